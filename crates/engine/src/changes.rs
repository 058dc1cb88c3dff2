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

use crate::spill::SpillBuffer;
use crate::unfilled::Unfilled;

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
/// its report to be read; an engine thread trimming the C heap). The room is made again by the
/// thread that takes the changes, before it takes the log's lock. Past it, changes go to a spill
/// buffer of [`SPILL`] more (memory of the log's own, see the `spill` module); only past both, in
/// one period, does recording allocate.
pub(crate) const ROOM: usize = 4096;
/// Changes a spill buffer holds (8 MiB of address space, memory only where written). The log has
/// two: one records while the other's changes are applied.
pub(crate) const SPILL: usize = 1 << 18;
/// Announcements of the engine's own changes the log holds room for: a committed run announces
/// a mapping per part of it at most (of `freeze::MAX_RUN` pages: checked there), besides a few
/// others.
pub(crate) const OWN_ROOM: usize = 1024;

/// What an announced change of the engine's own does to the dropped store ranges recorded over
/// it (see the `unfilled` module).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Own {
    /// It replaces what was there: they are forgotten.
    Replaces,
    /// It maps copies judged equal before mark `since`: ranges recorded before it are forgotten,
    /// the others were dropped while the merge went on and stay.
    Merges { since: u64 },
}

/// Changes taken from the log to be applied (see [`ChangeLog::take`]), oldest first.
pub(crate) struct Taken {
    /// The advice clock before the first of them was read (see `advice::clock`).
    pub(crate) since: u64,
    pending: Vec<Change>,
    /// To be given back to the log once applied ([`ChangeLog::give_back`]).
    pub(crate) spill: Option<SpillBuffer<Change>>,
    overflow: Vec<Change>,
}

impl Taken {
    pub(crate) fn iter(&self) -> impl Iterator<Item = Change> + '_ {
        let spilled = self.spill.as_ref().map_or(&[][..], |b| b.as_slice());
        self.pending
            .iter()
            .chain(spilled)
            .chain(self.overflow.iter())
            .copied()
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.iter().count()
    }
}

/// Changes recorded and not applied to the regions yet.
#[derive(Default, Debug)]
pub(crate) struct ChangeLog {
    /// The oldest changes, in the room the last taker made.
    pending: Vec<Change>,
    /// The next ones, past that room.
    spill: Option<SpillBuffer<Change>>,
    /// The other spill buffer, while it is not being applied.
    spare: Option<SpillBuffer<Change>>,
    /// The newest ones, past both (allocating).
    overflow: Vec<Change>,
    /// The engine's own changes announced and not reported yet, each with the dropped store
    /// ranges it makes stale (see [`Own`]).
    own: Vec<(Change, Own)>,
    /// Pages of store mappings the program dropped, to read zeros (see the `unfilled` module).
    pub(crate) unfilled: Unfilled,
    /// Moves of store mappings the program made (`mremap`), ever: the check of held copies
    /// reads the process's mappings, which such a move may tear (see the `held` module).
    store_moves: u64,
    /// The advice clock before the reports being read now were read, and before the first
    /// change recorded since the last take was (see `advice::clock`).
    reading_since: u64,
    since: Option<u64>,
}

impl ChangeLog {
    /// An empty log with room (see [`ROOM`]).
    pub(crate) fn with_room() -> Self {
        Self {
            pending: Vec::with_capacity(ROOM),
            spill: SpillBuffer::new(SPILL),
            spare: SpillBuffer::new(SPILL),
            overflow: Vec::new(),
            own: Vec::with_capacity(OWN_ROOM),
            unfilled: Unfilled::default(),
            store_moves: 0,
            reading_since: 0,
            since: None,
        }
    }

    /// The fault thread is about to read reports, with the advice clock at `clock`.
    pub(crate) fn reading(&mut self, clock: u64) {
        self.reading_since = clock;
    }

    /// Counts a move of store mappings the program made (see `store_moves`).
    pub(crate) fn note_store_move(&mut self) {
        self.store_moves += 1;
    }

    /// How many moves of store mappings the program made so far (see `store_moves`).
    pub(crate) fn store_moves(&self) -> u64 {
        self.store_moves
    }

    /// Whether no change waits to be taken.
    pub(crate) fn is_empty(&self) -> bool {
        self.pending.is_empty()
    }

    /// Records a change the kernel reported, unless it is one the engine announced (then that
    /// announcement is used up and returned). Allocates nothing until the room and a spill
    /// buffer are full.
    pub(crate) fn record(&mut self, c: Change) -> Option<Own> {
        if let Some(i) = self.own.iter().position(|&(o, _)| o == c) {
            return Some(self.own.swap_remove(i).1);
        }
        self.since.get_or_insert(self.reading_since);
        // (Changes stay in order: room, spill, overflow; each fills only once the one before is
        // full, and a take empties them all.)
        if self.pending.len() < self.pending.capacity() || self.pending.is_empty() {
            self.pending.push(c);
            return None;
        }
        let spilled = match &mut self.spill {
            Some(b) if self.overflow.is_empty() => b.push(c),
            _ => Err(c),
        };
        if let Err(c) = spilled {
            self.overflow.push(c);
        }
        None
    }

    /// Announces a change the engine is about to make itself (see the module documentation).
    /// Never call it for an operation that may fail before reaching the kernel's report, or
    /// withdraw it with [`unexpect`](Self::unexpect) then.
    pub(crate) fn expect(&mut self, c: Change) {
        self.own.push((c, Own::Replaces));
    }

    /// Announces a mapping of copies over pages the engine judged equal to them, while the dropped
    /// store ranges recorded from mark `since` on ([`Unfilled::mark`]) were dropped during the
    /// merge and must stay (see the `unfilled` module).
    pub(crate) fn expect_merge(&mut self, c: Change, since: u64) {
        self.own.push((c, Own::Merges { since }));
    }

    /// Withdraws an announcement whose change did not happen.
    pub(crate) fn unexpect(&mut self, c: Change) {
        if let Some(i) = self.own.iter().position(|&(o, _)| o == c) {
            self.own.swap_remove(i);
        }
    }

    /// Takes the changes recorded so far, oldest first, to apply them; `room` (empty, allocated
    /// before the log's lock was taken) records the next ones. Allocates nothing: the spill
    /// buffer goes with the changes, the spare one records, and [`give_back`](Self::give_back)
    /// makes the first the spare again once applied.
    pub(crate) fn take(&mut self, room: Vec<Change>) -> Taken {
        let spill = match &self.spill {
            Some(b) if !b.is_empty() => std::mem::replace(&mut self.spill, self.spare.take()),
            _ => None,
        };
        Taken {
            since: self.since.take().unwrap_or(self.reading_since),
            pending: std::mem::replace(&mut self.pending, room),
            spill,
            overflow: std::mem::take(&mut self.overflow),
        }
    }

    /// The spill buffer of applied changes (see [`take`](Self::take)), to record again: emptied
    /// here if the caller did not (best before taking the log's lock).
    pub(crate) fn give_back(&mut self, mut spill: SpillBuffer<Change>) {
        spill.clear();
        if self.spill.is_none() {
            self.spill = Some(spill);
        } else {
            self.spare = Some(spill);
        }
    }

    /// Every change recorded, oldest first.
    fn all(&self) -> impl DoubleEndedIterator<Item = &Change> {
        let spilled = self.spill.as_ref().map_or(&[][..], |b| b.as_slice());
        self.pending
            .iter()
            .chain(spilled)
            .chain(self.overflow.iter())
    }

    /// How many changes are recorded: a mark for [`fate_since`](Self::fate_since).
    pub(crate) fn mark(&self) -> usize {
        self.pending.len()
            + self.spill.as_ref().map_or(0, |b| b.as_slice().len())
            + self.overflow.len()
    }

    /// Whether a recorded change touched any page of `range` (or moved pages into it).
    pub(crate) fn touches(&self, range: Range<usize>) -> bool {
        let meets = |r: Range<usize>| r.start < range.end && range.start < r.end;
        self.all().any(|c| match *c {
            Change::Remap { to, len, .. } => meets(c.range()) || meets(to..to + len),
            _ => meets(c.range()),
        })
    }

    /// What the changes recorded after `mark` did to the page that was at `addr`, following it
    /// through moves.
    pub(crate) fn fate_since(&self, addr: usize, mark: usize) -> Fate {
        let mut at = addr;
        let mut zeroed = false;
        for c in self.all().skip(mark) {
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
        for c in self.all().rev().take(self.mark().saturating_sub(mark)) {
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
    fn changes_past_the_room_spill_in_order_and_are_all_taken() {
        let mut log = ChangeLog::with_room();
        let n = ROOM + 100;
        let change = |i: usize| Change::Remove {
            start: i * P,
            end: (i + 1) * P,
        };
        for i in 0..n {
            log.record(change(i));
        }
        assert_eq!(log.mark(), n);
        // A page dropped past the room is found, and moves after it are followed.
        assert_eq!(
            log.fate_since((ROOM + 50) * P, 0),
            Fate::Zeroed((ROOM + 50) * P)
        );
        log.record(Change::Remap {
            from: (ROOM + 99) * P,
            to: 1 << 40,
            len: P,
        });
        assert_eq!(log.origin_since(1 << 40, ROOM), (ROOM + 99) * P);
        let taken = log.take(Vec::with_capacity(ROOM));
        assert_eq!(taken.len(), n + 1);
        assert!(taken.iter().take(n).eq((0..n).map(change)));
        assert!(log.is_empty() && log.mark() == 0);
        // Recorded while the first spill buffer is out: the spare one takes the next changes.
        for i in 0..n {
            log.record(change(i));
        }
        log.give_back(taken.spill.expect("spilled"));
        let again = log.take(Vec::with_capacity(ROOM));
        assert!(again.iter().eq((0..n).map(change)));
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
