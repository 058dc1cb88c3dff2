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
//! The engine keeps the ranges it locked that way ([`LockedRanges`], per region) and locks
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

/// Ranges of a region (byte offsets from its start, sorted, apart) where the engine mapped
/// something over locked pages and locked it: what it maps there later is locked too.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct LockedRanges(Vec<Range<usize>>);

impl LockedRanges {
    pub(crate) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Adds `r`, joining the ranges it touches.
    pub(crate) fn add(&mut self, r: Range<usize>) {
        if r.is_empty() {
            return;
        }
        let first = self.0.partition_point(|x| x.end < r.start);
        let last = self.0.partition_point(|x| x.start <= r.end);
        let joined = self.0[first..last]
            .iter()
            .fold(r, |a, x| a.start.min(x.start)..a.end.max(x.end));
        self.0.splice(first..last, [joined]);
    }

    /// Takes `r` out (the program unmapped or unlocked it).
    pub(crate) fn remove(&mut self, r: Range<usize>) {
        if r.is_empty() || self.0.is_empty() {
            return;
        }
        let first = self.0.partition_point(|x| x.end <= r.start);
        let last = self.0.partition_point(|x| x.start < r.end);
        let mut kept = Vec::new();
        for x in &self.0[first..last] {
            if x.start < r.start {
                kept.push(x.start..r.start);
            }
            if x.end > r.end {
                kept.push(r.end..x.end);
            }
        }
        self.0.splice(first..last, kept);
    }

    /// Splits at offset `at`: keeps the ranges below it, returns those above, as offsets from
    /// `at` (a region split there: see `layout::split_off`).
    pub(crate) fn split_off(&mut self, at: usize) -> LockedRanges {
        let i = self.0.partition_point(|x| x.end <= at);
        let mut right = self.0.split_off(i);
        if let Some(first) = right.first_mut().filter(|x| x.start < at) {
            self.0.push(first.start..at);
            first.start = at;
        }
        right.iter_mut().for_each(|x| *x = x.start - at..x.end - at);
        LockedRanges(right)
    }

    /// The parts of `r` that are locked, in order.
    pub(crate) fn within(&self, r: Range<usize>) -> impl Iterator<Item = Range<usize>> + '_ {
        let first = self.0.partition_point(|x| x.end <= r.start);
        self.0[first..]
            .iter()
            .take_while(move |x| x.start < r.end)
            .map(move |x| x.start.max(r.start)..x.end.min(r.end))
            .filter(|p| !p.is_empty())
    }
}

/// Locks the parts of `[addr, addr + len)` that `locked` holds (offsets from `base`), just
/// mapped by the engine: see the module documentation. A failure (a limit on locked memory)
/// leaves them unlocked, as the rest of the program's memory there may be.
pub(crate) fn relock(locked: &LockedRanges, base: usize, addr: usize, len: usize) {
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
pub(crate) fn forget_unlocked(locked: &mut LockedRanges, base: usize, addr: usize, len: usize) {
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
    use proptest::prelude::*;

    /// Whether the page at `addr` lies in a locked mapping.
    pub(crate) fn is_locked(addr: usize) -> bool {
        let locked = sys::self_locked_mappings().unwrap();
        locked.iter().any(|m| m.contains(&addr))
    }

    fn pages(v: &LockedRanges) -> Vec<bool> {
        let mut out = vec![false; 64];
        for r in &v.0 {
            out[r.clone()].iter_mut().for_each(|b| *b = true);
        }
        out
    }

    proptest! {
        /// Ranges added and removed at random hold exactly the pages a plain set would, sorted,
        /// apart and never empty.
        #[test]
        fn ranges_behave_as_a_set_of_pages(ops in proptest::collection::vec((any::<bool>(), 0usize..64, 0usize..64), 0..40)) {
            let mut v = LockedRanges::default();
            let mut model = vec![false; 64];
            for (add, a, b) in ops {
                let r = a.min(b)..a.max(b);
                if add {
                    v.add(r.clone());
                } else {
                    v.remove(r.clone());
                }
                model[r].iter_mut().for_each(|m| *m = add);
                prop_assert_eq!(pages(&v), model.clone());
                prop_assert!(v.0.windows(2).all(|w| w[0].end < w[1].start));
                prop_assert!(v.0.iter().all(|r| !r.is_empty()));
            }
        }

        /// A split keeps what lies below the offset and gives the rest, counted from it.
        #[test]
        fn a_split_divides_the_pages(adds in proptest::collection::vec((0usize..64, 0usize..64), 0..10), at in 0usize..64) {
            let mut v = LockedRanges::default();
            for (x, y) in adds {
                v.add(x.min(y)..x.max(y));
            }
            let all = pages(&v);
            let right = v.split_off(at);
            let (left, right) = (pages(&v), pages(&right));
            for i in 0..64 {
                prop_assert_eq!(left[i], all[i] && i < at);
                prop_assert_eq!(right[i], i + at < 64 && all[i + at]);
            }
        }

        /// `within` gives the locked parts of a range, clipped to it.
        #[test]
        fn within_clips_to_the_range(adds in proptest::collection::vec((0usize..64, 0usize..64), 0..10), a in 0usize..64, b in 0usize..64) {
            let mut v = LockedRanges::default();
            for (x, y) in adds {
                v.add(x.min(y)..x.max(y));
            }
            let r = a.min(b)..a.max(b);
            let mut got = vec![false; 64];
            for p in v.within(r.clone()) {
                prop_assert!(p.start >= r.start && p.end <= r.end && !p.is_empty());
                got[p].iter_mut().for_each(|g| *g = true);
            }
            let want: Vec<bool> = pages(&v).iter().enumerate().map(|(i, &l)| l && r.contains(&i)).collect();
            prop_assert_eq!(got, want);
        }
    }
}
