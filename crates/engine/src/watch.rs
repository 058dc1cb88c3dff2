//! The watch: which pages were written since the last period, and which stayed unchanged long
//! enough to be candidates.
//!
//! In the write-protect mode one `PAGEMAP_SCAN` per region returns the pages present and written
//! since the last scan and write-protects the written ones again (userfaultfd async
//! write-protection: a write costs one minor fault in the kernel and nothing in user space), and
//! a second one the store mappings of a region with merged pages; pages are never read to find
//! out whether they changed. In the checksum mode, a per-page xxh3 checksum is compared instead, as KSM does.

use std::io;
use std::sync::atomic::Ordering;
use std::time::Instant;

use pageone_sys::{self as sys, uapi::*};

use crate::access::{checksum_changed, is_zero, PageReader, Pre, PAGE};
use crate::candidates::Candidate;
use crate::config::{Config, WatchMode};
use crate::huge::CAT_HUGE;
use crate::state::{Page, PageKind, RegionState, Shared, State};
use crate::store::Store;

/// What the watch found.
pub(crate) struct Watch {
    /// Pages unchanged long enough: present, anonymous.
    pub(crate) candidates: Vec<Candidate>,
    /// Pages that were written and have just stopped changing, to be read now: a zero page among
    /// them is released at once (see [`release_zero_probes`]).
    pub(crate) zero_probes: Vec<Candidate>,
    /// Huge pages to collapse again after the period's merges (see the `huge` module).
    pub(crate) collapsible: Vec<usize>,
}

/// Finds written pages and returns the candidates (unchanged long enough, present, anonymous).
/// A `kicked` period counts as a whole one (the caller asked for it).
pub(crate) fn watch(
    sh: &Shared,
    st: &mut State,
    config: &Config,
    clock: PeriodClock,
) -> io::Result<Watch> {
    let PeriodClock { kicked, period } = clock;
    if !config.merging {
        // Recycling only: no page is watched (PPR tickets are claimed from the pool).
        (st.volatile, st.written, st.unshared) = (0, 0, 0);
        return Ok(Watch {
            candidates: Vec::new(),
            zero_probes: Vec::new(),
            collapsible: Vec::new(),
        });
    }
    let now = Instant::now();
    // Kept from period to period: allocated afresh, the per-page categories came from new
    // memory every period (a page fault per 4 KiB).
    let mut scan = std::mem::take(&mut st.scan);
    let mut tally = Tally {
        out: Vec::new(),
        zero_probes: Vec::new(),
        written: 0,
        volatile: 0,
        unique: 0,
        parked: 0,
        refused: 0,
        all_pages: st.registered_pages(),
    };
    let State {
        regions,
        pagemap,
        store,
        zero,
        stale_sightings,
        huge,
        ..
    } = st;
    let mut collapsible = Vec::new();
    let mut reader = PageReader::new();
    // (A region handed to the kernel's KSM is no longer the engine's to watch.)
    // Store mappings are walked every period while the engine is busy, every 4th once it is
    // idle: their merged pages are present (mapped as they merge), which makes the walk most of
    // an idle period's cost, and what it finds there (pages written since their merge) only
    // changes what is counted and merged again, a few periods later.
    // Relaxed: the engine thread's own hint.
    let walk_store = !sh.settled.load(Ordering::Relaxed) || period % 4 == 0;
    for r in regions.values_mut().filter(|r| !r.to_ksm) {
        let step = unchanged_step(r, now, kicked, config);
        scan_categories(sh.mode, pagemap, r, &mut scan, walk_store)?;
        sh.counters
            .scanned
            .fetch_add(r.pages.len() as u64, Ordering::Relaxed);
        let mut w = RegionWatch {
            sh,
            config,
            step,
            period,
            start: r.start,
            store,
            zero,
            stale_sightings,
            tally: &mut tally,
            reader: &mut reader,
        };
        w.pages(r, &scan.cats);
        if sh.mode == WatchMode::UffdWp && config.restore_huge_pages {
            crate::huge::collapsible(r, &scan.cats, huge, &mut collapsible);
        }
    }
    st.volatile = tally.volatile;
    st.written = tally.written;
    st.unshared = tally.unique;
    st.parked = tally.parked;
    st.refusals.pages = tally.refused;
    // Sized for the largest region (memory a region unregistered since does not keep).
    let largest = st
        .regions
        .values()
        .map(|r| r.pages.len())
        .max()
        .unwrap_or(0);
    scan.shrink_to(largest);
    st.scan = scan;
    Ok(Watch {
        candidates: tally.out,
        zero_probes: tally.zero_probes,
        collapsible,
    })
}

/// Most pages read per period for [`release_zero_probes`] (about a millisecond per thousand).
const MAX_ZERO_PROBES: usize = 16384;

/// Reads the pages that have just stopped changing after a write, or were just written after
/// waiting unchanged in the first-sighting map, and adds those that hold only zeros to
/// `candidates`, as zero pages (released by this period's commit, verified on frozen bytes
/// there): memory a program frees by zeroing it (a guest booted with `init_on_free=1`) comes
/// back in the period that sees the write (long-unchanged memory) or one period after its last
/// write (memory written often), instead of after the merge wait and the back-off its writes
/// earned. A page not zero waits as before; reading it costs a page copy through the kernel,
/// once per write episode.
pub(crate) fn release_zero_probes(candidates: &mut Vec<Candidate>, probes: &[Candidate]) {
    let probes = &probes[..probes.len().min(MAX_ZERO_PROBES)];
    let before = candidates.len();
    let mut reader = PageReader::new();
    let mut next = probes.iter();
    reader.read_each(probes.iter().map(Candidate::addr), |_, bytes| {
        let c = next.next().expect("one result per page read");
        if bytes.is_some_and(is_zero) {
            candidates.push(Candidate::new(c.region, c.addr(), Pre::Zero));
        }
    });
    if candidates.len() > before {
        // Batches are made from candidates in address order.
        candidates.sort_unstable_by_key(Candidate::addr);
    }
}

/// The unchanged periods this scan counts for region `r`: one, unless it came less than a period
/// after the watch was armed (and the period was not kicked).
fn unchanged_step(r: &mut RegionState, now: Instant, kicked: bool, config: &Config) -> u8 {
    match r.armed_at {
        Some(t) if !kicked && now.duration_since(t) < config.merge_period => 0,
        _ => {
            r.armed_at = None;
            1
        }
    }
}

/// Fills `scan.cats` with the categories of region `r`'s pages: bit 0 present, bit 1
/// file-backed, bit 2 zero pfn, bit 3 written. In the write-protect mode the scans also
/// write-protect the written pages again, and the zero page of an anonymous piece gets no
/// categories (see [`anonymous_pages`]).
fn scan_categories(
    mode: WatchMode,
    pagemap: &sys::Pagemap,
    r: &RegionState,
    scan: &mut ScanBuffers,
    store: bool,
) -> io::Result<()> {
    let ScanBuffers {
        regions: regions_buf,
        cats,
        entries,
    } = scan;
    let n = r.pages.len();
    let end = r.start + r.len();
    cats.clear();
    cats.resize(n, 0);
    if mode == WatchMode::UffdWp {
        regions_buf.clear();
        // One walk returns the categories of every page of the anonymous pieces and
        // write-protects the written ones again. It skips the store mappings merged pages live
        // in (see `store_mappings`), so a region with merged pages walks those in a second one.
        // A walk costs about as much per mapping whether it looks into it or skips it, and a
        // region with tens of thousands of merged runs pays that per walk: so the written and
        // the present anonymous pages come from the same walk, not from one walk each.
        pagemap.scan(r.start, end, &anonymous_pages(), regions_buf)?;
        // (Left out, a store mapping's pages read as mapping their copies: nothing changes.)
        if r.merged_ever && store {
            pagemap.scan(r.start, end, &store_mappings(), regions_buf)?;
        }
        mark_pages(cats, r.start, regions_buf);
    } else {
        entries.clear();
        pagemap.entries(r.start, n, entries)?;
        for (c, e) in cats.iter_mut().zip(entries.iter()) {
            if e & PM_PRESENT != 0 {
                *c |= 1;
                if e & PM_FILE != 0 {
                    *c |= 2;
                }
            }
        }
    }
    Ok(())
}

/// What the watch of one period adds up.
struct Tally {
    /// The candidates.
    out: Vec<Candidate>,
    /// Pages to read for zeros (see [`release_zero_probes`]).
    zero_probes: Vec<Candidate>,
    /// Anonymous pages written since the last period.
    written: u64,
    /// Present pages still changing.
    volatile: u64,
    /// Unchanged pages waiting as first sightings.
    unique: u64,
    /// Pages parked on the VMA budget.
    parked: u64,
    /// Pages the kernel would not freeze, waiting.
    refused: u64,
    /// Registered pages: room for every candidate is made at once.
    all_pages: usize,
}

/// The watch of one region's pages, and what it changes besides them.
struct RegionWatch<'a> {
    sh: &'a Shared,
    config: &'a Config,
    /// Unchanged periods this scan counts (see `unchanged_step`).
    step: u8,
    /// The period's number (see [`RegionWatch::on_beat`]).
    period: u64,
    /// The region's first address.
    start: usize,
    store: &'a mut Store,
    zero: &'a mut u64,
    stale_sightings: &'a mut usize,
    tally: &'a mut Tally,
    /// Reads pages for their checksums (checksum mode, COW-broken pages).
    reader: &'a mut PageReader,
}

impl RegionWatch<'_> {
    /// Updates every page of region `r` from its categories `cats`.
    fn pages(&mut self, r: &mut RegionState, cats: &[u8]) {
        let wp = self.sh.mode == WatchMode::UffdWp;
        let pages = r.pages.iter_mut().zip(cats.iter()).zip(r.sums.iter_mut());
        for (i, ((p, &c), sum)) in pages.enumerate() {
            // The two cases of almost every page while a merge goes on and after it, decided
            // without a branch per kind (the kinds of neighbouring pages alternate, so a branch
            // on each was mispredicted half of the time): a merged page still mapping its copy
            // (not present, or present and file-backed), and a unique page present, not the zero
            // page and not written (the write-protect scan tells; checksums are not compared
            // here). Both are handled below as well; this only skips to the next page.
            let merged_quiet = (p.kind == PageKind::Merged) & (c & 3 != 1);
            let unique_quiet = (p.kind == PageKind::Unique) & (c & 0b1101 == 1) & wp;
            let parked_quiet = (p.kind == PageKind::Parked) & (c & 0b1101 == 1) & wp;
            // (A refused page reads as written after its freeze: see `PageKind::Refused`.)
            let refused_quiet = (p.kind == PageKind::Refused) & (c & 0b0101 == 1);
            self.tally.unique += u64::from(unique_quiet);
            self.tally.parked += u64::from(parked_quiet);
            self.tally.refused += u64::from(refused_quiet);
            if merged_quiet | unique_quiet | parked_quiet | refused_quiet {
                continue;
            }
            self.page(self.start + i * PAGE, p, sum, c);
        }
    }

    /// Updates the page at `addr` (`p`, its checksum `sum`) from its categories `c`.
    fn page(&mut self, addr: usize, p: &mut Page, sum: &mut u64, c: u8) {
        let present = c & 1 != 0;
        match p.kind {
            PageKind::Merged => {
                // (The zero page over a zero hole is neither file-backed nor written.)
                if present && c & 2 == 0 && c & 4 == 0 {
                    // Written since the merge: the kernel gave it a private copy. Merging it
                    // again costs a freeze, a mapping and another copy-on-write fault if it
                    // is written again, so each break doubles its wait (to max_backoff).
                    self.store.drop_ref(p.sid);
                    p.kind = PageKind::Broken;
                    p.unchanged = 0;
                    p.back_off(self.config.max_backoff);
                    checksum_changed(self.reader, addr, sum);
                    self.sh.counters.cow_breaks.fetch_add(1, Ordering::Relaxed);
                }
            }
            PageKind::Foreign => {
                // (Not present: not touched since the merge, which maps no page table entry.
                // Read, it is the old copy all the same.)
                if present && c & 2 == 0 {
                    // Written: a private copy now, like a COW-broken page (the replaced
                    // store kept no count of it).
                    p.kind = PageKind::Broken;
                    p.unchanged = 0;
                    p.back_off(self.config.max_backoff);
                    checksum_changed(self.reader, addr, sum);
                    return;
                }
                if self.sh.store_uffd.is_some() {
                    self.unchanged_in_store_mapping(p, addr);
                }
            }
            PageKind::Broken => {
                // Private pages in store mappings: watched by checksum (there are few), merged
                // again through the store mappings' write-protection.
                if self.sh.store_uffd.is_none() || !present || c & 2 != 0 {
                    return;
                }
                if checksum_changed(self.reader, addr, sum) {
                    p.unchanged = 0;
                    p.writes = p.writes.saturating_add(1).min(self.config.max_backoff);
                    self.tally.volatile += 1;
                    return;
                }
                self.unchanged_in_store_mapping(p, addr);
            }
            PageKind::Zero => {
                if present && c & 4 == 0 {
                    p.kind = PageKind::Anon;
                    *self.zero -= 1;
                    self.anonymous(addr, p, sum, c);
                }
            }
            PageKind::Unique => self.unique(addr, p, sum, c),
            PageKind::Parked => {
                let present = c & 1 != 0;
                if present && c & 4 == 0 && !self.written(addr, sum, c) {
                    self.tally.parked += 1;
                    return;
                }
                p.kind = PageKind::Anon;
                self.anonymous(addr, p, sum, c);
            }
            PageKind::Refused => {
                if c & 0b0101 == 1 {
                    self.tally.refused += 1;
                    return;
                }
                p.kind = PageKind::Anon;
                self.anonymous(addr, p, sum, c);
            }
            PageKind::Anon => self.anonymous(addr, p, sum, c),
        }
    }

    /// A page waiting in the first-sighting map: it keeps waiting unless written or released.
    fn unique(&mut self, addr: usize, p: &mut Page, sum: &mut u64, c: u8) {
        let present = c & 1 != 0;
        if present && c & 4 == 0 {
            if !self.written(addr, sum, c) {
                self.tally.unique += 1;
                return;
            }
            p.kind = PageKind::Anon;
            p.unchanged = 0;
            p.epoch = p.epoch.wrapping_add(1);
            p.writes = p.writes.saturating_add(1).min(self.config.max_backoff);
            *self.stale_sightings += 1;
            self.tally.volatile += 1;
            self.tally.written += 1;
            // Long unchanged, now written: perhaps zeroed to be freed (a guest booted with
            // `init_on_free=1`). Read now, so that it comes back in this period's commit.
            self.probe_zero(addr);
            return;
        }
        p.kind = PageKind::Anon;
        *self.stale_sightings += 1;
        self.anonymous(addr, p, sum, c);
    }

    /// An anonymous page: a candidate once it stayed unchanged long enough, present and not the
    /// zero page.
    fn anonymous(&mut self, addr: usize, p: &mut Page, sum: &mut u64, c: u8) {
        let present = c & 1 != 0;
        if !present || c & 4 != 0 {
            p.unchanged = 0;
            return;
        }
        if self.written(addr, sum, c) {
            p.unchanged = 0;
            p.epoch = p.epoch.wrapping_add(1);
            p.writes = p.writes.saturating_add(1).min(self.config.max_backoff);
            self.tally.volatile += 1;
            self.tally.written += 1;
            return;
        }
        // Written before, quiet since the last period: maybe zeroed to be freed. Read now only
        // if its back-off would keep it waiting two periods more or longer (a page written once
        // or twice is a candidate a period later anyway: reading it now would only read it
        // twice, which a program filling fresh memory paid for in its first touches).
        let just_quiet = p.unchanged == 0 && p.writes > 0 && self.step > 0;
        p.unchanged = p.unchanged.saturating_add(self.step);
        let needed = self.config.merge_periods.max(p.writes);
        if just_quiet && p.unchanged.saturating_add(1) < needed {
            self.probe_zero(addr);
        }
        if p.unchanged >= needed {
            let out = &mut self.tally.out;
            if out.capacity() == 0 {
                // Room for every page left at once: a registered range becomes candidates all
                // together, and growing by doubling would copy and fault in tens of MiB.
                out.reserve(self.tally.all_pages);
            }
            out.push(Candidate::new(self.start, addr, Pre::None));
        } else {
            self.tally.volatile += 1;
        }
    }

    /// Reads the page at `addr` after the watch: if it holds only zeros, it is released in this
    /// period's commit (see [`release_zero_probes`]).
    fn probe_zero(&mut self, addr: usize) {
        self.tally
            .zero_probes
            .push(Candidate::new(self.start, addr, Pre::None));
    }

    /// Whether the present page at `addr` was written since the last period: the write-protect
    /// scan tells, or else its checksum.
    fn written(&mut self, addr: usize, sum: &mut u64, c: u8) -> bool {
        if self.sh.mode == WatchMode::UffdWp {
            c & 8 != 0
        } else {
            checksum_changed(self.reader, addr, sum)
        }
    }

    /// Counts one more unchanged period (as the scan counts) for the page at `addr` in a store
    /// mapping (COW-broken or on a replaced store): a candidate once it waited long enough, else
    /// volatile.
    fn unchanged_in_store_mapping(&mut self, p: &mut Page, addr: usize) {
        p.unchanged = p.unchanged.saturating_add(self.step);
        let needed = self.config.merge_periods.max(p.writes);
        if p.unchanged >= needed && self.on_beat(needed) {
            self.tally
                .out
                .push(Candidate::new(self.start, addr, Pre::None));
        } else {
            self.tally.volatile += 1;
        }
    }
}

impl RegionWatch<'_> {
    fn on_beat(&self, needed: u8) -> bool {
        on_beat(self.period, needed, self.config.merge_periods)
    }
}

/// Whether a page in a store mapping that waits `needed` periods may be a candidate in period
/// number `period`. Such pages never wait in the first-sighting map (they are read again
/// instead), so two with the same contents meet only as candidates of one period. Backed off
/// past the merge wait (`merge_periods`), a page is a candidate only in periods whose number is
/// a multiple of its wait rounded up to a power of two: twins backed off alike, or to different
/// powers, come up together, where waits counted from each one's last try could keep them apart
/// for ever.
fn on_beat(period: u64, needed: u8, merge_periods: u8) -> bool {
    needed <= merge_periods || period % u64::from(needed).next_power_of_two() == 0
}

/// Which period the watch runs in.
#[derive(Clone, Copy, Debug)]
pub(crate) struct PeriodClock {
    /// The caller asked for the period: it counts as a whole one.
    pub(crate) kicked: bool,
    /// The period's number, counted from the engine's start.
    pub(crate) period: u64,
}

/// Present pages, reported with `PAGE_IS_PFNZERO`, and with `PAGE_IS_FILE` where they may be file
/// pages. Whether a page is a file page costs the kernel a look at the page itself (7x the cost
/// of a walk that reads page table entries only). In the write-protect mode the mapping tells
/// instead: registered pieces that are write-protectable (`PAGE_IS_WPALLOWED`, a property of the
/// mapping) are the anonymous ones, the others are mappings of the store. So in that mode this
/// walks the anonymous pieces only, and the store mappings are walked apart when needed.
pub(crate) fn present_pages(mode: WatchMode) -> sys::ScanQuery {
    if mode == WatchMode::UffdWp {
        sys::ScanQuery {
            category_mask: PAGE_IS_PRESENT | PAGE_IS_WPALLOWED,
            return_mask: PAGE_IS_PRESENT | PAGE_IS_PFNZERO,
            ..Default::default()
        }
    } else {
        sys::ScanQuery {
            category_mask: PAGE_IS_PRESENT,
            return_mask: PAGE_IS_PRESENT | PAGE_IS_PFNZERO | PAGE_IS_FILE,
            ..Default::default()
        }
    }
}

/// The pages of the anonymous pieces of a region that are present (or swapped), but the zero
/// page: one walk, which also write-protects the written pages again
/// (`PM_SCAN_WP_MATCHING` protects the matching pages that are `PAGE_IS_WRITTEN`). With
/// `PM_SCAN_WP_MATCHING` the kernel skips every mapping that is not write-protectable
/// (`PAGE_IS_WPALLOWED`: registered with a context that has async write-protection), which
/// leaves out the store mappings.
///
/// The zero page, small or huge, is left out (the watch takes it for a page not present) and so
/// never write-protected: it cannot be written in place (a write maps a new page, reported as
/// written), and a write to a write-protected huge zero page splits it into small pages, where
/// an unprotected one gets a whole huge page in one fault. Unpopulated entries are left alone
/// too (a first touch there is the kernel's own fault, a huge page where it gives one).
fn anonymous_pages() -> sys::ScanQuery {
    sys::ScanQuery {
        flags: PM_SCAN_WP_MATCHING,
        category_mask: PAGE_IS_PFNZERO,
        category_inverted: PAGE_IS_PFNZERO,
        // Pages only (present or swapped): the kernel counts an unpopulated entry as written, and
        // protecting it would install a marker, a page table where there was none (and no huge
        // page for the first touch there).
        category_anyof_mask: PAGE_IS_PRESENT | PAGE_IS_SWAPPED,
        return_mask: PAGE_IS_PRESENT | PAGE_IS_WRITTEN | PAGE_IS_HUGE,
    }
}

/// The present pages of the store mappings in a region that are not the store's: written since
/// their merge (copy-on-write broken) or the zero page. Pages mapping their copies (every merged
/// page: they are mapped as they merge) are left out of the answer, and read as not present (so
/// `PAGE_IS_FILE` is never returned). The store mappings are registered with the second context,
/// which has no async write-protection, so they are the mappings that are not
/// `PAGE_IS_WPALLOWED`: a write-protect walk cannot see them, and their `PAGE_IS_WRITTEN` says
/// nothing (their entries carry no write-protect bit).
fn store_mappings() -> sys::ScanQuery {
    sys::ScanQuery {
        category_mask: PAGE_IS_PRESENT | PAGE_IS_WPALLOWED | PAGE_IS_FILE,
        category_inverted: PAGE_IS_WPALLOWED | PAGE_IS_FILE,
        return_mask: PAGE_IS_PRESENT | PAGE_IS_PFNZERO,
        ..Default::default()
    }
}

/// Adds the scan results `found` (ranges of a region starting at `start`) to the per-page
/// categories: bit 0 present, bit 1 file-backed, bit 2 zero pfn, bit 3 written, bit 4 mapped by
/// a huge page.
fn mark_pages(cats: &mut [u8], start: usize, found: &[PageRegion]) {
    for pr in found {
        let mut bits = 0;
        for (cat, bit) in [
            (PAGE_IS_PRESENT, 1),
            (PAGE_IS_FILE, 2),
            (PAGE_IS_PFNZERO, 4),
            (PAGE_IS_WRITTEN, 8),
            (PAGE_IS_HUGE, CAT_HUGE),
        ] {
            if pr.categories & cat != 0 {
                bits |= bit;
            }
        }
        let (lo, hi) = (pr.start as usize - start, pr.end as usize - start);
        for c in &mut cats[lo / PAGE..hi / PAGE] {
            *c |= bits;
        }
    }
}

/// Scratch space of [`watch`]: per-page categories and what the scans return.
#[derive(Default)]
pub(crate) struct ScanBuffers {
    regions: Vec<PageRegion>,
    cats: Vec<u8>,
    entries: Vec<u64>,
}

impl ScanBuffers {
    /// Gives back room beyond twice what a region of `pages` pages needs.
    fn shrink_to(&mut self, pages: usize) {
        if self.cats.capacity() > 2 * pages {
            self.cats.shrink_to(pages);
        }
        if self.entries.capacity() > 2 * pages {
            self.entries.shrink_to(pages);
        }
    }

    /// The memory held.
    pub(crate) fn bytes(&self) -> usize {
        self.regions.capacity() * std::mem::size_of::<PageRegion>()
            + self.cats.capacity()
            + self.entries.capacity() * std::mem::size_of::<u64>()
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn twins_backed_off_differently_still_come_up_in_one_period() {
        // Within the longer wait (rounded up to a power of two), some period finds both on beat.
        for a in 1..=16u8 {
            for b in 1..=16u8 {
                let span = u64::from(a.max(b)).next_power_of_two();
                for start in 0..span {
                    assert!(
                        (start..start + span).any(|t| on_beat(t, a, 2) && on_beat(t, b, 2)),
                        "waits {a} and {b} from period {start}"
                    );
                }
            }
        }
        // At the merge wait or less, every period is one.
        assert!((0..8).all(|t| on_beat(t, 2, 2) && on_beat(t, 1, 2)));
        assert!(!on_beat(5, 16, 2) && on_beat(32, 16, 2) && on_beat(24, 5, 2));
    }

    use super::*;
    use crate::state::Page;
    use std::os::fd::AsRawFd;

    /// Each range found adds its categories to its pages: present 1, file-backed 2, zero pfn 4,
    /// written 8; other categories add nothing, and pages outside every range get none.
    #[test]
    fn scan_results_become_per_page_categories() {
        let start = 0x10_0000usize;
        let at = |k: usize| (start + k * PAGE) as u64;
        let range = |a: usize, b: usize, categories: u64| PageRegion {
            start: at(a),
            end: at(b),
            categories,
        };
        let found = [
            range(0, 2, PAGE_IS_PRESENT | PAGE_IS_WRITTEN),
            range(2, 3, PAGE_IS_PRESENT | PAGE_IS_PFNZERO | PAGE_IS_WPALLOWED),
            range(4, 6, PAGE_IS_PRESENT | PAGE_IS_FILE),
            range(6, 7, PAGE_IS_WRITTEN | PAGE_IS_SWAPPED),
            // A second walk's range over a page the first reported adds to it.
            range(1, 2, PAGE_IS_PFNZERO),
        ];
        let mut cats = vec![0u8; 8];
        mark_pages(&mut cats, start, &found);
        assert_eq!(cats, [0b1001, 0b1101, 0b0101, 0, 0b0011, 0b0011, 0b1000, 0]);
    }

    /// Page `k` of a test region: its address.
    fn page(base: usize, k: usize) -> *mut u8 {
        (base + k * PAGE) as *mut u8
    }

    /// A region laid out as the engine leaves one with merged pages, on the real kernel: pieces
    /// of private anonymous memory registered for async write-protection (as the engine
    /// registers memory; without missing faults, which nothing here answers) and pieces that are
    /// private mappings of a file registered with a second context without it (the store
    /// mappings). The watch's walks give every page the categories the watch decides by, and
    /// the written pages are write-protected again: a second scan finds them unwritten, and a
    /// new write is found.
    #[test]
    fn a_region_with_merged_pages_gets_every_page_category_and_is_protected_again() {
        const N: usize = 12;
        let uffd = sys::Uffd::open(UFFD_FEATURE_WP_ASYNC | UFFD_FEATURE_WP_UNPOPULATED).unwrap();
        if uffd.features() & UFFD_FEATURE_WP_ASYNC == 0 || !sys::pagemap_scan_supported() {
            eprintln!("skipped: this kernel lacks async write-protection or PAGEMAP_SCAN");
            return;
        }
        let base = sys::mmap_anonymous(N * PAGE).unwrap() as usize;
        for k in 0..N {
            if k != 2 {
                // SAFETY: a page of the fresh mapping above, which only this test uses.
                unsafe { std::ptr::write_volatile(page(base, k), k as u8 + 1) };
            }
        }
        // SAFETY: as above; page 2 is read only, so it maps the zero page.
        unsafe { std::ptr::read_volatile(page(base, 2)) };
        uffd.register(base, N * PAGE, UFFDIO_REGISTER_MODE_WP)
            .unwrap();
        let pagemap = sys::Pagemap::open().unwrap();
        pagemap.write_protect(base, base + N * PAGE).unwrap();
        // The store: pages 4, 5 and 6 each map a page of it on their own, 8, 9 and 10 one run.
        let store = sys::memfd_create(c"watch-test-store").unwrap();
        sys::ftruncate(store.as_raw_fd(), 16 * PAGE as u64).unwrap();
        let store_uffd = sys::Uffd::open(UFFD_FEATURE_WP_HUGETLBFS_SHMEM)
            .ok()
            .filter(|u| u.features() & UFFD_FEATURE_WP_HUGETLBFS_SHMEM != 0);
        for (k, n, copy) in [(4, 1, 9), (5, 1, 3), (6, 1, 12), (8, 3, 0)] {
            let offset = (copy * PAGE) as u64;
            // SAFETY: pages of this test's region, replaced by a mapping of the store (nothing
            // refers to them).
            unsafe { sys::mmap_private_fixed(page(base, k), n * PAGE, store.as_raw_fd(), offset) }
                .unwrap();
            if let Some(u) = &store_uffd {
                u.register(base + k * PAGE, n * PAGE, UFFDIO_REGISTER_MODE_WP)
                    .unwrap();
            }
        }
        // SAFETY: pages of this test's region, which only this thread uses.
        unsafe {
            // Written since the protection: anonymous pages 0 and 11; store page 5 (its copy is
            // broken).
            std::ptr::write_volatile(page(base, 0), 100);
            std::ptr::write_volatile(page(base, 11), 100);
            std::ptr::write_volatile(page(base, 5), 100);
            // Read: the store pages 4, 8, 9 and 10 map the file's pages.
            for k in [4, 8, 9, 10] {
                std::ptr::read_volatile(page(base, k));
            }
            // Released: page 3 has no page (nor a write-protect marker) left.
            sys::madvise(page(base, 3), PAGE, libc::MADV_DONTNEED).unwrap();
        }
        let r = RegionState {
            merged_ever: true,
            ..RegionState::new(base, vec![Page::default(); N])
        };
        let mut scan = ScanBuffers::default();
        let mut categories = || {
            scan_categories(WatchMode::UffdWp, &pagemap, &r, &mut scan, true).unwrap();
            scan.cats.clone()
        };
        // Present 1, zero pfn 4, written 8 (anonymous pieces only). The zero page of an
        // anonymous piece is left out of the walk (never write-protected): no categories. A store
        // mapping's page mapping the store is left out too (merged pages are mapped as they
        // merge): no categories; one written since (page 5) is present.
        let (anon, zero, file, written) = (1, 0, 0, 0b1001);
        let mut want = [
            written, anon, zero, 0, file, anon, 0, anon, file, file, file, written,
        ];
        let first = categories();
        // The released page: no page, and written on kernels whose walks count an entry with
        // no page and no write-protect marker as written (both walks then arm a marker there).
        assert!(first[3] == 0 || first[3] == 8, "released page: {first:?}");
        want[3] = first[3];
        assert_eq!(first, want, "first scan");
        want[3] = 0;
        want[0] = anon;
        want[11] = anon;
        assert_eq!(
            categories(),
            want,
            "the written pages were not protected again"
        );
        // SAFETY: as above.
        unsafe { std::ptr::write_volatile(page(base, 1), 100) };
        want[1] = written;
        assert_eq!(categories(), want, "a write after the second scan");
        drop(uffd);
        drop(store_uffd);
        // SAFETY: this test's region; nothing refers to it any more.
        unsafe { sys::munmap(base as *mut u8, N * PAGE) }.unwrap();
    }

    /// The watch's scratch keeps its room between periods, but not more than twice what the
    /// largest region needs.
    #[test]
    fn watch_scratch_keeps_room_for_the_largest_region_only() {
        let mut b = ScanBuffers::default();
        b.cats.resize(1 << 20, 0);
        b.entries.resize(1 << 20, 0);
        b.cats.clear();
        b.entries.clear();
        b.shrink_to(1 << 19);
        assert!(b.cats.capacity() >= 1 << 20 && b.entries.capacity() >= 1 << 20);
        assert!(b.bytes() >= 9 << 20);
        b.shrink_to(1000);
        assert!((1000..1 << 19).contains(&b.cats.capacity()));
        assert!((1000..1 << 19).contains(&b.entries.capacity()));
        assert!(b.bytes() < 9 << 19);
    }
}
