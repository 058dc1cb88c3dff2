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
}

impl Default for Held {
    fn default() -> Self {
        Self {
            ids: Vec::new(),
            next_check: Instant::now(),
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
    /// not overlapping, read after the snapshot) contains; the rest stay held until the next
    /// check, due a while after `now`.
    pub(crate) fn clear(
        &mut self,
        covered: &[Range<KeyId>],
        checked: usize,
        now: Instant,
    ) -> Vec<KeyId> {
        self.next_check = now + CHECK_EVERY;
        let later = self.ids.split_off(checked.min(self.ids.len()));
        let (mut kept, cleared): (Vec<KeyId>, Vec<KeyId>) =
            self.ids.iter().partition(|&&id| is_covered(covered, id));
        kept.extend(later);
        kept.sort_unstable();
        kept.dedup();
        // A copy held twice (once before the snapshot, once after) stays held for the later one.
        let mut cleared: Vec<KeyId> = cleared
            .into_iter()
            .filter(|id| kept.binary_search(id).is_err())
            .collect();
        cleared.sort_unstable();
        cleared.dedup();
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

    proptest! {
        /// A copy held when the mappings were read is cleared exactly when no mapping covers
        /// it, whatever the order of the mappings and however they overlap; held twice, it is
        /// cleared once. A copy held after the read began is never cleared by it (a mapping
        /// over it may be newer than the read), also when it was held before as well.
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
            let cleared = h.clear(&covered, checked, now);
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
