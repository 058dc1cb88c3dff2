//! Helpers shared by the engine's integration tests.
// Each test binary uses a different subset.
#![allow(dead_code)]

use std::time::{Duration, Instant};

use pageone_engine::{Engine, Stats};

pub const PAGE: usize = 4096;

/// Fills a page with content number `c` (0 = zero page): an 8-byte value at a content-dependent
/// offset, so contents differ early or late in the page.
pub fn fill(page: &mut [u8], c: u64) {
    page.fill(0);
    if c != 0 {
        let off = (c as usize * 56) % (PAGE - 8);
        page[off..off + 8].copy_from_slice(&c.to_le_bytes());
    }
}

/// Private anonymous memory of `pages` pages, filled by `content`, as the test's own slice.
pub fn filled(pages: usize, content: impl Fn(usize) -> u64) -> &'static mut [u8] {
    let p = pageone_sys::mmap_anonymous(pages * PAGE).unwrap();
    // SAFETY: a fresh private mapping of this length that nothing else uses; it is leaked (the
    // test process ends soon), so the slice stays valid.
    let s = unsafe { std::slice::from_raw_parts_mut(p, pages * PAGE) };
    for (i, page) in s.chunks_mut(PAGE).enumerate() {
        fill(page, content(i));
    }
    s
}

pub fn check(page: &[u8], c: u64) -> bool {
    let mut want = [0u8; PAGE];
    fill(&mut want, c);
    page == want
}

/// Runs periods until `what` holds (or 60 s passed); returns the last stats.
pub fn wait_for(e: &Engine, what: impl Fn(&Stats) -> bool) -> Stats {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        e.wait_periods(1, Duration::from_secs(10));
        let s = e.stats();
        if what(&s) || Instant::now() > deadline {
            return s;
        }
    }
}

/// The kernel's KSM running, as fast as it goes, for one test at a time in its binary: every
/// knob it changed is restored when dropped, and `run` is left as it was (never 1: 2 if it was
/// running, after unmerging).
pub struct KsmRunning {
    saved: Vec<(&'static str, String)>,
    /// Held until the knobs are restored (fields drop after `drop`).
    _one: std::sync::MutexGuard<'static, ()>,
}

const KSM: &str = "/sys/kernel/mm/ksm";

/// The tests of a binary share the kernel's KSM: one at a time.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// The kernel's KSM running for this test alone, and an engine of 20 ms periods handing memory to
/// it (dropped in the reverse order, the engine first); `None` where KSM is not there or not
/// writable (the test is skipped, and says so).
pub fn with_ksm() -> Option<(KsmRunning, Engine)> {
    let Some(ksm) = KsmRunning::start() else {
        eprintln!("skipped: the kernel's KSM is not there or not writable (needs root)");
        return None;
    };
    let e = Engine::builder()
        .merge_period(Duration::from_millis(20))
        .ksm_when_limited(true)
        .build()
        .unwrap();
    Some((ksm, e))
}

impl KsmRunning {
    /// `None` where KSM is not there or its knobs are not writable (not root).
    pub fn start() -> Option<Self> {
        // Before the knobs are read: another test's KSM is no state to restore.
        let one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
        let read = |k: &str| std::fs::read_to_string(format!("{KSM}/{k}")).ok();
        let saved: Vec<_> = ["run", "pages_to_scan", "sleep_millisecs"]
            .into_iter()
            .map(|k| Some((k, read(k)?.trim().to_string())))
            .collect::<Option<_>>()?;
        let guard = Self { saved, _one: one };
        for (k, v) in [
            ("run", "2"),
            ("pages_to_scan", "100000"),
            ("sleep_millisecs", "0"),
        ] {
            std::fs::write(format!("{KSM}/{k}"), v).ok()?;
        }
        std::fs::write(format!("{KSM}/run"), "1").ok()?;
        Some(guard)
    }

    /// The pages of this process that map a page KSM merged (both of a merged pair count):
    /// other processes' merges (a QEMU guest's, say) neither add to it nor take from it.
    pub fn merging_here() -> u64 {
        let v = std::fs::read_to_string("/proc/self/ksm_merging_pages").unwrap();
        v.trim().parse().unwrap()
    }

    /// `merging_here()` less `before` (none if pages merged before came apart since).
    pub fn merged_since(before: u64) -> u64 {
        Self::merging_here().saturating_sub(before)
    }
}

impl Drop for KsmRunning {
    fn drop(&mut self) {
        let _ = std::fs::write(format!("{KSM}/run"), "2");
        for (k, v) in self.saved.iter().filter(|(k, _)| *k != "run") {
            let _ = std::fs::write(format!("{KSM}/{k}"), v);
        }
        let run = self.saved.iter().find(|(k, _)| *k == "run").map(|(_, v)| v);
        let run = if run.is_some_and(|v| v == "1") {
            "2"
        } else {
            run.map_or("0", |v| v)
        };
        let _ = std::fs::write(format!("{KSM}/run"), run);
    }
}

/// Locks this process's memory, now and to come (`mlockall`); false (the test is skipped, and
/// says so) where the kernel refuses: it needs root or a memlock limit.
pub fn lock_all_memory() -> bool {
    // SAFETY: locks this test process's memory; no memory-safety preconditions.
    if unsafe { libc::mlockall(libc::MCL_CURRENT | libc::MCL_FUTURE) } != 0 {
        eprintln!(
            "skipped: mlockall refused ({}); it needs root or a memlock limit",
            std::io::Error::last_os_error()
        );
        return false;
    }
    true
}

/// How many of the `n` pages from `addr` lie in mappings that are not locked.
pub fn unlocked_pages(addr: usize, n: usize) -> usize {
    let locked = pageone_sys::self_locked_mappings().unwrap();
    (0..n)
        .map(|i| addr + i * PAGE)
        .filter(|a| !locked.iter().any(|m| m.contains(a)))
        .count()
}

/// Makes the region read-only (`mprotect`, past the engine: as a program's own raw call).
pub fn make_read_only(r: &pageone_engine::Region) {
    // SAFETY: the test's own region, which no live reference writes.
    let done = unsafe { libc::mprotect(r.as_ptr().cast(), r.len(), libc::PROT_READ) };
    assert_eq!(done, 0, "{}", std::io::Error::last_os_error());
}

/// An engine merging every 20 ms with a store of 65,536 pages (a failure fills that much, not
/// the machine's memory), handing regions to the kernel's KSM or not.
pub fn small_engine(ksm_when_limited: bool) -> pageone_engine::Engine {
    pageone_engine::Engine::builder()
        .merge_period(std::time::Duration::from_millis(20))
        .store_pages(65_536)
        .ksm_when_limited(ksm_when_limited)
        .build()
        .expect("the engine starts on this kernel")
}

/// A region of two identical halves of `n` pages each (page `i` holds `i % n + 1`).
pub fn halves(e: &pageone_engine::Engine, n: usize) -> pageone_engine::Region<'_> {
    let mut r = e.alloc_region(2 * n * PAGE).unwrap();
    for (i, p) in r.as_mut_slice().chunks_mut(PAGE).enumerate() {
        fill(p, (i % n) as u64 + 1);
    }
    r
}

// Memory advised and moved (the advice and failed-move tests).

/// Pages of `[base, base + pages * PAGE)` not in a mapping whose `VmFlags` hold `flag`.
pub fn pages_without(flag: &str, base: usize, pages: usize) -> Vec<usize> {
    let flagged = pageone_sys::self_mappings_flagged(flag).unwrap();
    (0..pages)
        .filter(|i| !flagged.iter().any(|m| m.contains(&(base + i * PAGE))))
        .collect()
}

/// Mappings of a store among those of `[base, base + len)`: merged pages.
pub fn store_mappings(base: usize, len: usize) -> usize {
    let maps = pageone_sys::self_mappings_in(base, base + len).unwrap();
    maps.iter()
        .filter(|m| pageone_engine::is_store_mapping(m))
        .count()
}

/// Maps `2 * n` pages of two identical halves (page `i` holds `i % n + 1`).
pub fn halves_unregistered(n: usize) -> usize {
    let base = pageone_sys::mmap_anonymous(2 * n * PAGE).unwrap() as usize;
    fill_halves(base, n);
    base
}

/// Fills the `2 * n` pages at `base` as two identical halves (page `i` holds `i % n + 1`).
pub fn fill_halves(base: usize, n: usize) {
    for i in 0..2 * n {
        // SAFETY: a page of the test's own mapping, which nothing else refers to yet.
        let page = unsafe { std::slice::from_raw_parts_mut((base + i * PAGE) as *mut u8, PAGE) };
        fill(page, (i % n) as u64 + 1);
    }
}

/// Unmaps the test's mapping, as a program under the shim does: the engine told, then the
/// kernel's call.
pub fn unmap(base: usize, len: usize) {
    pageone_engine::mapping_gone(base..base + len);
    // SAFETY: the test's own mapping, which nothing refers to any more.
    unsafe { pageone_sys::munmap(base as *mut u8, len) }.unwrap();
}

/// Advises `[base, base + len)` as a program under the shim does: the kernel's call, then the
/// engine told.
pub fn advise(base: usize, len: usize, advice: i32) {
    // SAFETY: advice that changes no contents, on the test's own mapping.
    unsafe { pageone_sys::madvise(base as *mut u8, len, advice) }.unwrap();
    pageone_engine::advised(base..base + len, advice);
}

pub fn holds(base: usize, i: usize, c: u64) -> bool {
    // SAFETY: a page of the test's mapping, read while no thread writes it.
    check(
        unsafe { std::slice::from_raw_parts((base + i * PAGE) as *const u8, PAGE) },
        c,
    )
}
