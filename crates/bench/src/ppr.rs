//! PPR against its baseline, `madvise(MADV_DONTNEED)` of each freed page: what marking a freed
//! page costs the program (cycles and nanoseconds per page), what taking the mark back costs,
//! and how soon the engine gives the memory back (seconds from the marks to the last release,
//! the engine's CPU, and the pages the kernel's page tables no longer hold).

use std::sync::Arc;
use std::time::{Duration, Instant};

use pageone_engine::recycler::Pool;
use pageone_engine::Engine;

const PAGE: usize = 4096;

/// One run's figures.
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct PprSample {
    pub pages: usize,
    /// Per page marked (`Pool::mark`), the page written since the watch last write-protected it
    /// (a page in use just before it is freed).
    pub mark_ns: f64,
    pub mark_cycles: f64,
    /// Per page marked while write-protected by the watch (unwritten for a period): the mark's
    /// first store takes the kernel's write-protect fault.
    pub mark_protected_ns: f64,
    pub mark_protected_cycles: f64,
    /// Per page unmarked before any recycling.
    pub unmark_ns: f64,
    /// Per page given back with one `madvise(MADV_DONTNEED)` each (the baseline).
    pub dontneed_ns: f64,
    pub dontneed_cycles: f64,
    /// From the marks to the last page released by the engine, and its CPU meanwhile.
    pub recycle_seconds: f64,
    pub recycle_cpu_seconds: f64,
    /// Pages of the region still holding memory after recycling: present in the page tables and
    /// not the shared zero page, which the engine maps over released pages (0: all given back).
    pub present_after: usize,
    /// What the engine's claim costs each period when nothing is marked, for a pool of
    /// [`IDLE_POOL_SLOTS`] slots (marks for 16 GiB of pages), in microseconds.
    pub idle_claim_us: f64,
}

/// Slots of the idle pool whose claim is timed.
pub const IDLE_POOL_SLOTS: usize = 1 << 22;

/// The median time of a claim on a pool of `slots` slots where nothing is marked (after one
/// page was marked, claimed and finished, so the pool is not untouched memory).
fn idle_claim_us(slots: usize) -> f64 {
    let pool = Pool::with_values(slots, 7, 99);
    let mut words = [0u64; 3];
    pool.mark_with(PAGE, |k, v| words[k] = v);
    for t in pool.claim(usize::MAX, |_| Some(words)) {
        pool.finish(t, true);
    }
    let mut us: Vec<f64> = (0..11)
        .map(|_| {
            let t = Instant::now();
            let got = pool.claim(usize::MAX, |_| None);
            std::hint::black_box(got);
            t.elapsed().as_nanos() as f64 / 1e3
        })
        .collect();
    us.sort_by(f64::total_cmp);
    us[us.len() / 2]
}

fn cycles() -> u64 {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: RDTSC reads the time-stamp counter; it has no memory effects.
        unsafe { core::arch::x86_64::_rdtsc() }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        0
    }
}

/// Private anonymous memory of `pages` pages, every page written (distinct contents).
fn filled(pages: usize) -> Result<*mut u8, String> {
    let p = pageone_sys::mmap_anonymous(pages * PAGE).map_err(|e| format!("mmap: {e}"))?;
    for i in 0..pages {
        // SAFETY: page i of the fresh mapping above, which nothing else uses.
        unsafe { p.add(i * PAGE + 64).cast::<u64>().write(i as u64 + 1) };
    }
    Ok(p)
}

/// One run on `mib` MiB with an engine of 2 workers whose periods run only when asked (so that
/// none falls between the marks timed: it would write-protect the pages again).
pub fn run_once(mib: usize) -> Result<PprSample, String> {
    let pages = (mib << 20) / PAGE;
    let engine = Engine::builder()
        .workers(2)
        .merge_period(Duration::from_secs(3600))
        .build()
        .map_err(|e| format!("engine: {e}"))?;
    let pagemap = pageone_sys::Pagemap::open().map_err(|e| format!("pagemap: {e}"))?;
    let base = filled(pages)?;
    engine
        .register(base, pages * PAGE)
        .map_err(|e| format!("register: {e}"))?;
    let pool = Arc::new(Pool::new(2 * pages).map_err(|e| e.to_string())?);
    let mut s = PprSample {
        pages,
        idle_claim_us: idle_claim_us(IDLE_POOL_SLOTS),
        ..Default::default()
    };

    // The program's costs, the engine not looking yet (no pool attached).
    let (t, c) = (Instant::now(), cycles());
    for i in 0..pages {
        // SAFETY: a page of the region above, not used until unmarked below.
        unsafe { pool.mark(base.add(i * PAGE)) };
    }
    s.mark_protected_cycles = (cycles() - c) as f64 / pages as f64;
    s.mark_protected_ns = t.elapsed().as_nanos() as f64 / pages as f64;
    let t = Instant::now();
    for i in 0..pages {
        // SAFETY: marked above.
        unsafe { pool.unmark(base.add(i * PAGE)) };
    }
    s.unmark_ns = t.elapsed().as_nanos() as f64 / pages as f64;

    // The engine gives the marked pages back (marked again: now writable pages).
    let (t, c) = (Instant::now(), cycles());
    for i in 0..pages {
        // SAFETY: as above; the pages are not used again before the region is unregistered.
        unsafe { pool.mark(base.add(i * PAGE)) };
    }
    s.mark_cycles = (cycles() - c) as f64 / pages as f64;
    s.mark_ns = t.elapsed().as_nanos() as f64 / pages as f64;
    let cpu0 = engine.stats().worker_cpu_ns;
    let t = Instant::now();
    engine.recycle_from(pool.clone());
    while engine.stats().pages_recycled < pages as u64 {
        if t.elapsed() > Duration::from_secs(60) {
            return Err(format!(
                "only {} of {pages} pages recycled in 60 s",
                engine.stats().pages_recycled
            ));
        }
        engine.wait_periods(1, Duration::from_secs(10));
    }
    s.recycle_seconds = t.elapsed().as_secs_f64();
    s.recycle_cpu_seconds = (engine.stats().worker_cpu_ns - cpu0) as f64 / 1e9;
    let count = |mask| {
        pagemap
            .count_pages(base as usize, pages, mask)
            .map_err(|e| format!("PAGEMAP_SCAN: {e}"))
    };
    // The zero page is present too: what is left holds memory.
    s.present_after = count(pageone_sys::uapi::PAGE_IS_PRESENT)?
        .saturating_sub(count(pageone_sys::uapi::PAGE_IS_PFNZERO)?);
    engine
        .unregister(base, pages * PAGE)
        .map_err(|e| format!("unregister: {e}"))?;
    drop(engine);

    // The baseline: the same pages written again, then given back one system call each.
    for i in 0..pages {
        // SAFETY: the region is anonymous memory again (unregistered), ours alone.
        unsafe { base.add(i * PAGE + 64).cast::<u64>().write(i as u64 + 1) };
    }
    let (t, c) = (Instant::now(), cycles());
    for i in 0..pages {
        // SAFETY: the page's contents are ours and no longer needed.
        unsafe { pageone_sys::madvise(base.add(i * PAGE), PAGE, libc::MADV_DONTNEED) }
            .map_err(|e| format!("madvise: {e}"))?;
    }
    s.dontneed_cycles = (cycles() - c) as f64 / pages as f64;
    s.dontneed_ns = t.elapsed().as_nanos() as f64 / pages as f64;
    // SAFETY: the mapping made by `filled`, unused from here on.
    unsafe { pageone_sys::munmap(base, pages * PAGE) }.map_err(|e| format!("munmap: {e}"))?;
    Ok(s)
}

/// The median of `f` over the samples.
pub fn median(samples: &[PprSample], f: impl Fn(&PprSample) -> f64) -> f64 {
    let mut v: Vec<f64> = samples.iter().map(f).collect();
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}
