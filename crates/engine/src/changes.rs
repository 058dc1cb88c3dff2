//! Changes the program made to registered memory behind the engine's back, as the kernel reports
//! them (userfaultfd's `UNMAP`, `REMAP` and `REMOVE` events): `munmap`, `mmap(MAP_FIXED)` over it
//! or `mremap` (also the ones `free()` and `realloc()` make inside the C library, where no shim
//! sees them), and `MADV_DONTNEED`/`MADV_REMOVE`.
//!
//! # Why a page of a new mapping is never frozen
//!
//! From the moment the kernel prepares such a change until the event is *read*, it refuses every
//! move, copy and write-protection of the context with `EAGAIN` (`mmap_changing`). The fault
//! thread reads events only while holding the [`ChangeLog`]'s lock, and records them before
//! releasing it; the committer holds the same lock while it checks a run against the recorded
//! changes and moves its pages out. So when a move succeeds, every unmapping before it has been
//! recorded, and a run overlapping one is not frozen: the page moved is the registered one the
//! run was planned for, never a page of a mapping made at the same address since.
//!
//! The engine's own remaps of registered memory (copies mapped over merged pages, the scratch
//! area discarded) are reported too: it announces each before making it ([`ChangeLog::expect`]),
//! and the fault thread drops the event it matches instead of recording it. Nothing waits for an
//! event while holding the log's lock (the kernel holds the caller until the event is read).
//!
//! Changes made while a run is frozen are applied to it before its pages go back (see
//! `FrozenRun::restore`): a page unmapped is dropped with its mapping, a page dropped by
//! `MADV_DONTNEED` stays empty (it reads zeros, as the program asked), a page moved by `mremap`
//! goes back at its new address. The engine thread applies the recorded changes to its regions
//! at the start of each period, and registration calls before they look at the regions.

use std::ops::Range;

use pageone_sys::uapi::UffdEvent;

/// One change the kernel reported.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Change {
    /// Unmapped (its pages are gone with the mapping).
    Unmap { start: usize, end: usize },
    /// Pages dropped (`MADV_DONTNEED`/`MADV_REMOVE`): the anonymous ones read zeros again.
    Remove { start: usize, end: usize },
    /// Moved to `to` with its pages and its registration.
    Remap { from: usize, to: usize, len: usize },
}

impl Change {
    /// The change an event reports, if it is one.
    pub(crate) fn of(event: UffdEvent) -> Option<Self> {
        Some(match event {
            UffdEvent::Unmap { start, end } => Change::Unmap {
                start: start as usize,
                end: end as usize,
            },
            UffdEvent::Remove { start, end } => Change::Remove {
                start: start as usize,
                end: end as usize,
            },
            UffdEvent::Remap { from, to, len } => Change::Remap {
                from: from as usize,
                to: to as usize,
                len: len as usize,
            },
            _ => return None,
        })
    }

    /// The addresses whose pages it changed.
    pub(crate) fn range(&self) -> Range<usize> {
        match *self {
            Change::Unmap { start, end } | Change::Remove { start, end } => start..end,
            Change::Remap { from, len, .. } => from..from + len,
        }
    }
}

/// What the recorded changes did to the page that was at an address.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Fate {
    /// Nothing: it is where it was.
    Kept,
    /// It is at this address now.
    Moved(usize),
    /// Dropped by `MADV_DONTNEED` (at the address given, after any move): it must read zeros.
    Zeroed(usize),
    /// Unmapped.
    Gone,
}

/// Changes the log holds room for, so that the fault thread records them without allocating:
/// an allocation can wait for a thread that waits for the fault thread (a `fork` holding the
/// allocator's locks while another thread's `free` gives registered memory back and waits for
/// its report to be read). The room is made again by the thread that takes the changes, before
/// it takes the log's lock; only past this many changes in one period does recording allocate.
pub(crate) const ROOM: usize = 4096;
/// Announcements of the engine's own changes the log holds room for: a committed run announces
/// a mapping per part of it at most (of `freeze::MAX_RUN` pages: checked there), besides a few
/// others.
pub(crate) const OWN_ROOM: usize = 1024;

/// Changes recorded and not applied to the regions yet.
#[derive(Default, Debug)]
pub(crate) struct ChangeLog {
    pending: Vec<Change>,
    /// The engine's own changes announced and not reported yet.
    own: Vec<Change>,
}

impl ChangeLog {
    /// An empty log with room (see [`ROOM`]).
    pub(crate) fn with_room() -> Self {
        Self {
            pending: Vec::with_capacity(ROOM),
            own: Vec::with_capacity(OWN_ROOM),
        }
    }

    /// Whether no change waits to be taken.
    pub(crate) fn is_empty(&self) -> bool {
        self.pending.is_empty()
    }

    /// Records a change the kernel reported, unless it is one the engine announced (then that
    /// announcement is used up).
    pub(crate) fn record(&mut self, c: Change) {
        if let Some(i) = self.own.iter().position(|&o| o == c) {
            self.own.swap_remove(i);
            return;
        }
        self.pending.push(c);
    }

    /// Announces a change the engine is about to make itself (see the module documentation).
    /// Never call it for an operation that may fail before reaching the kernel's report, or
    /// withdraw it with [`unexpect`](Self::unexpect) then.
    pub(crate) fn expect(&mut self, c: Change) {
        self.own.push(c);
    }

    /// Withdraws an announcement whose change did not happen.
    pub(crate) fn unexpect(&mut self, c: Change) {
        if let Some(i) = self.own.iter().position(|&o| o == c) {
            self.own.swap_remove(i);
        }
    }

    /// Takes the changes recorded so far, oldest first, to apply them; `room` (empty, allocated
    /// before the log's lock was taken) records the next ones.
    pub(crate) fn take(&mut self, room: Vec<Change>) -> Vec<Change> {
        std::mem::replace(&mut self.pending, room)
    }

    /// How many changes are recorded: a mark for [`fate_since`](Self::fate_since).
    pub(crate) fn mark(&self) -> usize {
        self.pending.len()
    }

    /// Whether a recorded change touched any page of `range` (or moved pages into it).
    pub(crate) fn touches(&self, range: Range<usize>) -> bool {
        let meets = |r: Range<usize>| r.start < range.end && range.start < r.end;
        self.pending.iter().any(|c| match *c {
            Change::Remap { to, len, .. } => meets(c.range()) || meets(to..to + len),
            _ => meets(c.range()),
        })
    }

    /// What the changes recorded after `mark` did to the page that was at `addr`, following it
    /// through moves.
    pub(crate) fn fate_since(&self, addr: usize, mark: usize) -> Fate {
        let mut at = addr;
        let mut zeroed = false;
        for c in self.pending.iter().skip(mark) {
            if !c.range().contains(&at) {
                continue;
            }
            match *c {
                Change::Unmap { .. } => return Fate::Gone,
                Change::Remove { .. } => zeroed = true,
                Change::Remap { from, to, .. } => at = at - from + to,
            }
        }
        match (zeroed, at == addr) {
            (true, _) => Fate::Zeroed(at),
            (false, true) => Fate::Kept,
            (false, false) => Fate::Moved(at),
        }
    }

    /// Where the page now at `addr` was before the changes recorded after `mark` moved it.
    pub(crate) fn origin_since(&self, addr: usize, mark: usize) -> usize {
        let mut at = addr;
        for c in self.pending.iter().skip(mark).rev() {
            if let Change::Remap { from, to, len } = *c {
                if (to..to + len).contains(&at) {
                    at = at - to + from;
                }
            }
        }
        at
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const P: usize = 4096;

    #[test]
    fn a_page_is_followed_through_moves_drops_and_unmaps() {
        let mut log = ChangeLog::default();
        log.record(Change::Remap {
            from: 10 * P,
            to: 100 * P,
            len: 4 * P,
        });
        log.record(Change::Remove {
            start: 101 * P,
            end: 102 * P,
        });
        log.record(Change::Unmap {
            start: 103 * P,
            end: 104 * P,
        });
        log.record(Change::Unmap {
            start: 20 * P,
            end: 21 * P,
        });
        assert_eq!(log.fate_since(10 * P, 0), Fate::Moved(100 * P));
        assert_eq!(log.fate_since(11 * P, 0), Fate::Zeroed(101 * P));
        assert_eq!(log.fate_since(13 * P, 0), Fate::Gone);
        assert_eq!(log.fate_since(14 * P, 0), Fate::Kept);
        assert_eq!(log.fate_since(20 * P, 0), Fate::Gone);
        assert!(log.touches(12 * P..15 * P) && !log.touches(14 * P..20 * P));
        assert!(
            log.touches(99 * P..100 * P + 1),
            "pages moved into a range touch it"
        );
        assert_eq!(log.origin_since(102 * P, 0), 12 * P);
        assert_eq!(log.origin_since(102 * P, 1), 102 * P);
        // A page moved onto an address a later change unmaps is gone; one moved before a change
        // at its old address is not touched by it.
        assert_eq!(log.take(Vec::new()).len(), 4);
        assert_eq!(log.mark(), 0);
    }

    #[test]
    fn events_become_changes() {
        let e = UffdEvent::Remap {
            from: 1,
            to: 2,
            len: 3,
        };
        assert_eq!(
            Change::of(e),
            Some(Change::Remap {
                from: 1,
                to: 2,
                len: 3
            })
        );
        assert_eq!(Change::of(UffdEvent::Other(0x13)), None);
    }

    proptest! {
        /// With only unmaps and drops, a page's fate is decided by whether any change covers it.
        #[test]
        fn without_moves_a_page_is_kept_unless_a_change_covers_it(
            changes in proptest::collection::vec((0usize..64, 1usize..8, any::<bool>()), 0..12),
            page in 0usize..72,
        ) {
            let mut log = ChangeLog::default();
            let (mut gone, mut zeroed) = (false, false);
            for (s, n, unmap) in changes {
                let (start, end) = (s * P, (s + n) * P);
                log.record(if unmap { Change::Unmap { start, end } } else { Change::Remove { start, end } });
                if (start..end).contains(&(page * P)) {
                    if unmap { gone = true } else { zeroed = true }
                }
            }
            let want = if gone { Fate::Gone } else if zeroed { Fate::Zeroed(page * P) } else { Fate::Kept };
            prop_assert_eq!(log.fate_since(page * P, 0), want);
        }
    }
}
