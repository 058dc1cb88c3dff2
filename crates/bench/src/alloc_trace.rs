//! One alloc/free trace replayed against several allocators: glibc's malloc, jemalloc and
//! mimalloc with their default decay (the same calls, the library preloaded into a child process
//! by the caller), and [`PprHeap`](crate::ppr_heap::PprHeap), whose large frees are marked for PPR.
//!
//! The trace follows the seed's density workload, scaled down: phases of one second in which a
//! program allocates up to a target (usually a sixteenth to a quarter of the peak, one phase in
//! eight the peak itself), writes every page, holds the memory, frees it, and idles; a long-lived
//! set of blocks stays across phases with some turnover. Sizes are drawn from 16 B to 4 MiB.
//! Pauses end at fixed times from the start, so every allocator runs the same wall time.
//!
//! Measured: the latency of each `free` (TSC cycles, converted with the run's own calibration),
//! excess resident memory (the process's RSS above its RSS before the trace and above the bytes
//! the program holds) integrated over time in GiB·s, and the process's CPU time (less the
//! sampler thread's).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};

const PAGE: usize = 4096;

/// Shape of a trace.
#[derive(Clone, Copy, Debug, serde::Serialize, serde::Deserialize)]
pub struct TraceParams {
    pub seed: u64,
    pub phases: usize,
    /// The largest phase's allocations, in MiB.
    pub peak_mib: usize,
    /// Each phase: time its memory is held, then time idle after the frees.
    pub hold_ms: u64,
    pub idle_ms: u64,
    /// Time measured after the last phase.
    pub tail_ms: u64,
}

impl Default for TraceParams {
    fn default() -> Self {
        Self {
            seed: 29,
            phases: 12,
            peak_mib: 256,
            hold_ms: 300,
            idle_ms: 700,
            tail_ms: 2000,
        }
    }
}

/// One step of a trace. Block ids are indices into the replay's table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Alloc {
        id: u32,
        size: usize,
    },
    Free {
        id: u32,
    },
    /// Wait until this many milliseconds after the start.
    Pause {
        at_ms: u64,
    },
}

/// A block size: 60% small (16 B–4 KiB), 30% medium (to 64 KiB), 10% large (to 4 MiB), each
/// log-uniform.
fn size(rng: &mut impl Rng) -> usize {
    let (lo, hi): (f64, f64) = match rng.gen_range(0..10) {
        0..=5 => (16.0, 4096.0),
        6..=8 => (4096.0, 65536.0),
        _ => (65536.0, 4194304.0),
    };
    (lo.ln() + rng.gen::<f64>() * (hi.ln() - lo.ln())).exp() as usize
}

/// The trace for `p` (the same for the same parameters).
pub fn generate(p: &TraceParams) -> Vec<Op> {
    let mut rng = rand::rngs::SmallRng::seed_from_u64(p.seed);
    let peak = p.peak_mib << 20;
    let mut ops = Vec::new();
    let mut next = 0u32;
    let mut alloc = |ops: &mut Vec<Op>, rng: &mut rand::rngs::SmallRng| {
        let s = size(rng);
        ops.push(Op::Alloc { id: next, size: s });
        next += 1;
        (next - 1, s)
    };
    // The long-lived set: a sixteenth of the peak.
    let mut long: Vec<(u32, usize)> = Vec::new();
    let mut long_bytes = 0;
    while long_bytes < peak / 16 {
        let b = alloc(&mut ops, &mut rng);
        long_bytes += b.1;
        long.push(b);
    }
    let phase_ms = p.hold_ms + p.idle_ms;
    for k in 0..p.phases {
        // Phase 1 is always a peak, so that every trace has one early.
        let target = if k == 1 || rng.gen_range(0..8) == 0 {
            peak
        } else {
            (peak as f64 * rng.gen_range(1.0 / 16.0..0.25)) as usize
        };
        let mut mine = Vec::new();
        let mut bytes = 0;
        while bytes < target {
            let b = alloc(&mut ops, &mut rng);
            bytes += b.1;
            mine.push(b.0);
        }
        // A tenth of the long-lived set turns over.
        for _ in 0..long.len() / 10 {
            let i = rng.gen_range(0..long.len());
            ops.push(Op::Free { id: long[i].0 });
            long[i] = alloc(&mut ops, &mut rng);
        }
        let start = k as u64 * phase_ms;
        ops.push(Op::Pause {
            at_ms: start + p.hold_ms,
        });
        // Freed in an order of their own.
        for i in (1..mine.len()).rev() {
            mine.swap(i, rng.gen_range(0..=i));
        }
        ops.extend(mine.into_iter().map(|id| Op::Free { id }));
        ops.push(Op::Pause {
            at_ms: start + phase_ms,
        });
    }
    ops.push(Op::Pause {
        at_ms: p.phases as u64 * phase_ms + p.tail_ms,
    });
    ops.extend(long.into_iter().map(|(id, _)| Op::Free { id }));
    ops
}

/// What a trace is replayed against.
pub trait Heap {
    fn alloc(&self, size: usize) -> *mut u8;
    /// # Safety
    /// `p` came from `alloc(size)` of this heap and is not used afterwards.
    unsafe fn free(&self, p: *mut u8, size: usize);
}

/// The C library's `malloc` and `free`: glibc's, or whatever allocator is preloaded.
pub struct Malloc;

impl Heap for Malloc {
    fn alloc(&self, size: usize) -> *mut u8 {
        // SAFETY: malloc has no preconditions.
        unsafe { libc::malloc(size) }.cast()
    }
    unsafe fn free(&self, p: *mut u8, _size: usize) {
        // SAFETY: from malloc above, per the caller.
        unsafe { libc::free(p.cast()) }
    }
}

fn layout(size: usize) -> std::alloc::Layout {
    // 16: what malloc guarantees too.
    std::alloc::Layout::from_size_align(size.max(1), 16).expect("a block size fits a layout")
}

impl Heap for crate::ppr_heap::PprHeap {
    fn alloc(&self, size: usize) -> *mut u8 {
        // SAFETY: a non-zero layout.
        unsafe { std::alloc::GlobalAlloc::alloc(self, layout(size)) }
    }
    unsafe fn free(&self, p: *mut u8, size: usize) {
        // SAFETY: from `alloc` above with the same layout, per the caller.
        unsafe { std::alloc::GlobalAlloc::dealloc(self, p, layout(size)) }
    }
}

/// One replay's figures.
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct TraceResult {
    pub heap: String,
    pub allocs: u64,
    pub frees: u64,
    pub free_ns_mean: f64,
    pub free_ns_p50: f64,
    pub free_ns_p99: f64,
    /// RSS above the start and above the bytes held, integrated over the run.
    pub excess_gib_s: f64,
    pub excess_peak_mib: f64,
    /// The bytes held, integrated over the run (what the program needed).
    pub live_gib_s: f64,
    /// The process's CPU (every thread but the sampler's), and the run's wall time.
    pub cpu_s: f64,
    pub wall_s: f64,
    /// CPU seconds by thread name over the whole process life (the replaying thread is
    /// `main`), where it went.
    #[serde(default)]
    pub thread_cpu_s: Vec<(String, f64)>,
}

fn rss_bytes() -> usize {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<usize>().ok())
        .map_or(0, |p| p * PAGE)
}

fn process_cpu_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: ts is a live timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Excess resident memory over time, sampled every `every` by a thread of its own.
struct Sampler {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<(f64, f64, f64, u64)>,
}

impl Sampler {
    fn start(live: Arc<AtomicUsize>, every: Duration) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let base = rss_bytes();
        let thread = std::thread::spawn(move || {
            let clock = pageone_sys::CpuClock::current().ok();
            let (mut excess_s, mut live_s, mut peak) = (0.0, 0.0, 0.0f64);
            let mut last = Instant::now();
            // Relaxed: a flag polled each sample.
            while !s.load(Ordering::Relaxed) {
                std::thread::sleep(every);
                let now = Instant::now();
                let dt = now.duration_since(last).as_secs_f64();
                last = now;
                // Relaxed: a counter read for a sample.
                let l = live.load(Ordering::Relaxed) as f64;
                let e = (rss_bytes() as f64 - base as f64 - l).max(0.0);
                excess_s += e * dt;
                live_s += l * dt;
                peak = peak.max(e);
            }
            let gib = (1u64 << 30) as f64;
            (
                excess_s / gib,
                live_s / gib,
                peak / (1 << 20) as f64,
                clock.map_or(0, |c| c.ns()),
            )
        });
        Self { stop, thread }
    }

    /// (excess GiB·s, live GiB·s, peak excess MiB, the sampler's CPU ns).
    fn finish(self) -> (f64, f64, f64, u64) {
        // Relaxed: see `start`.
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().unwrap_or_default()
    }
}

fn cycles() -> u64 {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: RDTSC reads the time-stamp counter; it has no memory effects.
        unsafe { core::arch::x86_64::_rdtsc() }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        Instant::now().elapsed().as_nanos() as u64
    }
}

/// The value written at offset 64 of page `i` of block `id` (8 bytes at 0 for blocks under a
/// page plus 64 bytes).
fn stamp(id: u32, i: usize) -> u64 {
    ((id as u64) << 24 | i as u64) ^ 0x9e37_79b9_7f4a_7c15
}

fn write_block(p: *mut u8, id: u32, size: usize) {
    if size < 72 {
        return;
    }
    for (i, off) in (0..size - 72).step_by(PAGE).enumerate() {
        // SAFETY: off + 72 <= size: inside the block, which the replay owns.
        unsafe { p.add(off + 64).cast::<u64>().write_unaligned(stamp(id, i)) };
    }
}

fn block_intact(p: *mut u8, id: u32, size: usize) -> bool {
    size < 72
        || (0..size - 72).step_by(PAGE).enumerate().all(|(i, off)| {
            // SAFETY: as in `write_block`.
            let got = unsafe { p.add(off + 64).cast::<u64>().read_unaligned() };
            got == stamp(id, i)
        })
}

/// Replays `ops` against `heap`, named `name` in the result. Every block's pages are written
/// when allocated and checked before they are freed: a lost write fails the run.
pub fn replay(name: &str, ops: &[Op], heap: &dyn Heap) -> Result<TraceResult, String> {
    let ids = ops
        .iter()
        .filter_map(|o| match o {
            Op::Alloc { id, .. } => Some(*id as usize + 1),
            _ => None,
        })
        .max()
        .unwrap_or(0);
    let mut blocks: Vec<(usize, usize)> = vec![(0, 0); ids];
    let mut free_cycles = Vec::new();
    let live = Arc::new(AtomicUsize::new(0));
    let sampler = Sampler::start(live.clone(), Duration::from_millis(10));
    let (t0, c0, cpu0) = (Instant::now(), cycles(), process_cpu_ns());
    let mut allocs = 0;
    for op in ops {
        match *op {
            Op::Alloc { id, size } => {
                let p = heap.alloc(size);
                if p.is_null() {
                    return Err(format!("{name}: allocating {size} bytes failed"));
                }
                write_block(p, id, size);
                blocks[id as usize] = (p as usize, size);
                allocs += 1;
                // Relaxed: a counter for the sampler.
                live.fetch_add(size, Ordering::Relaxed);
            }
            Op::Free { id } => {
                let (p, size) = std::mem::take(&mut blocks[id as usize]);
                if !block_intact(p as *mut u8, id, size) {
                    return Err(format!("{name}: block {id} lost a write before its free"));
                }
                let c = cycles();
                // SAFETY: allocated by this replay with `size`, freed once (taken from the table).
                unsafe { heap.free(p as *mut u8, size) };
                free_cycles.push(cycles() - c);
                // Relaxed: as above.
                live.fetch_sub(size, Ordering::Relaxed);
            }
            Op::Pause { at_ms } => {
                let at = t0 + Duration::from_millis(at_ms);
                if let Some(d) = at.checked_duration_since(Instant::now()) {
                    std::thread::sleep(d);
                }
            }
        }
    }
    let (wall, c1, cpu1) = (t0.elapsed(), cycles(), process_cpu_ns());
    let (excess_gib_s, live_gib_s, excess_peak_mib, sampler_ns) = sampler.finish();
    let ns_per_cycle = wall.as_nanos() as f64 / (c1 - c0).max(1) as f64;
    free_cycles.sort_unstable();
    let pct = |q: f64| {
        free_cycles
            .get(((free_cycles.len() as f64 - 1.0) * q) as usize)
            .map_or(0.0, |&c| c as f64 * ns_per_cycle)
    };
    let total: u64 = free_cycles.iter().sum();
    Ok(TraceResult {
        heap: name.into(),
        allocs,
        frees: free_cycles.len() as u64,
        free_ns_mean: total as f64 * ns_per_cycle / free_cycles.len().max(1) as f64,
        free_ns_p50: pct(0.5),
        free_ns_p99: pct(0.99),
        excess_gib_s,
        excess_peak_mib,
        live_gib_s,
        cpu_s: (cpu1 - cpu0).saturating_sub(sampler_ns) as f64 / 1e9,
        wall_s: wall.as_secs_f64(),
        thread_cpu_s: thread_cpu(),
    })
}

/// CPU seconds of this process's live threads, summed by name, largest first.
fn thread_cpu() -> Vec<(String, f64)> {
    let mut by: Vec<(String, f64)> = Vec::new();
    let tasks = std::fs::read_dir("/proc/self/task")
        .into_iter()
        .flatten()
        .flatten();
    for t in tasks {
        let Ok(stat) = std::fs::read_to_string(t.path().join("stat")) else {
            continue;
        };
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
            continue;
        };
        let name = stat[open + 1..close].to_string();
        let f: Vec<&str> = stat[close + 1..].split_whitespace().collect();
        let ticks: u64 = [11, 12]
            .iter()
            .filter_map(|&i| f.get(i)?.parse::<u64>().ok())
            .sum();
        // SAFETY: sysconf has no preconditions.
        let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
        match by.iter_mut().find(|(n, _)| *n == name) {
            Some(e) => e.1 += ticks as f64 / hz,
            None => by.push((name, ticks as f64 / hz)),
        }
    }
    by.sort_by(|a, b| b.1.total_cmp(&a.1));
    by
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small() -> TraceParams {
        TraceParams {
            seed: 7,
            phases: 3,
            peak_mib: 8,
            hold_ms: 20,
            idle_ms: 30,
            tail_ms: 50,
        }
    }

    #[test]
    fn a_trace_frees_every_block_once_and_peaks_early() {
        let p = small();
        let ops = generate(&p);
        assert_eq!(ops, generate(&p), "the same parameters give the same trace");
        let mut live = std::collections::HashMap::new();
        let (mut bytes, mut peak_after_phase_1) = (0usize, 0usize);
        let mut pauses = 0;
        for op in &ops {
            match *op {
                Op::Alloc { id, size } => {
                    assert!((16..=4 << 20).contains(&size));
                    assert!(live.insert(id, size).is_none(), "id {id} reused");
                    bytes += size;
                }
                Op::Free { id } => bytes -= live.remove(&id).expect("freed once, after its alloc"),
                Op::Pause { .. } => {
                    pauses += 1;
                    if pauses == 3 {
                        peak_after_phase_1 = bytes;
                    }
                }
            }
        }
        assert!(live.is_empty());
        assert_eq!(pauses, 2 * p.phases + 1);
        // Phase 1 holds the peak (plus the long-lived set) at its first pause.
        assert!(peak_after_phase_1 >= 8 << 20, "{peak_after_phase_1}");
        let times: Vec<u64> = ops
            .iter()
            .filter_map(|o| match o {
                Op::Pause { at_ms } => Some(*at_ms),
                _ => None,
            })
            .collect();
        assert!(times.windows(2).all(|w| w[0] < w[1]));
        assert_eq!(*times.last().unwrap(), 3 * 50 + 50);
    }

    #[test]
    fn a_replay_with_malloc_measures_the_trace() {
        let ops = generate(&small());
        let r = replay("glibc", &ops, &Malloc).unwrap();
        assert_eq!(r.allocs, r.frees);
        assert!(r.allocs > 10);
        assert!(r.wall_s >= 0.2, "pauses are kept: {}", r.wall_s);
        assert!(r.live_gib_s > 0.0);
        assert!(r.free_ns_mean > 0.0 && r.free_ns_p99 >= r.free_ns_p50);
        assert!(r.cpu_s > 0.0);
        assert!(!r.thread_cpu_s.is_empty(), "at least the replaying thread");
    }

    #[test]
    fn a_lost_write_is_seen() {
        let p = Malloc.alloc(3 * PAGE);
        write_block(p, 0, 3 * PAGE);
        assert!(block_intact(p, 0, 3 * PAGE));
        // The second page's stamp changed between the alloc and the free.
        // SAFETY: inside the block.
        unsafe { p.add(PAGE + 64).write(0xff) };
        assert!(!block_intact(p, 0, 3 * PAGE));
        // SAFETY: from Malloc.alloc.
        unsafe { Malloc.free(p, 3 * PAGE) };
    }

    #[test]
    fn the_ppr_heap_replays_the_trace_intact() {
        let heap = crate::ppr_heap::PprHeap::new(crate::ppr_heap::PprHeapConfig {
            arena_bytes: 64 << 20,
            period: Duration::from_millis(20),
            workers: 1,
        })
        .unwrap();
        let r = replay("ppr", &generate(&small()), &heap).unwrap();
        assert_eq!(r.allocs, r.frees);
        assert!(heap.stats().marked > 0);
    }
}
