//! The [`Engine`] handle: starts the engine's threads (engine, committer, faults, workers), offers
//! the API, and stops them. The work itself is done by the stages (see the crate documentation).

use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use pageone_sync::lock;
use pageone_sys::{self as sys, uapi::*};

use crate::access::PAGE;
use crate::apart::{self, EngineThread};
use crate::changes::ChangeLog;
use crate::dropping::{self, DropAdvice};
use crate::error::Chain;
use crate::faults::fault_loop;
use crate::freeze::{FrozenRange, MAX_RUN, SCRATCH_SLOTS};
use crate::locking::LockedScratch;
use crate::parking::Parking;
use crate::period::{commit_loop, engine_loop};
use crate::pool::Pool;
use crate::registry;
use crate::state::{Counters, Shared, State};
use crate::stats::stats_of;
use crate::store::Store;
use crate::{Builder, Config, EngineError, Stats, WatchMode};

/// A running deduplication engine. Dropping it shuts it down cleanly (see [`Engine::shutdown`]).
pub struct Engine {
    shared: Arc<Shared>,
    /// The workers (shared with the engine and commit threads): registration queues read-ahead.
    pool: Arc<Pool>,
    engine_thread: Option<EngineThread<()>>,
    commit_thread: Option<EngineThread<()>>,
    fault_thread: Option<EngineThread<()>>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("mode", &self.shared.mode)
            .finish()
    }
}

/// The userfaultfd context of registered memory, and how writes are watched with it.
struct Watch {
    uffd: sys::Uffd,
    mode: WatchMode,
    /// How registered memory is registered with `uffd`.
    reg_mode: u64,
    /// How a frozen run is registered while frozen, if not as registered memory is (see
    /// `Shared::freeze_mode`).
    freeze_mode: Option<u64>,
}

impl Watch {
    /// Opens the context with `UFFDIO_MOVE` (to freeze pages) and, unless checksums are asked
    /// for, async write-protection (to watch for writes) when the kernel has both.
    fn open(config: &Config) -> Result<Self, EngineError> {
        let want_wp = config.watch != WatchMode::Checksum;
        // The events: every change to registered memory the program makes, whatever makes it
        // (see the `changes` module).
        let wanted = UFFD_FEATURE_MOVE
            | UFFD_FEATURE_EVENT_UNMAP
            | UFFD_FEATURE_EVENT_REMAP
            | UFFD_FEATURE_EVENT_REMOVE
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
        // Watching by write-protection, registered memory is registered for write-protection
        // only: a first touch, or a touch of a page released or dropped, is the kernel's own
        // fault. Missing faults are asked for only on a run while it is frozen (its pages are
        // moved out, and a touch must wait for them; see `freeze::Rearm`). Checksum watching
        // registers for missing faults throughout.
        let (reg_mode, freeze_mode) = if mode == WatchMode::UffdWp {
            (UFFDIO_REGISTER_MODE_WP, Some(UFFDIO_REGISTER_MODE_MISSING))
        } else {
            (UFFDIO_REGISTER_MODE_MISSING, None)
        };
        Ok(Watch {
            uffd,
            mode,
            reg_mode,
            freeze_mode,
        })
    }
}

/// The stable store: the configured daemon's scope store, or a store of this process alone (also
/// when the daemon cannot be joined: service degrades, memory stays correct). Returns it with
/// whether the daemon was unreachable.
fn open_store(config: &Config) -> Result<(Store, bool), EngineError> {
    // Capacity of the store: every page of RAM (virtual; only used copies cost memory).
    let ram = sys::meminfo_kib("MemTotal").unwrap_or(16 << 20) * 1024;
    let local_capacity = config
        .store_pages
        .unwrap_or((ram / PAGE as u64).min(u32::MAX as u64 - 1) as u32);
    let Some(path) = &config.daemon else {
        return Ok((Store::new(local_capacity)?, false));
    };
    match crate::remote::Remote::connect(path, &config.scope) {
        Ok((remote, fd, capacity)) => Ok((Store::shared(fd, capacity, remote)?, false)),
        Err(e) => {
            // Service degrades (no sharing with other processes), memory stays correct.
            tracing::warn!(error = %Chain(&e), socket = %path.display(), "running alone");
            Ok((Store::new(local_capacity)?, true))
        }
    }
}

impl Engine {
    /// A builder with the defaults of [`Config`].
    pub fn builder() -> Builder {
        Builder::default()
    }

    pub(crate) fn start(config: Config) -> Result<Self, EngineError> {
        config.validate()?;
        sys::set_background_priority(config.priority);
        crate::layout::watch_forks().map_err(EngineError::Thread)?;
        let Watch {
            uffd,
            mode,
            reg_mode,
            freeze_mode,
        } = Watch::open(&config)?;
        let config_workers = config.workers;
        let (store, daemon_unreachable) = open_store(&config)?;
        // The scratch area receives frozen pages; UFFDIO_MOVE needs its destination registered
        // with the same context and the same protections as the source (a frozen run), and an
        // empty destination: never populated, even after `mlockall(MCL_FUTURE)` (locked pages
        // move to the locked area instead: see the `locking` module).
        let scratch =
            sys::mmap_anonymous_unlocked(SCRATCH_SLOTS * PAGE).map_err(EngineError::Map)? as usize;
        uffd.register(
            scratch,
            SCRATCH_SLOTS * PAGE,
            freeze_mode.unwrap_or(reg_mode),
        )
        .map_err(EngineError::Uffd)?;
        // A child of a fork must not share the frozen pages held there: moving them back would
        // fail (a page shared with a child cannot move).
        // SAFETY: MADV_DONTFORK changes no contents of the engine's own scratch area.
        unsafe {
            sys::madvise(
                scratch as *mut u8,
                SCRATCH_SLOTS * PAGE,
                libc::MADV_DONTFORK,
            )
        }
        .map_err(EngineError::Map)?;
        let locked_scratch = LockedScratch::new(&uffd, freeze_mode.unwrap_or(reg_mode), MAX_RUN);
        // A second context, without async write-protection: its write faults block until the
        // engine un-protects, which is how a COW-broken page is held still while compared. It
        // reports changes to the store mappings it holds (merged pages) like the first.
        // Minor faults: a page of a store mapping dropped where the engine cannot see it reads
        // zeros (see the `unfilled` module).
        let store_features = UFFD_FEATURE_WP_HUGETLBFS_SHMEM | UFFD_FEATURE_MINOR_SHMEM;
        let store_uffd = sys::Uffd::open(
            store_features
                | UFFD_FEATURE_EVENT_UNMAP
                | UFFD_FEATURE_EVENT_REMAP
                | UFFD_FEATURE_EVENT_REMOVE,
        )
        .ok()
        .filter(|u| u.features() & store_features == store_features);
        let pagemap = sys::Pagemap::open().map_err(EngineError::Uffd)?;
        let shared = Arc::new(Shared {
            uffd,
            store_uffd,
            mode,
            reg_mode,
            freeze_mode,
            daemon_unreachable,
            state: Mutex::new(State::new(store, scratch, pagemap)),
            period_lock: Mutex::new(()),
            config: Mutex::new(config),
            frozen: FrozenRange::default(),
            parking: Parking::new().map_err(EngineError::Map)?,
            changes: Mutex::new(ChangeLog::with_room()),
            staging: Default::default(),
            locked_scratch,
            stop: AtomicBool::new(false),
            faults_done: AtomicBool::new(false),
            fault_thread_id: AtomicI32::new(0),
            stop_fd: sys::eventfd().map_err(EngineError::Thread)?,
            maps: sys::Maps::open().map_err(EngineError::Map)?,
            periods: Mutex::new(0),
            settled: AtomicBool::new(false),
            period_cv: Condvar::new(),
            kick: (Mutex::new(false), Condvar::new()),
            not_before: Mutex::new(None),
            counters: Counters::default(),
            recycler: Mutex::new(None),
            recycled_slots: Mutex::new(Vec::new()),
            clocks: Arc::default(),
        });
        tracing::info!(mode = %mode, "pageone engine started");
        Self::spawn(shared, config_workers)
    }

    /// Starts the fault thread, the workers, the committer and the engine thread, with every
    /// signal blocked: the program's signal handlers never run on them (a handler touching
    /// registered memory would block the thread that answers faults, or the committer on its own
    /// frozen run).
    fn spawn(shared: Arc<Shared>, workers: usize) -> Result<Self, EngineError> {
        // Threads inherit the mask of the thread creating them; the caller's is restored below.
        let _mask = sys::block_all_signals().map_err(EngineError::Thread)?;
        let s = shared.clone();
        let fault_thread = apart::spawn("pageone-faults".into(), move || fault_loop(&s))
            .map_err(EngineError::Thread)?;
        let pool =
            Arc::new(Pool::new(workers, shared.clocks.clone()).map_err(EngineError::Thread)?);
        // Rendezvous: the classifier hands over a batch when the committer takes it, so it runs
        // at most one batch ahead (bounded copies in flight, and frees feed the next copies).
        let (to_committer, batches) = std::sync::mpsc::sync_channel(0);
        let engine_pool = pool.clone();
        let s = shared.clone();
        let commit_thread = apart::spawn("pageone-commit".into(), move || commit_loop(&s, batches))
            .map_err(EngineError::Thread)?;
        let s = shared.clone();
        let engine_thread = apart::spawn("pageone-engine".into(), move || {
            engine_loop(&s, &engine_pool, to_committer)
        })
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
        registry::register(&self.shared, &self.pool, addr as usize, len)
    }

    /// Recycles the pages the program marks free in `pool` (PPR, see [`pageone_recycler`]):
    /// every period, marked pages of registered memory are released (their memory goes back to
    /// the kernel; they read as zeros afterwards) unless unmarked first. Replaces a pool attached
    /// before.
    pub fn recycle_from(&self, pool: Arc<pageone_recycler::Pool>) {
        *lock(&self.shared.recycler) = Some(pool);
    }

    /// Registers the parts of `[addr, addr+len)` not registered yet, the equivalent of
    /// `madvise(MADV_MERGEABLE)` on memory part of which may be registered: as
    /// [`register`](Self::register), for every part or none.
    pub fn merge(&self, addr: *mut u8, len: usize) -> Result<(), EngineError> {
        registry::merge(&self.shared, &self.pool, addr as usize, len)
    }

    /// Unregisters the registered pages in `[addr, addr+len)`, the equivalent of
    /// `madvise(MADV_UNMERGEABLE)`: those pages become private again with their contents intact
    /// (merged ones are copied back; nothing else is touched, so the cost is that of the part), and
    /// the rest of each region stays registered. `NotRegistered` if none was.
    pub fn unregister(&self, addr: *mut u8, len: usize) -> Result<(), EngineError> {
        registry::unregister(&self.shared, addr as usize, len)
    }

    /// Whether any page of `[addr, addr+len)` is registered.
    pub fn is_registered(&self, addr: *mut u8, len: usize) -> bool {
        let (a, end) = (addr as usize, (addr as usize).saturating_add(len));
        let st = lock(&self.shared.state);
        st.regions
            .range(..end)
            .next_back()
            .is_some_and(|(_, r)| r.start + r.len() > a)
            || st.regions.range(a..end).next().is_some()
    }

    /// Locks every current mapping of the process as `mlockall(MCL_CURRENT)` does (on fault only
    /// with `on_fault`, as `MCL_ONFAULT`), but for the engine's own memory: its views of the
    /// store, staging, scratch and locked areas stay unlocked and empty (the kernel would fill
    /// them, a view of the store as large as the memory), its threads' stacks and allocator
    /// unlocked, and merged pages are locked as they stand (locked in full, each would be
    /// copied). What it maps over registered memory later is locked too. For the shim's
    /// `mlockall`, in place of the kernel's `MCL_CURRENT` (the caller sets or clears
    /// `MCL_FUTURE` with the kernel's call).
    pub fn lock_current(&self, on_fault: bool) -> Result<(), EngineError> {
        crate::lock_all::lock_current(&self.shared, on_fault)?;
        self.locking_changed(std::ptr::null_mut(), usize::MAX, true);
        Ok(())
    }

    /// The program unlocked all its memory (`munlockall`), the engine's locked area with it:
    /// that is locked again, and what the engine maps later is not locked.
    pub fn unlocked_all(&self) {
        if let Some(l) = &self.shared.locked_scratch {
            l.lock_again();
        }
        self.locking_changed(std::ptr::null_mut(), usize::MAX, false);
    }

    /// The program locked (`locked`) or unlocked `[addr, addr + len)` (`mlock`, `munlock`, or
    /// everything with `len` of `usize::MAX`): where the engine maps something over registered
    /// pages there later, it locks it or leaves it unlocked alike (see the crate doc).
    pub fn locking_changed(&self, addr: *mut u8, len: usize, locked: bool) {
        let (a, end) = (addr as usize, (addr as usize).saturating_add(len));
        let mut st = lock(&self.shared.state);
        for r in st.regions.values_mut() {
            let (s, e) = (a.max(r.start), end.min(r.start + r.len()));
            if s >= e {
                continue;
            }
            let at = s - r.start..e - r.start;
            if locked {
                r.locked.add(at);
            } else {
                r.locked.remove(at);
            }
        }
    }

    /// Writes the registered ranges, `(start, end)` in address order with adjacent regions joined,
    /// into `out`; returns how many there are (more than `out.len()` if it was too short: the
    /// first ones are written). Changes the kernel reported are applied first. Allocates nothing:
    /// for a `fork` hook that records what a child inherits.
    pub fn registered_ranges(&self, out: &mut [(usize, usize)]) -> usize {
        let mut st = lock(&self.shared.state);
        crate::layout::apply_changes(&self.shared, &mut st);
        let mut n = 0;
        let mut last: Option<(usize, usize)> = None;
        for r in st.regions.values() {
            let (s, e) = (r.start, r.start + r.len());
            match &mut last {
                Some(l) if l.1 == s => l.1 = e,
                _ => {
                    if let Some(l) = last.take() {
                        if let Some(slot) = out.get_mut(n) {
                            *slot = l;
                        }
                        n += 1;
                    }
                    last = Some((s, e));
                }
            }
        }
        if let Some(l) = last {
            if let Some(slot) = out.get_mut(n) {
                *slot = l;
            }
            n += 1;
        }
        n
    }

    /// Tells the engine that the program dropped the pages of `[addr, addr+len)` with
    /// `MADV_DONTNEED` (call it after the `madvise`, before relying on the result): merged pages are
    /// mappings of a store file, which would read their copy again, so they are made empty
    /// anonymous memory now (reading zeros, as the kernel promises); nothing else is touched. The
    /// `LD_PRELOAD` shim does this for unmodified programs. Unregistered memory is ignored.
    pub fn discard(&self, addr: *mut u8, len: usize) -> Result<(), EngineError> {
        dropping::discard(&self.shared, addr as usize, len)
    }

    /// `madvise(addr, len, advice)` as the kernel answers it (`EngineError::Refused` with its
    /// error where it refuses), with merged pages made empty anonymous memory: they read zeros,
    /// as the kernel promises (`MADV_FREE` of merged pages drops them, which it allows). The same
    /// result as the `madvise` followed by [`discard`](Self::discard), at a fraction of the cost
    /// where pages are merged: the kernel's drop of merged pages would wait for the engine's
    /// fault thread to read its report; here it does not. The `LD_PRELOAD` shim does this for
    /// unmodified programs. Unregistered memory is dropped as by the kernel alone.
    pub fn drop_pages(
        &self,
        addr: *mut u8,
        len: usize,
        advice: DropAdvice,
    ) -> Result<(), EngineError> {
        dropping::drop_pages(&self.shared, addr as usize, len, advice)
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
        next.validate()?;
        next.watch = c.watch;
        sys::set_background_priority(next.priority);
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
        // The fault thread keeps reading until every region is unregistered (that may need it);
        // `stop_fd` wakes it only once it may end (signalled earlier, it would spin meanwhile).
        if let Some(t) = self.engine_thread.take() {
            let _ = t.join();
        }
        // The engine thread dropped its end of the batch channel: the committer ends.
        if let Some(t) = self.commit_thread.take() {
            let _ = t.join();
        }
        self.shared.staging.release(&self.shared);
        registry::unregister_all(&self.shared);
        // SeqCst: pairs with the fault thread's load.
        self.shared.faults_done.store(true, Ordering::SeqCst);
        let _ = sys::eventfd_signal(std::os::fd::AsRawFd::as_raw_fd(&self.shared.stop_fd));
        if let Some(t) = self.fault_thread.take() {
            let _ = t.join();
        }
    }

    /// For tests: unregisters `[addr, addr+len)` from the store mappings' context, as Linux 6.8 to
    /// 6.16 did as a side effect of unregistering a range from the main context (the engine must
    /// still give anonymous memory back on such a kernel).
    #[doc(hidden)]
    pub fn drop_store_registrations(&self, addr: *mut u8, len: usize) {
        if let Some(u) = &self.shared.store_uffd {
            let _ = u.unregister(addr as usize, len);
        }
    }

    /// For tests: when store mappings in `[addr, addr+len)` are made anonymous again, the move of
    /// the copy's part after `parts` parts moved there fails, as a kernel short of memory would
    /// fail it, `how` it is asked to (after unmapping its destination, as Linux 6.8 to 6.16 may);
    /// once, in the whole process. [`copy_move_failure_pending`] says whether it has not happened
    /// yet.
    ///
    /// [`copy_move_failure_pending`]: Self::copy_move_failure_pending
    #[doc(hidden)]
    pub fn fail_a_copys_move_after(
        &self,
        parts: usize,
        addr: *mut u8,
        len: usize,
        how: crate::MoveFailure,
    ) {
        let a = addr as usize;
        crate::anonymize::fail_a_move_after(parts, a..a.saturating_add(len), how);
    }

    /// For tests: see [`fail_a_copys_move_after`](Self::fail_a_copys_move_after).
    #[doc(hidden)]
    pub fn copy_move_failure_pending(&self) -> bool {
        crate::anonymize::failure_pending()
    }

    /// For tests: the moves of store mappings by the program that the engine counted (a held
    /// copy is reused only with none between two reads of the mappings: see the `held` module).
    #[doc(hidden)]
    pub fn store_moves(&self) -> u64 {
        lock(&self.shared.changes).store_moves()
    }

    /// For tests: the ids the store gave out for copies so far (a merge try's memory).
    #[doc(hidden)]
    pub fn copies_made(&self) -> u64 {
        lock(&self.shared.state).store.given_out
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
