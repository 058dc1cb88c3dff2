//! Whole-engine benchmark: time and CPU to deduplicate identical regions, PageONE next to KSM.
//!
//! One process maps `regions` private anonymous regions of `region_mib` MiB each and fills them
//! with the same seed data (identical across regions, unique within): "easy" pages hold a random
//! 8-byte value at offset 0, "hard" pages the same at a random offset in 0..252 (mean 128 leading
//! zero bytes). The possible saving is `(regions - 1) * pages_per_region` pages. Each side is
//! timed from registration (`madvise(MADV_MERGEABLE)` for KSM) until it saves 99% of that, and its
//! CPU time is read from its own threads (`ksmd` for KSM, the engine's threads for PageONE).

use std::time::{Duration, Instant};

use pageone_engine::Engine;
use pageone_sys as sys;

use crate::ksm;

pub use pageone_seed::{fill_page, Data};

const PAGE: usize = 4096;

/// One measurement of one side.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Sample {
    pub side: &'static str,
    pub data: Data,
    /// Seconds from registration to 99% of the possible saving (None: not reached in time).
    pub seconds_to_99: Option<f64>,
    /// CPU-seconds spent by the side's threads until then.
    pub cpu_seconds: f64,
    /// Pages saved at the end (pages_sharing).
    pub pages_saved: u64,
    pub possible: u64,
    /// Host memory the merging gave back, by the kernel ([`HostMemory`] before registration
    /// minus after merging settled): the pages freed less everything the side spent to free them
    /// (its copies, heaps, page tables, VMAs; KSM's rmap items and stable nodes).
    pub memory_saved_kib: Option<i64>,
}

/// Host memory in use by processes and for them, in KiB, by `/proc/meminfo` field: anonymous
/// pages, shared memory (pageone's stores), page tables, and unreclaimable kernel objects (VMAs,
/// KSM's rmap items). Page cache and reclaimable slab are left out: they come and go with
/// whatever else the host does.
#[derive(Clone, Copy, Debug)]
pub struct HostMemory([i64; 4]);

const HOST_FIELDS: [&str; 4] = ["AnonPages", "Shmem", "PageTables", "SUnreclaim"];

impl HostMemory {
    pub fn now() -> Option<Self> {
        let mut v = [0; 4];
        for (x, f) in v.iter_mut().zip(HOST_FIELDS) {
            *x = sys::meminfo_kib(f).ok()? as i64;
        }
        Some(Self(v))
    }

    pub fn total(&self) -> i64 {
        self.0.iter().sum()
    }

    /// Per field, how much `self` is above `before`, as text (MiB).
    pub fn growth_since(&self, before: &Self) -> String {
        HOST_FIELDS
            .iter()
            .zip(self.0.iter().zip(before.0))
            .map(|(f, (a, b))| format!("{f} {:+.1}", (a - b) as f64 / 1024.0))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// After a side reached 99%: lets it finish (every page it can save, or `grace`), then waits
/// `frees` for memory it releases at period ends, and returns what [`HostMemory`] says was
/// saved since `before` (and prints where it went, per field, to stderr).
pub fn settle_memory(
    before: Option<HostMemory>,
    mut saved_pages: impl FnMut() -> u64,
    possible: u64,
    grace: Duration,
    frees: Duration,
) -> Option<i64> {
    let t0 = Instant::now();
    while saved_pages() < possible && t0.elapsed() < grace {
        std::thread::sleep(Duration::from_millis(10));
    }
    std::thread::sleep(frees);
    let (before, after) = (before?, HostMemory::now()?);
    eprintln!("    (host memory, MiB: {})", after.growth_since(&before));
    Some(before.total() - after.total())
}

/// How long a side may take past 99% to save the rest before memory is measured.
pub const SETTLE_GRACE: Duration = Duration::from_secs(2);

/// Benchmark parameters.
#[derive(Clone, Debug)]
pub struct Params {
    pub regions: usize,
    pub region_mib: usize,
    pub workers: usize,
    pub merge_period: Duration,
    pub timeout: Duration,
}

struct Regions {
    ptrs: Vec<*mut u8>,
    len: usize,
}

impl Regions {
    fn new(p: &Params, data: Data) -> std::io::Result<Self> {
        let len = p.region_mib << 20;
        let mut ptrs = Vec::new();
        for _ in 0..p.regions {
            let ptr = sys::mmap_anonymous(len)?;
            for i in 0..len / PAGE {
                // SAFETY: page i of a fresh private mapping of len bytes, owned here.
                unsafe { fill_page(ptr.add(i * PAGE), data, i as u64) };
            }
            ptrs.push(ptr);
        }
        Ok(Self { ptrs, len })
    }

    fn verify(&self, data: Data) -> bool {
        let mut want = [0u8; PAGE];
        for &ptr in &self.ptrs {
            for i in 0..self.len / PAGE {
                want.fill(0);
                // SAFETY: `want` is a local page.
                unsafe { fill_page(want.as_mut_ptr(), data, i as u64) };
                // SAFETY: the page is mapped and only this thread writes it (nobody here).
                let got = unsafe { std::slice::from_raw_parts(ptr.add(i * PAGE), PAGE) };
                if got != want {
                    return false;
                }
            }
        }
        true
    }
}

impl Drop for Regions {
    fn drop(&mut self) {
        for &p in &self.ptrs {
            // SAFETY: mapped in `new`, no reference outlives self.
            let _ = unsafe { sys::munmap(p, self.len) };
        }
    }
}

/// Measures KSM (`sleep_millisecs=0`, `pages_to_scan=100000`) on one data set.
pub fn run_ksm(p: &Params, data: Data) -> Result<Sample, String> {
    let session = ksm::KsmSession::new(0, 100_000).map_err(|e| format!("KSM knobs: {e}"))?;
    let regions = Regions::new(p, data).map_err(|e| e.to_string())?;
    let possible = ((p.regions - 1) * regions.len / PAGE) as u64;
    let mem0 = HostMemory::now();
    let cpu0 = ksm::ksmd_cpu_ns();
    let t0 = Instant::now();
    for &ptr in &regions.ptrs {
        // SAFETY: MADV_MERGEABLE does not change contents.
        unsafe { sys::madvise(ptr, regions.len, libc::MADV_MERGEABLE) }
            .map_err(|e| format!("MADV_MERGEABLE: {e}"))?;
    }
    session.start().map_err(|e| e.to_string())?;
    let target = possible * 99 / 100;
    let mut reached = None;
    while t0.elapsed() < p.timeout {
        if ksm::read("pages_sharing").unwrap_or(0) >= target {
            reached = Some(t0.elapsed().as_secs_f64());
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let cpu = (ksm::ksmd_cpu_ns() - cpu0) as f64 / 1e9;
    let memory_saved_kib = settle_memory(
        mem0,
        || ksm::read("pages_sharing").unwrap_or(0),
        possible,
        SETTLE_GRACE,
        2 * p.merge_period,
    );
    let saved = ksm::read("pages_sharing").unwrap_or(0);
    session.stop_and_unmerge().map_err(|e| e.to_string())?;
    if !regions.verify(data) {
        return Err("KSM run: data changed (this is a bug in the benchmark)".into());
    }
    Ok(Sample {
        side: "ksm",
        data,
        seconds_to_99: reached,
        cpu_seconds: cpu,
        pages_saved: saved,
        possible,
        memory_saved_kib,
    })
}

/// Measures PageONE with `p.workers` workers on one data set.
pub fn run_pageone(p: &Params, data: Data) -> Result<Sample, String> {
    let engine = Engine::builder()
        .workers(p.workers)
        .merge_period(p.merge_period)
        .build()
        .map_err(|e| format!("engine: {e}"))?;
    let regions = Regions::new(p, data).map_err(|e| e.to_string())?;
    let possible = ((p.regions - 1) * regions.len / PAGE) as u64;
    let mem0 = HostMemory::now();
    let cpu0 = engine.stats().worker_cpu_ns;
    let t0 = Instant::now();
    for &ptr in &regions.ptrs {
        engine
            .register(ptr, regions.len)
            .map_err(|e| format!("register: {e}"))?;
    }
    let target = possible * 99 / 100;
    let mut reached = None;
    while t0.elapsed() < p.timeout {
        if engine.stats().pages_sharing >= target {
            reached = Some(t0.elapsed().as_secs_f64());
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let cpu = (engine.stats().worker_cpu_ns - cpu0) as f64 / 1e9;
    let memory_saved_kib = settle_memory(
        mem0,
        || engine.stats().pages_sharing,
        possible,
        SETTLE_GRACE,
        2 * p.merge_period,
    );
    let s = engine.stats();
    if !regions.verify(data) {
        return Err("pageone run: data changed".into());
    }
    for &ptr in &regions.ptrs {
        let _ = engine.unregister(ptr, regions.len);
    }
    drop(engine);
    Ok(Sample {
        side: "pageone",
        data,
        seconds_to_99: reached,
        cpu_seconds: cpu,
        pages_saved: s.pages_sharing,
        possible,
        memory_saved_kib,
    })
}

/// The median of the samples' times (None if any run did not reach 99%).
pub fn median_time(samples: &[&Sample]) -> Option<f64> {
    let mut t: Vec<f64> = samples
        .iter()
        .map(|s| s.seconds_to_99)
        .collect::<Option<_>>()?;
    t.sort_by(f64::total_cmp);
    t.get(t.len() / 2).copied()
}

/// The median memory saved (KiB) of the samples that measured it.
pub fn median_memory_saved(samples: &[&Sample]) -> Option<i64> {
    let mut m: Vec<i64> = samples.iter().filter_map(|s| s.memory_saved_kib).collect();
    m.sort_unstable();
    m.get(m.len() / 2).copied()
}

/// The median CPU-seconds of the samples.
pub fn median_cpu(samples: &[&Sample]) -> f64 {
    let mut t: Vec<f64> = samples.iter().map(|s| s.cpu_seconds).collect();
    t.sort_by(f64::total_cmp);
    t.get(t.len() / 2).copied().unwrap_or(0.0)
}
