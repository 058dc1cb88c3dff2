//! Copies held back from reuse while a mapping of the store may still cover them.
//!
//! A page merged onto a copy keeps its place in the store's mapping after the program writes it
//! (the kernel gives it a private copy there), and so may a page whose merge the engine undid
//! in its books only. Dropped (`MADV_DONTNEED`, which the program may issue where the engine
//! cannot see it first, inside the C library or with a raw system call), such a page reads the
//! store file at its copy's offset again. So a copy that no page counts any more is reused (by
//! this engine, or by the daemon once released) only after the process's mappings show that no
//! private mapping of the store covers it; until then a dropped page over it reads what the copy
//! held, never another page's bytes. A store of the engine's own punches it at once: it reads
//! zeros, as a dropped page of anonymous memory does. A daemon's slot is vacated (the daemon
//! empties it once no process needs its bytes: zeros too, and its memory back).
//!
//! The mappings are read a part at a time, and a store mapping the program moves meanwhile
//! (`mremap`: glibc's `realloc` of a large block makes such calls where the shim cannot see
//! them) may be read at neither place. So a copy is given back only once two checks in a row
//! found it uncovered, with no such move reported from the start of the first read to the end of
//! the second: a move tearing the first read is reported before the second ends (the kernel
//! holds the mover until the fault thread has read its report, and the checks are a second
//! apart), and one tearing the second read, while the first found the copy uncovered, would
//! have had to move a mapping the first read did not show.

use std::ops::Range;
use std::time::{Duration, Instant};

use pageone_index::KeyId;
use pageone_sys as sys;

/// How often the mappings are read while copies are held: each read costs what the process's
/// mappings hold (about 0.5 ms per thousand), so it is rare, and held copies wait that long.
const CHECK_EVERY: Duration = Duration::from_secs(1);

/// Copies freed here and held back from reuse until no mapping covers them.
#[derive(Debug)]
pub(crate) struct Held {
    ids: Vec<KeyId>,
    next_check: Instant,
    /// The copies the last check found uncovered (sorted), and the program's moves of store
    /// mappings counted when that check's read began (see the module's comment).
    uncovered: Vec<KeyId>,
    uncovered_since: Option<u64>,
}

impl Default for Held {
    fn default() -> Self {
        Self {
            ids: Vec::new(),
            next_check: Instant::now(),
            uncovered: Vec::new(),
            uncovered_since: None,
        }
    }
}

impl Held {
    pub(crate) fn hold(&mut self, id: KeyId) {
        self.ids.push(id);
    }

    pub(crate) fn len(&self) -> usize {
        self.ids.len()
    }

    /// Whether copies are held and the mappings are due to be read again.
    pub(crate) fn due(&self, now: Instant) -> bool {
        !self.ids.is_empty() && now >= self.next_check
    }

    /// How many copies are held now: the mappings read next decide for these (`clear`'s
    /// `checked`), not for copies held after the read began, whose mappings it may have missed.
    /// Copies are only added until `clear`, so these are the first ones.
    pub(crate) fn snapshot(&self) -> usize {
        self.ids.len()
    }

    /// Takes out the copies held at the `checked` snapshot that no range of `covered` (sorted,
    /// not overlapping, read after the snapshot) contains and the check before found uncovered
    /// too, with no move of the program's counted from that check's read to the end of this one
    /// (`moves`: the count before and after this read; see the module's comment). The rest stay
    /// held until the next check, due a while after `now`.
    pub(crate) fn clear(
        &mut self,
        covered: &[Range<KeyId>],
        checked: usize,
        now: Instant,
        moves: Range<u64>,
    ) -> Vec<KeyId> {
        self.next_check = now + CHECK_EVERY;
        let later = self.ids.split_off(checked.min(self.ids.len()));
        let (mut kept, uncovered): (Vec<KeyId>, Vec<KeyId>) =
            self.ids.iter().partition(|&&id| is_covered(covered, id));
        kept.extend(later);
        kept.sort_unstable();
        kept.dedup();
        // A copy held twice (once before the snapshot, once after) stays held for the later one.
        let mut uncovered: Vec<KeyId> = uncovered
            .into_iter()
            .filter(|id| kept.binary_search(id).is_err())
            .collect();
        uncovered.sort_unstable();
        uncovered.dedup();
        let confirmed = self.uncovered_since == Some(moves.end) && moves.start == moves.end;
        let (cleared, waiting): (Vec<KeyId>, Vec<KeyId>) = uncovered
            .into_iter()
            .partition(|id| confirmed && self.uncovered.binary_search(id).is_ok());
        // Found uncovered by this read: given back at the next check, if it finds them so too.
        kept.extend(&waiting);
        kept.sort_unstable();
        self.uncovered = waiting;
        self.uncovered_since = (moves.start == moves.end).then_some(moves.start);
        self.ids = kept;
        cleared
    }

    /// Puts off the next check (the mappings could not be read).
    pub(crate) fn put_off(&mut self, now: Instant) {
        self.next_check = now + CHECK_EVERY;
    }
}

fn is_covered(covered: &[Range<KeyId>], id: KeyId) -> bool {
    let i = covered.partition_point(|r| r.end <= id);
    covered.get(i).is_some_and(|r| r.start <= id)
}

/// The copies of the store file `inode` that its private mappings in `maps` cover (a page
/// mapping a copy, or a private copy of one in its place), as sorted ranges of ids that do not
/// overlap. Shared mappings (the engine's own view of the store) read copies, they do not stand
/// in for pages.
pub(crate) fn covered_copies(maps: &[sys::Mapping], inode: u64) -> Vec<Range<KeyId>> {
    let page = sys::PAGE_SIZE as u64;
    let mut ranges: Vec<Range<KeyId>> = maps
        .iter()
        .filter(|m| m.inode == inode && m.perms.ends_with('p'))
        .map(|m| {
            let first = m.offset / page;
            let last = first + (m.end - m.start) as u64 / page;
            let id = |x: u64| x.min(KeyId::MAX as u64) as KeyId;
            id(first)..id(last)
        })
        .collect();
    ranges.sort_unstable_by_key(|r| r.start);
    let mut out: Vec<Range<KeyId>> = Vec::with_capacity(ranges.len());
    for r in ranges {
        match out.last_mut() {
            Some(last) if r.start <= last.end => last.end = last.end.max(r.end),
            _ => out.push(r),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn mapping(
        start: usize,
        pages: usize,
        offset_pages: u64,
        perms: &str,
        inode: u64,
    ) -> sys::Mapping {
        sys::Mapping {
            start,
            end: start + pages * sys::PAGE_SIZE,
            perms: perms.into(),
            offset: offset_pages * sys::PAGE_SIZE as u64,
            inode,
            path: "/memfd:pageone-stable (deleted)".into(),
        }
    }

    #[test]
    fn only_private_mappings_of_the_store_cover_copies() {
        let maps = [
            mapping(0x10000, 3, 10, "rw-p", 7),
            mapping(0x20000, 1, 12, "r--p", 7),
            mapping(0x30000, 2, 20, "---p", 7),
            // The engine's own view, another file, an anonymous mapping.
            mapping(0x40000, 1000, 0, "r--s", 7),
            mapping(0x50000, 5, 30, "rw-p", 8),
            mapping(0x60000, 5, 40, "rw-p", 0),
        ];
        assert_eq!(covered_copies(&maps, 7), vec![10..13, 20..22]);
    }

    /// A copy found uncovered is given back at the next check that finds it uncovered too, and
    /// only if the program moved no store mapping from the first read to the end of the second.
    #[test]
    fn a_copy_is_given_back_after_two_checks_with_no_move_between() {
        let ms = [mapping(0x10000, 2, 10, "rw-p", 1)];
        let covered = covered_copies(&ms, 1);
        let now = Instant::now();
        let mut h = Held::default();
        h.hold(3);
        h.hold(11);
        assert!(
            h.clear(&covered, 2, now, 0..0).is_empty(),
            "one check decides nothing"
        );
        // A move reported during the next read, or between the two: nothing is given back,
        // and the count starts again.
        assert!(h.clear(&covered, 2, now, 0..1).is_empty());
        assert!(h.clear(&covered, 2, now, 1..1).is_empty());
        assert!(h.clear(&covered, 2, now, 2..2).is_empty());
        assert_eq!(h.clear(&covered, 2, now, 2..2), vec![3]);
        assert_eq!(h.ids, vec![11]);
        // Covered at the second check: held on.
        h.hold(20);
        assert!(h.clear(&covered, 2, now, 2..2).is_empty());
        let later = covered_copies(&[mapping(0x10000, 1, 20, "rw-p", 1)], 1);
        assert!(h.clear(&later, 2, now, 2..2).is_empty());
        assert_eq!(h.ids, vec![11, 20]);
    }

    proptest! {
        /// A copy held when the mappings were read is cleared exactly when no mapping covers
        /// it (at this check and the one before, with no move between), whatever the order of
        /// the mappings and however they overlap; held twice, it is cleared once. A copy held
        /// after the read began is never cleared by it (a mapping over it may be newer than the
        /// read), also when it was held before as well.
        #[test]
        fn a_copy_is_cleared_exactly_when_no_mapping_covers_it(
            maps in prop::collection::vec((0u64..200, 1usize..20), 0..30),
            held in prop::collection::vec(0u32..240, 0..60),
            later in prop::collection::vec(0u32..240, 0..20),
        ) {
            let ms: Vec<_> = maps
                .iter()
                .enumerate()
                .map(|(i, &(off, n))| mapping(i << 24, n, off, "rw-p", 1))
                .collect();
            let mut h = Held::default();
            for &id in &held {
                h.hold(id);
            }
            let checked = h.snapshot();
            let covered = covered_copies(&ms, 1);
            for &id in &later {
                h.hold(id);
            }
            let now = Instant::now();
            // The same mappings read by a check before (which decides nothing).
            let mut first = Held { ids: h.ids[..checked].to_vec(), ..Held::default() };
            prop_assert!(first.clear(&covered, checked, now, 0..0).is_empty());
            h.uncovered = first.uncovered;
            h.uncovered_since = first.uncovered_since;
            let cleared = h.clear(&covered, checked, now, 0..0);
            let covers = |id: u32| maps.iter().any(|&(off, n)| off <= id as u64 && (id as u64) < off + n as u64);
            let mut want: Vec<u32> = held
                .iter()
                .copied()
                .filter(|&id| !covers(id) && !later.contains(&id))
                .collect();
            want.sort_unstable();
            want.dedup();
            prop_assert_eq!(&cleared, &want);
            prop_assert!(h.ids.iter().all(|&id| covers(id) || later.contains(&id)));
            prop_assert!(later.iter().all(|id| h.ids.contains(id)));
            prop_assert!(!h.due(now));
        }
    }
}
