//! The engine thread (watcher + committer), its workers, and the fault thread.

use pageone_sync::lock;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use pageone_index::{KeyId, WordKey};
use pageone_sys::{self as sys, uapi::*};

use crate::pool::Pool;
use crate::store::Store;
use crate::{Config, EngineError, Stats, WatchMode};

const PAGE: usize = sys::PAGE_SIZE;
const WORDS: usize = PAGE / 8;
/// Longest run frozen at once: bounds how long a writer can be blocked and the scratch size.
const MAX_RUN: usize = 512;
/// Candidates classified together and handed to the committer as one batch (16 MiB of pages):
/// small enough that the committer's frees feed the next batch's copies and the two stages overlap
/// finely, large enough that per-batch costs stay small.
const BATCH: usize = 4096;
/// The same with a daemon (4 MiB of pages). The processes of a scope merge the same contents at
/// about the same time, comparing their pages with copies another process just made: in
/// alternating runs four processes took up to 14% more CPU with 16 MiB batches, while one
/// process alone took 5% less (docs/benchmarks.md).
const REMOTE_BATCH: usize = 1024;

/// Page kinds (per registered page, owned by the engine thread).
const ANON: u8 = 0;
const MERGED: u8 = 1;
const ZERO: u8 = 2;
/// A merged page that was written: private again, inside a file-backed mapping of the store that
/// `UFFDIO_MOVE` cannot freeze. It is watched by checksum and frozen for a new merge with
/// synchronous write-protection through the store mappings' own userfaultfd (`store_uffd`).
const BROKEN: u8 = 3;
/// An unchanged page that matched nothing: it waits in the first-sighting map (no work per period)
/// until a duplicate shows up or it is written.
const UNIQUE: u8 = 4;
/// A page merged onto a store this engine has since replaced (its daemon was lost and another
/// joined): it still maps that store's copy, and is merged again onto the current store like a
/// COW-broken page (the copy is in a store mapping). Written, it becomes `BROKEN`.
const FOREIGN: u8 = 5;

/// Pages living in a store mapping that is not (or no longer) a counted merge: frozen for a merge
/// with the store mappings' write-protection, not with `UFFDIO_MOVE`.
fn in_store_mapping(kind: u8) -> bool {
    kind == BROKEN || kind == FOREIGN
}

#[derive(Clone, Copy, Default)]
struct Page {
    sid: KeyId,
    kind: u8,
    unchanged: u8,
    writes: u8,
    /// Incremented on every write seen, so a first-sighting entry can tell it is stale.
    epoch: u8,
}

impl Page {
    /// Doubles the periods this page waits before its next merge attempt (two at least), up to
    /// `max`: for pages whose merges keep failing or being undone.
    fn back_off(&mut self, max: u8) {
        self.writes = self.writes.max(1).saturating_mul(2).min(max);
    }
}

struct RegionState {
    start: usize,
    pages: Vec<Page>,
    /// Whether any page was ever merged: only then does the region contain mappings of the store
    /// that the watch must scan separately (write-protect scans skip them).
    merged_ever: bool,
    /// When the watch was armed, until a scan a whole period later: a scheduled scan that comes
    /// sooner does not count as an unchanged period (pages merge after `merge_periods` whole
    /// periods, however registration fell between scans).
    armed_at: Option<Instant>,
    /// Checksums of the last period (checksum mode only).
    sums: Vec<u64>,
}

impl RegionState {
    fn len(&self) -> usize {
        self.pages.len() * PAGE
    }
}

/// State owned by whoever holds the lock: the engine thread during a period, an API call otherwise.
struct State {
    regions: BTreeMap<usize, RegionState>,
    store: Store,
    scratch: usize,
    pagemap: Arc<sys::Pagemap>,
    unshared: u64,
    volatile: u64,
    zero: u64,
    /// VMAs of the process: counted at the start of each period, then kept by the committer.
    vmas: usize,
    /// First sightings: hash of contents -> (address, epoch) of a UNIQUE page.
    unstable: FirstSightings,
    /// Scratch space of the watch, kept between periods.
    scan: ScanBuffers,
    /// UNIQUE pages written (or released) since the last sweep: their first-sighting entries are
    /// stale until [`sweep_first_sightings`] drops them.
    stale_sightings: usize,
    /// Periods did work since the C heap's free memory was last returned.
    heap_dirty: bool,
    /// Whether a copy another process made for a page waiting here was taken since the period
    /// began, and relooks skipped in a row because such copies kept coming (see `relook_due`).
    offered: bool,
    relooks_skipped: u32,
    /// Read-ahead of newly registered pages (see `read_ahead`): jobs still running, and the
    /// results of finished ones by address, with the periods since they were installed.
    ahead_jobs: Vec<AheadJob>,
    ahead: Vec<AheadBlock>,
    ahead_age: u32,
}

struct Shared {
    uffd: sys::Uffd,
    /// Registered (synchronous write-protect) on every mapping of the store, to freeze COW-broken
    /// pages for a new merge; `None` when the kernel lacks write-protection of shmem.
    store_uffd: Option<sys::Uffd>,
    mode: WatchMode,
    reg_mode: u64,
    /// Why there is no daemon link although one was configured ("unreachable"), else "none".
    daemon_note: &'static str,
    /// Held by the engine thread for a whole period and by register/unregister: the set of
    /// registered regions never changes while a period reads or remaps their pages.
    period_lock: Mutex<()>,
    /// Taken for short sections only (by the classifier, the committer and the API), so that
    /// classification and commits of one period overlap.
    state: Mutex<State>,
    config: Mutex<Config>,
    /// The run currently frozen, packed by [`pack_run`] into one word so the fault thread never
    /// sees half of an update: it leaves faults there to the committer, which wakes them after the
    /// replacement.
    frozen: AtomicU64,
    /// Makes "is it frozen?" and "fill it" one step for the fault thread: a freeze cannot start
    /// between them (else a page moved out just after the check would get a zero page, and the
    /// frozen contents could not be put back).
    fault_gate: Mutex<()>,
    stop: AtomicBool,
    stop_fd: std::os::fd::OwnedFd,
    /// Periods completed, with a condvar for `wait_periods`.
    periods: Mutex<u64>,
    period_cv: Condvar,
    kick: (Mutex<bool>, Condvar),
    /// When the next period should start: a period after the latest registration, so newly
    /// armed memory counts its first unchanged period at the first scan instead of waiting for a
    /// second one; but no later than two periods after the first registration since the last
    /// scan (registering all the time cannot hold periods off). `(latest + period, cap)`.
    not_before: Mutex<Option<(Instant, Instant)>>,
    counters: Counters,
    /// The pool of pages the program marks free (PPR), when it attached one.
    recycler: Mutex<Option<Arc<pageone_recycler::Pool>>>,
    /// Slots of tickets whose page the committer released this period.
    recycled_slots: Mutex<Vec<u32>>,
    /// CPU clocks of the engine's threads (engine, committer, faults, workers).
    clocks: Arc<Mutex<Vec<sys::CpuClock>>>,
}

#[derive(Default)]
struct Counters {
    scanned: AtomicU64,
    merges: AtomicU64,
    cow_breaks: AtomicU64,
    mismatches: AtomicU64,
    vma_limited: AtomicU64,
    vmas: AtomicU64,
    vma_limit: AtomicU64,
    recycled: AtomicU64,
    /// Daemons joined after the start (see `join_again`).
    joins: AtomicU64,
    /// Pages made private when leaving replaced stores (see `leave_replaced_stores`).
    left_private: AtomicU64,
}

/// A running deduplication engine. Dropping it shuts it down cleanly (see [`Engine::shutdown`]).
pub struct Engine {
    shared: Arc<Shared>,
    /// The workers (shared with the engine and commit threads): registration queues read-ahead.
    pool: Arc<Pool>,
    engine_thread: Option<JoinHandle<()>>,
    commit_thread: Option<JoinHandle<()>>,
    fault_thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("mode", &self.shared.mode)
            .finish()
    }
}

fn validate(config: &Config) -> Result<(), EngineError> {
    if config.workers == 0 {
        return Err(EngineError::Config("workers must be at least 1"));
    }
    if config.merge_periods == 0 {
        return Err(EngineError::Config("merge_periods must be at least 1"));
    }
    if config.max_sharing < 2 {
        return Err(EngineError::Config("max_sharing must be at least 2"));
    }
    if config.merge_period.is_zero() {
        return Err(EngineError::Config("merge_period must be positive"));
    }
    Ok(())
}

impl Engine {
    /// A builder with the defaults of [`Config`].
    pub fn builder() -> crate::Builder {
        crate::Builder::default()
    }

    pub(crate) fn start(config: Config) -> Result<Self, EngineError> {
        validate(&config)?;
        let want_wp = config.watch != WatchMode::Checksum;
        let wanted = UFFD_FEATURE_MOVE
            | if want_wp {
                UFFD_FEATURE_WP_ASYNC | UFFD_FEATURE_WP_UNPOPULATED
            } else {
                0
            };
        let uffd = sys::Uffd::open(wanted).map_err(EngineError::Uffd)?;
        if uffd.features() & UFFD_FEATURE_MOVE == 0 {
            return Err(EngineError::Unsupported(
                "UFFDIO_MOVE (Linux 6.8) to freeze pages",
            ));
        }
        let wp_ok = uffd.features() & (UFFD_FEATURE_WP_ASYNC | UFFD_FEATURE_WP_UNPOPULATED)
            == (UFFD_FEATURE_WP_ASYNC | UFFD_FEATURE_WP_UNPOPULATED)
            && sys::pagemap_scan_supported();
        let mode = match config.watch {
            WatchMode::UffdWp if !wp_ok => {
                return Err(EngineError::Unsupported(
                    "userfaultfd WP_ASYNC with PAGEMAP_SCAN",
                ))
            }
            WatchMode::Checksum => WatchMode::Checksum,
            _ if wp_ok => WatchMode::UffdWp,
            _ => WatchMode::Checksum,
        };
        let config_workers = config.workers;
        let reg_mode = UFFDIO_REGISTER_MODE_MISSING
            | if mode == WatchMode::UffdWp {
                UFFDIO_REGISTER_MODE_WP
            } else {
                0
            };
        // Capacity of the store: every page of RAM (virtual; only used copies cost memory).
        let ram = sys::meminfo_kib("MemTotal").unwrap_or(16 << 20) * 1024;
        let local_capacity = (ram / PAGE as u64).min(u32::MAX as u64 - 1) as u32;
        let mut daemon_note = "none";
        let store = match &config.daemon {
            Some(path) => match crate::remote::Remote::connect(path, &config.scope) {
                Ok((remote, fd, capacity)) => Store::shared(fd, capacity, remote)?,
                Err(e) => {
                    // Service degrades (no sharing with other processes), memory stays correct.
                    tracing::warn!(error = %e, socket = %path.display(), "running alone");
                    daemon_note = "unreachable";
                    Store::new(local_capacity)?
                }
            },
            None => Store::new(local_capacity)?,
        };
        // The scratch area receives frozen pages; UFFDIO_MOVE needs its destination registered
        // with the same context and the same protections as the source.
        let scratch = sys::mmap_anonymous(MAX_RUN * PAGE).map_err(EngineError::Map)? as usize;
        uffd.register(scratch, MAX_RUN * PAGE, reg_mode)
            .map_err(EngineError::Uffd)?;
        // A second context, without async write-protection: its write faults block until the
        // engine un-protects, which is how a COW-broken page is held still while compared.
        let store_uffd = sys::Uffd::open(UFFD_FEATURE_WP_HUGETLBFS_SHMEM)
            .ok()
            .filter(|u| u.features() & UFFD_FEATURE_WP_HUGETLBFS_SHMEM != 0);
        let shared = Arc::new(Shared {
            uffd,
            store_uffd,
            mode,
            reg_mode,
            daemon_note,
            state: Mutex::new(State {
                regions: BTreeMap::new(),
                store,
                scratch,
                pagemap: Arc::new(sys::Pagemap::open().map_err(EngineError::Uffd)?),
                unshared: 0,
                volatile: 0,
                zero: 0,
                vmas: 0,
                unstable: FirstSightings::default(),
                scan: ScanBuffers::default(),
                stale_sightings: 0,
                heap_dirty: false,
                offered: false,
                relooks_skipped: 0,
                ahead_jobs: Vec::new(),
                ahead: Vec::new(),
                ahead_age: 0,
            }),
            period_lock: Mutex::new(()),
            config: Mutex::new(config),
            frozen: AtomicU64::new(0),
            fault_gate: Mutex::new(()),
            stop: AtomicBool::new(false),
            stop_fd: sys::eventfd().map_err(EngineError::Thread)?,
            periods: Mutex::new(0),
            period_cv: Condvar::new(),
            kick: (Mutex::new(false), Condvar::new()),
            not_before: Mutex::new(None),
            counters: Counters::default(),
            recycler: Mutex::new(None),
            recycled_slots: Mutex::new(Vec::new()),
            clocks: Arc::default(),
        });
        tracing::info!(mode = %mode, "pageone engine started");
        let s = shared.clone();
        let fault_thread = std::thread::Builder::new()
            .name("pageone-faults".into())
            .spawn(move || fault_loop(&s))
            .map_err(EngineError::Thread)?;
        let pool = Arc::new(
            Pool::new(config_workers, shared.clocks.clone()).map_err(EngineError::Thread)?,
        );
        // Rendezvous: the classifier hands over a batch when the committer takes it, so it runs
        // at most one batch ahead (bounded copies in flight, and frees feed the next copies).
        let (to_committer, batches) = std::sync::mpsc::sync_channel(0);
        let engine_pool = pool.clone();
        let (s, p) = (shared.clone(), pool.clone());
        let commit_thread = std::thread::Builder::new()
            .name("pageone-commit".into())
            .spawn(move || commit_loop(&s, &p, batches))
            .map_err(EngineError::Thread)?;
        let s = shared.clone();
        let engine_thread = std::thread::Builder::new()
            .name("pageone-engine".into())
            .spawn(move || engine_loop(&s, &engine_pool, to_committer))
            .map_err(EngineError::Thread)?;
        Ok(Self {
            shared,
            pool,
            engine_thread: Some(engine_thread),
            commit_thread: Some(commit_thread),
            fault_thread: Some(fault_thread),
        })
    }

    /// How this engine detects writes.
    pub fn watch_mode(&self) -> WatchMode {
        self.shared.mode
    }

    /// Registers `[addr, addr+len)` for merging, the equivalent of `madvise(MADV_MERGEABLE)`. The
    /// range must be page-aligned private anonymous read/write memory. Its contents are never
    /// changed by the engine; registering does not populate it.
    pub fn register(&self, addr: *mut u8, len: usize) -> Result<(), EngineError> {
        let a = addr as usize;
        if a % PAGE != 0 || len % PAGE != 0 || len == 0 {
            return Err(EngineError::Unaligned { addr: a, len });
        }
        let end = a
            .checked_add(len)
            .ok_or(EngineError::Unaligned { addr: a, len })?;
        let _period = lock(&self.shared.period_lock);
        let maps = sys::self_mappings().map_err(EngineError::Map)?;
        let mut st = lock(&self.shared.state);
        // Private anonymous memory, or pages this engine merged and later unmerged (private copies
        // in mappings of its own store, which stay private: they cannot be frozen again).
        let mut cur = a;
        let mut unmergeable = Vec::new();
        for m in maps.iter().filter(|m| m.end > a && m.start < end) {
            let ours = st.store.maps_inode(m.inode) && m.perms == "rw-p";
            if m.start > cur || !(m.is_private_anonymous_rw() || ours) {
                return Err(EngineError::NotAnonymous { addr: a, len });
            }
            if ours {
                unmergeable.push((m.start.max(a), m.end.min(end)));
            }
            cur = m.end;
        }
        if cur < end {
            return Err(EngineError::NotAnonymous { addr: a, len });
        }
        if st
            .regions
            .range(..end)
            .next_back()
            .is_some_and(|(_, r)| r.start + r.len() > a)
        {
            return Err(EngineError::Overlap { addr: a, len });
        }
        // Anonymous pieces are watched by the main context; pieces that are mappings of the store
        // (pages merged, then unmerged) by the store mappings' context.
        let mut pieces: Vec<(usize, usize, bool)> = Vec::new();
        let mut cur = a;
        for &(s, e) in &unmergeable {
            if s > cur {
                pieces.push((cur, s, false));
            }
            pieces.push((s, e, true));
            cur = e;
        }
        if cur < end {
            pieces.push((cur, end, false));
        }
        for (k, &(s, e, store_piece)) in pieces.iter().enumerate() {
            let r = if store_piece {
                self.shared
                    .store_uffd
                    .as_ref()
                    .map_or(Ok(()), |u| u.register(s, e - s, UFFDIO_REGISTER_MODE_WP))
            } else {
                self.shared.uffd.register(s, e - s, self.shared.reg_mode)
            };
            if let Err(err) = r {
                for &(s, e, store_piece) in &pieces[..k] {
                    if !store_piece {
                        let _ = self.shared.uffd.unregister(s, e - s);
                    } else if let Some(u) = &self.shared.store_uffd {
                        let _ = u.unregister(s, e - s);
                    }
                }
                return Err(EngineError::Uffd(err));
            }
        }
        if self.shared.mode == WatchMode::UffdWp {
            // Arm the watch now: pages written from here on show up in the next period's scan,
            // which counts the first unchanged period.
            st.pagemap
                .write_protect(a, end)
                .map_err(EngineError::Uffd)?;
        }
        let n = len / PAGE;
        // Checksums: every page in checksum mode, COW-broken pages in both modes.
        let sums = vec![0; n];
        let mut pages = vec![Page::default(); n];
        for &(s, e) in &unmergeable {
            for p in &mut pages[(s - a) / PAGE..(e - a) / PAGE] {
                p.kind = BROKEN;
            }
        }
        st.regions.insert(
            a,
            RegionState {
                start: a,
                pages,
                merged_ever: !unmergeable.is_empty(),
                armed_at: (self.shared.mode == WatchMode::UffdWp).then(Instant::now),
                sums,
            },
        );
        read_ahead(&mut st, &self.pool, a, end, self.shared.mode);
        drop(st);
        if self.shared.mode == WatchMode::UffdWp {
            let period = lock(&self.shared.config).merge_period;
            let now = Instant::now();
            let t = now + period;
            let mut nb = lock(&self.shared.not_before);
            *nb = Some(match *nb {
                Some((old, cap)) => (old.max(t), cap),
                None => (t, now + period * 2),
            });
            drop(nb);
            // Wake the sleeping engine loop so it takes the new deadline.
            self.shared.kick.1.notify_all();
        }
        tracing::debug!(addr = a, len, "registered");
        Ok(())
    }

    /// Recycles the pages the program marks free in `pool` (PPR, see [`pageone_recycler`]):
    /// every period, marked pages of registered memory are released (their memory goes back to
    /// the kernel; they read as zeros afterwards) unless unmarked first. Replaces a pool attached
    /// before.
    pub fn recycle_from(&self, pool: Arc<pageone_recycler::Pool>) {
        *lock(&self.shared.recycler) = Some(pool);
    }

    /// Unregisters the registered regions inside `[addr, addr+len)`, the equivalent of
    /// `madvise(MADV_UNMERGEABLE)`: every page becomes private again with its contents intact.
    pub fn unregister(&self, addr: *mut u8, len: usize) -> Result<(), EngineError> {
        let a = addr as usize;
        let end = a.saturating_add(len);
        let _period = lock(&self.shared.period_lock);
        let mut st = lock(&self.shared.state);
        let keys: Vec<usize> = st.regions.range(a..end).map(|(&k, _)| k).collect();
        if keys.is_empty() {
            return Err(EngineError::NotRegistered { addr: a, len });
        }
        for k in &keys {
            let r = &st.regions[k];
            if r.start + r.len() > end {
                return Err(EngineError::Overlap { addr: a, len });
            }
        }
        forget_read_ahead(&mut st);
        for k in keys {
            let r = st.regions.remove(&k).expect("listed above");
            unregister_region(&self.shared, &mut st, r);
        }
        Ok(())
    }

    /// Maps a fresh private anonymous region of `len` bytes (rounded up to pages) and registers it.
    pub fn alloc_region(&self, len: usize) -> Result<Region<'_>, EngineError> {
        let len = len.div_ceil(PAGE).max(1) * PAGE;
        let p = sys::mmap_anonymous(len).map_err(EngineError::Map)?;
        if let Err(e) = self.register(p, len) {
            // SAFETY: p..p+len was mapped above and nothing refers to it.
            let _ = unsafe { sys::munmap(p, len) };
            return Err(e);
        }
        Ok(Region {
            engine: self,
            ptr: p,
            len,
        })
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> Stats {
        let st = lock(&self.shared.state);
        stats_of(&self.shared, &st)
    }

    /// The current configuration.
    pub fn config(&self) -> Config {
        lock(&self.shared.config).clone()
    }

    /// Changes the configuration; takes effect at the next period. The watch mode cannot change.
    pub fn reconfigure(&self, f: impl FnOnce(&mut Config)) -> Result<(), EngineError> {
        let mut c = lock(&self.shared.config);
        let mut next = c.clone();
        f(&mut next);
        validate(&next)?;
        next.watch = c.watch;
        *c = next;
        Ok(())
    }

    /// Starts the next period now instead of at the end of the current merge period.
    pub fn kick(&self) {
        let (m, cv) = &self.shared.kick;
        *lock(m) = true;
        cv.notify_all();
    }

    /// Blocks until `n` more periods have completed (kicking each one), or `timeout` passes.
    /// Returns whether they did.
    pub fn wait_periods(&self, n: u64, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let target = *lock(&self.shared.periods) + n;
        loop {
            self.kick();
            let g = lock(&self.shared.periods);
            if *g >= target {
                return true;
            }
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            let (g, _) = self
                .shared
                .period_cv
                .wait_timeout(g, (deadline - now).min(Duration::from_millis(50)))
                .unwrap_or_else(|e| e.into_inner());
            if *g >= target {
                return true;
            }
        }
    }

    /// Stops the engine: every registered page becomes private again with its contents intact,
    /// and the stable store is emptied.
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.kick();
        let _ = sys::eventfd_signal(std::os::fd::AsRawFd::as_raw_fd(&self.shared.stop_fd));
        if let Some(t) = self.engine_thread.take() {
            let _ = t.join();
        }
        // The engine thread dropped its end of the batch channel: the committer ends.
        if let Some(t) = self.commit_thread.take() {
            let _ = t.join();
        }
        {
            let mut st = lock(&self.shared.state);
            forget_read_ahead(&mut st);
            let regions = std::mem::take(&mut st.regions);
            for (_, r) in regions {
                unregister_region(&self.shared, &mut st, r);
            }
            st.store.say_goodbye();
        }
        if let Some(t) = self.fault_thread.take() {
            let _ = t.join();
        }
    }

    /// Pages currently held in the stable store (for tests: 0 after unregistering everything).
    pub fn stable_pages(&self) -> usize {
        let st = lock(&self.shared.state);
        st.store.shared as usize
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        if self.engine_thread.is_some() {
            self.stop();
        }
    }
}

/// A registered region allocated by [`Engine::alloc_region`]; unregistered and unmapped on drop.
pub struct Region<'e> {
    engine: &'e Engine,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the region is plain memory owned by this handle; the engine only reads it with volatile
// loads and remaps pages with identical contents.
unsafe impl Send for Region<'_> {}
// SAFETY: see Send; shared access gives only raw pointers.
unsafe impl Sync for Region<'_> {}

impl Region<'_> {
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The region as a mutable slice for its single owner. The engine never forms references to
    /// it and preserves its contents, so exclusive access through `&mut self` is sound.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: ptr..ptr+len is a live mapping owned by this handle, borrowed mutably.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: as above; shared borrow, and only &mut self can write through this handle.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl Drop for Region<'_> {
    fn drop(&mut self) {
        let _ = self.engine.unregister(self.ptr, self.len);
        // SAFETY: the mapping is owned by this handle and no reference outlives it.
        let _ = unsafe { sys::munmap(self.ptr, self.len) };
    }
}

/// Makes every page of `r` private again and releases its copies.
fn unregister_region(sh: &Shared, st: &mut State, r: RegionState) {
    let (start, end) = (r.start, r.start + r.len());
    // First sightings in the range are forgotten: the range may be registered again later, with
    // page epochs starting over.
    st.unstable.retain(|_, addr, _| addr < start || addr >= end);
    unregister_range(&sh.uffd, start, r.len());
    // Merged and COW-broken pages live in mappings of the store: turn those back into anonymous
    // memory, so the range behaves exactly as before registering (e.g. MADV_DONTNEED gives zeros).
    let pieces: Vec<(usize, usize)> = sys::self_mappings()
        .unwrap_or_default()
        .iter()
        .filter(|m| {
            st.store.maps_inode(m.inode) && m.perms == "rw-p" && m.end > start && m.start < end
        })
        .map(|m| (m.start.max(start), m.end.min(end)))
        .collect();
    let mut failed = Vec::new();
    for &(s, e) in &pieces {
        if !anonymize(sh, s, e) {
            failed.push((s, e));
        }
    }
    if let Some(u2) = &sh.store_uffd {
        unregister_range(u2, start, r.len());
    }
    for (i, p) in r.pages.iter().enumerate() {
        let addr = start + i * PAGE;
        if p.kind == MERGED {
            if failed.iter().any(|&(s, e)| addr >= s && addr < e) {
                // Still a store mapping: at least make the page private.
                break_cow(addr);
            }
            st.store.drop_ref(p.sid);
        } else if p.kind == ZERO {
            st.zero -= 1;
        }
    }
    st.store.punch_pending();
}

/// Replaces the store mapping `[s, e)` by anonymous memory with the same contents: writers are
/// held off with write-protection, the pages are copied into a fresh anonymous mapping, and that
/// mapping is moved over the old one in one step (`mremap`), then writers are woken. Returns false
/// (changing nothing) if any step is not possible.
fn anonymize(sh: &Shared, s: usize, e: usize) -> bool {
    let Some(u2) = &sh.store_uffd else {
        return false;
    };
    let len = e - s;
    if u2.writeprotect(s, len, true).is_err() {
        let _ = u2.writeprotect(s, len, false);
        return false;
    }
    let ok = match sys::mmap_anonymous(len) {
        Ok(tmp) => {
            for w in 0..len / 8 {
                // SAFETY: the source is mapped and held still (writers block on write-protect),
                // read with volatile loads as someone else's memory; `tmp` is ours alone.
                unsafe {
                    let v = std::ptr::read_volatile((s as *const u64).add(w));
                    std::ptr::write((tmp as *mut u64).add(w), v);
                }
            }
            // SAFETY: `tmp` is a whole mapping of ours; the destination holds exactly the bytes
            // just copied and belongs to the registered region.
            let moved = unsafe { sys::mremap_fixed(tmp, len, s as *mut u8) }.is_ok();
            if !moved {
                // SAFETY: `tmp` is ours and nothing refers to it.
                let _ = unsafe { sys::munmap(tmp, len) };
            }
            moved
        }
        Err(_) => false,
    };
    if !ok {
        let _ = u2.writeprotect(s, len, false);
    }
    // Writers blocked on the old mapping retry their fault in the new one.
    let _ = u2.wake(s, len);
    ok
}

/// Unregisters `[start, start+len)` from `uffd`, piece by piece if the owner unmapped parts of it.
fn unregister_range(uffd: &sys::Uffd, start: usize, len: usize) {
    if uffd.unregister(start, len).is_err() {
        // Pieces of the range may have been unmapped by the owner; unregister what is left.
        if let Ok(maps) = sys::self_mappings() {
            for m in maps
                .iter()
                .filter(|m| m.end > start && m.start < start + len)
            {
                let s = m.start.max(start);
                let e = m.end.min(start + len);
                let _ = uffd.unregister(s, e - s);
            }
        }
    }
}

/// Gives the merged page at `addr` a private copy without changing a byte, as a write would
/// (KSM's unmerge does the same with a write fault).
fn break_cow(addr: usize) {
    // SAFETY: addr is a page of a private mapping the engine made; populating it writable copies
    // the page in the kernel, atomically with respect to concurrent writers.
    if unsafe { sys::madvise(addr as *mut u8, PAGE, libc::MADV_POPULATE_WRITE) }.is_ok() {
        return;
    }
    // Before Linux 5.14: a compare-and-swap of a word with itself is a write (an atomic add of
    // zero is not: compilers may turn it into a load), and it cannot lose a concurrent store.
    // SAFETY: addr is mapped and 8-aligned; the owner may write it concurrently, which an atomic
    // read-modify-write tolerates.
    let w = unsafe { std::sync::atomic::AtomicU64::from_ptr(addr as *mut u64) };
    let mut v = w.load(Ordering::Relaxed);
    // Relaxed: only the write itself matters, not ordering with other memory.
    while let Err(cur) = w.compare_exchange_weak(v, v, Ordering::Relaxed, Ordering::Relaxed) {
        v = cur;
    }
}

/// Answers missing faults that are not frozen pages with the zero page.
fn fault_loop(sh: &Shared) {
    count_cpu_of_this_thread(sh);
    let fds = [
        sh.uffd.as_raw_fd(),
        std::os::fd::AsRawFd::as_raw_fd(&sh.stop_fd),
    ];
    loop {
        if sh.stop.load(Ordering::SeqCst) && lock(&sh.state).regions.is_empty() {
            return;
        }
        if sys::poll_readable(&fds, 100).is_err() {
            std::thread::sleep(Duration::from_millis(1));
        }
        while let Ok(Some(msg)) = sh.uffd.read_event() {
            if msg.event != UFFD_EVENT_PAGEFAULT {
                continue;
            }
            let addr = msg.pf_address as usize & !(PAGE - 1);
            let _gate = lock(&sh.fault_gate);
            // Pairs with the committer's SeqCst stores around a freeze: a fault on a page moved
            // out is reported after the move, which follows the store of the frozen range.
            let (fs, fe) = unpack_run(sh.frozen.load(Ordering::SeqCst));
            if addr >= fs && addr < fe {
                continue; // The committer wakes it after replacing the page.
            }
            // A first touch or a released zero page: map the shared zero page. A write-protect
            // marker (async watching of an unpopulated page) makes that fail with EEXIST: clear
            // it and retry, or as a last resort install a zeroed page. Other errors (EEXIST
            // because the page came back, ENOENT because the address is now a merged mapping)
            // only need the wake.
            static ZEROS: [u64; WORDS] = [0; WORDS];
            let r = match sh.uffd.zeropage(addr, PAGE) {
                Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {
                    let _ = sh.uffd.writeprotect(addr, PAGE, false);
                    sh.uffd.zeropage(addr, PAGE).or_else(|_| {
                        // SAFETY: ZEROS is a static page of zeros.
                        unsafe { sh.uffd.copy(addr, ZEROS.as_ptr().cast(), PAGE) }
                    })
                }
                r => r,
            };
            if r.is_err() {
                let _ = sh.uffd.wake(addr, PAGE);
            }
        }
    }
}

/// A snapshot of the counters, as the holder of the state lock sees them.
fn stats_of(sh: &Shared, st: &State) -> Stats {
    let c = &sh.counters;
    let registered: usize = st.regions.values().map(|r| r.len()).sum();
    let shared = st.store.shared;
    let sharing = st.store.sharing_refs.saturating_sub(shared);
    let vmas = c.vmas.load(Ordering::Relaxed);
    // Our costs: per-page state, the store's index, each VMA (~200 bytes in the kernel),
    // read-ahead results while kept (an address and a result per page), and the watch's scratch.
    let ahead_bytes = ahead_pages(st) * std::mem::size_of::<PagePre>();
    let meta = (registered / PAGE) as u64 * 8
        + st.store.metadata_bytes()
        + vmas * 200
        + ahead_bytes as u64
        + st.scan.bytes() as u64;
    Stats {
        pages_shared: shared,
        pages_sharing: sharing,
        pages_unshared: st.unshared,
        pages_volatile: st.volatile,
        pages_scanned: c.scanned.load(Ordering::Relaxed),
        full_scans: *lock(&sh.periods),
        zero_pages: st.zero,
        pages_recycled: c.recycled.load(Ordering::Relaxed),
        daemon_joins: c.joins.load(Ordering::Relaxed),
        pages_left_private: c.left_private.load(Ordering::Relaxed),
        general_profit: ((sharing + st.zero) * PAGE as u64) as i64 - meta as i64,
        merges: c.merges.load(Ordering::Relaxed),
        cow_breaks: c.cow_breaks.load(Ordering::Relaxed),
        compare_mismatches: c.mismatches.load(Ordering::Relaxed),
        vmas_used: vmas,
        vma_limit: c.vma_limit.load(Ordering::Relaxed),
        vma_limited_merges: c.vma_limited.load(Ordering::Relaxed),
        watch_mode: sh.mode.to_string(),
        worker_cpu_ns: lock(&sh.clocks).iter().map(sys::CpuClock::ns).sum(),
        registered_bytes: registered as u64,
        daemon: match st.store.daemon_state() {
            "none" => sh.daemon_note,
            s => s,
        }
        .into(),
        scope: st
            .store
            .remote
            .as_ref()
            .map(|r| r.scope.clone())
            .unwrap_or_default(),
    }
}

/// A batch classified and ready for the committer.
struct Classified {
    cands: Vec<Candidate>,
    actions: Vec<Option<Action>>,
    /// Copies made for this batch; those that merged nothing are freed after its commit.
    new_copies: Vec<KeyId>,
}

enum ToCommitter {
    Batch {
        batch: Classified,
        config: Arc<Config>,
        /// Most VMAs the process may have after a merge.
        budget: usize,
    },
    /// Answered once every batch sent before it is committed.
    Flush(std::sync::mpsc::SyncSender<()>),
}

/// Records the calling thread's CPU clock for [`Stats::worker_cpu_ns`].
fn count_cpu_of_this_thread(sh: &Shared) {
    if let Ok(c) = sys::CpuClock::current() {
        lock(&sh.clocks).push(c);
    }
}

fn engine_loop(sh: &Shared, pool: &Pool, committer: std::sync::mpsc::SyncSender<ToCommitter>) {
    let _ = sys::set_thread_idle_priority();
    count_cpu_of_this_thread(sh);
    // Whether this period was started by `kick` rather than by the clock.
    let mut kicked = false;
    // Periods in a row that changed little (merges, zero pages released and copy-on-write
    // breaks under 1/1024 of the registered pages): after IDLE_PERIODS of them the engine
    // sleeps 2, 4, then 8 periods between scans. Scanning tens of thousands of VMAs is most of a
    // settled process's cost, and a settled guest keeps rewriting a few hundred unique pages,
    // which become candidates again and again without merging, so "no candidates" never
    // comes. A busy period, a registration or a kick brings the period back.
    let mut idle = 0u32;
    let mut next_join = Instant::now() + REJOIN_INTERVAL;
    // When to give up waiting for pages to move off stores replaced by `join_again`.
    let mut retire_at: Option<Instant> = None;
    while !sh.stop.load(Ordering::SeqCst) {
        let t0 = Instant::now();
        let config = Arc::new(lock(&sh.config).clone());
        let period = config.merge_period;
        if config.workers > pool.size() {
            if let Err(e) = pool.grow(config.workers) {
                tracing::warn!(error = %e, "could not add workers; keeping {}", pool.size());
            }
        }
        if t0 >= next_join {
            next_join = t0 + REJOIN_INTERVAL;
            if join_again(sh, &config) {
                idle = 0;
                retire_at = Some(t0 + period * RETIRE_PERIODS);
            }
        }
        if retire_at.is_some_and(|t| t0 >= t) {
            let _period = lock(&sh.period_lock);
            let mut st = lock(&sh.state);
            retire_at = (!leave_replaced_stores(sh, &mut st)).then(|| t0 + period * RETIRE_PERIODS);
        }
        {
            let _period = lock(&sh.period_lock);
            // Merges, copy-on-write breaks and zero pages released so far.
            let activity = || {
                let c = &sh.counters;
                let changes =
                    c.merges.load(Ordering::Relaxed) + c.cow_breaks.load(Ordering::Relaxed);
                (changes, lock(&sh.state).zero)
            };
            let (changes0, zero0) = activity();
            let busy = match run_period(sh, &config, pool, &committer, kicked) {
                Ok(()) => {
                    let (changes, zero) = activity();
                    let done = changes - changes0 + zero.abs_diff(zero0);
                    let st = lock(&sh.state);
                    let pages: usize = st.regions.values().map(|r| r.pages.len()).sum();
                    done > 0 && done * 1024 >= pages as u64
                }
                Err(e) => {
                    tracing::warn!(error = %e, "merge period failed; memory is unchanged");
                    true
                }
            };
            idle = if busy { 0 } else { idle.saturating_add(1) };
            let st = lock(&sh.state);
            if st.store.remote.is_some() {
                let json = serde_json::to_string(&stats_of(sh, &st)).unwrap_or_default();
                if let Some(r) = &st.store.remote {
                    r.report(json);
                }
            }
        }
        {
            *lock(&sh.periods) += 1;
            sh.period_cv.notify_all();
        }
        // Sleep out the period unless kicked or stopped.
        let stretch = match idle.checked_sub(IDLE_PERIODS) {
            None => 1,
            Some(n) => 1u32 << (n + 1).min(3),
        };
        let (m, cv) = &sh.kick;
        let mut k = lock(m);
        while !*k && !sh.stop.load(Ordering::SeqCst) {
            // Deferred to a period after the latest registration (see `not_before`). The bound
            // is counted from the first registration, not from the last scan: counted from the
            // scan (one period at most), a burst of registrations that began late in a period,
            // or after idle periods, was scanned in its middle, so its regions came up as
            // candidates in different periods, the later ones behind the others' merge work.
            let deadline = match *lock(&sh.not_before) {
                Some((t, cap)) => {
                    idle = 0;
                    t.min(cap)
                }
                None => t0 + period * stretch,
            };
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            k = cv
                .wait_timeout(k, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        kicked = *k;
        *k = false;
        if kicked {
            idle = 0;
        }
        // A registration after the deadline keeps its own for the next period.
        let mut nb = lock(&sh.not_before);
        if nb.is_some_and(|(t, cap)| t.min(cap) <= Instant::now()) {
            *nb = None;
        }
    }
}

/// How often a daemon that was lost (or unreachable at the start) is asked for again.
const REJOIN_INTERVAL: Duration = Duration::from_secs(1);

/// Joins the configured daemon when the engine has no link to one (lost, or unreachable at the
/// start): the new scope store replaces the current one between periods, and every merged page
/// becomes `FOREIGN`, to be merged again onto the new store (given a copy of its own if no other
/// process has its content) while it keeps mapping the old copy meanwhile. Returns whether it
/// joined.
fn join_again(sh: &Shared, config: &Config) -> bool {
    let Some(path) = &config.daemon else {
        return false;
    };
    let linked = lock(&sh.state)
        .store
        .remote
        .as_ref()
        .is_some_and(|r| !r.is_lost());
    if linked {
        return false;
    }
    // Connecting and greeting happen without locks: the program's calls go on meanwhile.
    let store = match crate::remote::Remote::connect(path, &config.scope)
        .and_then(|(remote, fd, capacity)| Store::shared(fd, capacity, remote))
    {
        Ok(s) => s,
        Err(e) => {
            tracing::debug!(error = %e, "the pageone daemon is still not reachable");
            return false;
        }
    };
    let _period = lock(&sh.period_lock);
    let mut st = lock(&sh.state);
    // Read-ahead results may name copies of the old store.
    forget_read_ahead(&mut st);
    let old = std::mem::replace(&mut st.store, store);
    st.store.take_over(old);
    let mut foreign = 0u64;
    for r in st.regions.values_mut() {
        for p in r.pages.iter_mut().filter(|p| p.kind == MERGED) {
            p.kind = FOREIGN;
            p.unchanged = 0;
            p.writes = 0;
            foreign += 1;
        }
    }
    // Relaxed: a counter.
    sh.counters.joins.fetch_add(1, Ordering::Relaxed);
    tracing::info!(
        pages = foreign,
        "joined the pageone daemon again; merged pages move to its store"
    );
    true
}

/// Periods after a join in which merged pages move to the new store on their own (merged again,
/// or given a copy of their own) before the rest is made private (`leave_replaced_stores`).
const RETIRE_PERIODS: u32 = 20;

/// Turns what is left of replaced stores' mappings in registered memory into anonymous memory
/// (pages written since the join, pages still waiting to move, pages the program dropped): as
/// long as one page maps a replaced store, all of that store's memory stays allocated (nobody
/// frees its copies any more). Those pages are watched again like any anonymous page. Returns
/// whether no such mapping is left.
fn leave_replaced_stores(sh: &Shared, st: &mut State) -> bool {
    if !st.store.has_replaced() {
        return true;
    }
    let Ok(maps) = sys::self_mappings() else {
        return false;
    };
    let mut left = false;
    for m in maps
        .iter()
        .filter(|m| st.store.replaced_inode(m.inode) && m.perms == "rw-p")
    {
        let Some((_, r)) = st.regions.range_mut(..=m.start).next_back() else {
            left = true;
            continue;
        };
        let (s, e) = (m.start, m.end.min(r.start + r.len()));
        // A mapping reaching into the next region is done there at the next call.
        left |= m.end > e;
        if s >= e || !anonymize(sh, s, e) {
            left = true;
            continue;
        }
        // The anonymous mapping moved in carries no registration: watch it as the region's.
        if let Err(err) = sh.uffd.register(s, e - s, sh.reg_mode) {
            tracing::warn!(error = %err, "a range left unwatched after leaving a replaced store");
        } else if sh.mode == WatchMode::UffdWp {
            let _ = st.pagemap.write_protect(s, e);
        }
        let mut made_private = 0;
        for p in &mut r.pages[(s - r.start) / PAGE..(e - r.start) / PAGE] {
            if in_store_mapping(p.kind) {
                p.kind = ANON;
                p.unchanged = 0;
                made_private += 1;
            }
        }
        // Relaxed: a counter.
        sh.counters
            .left_private
            .fetch_add(made_private, Ordering::Relaxed);
    }
    if !left {
        st.store.forget_replaced();
    }
    !left
}

/// The committer thread: commits batches in the order the classifier sends them, while the
/// classifier works on the next one.
fn commit_loop(sh: &Shared, pool: &Pool, batches: std::sync::mpsc::Receiver<ToCommitter>) {
    let _ = sys::set_thread_idle_priority();
    count_cpu_of_this_thread(sh);
    while let Ok(msg) = batches.recv() {
        match msg {
            ToCommitter::Batch {
                batch,
                config,
                budget,
            } => {
                let t0 = Instant::now();
                commit(sh, pool, &config, &batch.cands, &batch.actions, budget);
                let mut st = lock(&sh.state);
                for id in batch.new_copies {
                    st.store.free_unmapped(id);
                }
                drop(st);
                tracing::debug!(
                    pid = std::process::id(),
                    candidates = batch.cands.len(),
                    commit_ms = t0.elapsed().as_secs_f64() * 1e3,
                    "commit"
                );
            }
            ToCommitter::Flush(done) => {
                let _ = done.send(());
            }
        }
    }
}

/// Which waiting first sightings to ask the daemon about again in a batch.
#[derive(Clone, Copy)]
struct Relook {
    skip: usize,
    take: usize,
}

/// Every this many periods, waiting first sightings are asked about again (daemon only), one
/// request's worth (`proto::MAX_ITEMS`) at a time.
const RELOOK_PERIODS: u64 = 16;
/// Relooks skipped in a row at most while offers keep coming (so a waiting page whose copy came
/// out under another hash is asked about again within 4 x RELOOK_PERIODS periods at the latest).
const RELOOK_SKIPS: u32 = 3;
/// Periods without anything to merge before the engine scans less often (see `engine_loop`).
const IDLE_PERIODS: u32 = 8;
/// Every this many periods the VMA count is read again once it is large (see `run_period`).
const VMA_RECOUNT_PERIODS: u64 = 16;
/// Below this many VMAs, counting them (reading `/proc/self/maps`) every period is cheap.
const SMALL_VMA_COUNT: usize = 4096;

/// What classification needs of the store without its lock: fixed for the engine's life.
struct StoreView {
    /// The stable tree; `None` with a daemon (see `Store::local_index`).
    tree: Option<Arc<pageone_index::SdTree<crate::store::StoreKeys>>>,
    base: usize,
    fd: i32,
    remote: Option<Arc<crate::remote::Remote>>,
}

fn run_period(
    sh: &Shared,
    config: &Arc<Config>,
    pool: &Pool,
    committer: &std::sync::mpsc::SyncSender<ToCommitter>,
    kicked: bool,
) -> io::Result<()> {
    let t_watch = Instant::now();
    let limit = sys::max_map_count().unwrap_or(65530);
    sh.counters.vma_limit.store(limit as u64, Ordering::Relaxed);
    let period = *lock(&sh.periods);
    let recycler = lock(&sh.recycler).clone();
    let (mut candidates, view, waiting, tickets, relook_now) = {
        let mut st = lock(&sh.state);
        let mut candidates = watch(sh, &mut st, config, kicked)?;
        // Pages marked free (PPR) are released this period: they skip the unchanged wait.
        let tickets = match &recycler {
            Some(pool) => claim_marked(&st, pool),
            None => (Vec::new(), Vec::new()),
        };
        if !tickets.0.is_empty() {
            let taken: HashSet<usize> = tickets.0.iter().map(|c| c.addr()).collect();
            candidates.retain(|c| !taken.contains(&c.addr()));
        }
        // Counting VMAs reads all of /proc/self/maps: megabytes of text with tens of thousands
        // of merged runs, which made the count most of an idle QEMU's engine CPU. So the count
        // is re-read every period only while it is small; otherwise every 16th period (the
        // margin covers what the program maps meanwhile; merges add their worst case to the
        // estimate), and by the commit when the estimate reaches the budget (`VmaBudget`).
        if st.vmas < SMALL_VMA_COUNT || period % VMA_RECOUNT_PERIODS == 0 {
            st.vmas = sys::map_count()?;
        }
        let view = StoreView {
            tree: st.store.local_index(),
            base: st.store.addr(0),
            fd: st.store.fd(),
            remote: st.store.remote.clone(),
        };
        let offered = std::mem::take(&mut st.offered);
        let relook_now = relook_due(period, offered, &mut st.relooks_skipped);
        (
            candidates,
            view,
            !st.unstable.is_empty(),
            tickets,
            relook_now,
        )
    };
    // Read-ahead still running is waited for when there is something to classify: it is that
    // same work, started earlier.
    let wait = !candidates.is_empty();
    use_read_ahead(sh, &mut candidates, wait);
    tracing::debug!(
        pid = std::process::id(),
        watch_ms = t_watch.elapsed().as_secs_f64() * 1e3,
        candidates = candidates.len(),
        "watch"
    );
    // In batches: memory freed by one batch's merges is reused for the next batch's stable
    // copies, savings show up progressively, and first sightings pair up across batches through
    // the first-sighting map. The committer commits a batch while the next one is classified.
    // With a daemon, an empty batch still collects the copies other processes made for pages
    // waiting here.
    let many = candidates.len() >= BATCH;
    let t_order = Instant::now();
    let batch = if view.remote.is_some() {
        REMOTE_BATCH
    } else {
        BATCH
    };
    let batches = batches_by_content(candidates, pool, batch);
    tracing::debug!(order_ms = t_order.elapsed().as_secs_f64() * 1e3, "order");
    if many && view.remote.is_none() {
        // Contents seen once this period become first sightings (unless a stable copy has them):
        // room for them at once, instead of rehashing a map of up to hundreds of thousands of
        // entries into fresh memory doubling after doubling. (With a daemon, most are another
        // process's: each batch makes room for what the daemon left to it, see `classify`.)
        let singles = batches.singles();
        lock(&sh.state).unstable.reserve(singles);
    }
    let collect_only = (batches.is_empty() && view.remote.is_some() && waiting).then(Vec::new);
    let mut relook = (view.remote.is_some() && waiting && relook_now).then(|| Relook {
        skip: (period / RELOOK_PERIODS) as usize * crate::proto::MAX_ITEMS,
        take: crate::proto::MAX_ITEMS,
    });
    let budget = limit.saturating_sub(config.vma_margin);
    let recycling = !tickets.0.is_empty();
    if recycling {
        lock(&sh.recycled_slots).clear();
        let actions = tickets
            .1
            .iter()
            .map(|&s| Some(Action::Recycle(s)))
            .collect();
        let batch = Classified {
            cands: tickets.0.clone(),
            actions,
            new_copies: Vec::new(),
        };
        // A send fails only when the committer is gone; then nothing is released, and the
        // tickets are ended below all the same.
        let _ = committer.send(ToCommitter::Batch {
            batch,
            config: config.clone(),
            budget,
        });
    }
    let mut handed_over = true;
    let mut worked = false;
    for batch in batches.chain(collect_only) {
        let t0 = Instant::now();
        let classified = classify(sh, &view, config, batch, pool, relook.take());
        worked |= !classified.cands.is_empty();
        tracing::debug!(
            pid = std::process::id(),
            candidates = classified.cands.len(),
            classify_ms = t0.elapsed().as_secs_f64() * 1e3,
            "classify"
        );
        let msg = ToCommitter::Batch {
            batch: classified,
            config: config.clone(),
            budget,
        };
        if let Err(std::sync::mpsc::SendError(ToCommitter::Batch { batch, .. })) =
            committer.send(msg)
        {
            // Only a bug ends the committer early: give this batch's copies back, merge nothing.
            tracing::error!("the committer is gone; nothing more is merged");
            let mut st = lock(&sh.state);
            for id in batch.new_copies {
                st.store.free_unmapped(id);
            }
            handed_over = false;
            break;
        }
        if sh.stop.load(Ordering::Relaxed) {
            break;
        }
    }
    if handed_over || recycling {
        let (done, wait) = std::sync::mpsc::sync_channel(1);
        if committer.send(ToCommitter::Flush(done)).is_ok() {
            let _ = wait.recv();
        }
    }
    if let (Some(pool), true) = (&recycler, recycling) {
        // Every ticket ends this period, released or not, so no slot stays claimed.
        let released: HashSet<u32> = std::mem::take(&mut *lock(&sh.recycled_slots))
            .into_iter()
            .collect();
        for (c, &slot) in tickets.0.iter().zip(&tickets.1) {
            let ticket = pageone_recycler::Ticket {
                slot,
                addr: c.addr(),
            };
            pool.finish(ticket, released.contains(&slot));
        }
    }
    let trim = {
        let mut st = lock(&sh.state);
        sweep_first_sightings(&mut st);
        st.store.reclaim();
        // A period with many candidates made large short-lived allocations (candidates,
        // batches, read-ahead results, offers): their memory goes back at once, it counts
        // against the saving. Smaller ones go back every few periods of work, or at the first
        // idle period after some.
        st.heap_dirty |= worked;
        let trim = many || (st.heap_dirty && (!worked || period % TRIM_PERIODS == 0));
        st.heap_dirty &= !trim;
        trim
    };
    if trim {
        sys::release_free_heap();
    }
    Ok(())
}

/// Whether waiting pages are asked about again this period (see RELOOK_PERIODS): every
/// RELOOK_PERIODS periods, but not while other processes' copies for them keep coming (`offered`
/// in the last period). Those offers do that work already, and a relook would repeat up to a
/// request's worth of lookups (in the cross-process benchmark's merging, an eighth of all of
/// them). At most RELOOK_SKIPS in a row are skipped; `skipped` counts them.
fn relook_due(period: u64, offered: bool, skipped: &mut u32) -> bool {
    if period % RELOOK_PERIODS != 0 {
        return false;
    }
    if offered && *skipped < RELOOK_SKIPS {
        *skipped += 1;
        return false;
    }
    *skipped = 0;
    true
}

/// Most PPR tickets taken per period (the rest wait for the next one).
const MAX_TICKETS: usize = 1 << 16;

/// Takes the tickets of pages marked free in `pool` that the engine may release: ANON or UNIQUE
/// pages of registered regions (merged and COW-broken pages live in store mappings, which a
/// freeze cannot move). Returns them as candidates in address order with their tickets' slots.
/// The state lock keeps the regions mapped while their words are read; no run is frozen then
/// (the period's commits start after this), so a read never waits for the committer.
fn claim_marked(st: &State, pool: &pageone_recycler::Pool) -> (Vec<Candidate>, Vec<u32>) {
    let tickets = pool.claim(MAX_TICKETS, |addr| {
        let (_, _, p) = page_at(&st.regions, addr)?;
        if addr % PAGE != 0 || !matches!(p.kind, ANON | UNIQUE) {
            return None;
        }
        // SAFETY: a page of a registered region, mapped while the state lock is held (the
        // program may write it meanwhile: the commit checks again on frozen bytes).
        Some(unsafe { mark_words(addr) })
    });
    let mut out: Vec<(Candidate, u32)> = tickets
        .iter()
        .filter_map(|t| {
            let (region, _, _) = page_at(&st.regions, t.addr)?;
            let c = Candidate::new(region, t.addr, Pre::None);
            Some((c, t.slot))
        })
        .collect();
    out.sort_unstable_by_key(|(c, _)| c.addr());
    out.into_iter().unzip()
}

/// Drops first-sighting entries whose page was written or released since (found by the page's
/// kind and epoch), once they are a good part of the map: a guest that keeps rewriting unique
/// pages would otherwise grow the map by an entry per content it ever held, and the daemon's
/// notes with it (it is told to forget them). The map's memory shrinks with it.
fn sweep_first_sightings(st: &mut State) {
    let stale = st.stale_sightings;
    if stale < SWEEP_MIN_STALE || stale * 4 < st.unstable.len() {
        // Entries taken by merges leave the table large and mostly empty (touched memory).
        if st.unstable.capacity() > 4 * st.unstable.len() + SWEEP_MIN_STALE {
            st.unstable.shrink_to_fit();
        }
        return;
    }
    st.stale_sightings = 0;
    let State {
        unstable,
        regions,
        store,
        ..
    } = st;
    let mut gone = Vec::new();
    unstable.retain(|h, addr, epoch| {
        let live = still_waiting(regions, addr, epoch).is_some();
        if !live {
            gone.push(h);
        }
        live
    });
    if unstable.capacity() > 2 * unstable.len() + SWEEP_MIN_STALE {
        unstable.shrink_to_fit();
    }
    if let Some(r) = &store.remote {
        r.forget(gone);
    }
}

/// Periods with some work between returns of free heap memory (every period with many
/// candidates returns it at once).
const TRIM_PERIODS: u64 = 8;

/// Stale first sightings worth a sweep (below this the map is small anyway).
const SWEEP_MIN_STALE: usize = 4096;

/// Orders candidates so that the pages of one content fall in one batch (by the hash or stable
/// copy read ahead): every batch then pairs its own duplicates and its merges start at once,
/// instead of the first batches only filling the first-sighting map. Each batch is in address
/// order (runs of pages get runs of copies). Pages not read ahead keep their order.
///
/// The contents are chained in one pass (no sort: this runs while the committer waits for the
/// first batch), split by content over the workers and this thread (each chains the contents
/// of its share of the key space), and each batch is gathered only when it is taken.
fn batches_by_content(cands: Vec<Candidate>, pool: &Pool, batch: usize) -> ContentBatches {
    let n = cands.len();
    if cands.iter().all(|c| content_key(c) == 0) {
        return ContentBatches {
            cands,
            next: vec![u32::MAX; n],
            head: vec![true; n],
            at: 0,
            batch,
        };
    }
    let parts = if n >= 4 * BATCH { pool.size() + 1 } else { 1 };
    // next[i]: the next candidate of i's content; heads start a content (or stand alone). Each
    // index is written by the one part that owns its key. (Memory made for this period costs a
    // page fault per 4 KiB: keys are computed where needed, and the atomics become the result.)
    let cands = Arc::new(cands);
    let next: Arc<Vec<AtomicU32>> = Arc::new((0..n).map(|_| AtomicU32::new(u32::MAX)).collect());
    let head: Arc<Vec<AtomicBool>> = Arc::new((0..n).map(|_| AtomicBool::new(true)).collect());
    let (cs, nx, hd) = (cands.clone(), next.clone(), head.clone());
    pool.run(
        parts,
        Arc::new(move |part| {
            // Parts split on high bits: the map's buckets use the low ones.
            let mine = |key: u64| key != 0 && (key >> 40) as usize % parts == part;
            // The last candidate of each content of this part so far, by the key's low half (two
            // contents sharing it are only batched together), in a map sized for as many
            // contents as it has keys (mostly so: pages that wait this long are mostly unique),
            // not grown into fresh memory doubling after doubling.
            let mut last: HashMap<u32, u32, HashOfHash> = HashMap::with_capacity_and_hasher(
                cs.iter().filter(|c| mine(content_key(c))).count(),
                HashOfHash::default(),
            );
            for (i, c) in cs.iter().enumerate() {
                let key = content_key(c);
                if !mine(key) {
                    continue;
                }
                let i = i as u32;
                match last.entry(key as u32) {
                    std::collections::hash_map::Entry::Occupied(mut o) => {
                        // Relaxed: read after `pool.run` returns, which waits for this part
                        // under the pool's latch (its mutex orders the stores before the reads).
                        nx[*o.get() as usize].store(i, Ordering::Relaxed);
                        *o.get_mut() = i;
                        hd[i as usize].store(false, Ordering::Relaxed);
                    }
                    std::collections::hash_map::Entry::Vacant(v) => {
                        v.insert(i);
                    }
                }
            }
        }),
    );
    // `pool.run` returned: every part ran and dropped its clones of the Arcs (see `Task::run`),
    // so the vectors are taken back as they are, the atomics in place (same layout). Relaxed:
    // after the parts finished (see above).
    let cands = Arc::try_unwrap(cands).unwrap_or_else(|c| c.as_ref().clone());
    let next = match Arc::try_unwrap(next) {
        Ok(v) => v.into_iter().map(AtomicU32::into_inner).collect(),
        Err(v) => v.iter().map(|x| x.load(Ordering::Relaxed)).collect(),
    };
    let head = match Arc::try_unwrap(head) {
        Ok(v) => v.into_iter().map(AtomicBool::into_inner).collect(),
        Err(v) => v.iter().map(|x| x.load(Ordering::Relaxed)).collect(),
    };
    ContentBatches {
        cands,
        next,
        head,
        at: 0,
        batch,
    }
}

/// A candidate's content key for batching: the low word of its hash, or its stable copy spread
/// over the key space (an odd multiplier is a bijection; the map uses the low bits as they are).
/// Keys shared by two contents only batch them together. 0: not read ahead (no chain).
fn content_key(c: &Candidate) -> u64 {
    match c.pre() {
        Pre::Hash(h) => h[0].max(1),
        Pre::Stable(id) => (id as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15),
        Pre::None | Pre::Zero => 0,
    }
}

/// The batches of [`batches_by_content`], gathered one at a time.
struct ContentBatches {
    cands: Vec<Candidate>,
    next: Vec<u32>,
    head: Vec<bool>,
    /// The next candidate to look at for a head.
    at: usize,
    /// Pages a batch reaches before it is cut (between contents).
    batch: usize,
}

impl Iterator for ContentBatches {
    type Item = Vec<Candidate>;

    fn next(&mut self) -> Option<Vec<Candidate>> {
        let mut take: Vec<u32> = Vec::with_capacity(self.batch);
        // Whole contents, in the order of their first candidate, until the batch is full.
        while take.len() < self.batch && self.at < self.cands.len() {
            if self.head[self.at] {
                let mut i = self.at as u32;
                while i != u32::MAX {
                    take.push(i);
                    i = self.next[i as usize];
                }
            }
            self.at += 1;
        }
        if take.is_empty() {
            return None;
        }
        take.sort_unstable_by_key(|&i| self.cands[i as usize].addr());
        Some(take.iter().map(|&i| self.cands[i as usize]).collect())
    }
}

impl ContentBatches {
    fn is_empty(&self) -> bool {
        self.cands.is_empty()
    }

    /// Candidates read ahead whose content no other candidate has.
    fn singles(&self) -> usize {
        (0..self.cands.len())
            .filter(|&i| {
                self.head[i]
                    && self.next[i] == u32::MAX
                    && matches!(self.cands[i].pre(), Pre::Hash(_))
            })
            .count()
    }
}

/// Pages read ahead per part of a read-ahead job (small parts, so that other submitters' parts
/// are not held up long behind them).
const AHEAD_PART: usize = 1024;
/// Most pages read ahead and not yet used, over all registrations (24 bytes each while kept):
/// beyond that, pages are read when they are candidates, as without read-ahead.
const AHEAD_MAX_PAGES: usize = 512 * 1024;
/// Periods read-ahead results are kept after they were installed: pages are due two periods
/// after registration, one more when registration fell just before a scan. (Epochs count writes
/// in a `u8`: results must not outlive a wrap-around either.)
const AHEAD_PERIODS: u32 = 4;

/// The results of one read-ahead part: present pages in address order, with what reading each
/// found.
type AheadPart = Vec<PagePre>;

/// A read-ahead queued on the workers: its address range and, per part of `AHEAD_PART` pages,
/// where the part puts its results.
struct AheadJob {
    done: crate::pool::Pending,
    start: usize,
    end: usize,
    parts: Arc<Vec<Mutex<AheadPart>>>,
    /// The store's allocation mark when the job started (see `AheadBlock::allocation_mark`).
    allocation_mark: u64,
}

/// Results of a finished read-ahead of `[start, end)`: `parts[k]` holds, in address order, the
/// present pages of the range's `k`th `AHEAD_PART` pages with what reading them found.
struct AheadBlock {
    start: usize,
    end: usize,
    parts: Vec<AheadPart>,
    /// The store's allocation mark when the read began: a stable copy found then and given out
    /// again since may hold other bytes now (freed and reused), and is not proposed.
    allocation_mark: u64,
}

impl AheadBlock {
    fn pages(&self) -> usize {
        self.parts.iter().map(Vec::len).sum()
    }
}

/// Reads the present pages of a newly registered range on the workers, in what is otherwise idle
/// time (the range's pages wait two whole periods before they are candidates): zero, equal to a
/// stable copy, or else their hash. A page unwritten until it is a candidate skips that work, and
/// its period's batches are ordered by content. The reads come after the range was armed, so any
/// write after a read is seen by the watch (the page's epoch changes and the result is not used);
/// every result is a hint only, as every merge is verified on frozen bytes.
///
/// Each part finds its own present pages (`PAGEMAP_SCAN`), so registering costs only the
/// queueing: the registering thread is the program's own.
fn read_ahead(st: &mut State, pool: &Pool, start: usize, end: usize, mode: WatchMode) {
    let room = AHEAD_MAX_PAGES.saturating_sub(ahead_pages(st));
    let end = end.min(start + room * PAGE);
    if end <= start {
        return;
    }
    // Allocated here, filled by the workers: results live in this thread's heap, not in the
    // workers' malloc arenas (which kept the memory after it was freed).
    let pages = (end - start) / PAGE;
    let n_parts = pages.div_ceil(AHEAD_PART);
    let parts: Arc<Vec<Mutex<AheadPart>>> = Arc::new(
        (0..n_parts)
            .map(|k| Mutex::new(Vec::with_capacity(AHEAD_PART.min(pages - k * AHEAD_PART))))
            .collect(),
    );
    let tree = st.store.local_index();
    let store_base = st.store.addr(0);
    let allocation_mark = st.store.allocation_mark();
    let pagemap = st.pagemap.clone();
    let out = parts.clone();
    let done = pool.spawn(
        n_parts,
        Arc::new(move |part| {
            let lo = start + part * AHEAD_PART * PAGE;
            let hi = (lo + AHEAD_PART * PAGE).min(end);
            // Only present pages (reading a missing one would fault it in), neither the zero
            // page nor a file page.
            let mut found = Vec::new();
            if pagemap
                .scan(lo, hi, &present_pages(mode), &mut found)
                .is_err()
            {
                return;
            }
            let mut buf = [0u64; WORDS];
            let mut res = lock(&out[part]);
            for r in found
                .iter()
                .filter(|r| r.categories & (PAGE_IS_PFNZERO | PAGE_IS_FILE) == 0)
            {
                for addr in (r.start as usize..r.end as usize).step_by(PAGE) {
                    res.push(PagePre::new(
                        addr,
                        read_page(addr, tree.as_deref(), store_base, &mut buf),
                    ));
                }
            }
        }),
    );
    st.ahead_jobs.push(AheadJob {
        done,
        start,
        end,
        parts,
        allocation_mark,
    });
}

/// Pages read ahead or being read, whose results are kept.
fn ahead_pages(st: &State) -> usize {
    st.ahead_jobs
        .iter()
        .map(|j| (j.end - j.start) / PAGE)
        .sum::<usize>()
        + st.ahead.iter().map(AheadBlock::pages).sum::<usize>()
}

/// What classification finds for the page at `addr`: zero, equal to a stable copy, or else its
/// hash (of a snapshot: the page may change meanwhile).
fn read_page(
    addr: usize,
    tree: Option<&pageone_index::SdTree<crate::store::StoreKeys>>,
    store_base: usize,
    buf: &mut [u64; WORDS],
) -> Pre {
    if (0..WORDS).all(|i| page_word(addr, i) == 0) {
        return Pre::Zero;
    }
    if let Some(id) = tree.and_then(|t| stable_copy(addr, t, store_base)) {
        return Pre::Stable(id);
    }
    copy_page(addr, buf);
    let h = twox_hash::XxHash3_128::oneshot(as_bytes(buf));
    Pre::Hash([h as u64, (h >> 64) as u64])
}

/// The stable copy equal to the page at `addr`, if the tree has one. The tree names the only copy
/// that can match; the full compare is done here with plain word loads, faster than through the
/// tree's key accessor (and the commit compares again, on frozen bytes).
fn stable_copy(
    addr: usize,
    tree: &pageone_index::SdTree<crate::store::StoreKeys>,
    store_base: usize,
) -> Option<KeyId> {
    let key = WordKey(|i| page_word(addr, i));
    let e = tree.candidate(&key)?;
    live_page_equals(addr, store_base + e.key() as usize * PAGE).then(|| e.key())
}

/// The hash of `Pre::Hash` as one number.
fn joined(h: [u64; 2]) -> u128 {
    h[0] as u128 | (h[1] as u128) << 64
}

/// Waits for the read-ahead jobs (they read registered pages, which must stay mapped meanwhile)
/// and drops every result: called when regions are unregistered (the same addresses may be
/// registered again, with page epochs starting over).
fn forget_read_ahead(st: &mut State) {
    for j in st.ahead_jobs.drain(..) {
        j.done.wait();
    }
    st.ahead = Vec::new();
}

/// Installs the results of finished read-ahead jobs (of all of them when `wait`), and gives the
/// candidates that are ANON pages unwritten since their read the result.
fn use_read_ahead(sh: &Shared, cands: &mut [Candidate], wait: bool) {
    let jobs: Vec<AheadJob> = {
        let mut st = lock(&sh.state);
        let (done, running): (Vec<_>, Vec<_>) = std::mem::take(&mut st.ahead_jobs)
            .into_iter()
            .partition(|j| wait || j.done.is_done());
        st.ahead_jobs = running;
        done
    };
    let mut st = lock(&sh.state);
    if !jobs.is_empty() {
        // Waited for without the state lock: the jobs do not take it.
        drop(st);
        for j in &jobs {
            j.done.wait();
        }
        let blocks: Vec<AheadBlock> = jobs
            .into_iter()
            .map(|j| AheadBlock {
                start: j.start,
                end: j.end,
                allocation_mark: j.allocation_mark,
                parts: j
                    .parts
                    .iter()
                    .map(|p| std::mem::take(&mut *lock(p)))
                    .collect(),
            })
            .collect();
        st = lock(&sh.state);
        st.ahead.extend(blocks);
        st.ahead.sort_unstable_by_key(|b| b.start);
        st.ahead_age = 0;
    } else if !st.ahead.is_empty() {
        st.ahead_age += 1;
        if st.ahead_age > AHEAD_PERIODS {
            st.ahead = Vec::new();
        }
    }
    if st.ahead.is_empty() || cands.is_empty() {
        return;
    }
    let State {
        ahead,
        regions,
        store,
        ..
    } = &mut *st;
    // Candidates and blocks are in address order; blocks do not overlap (one per registration).
    // A block whose pages all came up as candidates has served: it is dropped now (it holds 24
    // bytes per page).
    let mut used = vec![0usize; ahead.len()];
    // The block, its part and the position in it that the next candidate is looked up from.
    let (mut bi, mut pi, mut at) = (0, usize::MAX, 0);
    for c in cands.iter_mut() {
        while ahead.get(bi).is_some_and(|b| b.end <= c.addr()) {
            bi += 1;
            pi = usize::MAX;
        }
        let Some(b) = ahead.get(bi) else {
            break;
        };
        if c.addr() < b.start {
            continue;
        }
        let part = (c.addr() - b.start) / (AHEAD_PART * PAGE);
        if part != pi {
            (pi, at) = (part, 0);
        }
        let Some(p) = b.parts.get(part) else {
            continue;
        };
        while p.get(at).is_some_and(|e| e.addr() < c.addr()) {
            at += 1;
        }
        let Some(pre) = p.get(at).filter(|e| e.addr() == c.addr()).map(PagePre::pre) else {
            continue;
        };
        used[bi] += 1;
        let fresh = regions
            .get(&c.region)
            .is_some_and(|r| r.pages[c.index()].kind == ANON && r.pages[c.index()].epoch == 0);
        let stale =
            matches!(pre, Pre::Stable(id) if store.reallocated_since(id, b.allocation_mark));
        if fresh && !stale {
            c.set_pre(pre);
        }
    }
    let mut k = 0;
    ahead.retain(|b| {
        k += 1;
        used[k - 1] < b.pages()
    });
}

/// What the committer should do with one candidate page.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Action {
    Zero,
    Merge(KeyId),
    /// Release the page if its frozen bytes still hold the PPR mark of this slot's ticket.
    Recycle(u32),
}

/// What reading a page ahead found (see `read_ahead`). A hint only: every merge is verified on
/// frozen bytes.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Pre {
    /// Nothing known: classification reads the page.
    None,
    Zero,
    /// Equal to this stable copy when read.
    Stable(KeyId),
    /// Matched no stable copy; the xxh3-128 hash of its contents (low word first).
    Hash([u64; 2]),
}

/// A page's address and what was read ahead for it, in 24 bytes: the kind of `Pre` goes in the
/// address's low bits (a page address has 12 zero bits there). Read-ahead results and
/// candidates are made for every page of a registered range at once, in memory that costs a page
/// fault per 4 KiB.
#[derive(Clone, Copy)]
struct PagePre {
    addr_pre: usize,
    /// `Pre::Hash`'s hash, or `Pre::Stable`'s copy in the low word.
    word: [u64; 2],
}

impl PagePre {
    fn new(addr: usize, pre: Pre) -> Self {
        debug_assert!(addr % PAGE == 0);
        let mut p = PagePre {
            addr_pre: addr,
            word: [0; 2],
        };
        p.set_pre(pre);
        p
    }

    fn addr(&self) -> usize {
        self.addr_pre & !(PAGE - 1)
    }

    fn pre(&self) -> Pre {
        match self.addr_pre & 3 {
            0 => Pre::None,
            1 => Pre::Zero,
            2 => Pre::Stable(self.word[0] as KeyId),
            _ => Pre::Hash(self.word),
        }
    }

    fn set_pre(&mut self, pre: Pre) {
        let (tag, word) = match pre {
            Pre::None => (0, [0; 2]),
            Pre::Zero => (1, [0; 2]),
            Pre::Stable(id) => (2, [u64::from(id), 0]),
            Pre::Hash(h) => (3, h),
        };
        self.addr_pre = self.addr() | tag;
        self.word = word;
    }
}

/// A page that may be merged this period (32 bytes; its index is derived from its address).
#[derive(Clone, Copy)]
struct Candidate {
    /// Start address of the page's region (its key in `State::regions`).
    region: usize,
    page: PagePre,
}

const _: () = assert!(std::mem::size_of::<PagePre>() == 24);
const _: () = assert!(std::mem::size_of::<Candidate>() == 32);

impl Candidate {
    fn new(region: usize, addr: usize, pre: Pre) -> Self {
        debug_assert!(addr >= region);
        Candidate {
            region,
            page: PagePre::new(addr, pre),
        }
    }

    fn addr(&self) -> usize {
        self.page.addr()
    }

    /// The page's index in its region.
    fn index(&self) -> usize {
        (self.addr() - self.region) / PAGE
    }

    /// Read ahead, when the page is unwritten since.
    fn pre(&self) -> Pre {
        self.page.pre()
    }

    fn set_pre(&mut self, pre: Pre) {
        self.page.set_pre(pre);
    }
}

/// Reads word `i` of the page at `addr`, big-endian, with a volatile load (the owner may write it).
fn page_word(addr: usize, i: usize) -> u64 {
    // SAFETY: addr is a registered, mapped page and i < WORDS; volatile because another thread
    // may write it concurrently. A torn view only affects which index entry is proposed: every
    // merge is verified on frozen bytes.
    u64::from_be(unsafe { std::ptr::read_volatile((addr as *const u64).add(i)) })
}

/// Copies the page at `addr` (which its owner may be writing) into `buf`, to be read there.
fn copy_page(addr: usize, buf: &mut [u64; WORDS]) {
    // SAFETY: addr is a registered, mapped page and `buf` a page of this thread's own; no reference
    // to the page is formed, and what a concurrent writer can cause is a torn copy, which only
    // affects which copy or hash is proposed (every merge is verified on frozen bytes). A plain
    // copy rather than word-by-word volatile loads, as rust-vmm's vm-memory copies guest memory
    // longer than a word: `memcpy` runs at memory speed (this copy and hash is most of the
    // read-ahead's time).
    unsafe { std::ptr::copy_nonoverlapping(addr as *const u64, buf.as_mut_ptr(), WORDS) };
}

fn as_bytes(buf: &[u64; WORDS]) -> &[u8] {
    // SAFETY: a [u64; 512] is 4096 initialised bytes; u8 has no alignment requirement.
    unsafe { std::slice::from_raw_parts(buf.as_ptr().cast::<u8>(), PAGE) }
}

/// Checksum-mode watching: whether the page at `addr` changed since the last call.
fn checksum_changed(addr: usize, last: &mut u64) -> bool {
    let mut buf = [0u64; WORDS];
    copy_page(addr, &mut buf);
    let sum = twox_hash::XxHash3_64::oneshot(as_bytes(&buf));
    let changed = *last != sum;
    *last = sum;
    changed
}

/// Present pages, reported with `PAGE_IS_PFNZERO`, and with `PAGE_IS_FILE` where they may be file
/// pages. Whether a page is a file page costs the kernel a look at the page itself (7x the cost
/// of a walk that reads page table entries only). In the write-protect mode the mapping tells
/// instead: registered pieces that are write-protectable (`PAGE_IS_WPALLOWED`, a property of the
/// mapping) are the anonymous ones, the others are mappings of the store. So in that mode this
/// walks the anonymous pieces only, and the store mappings are walked apart when needed.
fn present_pages(mode: WatchMode) -> sys::ScanQuery {
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

/// Pages written since the last scan, write-protected again by the same call.
fn written_query() -> sys::ScanQuery {
    sys::ScanQuery {
        flags: PM_SCAN_WP_MATCHING,
        category_mask: PAGE_IS_WRITTEN,
        return_mask: PAGE_IS_WRITTEN,
        ..Default::default()
    }
}

/// Adds the scan results `found` (ranges of a region starting at `start`) to the per-page
/// categories: bit 0 present, bit 1 file-backed, bit 2 zero pfn, bit 3 written.
fn mark_pages(cats: &mut [u8], start: usize, found: &[PageRegion]) {
    for pr in found {
        let mut bits = 0;
        for (cat, bit) in [
            (PAGE_IS_PRESENT, 1),
            (PAGE_IS_FILE, 2),
            (PAGE_IS_PFNZERO, 4),
            (PAGE_IS_WRITTEN, 8),
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

/// Counts `step` more unchanged periods for the page at `(region, addr)` in a store
/// mapping (COW-broken or on a replaced store): a candidate once it waited long enough, else
/// volatile.
fn unchanged_period(
    p: &mut Page,
    step: u8,
    config: &Config,
    (region, addr): (usize, usize),
    out: &mut Vec<Candidate>,
    volatile: &mut u64,
) {
    p.unchanged = p.unchanged.saturating_add(step);
    if p.unchanged >= config.merge_periods.max(p.writes) {
        out.push(Candidate::new(region, addr, Pre::None));
    } else {
        *volatile += 1;
    }
}

/// Finds written pages and returns the candidates (unchanged long enough, present, anonymous).
/// A `kicked` period counts as a whole one (the caller asked for it).
fn watch(sh: &Shared, st: &mut State, config: &Config, kicked: bool) -> io::Result<Vec<Candidate>> {
    let now = Instant::now();
    let mut out = Vec::new();
    // Kept from period to period: allocated afresh, the per-page categories came from new
    // memory every period (a page fault per 4 KiB).
    let mut scan = std::mem::take(&mut st.scan);
    let ScanBuffers {
        regions: regions_buf,
        cats,
        entries,
    } = &mut scan;
    let mut volatile = 0u64;
    let mut unique = 0u64;
    let all_pages: usize = st.regions.values().map(|r| r.pages.len()).sum();
    let State {
        regions,
        pagemap,
        store,
        zero,
        stale_sightings,
        ..
    } = st;
    for r in regions.values_mut() {
        let n = r.pages.len();
        let end = r.start + r.len();
        // Unchanged pages count this period unless it came less than a period after arming.
        let step = match r.armed_at {
            Some(t) if !kicked && now.duration_since(t) < config.merge_period => 0,
            _ => {
                r.armed_at = None;
                1
            }
        };
        // Categories per page: bit 0 present, bit 1 file-backed, bit 2 zero pfn, bit 3 written.
        cats.clear();
        cats.resize(n, 0);
        if sh.mode == WatchMode::UffdWp {
            regions_buf.clear();
            if r.merged_ever {
                // Write-protect scans skip the store mappings merged pages live in, so those are
                // seen by more scans: which pages are present in the anonymous pieces, and in the
                // store mappings which are present and file-backed (or written: copy-on-write
                // broken). Each piece is walked for presence once (see `present_pages`).
                pagemap.scan(r.start, end, &written_query(), regions_buf)?;
                pagemap.scan(r.start, end, &present_pages(sh.mode), regions_buf)?;
                let store_mappings = sys::ScanQuery {
                    category_mask: PAGE_IS_PRESENT | PAGE_IS_WPALLOWED,
                    category_inverted: PAGE_IS_WPALLOWED,
                    return_mask: PAGE_IS_PRESENT | PAGE_IS_FILE | PAGE_IS_PFNZERO,
                    ..Default::default()
                };
                pagemap.scan(r.start, end, &store_mappings, regions_buf)?;
            } else {
                // Only anonymous memory: one walk returns every page's categories and
                // write-protects the written ones again.
                let all = sys::ScanQuery {
                    flags: PM_SCAN_WP_MATCHING,
                    category_anyof_mask: PAGE_IS_PRESENT | PAGE_IS_WRITTEN,
                    return_mask: PAGE_IS_PRESENT | PAGE_IS_WRITTEN | PAGE_IS_PFNZERO,
                    ..Default::default()
                };
                pagemap.scan(r.start, end, &all, regions_buf)?;
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
        sh.counters.scanned.fetch_add(n as u64, Ordering::Relaxed);
        let wp = sh.mode == WatchMode::UffdWp;
        for (i, (p, &c)) in r.pages.iter_mut().zip(cats.iter()).enumerate() {
            // The two cases of almost every page while a merge goes on and after it, decided
            // without a branch per kind (the kinds of neighbouring pages alternate, so a branch
            // on each was mispredicted half of the time): a merged page still mapping its copy
            // (not present, or present and file-backed), and a unique page present, not the zero
            // page and not written (the write-protect scan tells; checksums are not compared
            // here). Both are handled below as well; this only skips to the next page.
            let merged_quiet = (p.kind == MERGED) & (c & 3 != 1);
            let unique_quiet = (p.kind == UNIQUE) & (c & 0b1101 == 1) & wp;
            unique += u64::from(unique_quiet);
            if merged_quiet | unique_quiet {
                continue;
            }
            let present = c & 1 != 0;
            match p.kind {
                MERGED => {
                    if present && c & 2 == 0 {
                        // Written since the merge: the kernel gave it a private copy. Merging it
                        // again costs a freeze, a mapping and another copy-on-write fault if it
                        // is written again, so each break doubles its wait (to max_backoff).
                        store.drop_ref(p.sid);
                        p.kind = BROKEN;
                        p.unchanged = 0;
                        p.back_off(config.max_backoff);
                        checksum_changed(r.start + i * PAGE, &mut r.sums[i]);
                        sh.counters.cow_breaks.fetch_add(1, Ordering::Relaxed);
                    }
                    continue;
                }
                FOREIGN => {
                    // (Not present: not touched since the merge, which maps no page table entry.
                    // Read, it is the old copy all the same.)
                    let addr = r.start + i * PAGE;
                    if present && c & 2 == 0 {
                        // Written: a private copy now, like a COW-broken page (the replaced
                        // store kept no count of it).
                        p.kind = BROKEN;
                        p.unchanged = 0;
                        p.back_off(config.max_backoff);
                        checksum_changed(addr, &mut r.sums[i]);
                        continue;
                    }
                    if sh.store_uffd.is_some() {
                        let at = (r.start, addr);
                        unchanged_period(p, step, config, at, &mut out, &mut volatile);
                    }
                    continue;
                }
                BROKEN => {
                    // Private pages in store mappings: watched by checksum (there are few), merged
                    // again through the store mappings' write-protection.
                    if sh.store_uffd.is_none() || !present || c & 2 != 0 {
                        continue;
                    }
                    let addr = r.start + i * PAGE;
                    if checksum_changed(addr, &mut r.sums[i]) {
                        p.unchanged = 0;
                        p.writes = p.writes.saturating_add(1).min(config.max_backoff);
                        volatile += 1;
                        continue;
                    }
                    let at = (r.start, addr);
                    unchanged_period(p, step, config, at, &mut out, &mut volatile);
                    continue;
                }
                ZERO => {
                    if present && c & 4 == 0 {
                        p.kind = ANON;
                        *zero -= 1;
                    } else {
                        continue;
                    }
                }
                UNIQUE => {
                    if present && c & 4 == 0 {
                        let written = if sh.mode == WatchMode::UffdWp {
                            c & 8 != 0
                        } else {
                            checksum_changed(r.start + i * PAGE, &mut r.sums[i])
                        };
                        if !written {
                            unique += 1;
                            continue;
                        }
                        p.kind = ANON;
                        p.unchanged = 0;
                        p.epoch = p.epoch.wrapping_add(1);
                        p.writes = p.writes.saturating_add(1).min(config.max_backoff);
                        *stale_sightings += 1;
                        volatile += 1;
                        continue;
                    }
                    p.kind = ANON;
                    *stale_sightings += 1;
                }
                _ => {}
            }
            if !present || c & 4 != 0 {
                p.unchanged = 0;
                continue;
            }
            let addr = r.start + i * PAGE;
            let written = if sh.mode == WatchMode::UffdWp {
                c & 8 != 0
            } else {
                checksum_changed(addr, &mut r.sums[i])
            };
            if written {
                p.unchanged = 0;
                p.epoch = p.epoch.wrapping_add(1);
                p.writes = p.writes.saturating_add(1).min(config.max_backoff);
                volatile += 1;
                continue;
            }
            p.unchanged = p.unchanged.saturating_add(step);
            let needed = config.merge_periods.max(p.writes);
            if p.unchanged >= needed {
                if out.capacity() == 0 {
                    // Room for every page left at once: a registered range becomes candidates all
                    // together, and growing by doubling would copy and fault in tens of MiB.
                    out.reserve(all_pages);
                }
                out.push(Candidate::new(r.start, addr, Pre::None));
            } else {
                volatile += 1;
            }
        }
    }
    st.volatile = volatile;
    st.unshared = unique;
    // Sized for the largest region (memory a region unregistered since does not keep).
    let largest = st
        .regions
        .values()
        .map(|r| r.pages.len())
        .max()
        .unwrap_or(0);
    scan.shrink_to(largest);
    st.scan = scan;
    Ok(out)
}

/// Scratch space of [`watch`]: per-page categories and what the scans return.
#[derive(Default)]
struct ScanBuffers {
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
    fn bytes(&self) -> usize {
        self.regions.capacity() * std::mem::size_of::<PageRegion>()
            + self.cats.capacity()
            + self.entries.capacity() * std::mem::size_of::<u64>()
    }
}

/// Inserts `ids` into the stable tree from the worker threads; results in the order of `ids`.
fn insert_parallel(
    pool: &Pool,
    parts: usize,
    tree: &Arc<pageone_index::SdTree<crate::store::StoreKeys>>,
    ids: &[KeyId],
) -> Vec<Result<pageone_index::Insert, pageone_index::IndexError>> {
    let tree = tree.clone();
    let n = ids.len();
    let mut all: Vec<_> = pool
        .map_parts(parts, Arc::new(ids.to_vec()), move |_, ids| {
            ids.iter()
                .map(|&id| tree.insert_or_get(id))
                .collect::<Vec<_>>()
        })
        .into_iter()
        .flatten()
        .flatten()
        .collect();
    // A part that did not report publishes nothing.
    while all.len() < n {
        all.push(Err(pageone_index::IndexError::Full(0)));
    }
    all
}

/// Keys that are xxh3 hashes already need no hashing again: use their low bits.
#[derive(Default, Clone, Copy)]
struct IdentityHasher(u64);

impl std::hash::Hasher for IdentityHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes.iter().take(8) {
            self.0 = (self.0 << 8) | b as u64;
        }
    }
    fn write_u128(&mut self, v: u128) {
        self.0 = v as u64;
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = v;
    }
    /// Spread over the whole word (an odd multiplier is a bijection): the map's tags come from
    /// the top bits, which a `u32` leaves zero.
    fn write_u32(&mut self, v: u32) {
        self.0 = u64::from(v).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

type HashOfHash = std::hash::BuildHasherDefault<IdentityHasher>;

/// A content hash as two words: 8-byte aligned, so that a first-sighting entry takes 24 bytes,
/// not the 32 a `u128` key pads it to (the map holds every page waiting for a twin).
#[derive(Clone, Copy, PartialEq, Eq)]
struct HashKey([u64; 2]);

impl std::hash::Hash for HashKey {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        state.write_u64(self.0[0]);
    }
}

impl HashKey {
    fn new(h: u128) -> Self {
        Self([h as u64, (h >> 64) as u64])
    }

    fn get(self) -> u128 {
        self.0[0] as u128 | (self.0[1] as u128) << 64
    }
}

/// The first-sighting map: hash of contents -> (address, epoch) of the UNIQUE page waiting for
/// another page of that content. The epoch rides in the address's page offset bits.
#[derive(Default)]
struct FirstSightings(HashMap<HashKey, u64, HashOfHash>);

impl FirstSightings {
    fn insert(&mut self, h: u128, addr: usize, epoch: u8) {
        debug_assert_eq!(addr % PAGE, 0);
        self.0.insert(HashKey::new(h), addr as u64 | epoch as u64);
    }

    fn remove(&mut self, h: u128) -> Option<(usize, u8)> {
        self.0.remove(&HashKey::new(h)).map(unpack_sighting)
    }

    fn retain(&mut self, mut keep: impl FnMut(u128, usize, u8) -> bool) {
        self.0.retain(|k, &mut v| {
            let (addr, epoch) = unpack_sighting(v);
            keep(k.get(), addr, epoch)
        });
    }

    fn keys(&self) -> impl Iterator<Item = u128> + Clone + '_ {
        self.0.keys().map(|k| k.get())
    }

    fn len(&self) -> usize {
        self.0.len()
    }

    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    fn capacity(&self) -> usize {
        self.0.capacity()
    }

    fn reserve(&mut self, n: usize) {
        self.0.reserve(n);
    }

    fn shrink_to_fit(&mut self) {
        self.0.shrink_to_fit();
    }
}

fn unpack_sighting(v: u64) -> (usize, u8) {
    ((v & !(PAGE as u64 - 1)) as usize, v as u8)
}

/// Takes the first sighting waiting under hash `h` out of the map: its page, if that is still
/// the UNIQUE page of the same epoch (unwritten since it was hashed).
fn take_waiting(st: &mut State, h: u128) -> Option<Candidate> {
    let (addr, epoch) = st.unstable.remove(h)?;
    let region = still_waiting(&st.regions, addr, epoch)?;
    Some(Candidate::new(region, addr, Pre::None))
}

/// The region of the page at `addr` if a first-sighting entry made at `epoch` still
/// describes it: it is the UNIQUE page of that epoch (unwritten since it was hashed).
fn still_waiting(regions: &BTreeMap<usize, RegionState>, addr: usize, epoch: u8) -> Option<usize> {
    let (start, _, p) = page_at(regions, addr)?;
    (p.kind == UNIQUE && p.epoch == epoch).then_some(start)
}

/// The region (its start), index and state of the registered page holding `addr`.
fn page_at(regions: &BTreeMap<usize, RegionState>, addr: usize) -> Option<(usize, usize, &Page)> {
    let (&start, r) = regions.range(..=addr).next_back()?;
    let index = (addr - start) / PAGE;
    Some((start, index, r.pages.get(index)?))
}

/// The first three words of the page at `addr` (a PPR mark's place), read volatile.
///
/// # Safety
/// `addr` is a mapped, readable page that stays mapped during the call.
unsafe fn mark_words(addr: usize) -> [u64; 3] {
    // SAFETY: by the caller's contract; volatile because another thread may write the page.
    [0, 1, 2].map(|w| unsafe { std::ptr::read_volatile((addr as *const u64).add(w)) })
}

/// A set of candidate numbers (dense, from 0): a flag each, no hashing.
#[derive(Default)]
struct CandidateSet(Vec<bool>);

impl CandidateSet {
    fn insert(&mut self, i: u32) {
        let i = i as usize;
        if i >= self.0.len() {
            self.0.resize(i + 1, false);
        }
        self.0[i] = true;
    }

    fn contains(&self, i: u32) -> bool {
        self.0.get(i as usize).copied().unwrap_or(false)
    }
}

/// Adds a candidate with no action yet; returns its number.
fn push_candidate(
    cands: &mut Vec<Candidate>,
    actions: &mut Vec<Option<Action>>,
    c: Candidate,
) -> u32 {
    cands.push(c);
    actions.push(None);
    (cands.len() - 1) as u32
}

/// Decides, on the worker threads, what to do with each candidate (adding UNIQUE pages of earlier
/// periods that turn out to be duplicates).
///
/// The state lock is taken only to group first sightings and to record the new copies; reading
/// pages, writing copies and indexing them run without it, so the committer works meanwhile.
fn classify(
    sh: &Shared,
    view: &StoreView,
    config: &Config,
    mut cands: Vec<Candidate>,
    pool: &Pool,
    relook: Option<Relook>,
) -> Classified {
    let t_start = Instant::now();
    let parts = config.workers.clamp(1, pool.size());
    // A page read ahead whose content is alone in this batch may have a stable copy published
    // since its read: it looks in the tree as usual (the others are grouped by their hash).
    // (With a daemon there is no tree here: the daemon is asked by hash either way.)
    let mut in_batch: HashMap<u128, bool, HashOfHash> = HashMap::default();
    for c in cands.iter().filter(|_| view.tree.is_some()) {
        if let Pre::Hash(h) = c.pre() {
            in_batch
                .entry(joined(h))
                .and_modify(|alone| *alone = false)
                .or_insert(true);
        }
    }
    let items: Arc<Vec<(usize, Pre, bool)>> = Arc::new(
        cands
            .iter()
            .map(|c| {
                let alone = match c.pre() {
                    Pre::Hash(h) => in_batch.get(&joined(h)).copied().unwrap_or(true),
                    _ => false,
                };
                (c.addr(), c.pre(), alone)
            })
            .collect(),
    );
    drop(in_batch);
    // Phase 1: zero check, stable index, hash of first sightings (done already for pages read
    // ahead).
    let tree = view.tree.clone();
    let store_base = view.base;
    let parts_out = pool.map_parts(parts, items, move |lo, items| {
        let mut acts = Vec::with_capacity(items.len());
        let mut hs = Vec::new();
        let mut buf = Box::new([0u64; WORDS]);
        for (k, &(addr, pre, alone)) in items.iter().enumerate() {
            // Pages not read ahead are read now, the same way.
            let pre = match pre {
                Pre::None => read_page(addr, tree.as_deref(), store_base, &mut buf),
                Pre::Hash(h) if alone => match &tree {
                    Some(t) => stable_copy(addr, t, store_base).map_or(Pre::Hash(h), Pre::Stable),
                    None => Pre::Hash(h),
                },
                p => p,
            };
            match pre {
                Pre::Zero => acts.push(Some(Action::Zero)),
                Pre::Stable(id) => acts.push(Some(Action::Merge(id))),
                Pre::Hash(h) => {
                    acts.push(None);
                    hs.push((joined(h), (lo + k) as u32));
                }
                Pre::None => acts.push(None),
            }
        }
        (acts, hs)
    });
    let t_phase1 = Instant::now();
    tracing::debug!(
        phase1_ms = (t_phase1 - t_start).as_secs_f64() * 1e3,
        "classify"
    );
    let mut actions: Vec<Option<Action>> = Vec::with_capacity(cands.len());
    let mut hashes: Vec<(u128, u32)> = Vec::new();
    for (mut a, mut h) in parts_out.into_iter().flatten() {
        actions.append(&mut a);
        hashes.append(&mut h);
    }
    if actions.len() != cands.len() {
        // A worker failed (it cannot, short of a bug): merge nothing in this batch.
        let n = cands.len();
        return Classified {
            cands,
            actions: vec![None; n],
            new_copies: Vec::new(),
        };
    }
    let mut guard = lock(&sh.state);
    let st = &mut *guard;
    // Phase 2: group first sightings by hash, with this period's candidates and with the UNIQUE
    // pages of earlier periods; each group of two or more gets a stable copy, in address order
    // so that runs of pages get runs of ids. Singletons become UNIQUE and wait in the map.
    // `hashes` is in candidate order already (parts are consecutive chunks, appended in order).
    let mut first: HashMap<u128, (u32, bool), HashOfHash> =
        HashMap::with_capacity_and_hasher(hashes.len(), HashOfHash::default());
    let mut groups: Vec<u32> = Vec::new(); // first candidate of each group
    let mut member_of: Vec<(u32, u32)> = Vec::new(); // (candidate, first)
    for &(h, i) in &hashes {
        if let Some((f, grouped)) = first.get_mut(&h) {
            if !*grouped {
                *grouped = true;
                groups.push(*f);
            }
            member_of.push((i, *f));
            continue;
        }
        if let Some(c) = take_waiting(st, h) {
            let j = push_candidate(&mut cands, &mut actions, c);
            first.insert(h, (i, true));
            groups.push(i);
            member_of.push((j, i));
            continue;
        }
        first.insert(h, (i, false));
    }
    // Across processes: ask the scope's daemon about this batch's first sightings. A hash with a
    // copy is adopted (no copy made here); one another process noted is copied even when single
    // here; the rest wait as before. Offers are copies made for content this process noted.
    // The call is made without the state lock (the committer goes on meanwhile; it does not
    // touch the first-sighting map nor pages waiting in it).
    let mut adopted: Vec<(u32, KeyId)> = Vec::new();
    if let Some(remote) = &view.remote {
        let keys: Vec<(u128, u32, bool)> = first.iter().map(|(&h, &(i, g))| (h, i, g)).collect();
        let mut hs: Vec<u128> = keys.iter().map(|k| k.0).collect();
        // Pages waiting in the first-sighting map are asked about again now and then: the copy
        // another process was to make for them may have come out under another hash (its page
        // changed), and then no offer ever comes.
        if let Some(r) = relook {
            let n = st.unstable.len();
            hs.extend(
                st.unstable
                    .keys()
                    .cycle()
                    .skip(r.skip % n.max(1))
                    .take(r.take.min(n))
                    .filter(|h| !first.contains_key(h)),
            );
        }
        drop(guard);
        let reply = remote.lookup(&hs);
        guard = lock(&sh.state);
        let st = &mut *guard;
        if let Some((answers, offers)) = reply {
            let mut taken = CandidateSet::default();
            for (&h, &a) in hs[keys.len()..].iter().zip(&answers[keys.len()..]) {
                if a == crate::proto::NOTED {
                    continue;
                }
                match (take_waiting(st, h), a) {
                    (Some(c), _) => {
                        let j = push_candidate(&mut cands, &mut actions, c);
                        first.insert(h, (j, true));
                        if a == crate::proto::WANTED {
                            groups.push(j);
                        } else {
                            adopted.push((j, a));
                        }
                    }
                    // Not usable any more: give the hold back (unless this process holds it).
                    (None, slot) if slot != crate::proto::WANTED => {
                        if st.store.adopt(slot) == Some(true) {
                            st.store.unadopt(slot);
                        }
                    }
                    (None, _) => {}
                }
            }
            for (&(h, i, grouped), &a) in keys.iter().zip(&answers) {
                match a {
                    crate::proto::NOTED => {
                        // A page still on a replaced store gets a copy here even alone of its
                        // content: it is a merge already (a copy of its own costs no memory),
                        // and the replaced store is freed once no page maps it.
                        let c = &cands[i as usize];
                        let foreign = st.store.has_replaced()
                            && st
                                .regions
                                .get(&c.region)
                                .is_some_and(|r| r.pages[c.index()].kind == FOREIGN);
                        if foreign && !grouped {
                            first.insert(h, (i, true));
                            groups.push(i);
                        }
                    }
                    crate::proto::WANTED => {
                        if !grouped {
                            first.insert(h, (i, true));
                            groups.push(i);
                        }
                    }
                    slot => {
                        first.insert(h, (i, true));
                        taken.insert(i);
                        adopted.push((i, slot));
                    }
                }
            }
            groups.retain(|&g| !taken.contains(g));
            for (h, slot) in offers {
                match take_waiting(st, h) {
                    Some(c) => {
                        st.offered = true;
                        let j = push_candidate(&mut cands, &mut actions, c);
                        adopted.push((j, slot));
                    }
                    // Not usable any more: give the hold back (unless this process holds it anyway).
                    None => {
                        if st.store.adopt(slot) == Some(true) {
                            st.store.unadopt(slot);
                        }
                    }
                }
            }
        }
    }
    let st = &mut *guard;
    // Room for the new first sightings at once (a map larger than its entries need would have
    // them spread over more fresh memory).
    st.unstable
        .reserve(first.values().filter(|&&(_, grouped)| !grouped).count());
    for (&h, &(i, grouped)) in &first {
        if !grouped {
            let c = &cands[i as usize];
            if let Some(r) = st.regions.get_mut(&c.region) {
                let p = &mut r.pages[c.index()];
                p.unchanged = 0;
                if !in_store_mapping(p.kind) {
                    p.kind = UNIQUE;
                    st.unstable.insert(h, c.addr(), p.epoch);
                } else {
                    // A COW-broken page is re-hashed when it is a candidate again instead; each
                    // miss doubles the wait (to max_backoff periods), so the many unique pages a
                    // booting guest rewrites do not cost a hash and a lookup every two periods.
                    p.back_off(config.max_backoff);
                }
                st.unshared += 1;
            }
        }
    }
    // A copy serves at most `max_sharing` pages of this process: larger groups, and groups whose
    // adopted copy is (nearly) full here, are split; each further chunk is led by a page that
    // gets a copy of its own (a fresh one: through the daemon, it must not be deduplicated back
    // onto the full copy).
    let mut fresh_groups = split_groups(
        &st.store,
        config.max_sharing,
        &groups,
        &mut adopted,
        &mut member_of,
    );
    // Their copies are not indexed: the tree would answer with the full copy of that content.
    let mut chunk_leaders = CandidateSet::default();
    for &g in &fresh_groups {
        chunk_leaders.insert(g);
    }
    let mut new_copies = Vec::new();
    if groups.is_empty() && adopted.is_empty() && fresh_groups.is_empty() {
        return Classified {
            cands,
            actions,
            new_copies,
        };
    }
    groups.sort_unstable();
    fresh_groups.sort_unstable();
    let t_group = Instant::now();
    // New copies (consecutive ids for runs of pages where the store allows), then the adopted
    // slots: (first candidate, id, new here). Local copies are written below without the lock:
    // their ids are this batch's alone until published.
    if view.remote.is_none() {
        // Every local copy is a new one.
        groups.append(&mut fresh_groups);
        groups.sort_unstable();
    }
    let srcs: Vec<usize> = groups.iter().map(|&g| cands[g as usize].addr()).collect();
    let (made, to_write) = match &view.remote {
        // The daemon makes them; asked without the state lock.
        Some(remote) if !srcs.is_empty() || !fresh_groups.is_empty() => {
            drop(guard);
            let mut slots = remote.copy(&srcs, false);
            let fresh_srcs: Vec<usize> = fresh_groups
                .iter()
                .map(|&g| cands[g as usize].addr())
                .collect();
            slots.extend(remote.copy(&fresh_srcs, true));
            groups.append(&mut fresh_groups);
            guard = lock(&sh.state);
            let st = &mut *guard;
            let made: Vec<Option<(KeyId, bool)>> = slots
                .into_iter()
                .map(|s| {
                    let id = s?;
                    st.store.adopt(id).map(|fresh| (id, fresh))
                })
                .collect();
            (made, None)
        }
        Some(_) => (Vec::new(), None),
        None => match st.store.alloc(srcs.len()) {
            Some(ids) => (ids.iter().map(|&id| Some((id, true))).collect(), Some(ids)),
            None => {
                tracing::warn!("stable store is full; first sightings are not merged this period");
                (vec![None; srcs.len()], None)
            }
        },
    };
    let st = &mut *guard;
    let mut todo: Vec<(u32, KeyId, bool)> = Vec::with_capacity(groups.len() + adopted.len());
    for (&g, m) in groups.iter().zip(made) {
        if let Some((id, fresh)) = m {
            todo.push((g, id, fresh));
        }
    }
    for (i, slot) in adopted {
        if let Some(fresh) = st.store.adopt(slot) {
            todo.push((i, slot, fresh));
        }
    }
    drop(guard);
    if let Some(ids) = &to_write {
        // The kernel reads the source pages (they may be changing: every merge is verified
        // later on frozen bytes).
        if let Err(e) = crate::store::write_copies(view.fd, &srcs, ids) {
            tracing::warn!(error = %e, "stable copies could not be written; not merging them");
            let mut st = lock(&sh.state);
            for &id in ids {
                st.store.free_unmapped(id);
            }
            let written: HashSet<KeyId> = ids.iter().copied().collect();
            todo.retain(|t| !written.contains(&t.1));
        }
    }
    let t_copy = Instant::now();
    // Index the new ids on the workers (the SD tree takes concurrent inserts), then record the
    // outcomes serially.
    let fresh: Vec<KeyId> = todo
        .iter()
        .filter(|t| t.2 && !chunk_leaders.contains(t.0))
        .map(|t| t.1)
        .collect();
    let mut inserted = match &view.tree {
        Some(tree) => insert_parallel(pool, parts, tree, &fresh),
        None => Vec::new(),
    }
    .into_iter();
    let mut guard = lock(&sh.state);
    let st = &mut *guard;
    // The copy of each group, by its first candidate.
    let mut id_of_first: Vec<Option<KeyId>> = vec![None; cands.len()];
    for &(g, id, is_new) in &todo {
        let used = if is_new && chunk_leaders.contains(g) {
            // Allocated here and never indexed: freed when its last page lets go of it.
            new_copies.push(id);
            id
        } else if is_new {
            new_copies.push(id);
            let recorded = if view.tree.is_some() {
                let ins = inserted
                    .next()
                    .unwrap_or(Err(pageone_index::IndexError::Full(0)));
                st.store.record_insert(id, ins)
            } else {
                Ok(st.store.record_adopted(id))
            };
            match recorded {
                Ok(used) => used,
                Err(e) => {
                    tracing::warn!(error = %e, "stable copy not published");
                    continue;
                }
            }
        } else {
            id
        };
        id_of_first[g as usize] = Some(used);
        actions[g as usize] = Some(Action::Merge(used));
    }
    for (i, f) in member_of {
        if let Some(id) = id_of_first[f as usize] {
            actions[i as usize] = Some(Action::Merge(id));
        }
    }
    tracing::debug!(
        phase1_to_group_ms = (t_group - t_phase1).as_secs_f64() * 1e3,
        copy_ms = (t_copy - t_group).as_secs_f64() * 1e3,
        publish_ms = t_copy.elapsed().as_secs_f64() * 1e3,
        "classify"
    );
    Classified {
        cands,
        actions,
        new_copies,
    }
}

/// Splits groups so that no copy serves more than `max_sharing` pages of this process. `groups`
/// are leaders of new copies, `adopted` leaders of copies the daemon holds, `member_of` the
/// other pages as (candidate, leader). Returns the leaders of the extra chunks (each needs a new
/// copy of its own); members are re-pointed to them. An adopted copy retired here (full) gives
/// its whole group to a fresh leader.
fn split_groups(
    store: &Store,
    max_sharing: u32,
    groups: &[u32],
    adopted: &mut Vec<(u32, KeyId)>,
    member_of: &mut [(u32, u32)],
) -> Vec<u32> {
    let cap = max_sharing.max(2) as usize;
    let mut fresh = Vec::new();
    if member_of.is_empty() {
        // No group has members (the usual batch across processes: each page adopts another
        // process's copy): only leaders whose adopted copy is full need a fresh copy.
        adopted.retain(|&(l, slot)| {
            let full = store.room(slot, max_sharing) == 0;
            if full {
                fresh.push(l);
            }
            !full
        });
        return fresh;
    }
    // Room per leader, counting the leader itself.
    let mut room: HashMap<u32, usize> = groups.iter().map(|&g| (g, cap)).collect();
    let mut full_adopted = HashSet::new();
    for &(l, slot) in adopted.iter() {
        let r = store.room(slot, max_sharing) as usize;
        if r == 0 {
            // The leader itself needs a fresh copy.
            full_adopted.insert(l);
            fresh.push(l);
            room.insert(l, cap);
        } else {
            room.insert(l, r);
        }
    }
    adopted.retain(|(l, _)| !full_adopted.contains(l));
    // Members in candidate order, so chunks keep address runs together.
    member_of.sort_unstable();
    let mut used: HashMap<u32, usize> = room.keys().map(|&l| (l, 1)).collect();
    // The current chunk leader of each original leader.
    let mut chunk: HashMap<u32, u32> = HashMap::new();
    for (c, l) in member_of.iter_mut() {
        let orig = *l;
        let lead = *chunk.get(&orig).unwrap_or(&orig);
        let Some(&r) = room.get(&lead) else {
            continue;
        };
        let u = used.entry(lead).or_insert(1);
        if *u < r {
            *u += 1;
            *l = lead;
        } else {
            // This page starts a new chunk with a copy of its own.
            fresh.push(*c);
            room.insert(*c, cap);
            used.insert(*c, 1);
            chunk.insert(orig, *c);
            *l = *c;
        }
    }
    fresh
}

/// Records the outcome of mapping copy `copy` over a page: merged, or (`ok == false`) the
/// reference counted for it is taken back.
///
/// A merge that could not be mapped (the VMA budget is spent, or `mmap` failed) waits longer
/// each time, doubling up to `max_backoff` periods: a process at its VMA limit must not pay a
/// classification of every unmergeable page every two periods.
fn settle(p: &mut Page, store: &mut Store, copy: KeyId, ok: bool, max_backoff: u8) {
    if ok {
        // The page keeps its write history: a page that was written again after a merge
        // waits longer before the next one.
        *p = Page {
            sid: copy,
            kind: MERGED,
            unchanged: 0,
            writes: p.writes,
            epoch: p.epoch,
        };
    } else {
        store.undo_ref(copy);
        p.unchanged = 0;
        p.back_off(max_backoff);
    }
}

/// The VMA budget of one batch's commit. The engine's count is an estimate that merges raise by
/// their worst case (two VMAs, one when the copy continues its left neighbour's mapping), so
/// before it refuses a merge it is replaced by the kernel's count, once per batch (reading
/// `/proc/self/maps` costs milliseconds with tens of thousands of VMAs).
struct VmaBudget {
    budget: usize,
    recounted: bool,
}

impl VmaBudget {
    fn new(budget: usize) -> Self {
        Self {
            budget,
            recounted: false,
        }
    }

    /// Whether `cost` more VMAs fit; `vmas` is the engine's count, corrected here if need be.
    fn allows(&mut self, vmas: &mut usize, cost: usize) -> bool {
        if *vmas + cost <= self.budget {
            return true;
        }
        if !self.recounted {
            self.recounted = true;
            if let Ok(n) = sys::map_count() {
                *vmas = n;
            }
        }
        *vmas + cost <= self.budget
    }
}

/// Maps copies `sid..sid + m` over the `m` pages of `region` from page `index` on, if the VMA
/// budget has room for `cost` more VMAs, and settles every page either way (merged, or its
/// reference taken back and the page backed off). Returns whether the copies were mapped.
///
/// # Safety
///
/// The caller holds the pages still (moved out, or write-protected with writers blocked) and has
/// compared them equal to their copies, so replacing the mapping discards nothing.
#[allow(clippy::too_many_arguments)]
unsafe fn map_copies(
    sh: &Shared,
    region: &mut RegionState,
    store: &mut Store,
    config: &Config,
    (vmas, budget): (&mut usize, &mut VmaBudget),
    index: usize,
    (sid, m): (KeyId, usize),
    cost: usize,
) -> bool {
    let addr = region.start + index * PAGE;
    let ok = if !budget.allows(vmas, cost) {
        sh.counters
            .vma_limited
            .fetch_add(m as u64, Ordering::Relaxed);
        false
    } else {
        // SAFETY: the pages are held still and equal their copies (this function's contract).
        match unsafe {
            sys::mmap_private_fixed(
                addr as *mut u8,
                m * PAGE,
                store.fd(),
                sid as u64 * PAGE as u64,
            )
        } {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(error = %e, "merge mapping failed; pages are put back");
                false
            }
        }
    };
    for q in 0..m {
        settle(
            &mut region.pages[index + q],
            store,
            sid + q as u32,
            ok,
            config.max_backoff,
        );
    }
    if ok {
        *vmas += cost;
        region.merged_ever = true;
        sh.counters.merges.fetch_add(m as u64, Ordering::Relaxed);
        watch_store_mapping(sh, addr, m);
    }
    ok
}

/// Registers a new mapping of the store with the store mappings' userfaultfd, so that its pages
/// can be frozen for a new merge if they are COW-broken later. Failing only costs that.
fn watch_store_mapping(sh: &Shared, addr: usize, pages: usize) {
    if let Some(u) = &sh.store_uffd {
        if let Err(e) = u.register(addr, pages * PAGE, UFFDIO_REGISTER_MODE_WP) {
            tracing::debug!(error = %e, "store mapping not write-protectable; it will not be re-merged");
        }
    }
}

/// A run of consecutive candidate pages of one region.
struct Run {
    start: usize,
    first_index: usize,
    n: usize,
}

/// Whether the page at `live` (held still by write-protection) equals copy `copy`. Volatile
/// reads: the page is someone else's memory even while writers are held off.
fn live_page_equals(live: usize, copy: usize) -> bool {
    (0..WORDS).all(|i| {
        // SAFETY: both are mapped pages and i < WORDS; `copy` is an immutable published copy.
        unsafe {
            std::ptr::read_volatile((live as *const u64).add(i))
                == std::ptr::read_volatile((copy as *const u64).add(i))
        }
    })
}

/// Merges a run of COW-broken pages again. They live in store mappings, which `UFFDIO_MOVE` cannot
/// freeze, so writers are held off with synchronous write-protection instead: the pages stay
/// readable, any write blocks until the run is done, and the comparison reads bytes that cannot
/// change. Equal subruns are replaced by mappings of the copies; the rest is un-protected.
#[allow(clippy::too_many_arguments)]
fn commit_broken(
    sh: &Shared,
    store: &mut Store,
    region: &mut RegionState,
    run: Run,
    acts: &[Option<Action>],
    config: &Config,
    vmas: &mut usize,
    budget: &mut VmaBudget,
) {
    let Some(u2) = &sh.store_uffd else { return };
    let Run {
        start,
        first_index,
        n,
    } = run;
    if u2.writeprotect(start, n * PAGE, true).is_err() {
        // Some page is not in a write-protectable mapping: leave the run alone this time.
        let _ = u2.writeprotect(start, n * PAGE, false);
        return;
    }
    let mut verdict: Vec<Option<Action>> = vec![None; n];
    for k in 0..n {
        let Some(Action::Merge(sid)) = acts[k] else {
            continue;
        };
        if store.refs(sid) >= config.max_sharing {
            store.retire(sid);
        } else if live_page_equals(start + k * PAGE, store.addr(sid)) {
            verdict[k] = Some(Action::Merge(sid));
            store.add_ref(sid);
        } else {
            sh.counters.mismatches.fetch_add(1, Ordering::Relaxed);
        }
    }
    let mut k = 0;
    while k < n {
        let Some((sid, m)) = merge_subrun(&verdict, k) else {
            region.pages[first_index + k].unchanged = 0;
            k += 1;
            continue;
        };
        // SAFETY: the subrun's pages are write-protected with writers blocked and equal their
        // copies (compared above).
        let ok = unsafe {
            map_copies(
                sh,
                region,
                store,
                config,
                (vmas, &mut *budget),
                first_index + k,
                (sid, m),
                2,
            )
        };
        if !ok {
            verdict[k..k + m].fill(None);
        }
        k += m;
    }
    // Let writers in: un-protect what was not replaced, then wake everyone who waited on the run
    // (a wake needs no mapping, so it also reaches writers of the replaced pages).
    for (k, v) in verdict.iter().enumerate() {
        if v.is_none() {
            let _ = u2.writeprotect(start + k * PAGE, PAGE, false);
        }
    }
    let _ = u2.wake(start, n * PAGE);
}

/// Compares frozen pages: `(frozen, copy)` pairs, `copy == 0` meaning "is it all zero?", and
/// `frozen == 0` meaning "not moved" (false). Long runs are split over the workers.
fn verify_pages(pool: &Pool, workers: usize, jobs: Vec<(usize, usize)>) -> Vec<bool> {
    fn check(frozen: usize, copy: usize) -> bool {
        if frozen == 0 {
            return false;
        }
        // SAFETY: `frozen` is a scratch page holding a page moved in by the committer, which waits
        // for this check; only the engine knows the scratch area, so nobody writes it meanwhile.
        let f = unsafe { std::slice::from_raw_parts(frozen as *const u8, PAGE) };
        if copy == 0 {
            return f.iter().all(|&b| b == 0);
        }
        // SAFETY: `copy` is a published stable copy: the store is written only before
        // publication, so it is immutable while referenced here.
        let c = unsafe { std::slice::from_raw_parts(copy as *const u8, PAGE) };
        f == c
    }
    let parts = workers.clamp(1, pool.size());
    if jobs.len() < 64 || parts == 1 {
        return jobs.iter().map(|&(f, c)| check(f, c)).collect();
    }
    let n = jobs.len();
    let mut equal: Vec<bool> = pool
        .map_parts(parts, Arc::new(jobs), |_, jobs| {
            jobs.iter().map(|&(f, c)| check(f, c)).collect::<Vec<_>>()
        })
        .into_iter()
        .flatten()
        .flatten()
        .collect();
    // A part that did not report (a bug) verifies nothing: nothing is merged.
    if equal.len() != n {
        equal = vec![false; n];
    }
    equal
}

/// Sets `moved[k]` to whether page `k` of the run at `start` moved to scratch slot `k`: the slot
/// holds a page and the run's address none (see the failed-move note in `commit`). If a scan
/// fails, `moved` stays as the moves reported it.
fn reconcile_moved(pagemap: &sys::Pagemap, start: usize, scratch: usize, moved: &mut [bool]) {
    let n = moved.len();
    let (Ok(slots), Ok(live)) = (
        pagemap.pages_with(scratch, n, PAGE_IS_PRESENT),
        pagemap.pages_with(start, n, PAGE_IS_PRESENT),
    ) else {
        return;
    };
    for (k, m) in moved.iter_mut().enumerate() {
        *m = slots[k] && !live[k];
    }
}

/// What a read fault on a file mapping maps at once, aligned, of the pages in the page cache
/// (Linux's default `fault_around_bytes`).
const FAULT_AROUND_BYTES: usize = 64 << 10;

/// The subrun of merges at `k`: its first copy and its length, as long as the copies follow each
/// other (one mapping of the store covers it). `None` if `acts[k]` is not a merge.
fn merge_subrun(acts: &[Option<Action>], k: usize) -> Option<(KeyId, usize)> {
    let Some(Action::Merge(sid)) = acts[k] else {
        return None;
    };
    let m = acts[k..]
        .iter()
        .enumerate()
        .take_while(|&(j, a)| *a == Some(Action::Merge(sid.wrapping_add(j as u32))))
        .count();
    Some((sid, m))
}

/// Packs a run `[start, start + pages*PAGE)` into one word: page number above, length below.
fn pack_run(start: usize, pages: usize) -> u64 {
    ((start as u64 / PAGE as u64) << 16) | pages as u64
}

fn unpack_run(w: u64) -> (usize, usize) {
    let start = (w >> 16) as usize * PAGE;
    (start, start + (w & 0xffff) as usize * PAGE)
}

/// Freezes, verifies and replaces runs of candidates, in address order. The state lock is held
/// for one run at a time (at most `MAX_RUN` pages), so the classifier can record its next batch
/// between runs.
fn commit(
    sh: &Shared,
    pool: &Pool,
    config: &Config,
    cands: &[Candidate],
    actions: &[Option<Action>],
    budget: usize,
) {
    let mut todo: Vec<usize> = (0..cands.len()).filter(|&i| actions[i].is_some()).collect();
    if todo.is_empty() {
        return;
    }
    let mut budget = VmaBudget::new(budget);
    let recycler = lock(&sh.recycler).clone();
    todo.sort_unstable_by_key(|&i| cands[i].addr());
    let mut i = 0;
    let mut moved = [false; MAX_RUN];
    let mut tm = [0f64; 4];
    let t_end = Instant::now();
    let mut verdict: [Option<Action>; MAX_RUN] = [None; MAX_RUN];
    while i < todo.len() {
        let mut guard = lock(&sh.state);
        let State {
            regions,
            store,
            vmas,
            scratch,
            ..
        } = &mut *guard;
        let scratch = *scratch;
        // A run: candidates at consecutive addresses of one region, all COW-broken or none.
        let first = &cands[todo[i]];
        let Some(region) = regions.get_mut(&first.region) else {
            i += 1;
            continue;
        };
        let broken = |t: usize| in_store_mapping(region.pages[cands[todo[t]].index()].kind);
        let run_broken = broken(i);
        let mut j = i + 1;
        while j < todo.len()
            && j - i < MAX_RUN
            && cands[todo[j]].region == first.region
            && cands[todo[j]].index() == first.index() + (j - i)
            && broken(j) == run_broken
        {
            j += 1;
        }
        let n = j - i;
        let start = first.addr();
        if run_broken {
            let acts: Vec<Option<Action>> = (i..j).map(|t| actions[todo[t]]).collect();
            let run = Run {
                start,
                first_index: first.index(),
                n,
            };
            commit_broken(sh, store, region, run, &acts, config, vmas, &mut budget);
            i = j;
            continue;
        }
        // Merges that cannot be mapped for want of VMAs are not worth a freeze: they back off now,
        // and a run left with nothing to do is skipped.
        let mut acts: [Option<Action>; MAX_RUN] = [None; MAX_RUN];
        for k in 0..n {
            acts[k] = actions[todo[i + k]];
        }
        if !budget.allows(vmas, 2) {
            let mut limited = 0;
            for (k, a) in acts.iter_mut().enumerate().take(n) {
                if let Some(Action::Merge(_)) = a {
                    *a = None;
                    limited += 1;
                    let p = &mut region.pages[first.index() + k];
                    p.unchanged = 0;
                    p.back_off(config.max_backoff);
                }
            }
            sh.counters
                .vma_limited
                .fetch_add(limited, Ordering::Relaxed);
            if acts[..n].iter().all(Option::is_none) {
                i = j;
                continue;
            }
        }
        // Freezing and comparing need no state: the period lock keeps the region registered, and
        // a copy named by this batch stays allocated until the batch is done (only the committer
        // frees copies during a period).
        let (region_key, first_index) = (first.region, first.index());
        let store_base = store.addr(0);
        let pagemap = guard.pagemap.clone();
        drop(guard);

        // The copies are read through the store's view to be compared: mapped now, before the
        // freeze, by reading one page of each aligned 64 KiB of the view (a read fault maps the
        // pages of the file around it, that much by Linux's default `fault_around_bytes`),
        // instead of faulting during the compare with the run frozen. Cheaper than
        // `MADV_POPULATE_READ`, which walks every page, and than reading every page (measured:
        // docs/benchmarks.md). Pages left unmapped fault in during the compare, as before.
        let mut k = 0;
        while k < n {
            let Some((sid, m)) = merge_subrun(&acts[..n], k) else {
                k += 1;
                continue;
            };
            let (mut at, end) = (
                store_base + sid as usize * PAGE,
                store_base + (sid as usize + m) * PAGE,
            );
            while at < end {
                // SAFETY: a copy named by this batch stays allocated until the batch is done
                // (see above) and lies in the view, a read-only mapping of the store; volatile,
                // as the bytes are another process's to publish.
                unsafe { std::ptr::read_volatile(at as *const u64) };
                at = (at / FAULT_AROUND_BYTES + 1) * FAULT_AROUND_BYTES;
            }
            k += m;
        }
        let tf = Instant::now();
        // Freeze: from here until the wake, any access to the run blocks in the kernel.
        // SeqCst pairs with the fault thread's load: the range is visible before any page moves.
        {
            let _gate = lock(&sh.fault_gate);
            sh.frozen.store(pack_run(start, n), Ordering::SeqCst);
        }
        moved[..n].fill(false);
        let mut failed = false;
        let mut off = 0;
        while off < n {
            // SAFETY: the run is registered memory the engine froze (no reference to it exists in
            // the engine) and the scratch slots [off, n) are empty (discarded after every run).
            let r = unsafe {
                sh.uffd.move_pages(
                    scratch + off * PAGE,
                    start + off * PAGE,
                    (n - off) * PAGE,
                    UFFDIO_MOVE_MODE_DONTWAKE,
                )
            };
            match r {
                Ok(bytes) if bytes >= PAGE => {
                    let k = bytes / PAGE;
                    moved[off..off + k].fill(true);
                    off += k;
                }
                // A hole, a page shared with a child, or a page busy in the kernel: skip it.
                _ => {
                    off += 1;
                    failed = true;
                }
            }
        }
        if failed {
            // A failed move may still have moved pages: Linux 6.18 can move part of a batch
            // of pages, meet a concurrent writer, retry from the batch's start and report
            // EEXIST (its destination is now taken) without counting what it moved. A page left
            // in scratch and thought unmoved would be discarded with it, losing its writes. So
            // the page tables say what moved: a page in scratch whose address is empty (frozen
            // addresses stay empty until the wake).
            reconcile_moved(&pagemap, start, scratch, &mut moved[..n]);
        }

        let tv = Instant::now();
        tm[0] += (tv - tf).as_secs_f64();
        // Verify on frozen bytes: byte-for-byte, on the workers when the run is long.
        let jobs: Vec<(usize, usize)> = (0..n)
            .map(|k| match acts[k] {
                _ if !moved[k] => (0, 0),
                Some(Action::Zero) => (scratch + k * PAGE, 0),
                Some(Action::Merge(sid)) => (scratch + k * PAGE, store_base + sid as usize * PAGE),
                // Checked below on the mark's three words.
                Some(Action::Recycle(_)) | None => (0, 0),
            })
            .collect();
        let equal = verify_pages(pool, config.workers, jobs);
        let mut guard = lock(&sh.state);
        let State {
            regions,
            store,
            zero,
            vmas,
            ..
        } = &mut *guard;
        let region = regions
            .get_mut(&region_key)
            .expect("the period lock keeps regions registered during a commit");
        for k in 0..n {
            verdict[k] = None;
            if !moved[k] {
                continue;
            }
            verdict[k] = match acts[k] {
                Some(Action::Zero) if equal[k] => Some(Action::Zero),
                // Freed since classification named it (the tree can name a copy of an earlier
                // batch that merged nothing, freed after that batch's commit): mapping it would
                // map a page the store punches or reuses.
                Some(Action::Merge(sid)) if !store.is_allocated(sid) => None,
                Some(Action::Merge(sid)) if store.refs(sid) >= config.max_sharing => {
                    store.retire(sid);
                    None
                }
                Some(Action::Merge(sid)) if equal[k] => Some(Action::Merge(sid)),
                Some(Action::Recycle(slot)) => {
                    // SAFETY: scratch slot k holds the page moved out of the frozen address; only
                    // the engine knows the scratch area, so nobody writes it meanwhile.
                    let words = unsafe { mark_words(scratch + k * PAGE) };
                    let ticket = pageone_recycler::Ticket {
                        slot,
                        addr: start + k * PAGE,
                    };
                    let marked = recycler
                        .as_ref()
                        .is_some_and(|p| p.is_marked(&ticket, words));
                    if marked {
                        lock(&sh.recycled_slots).push(slot);
                        sh.counters.recycled.fetch_add(1, Ordering::Relaxed);
                    }
                    // Released like a zero page; without its mark (unmarked since), put back.
                    marked.then_some(Action::Zero)
                }
                _ => {
                    sh.counters.mismatches.fetch_add(1, Ordering::Relaxed);
                    None
                }
            };
            // Count references now so the sharing limit holds within one run.
            if let Some(Action::Merge(sid)) = verdict[k] {
                store.add_ref(sid);
            }
        }

        let tr = Instant::now();
        tm[1] += (tr - tv).as_secs_f64();
        // Replace: one mapping per subrun of consecutive copies.
        let mut k = 0;
        while k < n {
            let Some((sid, m)) = merge_subrun(&verdict[..n], k) else {
                k += 1;
                continue;
            };
            let idx = first_index + k;
            let coalesces = idx > 0 && {
                let left = region.pages[idx - 1];
                left.kind == MERGED && left.sid.wrapping_add(1) == sid
            };
            let cost = if coalesces { 1 } else { 2 };
            // SAFETY: the subrun is frozen (its pages are in scratch) and compared equal to its
            // copies.
            let ok = unsafe {
                map_copies(
                    sh,
                    region,
                    store,
                    config,
                    (vmas, &mut budget),
                    first_index + k,
                    (sid, m),
                    cost,
                )
            };
            if !ok {
                verdict[k..k + m].fill(None);
            }
            k += m;
        }

        // Put back every moved page that is not merged or released.
        for k in 0..n {
            let p = &mut region.pages[first_index + k];
            match verdict[k] {
                Some(Action::Zero) => {
                    p.kind = ZERO;
                    p.unchanged = 0;
                    *zero += 1;
                }
                Some(Action::Merge(_)) => {}
                // (A verdict is never Recycle: a recycled page's is Zero.)
                None | Some(Action::Recycle(_)) => {
                    p.unchanged = 0;
                    p.kind = ANON;
                    if moved[k] {
                        // SAFETY: scratch slot k holds the page moved out of this frozen address,
                        // which is still empty (the fault thread does not fill frozen pages).
                        let r = unsafe {
                            sh.uffd.move_pages(
                                start + k * PAGE,
                                scratch + k * PAGE,
                                PAGE,
                                UFFDIO_MOVE_MODE_DONTWAKE,
                            )
                        };
                        if let Err(e) = r {
                            eprintln!(
                                "pageone: a frozen page could not be put back at {:#x}: {e}",
                                start + k * PAGE
                            );
                            tracing::error!(error = %e, addr = start + k * PAGE, "a frozen page could not be put back");
                        }
                    }
                }
            }
        }
        // Free the originals of merged and zero pages before the merges can be seen in the
        // stats (whoever reads them may measure the memory), then let writers in.
        // SAFETY: the scratch area is the engine's; what remains in it is no longer needed.
        let _ = unsafe { sys::madvise(scratch as *mut u8, n * PAGE, libc::MADV_DONTNEED) };
        drop(guard);
        let td = Instant::now();
        tm[2] += (td - tr).as_secs_f64();
        sh.frozen.store(0, Ordering::SeqCst);
        let _ = sh.uffd.wake(start, n * PAGE);
        i = j;
    }
    tracing::debug!(
        move_ms = tm[0] * 1e3,
        verify_ms = tm[1] * 1e3,
        replace_ms = tm[2] * 1e3,
        total_ms = t_end.elapsed().as_secs_f64() * 1e3,
        "commit"
    );
    // The count after this commit (exact at the period's start, plus what merges added at most).
    sh.counters
        .vmas
        .store(lock(&sh.state).vmas as u64, Ordering::Relaxed);
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A first sighting keeps its address, epoch and whole hash, in 24 bytes of map entry (the
    /// map holds every page waiting for a twin).
    #[test]
    fn first_sightings_are_small_and_exact() {
        assert_eq!(std::mem::size_of::<(HashKey, u64)>(), 24);
        let mut f = FirstSightings::default();
        let h = (0xfeed_u128 << 64) | 0xbeef;
        f.insert(h, 0x7f12_3456_7000, 255);
        f.insert(h ^ (1 << 64), 0x1000, 0);
        assert_eq!(f.keys().filter(|&k| k == h).count(), 1);
        assert_eq!(f.remove(h), Some((0x7f12_3456_7000, 255)));
        assert_eq!(f.remove(h), None);
        assert_eq!(f.remove(h ^ (1 << 64)), Some((0x1000, 0)));
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

    fn pre_of(k: u8) -> Pre {
        match k {
            0 => Pre::None,
            1 => Pre::Zero,
            2..=5 => Pre::Stable(k as KeyId),
            // Spread over the key space, as real hashes are (the ordering splits it).
            _ => Pre::Hash([(k as u64 % 24).wrapping_mul(0x9e37_79b9_7f4a_7c15), 7]),
        }
    }

    #[test]
    fn merge_subruns_end_where_copies_stop_following_each_other() {
        let m = |sid| Some(Action::Merge(sid));
        let acts = [m(5), m(6), m(8), Some(Action::Zero), m(9), None, m(3), m(4)];
        let found: Vec<_> = (0..acts.len()).map(|k| merge_subrun(&acts, k)).collect();
        assert_eq!(
            found,
            [
                Some((5, 2)),
                Some((6, 1)),
                Some((8, 1)),
                None,
                Some((9, 1)),
                None,
                Some((3, 2)),
                Some((4, 1)),
            ]
        );
    }

    proptest! {
        /// A packed page address and read-ahead result give back what was packed, whatever the
        /// result, and setting it again replaces it without touching the address.
        #[test]
        fn page_pre_keeps_address_and_result(
            page in 0usize..(1 << 35),
            kind in 0u8..4,
            words in any::<[u64; 2]>(),
            id in any::<KeyId>(),
            again in 0u8..4,
        ) {
            let pre = |k: u8| match k {
                0 => Pre::None,
                1 => Pre::Zero,
                2 => Pre::Stable(id),
                _ => Pre::Hash(words),
            };
            let region = page / 2 * PAGE;
            let mut c = Candidate::new(region, page * PAGE, pre(kind));
            prop_assert_eq!(c.addr(), page * PAGE);
            prop_assert_eq!(c.index(), page - page / 2);
            prop_assert_eq!(c.pre(), pre(kind));
            c.set_pre(pre(again));
            prop_assert_eq!(c.addr(), page * PAGE);
            prop_assert_eq!(c.pre(), pre(again));
        }

        /// Relooks come only every RELOOK_PERIODS periods, always when no offers came, and are
        /// never put off more than RELOOK_SKIPS times in a row, however offers come.
        #[test]
        fn relooks_are_put_off_a_bounded_number_of_times(
            offered in proptest::collection::vec(any::<bool>(), 0..400),
        ) {
            let mut skipped = 0;
            let mut put_off = 0;
            for (period, &offered) in offered.iter().enumerate() {
                let period = period as u64;
                let due = relook_due(period, offered, &mut skipped);
                if period % RELOOK_PERIODS != 0 {
                    prop_assert!(!due);
                    continue;
                }
                prop_assert!(due || offered);
                put_off = if due { 0 } else { put_off + 1 };
                prop_assert!(put_off <= RELOOK_SKIPS);
            }
        }

        /// Every candidate lands in exactly one batch, batches are in address order, pages of
        /// one content (hash or stable copy) share a batch, and a batch is cut only between
        /// contents once it holds the batch length (alone or with a daemon).
        #[test]
        fn batches_by_content_keep_every_candidate_and_whole_contents(
            kinds in proptest::collection::vec(0u8..40, 0..(6 * BATCH)),
            len in prop_oneof![Just(REMOTE_BATCH), Just(BATCH)],
        ) {
            // From 4 * BATCH candidates on, the chaining is split over the workers.
            let pool = Pool::new(2, Arc::new(Mutex::new(Vec::new()))).unwrap();
            let cands: Vec<Candidate> = kinds
                .iter()
                .enumerate()
                .map(|(i, &k)| Candidate::new(PAGE, (i + 1) * PAGE, pre_of(k)))
                .collect();
            let batches: Vec<Vec<Candidate>> = batches_by_content(cands.clone(), &pool, len).collect();
            let mut seen: Vec<usize> = batches.iter().flatten().map(|c| c.index()).collect();
            seen.sort_unstable();
            prop_assert_eq!(seen, (0..cands.len()).collect::<Vec<_>>());
            let mut batch_of: HashMap<String, usize> = HashMap::new();
            for (b, batch) in batches.iter().enumerate() {
                prop_assert!(batch.windows(2).all(|w| w[0].addr() < w[1].addr()));
                for c in batch {
                    let key = match c.pre() {
                        Pre::Hash(h) => format!("h{h:?}"),
                        Pre::Stable(id) => format!("s{id}"),
                        Pre::None | Pre::Zero => continue,
                    };
                    let first = *batch_of.entry(key).or_insert(b);
                    prop_assert_eq!(first, b, "one content split over two batches");
                }
            }
            // Cuts come only after a batch is full: every batch but the last holds `len` pages
            // or more.
            for batch in batches.iter().rev().skip(1) {
                prop_assert!(batch.len() >= len);
            }
        }
    }
}
