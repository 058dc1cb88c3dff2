//! Pages of store mappings (merged pages, and pages written since their merge) that the program
//! dropped where no shim saw it (a raw `madvise(MADV_DONTNEED)`, the C library's own calls): the
//! kernel's result is zeros, but a private mapping of the store's file reads the file again
//! once its page table entry is gone.
//!
//! # How they read zeros
//!
//! Store mappings are registered for minor faults (`UFFDIO_REGISTER_MODE_MINOR`): a page whose
//! entry is gone while the file still has it is reported, not mapped by the kernel. The engine
//! maps their pages itself as it merges them (`UFFDIO_CONTINUE`), so a merged page faults only
//! once something took its entry away. The kernel reports a drop (`REMOVE`) before it takes the
//! entries, and the fault thread records it here, under the change log's lock, as it reads it;
//! so a minor fault at a dropped page always finds it recorded, and is answered with the zero
//! page. Every other minor fault maps the file's page (it was taken away by something that keeps
//! contents: reclaim, say).
//!
//! A range stays recorded until the program unmaps it (one it moves by `mremap` is followed, its
//! pages moving empty) or the engine maps something else there. Each period the engine maps the
//! zero page over the pages of ranges recorded since the last ([`fill`]), so that a first touch
//! does not wait for the fault thread; the kernel takes the entries only after the report is
//! read, so a page it had not dropped yet is left for the minor fault. A range recorded while
//! the engine was merging its pages stays over the copies mapped there (`Own::Merges`): dropped
//! during the merge, they read zeros too. A page is merged again only after periods that saw it
//! written or filled, and that mapping forgets the range.
//!
//! Recording allocates nothing until [`ROOM`] ranges wait in one period (the fault thread must
//! not allocate: see `changes::ROOM`).

use std::ops::Range;

use crate::access::PAGE;
use crate::changes::{Change, Own};

/// Ranges recorded without allocating.
pub(crate) const ROOM: usize = 1024;

/// A dropped range of store mappings: its number (new when recorded, extended or moved), and
/// whether the zero page was mapped over it since.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Waiting {
    seq: u64,
    pub(crate) range: Range<usize>,
    filled: bool,
}

/// Dropped ranges of store mappings, until the program unmaps them or the engine maps something
/// else there.
#[derive(Debug)]
pub(crate) struct Unfilled {
    entries: Vec<Waiting>,
    next_seq: u64,
}

impl Default for Unfilled {
    fn default() -> Self {
        Self {
            entries: Vec::with_capacity(ROOM),
            next_seq: 0,
        }
    }
}

impl Unfilled {
    /// Whether no range waits to be filled.
    pub(crate) fn nothing_to_fill(&self) -> bool {
        self.entries.iter().all(|e| e.filled)
    }

    /// A mark: ranges recorded (or extended, or moved) from now on are numbered from it on.
    pub(crate) fn mark(&self) -> u64 {
        self.next_seq + 1
    }

    /// Records that the program dropped `range` of store mappings (a `REMOVE` report of their
    /// context).
    pub(crate) fn dropped(&mut self, range: Range<usize>) {
        let seq = self.seq();
        if let Some(last) = self.entries.last_mut() {
            // A range dropped page by page is one entry.
            if last.range.end == range.start {
                last.range.end = range.end;
                (last.seq, last.filled) = (seq, false);
                return;
            }
        }
        self.entries.push(Waiting {
            seq,
            range,
            filled: false,
        });
    }

    /// Follows a change of the mappings: ranges unmapped (or mapped over) are forgotten, ranges
    /// moved move (and wait for a fill at their new addresses). `own`: the engine's own change,
    /// with what it does to them.
    pub(crate) fn follow(&mut self, c: &Change, own: Option<Own>) {
        if self.entries.is_empty() {
            return;
        }
        let upto = match own {
            Some(Own::Merges { since }) => since - 1,
            None | Some(Own::Replaces) => u64::MAX,
        };
        match *c {
            Change::Unmap { start, end } => self.cut(start..end, upto, |_| None),
            // (The engine's own moves are of copies staged aside, which nothing dropped: see
            // the `staging` module.)
            Change::Remap { from, to, len } => {
                self.cut(to..to + len, upto, |_| None);
                let seq = self.seq();
                self.cut(from..from + len, u64::MAX, |w| {
                    Some(Waiting {
                        seq,
                        range: w.range.start - from + to..w.range.end - from + to,
                        filled: false,
                    })
                });
            }
            Change::Remove { .. } => {}
        }
    }

    /// Whether the page at `addr` was dropped (it reads zeros where it has no page).
    pub(crate) fn holds(&self, addr: usize) -> bool {
        self.entries.iter().any(|e| e.range.contains(&addr))
    }

    /// The ranges not filled yet, copied into `into` as far as its capacity goes (allocated by
    /// the caller before the lock: this allocates nothing; the rest wait for the next fill).
    pub(crate) fn to_fill(&self, mut into: Vec<Waiting>) -> Vec<Waiting> {
        into.clear();
        let room = into.capacity();
        into.extend(
            self.entries
                .iter()
                .filter(|e| !e.filled)
                .take(room)
                .cloned(),
        );
        into
    }

    /// Records that the ranges of `done`, taken by [`to_fill`](Self::to_fill), were filled; ranges
    /// recorded, extended or moved since are not.
    pub(crate) fn filled(&mut self, done: &[Waiting]) {
        for e in &mut self.entries {
            e.filled |= done.iter().any(|d| {
                d.seq == e.seq && d.range.start <= e.range.start && e.range.end <= d.range.end
            });
        }
    }

    fn seq(&mut self) -> u64 {
        self.next_seq += 1;
        self.next_seq
    }

    /// Takes `cut` out of every range numbered up to `upto` (keeping the parts outside it in
    /// place), putting what `inside` makes of each part taken in its place. Allocates only past
    /// the room.
    fn cut(
        &mut self,
        cut: Range<usize>,
        upto: u64,
        mut inside: impl FnMut(Waiting) -> Option<Waiting>,
    ) {
        let mut i = 0;
        while i < self.entries.len() {
            let e = self.entries[i].clone();
            let (s, t) = (e.range.start.max(cut.start), e.range.end.min(cut.end));
            if s >= t || e.seq > upto {
                i += 1;
                continue;
            }
            self.entries.remove(i);
            let part =
                |range: Range<usize>| (!range.is_empty()).then(|| Waiting { range, ..e.clone() });
            let parts = [
                part(e.range.start..s),
                part(s..t).and_then(&mut inside),
                part(t..e.range.end),
            ];
            for p in parts.into_iter().flatten() {
                self.entries.insert(i, p);
                i += 1;
            }
        }
    }
}

/// Maps the zero page over every page of `range` whose entry is empty, through the store
/// mappings' context (pages present, and pages not in a store mapping, are skipped). Returns
/// false if the kernel asked to try again (`EAGAIN`: a change of the mappings waits to be read).
pub(crate) fn fill(uffd: &pageone_sys::Uffd, range: &Range<usize>) -> bool {
    let mut at = range.start;
    while at < range.end {
        match uffd.fill_zero_pages(at, range.end - at) {
            Ok(_) => break,
            Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => return false,
            Err(_) => at += PAGE,
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const P: usize = 4096;

    #[test]
    fn drops_page_by_page_are_one_range_and_unmaps_split_it() {
        let mut u = Unfilled::default();
        for i in 10..20 {
            u.dropped(i * P..(i + 1) * P);
        }
        assert_eq!(u.entries.len(), 1);
        u.follow(
            &Change::Unmap {
                start: 12 * P,
                end: 14 * P,
            },
            None,
        );
        assert!(u.holds(10 * P) && u.holds(11 * P) && u.holds(19 * P));
        assert!(!u.holds(12 * P) && !u.holds(13 * P));
        assert_eq!(u.entries.len(), 2);
    }

    #[test]
    fn a_fill_marks_only_what_it_took() {
        let mut u = Unfilled::default();
        u.dropped(P..2 * P);
        u.dropped(10 * P..11 * P);
        let done = u.to_fill(Vec::with_capacity(ROOM));
        u.dropped(5 * P..6 * P);
        u.follow(
            &Change::Remap {
                from: P,
                to: 100 * P,
                len: P,
            },
            None,
        );
        // Extended since it was taken: it waits again.
        u.dropped(6 * P..7 * P);
        u.filled(&done);
        // Moved after it was taken: filled at its old address, so it waits again.
        let left: Vec<_> = u
            .to_fill(Vec::with_capacity(ROOM))
            .into_iter()
            .map(|w| w.range)
            .collect();
        assert_eq!(left, [100 * P..101 * P, 5 * P..7 * P]);
        let done = u.to_fill(Vec::with_capacity(ROOM));
        u.filled(&done);
        assert!(u.nothing_to_fill());
        // Filled, they are still held.
        assert!(u.holds(100 * P) && u.holds(6 * P) && u.holds(10 * P) && !u.holds(P));
    }

    #[test]
    fn a_fill_takes_no_more_than_its_room() {
        let mut u = Unfilled::default();
        for i in 0..10 {
            u.dropped(2 * i * P..(2 * i + 1) * P);
        }
        let done = u.to_fill(Vec::with_capacity(4));
        let taken = done.len();
        assert_eq!(taken, done.capacity().min(10));
        u.filled(&done);
        assert_eq!(u.to_fill(Vec::with_capacity(ROOM)).len(), 10 - taken);
    }

    #[test]
    fn a_merge_forgets_the_ranges_before_its_mark_only() {
        let mut u = Unfilled::default();
        u.dropped(P..3 * P);
        let since = u.mark();
        u.dropped(10 * P..11 * P);
        let merge = Some(Own::Merges { since });
        u.follow(
            &Change::Unmap {
                start: 0,
                end: 20 * P,
            },
            merge,
        );
        assert!(!u.holds(P) && !u.holds(2 * P) && u.holds(10 * P));
        u.follow(
            &Change::Unmap {
                start: 0,
                end: 20 * P,
            },
            Some(Own::Replaces),
        );
        assert!(!u.holds(10 * P));
    }

    proptest! {
        /// Against a model of one flag per page: a page is held exactly when it was dropped and
        /// neither unmapped nor moved away since, following moves.
        #[test]
        fn ranges_follow_unmaps_and_moves(ops in proptest::collection::vec((0u8..3, 0usize..32, 1usize..8, 0usize..32), 1..40)) {
            let mut u = Unfilled::default();
            let mut model = [false; 40];
            for (op, a, n, to) in ops {
                let n = n.min(40 - a).min(40 - to);
                // (`mremap` never moves a range onto itself.)
                if n == 0 || (op == 2 && a < to + n && to < a + n) {
                    continue;
                }
                match op {
                    0 => {
                        u.dropped(a * P..(a + n) * P);
                        model[a..a + n].iter_mut().for_each(|m| *m = true);
                    }
                    1 => {
                        u.follow(&Change::Unmap { start: a * P, end: (a + n) * P }, None);
                        model[a..a + n].iter_mut().for_each(|m| *m = false);
                    }
                    _ => {
                        u.follow(&Change::Remap { from: a * P, to: to * P, len: n * P }, None);
                        let moved: Vec<bool> = model[a..a + n].to_vec();
                        model[a..a + n].iter_mut().for_each(|m| *m = false);
                        model[to..to + n].copy_from_slice(&moved);
                    }
                }
                for (i, &m) in model.iter().enumerate() {
                    prop_assert_eq!(u.holds(i * P), m, "page {}", i);
                }
            }
        }
    }
}
