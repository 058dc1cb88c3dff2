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
