//! Freezing a run of pages for a merge, as guards whose drop lets the run go on every path.
//!
//! * [`FrozenRun`]: anonymous pages are moved out (`UFFDIO_MOVE`) into the engine's scratch area.
//!   While a page is out, any access to its address blocks in the kernel as a missing fault that
//!   the fault thread leaves alone (the run is published in [`FrozenRange`]). The commit compares
//!   the moved bytes, maps copies over equal pages and releases zero pages, marking each such page
//!   *consumed*; the guard puts every other moved page back, discards the scratch area,
//!   unpublishes the run and wakes its writers.
//! * [`ProtectedRun`]: COW-broken pages live in store mappings, which `UFFDIO_MOVE` cannot move;
//!   they are held still with synchronous write-protection instead (through the store mappings'
//!   own userfaultfd). The guard un-protects the pages that were not replaced and wakes the
//!   writers.
//!
//! Either way a writer waits for one run at most, also when the commit returns early or panics.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};

use pageone_sync::lock;
use pageone_sys::{self as sys, uapi::*};

use crate::access::PAGE;
use crate::changes::{Change, ChangeLog, Fate};
use crate::locking::LockedScratch;
use crate::parking::Parking;

/// How store mappings (merged pages) are registered with the store mappings' context: for missing
/// faults, which brings the kernel's reports of the program's changes to them; and for minor
/// faults, so that a page the program dropped where the engine could not see it reads zeros, not
/// its copy (see the `unfilled` module). Their pages are mapped as they merge (a minor fault
/// costs a round trip to the fault thread, and the kernel's fault-around is off). Write-protection
/// is registered only on a run of them held still ([`ProtectedRun`]). The missing faults there
/// are reads of holes of the store's file (zero holes), answered with the zero page.
pub(crate) const STORE_MODE: u64 = UFFDIO_REGISTER_MODE_MISSING | UFFDIO_REGISTER_MODE_MINOR;

/// Longest run frozen at once: bounds how long a writer can be blocked.
pub(crate) const MAX_RUN: usize = 512;
// A committed run's announcements fit the change log's room (see `changes::OWN_ROOM`).
const _: () = assert!(2 * MAX_RUN <= crate::changes::OWN_ROOM);

/// Slots of the scratch area: the runs of one commit take slot after slot, and the originals of
/// the pages they merged or released are discarded once the slots are used up or the commit ends
/// (see [`Scratch`]), at most this many pages (8 MiB) held meanwhile.
pub(crate) const SCRATCH_SLOTS: usize = 4 * MAX_RUN;

/// The run currently frozen, as the fault thread sees it.
#[derive(Default)]
pub(crate) struct FrozenRange {
    /// The run, packed by [`pack_run`] into one word so the fault thread never sees half of an
    /// update.
    word: AtomicU64,
    /// The change log's mark when the run was frozen: changes recorded after it may have moved
    /// the run's pages (see [`Gate::is_frozen`]).
    mark: AtomicUsize,
    /// Makes "is it frozen?" and "fill it" one step for the fault thread: a freeze cannot start
    /// between them (else a page moved out just after the check would get a zero page, and the
    /// frozen contents could not be put back).
    gate: Mutex<()>,
}

impl FrozenRange {
    /// Holds freezes off until the returned gate is dropped: the fault thread asks whether an
    /// address is frozen and fills it under one gate.
    pub(crate) fn gate(&self) -> Gate<'_> {
        Gate {
            range: self,
            _held: lock(&self.gate),
        }
    }

    /// Publishes the run `[start, start + n*PAGE)`, before any of its pages moves, with the change
    /// log's mark.
    fn publish(&self, start: usize, n: usize, mark: usize) {
        let _gate = lock(&self.gate);
        // Relaxed: read under the gate, like the word below.
        self.mark.store(mark, Ordering::Relaxed);
        // SeqCst pairs with the fault thread's load (`Gate::is_frozen`): the range is visible
        // before any page moves.
        self.word.store(pack_run(start, n), Ordering::SeqCst);
    }

    /// The run published now, if any, at the addresses it was frozen at.
    pub(crate) fn published(&self) -> Option<std::ops::Range<usize>> {
        // SeqCst: as the fault thread's load in `Gate::is_frozen`.
        let (s, e) = unpack_run(self.word.load(Ordering::SeqCst));
        (s < e).then_some(s..e)
    }

    /// Unpublishes the run, after every page is back or replaced and before its writers are woken.
    fn clear(&self) {
        // SeqCst pairs with the fault thread's load, as in `publish`.
        self.word.store(0, Ordering::SeqCst);
    }
}

/// The fault thread's view of the frozen run, with freezes held off (see [`FrozenRange::gate`]).
pub(crate) struct Gate<'a> {
    range: &'a FrozenRange,
    _held: MutexGuard<'a, ()>,
}

impl Gate<'_> {
    /// Whether `addr` is a page of the frozen run: in it, or moved there from it by a change
    /// recorded in `log` since the freeze (an `mremap` of the run while it is frozen moves its
    /// empty addresses: the run's pages go back there).
    pub(crate) fn is_frozen(&self, addr: usize, log: &ChangeLog) -> bool {
        // Pairs with the committer's SeqCst stores around a freeze: a fault on a page moved
        // out is reported after the move, which follows the store of the frozen range.
        let (fs, fe) = unpack_run(self.range.word.load(Ordering::SeqCst));
        if fs == fe {
            return false;
        }
        // Relaxed: written under the gate, which is held.
        let at = log.origin_since(addr, self.range.mark.load(Ordering::Relaxed));
        at >= fs && at < fe
    }
}

/// Packs a run `[start, start + pages*PAGE)` into one word: page number above, length below.
fn pack_run(start: usize, pages: usize) -> u64 {
    ((start as u64 / PAGE as u64) << 16) | pages as u64
}

fn unpack_run(w: u64) -> (usize, usize) {
    let start = (w >> 16) as usize * PAGE;
    (start, start + (w & 0xffff) as usize * PAGE)
}

/// The scratch area frozen pages are moved into ([`SCRATCH_SLOTS`] pages registered with the
/// same context and protections as registered memory, which `UFFDIO_MOVE` requires of its
/// destination), as one commit uses it: each run takes the next free slots, and what is left in
/// them (the originals of pages merged or released, pages copied back) is discarded when too few
/// slots are left for a run, and when the guard is dropped.
///
/// Discarding is an `MADV_DONTNEED` of memory registered with the context, which the kernel
/// reports like the program's and holds the caller until the fault thread has read the report (a
/// thread round trip): once per commit or per [`SCRATCH_SLOTS`] pages, instead of once per run
/// (with pages scattered, a run is often a single page).
pub(crate) struct Scratch<'a> {
    base: usize,
    /// Slots taken since the last discard.
    used: usize,
    changes: &'a Mutex<ChangeLog>,
}

impl<'a> Scratch<'a> {
    /// The scratch area at `base`, empty (discarded after every use); `changes` is the change log
    /// its discards are announced in.
    pub(crate) fn new(base: usize, changes: &'a Mutex<ChangeLog>) -> Self {
        Scratch {
            base,
            used: 0,
            changes,
        }
    }

    /// The first of `n` empty slots for a run (`n <= MAX_RUN`), taken: the slots used so far are
    /// discarded first if fewer than `n` are left. Call it only while no run is frozen.
    pub(crate) fn take(&mut self, n: usize) -> usize {
        assert!(n <= MAX_RUN, "a run of {n} pages exceeds the scratch area");
        if self.used + n > SCRATCH_SLOTS {
            self.discard();
        }
        let at = self.base + self.used * PAGE;
        self.used += n;
        at
    }

    /// Discards the slots used so far (announced in the change log, as the engine's own change).
    fn discard(&mut self) {
        if self.used == 0 {
            return;
        }
        let discard = Change::Remove {
            start: self.base,
            end: self.base + self.used * PAGE,
        };
        lock(self.changes).expect(discard);
        // SAFETY: the scratch area is the engine's, and no run is frozen in it (see `take`): what
        // remains in the used slots is no longer needed.
        let done =
            unsafe { sys::madvise(self.base as *mut u8, self.used * PAGE, libc::MADV_DONTNEED) };
        if done.is_err() {
            lock(self.changes).unexpect(discard);
        }
        self.used = 0;
    }
}

impl Drop for Scratch<'_> {
    fn drop(&mut self) {
        self.discard();
    }
}

/// What freezing needs: the userfaultfd context of registered memory, the range the fault thread
/// reads, and the run's slots in the scratch area (taken from a [`Scratch`]).
pub(crate) struct Freezer<'a> {
    pub(crate) uffd: &'a sys::Uffd,
    pub(crate) range: &'a FrozenRange,
    /// The first of the run's empty scratch slots.
    pub(crate) scratch: usize,
    /// Where locked pages are frozen into (see the `locking` module), if it could be made.
    pub(crate) locked: Option<&'a LockedScratch>,
    pub(crate) pagemap: &'a sys::Pagemap,
    /// The changes the kernel reported (see the `changes` module): consulted before pages go
    /// back.
    pub(crate) changes: &'a Mutex<ChangeLog>,
    /// Where a page that cannot be put back waits (see the `parking` module).
    pub(crate) parking: &'a Parking,
    /// How the run is registered while frozen and after, when registered memory is not
    /// registered for missing faults (see `Shared::freeze_mode`).
    pub(crate) rearm: Option<Rearm>,
}

/// The registration modes of a run while it is frozen (missing faults: a touch waits for its
/// page) and after (as registered memory is: write-protection only).
///
/// The kernel takes a registration for a mode already registered as nothing to do, so the run
/// is registered for missing faults *only* while frozen, which replaces the write-protection
/// mode, and for write-protection only after, which replaces that. Its moved pages come back as
/// new entries without a write-protect bit (written, to the watch), as ever after a freeze; a
/// page that could not move keeps its bit, which a write while the run was frozen would leave
/// on a writable entry: so such pages are un-protected after (written, to the watch).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Rearm {
    pub(crate) frozen: u64,
    pub(crate) watched: u64,
}

/// A run of anonymous pages moved out into its scratch slots: page `k` is in slot `k` from the
/// first. Dropping it puts back every moved page not [consumed](Self::consume) (unless
/// [`restore`](Self::restore) did), unpublishes the run and wakes the writers blocked on it; the
/// slots are discarded later, by their [`Scratch`].
pub(crate) struct FrozenRun<'a> {
    uffd: &'a sys::Uffd,
    range: &'a FrozenRange,
    changes: &'a Mutex<ChangeLog>,
    parking: &'a Parking,
    rearm: Option<Rearm>,
    /// Whether the run was registered for missing faults (if `rearm`), so its pages could move.
    registered: bool,
    /// Pages parked at their own address (see `restore`): they stay registered for missing
    /// faults until their bytes are back (see the `parking` module).
    parked: [bool; MAX_RUN],
    /// The change log's mark at the freeze.
    mark: usize,
    scratch: usize,
    /// The locked area (see the `locking` module) and, per page, whether it moved there.
    locked: Option<&'a LockedScratch>,
    in_locked: [bool; MAX_RUN],
    start: usize,
    n: usize,
    moved: [bool; MAX_RUN],
    /// Pages the kernel would not move at all: their mapping is not alike the scratch area's in
    /// protection or locking (`EINVAL`; see the `refusals` module).
    refused: [bool; MAX_RUN],
    /// Pages that did not move because their address held none (never touched, or released as
    /// a zero page): frozen all the same (a touch waits), they read zeros.
    empty: [bool; MAX_RUN],
    consumed: [bool; MAX_RUN],
    /// Consumed pages whose address now maps a copy (a mapping of its own, not the run's).
    mapped: [bool; MAX_RUN],
    /// Where a page went back when the program moved its mapping meanwhile (else 0): its
    /// writers are woken there.
    moved_to: [usize; MAX_RUN],
    /// Whether the pages were put back and the scratch area discarded already.
    restored: bool,
    /// In tests: the pages (bit `k` for page `k`) whose put-backs fail as out of memory.
    #[cfg(test)]
    fail_pages: u64,
}

impl<'a> FrozenRun<'a> {
    /// Freezes the `n` pages from `start`: publishes the run, then moves its pages into scratch
    /// slots `0..n`. Until the guard is dropped, any access to the run blocks in the kernel.
    /// `log` is the change log, locked by the caller, who checked that no change it records
    /// touches the run: while it is held, the kernel refuses to move a page of a mapping made
    /// since an unrecorded change (see the `changes` module).
    ///
    /// # Safety
    ///
    /// `[start, start + n*PAGE)` (`n <= MAX_RUN`) is registered with `f.uffd` for missing faults,
    /// and the engine holds no reference into it; the `n` scratch slots from `f.scratch` are empty
    /// (taken from a [`Scratch`]) and no other run is frozen; missing faults in the run are left
    /// unanswered while it is published.
    pub(crate) unsafe fn freeze(f: Freezer<'a>, log: &ChangeLog, start: usize, n: usize) -> Self {
        assert!(n <= MAX_RUN, "a run of {n} pages exceeds the longest run");
        let mark = log.mark();
        f.range.publish(start, n, mark);
        // Missing faults first: once a page is out, a touch must wait for it. (The kernel
        // registers over a part the program unmapped meanwhile without a word: the pages there
        // do not move, and the unmapping was reported.)
        let registered = f
            .rearm
            .is_none_or(|r| f.uffd.register(start, n * PAGE, r.frozen).is_ok());
        let mut run = FrozenRun {
            uffd: f.uffd,
            range: f.range,
            changes: f.changes,
            parking: f.parking,
            rearm: f.rearm,
            registered,
            parked: [false; MAX_RUN],
            mark,
            scratch: f.scratch,
            locked: f.locked,
            in_locked: [false; MAX_RUN],
            start,
            n,
            moved: [false; MAX_RUN],
            refused: [false; MAX_RUN],
            empty: [false; MAX_RUN],
            consumed: [false; MAX_RUN],
            mapped: [false; MAX_RUN],
            moved_to: [0; MAX_RUN],
            restored: false,
            #[cfg(test)]
            fail_pages: 0,
        };
        if registered {
            run.move_out(f.pagemap);
        }
        run
    }

    /// What changes recorded since the freeze did to page `k` (`log` is the change log, locked).
    pub(crate) fn fate(&self, log: &ChangeLog, k: usize) -> Fate {
        log.fate_since(self.start + k * PAGE, self.mark)
    }

    fn move_out(&mut self, pagemap: &sys::Pagemap) {
        let (start, n) = (self.start, self.n);
        let mut failed = false;
        // Pages per call: the rest of the run, or one at a time once a call was refused (a run
        // spanning two mappings is refused whole: the kernel moves within one mapping a call).
        let mut one_by_one = false;
        // Into the scratch area, or the locked area (see the `locking` module): where the last
        // move went. A page the kernel refuses to move into one (`EINVAL`) is tried in the other
        // before it is refused; once it moves, the rest of the run is tried whole there.
        let mut into_locked = false;
        let mut switched = false;
        let mut off = 0;
        while off < n {
            let len = if one_by_one { 1 } else { n - off };
            let Some(area) = self.area(into_locked) else {
                into_locked = false;
                continue;
            };
            // SAFETY: the run is registered memory the engine froze (no reference to it exists in
            // the engine) and the slots [off, n) of either area are empty (`freeze`'s contract;
            // the locked area is emptied after every run that used it).
            let r = unsafe {
                self.uffd.move_pages(
                    area + off * PAGE,
                    start + off * PAGE,
                    len * PAGE,
                    UFFDIO_MOVE_MODE_DONTWAKE,
                )
            };
            match r {
                Ok(bytes) if bytes >= PAGE => {
                    let k = bytes / PAGE;
                    self.moved[off..off + k].fill(true);
                    self.in_locked[off..off + k].fill(into_locked);
                    off += k;
                    one_by_one &= !switched;
                    switched = false;
                }
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) && len > 1 => one_by_one = true,
                // A mapping unlike this area's in locking: the other one.
                Err(e)
                    if e.raw_os_error() == Some(libc::EINVAL)
                        && !switched
                        && self.area(!into_locked).is_some() =>
                {
                    into_locked = !into_locked;
                    switched = true;
                }
                // A mapping unlike either area's (not read/write): refused.
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                    self.refused[off] = true;
                    off += 1;
                    failed = true;
                    switched = false;
                }
                // A hole, a page shared with a child, or a page busy in the kernel: skip it.
                _ => {
                    off += 1;
                    failed = true;
                    switched = false;
                }
            }
        }
        if failed {
            // A failed move may still have moved pages: Linux 6.18 can move part of a batch
            // of pages, meet a concurrent writer, retry from the batch's start and report
            // EEXIST (its destination is now taken) without counting what it moved. A page left
            // in scratch and thought unmoved would be discarded with it, losing its writes. So
            // the page tables say what moved: a page in a slot whose address is empty (frozen
            // addresses stay empty until the wake).
            let areas = (
                self.scratch,
                self.locked.and_then(LockedScratch::slots_if_locked),
            );
            let (moved, in_locked) = (&mut self.moved[..n], &mut self.in_locked[..n]);
            reconcile_moved(pagemap, start, areas, moved, in_locked);
            self.find_empty(pagemap);
        }
    }

    /// Marks the pages that did not move because their address is empty: no page, nothing
    /// swapped out or migrating (a pte marker counts as something). Published and registered
    /// for missing faults, such an address stays empty until the wake.
    fn find_empty(&mut self, pagemap: &sys::Pagemap) {
        let n = self.n;
        let Ok(held) = pagemap.pages_with_any(self.start, n, PAGE_IS_PRESENT | PAGE_IS_SWAPPED)
        else {
            return;
        };
        for (k, held) in held.into_iter().enumerate().take(n) {
            self.empty[k] = !self.moved[k] && !self.refused[k] && !held;
        }
    }

    /// The first slot of the run's scratch slots, or of the locked area's (locked on the first
    /// call), if it could be locked.
    fn area(&self, locked: bool) -> Option<usize> {
        if locked {
            self.locked.and_then(LockedScratch::slots)
        } else {
            Some(self.scratch)
        }
    }

    /// Page `k`'s slot (where it is frozen, if it moved).
    fn slot(&self, k: usize) -> usize {
        let locked = self.locked.filter(|_| self.in_locked[k]);
        locked.map_or(self.scratch, |l| l.range().start) + k * PAGE
    }

    /// Where page `k`'s frozen bytes are, if it moved: its scratch slot. Only the engine knows
    /// the scratch area, so nobody writes them while the run is frozen.
    pub(crate) fn frozen_page(&self, k: usize) -> Option<usize> {
        self.moved[k].then(|| self.slot(k))
    }

    /// Whether page `k` was frozen into the locked area (its mapping is locked: see the
    /// `locking` module).
    pub(crate) fn locked(&self, k: usize) -> bool {
        self.moved[k] && self.in_locked[k]
    }

    /// Whether page `k` did not move because its address held no page (it reads zeros).
    pub(crate) fn empty(&self, k: usize) -> bool {
        self.empty[k]
    }

    /// Whether page `k` stayed in place because the kernel refused to move it from its mapping
    /// (see the `refusals` module), rather than for a hole or a passing reason.
    pub(crate) fn refused(&self, k: usize) -> bool {
        self.refused[k] && !self.moved[k]
    }

    /// Marks moved page `k` consumed: merged (its address maps a copy now) or released (its
    /// address stays empty). Its frozen bytes are discarded, not put back.
    pub(crate) fn consume(&mut self, k: usize) {
        debug_assert!(self.moved[k], "only a moved page can be consumed");
        self.consumed[k] = true;
    }

    /// Marks page `k`, moved or [empty](Self::empty), consumed by a copy mapped over its
    /// address (see [`consume`]): that address is no longer part of the run's mapping.
    ///
    /// [`consume`]: Self::consume
    pub(crate) fn consume_mapped(&mut self, k: usize) {
        debug_assert!(
            self.moved[k] || self.empty[k],
            "only a frozen page can be consumed"
        );
        self.consumed[k] = true;
        self.mapped[k] = true;
    }

    /// Registers the run's pages that are still its mapping's (put back, or released: empty) as
    /// registered memory is, without missing faults again (see `Shared::freeze_mode`). Not while
    /// a page of it is parked (its waiters need the missing faults), nor where the program
    /// changed the mapping meanwhile (refused: missing faults there are answered by the fault
    /// thread as before).
    fn rearm_watch(&self) {
        let Some(r) = self.rearm.filter(|_| self.registered) else {
            return;
        };
        // Mapped copies are mappings of their own; parked pages are re-armed when they are back.
        let skipped = |q: usize| self.mapped[q] || self.parked[q];
        let mut k = 0;
        while k < self.n {
            if skipped(k) {
                k += 1;
                continue;
            }
            let m = (k..self.n).take_while(|&q| !skipped(q)).count();
            let _ = self
                .uffd
                .register(self.start + k * PAGE, m * PAGE, r.watched);
            k += m;
        }
        for k in (0..self.n).filter(|&k| !self.moved[k] && !self.mapped[k]) {
            let _ = self.uffd.writeprotect(self.start + k * PAGE, PAGE, false);
        }
    }

    /// Puts back every moved page that was not consumed (the originals of merged and released
    /// pages stay in their slots until the [`Scratch`] discards them). The run stays frozen, its
    /// writers blocked, until the guard is dropped. Done once; dropping the guard does it if the commit did not. Returns
    /// what could not be put back, to log once the writers are woken (nothing is logged while
    /// they wait).
    ///
    /// A page is put back where it was (`UFFDIO_MOVE`); if the kernel refuses that (the program
    /// changed the mapping's protection or locked it meanwhile, or the page is shared with a
    /// child), its bytes are copied back instead (`UFFDIO_COPY`). Only a page whose mapping is
    /// gone (the program unmapped it: the kernel finds no registered mapping there) is dropped,
    /// with the mapping it belonged to. While the kernel holds moves back for an unmapping or
    /// `MADV_DONTNEED` whose event the fault thread has not read yet (`EAGAIN`), it waits. A page
    /// the copy fails for (no memory for it) is parked, never dropped (see the `parking` module);
    /// with every parking slot taken, it waits for one or for memory.
    pub(crate) fn restore(&mut self) -> RestoreReport {
        let mut report = RestoreReport::default();
        if self.restored {
            return report;
        }
        self.restored = true;
        let mut log = lock(self.changes);
        for k in (0..self.n).filter(|&k| self.moved[k] && !self.consumed[k]) {
            let slot = self.slot(k);
            loop {
                let to = match self.fate(&log, k) {
                    Fate::Gone => {
                        report.gone += 1;
                        break;
                    }
                    // The program dropped it meanwhile: it stays empty and reads zeros.
                    Fate::Zeroed(_) => {
                        report.zeroed += 1;
                        break;
                    }
                    Fate::Kept => self.start + k * PAGE,
                    Fate::Moved(to) => {
                        self.moved_to[k] = to;
                        to
                    }
                };
                let again = match self.put_back(to, k) {
                    PutBack::Moved => false,
                    PutBack::Copied => {
                        report.copied += 1;
                        false
                    }
                    PutBack::Gone => {
                        report.gone += 1;
                        false
                    }
                    PutBack::Failed(e)
                        // SAFETY: `slot` holds the frozen page, in the scratch area nobody else
                        // writes.
                        if unsafe { self.parking.park(to, slot, self.watched_mode()) } =>
                    {
                        report.parked += 1;
                        self.parked[k] = to == self.start + k * PAGE;
                        report.error = Some((to, e));
                        false
                    }
                    // No parking slot either: wait for memory or a slot.
                    PutBack::Failed(_) => true,
                    // A change is under way and its event unread: let the fault thread read and
                    // record it, then look at the page's fate again.
                    PutBack::Again => true,
                };
                if !again {
                    break;
                }
                drop(log);
                report.waits += 1;
                let wait = 50 * u64::from(report.waits.min(20));
                std::thread::sleep(std::time::Duration::from_micros(wait));
                log = lock(self.changes);
            }
        }
        drop(log);
        report
    }

    /// The registration a parked page of this run gets back with its bytes (0: none to change).
    fn watched_mode(&self) -> u64 {
        self.rearm.map_or(0, |r| r.watched)
    }

    /// [`restore`](Self::restore), with the put-backs of pages `ks` failing as out of memory
    /// (tests only).
    #[cfg(test)]
    pub(crate) fn restore_with_failures(&mut self, ks: &[usize]) -> RestoreReport {
        self.fail_pages = ks.iter().fold(0u64, |m, &k| m | 1 << k);
        self.restore()
    }

    /// [`put_back`] of page `k` to `to`, but for the failures a test asks for.
    fn put_back(&self, to: usize, k: usize) -> PutBack {
        #[cfg(test)]
        if k < 64 && self.fail_pages & 1 << k != 0 {
            return PutBack::Failed(std::io::Error::from_raw_os_error(libc::ENOMEM));
        }
        put_back(self.uffd, to, self.slot(k))
    }
}

impl Drop for FrozenRun<'_> {
    fn drop(&mut self) {
        // On an early return or a panic the report is logged here, after the wake.
        let report = self.restore();
        self.rearm_watch();
        self.range.clear();
        let _ = self.uffd.wake(self.start, self.n * PAGE);
        for &to in self.moved_to.iter().take(self.n).filter(|&&to| to != 0) {
            let _ = self.uffd.wake(to, PAGE);
        }
        // The next run freezes into the same locked slots: emptied now (pages put back left
        // theirs empty already).
        if let Some(l) = self
            .locked
            .filter(|_| self.in_locked[..self.n].contains(&true))
        {
            l.discard(self.changes, self.n);
        }
        report.log();
    }
}

/// How a frozen page went back.
enum PutBack {
    Moved,
    Copied,
    /// Its mapping is gone: nothing to put back into.
    Gone,
    /// Refused for now: a change is under way in the program and its event unread (`EAGAIN`).
    Again,
    Failed(std::io::Error),
}

/// Puts the frozen page in scratch slot `slot` back at `addr` (see [`FrozenRun::restore`]).
fn put_back(uffd: &sys::Uffd, addr: usize, slot: usize) -> PutBack {
    // SAFETY: `slot` holds the page moved out of the frozen address `addr` (or where the program
    // moved that address since), which is still empty (the fault thread does not fill frozen
    // pages).
    let moved = unsafe { uffd.move_pages(addr, slot, PAGE, UFFDIO_MOVE_MODE_DONTWAKE) };
    let e = match moved {
        Ok(_) => return PutBack::Moved,
        Err(e) => e,
    };
    if e.raw_os_error() == Some(libc::EAGAIN) {
        return PutBack::Again;
    }
    // SAFETY: `slot` is a mapped scratch page of PAGE bytes nobody else writes.
    match unsafe { uffd.copy(addr, slot as *const u8, PAGE) } {
        Ok(()) => PutBack::Copied,
        Err(c) if c.raw_os_error() == Some(libc::EAGAIN) => PutBack::Again,
        // No registered mapping at `addr` any more (ENOENT: none; EINVAL: not ours).
        Err(c) if matches!(c.raw_os_error(), Some(libc::ENOENT | libc::EINVAL)) => PutBack::Gone,
        Err(c) => PutBack::Failed(c),
    }
}

/// What [`FrozenRun::restore`] could not do as usual.
#[derive(Default, Debug)]
pub(crate) struct RestoreReport {
    /// Pages copied back instead of moved.
    pub(crate) copied: usize,
    /// Pages whose mapping the program removed meanwhile.
    pub(crate) gone: usize,
    /// Pages the program dropped (`MADV_DONTNEED`) meanwhile: left empty.
    pub(crate) zeroed: usize,
    /// Times a put-back waited for an event to be read.
    pub(crate) waits: u32,
    /// Pages that could not be put back for now and were parked, and the last error.
    pub(crate) parked: usize,
    pub(crate) error: Option<(usize, std::io::Error)>,
}

impl RestoreReport {
    /// Logs it (after the wake).
    pub(crate) fn log(&self) {
        if self.copied + self.gone + self.zeroed > 0 {
            tracing::debug!(
                copied = self.copied,
                gone = self.gone,
                zeroed = self.zeroed,
                "frozen pages copied back, or dropped with their mapping"
            );
        }
        if let Some((addr, e)) = &self.error {
            tracing::warn!(
                error = %e,
                addr,
                parked = self.parked,
                "frozen pages could not be put back yet: parked until memory allows"
            );
        }
    }
}

/// Runs the calling thread in the normal scheduling class until dropped, then puts it back in
/// its background class (`SCHED_IDLE` unless it was starved: see `sys::Background`): a thread
/// holding writers up (a frozen or write-protected run) must not wait behind busy threads of
/// normal priority while they wait for it. Only for the engine's threads.
pub(crate) struct NormalPriority(());

impl NormalPriority {
    pub(crate) fn enter() -> Self {
        let _ = sys::set_thread_normal_priority();
        NormalPriority(())
    }
}

impl Drop for NormalPriority {
    fn drop(&mut self) {
        sys::restore_background_class();
    }
}

/// Sets `moved[k]` to whether page `k` of the run at `start` moved to its slot `k` in the
/// scratch area or the locked area (`in_locked[k]`: the latter): the slot holds a page and the
/// run's address none (see the failed-move note in `move_out`). If a scan fails, both stay as the
/// moves reported them.
fn reconcile_moved(
    pagemap: &sys::Pagemap,
    start: usize,
    (scratch, locked): (usize, Option<usize>),
    moved: &mut [bool],
    in_locked: &mut [bool],
) {
    let n = moved.len();
    let (Ok(slots), Ok(live)) = (
        pagemap.pages_with(scratch, n, PAGE_IS_PRESENT),
        pagemap.pages_with(start, n, PAGE_IS_PRESENT),
    ) else {
        return;
    };
    let locked_slots = match locked.map(|l| pagemap.pages_with(l, n, PAGE_IS_PRESENT)) {
        Some(Ok(l)) => Some(l),
        Some(Err(_)) => return,
        None => None,
    };
    for k in 0..n {
        in_locked[k] = locked_slots.as_ref().is_some_and(|l| l[k]);
        moved[k] = (slots[k] || in_locked[k]) && !live[k];
    }
}

/// A run of pages in store mappings held still by synchronous write-protection: they stay
/// readable, and any write blocks until the guard is dropped. Dropping it un-protects the pages
/// not [replaced](Self::mark_replaced), then wakes everyone who waited on the run (a wake needs
/// no mapping, so it also reaches writers of the replaced pages).
pub(crate) struct ProtectedRun<'a> {
    uffd: &'a sys::Uffd,
    start: usize,
    n: usize,
    replaced: [bool; MAX_RUN],
}

impl<'a> ProtectedRun<'a> {
    /// Write-protects the `n` pages from `start` (`n <= MAX_RUN`) through `uffd`, the context
    /// their store mappings are registered with (for write-protection while held, [`STORE_MODE`]
    /// otherwise). `None`, with nothing left protected, if some page is not in a
    /// write-protectable mapping.
    pub(crate) fn protect(uffd: &'a sys::Uffd, start: usize, n: usize) -> Option<Self> {
        assert!(n <= MAX_RUN, "a run of {n} pages exceeds the longest run");
        let registered = uffd
            .register(start, n * PAGE, STORE_MODE | UFFDIO_REGISTER_MODE_WP)
            .is_ok();
        if !registered || uffd.writeprotect(start, n * PAGE, true).is_err() {
            let _ = uffd.writeprotect(start, n * PAGE, false);
            let _ = uffd.register(start, n * PAGE, STORE_MODE);
            return None;
        }
        Some(ProtectedRun {
            uffd,
            start,
            n,
            replaced: [false; MAX_RUN],
        })
    }

    /// Marks page `k` replaced by a mapping of its copy: there is nothing to un-protect there.
    pub(crate) fn mark_replaced(&mut self, k: usize) {
        self.replaced[k] = true;
    }
}

impl Drop for ProtectedRun<'_> {
    fn drop(&mut self) {
        for k in (0..self.n).filter(|&k| !self.replaced[k]) {
            let _ = self.uffd.writeprotect(self.start + k * PAGE, PAGE, false);
        }
        // The pages not replaced are registered as store mappings are again (the replaced ones
        // are new mappings, registered so already).
        let mut k = 0;
        while k < self.n {
            let m = (k..self.n).take_while(|&q| !self.replaced[q]).count();
            if m > 0 {
                let _ = self
                    .uffd
                    .register(self.start + k * PAGE, m * PAGE, STORE_MODE);
            }
            k += m.max(1);
        }
        let _ = self.uffd.wake(self.start, self.n * PAGE);
    }
}

#[cfg(test)]
pub(crate) mod tests {
    //! The guards on the real kernel: whatever path leaves a freeze (the commit's own, an early
    //! return, a panic), the pages come back with their contents and blocked writers go on.

    use super::*;
    use std::sync::{mpsc, RwLock, RwLockReadGuard};
    use std::time::{Duration, Instant};

    /// A region of `n` pages (page `k` filled with `k + 1`) and a scratch area, both registered
    /// for missing faults with a context that can move pages, as the engine registers them. No
    /// thread answers missing faults: a page is only read where the page tables say it is.
    struct Frozen {
        /// Held for the test: see [`NO_FORK`].
        _forks_wait: Option<RwLockReadGuard<'static, ()>>,
        uffd: sys::Uffd,
        range: FrozenRange,
        changes: Mutex<ChangeLog>,
        parking: Parking,
        pagemap: sys::Pagemap,
        region: usize,
        scratch: usize,
        locked: Option<LockedScratch>,
        n: usize,
        rearm: Option<Rearm>,
    }

    /// Held shared by the tests of frozen runs and exclusively by tests that fork: a run these
    /// tests freeze does not hold forks off as the engine's runs do (see `layout::holding_still`),
    /// and a page shared with a child is copied back, not moved, which some of them tell apart.
    pub(crate) static NO_FORK: RwLock<()> = RwLock::new(());

    impl Frozen {
        fn new(n: usize) -> Self {
            Self::registered(n, None)
        }

        /// The region registered for write-protection only, as the engine registers memory it
        /// watches that way: missing faults only while a run is frozen.
        fn watched(n: usize) -> Self {
            Self::registered(
                n,
                Some(Rearm {
                    frozen: UFFDIO_REGISTER_MODE_MISSING,
                    watched: UFFDIO_REGISTER_MODE_WP,
                }),
            )
        }

        fn registered(n: usize, rearm: Option<Rearm>) -> Self {
            // Before the pages exist: a child forked while they do shares them, and shared
            // pages cannot move.
            let forks_wait = NO_FORK.read().unwrap_or_else(|e| e.into_inner());
            let uffd = sys::Uffd::open(UFFD_FEATURE_MOVE).unwrap();
            assert_ne!(
                uffd.features() & UFFD_FEATURE_MOVE,
                0,
                "UFFDIO_MOVE is needed"
            );
            let region = sys::mmap_anonymous(n * PAGE).unwrap() as usize;
            for k in 0..n {
                // SAFETY: a page of the fresh mapping above, which only this test uses.
                unsafe { std::ptr::write_bytes((region + k * PAGE) as *mut u8, k as u8 + 1, PAGE) };
            }
            let scratch = sys::mmap_anonymous(SCRATCH_SLOTS * PAGE).unwrap() as usize;
            let (region_mode, scratch_mode) = match rearm {
                Some(r) => (r.watched, r.frozen),
                None => (UFFDIO_REGISTER_MODE_MISSING, UFFDIO_REGISTER_MODE_MISSING),
            };
            uffd.register(region, n * PAGE, region_mode).unwrap();
            uffd.register(scratch, SCRATCH_SLOTS * PAGE, scratch_mode)
                .unwrap();
            let locked = LockedScratch::new(&uffd, scratch_mode, MAX_RUN);
            Frozen {
                _forks_wait: Some(forks_wait),
                uffd,
                range: FrozenRange::default(),
                changes: Mutex::default(),
                parking: Parking::new().unwrap(),
                pagemap: sys::Pagemap::open().unwrap(),
                region,
                scratch,
                locked,
                n,
                rearm,
            }
        }

        fn freeze(&self) -> FrozenRun<'_> {
            self.freeze_into(self.scratch)
        }

        /// Freezes the region into the empty scratch slots from `slots`.
        fn freeze_into(&self, slots: usize) -> FrozenRun<'_> {
            let f = Freezer {
                uffd: &self.uffd,
                range: &self.range,
                scratch: slots,
                locked: self.locked.as_ref(),
                pagemap: &self.pagemap,
                changes: &self.changes,
                parking: &self.parking,
                rearm: self.rearm,
            };
            let log = lock(&self.changes);
            // SAFETY: the region and the scratch area are registered above and only this test
            // uses them; nothing answers missing faults.
            unsafe { FrozenRun::freeze(f, &log, self.region, self.n) }
        }

        fn present(&self, addr: usize, n: usize) -> Vec<bool> {
            self.pagemap.pages_with(addr, n, PAGE_IS_PRESENT).unwrap()
        }

        /// Whether page `k` is present and holds `k + 1` throughout, but for `first` at byte 0.
        fn intact(&self, k: usize, first: u8) -> bool {
            if !self.present(self.region + k * PAGE, 1)[0] {
                return false;
            }
            // SAFETY: a present page of this test's region; the writers are done.
            let page =
                unsafe { std::slice::from_raw_parts((self.region + k * PAGE) as *const u8, PAGE) };
            page[0] == first && page[1..].iter().all(|&b| b == k as u8 + 1)
        }

        fn is_frozen(&self, k: usize) -> bool {
            self.range
                .gate()
                .is_frozen(self.region + k * PAGE, &lock(&self.changes))
        }
    }

    /// Writes `v` to the byte at `addr` on a thread of its own; the receiver hears when it is
    /// done.
    fn write_on_a_thread(addr: usize, v: u8) -> mpsc::Receiver<()> {
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            // SAFETY: a page of a mapping the test owns, written only by this thread meanwhile.
            unsafe { std::ptr::write_volatile(addr as *mut u8, v) };
            let _ = tx.send(());
        });
        rx
    }

    /// Waits until `uffd` reports a fault at the page of `addr`: the writer is blocked in the
    /// kernel, and only a wake lets it go on.
    fn blocked_at(uffd: &sys::Uffd, addr: usize) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Ok(Some(msg)) = uffd.read_event() {
                if msg.event == UFFD_EVENT_PAGEFAULT
                    && msg.pf_address as usize & !(PAGE - 1) == addr
                {
                    return;
                }
            }
            assert!(Instant::now() < deadline, "the writer never faulted");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// A run over two mappings (split here by advice that changes nothing a move checks) moves
    /// whole: the kernel refuses a move across mappings, so the pages move one by one after such
    /// a refusal, and none counts as refused (which would keep it from merging for a while).
    #[test]
    fn a_run_over_two_mappings_moves_whole() {
        let t = Frozen::new(4);
        // SAFETY: advice on this test's own region; it changes no contents.
        unsafe {
            sys::madvise(
                (t.region + 2 * PAGE) as *mut u8,
                2 * PAGE,
                libc::MADV_NOHUGEPAGE,
            )
        }
        .unwrap();
        let run = t.freeze();
        assert!((0..4).all(|k| run.frozen_page(k).is_some() && !run.refused(k)));
        assert_eq!(t.present(t.region, 4), [false; 4]);
        drop(run);
        assert!((0..4).all(|k| t.intact(k, k as u8 + 1)));
    }

    /// A page whose address holds none (never touched, or dropped) does not move, and is
    /// frozen as empty all the same: a touch waits for the wake. A page the kernel refused to
    /// move is not empty, and a page mapping the kernel's zero page moves.
    #[test]
    fn an_empty_address_is_frozen_as_empty_and_a_touch_waits_for_the_wake() {
        let t = Frozen::watched(4);
        // Pages 1 and 2 dropped, page 2 read since (the zero page), page 3 read-only.
        // SAFETY: pages of this test's own region, which nothing else uses.
        unsafe {
            sys::madvise((t.region + PAGE) as *mut u8, 2 * PAGE, libc::MADV_DONTNEED).unwrap();
            assert_eq!(
                std::ptr::read_volatile((t.region + 2 * PAGE) as *const u8),
                0
            );
            let r = sys::raw_mprotect((t.region + 3 * PAGE) as *mut _, PAGE, libc::PROT_READ);
            assert_eq!(r, 0);
        }
        let run = t.freeze();
        assert!(run.frozen_page(0).is_some() && !run.empty(0));
        assert!(run.frozen_page(1).is_none() && run.empty(1));
        assert!(run.frozen_page(2).is_some() && !run.empty(2));
        assert!(run.refused(3) && !run.empty(3));
        let done = write_on_a_thread(t.region + PAGE, 9);
        blocked_at(&t.uffd, t.region + PAGE);
        assert!(done.recv_timeout(Duration::from_millis(50)).is_err());
        drop(run);
        done.recv_timeout(Duration::from_secs(10)).unwrap();
        // SAFETY: a page of this test's region; its writer is done.
        let page = unsafe { std::slice::from_raw_parts((t.region + PAGE) as *const u8, PAGE) };
        assert!(page[0] == 9 && page[1..].iter().all(|&b| b == 0));
        assert!(t.intact(0, 1));
    }

    /// A page shared with a child cannot move (`EBUSY`), and holds bytes: it is neither
    /// refused nor empty, and stays as it is.
    #[test]
    fn a_page_shared_with_a_child_is_not_empty() {
        let mut t = Frozen::watched(1);
        t._forks_wait = None;
        let mut fds = [0; 2];
        // SAFETY: `fds` is a local array of two descriptors.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        let pid = {
            let _no_run = NO_FORK.write().unwrap_or_else(|e| e.into_inner());
            // SAFETY: the child only waits for the pipe to close and exits.
            unsafe { libc::fork() }
        };
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            let mut b = 0u8;
            // SAFETY: reads one byte into a local; ends the child without running destructors.
            unsafe {
                libc::close(fds[1]);
                libc::read(fds[0], (&raw mut b).cast(), 1);
                libc::_exit(0);
            }
        }
        let run = t.freeze();
        assert!(run.frozen_page(0).is_none() && !run.refused(0) && !run.empty(0));
        drop(run);
        let mut status = 0;
        // SAFETY: closes this test's pipe, then waits for the child forked above.
        unsafe {
            libc::close(fds[1]);
            libc::close(fds[0]);
            assert_eq!(libc::waitpid(pid, &mut status, 0), pid);
        }
        assert!(t.intact(0, 1));
    }

    /// A page the program made read-only cannot move to either area: it stays in place,
    /// refused, and the others move.
    #[test]
    fn a_read_only_page_is_refused_and_the_others_move() {
        let t = Frozen::new(3);
        // SAFETY: a page of this test's own region, which nothing writes meanwhile.
        let r = unsafe { sys::raw_mprotect((t.region + PAGE) as *mut _, PAGE, libc::PROT_READ) };
        assert_eq!(r, 0);
        let run = t.freeze();
        assert!(run.refused(1) && run.frozen_page(1).is_none());
        let moved = (0..3).map(|k| (run.frozen_page(k).is_some(), run.refused(k)));
        assert_eq!(
            moved.collect::<Vec<_>>(),
            [(true, false), (false, true), (true, false)]
        );
        assert_eq!(t.present(t.region, 3), [false, true, false]);
        drop(run);
        assert!((0..3).all(|k| t.intact(k, k as u8 + 1)));
    }

    /// A page the program locked moves to the locked area (see the `locking` module), the others
    /// to the scratch area; all go back where they were, the locked one still locked, and the
    /// locked area is emptied.
    #[test]
    fn a_locked_page_moves_to_the_locked_area_and_back() {
        let t = Frozen::new(3);
        // SAFETY: locks a page of this test's own region; it changes no contents.
        if unsafe { libc::mlock((t.region + PAGE) as *const libc::c_void, PAGE) } != 0 {
            eprintln!(
                "skipped: mlock refused ({})",
                std::io::Error::last_os_error()
            );
            return;
        }
        let run = t.freeze();
        let Some(area) = t.locked.as_ref().and_then(LockedScratch::slots_if_locked) else {
            panic!("the locked area was not locked");
        };
        assert_eq!(run.frozen_page(1), Some(area + PAGE));
        assert!(run.locked(1) && !run.locked(0) && !run.locked(2));
        assert_eq!(run.frozen_page(2), Some(t.scratch + 2 * PAGE));
        assert_eq!(t.present(t.region, 3), [false; 3]);
        drop(run);
        assert!((0..3).all(|k| t.intact(k, k as u8 + 1)));
        assert_eq!(t.present(area, 3), [false; 3]);
        assert!(crate::locking::tests::is_locked(t.region + PAGE));
    }

    /// A whole locked run moves to the locked area in one call once its first page did, and a
    /// page consumed there is emptied from it when the run is woken.
    #[test]
    fn a_locked_run_moves_whole_and_its_consumed_slot_is_emptied() {
        let t = Frozen::new(8);
        // SAFETY: locks this test's own region; it changes no contents.
        if unsafe { libc::mlock(t.region as *const libc::c_void, 8 * PAGE) } != 0 {
            eprintln!(
                "skipped: mlock refused ({})",
                std::io::Error::last_os_error()
            );
            return;
        }
        let mut run = t.freeze();
        assert!((0..8).all(|k| run.locked(k)));
        let area = run.frozen_page(0).unwrap();
        run.consume(3);
        drop(run);
        assert_eq!(t.present(area, 8), [false; 8]);
        let back = t.present(t.region, 8);
        assert_eq!(back, [true, true, true, false, true, true, true, true]);
        assert!((0..8).filter(|&k| k != 3).all(|k| t.intact(k, k as u8 + 1)));
    }

    #[test]
    fn a_dropped_frozen_run_puts_every_page_back_and_wakes_its_writers() {
        let t = Frozen::new(4);
        let run = t.freeze();
        assert!(t.is_frozen(0) && t.is_frozen(3) && !t.is_frozen(4));
        assert_eq!(
            t.present(t.region, 4),
            [false; 4],
            "frozen pages are moved out"
        );
        assert_eq!(t.present(t.scratch, 4), [true; 4]);
        assert!((0..4).all(|k| run.frozen_page(k) == Some(t.scratch + k * PAGE)));
        let done = write_on_a_thread(t.region + 2 * PAGE, 0xee);
        blocked_at(&t.uffd, t.region + 2 * PAGE);
        assert!(done.try_recv().is_err(), "a write to a frozen page waits");
        // An early return of the commit: nothing consumed, nothing restored.
        drop(run);
        done.recv_timeout(Duration::from_secs(10))
            .expect("the writer is woken when the run is dropped");
        assert!(!t.is_frozen(0));
        assert!(t.intact(0, 1) && t.intact(1, 2) && t.intact(3, 4));
        assert!(t.intact(2, 0xee), "the write lands on the page put back");
        assert_eq!(
            t.present(t.scratch, 4),
            [false; 4],
            "the scratch area is discarded"
        );
    }

    #[test]
    fn a_panic_while_frozen_still_puts_the_pages_back() {
        let t = Frozen::new(3);
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _run = t.freeze();
            assert!(t.is_frozen(1));
            panic!("a commit fails while the run is frozen");
        }));
        assert!(r.is_err());
        assert!(!t.is_frozen(1));
        assert!((0..3).all(|k| t.intact(k, k as u8 + 1)));
        assert_eq!(t.present(t.scratch, 3), [false; 3]);
    }

    /// The copy back fails for want of memory: the page is parked, not dropped. Its writer,
    /// woken with the run, faults again and waits (nothing answers it with a zero page); the
    /// bytes go back once memory allows, and the write lands on them.
    #[test]
    fn a_page_that_cannot_be_put_back_is_parked_and_comes_back_later() {
        let t = Frozen::new(3);
        let mut run = t.freeze();
        let done = write_on_a_thread(t.region + PAGE, 0xee);
        blocked_at(&t.uffd, t.region + PAGE);
        // Pages 0 and 2 go back; page 1 finds no memory for it.
        let report = run.restore_with_failures(&[1]);
        assert_eq!(report.parked, 1, "{report:?}");
        drop(run);
        assert!(t.intact(0, 1) && t.intact(2, 3));
        assert!(t.parking.holds(t.region + PAGE));
        assert!(
            !t.present(t.region + PAGE, 1)[0],
            "a parked page's address stays empty"
        );
        // The writer was woken with the run, faulted again and waits.
        blocked_at(&t.uffd, t.region + PAGE);
        assert!(
            done.try_recv().is_err(),
            "the writer waits for the parked page"
        );
        // Still no memory: it stays parked, and the writer waits on.
        t.parking.fail_copies.store(1, Ordering::Relaxed);
        assert_eq!(t.parking.put_back(&t.uffd, 0..usize::MAX), 1);
        assert!(done.try_recv().is_err());
        // Memory again: the bytes go back and the writer is woken.
        assert_eq!(t.parking.put_back(&t.uffd, 0..usize::MAX), 0);
        done.recv_timeout(Duration::from_secs(10))
            .expect("the writer is woken when its page is back");
        assert!(t.intact(1, 0xee), "the write lands on the parked bytes");
        assert!(t.parking.is_empty());
    }

    /// A `fork` while a page is parked waits until the page is back: the child reads its bytes
    /// (fails without the wait: the child reads the empty address as zeros).
    #[test]
    fn a_fork_waits_for_parked_pages() {
        crate::layout::watch_forks().unwrap();
        let mut t = Frozen::new(2);
        t._forks_wait = None;
        let mut run = t.freeze();
        assert_eq!(run.restore_with_failures(&[1]).parked, 1);
        drop(run);
        // Memory comes back after a few tries of the fault thread (played by a thread here).
        t.parking.fail_copies.store(5, Ordering::Relaxed);
        let status = std::thread::scope(|s| {
            s.spawn(|| {
                while t.parking.put_back(&t.uffd, 0..usize::MAX) > 0 {
                    std::thread::sleep(Duration::from_millis(10));
                }
            });
            let _no_run = NO_FORK.write().unwrap_or_else(|e| e.into_inner());
            // SAFETY: the child only reads this test's memory and exits.
            let pid = unsafe { libc::fork() };
            assert!(pid >= 0, "fork failed");
            if pid == 0 {
                let page = (t.region + PAGE) as *const u8;
                // SAFETY: a page of the region, mapped in the child; nothing writes it there.
                let kept = (0..PAGE).all(|i| unsafe { page.add(i).read_volatile() } == 2);
                // SAFETY: ends the child without running the parent's destructors.
                unsafe { libc::_exit(i32::from(!kept)) };
            }
            let mut status = 0;
            // SAFETY: waits for the child forked above.
            assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
            status
        });
        assert!(
            libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
            "the child read the parked page as zeros (status {status:#x})"
        );
        assert!(t.parking.is_empty() && t.intact(1, 2));
    }

    /// A parked page the program unmaps, drops or moves meanwhile: dropped with its mapping or
    /// on `MADV_DONTNEED`, moved with `mremap`. A thread waiting on a dropped one is woken to
    /// fault again (and then gets the zero page, as any dropped page).
    #[test]
    fn parked_pages_follow_the_programs_changes() {
        let t = Frozen::new(4);
        let mut run = t.freeze();
        let report = run.restore_with_failures(&[0, 1, 2]);
        assert_eq!(report.parked, 3, "{report:?}");
        drop(run);
        let (a, b, c) = (t.region, t.region + PAGE, t.region + 2 * PAGE);
        let done = write_on_a_thread(b + 8, 0xee);
        blocked_at(&t.uffd, b);
        t.parking
            .follow(&t.uffd, &Change::Unmap { start: a, end: b });
        t.parking
            .follow(&t.uffd, &Change::Remove { start: b, end: c });
        // Woken, the writer faults again; the fault thread's answer to a page no longer parked.
        blocked_at(&t.uffd, b);
        t.uffd.zeropage(b, PAGE).unwrap();
        done.recv_timeout(Duration::from_secs(10))
            .expect("the writer of a dropped parked page is woken");
        // SAFETY: a present page of this test's region; its writer is done.
        let page = unsafe { std::slice::from_raw_parts(b as *const u8, PAGE) };
        assert!(page
            .iter()
            .enumerate()
            .all(|(i, &v)| v == if i == 8 { 0xee } else { 0 }));
        let to = t.region + 64 * PAGE;
        t.parking.follow(
            &t.uffd,
            &Change::Remap {
                from: c,
                to,
                len: PAGE,
            },
        );
        assert!(!t.parking.holds(a) && !t.parking.holds(b) && !t.parking.holds(c));
        assert!(t.parking.holds(to));
    }

    /// The program changed the frozen pages' mapping while they were out: made it read-only,
    /// locked it (without populating), or unmapped part of it. Moving the pages back is then
    /// refused by the kernel (protections or locking differ from the scratch area's, or nothing is
    /// mapped): the read-only and locked pages are copied back with their bytes; only the pages
    /// whose mapping is gone are dropped with it.
    #[test]
    fn pages_come_back_after_their_mapping_changed_while_frozen() {
        let t = Frozen::new(6);
        let mut run = t.freeze();
        let at = |k: usize| (t.region + k * PAGE) as *mut libc::c_void;
        // SAFETY: pages of this test's region, which hold no references.
        unsafe {
            assert_eq!(libc::mprotect(at(0), 2 * PAGE, libc::PROT_READ), 0);
            assert_eq!(
                libc::syscall(libc::SYS_mlock2, at(2), 2 * PAGE, libc::MLOCK_ONFAULT),
                0
            );
            assert_eq!(libc::munmap(at(4), PAGE), 0);
        }
        let report = run.restore();
        drop(run);
        assert_eq!((report.copied, report.gone, report.parked), (4, 1, 0));
        assert!(
            (0..4).all(|k| t.intact(k, k as u8 + 1)),
            "no page lost its bytes"
        );
        assert!(t.intact(5, 6));
        // SAFETY: as above.
        unsafe { libc::munlock(at(2), 2 * PAGE) };
    }

    #[test]
    fn consumed_pages_stay_released_and_the_others_come_back() {
        let t = Frozen::new(3);
        let mut run = t.freeze();
        run.consume(1);
        run.restore();
        // Restored but still frozen: writers wait for the drop.
        assert!(t.is_frozen(1));
        assert_eq!(t.present(t.region, 3), [true, false, true]);
        assert_eq!(
            t.present(t.scratch, 3),
            [false, true, false],
            "a consumed page's original stays in its slot until the scratch area is discarded"
        );
        drop(run);
        assert!(!t.is_frozen(1));
        assert!(t.intact(0, 1) && t.intact(2, 3));
        assert_eq!(
            t.present(t.region + PAGE, 1),
            [false],
            "a consumed page stays released"
        );
    }

    /// Memory registered for write-protection only: the run is registered for missing faults
    /// while frozen (a writer waits for its page), and not after: a released page's address is
    /// then the kernel's to fill on a touch, with no fault for anyone to answer.
    #[test]
    fn a_watched_run_waits_for_missing_faults_only_while_frozen() {
        let t = Frozen::watched(3);
        let mut run = t.freeze();
        assert_eq!(
            t.present(t.region, 3),
            [false; 3],
            "frozen pages are moved out"
        );
        let done = write_on_a_thread(t.region + 2 * PAGE, 0xee);
        blocked_at(&t.uffd, t.region + 2 * PAGE);
        assert!(done.try_recv().is_err(), "a write to a frozen page waits");
        run.consume(1);
        drop(run);
        done.recv_timeout(Duration::from_secs(10))
            .expect("the writer is woken when the run is dropped");
        assert!(t.intact(0, 1) && t.intact(2, 0xee));
        // The released page: touched, the kernel maps a page of zeros; no fault reaches the
        // context.
        let done = write_on_a_thread(t.region + PAGE + 8, 7);
        done.recv_timeout(Duration::from_secs(10))
            .expect("a touch of a released page is the kernel's own fault");
        assert!(
            matches!(t.uffd.read_event(), Ok(None)),
            "no fault was reported"
        );
        // SAFETY: a present page of this test's region; its writer is done.
        let page = unsafe { std::slice::from_raw_parts((t.region + PAGE) as *const u8, PAGE) };
        assert!(page
            .iter()
            .enumerate()
            .all(|(i, &v)| v == if i == 8 { 7 } else { 0 }));
    }

    /// A parked page of a watched run stays registered for missing faults (a touch waits for
    /// its bytes); the rest of the run is watched again at once, and the page once it is back
    /// (before, the whole run stayed registered for missing faults, unwatched, for good).
    #[test]
    fn a_watched_run_is_watched_again_around_its_parked_page() {
        const MISSING: (bool, bool) = (true, false);
        const WATCHED: (bool, bool) = (false, true);
        let t = Frozen::watched(3);
        let mut run = t.freeze();
        assert_eq!(run.restore_with_failures(&[1]).parked, 1);
        drop(run);
        let modes = |k: usize| registration_of(t.region + k * PAGE);
        assert_eq!([modes(0), modes(1), modes(2)], [WATCHED, MISSING, WATCHED]);
        let done = write_on_a_thread(t.region + PAGE, 0xee);
        blocked_at(&t.uffd, t.region + PAGE);
        assert_eq!(t.parking.put_back(&t.uffd, 0..usize::MAX), 0);
        done.recv_timeout(Duration::from_secs(10))
            .expect("the writer is woken when its page is back");
        assert!(t.intact(1, 0xee));
        assert_eq!(modes(1), WATCHED);
    }

    /// Whether the mapping of `addr` is registered for missing faults and for write-protection
    /// (its `VmFlags` in `/proc/self/smaps`: `um`, `uw`).
    fn registration_of(addr: usize) -> (bool, bool) {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let mut inside = false;
        for line in smaps.lines() {
            let range = line
                .split_whitespace()
                .next()
                .and_then(|r| r.split_once('-'));
            let bounds = range.and_then(|(a, b)| {
                Some((
                    usize::from_str_radix(a, 16).ok()?,
                    usize::from_str_radix(b, 16).ok()?,
                ))
            });
            if let Some((start, end)) = bounds.filter(|_| line.contains(' ')) {
                inside = (start..end).contains(&addr);
            } else if let Some(flags) = line.strip_prefix("VmFlags:").filter(|_| inside) {
                let has = |f: &str| flags.split_whitespace().any(|x| x == f);
                return (has("um"), has("uw"));
            }
        }
        panic!("no mapping holds {addr:#x}");
    }

    /// Runs take slot after slot; the used slots are discarded when a run would not fit, and
    /// when the scratch area's guard is dropped (here with a consumed page's original in a slot).
    #[test]
    fn scratch_slots_are_taken_in_turn_and_discarded_when_full_or_dropped() {
        let t = Frozen::new(1);
        let mut scratch = Scratch::new(t.scratch, &t.changes);
        assert_eq!(scratch.take(MAX_RUN), t.scratch);
        assert_eq!(scratch.take(1), t.scratch + MAX_RUN * PAGE);
        // A page in the first slot (filled through the context: nothing answers its faults).
        let sevens = [7u8; PAGE];
        // SAFETY: a slot just taken, which only this test uses, and a page of bytes.
        unsafe { t.uffd.copy(t.scratch, sevens.as_ptr(), PAGE) }.unwrap();
        // The rest, exactly, slot after slot.
        let mut left = SCRATCH_SLOTS - MAX_RUN - 1;
        while left > 0 {
            let n = left.min(MAX_RUN);
            let at = t.scratch + (SCRATCH_SLOTS - left) * PAGE;
            assert_eq!(scratch.take(n), at);
            left -= n;
        }
        assert_eq!(
            t.present(t.scratch, 1),
            [true],
            "not discarded while the slots last"
        );
        assert_eq!(
            scratch.take(MAX_RUN),
            t.scratch,
            "full: discarded, and taken from the start"
        );
        assert_eq!(t.present(t.scratch, 1), [false]);
        let mut run = t.freeze_into(scratch.take(1));
        run.consume(0);
        drop(run);
        let slot = t.scratch + MAX_RUN * PAGE;
        assert_eq!(t.present(slot, 1), [true], "the consumed page's original");
        assert_eq!(t.present(t.region, 1), [false], "consumed: released");
        drop(scratch);
        assert_eq!(t.present(slot, 1), [false], "discarded with the guard");
    }

    #[test]
    fn a_dropped_protected_run_unprotects_what_was_not_replaced_and_wakes_writers() {
        let n = 3;
        let uffd = sys::Uffd::open(UFFD_FEATURE_WP_HUGETLBFS_SHMEM).unwrap();
        assert_ne!(uffd.features() & UFFD_FEATURE_WP_HUGETLBFS_SHMEM, 0);
        // Private pages inside a private mapping of a memfd, as COW-broken pages are.
        let fd = sys::memfd_create(c"pageone-freeze-test").unwrap();
        let raw = std::os::fd::AsRawFd::as_raw_fd(&fd);
        sys::ftruncate(raw, (n * PAGE) as u64).unwrap();
        let base = sys::mmap_anonymous(n * PAGE).unwrap();
        // SAFETY: `base` is a fresh mapping of this length that only this test uses.
        unsafe { sys::mmap_private_fixed(base, n * PAGE, raw, 0) }.unwrap();
        let base = base as usize;
        for k in 0..n {
            // SAFETY: a page of the mapping above; the write gives it a private copy.
            unsafe { std::ptr::write_bytes((base + k * PAGE) as *mut u8, k as u8 + 1, PAGE) };
        }
        uffd.register(base, n * PAGE, UFFDIO_REGISTER_MODE_WP)
            .unwrap();
        let mut held = ProtectedRun::protect(&uffd, base, n).expect("shmem write-protection");
        let done = write_on_a_thread(base, 0xee);
        blocked_at(&uffd, base);
        assert!(
            done.try_recv().is_err(),
            "a write to a protected page waits"
        );
        // Page 1 counts as replaced: the drop leaves it protected.
        held.mark_replaced(1);
        drop(held);
        done.recv_timeout(Duration::from_secs(10))
            .expect("the writer is woken when the run is dropped");
        let again = write_on_a_thread(base + 2 * PAGE, 0xdd);
        again
            .recv_timeout(Duration::from_secs(10))
            .expect("a page not replaced is writable again");
        let blocked = write_on_a_thread(base + PAGE, 0xcc);
        blocked_at(&uffd, base + PAGE);
        assert!(
            blocked.try_recv().is_err(),
            "a replaced page is not un-protected"
        );
        // Let that writer go (un-protecting wakes it).
        uffd.writeprotect(base + PAGE, PAGE, false).unwrap();
        blocked.recv_timeout(Duration::from_secs(10)).unwrap();
        // SAFETY: the pages are present (written above) and the writers are done.
        let bytes = |k: usize| unsafe { std::ptr::read_volatile((base + k * PAGE) as *const u8) };
        assert_eq!([bytes(0), bytes(1), bytes(2)], [0xee, 0xcc, 0xdd]);
    }
}
