//! The kernel's KSM, for memory whose merges cost pageone a mapping per page. pageone's copies are
//! pages of a file, and one mapping maps one run of consecutive file pages, so a merged page
//! that is not next to its copy's neighbours costs a mapping (VMA) of its own, and the process's
//! `vm.max_map_count` stops it. The kernel's KSM shares a page between anonymous mappings with no
//! mapping at all, faster and with less CPU. So a chunk of a region ([`CHUNK_PAGES`]) whose
//! merges so far cost half a mapping per page or more is handed to KSM, where the host runs it
//! (`/sys/kernel/mm/ksm/run` = 1): its merged pages become private again, the engine stops
//! watching it, and it is marked `MADV_MERGEABLE` for `ksmd`. Chunks whose pages merge in runs
//! stay pageone's. A region pageone cannot merge at all, not read/write (see the `refusals`
//! module), which KSM merges, is handed over whole. See
//! `Config::ksm_when_limited` and `docs/DESIGN.md`, "Handing memory to the kernel's KSM".

use std::ops::Range;

use pageone_index::KeyId;
use pageone_sync::lock;
use pageone_sys as sys;

use crate::access::PAGE;
use crate::state::{PageKind, RegionState, Shared, Spending};

/// Pages of a region judged apart (64 MiB): memory whose duplicates lie scattered in one part
/// and in runs in another (a guest's page cache beside its kernel) is handed to KSM only where
/// they lie scattered.
pub(crate) const CHUNK_PAGES: usize = 16_384;
/// Merged pages a chunk is judged from at the least (fewer say little of its layout: a guest's
/// first merges may be single pages before the runs of its kernel's).
const SAMPLE_PAGES: u64 = 64;
/// Merged pages that judge a chunk the budget already refused (it cannot wait for more).
const REFUSED_SAMPLE_PAGES: u64 = 32;

/// Whether a chunk whose merges cost `s` is better merged by the kernel's KSM: its merges so far
/// cost half a mapping per page or more (runs of four pages or fewer on average: single pages
/// among others), judged after [`SAMPLE_PAGES`] merged pages, or after [`REFUSED_SAMPLE_PAGES`]
/// if the budget already refused some of its merges (`refused`). Whatever the budget: where
/// mappings are to spare (`vm.max_map_count` raised), KSM still merged such memory in less time
/// and with less CPU (`docs/benchmarks.md`, "Scattered duplicates"), and a chunk kept while its
/// partners go to KSM would keep a copy of its own of what they share. Chunks whose pages merge
/// in runs never qualify.
pub(crate) fn better_with_ksm(s: &Spending, refused: bool) -> bool {
    let sample = if refused {
        REFUSED_SAMPLE_PAGES
    } else {
        SAMPLE_PAGES
    };
    s.pages >= sample && 2 * s.vmas >= s.pages
}

/// Whether a chunk goes to the kernel's KSM because its pages' duplicates did (`c.twins_to_ksm`,
/// counted as a batch leaves out the pages of chunks marked for KSM: see
/// `period::without_regions_for_ksm`): [`SAMPLE_PAGES`] of them at the least, and no fewer than
/// the merges counted in the chunk. Left to pageone, such pages find no duplicate (theirs are
/// no longer classified) and KSM cannot merge them with theirs: the pages copies were made of,
/// mostly, which merge onto those copies in runs and so never judge their chunk by its merges.
pub(crate) fn twins_went_to_ksm(c: &crate::state::Chunk) -> bool {
    c.twins_to_ksm >= SAMPLE_PAGES && c.twins_to_ksm >= c.spending.pages
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

/// Hands what wants it to the kernel's KSM, if it runs (see the module): whole regions, and the
/// chunks of others, side by side ones together. Called between periods, holding no lock.
pub(crate) fn hand_over_wanted(sh: &Shared) {
    let wanted: Vec<(usize, Range<usize>)> = lock(&sh.state)
        .regions
        .values()
        .filter(|r| !r.to_ksm)
        .flat_map(|r| wanted_ranges(r).into_iter().map(|range| (r.start, range)))
        .collect();
    if wanted.is_empty() {
        return;
    }
    if !running() {
        // KSM stopped since the commit judged them: they are pageone's to merge again (and are
        // judged again while KSM does not run: never handed over).
        let mut st = lock(&sh.state);
        for r in st.regions.values_mut() {
            r.wants_ksm = false;
            r.chunks.iter_mut().for_each(|c| c.wants_ksm = false);
        }
        return;
    }
    // From the top down: a range handed over splits its region, and the part below keeps the
    // region's start.
    for (start, range) in wanted.into_iter().rev() {
        if let Some(len) = crate::registry::hand_to_ksm(sh, start, range.clone()) {
            tracing::info!(
                start = format_args!("{:#x}", range.start),
                pages = len / PAGE,
                "memory pageone merges at a mapping per page, or cannot merge (not read/write), is \
                 handed to the kernel's KSM"
            );
        }
    }
    want_chunks_left_alone(sh);
}

/// Marks for the kernel's KSM (at the next hand-over) the chunks whose merged pages mostly map
/// copies no other page maps any more: with a store of the process's own, where the counts are
/// all of them, such merges save nothing. They are the pages copies were made of, whose
/// duplicates lay scattered in memory just handed to KSM (their merges were runs, which never
/// judge a chunk: see `CommitCtx::charge_chunk`); handed over too, KSM merges them with those.
///
/// The state's lock is taken for one chunk at a time (a program thread dropping pages waits for
/// it): a chunk's 16,384 pages are read in tens of microseconds, where every page of a large
/// registration at once took 25 ms per 16 GiB, half of it merged.
fn want_chunks_left_alone(sh: &Shared) {
    let chunks: Vec<(usize, usize)> = {
        let st = lock(&sh.state);
        if !st.store.is_local() {
            return;
        }
        st.regions
            .values()
            .filter(|r| !r.to_ksm && !r.wants_ksm)
            .flat_map(|r| (0..r.pages.len().div_ceil(CHUNK_PAGES)).map(|c| (r.start, c)))
            .collect()
    };
    for (start, c) in chunks {
        let mut st = lock(&sh.state);
        let crate::state::State { regions, store, .. } = &mut *st;
        let Some(r) = regions.get_mut(&start) else {
            continue;
        };
        if let Some(pages) = r.pages.get(c * CHUNK_PAGES..) {
            let pages = &pages[..pages.len().min(CHUNK_PAGES)];
            if !r.wants_ksm_at(c * CHUNK_PAGES) && mostly_alone(pages, |sid| store.refs(sid)) {
                r.chunk_mut(c * CHUNK_PAGES).wants_ksm = true;
            }
        }
    }
}

/// Whether at least [`SAMPLE_PAGES`] of `pages` are merged and at least half of those map
/// copies only they map (`refs` of a copy).
fn mostly_alone(pages: &[crate::state::Page], refs: impl Fn(KeyId) -> u32) -> bool {
    let merged = pages.iter().filter(|p| p.kind == PageKind::Merged);
    let (n, alone) = merged.fold((0u64, 0u64), |(n, alone), p| {
        (n + 1, alone + u64::from(refs(p.sid) == 1))
    });
    n >= SAMPLE_PAGES && 2 * alone >= n
}

/// The ranges of `r` to hand to the kernel's KSM: all of it, or its chunks that want it, side
/// by side ones as one range, in address order.
pub(crate) fn wanted_ranges(r: &RegionState) -> Vec<Range<usize>> {
    let end = r.start + r.len();
    if r.wants_ksm {
        return std::iter::once(r.start..end).collect();
    }
    let mut out: Vec<Range<usize>> = Vec::new();
    for (c, _) in r.chunks.iter().enumerate().filter(|(_, c)| c.wants_ksm) {
        let s = r.start + c * CHUNK_PAGES * PAGE;
        if s >= end {
            // (Past the region's end: it shrank.)
            break;
        }
        let e = (s + CHUNK_PAGES * PAGE).min(end);
        match out.last_mut() {
            Some(last) if last.end == s => last.end = e,
            _ => out.push(s..e),
        }
    }
    out
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

    fn spent(pages: u64, vmas: u64) -> Spending {
        Spending {
            pages,
            vmas,
            refused: 0,
        }
    }

    #[test]
    fn a_chunk_merging_single_pages_goes_to_ksm() {
        // Two mappings per page, one, a half: gone.
        assert!(better_with_ksm(&spent(2000, 4000), false));
        assert!(better_with_ksm(&spent(2000, 2000), false));
        assert!(better_with_ksm(&spent(2000, 1000), false));
        // Runs of three or more on average, and runs of 64, stay, even refused.
        assert!(!better_with_ksm(&spent(3000, 999), false));
        assert!(!better_with_ksm(&spent(6400, 200), false));
        assert!(!better_with_ksm(&spent(6400, 200), true));
        // Too few merged pages to judge from; refused, fewer do.
        assert!(!better_with_ksm(&spent(63, 126), false));
        assert!(better_with_ksm(&spent(64, 128), false));
        assert!(better_with_ksm(&spent(32, 64), true));
        assert!(!better_with_ksm(&spent(31, 62), true));
    }

    #[test]
    fn only_the_chunks_that_want_ksm_are_handed_over_side_by_side_ones_together() {
        let chunk = CHUNK_PAGES * PAGE;
        // Five chunks and a half: the second, third and the last half want KSM.
        let base = 1 << 40;
        let mut r = region(5 * CHUNK_PAGES + CHUNK_PAGES / 2, 0, 0);
        r.start = base;
        for c in [1, 2, 5] {
            r.chunk_mut(c * CHUNK_PAGES).wants_ksm = true;
        }
        assert_eq!(
            wanted_ranges(&r),
            [
                base + chunk..base + 3 * chunk,
                base + 5 * chunk..base + 5 * chunk + chunk / 2
            ]
        );
        assert!(r.wants_ksm_at(CHUNK_PAGES) && r.wants_ksm_at(3 * CHUNK_PAGES - 1));
        assert!(!r.wants_ksm_at(0) && !r.wants_ksm_at(3 * CHUNK_PAGES));
        // A chunk marked past the region's end (it shrank) hands nothing over.
        r.chunk_mut(7 * CHUNK_PAGES).wants_ksm = true;
        assert_eq!(wanted_ranges(&r).len(), 2);
        // A region the kernel refuses goes whole.
        r.wants_ksm = true;
        let whole: Vec<_> = std::iter::once(base..base + r.len()).collect();
        assert_eq!(wanted_ranges(&r), whole);
        assert!(r.wants_ksm_at(0));
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

    #[test]
    fn a_chunk_whose_merged_pages_map_copies_alone_is_left_alone() {
        let merged = |sid| Page {
            sid,
            kind: PageKind::Merged,
            ..Page::default()
        };
        // Copies 0..100 are mapped by one page each, copies 100.. by two.
        let refs = |sid: KeyId| if sid < 100 { 1 } else { 2 };
        let mut pages = vec![Page::default(); 1000];
        for (i, p) in pages.iter_mut().enumerate().take(128) {
            *p = merged(if i < 64 { i as KeyId } else { 100 + i as KeyId });
        }
        // Half of 128 merged pages alone: left alone.
        assert!(mostly_alone(&pages, refs));
        // One fewer alone: not.
        pages[0] = merged(500);
        assert!(!mostly_alone(&pages, refs));
        // Too few merged pages to judge from, all alone.
        let few: Vec<Page> = (0..63).map(merged).collect();
        assert!(!mostly_alone(&few, refs));
        assert!(mostly_alone(&[few, vec![merged(63)]].concat(), refs));
    }

    #[test]
    fn a_chunk_whose_duplicates_went_to_ksm_follows_them_unless_it_merged_more() {
        let chunk = |twins: u64, merged: u64| crate::state::Chunk {
            twins_to_ksm: twins,
            spending: spent(merged, merged / 64),
            ..Default::default()
        };
        assert!(twins_went_to_ksm(&chunk(64, 0)));
        assert!(!twins_went_to_ksm(&chunk(63, 0)), "too few to judge from");
        assert!(twins_went_to_ksm(&chunk(1000, 1000)));
        assert!(
            !twins_went_to_ksm(&chunk(1000, 1001)),
            "runs merged in it outweigh them"
        );
    }
}
