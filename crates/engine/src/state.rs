//! The engine's state: what it knows of every registered page ([`Page`], [`RegionState`]), what it
//! keeps between periods ([`State`], behind the state lock) and what its threads share
//! ([`Shared`]). Each stage's own kept data is defined with the stage: the first-sighting map in
//! `sightings`, the watch's scratch in `watch`, read-ahead results in `read_ahead`.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

use pageone_index::KeyId;
use pageone_sync::lock;
use pageone_sys as sys;

use crate::access::PAGE;
use crate::changes::ChangeLog;
use crate::config::{Config, WatchMode};
use crate::freeze::FrozenRange;
use crate::huge::Collapsed;
use crate::parking::Parking;
use crate::read_ahead::{AheadBlock, AheadJob};
use crate::sightings::FirstSightings;
use crate::store::Store;
use crate::stranded::Stranded;
use crate::watch::ScanBuffers;

/// What a registered page is, as the engine last saw it (owned by the engine thread).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum PageKind {
    /// Private anonymous memory, watched for writes.
    #[default]
    Anon,
    /// Maps a stable copy of the current store (copy-on-write).
    Merged,
    /// Released as a zero page: its address stays empty until touched, when the fault thread
    /// maps the shared zero page.
    Zero,
    /// A merged page that was written: private again, inside a file-backed mapping of the store
    /// that `UFFDIO_MOVE` cannot freeze. It is watched by checksum and frozen for a new merge with
    /// synchronous write-protection through the store mappings' own userfaultfd (`store_uffd`).
    Broken,
    /// An unchanged page that matched nothing: it waits in the first-sighting map (no work per
    /// period) until a duplicate shows up or it is written.
    Unique,
    /// A page merged onto a store this engine has since replaced (its daemon was lost and another
    /// joined): it still maps that store's copy, and is merged again onto the current store like a
    /// COW-broken page (the copy is in a store mapping). Written, it becomes `Broken`.
    Foreign,
    /// An unchanged page whose merge the VMA budget could not afford: it waits, at no cost per
    /// period, until the budget has room again (the limit was raised, or mappings went away), or
    /// until it is written.
    Parked,
    /// An unchanged page the kernel would not freeze (its mapping is not read/write, or locked
    /// where the engine's locked area could not be locked: see the `locking` module):
    /// it waits, at no cost per period, until the engine tries refused pages again (see the
    /// `refusals` module), or until it is dropped. Writes do not end the wait: after a freeze
    /// that could not move it, the page reads as written to the watch (see `freeze::Rearm`), and
    /// a merge is decided on the bytes frozen at the next try anyway.
    Refused,
}

impl PageKind {
    /// Pages living in a store mapping that is not (or no longer) a counted merge: frozen for a
    /// merge with the store mappings' write-protection, not with `UFFDIO_MOVE`.
    pub(crate) fn in_store_mapping(self) -> bool {
        self == PageKind::Broken || self == PageKind::Foreign
    }
}

#[derive(Clone, Copy, Default)]
pub(crate) struct Page {
    pub(crate) sid: KeyId,
    pub(crate) kind: PageKind,
    pub(crate) unchanged: u8,
    pub(crate) writes: u8,
    /// Incremented on every write seen, so a first-sighting entry can tell it is stale.
    pub(crate) epoch: u8,
}

// One per registered page: 8 bytes.
const _: () = assert!(std::mem::size_of::<Page>() == 8);
// A page's first state is all-zero bytes (see `Page::fresh`).
const _: () = assert!(PageKind::Anon as u8 == 0);

impl Page {
    /// `n` pages in their first state (`Page::default()`), in memory left untouched until an
    /// entry is written (the kernel's zero page: `alloc_zeroed` of a large block maps fresh
    /// memory). A region handed to the kernel's KSM never writes its entries: 1 MiB per 512 MiB
    /// otherwise written with defaults and kept for the region's life.
    pub(crate) fn fresh(n: usize) -> Vec<Page> {
        if n == 0 {
            return Vec::new();
        }
        let layout = std::alloc::Layout::array::<Page>(n).expect("a region's page table size");
        // SAFETY: `layout` has a nonzero size (n >= 1, and a Page is 8 bytes).
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) }.cast::<Page>();
        if ptr.is_null() {
            std::alloc::handle_alloc_error(layout);
        }
        // SAFETY: `ptr` is a fresh allocation of the global allocator with the layout of a
        // `Vec<Page>` of capacity n, and n all-zero pages are initialized values: a `KeyId` of 0,
        // `PageKind::Anon` (discriminant 0, asserted above) and zero counters, which is
        // `Page::default()` (a test compares them).
        unsafe { Vec::from_raw_parts(ptr, n, n) }
    }

    /// Doubles the periods this page waits before its next merge attempt (two at least), up to
    /// `max`: for pages whose merges keep failing or being undone.
    pub(crate) fn back_off(&mut self, max: u8) {
        self.writes = self.writes.max(1).saturating_mul(2).min(max);
    }
}

pub(crate) struct RegionState {
    pub(crate) start: usize,
    pub(crate) pages: Vec<Page>,
    /// Where the engine's mappings over the region's pages are locked (see the `locking`
    /// module): offsets from `start`.
    pub(crate) locked: crate::ranges::RangeSet,
    /// Whether any page was ever merged: only then does the region contain mappings of the store
    /// that the watch must scan separately (write-protect scans skip them).
    pub(crate) merged_ever: bool,
    /// When the watch was armed, until a scan a whole period later: a scheduled scan that comes
    /// sooner does not count as an unchanged period (pages merge after `merge_periods` whole
    /// periods, however registration fell between scans).
    pub(crate) armed_at: Option<Instant>,
    /// Checksums of the last period (checksum mode only).
    pub(crate) sums: Vec<u64>,
    /// Whether the kernel mapped huge pages here (see the `huge` module).
    pub(crate) huge_seen: bool,
    /// Handed to the kernel's KSM whole (see the `ksm` module): registered in name only (so that
    /// nothing registers it again), no longer watched or merged by the engine.
    pub(crate) to_ksm: bool,
    /// The kernel refuses to freeze its pages (see `ksm::refuses_pageone`): to be handed to the
    /// kernel's KSM whole at the end of the period.
    pub(crate) wants_ksm: bool,
    /// What its merges cost in mappings so far, and the pages refused.
    pub(crate) spending: Spending,
    /// The same per chunk of `ksm::CHUNK_PAGES` pages from `start` (grown as merges reach
    /// them), merges the budget refused counted as if made and merges of pages onto the copies
    /// made of them left out (see `CommitCtx::charge_chunk`), and whether the chunk is to be
    /// handed to the kernel's KSM (see `ksm::better_with_ksm`).
    pub(crate) chunks: Vec<Chunk>,
}

/// What merges cost in a chunk of a region, and whether the chunk goes to the kernel's KSM.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Chunk {
    pub(crate) spending: Spending,
    /// Pages of the chunk whose duplicates in the same batch were left out for the kernel's KSM
    /// (see `ksm::twins_went_to_ksm`).
    pub(crate) twins_to_ksm: u64,
    pub(crate) wants_ksm: bool,
}

/// Pages merged in a region and the mappings (VMAs) counted for them (see
/// `ksm::better_with_ksm`), and pages the kernel refused to freeze there (see
/// `ksm::refuses_pageone`).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Spending {
    pub(crate) pages: u64,
    pub(crate) vmas: u64,
    pub(crate) refused: u64,
}

impl RegionState {
    /// A region of `pages` at `start` with nothing else known yet: nothing merged ever, not
    /// armed, no checksums, no huge pages seen, not the kernel's KSM's.
    pub(crate) fn new(start: usize, pages: Vec<Page>) -> Self {
        Self {
            start,
            pages,
            locked: Default::default(),
            merged_ever: false,
            armed_at: None,
            sums: Vec::new(),
            huge_seen: false,
            to_ksm: false,
            wants_ksm: false,
            spending: Spending::default(),
            chunks: Vec::new(),
        }
    }

    /// The chunk holding page `index`.
    pub(crate) fn chunk_mut(&mut self, index: usize) -> &mut Chunk {
        let c = index / crate::ksm::CHUNK_PAGES;
        if self.chunks.len() <= c {
            self.chunks.resize(c + 1, Chunk::default());
        }
        &mut self.chunks[c]
    }

    /// Whether page `index` is to be handed to the kernel's KSM (its region or its chunk).
    pub(crate) fn wants_ksm_at(&self, index: usize) -> bool {
        self.wants_ksm
            || self
                .chunks
                .get(index / crate::ksm::CHUNK_PAGES)
                .is_some_and(|c| c.wants_ksm)
    }

    pub(crate) fn len(&self) -> usize {
        self.pages.len() * PAGE
    }

    /// Locks what the engine just mapped over `[addr, addr + len)` where it replaced locked
    /// pages (see the `locking` module).
    pub(crate) fn relock(&self, addr: usize, len: usize) {
        crate::locking::relock(&self.locked, self.start, addr, len);
    }

    /// Forgets where in `[addr, addr + len)` the program unlocked what the engine locked,
    /// before the engine replaces the mappings there (see `locking::forget_unlocked`).
    pub(crate) fn forget_unlocked(&mut self, addr: usize, len: usize) {
        crate::locking::forget_unlocked(&mut self.locked, self.start, addr, len);
    }
}

/// The region holding `addr`, if any.
pub(crate) fn region_at(
    regions: &BTreeMap<usize, RegionState>,
    addr: usize,
) -> Option<&RegionState> {
    let (_, r) = regions.range(..=addr).next_back()?;
    (addr < r.start + r.len()).then_some(r)
}

/// The region holding `addr`, if any, to change.
pub(crate) fn region_at_mut(
    regions: &mut BTreeMap<usize, RegionState>,
    addr: usize,
) -> Option<&mut RegionState> {
    let (_, r) = regions.range_mut(..=addr).next_back()?;
    (addr < r.start + r.len()).then_some(r)
}

/// The region (its start), index and state of the registered page holding `addr`.
pub(crate) fn page_at(
    regions: &BTreeMap<usize, RegionState>,
    addr: usize,
) -> Option<(usize, usize, &Page)> {
    let (&start, r) = regions.range(..=addr).next_back()?;
    let index = (addr - start) / PAGE;
    Some((start, index, r.pages.get(index)?))
}

/// The registered pages of `range`, in every region that meets it, to be changed.
pub(crate) fn pages_in_mut(
    regions: &mut BTreeMap<usize, RegionState>,
    range: std::ops::Range<usize>,
) -> impl Iterator<Item = &mut Page> + '_ {
    let (start, end) = (range.start, range.end);
    regions
        .range_mut(..end)
        .rev()
        .map(|(_, r)| r)
        .take_while(move |r| r.start + r.len() > start)
        .flat_map(move |r| {
            let (lo, hi) = (r.start.max(start), (r.start + r.len()).min(end));
            let first = r.start;
            r.pages[(lo - first) / PAGE..(hi - first) / PAGE].iter_mut()
        })
}

/// State owned by whoever holds the lock: the engine thread during a period, an API call otherwise.
pub(crate) struct State {
    pub(crate) regions: BTreeMap<usize, RegionState>,
    pub(crate) store: Store,
    /// The scratch area frozen pages are moved into (`SCRATCH_SLOTS` pages; see `freeze::Scratch`).
    pub(crate) scratch: usize,
    pub(crate) pagemap: Arc<sys::Pagemap>,
    pub(crate) unshared: u64,
    /// Pages parked on the VMA budget at the last watch.
    pub(crate) parked: u64,
    /// Pages the kernel would not freeze, and when they are tried again.
    pub(crate) refusals: crate::refusals::Refusals,
    pub(crate) volatile: u64,
    /// Anonymous pages written since the period before the last watch.
    pub(crate) written: u64,
    pub(crate) zero: u64,
    /// VMAs of the process: counted at the start of each period, then kept by the committer.
    pub(crate) vmas: usize,
    /// The process's VMAs when memory was first registered (0 until then): what is left of the
    /// VMA budget above them is the engine's room, spent by profit (see
    /// `commit::pages_per_vma_wanted`).
    pub(crate) base_vmas: usize,
    /// First sightings: hash of contents -> (address, epoch) of a UNIQUE page.
    pub(crate) unstable: FirstSightings,
    /// Scratch space of the watch, kept between periods.
    pub(crate) scan: ScanBuffers,
    /// UNIQUE pages written (or released) since the last sweep: their first-sighting entries are
    /// stale until `sweep_first_sightings` drops them.
    pub(crate) stale_sightings: usize,
    /// Periods did work since the C heap's free memory was last returned.
    pub(crate) heap_dirty: bool,
    /// Whether a copy another process made for a page waiting here was taken since the period
    /// began, and relooks skipped in a row because such copies kept coming (see `relook_due`).
    pub(crate) offered: bool,
    pub(crate) relooks_skipped: u32,
    /// Offers fetched between periods for content still waiting here (see
    /// `period::fetch_offers_for_forgotten`), each a slot held for this process: the next batch
    /// adopts them, as it does its lookup's.
    pub(crate) offers_aside: crate::remote::Offers,
    /// Read-ahead of newly registered pages (see `read_ahead`): jobs still running, and the
    /// results of finished ones by address, with the periods since they were installed.
    pub(crate) ahead_jobs: Vec<AheadJob>,
    pub(crate) ahead: Vec<AheadBlock>,
    pub(crate) ahead_age: u32,
    /// Huge pages collapsed again (see the `huge` module).
    pub(crate) huge: Collapsed,
    /// Store mappings left where memory was unregistered at the mapping limit (see the
    /// `stranded` module).
    pub(crate) stranded: Vec<Stranded>,
}

impl State {
    /// Pages of all registered regions.
    pub(crate) fn registered_pages(&self) -> usize {
        self.regions.values().map(|r| r.pages.len()).sum()
    }

    /// No region registered yet.
    pub(crate) fn new(store: Store, scratch: usize, pagemap: sys::Pagemap) -> Self {
        State {
            regions: BTreeMap::new(),
            store,
            scratch,
            pagemap: Arc::new(pagemap),
            unshared: 0,
            parked: 0,
            refusals: Default::default(),
            volatile: 0,
            written: 0,
            zero: 0,
            vmas: 0,
            base_vmas: 0,
            unstable: FirstSightings::default(),
            scan: ScanBuffers::default(),
            stale_sightings: 0,
            heap_dirty: false,
            offered: false,
            relooks_skipped: 0,
            offers_aside: Vec::new(),
            ahead_jobs: Vec::new(),
            ahead: Vec::new(),
            ahead_age: 0,
            huge: Collapsed::default(),
            stranded: Vec::new(),
        }
    }
}

pub(crate) struct Shared {
    pub(crate) uffd: sys::Uffd,
    /// Registered (synchronous write-protect) on every mapping of the store, to freeze COW-broken
    /// pages for a new merge; `None` when the kernel lacks write-protection of shmem.
    pub(crate) store_uffd: Option<sys::Uffd>,
    pub(crate) mode: WatchMode,
    pub(crate) reg_mode: u64,
    /// How a frozen run is registered while it is frozen (missing faults), when registered
    /// memory is registered for write-protection only: its pages are moved out, and a touch must
    /// wait for them instead of getting a fresh page (see `freeze::Rearm`). `None` (checksum
    /// watching): registered memory is registered for missing faults throughout.
    pub(crate) freeze_mode: Option<u64>,
    /// Whether the configured daemon could not be joined at the start (reported as the daemon
    /// link while there is none).
    pub(crate) daemon_unreachable: bool,
    /// Held by the engine thread for a whole period and by register/unregister: the set of
    /// registered regions never changes while a period reads or remaps their pages.
    pub(crate) period_lock: Mutex<()>,
    /// Taken for short sections only (by the classifier, the committer and the API), so that
    /// classification and commits of one period overlap.
    pub(crate) state: Mutex<State>,
    pub(crate) config: Mutex<Config>,
    /// The run currently frozen, as the fault thread sees it: it leaves faults there to the
    /// committer, which wakes them after the replacement.
    pub(crate) frozen: FrozenRange,
    /// Frozen pages that could not be put back yet (see the `parking` module).
    pub(crate) parking: Parking,
    /// Changes to registered memory reported by the kernel and not applied to the regions yet
    /// (see the `changes` module). Lock order: the state lock, the change log, the frozen range's
    /// gate.
    pub(crate) changes: Mutex<ChangeLog>,
    /// Where copies are moved into place from (see the `staging` module).
    pub(crate) staging: crate::staging::StagingArea,
    /// Where frozen locked pages are moved into (see the `locking` module); `None` where it could
    /// not be made.
    pub(crate) locked_scratch: Option<crate::locking::LockedScratch>,
    pub(crate) stop: AtomicBool,
    /// Set once every region is unregistered at the stop: the fault thread ends then (it must
    /// answer faults and read events until then).
    pub(crate) faults_done: AtomicBool,
    /// The fault thread's id once it runs (else 0), for the committer to share a CPU with it
    /// (see the `colocate` module).
    pub(crate) fault_thread_id: AtomicI32,
    pub(crate) stop_fd: std::os::fd::OwnedFd,
    /// The process's `/proc/self/maps`, asked for the mappings of a range (the store mappings
    /// among the pages the program drops or unregisters).
    pub(crate) maps: sys::Maps,
    /// Periods completed, with a condvar for `wait_periods`.
    pub(crate) periods: Mutex<u64>,
    /// Whether the engine is idle (periods in a row that changed little: see `period`); the
    /// watch then walks store mappings less often.
    pub(crate) settled: AtomicBool,
    pub(crate) period_cv: Condvar,
    pub(crate) kick: (Mutex<bool>, Condvar),
    /// When the next period should start: a period after the latest registration, so newly
    /// armed memory counts its first unchanged period at the first scan instead of waiting for a
    /// second one; but no later than two periods after the first registration since the last
    /// scan (registering all the time cannot hold periods off). `(latest + period, cap)`.
    pub(crate) not_before: Mutex<Option<(Instant, Instant)>>,
    pub(crate) counters: Counters,
    /// The pool of pages the program marks free (PPR), when it attached one.
    pub(crate) recycler: Mutex<Option<Arc<pageone_recycler::Pool>>>,
    /// Slots of tickets whose page the committer released this period.
    pub(crate) recycled_slots: Mutex<Vec<u32>>,
    /// CPU clocks of the engine's threads (engine, committer, faults, workers).
    pub(crate) clocks: Arc<Mutex<Vec<sys::CpuClock>>>,
}

impl Shared {
    /// Records the calling thread's CPU clock for `Stats::worker_cpu_ns`.
    pub(crate) fn count_cpu_of_this_thread(&self) {
        if let Ok(c) = sys::CpuClock::current() {
            lock(&self.clocks).push(c);
        }
    }

    /// CPU time the engine's threads used so far, in nanoseconds.
    pub(crate) fn cpu_ns(&self) -> u64 {
        lock(&self.clocks).iter().map(sys::CpuClock::ns).sum()
    }

    /// Pages registered now.
    pub(crate) fn registered_pages(&self) -> usize {
        lock(&self.state).registered_pages()
    }
}

#[derive(Default)]
pub(crate) struct Counters {
    pub(crate) scanned: AtomicU64,
    pub(crate) merges: AtomicU64,
    pub(crate) cow_breaks: AtomicU64,
    pub(crate) mismatches: AtomicU64,
    pub(crate) vma_limited: AtomicU64,
    pub(crate) vmas: AtomicU64,
    pub(crate) vma_limit: AtomicU64,
    pub(crate) recycled: AtomicU64,
    /// Daemons joined after the start (see `join_again`).
    pub(crate) joins: AtomicU64,
    /// Pages made private when leaving replaced stores (see `leave_replaced_stores`).
    pub(crate) left_private: AtomicU64,
    /// Missing faults answered by the fault thread.
    pub(crate) faults_answered: AtomicU64,
    /// Huge pages collapsed again (see the `huge` module).
    pub(crate) huge_restored: AtomicU64,
}

#[cfg(test)]
mod tests {
    use super::Page;

    /// Fresh pages are in their first state, as `Page::default()` makes them.
    #[test]
    fn fresh_pages_are_default_pages() {
        for n in [0, 1, 511, 131_072] {
            let fresh = Page::fresh(n);
            assert_eq!(fresh.len(), n);
            let d = Page::default();
            assert!(fresh.iter().all(|p| p.sid == d.sid
                && p.kind == d.kind
                && p.unchanged == d.unchanged
                && p.writes == d.writes
                && p.epoch == d.epoch));
        }
    }
}
