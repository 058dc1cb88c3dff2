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

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

use pageone_sync::lock;
use pageone_sys::{self as sys, uapi::*};

use crate::access::PAGE;

/// Longest run frozen at once: bounds how long a writer can be blocked and the scratch size.
pub(crate) const MAX_RUN: usize = 512;

/// The run currently frozen, as the fault thread sees it.
#[derive(Default)]
pub(crate) struct FrozenRange {
    /// The run, packed by [`pack_run`] into one word so the fault thread never sees half of an
    /// update.
    word: AtomicU64,
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

    /// Publishes the run `[start, start + n*PAGE)`, before any of its pages moves.
    fn publish(&self, start: usize, n: usize) {
        let _gate = lock(&self.gate);
        // SeqCst pairs with the fault thread's load (`Gate::is_frozen`): the range is visible
        // before any page moves.
        self.word.store(pack_run(start, n), Ordering::SeqCst);
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
    /// Whether `addr` is in the frozen run.
    pub(crate) fn is_frozen(&self, addr: usize) -> bool {
        // Pairs with the committer's SeqCst stores around a freeze: a fault on a page moved
        // out is reported after the move, which follows the store of the frozen range.
        let (fs, fe) = unpack_run(self.range.word.load(Ordering::SeqCst));
        addr >= fs && addr < fe
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

/// What freezing needs: the userfaultfd context of registered memory, the range the fault thread
/// reads, and the scratch area (`MAX_RUN` pages registered with the same context and protections
/// as registered memory, which `UFFDIO_MOVE` requires of its destination).
pub(crate) struct Freezer<'a> {
    pub(crate) uffd: &'a sys::Uffd,
    pub(crate) range: &'a FrozenRange,
    pub(crate) scratch: usize,
    pub(crate) pagemap: &'a sys::Pagemap,
}

/// A run of anonymous pages moved out into the scratch area: page `k` is in scratch slot `k`.
/// Dropping it puts back every moved page not [consumed](Self::consume) (unless
/// [`restore`](Self::restore) did), discards the scratch area, unpublishes the run and wakes the
/// writers blocked on it.
pub(crate) struct FrozenRun<'a> {
    uffd: &'a sys::Uffd,
    range: &'a FrozenRange,
    scratch: usize,
    start: usize,
    n: usize,
    moved: [bool; MAX_RUN],
    consumed: [bool; MAX_RUN],
    /// Whether the pages were put back and the scratch area discarded already.
    restored: bool,
}

impl<'a> FrozenRun<'a> {
    /// Freezes the `n` pages from `start`: publishes the run, then moves its pages into scratch
    /// slots `0..n`. Until the guard is dropped, any access to the run blocks in the kernel.
    ///
    /// # Safety
    ///
    /// `[start, start + n*PAGE)` (`n <= MAX_RUN`) is registered with `f.uffd` for missing faults,
    /// and the engine holds no reference into it; the scratch area is empty (discarded after every
    /// run) and no other run is frozen; missing faults in the run are left unanswered while it is
    /// published.
    pub(crate) unsafe fn freeze(f: Freezer<'a>, start: usize, n: usize) -> Self {
        assert!(n <= MAX_RUN, "a run of {n} pages exceeds the scratch area");
        f.range.publish(start, n);
        let mut run = FrozenRun {
            uffd: f.uffd,
            range: f.range,
            scratch: f.scratch,
            start,
            n,
            moved: [false; MAX_RUN],
            consumed: [false; MAX_RUN],
            restored: false,
        };
        run.move_out(f.pagemap);
        run
    }

    fn move_out(&mut self, pagemap: &sys::Pagemap) {
        let (start, n, scratch) = (self.start, self.n, self.scratch);
        let mut failed = false;
        let mut off = 0;
        while off < n {
            // SAFETY: the run is registered memory the engine froze (no reference to it exists in
            // the engine) and the scratch slots [off, n) are empty (`freeze`'s contract).
            let r = unsafe {
                self.uffd.move_pages(
                    scratch + off * PAGE,
                    start + off * PAGE,
                    (n - off) * PAGE,
                    UFFDIO_MOVE_MODE_DONTWAKE,
                )
            };
            match r {
                Ok(bytes) if bytes >= PAGE => {
                    let k = bytes / PAGE;
                    self.moved[off..off + k].fill(true);
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
            reconcile_moved(pagemap, start, scratch, &mut self.moved[..n]);
        }
    }

    /// The run's first address.
    pub(crate) fn start(&self) -> usize {
        self.start
    }

    /// Where page `k`'s frozen bytes are, if it moved: its scratch slot. Only the engine knows
    /// the scratch area, so nobody writes them while the run is frozen.
    pub(crate) fn frozen_page(&self, k: usize) -> Option<usize> {
        self.moved[k].then(|| self.scratch + k * PAGE)
    }

    /// Marks moved page `k` consumed: merged (its address maps a copy now) or released (its
    /// address stays empty). Its frozen bytes are discarded, not put back.
    pub(crate) fn consume(&mut self, k: usize) {
        debug_assert!(self.moved[k], "only a moved page can be consumed");
        self.consumed[k] = true;
    }

    /// Puts back every moved page that was not consumed, then discards the scratch area (the
    /// originals of merged and released pages). The run stays frozen, its writers blocked, until
    /// the guard is dropped. Done once; dropping the guard does it if the commit did not.
    pub(crate) fn restore(&mut self) {
        if self.restored {
            return;
        }
        self.restored = true;
        for k in (0..self.n).filter(|&k| self.moved[k] && !self.consumed[k]) {
            let addr = self.start + k * PAGE;
            // SAFETY: scratch slot k holds the page moved out of this frozen address, which is
            // still empty (the fault thread does not fill frozen pages).
            let r = unsafe {
                self.uffd.move_pages(
                    addr,
                    self.scratch + k * PAGE,
                    PAGE,
                    UFFDIO_MOVE_MODE_DONTWAKE,
                )
            };
            if let Err(e) = r {
                eprintln!("pageone: a frozen page could not be put back at {addr:#x}: {e}");
                tracing::error!(error = %e, addr, "a frozen page could not be put back");
            }
        }
        // SAFETY: the scratch area is the engine's; what remains in it is no longer needed.
        let _ =
            unsafe { sys::madvise(self.scratch as *mut u8, self.n * PAGE, libc::MADV_DONTNEED) };
    }
}

impl Drop for FrozenRun<'_> {
    fn drop(&mut self) {
        self.restore();
        self.range.clear();
        let _ = self.uffd.wake(self.start, self.n * PAGE);
    }
}

/// Sets `moved[k]` to whether page `k` of the run at `start` moved to scratch slot `k`: the slot
/// holds a page and the run's address none (see the failed-move note in `move_out`). If a scan
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
    /// their store mappings are registered with for write-protection. `None`, with nothing left
    /// protected, if some page is not in a write-protectable mapping.
    pub(crate) fn protect(uffd: &'a sys::Uffd, start: usize, n: usize) -> Option<Self> {
        assert!(n <= MAX_RUN, "a run of {n} pages exceeds the longest run");
        if uffd.writeprotect(start, n * PAGE, true).is_err() {
            let _ = uffd.writeprotect(start, n * PAGE, false);
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
        let _ = self.uffd.wake(self.start, self.n * PAGE);
    }
}
