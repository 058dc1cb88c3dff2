//! Locked memory (`mlock`, `mlockall`): merged and released like the rest, and locked still.
//!
//! `UFFDIO_MOVE` moves pages only between mappings alike in locking, so a locked page cannot be
//! frozen into the scratch area, which is never locked (locked as it is made, after
//! `mlockall(MCL_FUTURE)`, it would be filled, and no page could move into it). Locked pages are
//! frozen into a second area instead, [`LockedScratch`], one run long, locked the first time a
//! page needs it, on fault only (`MLOCK_ONFAULT`: an empty place stays empty).
//!
//! The copies mapped over locked pages are locked in turn, on fault only too: a private mapping
//! of a file locked in full would be written to, one private copy per page (the kernel breaks
//! copy-on-write as it locks a writable private mapping), which would undo the merge. The
//! copies' pages are mapped already, so they are locked as they are; a page written later is
//! the program's own again, and locked as the kernel faults it in.
//!
//! The engine keeps the ranges it locked that way (a [`RangeSet`] per region) and locks
//! whatever it maps there later (merging a written page again, releasing one, giving the
//! memory back as anonymous memory), until the program unmaps or unlocks them.

use std::io;
use std::ops::Range;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Mutex;

use pageone_sync::lock;
use pageone_sys::{self as sys, uapi::MADV_DONTNEED_LOCKED};

use crate::access::PAGE;
use crate::changes::{Change, ChangeLog};
use crate::ranges::RangeSet;

/// Pages locked by `mlock2(MLOCK_ONFAULT)`: pages mapped now are locked as they are, the rest as
/// they fault in.
pub(crate) fn lock_on_fault(addr: usize, len: usize) -> io::Result<()> {
    lock_range(addr..addr + len, true)
}

/// Locks `range` (`mlock2`): on fault only (`MLOCK_ONFAULT`), or filled now.
pub(crate) fn lock_range(range: Range<usize>, on_fault: bool) -> io::Result<()> {
    let flags = if on_fault { libc::MLOCK_ONFAULT } else { 0 };
    // SAFETY: locking changes no contents and no mapping's extent; the range is page-aligned.
    let r = unsafe { libc::syscall(libc::SYS_mlock2, range.start, range.len(), flags) };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// The area frozen locked pages move into: a run long, registered like the scratch area,
/// unlocked and empty until a run needs it, then locked for good. Its slots are emptied after
/// every run that used them (see [`LockedScratch::discard`]).
#[derive(Debug)]
pub(crate) struct LockedScratch {
    base: usize,
    len: usize,
    /// `UNTRIED`, `LOCKED` or `REFUSED` (the kernel would not lock it: a limit on locked memory).
    /// Relaxed: only the committer reads and writes it.
    state: AtomicU8,
}

const UNTRIED: u8 = 0;
const LOCKED: u8 = 1;
const REFUSED: u8 = 2;

impl LockedScratch {
    /// Makes the area and registers it with `uffd` in `mode` (the scratch area's), not inherited
    /// by a child (`MADV_DONTFORK`, as the scratch area). `None` where it cannot be made, and
    /// where the process may lock only so much memory (`RLIMIT_MEMLOCK`, without
    /// `CAP_IPC_LOCK`): the area would take that from the program, whose own `mlock` could then
    /// fail. Locked pages are then refused (see the `refusals` module).
    pub(crate) fn new(uffd: &sys::Uffd, mode: u64, pages: usize) -> Option<Self> {
        if !sys::may_lock_without_limit() {
            return None;
        }
        let len = pages * PAGE;
        let base = sys::mmap_anonymous_unlocked(len).ok()? as usize;
        // SAFETY: MADV_DONTFORK changes no contents of the engine's own, empty area.
        let ready = uffd.register(base, len, mode).is_ok()
            && unsafe { sys::madvise(base as *mut u8, len, libc::MADV_DONTFORK) }.is_ok();
        if !ready {
            // SAFETY: the area is the engine's and nothing refers to it.
            let _ = unsafe { sys::munmap(base as *mut u8, len) };
            return None;
        }
        Some(LockedScratch {
            base,
            len,
            state: AtomicU8::new(UNTRIED),
        })
    }

    /// The area's first slot, locked (on the first call), or `None` if the kernel would not lock
    /// it. A system call at most, once: callable while a run is frozen.
    pub(crate) fn slots(&self) -> Option<usize> {
        match self.state.load(Ordering::Relaxed) {
            LOCKED => Some(self.base),
            REFUSED => None,
            _ => {
                let locked = lock_on_fault(self.base, self.len).is_ok();
                let state = if locked { LOCKED } else { REFUSED };
                self.state.store(state, Ordering::Relaxed);
                locked.then_some(self.base)
            }
        }
    }

    /// Where the area lies.
    pub(crate) fn range(&self) -> Range<usize> {
        self.base..self.base + self.len
    }

    /// Locks the area again if it was locked (after `munlockall`, which unlocks every mapping of
    /// the process); if that fails, it is not used again.
    pub(crate) fn lock_again(&self) {
        if self.state.load(Ordering::Relaxed) == LOCKED
            && lock_on_fault(self.base, self.len).is_err()
        {
            self.state.store(REFUSED, Ordering::Relaxed);
        }
    }

    /// The area's first slot if it is locked already.
    pub(crate) fn slots_if_locked(&self) -> Option<usize> {
        (self.state.load(Ordering::Relaxed) == LOCKED).then_some(self.base)
    }

    /// Empties the first `n` slots, which a run that has been woken left pages in (the originals
    /// of pages merged or released): announced in `changes`, as the engine's own change (the
    /// kernel reports it), and dropped as locked memory is (`MADV_DONTNEED_LOCKED`). If the
    /// kernel refuses, the area is not used again.
    pub(crate) fn discard(&self, changes: &Mutex<ChangeLog>, n: usize) {
        let discard = Change::Remove {
            start: self.base,
            end: self.base + n * PAGE,
        };
        lock(changes).expect(discard);
        // SAFETY: the area is the engine's and no run is frozen in it any more (the caller's
        // run was woken): what remains there is no longer needed.
        let done = unsafe { sys::madvise(self.base as *mut u8, n * PAGE, MADV_DONTNEED_LOCKED) };
        if done.is_err() {
            lock(changes).unexpect(discard);
            // Pages left in its slots would be taken for frozen pages of a later run that a
            // move left in place (see `freeze::reconcile_moved`): never used again.
            self.state.store(REFUSED, Ordering::Relaxed);
        }
    }
}

/// Locks the parts of `[addr, addr + len)` that `locked` holds (offsets from `base`), just
/// mapped by the engine: see the module documentation. A failure (a limit on locked memory)
/// leaves them unlocked, as the rest of the program's memory there may be.
pub(crate) fn relock(locked: &RangeSet, base: usize, addr: usize, len: usize) {
    if locked.is_empty() {
        return;
    }
    for r in locked.within(addr - base..addr - base + len) {
        let _ = lock_on_fault(base + r.start, r.len());
    }
}

/// Takes out of `locked` (offsets from `base`) the parts of `[addr, addr + len)` the program
/// unlocked where the engine did not see it (a raw `munlock`), so that what the engine maps
/// there next is not locked against the program's will. Called before the engine replaces the
/// mappings there, and only where it has locked parts in the range: the kernel refuses
/// `MADV_COLD` on locked memory, and on unlocked memory it only ages the pages, which the
/// engine is about to replace. (A part unlocked only in places stays: the kernel refuses the
/// call at the first locked mapping.)
pub(crate) fn forget_unlocked(locked: &mut RangeSet, base: usize, addr: usize, len: usize) {
    if locked.is_empty() {
        return;
    }
    let parts: Vec<Range<usize>> = locked.within(addr - base..addr - base + len).collect();
    for r in parts {
        // SAFETY: `MADV_COLD` changes no contents; the range is registered memory of the region.
        let unlocked =
            unsafe { sys::madvise((base + r.start) as *mut u8, r.len(), libc::MADV_COLD) }.is_ok();
        if unlocked {
            locked.remove(r);
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Whether the page at `addr` lies in a locked mapping.
    pub(crate) fn is_locked(addr: usize) -> bool {
        let locked = sys::self_locked_mappings().unwrap();
        locked.iter().any(|m| m.contains(&addr))
    }
}
