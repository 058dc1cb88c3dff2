//! The kernel's KSM, for memory whose merges cost pageone a mapping per page. pageone's copies are
//! pages of a file, and one mapping maps one run of consecutive file pages, so a merged page
//! that is not next to its copy's neighbours costs a mapping (VMA) of its own, and the process's
//! `vm.max_map_count` stops it. The kernel's KSM shares a page between anonymous mappings with no
//! mapping at all, faster and with less CPU. So a region whose merges so far cost half a mapping
//! per page or more is handed to KSM whole, where the host runs it (`/sys/kernel/mm/ksm/run` =
//! 1): its merged pages become private again, the engine stops watching it, and it is marked
//! `MADV_MERGEABLE` for `ksmd`. Regions whose pages merge in runs stay pageone's. So is a region
//! pageone cannot merge at all, not read/write (see the `refusals` module), which KSM merges. See
//! `Config::ksm_when_limited` and `docs/DESIGN.md`, "Handing memory to the kernel's KSM".

use pageone_sync::lock;
use pageone_sys as sys;

use crate::access::PAGE;
use crate::state::{RegionState, Shared};

/// Merged pages a region is judged from at the least (fewer say little of its layout: a guest's
/// first merges may be single pages before the runs of its kernel's).
const SAMPLE_PAGES: u64 = 1024;
/// Merged pages that judge a region the budget already refused (it cannot wait for more).
const REFUSED_SAMPLE_PAGES: u64 = 64;

/// Whether `region` is better merged by the kernel's KSM: its merges so far cost half a mapping
/// per page or more (runs of four pages or fewer on average: single pages among others), judged
/// after [`SAMPLE_PAGES`] merged pages, or after [`REFUSED_SAMPLE_PAGES`] if the budget already
/// refused some of its merges (`refused`). Whatever the budget: where mappings are to spare
/// (`vm.max_map_count` raised), KSM still merged such memory in less time and with less CPU
/// (`docs/benchmarks.md`, "Scattered duplicates"), and a region kept while its partners go to
/// KSM would keep a copy of its own of what they share. Regions whose pages merge in runs never
/// qualify.
pub(crate) fn better_with_ksm(region: &RegionState, refused: bool) -> bool {
    let s = region.spending;
    let sample = if refused {
        REFUSED_SAMPLE_PAGES
    } else {
        SAMPLE_PAGES
    };
    !region.to_ksm && s.pages >= sample && 2 * s.vmas >= s.pages
}

/// Refused pages (see the `refusals` module) a region is judged from at the least.
const REFUSED_PAGES: u64 = 64;

/// Whether `region` is memory pageone cannot merge that the kernel's KSM merges: the kernel
/// refused to freeze [`REFUSED_PAGES`] of its pages or more (not read/write, or locked where
/// the engine could not lock memory of its own), half of the merges planned there or more. (A
/// region with a few such pages among many merged stays.)
pub(crate) fn refuses_pageone(region: &RegionState) -> bool {
    let s = region.spending;
    !region.to_ksm && s.refused >= REFUSED_PAGES && 2 * s.refused >= s.pages
}

/// Whether the kernel's KSM is running (`ksmd` scans what is marked mergeable).
pub(crate) fn running() -> bool {
    std::fs::read_to_string("/sys/kernel/mm/ksm/run").is_ok_and(|s| s.trim() == "1")
}

/// Hands the regions that want it to the kernel's KSM, if it runs (see the module). Called
/// between periods, holding no lock.
pub(crate) fn hand_over_wanted(sh: &Shared) {
    let wanted: Vec<usize> = lock(&sh.state)
        .regions
        .values()
        .filter(|r| r.wants_ksm && !r.to_ksm)
        .map(|r| r.start)
        .collect();
    if wanted.is_empty() {
        return;
    }
    if !running() {
        // KSM stopped since the commit judged them: they are pageone's to merge again (and are
        // judged again while KSM does not run: never handed over).
        let mut st = lock(&sh.state);
        for start in wanted {
            if let Some(r) = st.regions.get_mut(&start) {
                r.wants_ksm = false;
            }
        }
        return;
    }
    for start in wanted {
        if let Some(len) = crate::registry::hand_to_ksm(sh, start) {
            tracing::info!(
                start = format_args!("{start:#x}"),
                pages = len / PAGE,
                "a region pageone merges at a mapping per page, or cannot merge (not read/write), is \
                 handed to the kernel's KSM"
            );
        }
    }
}

/// Marks `[start, start+len)` mergeable for the kernel's KSM. Nothing changes for its pages
/// (the mark is a flag of their mappings).
pub(crate) fn mark(start: usize, len: usize) {
    // SAFETY: MADV_MERGEABLE changes no contents.
    if let Err(e) = unsafe { sys::madvise(start as *mut u8, len, libc::MADV_MERGEABLE) } {
        tracing::debug!(error = %e, "a region could not be marked mergeable for the kernel's KSM");
    }
}

/// Takes `[start, start+len)`, handed to KSM, back as the program's private memory: the kernel
/// makes the pages KSM merged private again (`MADV_UNMERGEABLE`), as unregistering promises.
pub(crate) fn take_back(start: usize, len: usize) {
    // SAFETY: MADV_UNMERGEABLE changes no contents (merged pages become private copies).
    if let Err(e) = unsafe { sys::madvise(start as *mut u8, len, libc::MADV_UNMERGEABLE) } {
        tracing::debug!(error = %e, "a range handed to the kernel's KSM could not be taken back");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::{Page, Spending};

    fn region(pages: usize, merged: u64, vmas: u64) -> RegionState {
        RegionState {
            merged_ever: true,
            spending: Spending {
                pages: merged,
                vmas,
                refused: 0,
            },
            ..RegionState::new(0, vec![Page::default(); pages])
        }
    }

    #[test]
    fn a_region_merging_single_pages_goes_to_ksm() {
        // Two mappings per page, one, a half: gone, however large the region.
        assert!(better_with_ksm(&region(131_072, 2000, 4000), false));
        assert!(better_with_ksm(&region(16_384, 2000, 2000), false));
        assert!(better_with_ksm(&region(16_384, 2000, 1000), false));
        // Runs of three or more on average, and runs of 64, stay, even refused.
        assert!(!better_with_ksm(&region(16_384, 3000, 999), false));
        assert!(!better_with_ksm(&region(131_072, 6400, 200), false));
        assert!(!better_with_ksm(&region(131_072, 6400, 200), true));
        // Too few merged pages to judge from; refused, fewer do.
        assert!(!better_with_ksm(&region(131_072, 100, 200), false));
        assert!(better_with_ksm(&region(131_072, 100, 200), true));
        assert!(!better_with_ksm(&region(131_072, 10, 20), true));
        let mut handed = region(131_072, 2000, 4000);
        handed.to_ksm = true;
        assert!(!better_with_ksm(&handed, true));
    }

    #[test]
    fn a_region_whose_pages_the_kernel_refuses_goes_to_ksm() {
        // Merges planned there, and pages refused.
        let refused = |planned: u64, refused: u64| {
            let mut r = region(16_384, planned, planned);
            r.spending.refused = refused;
            refuses_pageone(&r)
        };
        assert!(refused(0, 64) && refused(128, 64) && refused(1536, 1024));
        // Too few to judge from, or fewer than half of the merges planned (a few pages read-only
        // among many merged).
        assert!(!refused(0, 63) && !refused(4096, 100) && !refused(200, 99));
        let mut handed = region(16_384, 0, 0);
        handed.spending.refused = 1000;
        handed.to_ksm = true;
        assert!(!refuses_pageone(&handed));
    }
}
