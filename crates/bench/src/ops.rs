//! The operations [`crate::overhead`] times, each in a process of its own (`pageone-bench
//! overhead-child --spec JSON`; under pageone, with the `LD_PRELOAD` shim, so that every call
//! below goes through it as a program's would).
//!
//! Memory is mapped and advised with the C library's `mmap` and `madvise` (which the shim
//! interposes), and marked `MADV_MERGEABLE` on every side: "plain" is the same program with KSM
//! not running. A "merged region" holds two identical halves (easy seed data), so that all of it
//! can merge; the process waits until it has (by `/proc/self/maps`: pages in file mappings, the
//! store's, plus `/proc/self/ksm_stat`'s merged pages), or the merge timeout.

use std::io::Write;
use std::time::{Duration, Instant};

use pageone_seed::{fill_page, Data};

use crate::latency::{Histogram, Sparse};
use crate::procfs;
use pageone_sys::monotonic_ns;

const PAGE: usize = 4096;
/// The word written by the CoW-break and stall writes (zero in the seed data).
const MARK_WORD: usize = 2048;
const MARK: u64 = 0x5EED_F00D_u64;

/// What is timed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Op {
    /// The first write to each page of fresh memory.
    FirstTouch,
    /// The same while another thread of the program runs on another CPU (a vCPU, a worker): a
    /// first touch that replaces a mapped page (the zero page) then costs a TLB shootdown there.
    FirstTouchBusy,
    /// The first read of each page of a merged region.
    ReadMerged,
    /// The first write to each page of a merged region (copy-on-write break).
    WriteMerged,
    /// The same while another thread of the program runs on another CPU: replacing the merged
    /// page's entry then costs a TLB shootdown there, whoever merged it (as it does while an
    /// engine thread of pageone's runs).
    WriteMergedBusy,
    /// `munmap` of a whole merged region.
    Munmap,
    /// `madvise(MADV_UNMERGEABLE)` of a whole merged region: every page private again.
    Unmerge,
    /// The same where the second half holds the first half's pages in another order, so that
    /// its pages merge one by one (single pages, as scattered duplicates do).
    UnmergeScattered,
    /// `MADV_DONTNEED` of a few pages of a merged region, at spread places.
    Dontneed,
    /// The same on a region whose pages are all different (nothing merged: memory a program
    /// gives back, as allocators and balloons do), once watched for a while.
    DontneedUnmerged,
    /// `MADV_FREE` of the same.
    Free,
    /// `mprotect(PROT_READ)` of the same.
    Mprotect,
    /// `fork` of a process with a merged region (the child exits at once).
    Fork,
    /// The exit of a process with a merged region, until its parent has reaped it.
    Exit,
    /// Writer threads writing random pages of a merged region while it keeps merging, with busy
    /// threads on every CPU: the latency of each write.
    WriteStall,
    /// Random 8-byte reads of a region on transparent huge pages (advised `MADV_HUGEPAGE`
    /// before `MADV_MERGEABLE`, as QEMU does with guest RAM) whose pages are all different, read
    /// after the program wrote it a second time and it settled: the cost of the TLB misses where
    /// its huge pages were split.
    HugeRead,
}

impl Op {
    pub const ALL: [Op; 16] = [
        Op::FirstTouch,
        Op::FirstTouchBusy,
        Op::ReadMerged,
        Op::WriteMerged,
        Op::WriteMergedBusy,
        Op::Munmap,
        Op::Unmerge,
        Op::UnmergeScattered,
        Op::Dontneed,
        Op::DontneedUnmerged,
        Op::Free,
        Op::Mprotect,
        Op::Fork,
        Op::Exit,
        Op::WriteStall,
        Op::HugeRead,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Op::FirstTouch => "first-touch",
            Op::FirstTouchBusy => "first-touch-busy",
            Op::ReadMerged => "read-merged",
            Op::WriteMerged => "write-merged",
            Op::WriteMergedBusy => "write-merged-busy",
            Op::Munmap => "munmap",
            Op::Unmerge => "unmerge",
            Op::UnmergeScattered => "unmerge-scattered",
            Op::Dontneed => "dontneed",
            Op::DontneedUnmerged => "dontneed-unmerged",
            Op::Free => "free",
            Op::Mprotect => "mprotect",
            Op::Fork => "fork",
            Op::Exit => "exit",
            Op::WriteStall => "write-stall",
            Op::HugeRead => "huge-read",
        }
    }
}

/// Who merges.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Side {
    /// `MADV_MERGEABLE` with KSM not running.
    Plain,
    /// KSM at its fastest.
    Ksm,
    /// pageone's `LD_PRELOAD` shim.
    Pageone,
}

impl Side {
    pub fn name(self) -> &'static str {
        match self {
            Side::Plain => "plain",
            Side::Ksm => "ksm",
            Side::Pageone => "pageone",
        }
    }
}

/// The writers of [`Op::WriteStall`].
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct Stall {
    pub writers: usize,
    pub seconds: f64,
    /// Each writer's pause between two writes (busy-waited), in microseconds.
    pub pause_us: f64,
}

/// One timed operation in one process.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct OpSpec {
    pub op: Op,
    pub side: Side,
    pub pages: usize,
    /// Calls of the partial operations and forks, and pages per partial call.
    pub calls: usize,
    pub call_pages: usize,
    pub merge_timeout_ms: u64,
    pub stall: Stall,
}

/// What the process measured.
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct OpOutput {
    pub pages: usize,
    /// Pages merged when the operation began (of `pages`).
    pub merged_pages: u64,
    /// [`Op::WriteStall`]: pages merged when the writers stopped.
    pub merged_pages_after: Option<u64>,
    pub merge_seconds: f64,
    /// Nanoseconds per page (for a call: its time over its pages).
    pub per_page: Sparse,
    /// Nanoseconds per call, for operations made of calls.
    pub per_call: Option<Sparse>,
    /// Pages that did not hold what the program expected afterwards.
    pub wrong_pages: u64,
    /// Whether `libpageone_preload.so` is mapped in the process.
    pub preloaded: bool,
    /// [`Op::Exit`]: the monotonic clock just before exiting.
    pub exit_t0_ns: Option<u64>,
    /// [`Op::HugeRead`]: pages mapped by huge pages when the reads began.
    #[serde(default)]
    pub huge_pages: Option<u64>,
}

/// Maps `pages` fresh pages through the C library (which the shim sees).
fn map(pages: usize) -> std::io::Result<*mut u8> {
    // SAFETY: a fresh anonymous mapping at an address of the kernel's choice aliases nothing.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            pages * PAGE,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error());
    }
    Ok(p.cast())
}

fn advise(p: *mut u8, pages: usize, advice: libc::c_int) -> std::io::Result<()> {
    // SAFETY: the range is the caller's mapping; the advices used here keep or zero contents as
    // the caller expects.
    if unsafe { libc::madvise(p.cast(), pages * PAGE, advice) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Pages of `[p, p + pages)` merged: in file mappings (the store's) and not copied since (a
/// present page of a file mapping that is not a file page is the program's private copy, by
/// `/proc/self/pagemap`), plus the process's KSM pages.
fn merged_pages(p: *mut u8, pages: usize) -> u64 {
    const PRESENT: u64 = 1 << 63;
    const FILE_PAGE: u64 = 1 << 61;
    let (lo, hi) = (p as usize, p as usize + pages * PAGE);
    let pagemap = pageone_sys::Pagemap::open().ok();
    let mut merged = 0u64;
    let mut entries = Vec::new();
    for m in pageone_sys::self_mappings().unwrap_or_default() {
        if m.inode == 0 || m.start >= hi || m.end <= lo {
            continue;
        }
        let (a, b) = (m.start.max(lo), m.end.min(hi));
        entries.clear();
        let copied = match &pagemap {
            Some(pm) if pm.entries(a, (b - a) / PAGE, &mut entries).is_ok() => entries
                .iter()
                .filter(|&&e| e & PRESENT != 0 && e & FILE_PAGE == 0)
                .count(),
            _ => 0,
        };
        merged += ((b - a) / PAGE - copied) as u64;
    }
    merged + procfs::ksm_merging_pages(std::process::id())
}

/// How the pages of a region repeat.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Layout {
    /// Two halves holding the same pages in the same order.
    Halves,
    /// Two halves holding the same pages, the second in an order of its own, where no two
    /// neighbours of the first half are neighbours.
    Scattered,
    /// Every page different.
    Distinct,
}

impl Layout {
    fn of(op: Op) -> Self {
        match op {
            Op::UnmergeScattered => Layout::Scattered,
            Op::DontneedUnmerged => Layout::Distinct,
            _ => Layout::Halves,
        }
    }
}

/// The content page `i` of a region of `pages` pages holds.
fn content(i: usize, pages: usize, layout: Layout) -> u64 {
    let half = (pages / 2).max(1);
    let k = i % half;
    if layout == Layout::Distinct {
        return (pages + i) as u64;
    }
    if layout == Layout::Halves || i < half {
        return k as u64;
    }
    // An odd multiplier permutes the residues of a power of two; other halves keep their order
    // past the largest power of two below them.
    let pow = 1usize << half.ilog2();
    if k >= pow {
        return k as u64;
    }
    (k.wrapping_mul(0x9E37) % pow) as u64
}

fn expected(i: usize, pages: usize, layout: Layout, mark: bool) -> [u8; PAGE] {
    let mut want = [0u8; PAGE];
    // SAFETY: `want` is a local page of zeros.
    unsafe { fill_page(want.as_mut_ptr(), Data::Easy, content(i, pages, layout)) };
    if mark {
        want[MARK_WORD..MARK_WORD + 8].copy_from_slice(&MARK.to_ne_bytes());
    }
    want
}

fn read_page(p: *const u8) -> [u8; PAGE] {
    let mut got = [0u8; PAGE];
    // SAFETY: the caller's mapped page; only this thread touches the region now.
    unsafe { std::ptr::copy_nonoverlapping(p, got.as_mut_ptr(), PAGE) };
    got
}

/// A merged region: mapped, filled, advised mergeable, and (except plain) waited on until it
/// merged. Unmapped when dropped unless taken.
struct Merged {
    p: *mut u8,
    pages: usize,
    layout: Layout,
    merged: u64,
    seconds: f64,
}

impl Merged {
    fn new(s: &OpSpec) -> std::io::Result<Self> {
        let p = map(s.pages)?;
        let layout = Layout::of(s.op);
        for i in 0..s.pages {
            // SAFETY: page i of the fresh mapping, zero.
            unsafe { fill_page(p.add(i * PAGE), Data::Easy, content(i, s.pages, layout)) };
        }
        advise(p, s.pages, libc::MADV_MERGEABLE)?;
        let t0 = Instant::now();
        let mut m = Self {
            p,
            pages: s.pages,
            layout,
            merged: 0,
            seconds: 0.0,
        };
        if layout == Layout::Distinct {
            // Nothing to merge: watched for a while (every side alike), as memory a program
            // gives back has been.
            std::thread::sleep(Duration::from_millis(500));
        } else if s.side != Side::Plain {
            let timeout = Duration::from_millis(s.merge_timeout_ms);
            let (mut best, mut since) = (0, Instant::now());
            while t0.elapsed() < timeout {
                m.merged = merged_pages(p, s.pages);
                if m.merged >= s.pages as u64 * 99 / 100 {
                    break;
                }
                if m.merged > best {
                    (best, since) = (m.merged, Instant::now());
                } else if best > 0 && since.elapsed() > Duration::from_secs(5) {
                    break; // stopped growing
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        m.seconds = t0.elapsed().as_secs_f64();
        Ok(m)
    }

    fn page(&self, i: usize) -> *mut u8 {
        // SAFETY: i < pages, inside the mapping.
        unsafe { self.p.add(i * PAGE) }
    }

    /// Pages not holding their content (with the mark if `mark`), among `range`.
    fn wrong(&self, range: std::ops::Range<usize>, mark: bool) -> u64 {
        range
            .filter(|&i| read_page(self.page(i)) != expected(i, self.pages, self.layout, mark))
            .count() as u64
    }

    /// Gives the mapping up without unmapping it (it was unmapped by the operation).
    fn forget(self) {
        std::mem::forget(self);
    }
}

impl Drop for Merged {
    fn drop(&mut self) {
        // SAFETY: mapped in `new`; no reference into it outlives self.
        unsafe { libc::munmap(self.p.cast(), self.pages * PAGE) };
    }
}

fn timed(f: impl FnOnce()) -> u64 {
    let t = Instant::now();
    f();
    t.elapsed().as_nanos() as u64
}

/// The first pages of the partial calls: `calls` places spread over the region.
fn call_starts(s: &OpSpec) -> Vec<usize> {
    let stride = (s.pages / s.calls.max(1)).max(s.call_pages);
    (0..s.calls)
        .map(|k| k * stride)
        .filter(|&i| i + s.call_pages <= s.pages)
        .collect()
}

/// Runs the operation and prints its [`OpOutput`] as one JSON line (for [`Op::Exit`], then
/// exits the process).
pub fn child(s: &OpSpec) -> std::io::Result<()> {
    let mut out = OpOutput {
        pages: s.pages,
        preloaded: std::fs::read_to_string("/proc/self/maps")?.contains("libpageone_preload"),
        ..OpOutput::default()
    };
    let (mut per_page, mut per_call) = (Histogram::default(), Histogram::default());
    if s.op == Op::FirstTouch {
        first_touch(s, &mut out, &mut per_page)?;
    } else if s.op == Op::FirstTouchBusy {
        with_a_busy_thread(|| first_touch(s, &mut out, &mut per_page))?;
    } else if s.op == Op::HugeRead {
        huge_read(s, &mut out, &mut per_page)?;
    } else {
        let m = Merged::new(s)?;
        (out.merged_pages, out.merge_seconds) = (m.merged, m.seconds);
        match s.op {
            Op::ReadMerged | Op::WriteMerged => touch_merged(s, m, &mut out, &mut per_page),
            Op::WriteMergedBusy => {
                // ksmd at its fastest keeps the other CPU busy in the kernel, where the busy
                // thread would run: paused while the writes are timed (merged pages stay merged),
                // so that the thread runs there as it does on the other sides.
                let _paused = (s.side == Side::Ksm).then(KsmPaused::new).transpose()?;
                with_a_busy_thread(|| touch_merged(s, m, &mut out, &mut per_page));
            }
            Op::WriteStall => stall(s, m, &mut out, &mut per_page),
            Op::Exit => {
                m.forget(); // the exit takes it down
                out.exit_t0_ns = Some(monotonic_ns());
                emit(&out)?;
                std::process::exit(0);
            }
            _ => calls(s, m, &mut out, &mut per_page, &mut per_call)?,
        }
    }
    out.per_page = per_page.to_sparse();
    if per_call.count() > 0 {
        out.per_call = Some(per_call.to_sparse());
    }
    emit(&out)
}

/// `ksmd` paused (`run` = 0, which leaves merged pages merged) until dropped.
struct KsmPaused;

impl KsmPaused {
    fn new() -> std::io::Result<Self> {
        crate::ksm::write("run", 0)?;
        Ok(KsmPaused)
    }
}

impl Drop for KsmPaused {
    fn drop(&mut self) {
        let _ = crate::ksm::write("run", 1);
    }
}

/// Runs `f` while a thread of the program spins (on the other CPU, as the scheduler places it),
/// stopped once `f` returns.
fn with_a_busy_thread<T>(f: impl FnOnce() -> T) -> T {
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let spinner = {
        let stop = stop.clone();
        // Relaxed: a stop flag only.
        std::thread::spawn(move || {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                std::hint::spin_loop();
            }
        })
    };
    std::thread::sleep(Duration::from_millis(50));
    let r = f();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    spinner.join().expect("the spinning thread");
    r
}

fn emit(out: &OpOutput) -> std::io::Result<()> {
    let mut o = std::io::stdout().lock();
    writeln!(o, "{}", serde_json::to_string(out).expect("JSON"))?;
    o.flush()
}

fn first_touch(s: &OpSpec, out: &mut OpOutput, h: &mut Histogram) -> std::io::Result<()> {
    let p = map(s.pages)?;
    advise(p, s.pages, libc::MADV_MERGEABLE)?;
    for i in 0..s.pages {
        // SAFETY: page i of the mapping made above, only this thread touches it.
        h.record(timed(|| unsafe {
            std::ptr::write_volatile(p.add(i * PAGE).cast::<u64>(), i as u64 + 1)
        }));
    }
    for i in 0..s.pages {
        let got = read_page(p.wrapping_add(i * PAGE));
        let ok = got[..8] == (i as u64 + 1).to_ne_bytes() && got[8..].iter().all(|&b| b == 0);
        out.wrong_pages += u64::from(!ok);
    }
    // SAFETY: mapped above, no reference into it.
    unsafe { libc::munmap(p.cast(), s.pages * PAGE) };
    Ok(())
}

/// [`Op::HugeRead`]: maps a 2 MiB-aligned region advised `MADV_HUGEPAGE`, fills it with pages of
/// their own, makes it mergeable, lets it settle, writes a word of every page, lets it settle
/// again, then times batches of dependent random reads (one sample per batch: ns per read).
fn huge_read(s: &OpSpec, out: &mut OpOutput, h: &mut Histogram) -> std::io::Result<()> {
    const HUGE: usize = 2 << 20;
    const BATCHES: usize = 32;
    const READS: usize = 1 << 20;
    let settle = Duration::from_secs(3);
    let pages = s.pages / (HUGE / PAGE) * (HUGE / PAGE);
    let raw = map(pages + HUGE / PAGE)?;
    let p = (raw as usize).next_multiple_of(HUGE) as *mut u8;
    let seed = |i: usize| 1_000_000 + i as u64;
    advise(p, pages, libc::MADV_HUGEPAGE)?;
    for i in 0..pages {
        // SAFETY: page i of the fresh mapping, zero.
        unsafe { fill_page(p.add(i * PAGE), Data::Easy, seed(i)) };
    }
    advise(p, pages, libc::MADV_MERGEABLE)?;
    std::thread::sleep(settle);
    for i in 0..pages {
        // SAFETY: a word of page i, which only this thread touches.
        unsafe { std::ptr::write_volatile(p.add(i * PAGE + MARK_WORD).cast::<u64>(), MARK) };
    }
    std::thread::sleep(settle);
    out.huge_pages = pageone_sys::Pagemap::open()
        .and_then(|pm| pm.count_pages(p as usize, pages, pageone_sys::uapi::PAGE_IS_HUGE))
        .ok()
        .map(|n| n as u64);
    let words = pages * PAGE / 8;
    let (mut x, mut sink) = (0x9E37_79B9_7F4A_7C15u64, 0u64);
    for _ in 0..BATCHES {
        let ns = timed(|| {
            for _ in 0..READS {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                // SAFETY: a word inside the region, which only this thread touches.
                let v = unsafe { std::ptr::read_volatile(p.cast::<u64>().add(x as usize % words)) };
                // The next address depends on the word read: one miss at a time, as a program
                // following pointers takes them, so a TLB miss costs what it costs.
                x ^= v & 0xFFFF;
                sink = sink.wrapping_add(v);
            }
        });
        h.record(ns / READS as u64);
    }
    std::hint::black_box(sink);
    for i in 0..pages {
        let mut want = [0u8; PAGE];
        // SAFETY: `want` is a local page of zeros.
        unsafe { fill_page(want.as_mut_ptr(), Data::Easy, seed(i)) };
        want[MARK_WORD..MARK_WORD + 8].copy_from_slice(&MARK.to_ne_bytes());
        out.wrong_pages += u64::from(read_page(p.wrapping_add(i * PAGE)) != want);
    }
    // SAFETY: mapped above, no reference into it.
    unsafe { libc::munmap(raw.cast(), (pages + HUGE / PAGE) * PAGE) };
    Ok(())
}

fn touch_merged(s: &OpSpec, m: Merged, out: &mut OpOutput, h: &mut Histogram) {
    let write = s.op != Op::ReadMerged;
    let mut sink = 0u64;
    for i in 0..s.pages {
        let at = m.page(i).wrapping_add(MARK_WORD).cast::<u64>();
        h.record(timed(|| {
            if write {
                // SAFETY: a word of the region, which only this thread touches.
                unsafe { std::ptr::write_volatile(at, MARK) };
            } else {
                // SAFETY: as above.
                sink = sink.wrapping_add(unsafe { std::ptr::read_volatile(at) });
            }
        }));
    }
    std::hint::black_box(sink);
    out.wrong_pages = m.wrong(0..s.pages, write);
}

/// The operations made of calls: munmap, the partial ones, fork.
fn calls(
    s: &OpSpec,
    m: Merged,
    out: &mut OpOutput,
    per_page: &mut Histogram,
    per_call: &mut Histogram,
) -> std::io::Result<()> {
    let mut record = |ns: u64, pages: usize| {
        per_call.record(ns);
        per_page.record(ns / pages.max(1) as u64);
    };
    match s.op {
        Op::Munmap => {
            let ns = timed(|| {
                // SAFETY: the region's whole mapping; nothing refers into it afterwards
                // (forgotten below).
                unsafe { libc::munmap(m.p.cast(), s.pages * PAGE) };
            });
            record(ns, s.pages);
            m.forget();
            return Ok(());
        }
        Op::Unmerge | Op::UnmergeScattered => {
            // SAFETY: the region's whole mapping; its contents are kept (checked below).
            let ns = timed(|| unsafe {
                libc::madvise(m.p.cast(), s.pages * PAGE, libc::MADV_UNMERGEABLE);
            });
            record(ns, s.pages);
            out.wrong_pages = m.wrong(0..s.pages, false);
            return Ok(());
        }
        Op::Fork => {
            for _ in 0..s.calls {
                let mut pid = 0;
                // SAFETY: the child only calls _exit, which is async-signal-safe.
                let ns = timed(|| pid = unsafe { libc::fork() });
                if pid == 0 {
                    // SAFETY: ends the child at once, running nothing of the parent's.
                    unsafe { libc::_exit(0) };
                }
                if pid < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                record(ns, s.pages);
                // SAFETY: reaps the child just made.
                unsafe { libc::waitpid(pid, std::ptr::null_mut(), 0) };
            }
            out.wrong_pages = m.wrong(0..s.pages, false);
            return Ok(());
        }
        _ => {}
    }
    let starts = call_starts(s);
    for &i in &starts {
        let (p, len) = (m.page(i), s.call_pages * PAGE);
        // SAFETY: a part of the region, which nothing reads meanwhile; DONTNEED and FREE zero it
        // (or, FREE, keep it), mprotect keeps it readable: checked below.
        let r = timed(|| unsafe {
            match s.op {
                Op::Dontneed | Op::DontneedUnmerged => {
                    libc::madvise(p.cast(), len, libc::MADV_DONTNEED)
                }
                Op::Free => libc::madvise(p.cast(), len, libc::MADV_FREE),
                _ => libc::mprotect(p.cast(), len, libc::PROT_READ),
            };
        });
        record(r, s.call_pages);
    }
    let zero = [0u8; PAGE];
    for i in 0..s.pages {
        let hit = starts.iter().any(|&k| (k..k + s.call_pages).contains(&i));
        let got = read_page(m.page(i));
        let ok = match (s.op, hit) {
            (Op::Dontneed | Op::DontneedUnmerged, true) => got == zero,
            (Op::Free, true) => got == zero || got == expected(i, s.pages, m.layout, false),
            _ => got == expected(i, s.pages, m.layout, false),
        };
        out.wrong_pages += u64::from(!ok);
    }
    Ok(())
}

/// Writers hammer random pages of the merged region (writing the word the page already holds,
/// so it stays mergeable and keeps being merged again) for the stall's seconds.
fn stall(s: &OpSpec, m: Merged, out: &mut OpOutput, h: &mut Histogram) {
    let base = m.p as usize;
    let pages = s.pages;
    let end = Instant::now() + Duration::from_secs_f64(s.stall.seconds);
    let pause = Duration::from_secs_f64(s.stall.pause_us / 1e6);
    let threads: Vec<_> = (0..s.stall.writers)
        .map(|w| {
            std::thread::spawn(move || {
                let mut h = Histogram::default();
                let mut x = 0x9E37_79B9_7F4A_7C15u64 ^ (w as u64 + 1);
                while Instant::now() < end {
                    // xorshift64
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    let at = (base + (x as usize % pages) * PAGE + MARK_WORD) as *mut u64;
                    // SAFETY: a word of the region (mapped until the writers are joined), zero
                    // in the seed data; every writer writes zero there, so no write is lost.
                    h.record(timed(|| unsafe { std::ptr::write_volatile(at, 0) }));
                    let t = Instant::now();
                    while t.elapsed() < pause {
                        std::hint::spin_loop();
                    }
                }
                h
            })
        })
        .collect();
    for t in threads {
        h.merge(&t.join().expect("a writer thread"));
    }
    out.merged_pages_after = Some(merged_pages(m.p, pages));
    out.wrong_pages = m.wrong(0..pages, false);
}
