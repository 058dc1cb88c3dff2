//! Huge pages given back to memory where nothing merged.
//!
//! The watch tracks writes with async write-protection, which tracks 4 KiB pages: the first write
//! to a protected huge page splits its mapping into 512 entries (the folio stays whole), and
//! khugepaged never collapses a range holding protected entries again. So registered memory the
//! program writes loses its huge mappings (and a guest its 2 MiB EPT entries under KVM), merged or
//! not. This gives them back where nothing merged: an aligned 2 MiB of a region where the kernel
//! gave huge pages, every page of it a first sighting (present, unique, unchanged since it was
//! classified) and not mapped huge, is collapsed into a huge page again (`MADV_COLLAPSE`, Linux
//! 6.1+), a few per period, after the period's merges. Its protection is lifted for the collapse
//! (the kernel does not collapse protected entries) and put back on the whole huge page after it,
//! which is one entry again.
//!
//! A write that lands between the two is not seen by the watch: so the 2 MiB count as written
//! (their first sightings go stale and they are classified again once unchanged), which costs a
//! look at each page, never a merge (merges compare frozen bytes). A range collapsed and split
//! again waits twice as long each time before the next collapse (8 periods, then 16, up to 512),
//! so memory written now and then is not copied over and over.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use pageone_sync::lock;
use pageone_sys as sys;

use crate::access::PAGE;
use crate::layout::{apply_changes, holding_still};
use crate::state::{PageKind, RegionState, Shared, State};

/// A huge page's size.
pub(crate) const HUGE: usize = 2 << 20;
const PER: usize = HUGE / PAGE;
/// Most huge pages collapsed per period (each copies 2 MiB in the kernel).
pub(crate) const MAX_PER_PERIOD: usize = 16;
/// The watch's per-page category of a page mapped by a huge page (see `watch::mark_pages`).
pub(crate) const CAT_HUGE: u8 = 16;

/// The ranges collapsed so far and when each may be collapsed again (see the module doc).
#[derive(Default)]
pub(crate) struct Collapsed {
    by_addr: HashMap<usize, (u8, Instant)>,
}

impl Collapsed {
    /// Whether the range at `addr` may be collapsed at `now`.
    fn due(&self, addr: usize, now: Instant) -> bool {
        self.by_addr.get(&addr).is_none_or(|&(_, t)| now >= t)
    }

    /// Records a collapse of the range at `addr` (or an attempt the kernel refused: `refused`
    /// waits the longest).
    fn record(&mut self, addr: usize, now: Instant, period: Duration, refused: bool) {
        let e = self.by_addr.entry(addr).or_insert((0, now));
        e.0 = if refused { 6 } else { (e.0 + 1).min(6) };
        e.1 = now + period * (8 << e.0);
    }

    /// Forgets the ranges in `range` (unregistered).
    pub(crate) fn forget(&mut self, range: Range<usize>) {
        self.by_addr.retain(|a, _| !range.contains(a));
    }
}

/// Adds to `out` the huge pages of region `r` worth collapsing, from the watch's categories
/// `cats` of its pages (see the module doc), up to [`MAX_PER_PERIOD`] in all; notes in `r`
/// whether the kernel gave it huge pages.
pub(crate) fn collapsible(
    r: &mut RegionState,
    cats: &[u8],
    collapsed: &Collapsed,
    out: &mut Vec<usize>,
) {
    r.huge_seen |= cats.iter().any(|&c| c & CAT_HUGE != 0);
    if !r.huge_seen || out.len() >= MAX_PER_PERIOD {
        return;
    }
    let now = Instant::now();
    let end = r.start + r.len();
    let mut a = r.start.next_multiple_of(HUGE);
    while a + HUGE <= end && out.len() < MAX_PER_PERIOD {
        let i = (a - r.start) / PAGE;
        let pages = &r.pages[i..i + PER];
        let small_unique = pages.iter().zip(&cats[i..i + PER]).all(|(p, &c)| {
            // Present, not the zero page, not written this period, mapped small.
            p.kind == PageKind::Unique && c & (1 | 4 | 8 | CAT_HUGE) == 1
        });
        if small_unique && collapsed.due(a, now) {
            out.push(a);
        }
        a += HUGE;
    }
}

/// Collapses the huge pages at `chunks` (found by [`collapsible`] this period) where they are
/// still what the watch saw; returns how many the kernel collapsed. Mapping changes of the
/// program wait meanwhile (no run is frozen: the period's commits are done).
pub(crate) fn collapse(sh: &Shared, chunks: &[usize], period: Duration) -> usize {
    if chunks.is_empty() {
        return 0;
    }
    let _still = holding_still();
    let mut st = lock(&sh.state);
    apply_changes(sh, &mut st);
    let mut done = 0;
    for &a in chunks {
        if !still_unique(&st, a) {
            continue;
        }
        // The kernel does not collapse write-protected entries: lift the protection (refused
        // where the range is not registered any more), collapse, protect the huge page again.
        if sh.uffd.writeprotect(a, HUGE, false).is_err() {
            continue;
        }
        // SAFETY: collapsing copies the pages' contents into a huge page, with the range's
        // page tables locked: no byte of the program's memory changes.
        let r = unsafe { sys::madvise(a as *mut u8, HUGE, libc::MADV_COLLAPSE) };
        let _ = st.pagemap.write_protect(a, a + HUGE);
        count_as_written(&mut st, a);
        st.huge.record(a, Instant::now(), period, r.is_err());
        if r.is_ok() {
            done += 1;
        }
    }
    // Relaxed: a counter.
    sh.counters
        .huge_restored
        .fetch_add(done as u64, Ordering::Relaxed);
    done
}

/// Whether the 2 MiB at `a` are still registered, every page a first sighting.
fn still_unique(st: &State, a: usize) -> bool {
    let Some((&start, r)) = st.regions.range(..=a).next_back() else {
        return false;
    };
    let i = (a - start) / PAGE;
    r.pages.len() >= i + PER
        && r.pages[i..i + PER]
            .iter()
            .all(|p| p.kind == PageKind::Unique)
}

/// The pages at `a` count as written this period (see the module doc).
fn count_as_written(st: &mut State, a: usize) {
    let Some((&start, r)) = st.regions.range_mut(..=a).next_back() else {
        return;
    };
    let i = (a - start) / PAGE;
    for p in &mut r.pages[i..i + PER] {
        p.kind = PageKind::Anon;
        p.unchanged = 0;
        p.epoch = p.epoch.wrapping_add(1);
    }
    st.stale_sightings += PER;
}
