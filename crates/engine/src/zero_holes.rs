//! Zero holes: zero pages kept inside runs of merged pages.
//!
//! A zero page is released by mapping the kernel's shared zero page over it, in an anonymous
//! mapping. Between two merged pages whose copies follow each other in the store, that splits
//! one mapping of the store into three (copies, anonymous memory, copies): with one page in
//! eight all zero, the VMA limit stopped merging at 43% of what could be saved. So when new
//! copies are made for pages on both sides of a short stretch of zero pages, that stretch gets
//! ids of its own between theirs. Those ids are never written: the store's file has holes
//! there, which read as zeros and take no memory. The zero pages are then merged like the
//! others (verified all zero while frozen), one mapping of the store covers the run, and the
//! kernel's zero page is mapped over the holes at once (`UFFDIO_ZEROPAGE` through the store
//! mappings' userfaultfd), so that reading them does not allocate a page in the store's file.
//! Holes are never indexed and never read through the store's view.
//!
//! Zero pages released before the pages around them merge (their duplicates came later: always
//! the case across processes, whose copies are made when a second process shows up) are empty
//! addresses by then, or map the kernel's zero page. They join the batch as zero gaps between
//! its other candidates (see `classify`), and merge onto holes only: frozen, an empty address
//! stays empty (a touch waits) and reads zeros, so it needs no verification beyond being empty.
//!
//! With a daemon, the zero pages go with the copies asked for, and the daemon makes each a hole
//! of its own between them (a page all zero that a client sends is punched, never indexed, held
//! for that client); a process whose pages merge onto copies another process made asks the
//! daemon to hold the holes between them for it too (`between_merges`). A hole the daemon names
//! is read (`pread`, which gives a hole of the file no page) and used only if it reads zeros.

use std::collections::HashMap;

use pageone_index::KeyId;

use crate::access::PAGE;

/// The longest stretch of zero pages given holes between two new copies: a longer one is
/// released as before (a mapping split costs the same whatever its length, and holes take ids).
pub(crate) const MAX_HOLE_GAP: usize = 64;

/// One id to give out, in order: a new copy of `leaders[j]`, or a zero hole for a candidate.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Slot {
    Copy(usize),
    Hole(u32),
}

/// The ids to give out for new copies of the pages at `leaders` (addresses, in the order their
/// ids are given out), with a zero hole for each page of a stretch of at most `MAX_HOLE_GAP`
/// zero pages between two consecutive leaders at neighbouring addresses; `zero_at` maps the
/// addresses of zero pages that may get a hole to their candidate numbers.
pub(crate) fn lay_out(leaders: &[usize], zero_at: &HashMap<usize, u32>) -> Vec<Slot> {
    let mut slots = Vec::with_capacity(leaders.len());
    for (j, &a) in leaders.iter().enumerate() {
        slots.push(Slot::Copy(j));
        let Some(&b) = leaders.get(j + 1) else {
            break;
        };
        if zero_at.is_empty() || b <= a + PAGE || b - a > (MAX_HOLE_GAP + 1) * PAGE {
            continue;
        }
        let gap = (a + PAGE..b).step_by(PAGE);
        if gap.clone().all(|z| zero_at.contains_key(&z)) {
            slots.extend(gap.map(|z| Slot::Hole(zero_at[&z])));
        }
    }
    slots
}

/// The zero holes that would keep runs of merged pages whole where their copies exist already
/// (made by another process of a daemon's scope): for each stretch of at most `MAX_HOLE_GAP`
/// zero pages of `zero_at` (address to candidate) between two pages of `merged` (address to
/// the copy it merges onto) at neighbouring addresses whose copies `b` and `b + z + 1` leave
/// room for exactly the `z` zero pages between them: `(candidate, b + d)` for the `d`th.
pub(crate) fn between_merges(
    merged: &HashMap<usize, KeyId>,
    zero_at: &HashMap<usize, u32>,
) -> Vec<(u32, KeyId)> {
    let mut out = Vec::new();
    if zero_at.is_empty() {
        return out;
    }
    for (&a, &b) in merged {
        let z = (1..=MAX_HOLE_GAP)
            .take_while(|d| zero_at.contains_key(&(a + d * PAGE)))
            .count();
        let after = merged.get(&(a + (z + 1) * PAGE));
        if z == 0 || after != Some(&b.wrapping_add(z as KeyId + 1)) {
            continue;
        }
        for d in 1..=z {
            out.push((zero_at[&(a + d * PAGE)], b.wrapping_add(d as KeyId)));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn holes_fill_short_zero_stretches_between_neighbouring_copies() {
        let p = |k: usize| 0x10000 + k * PAGE;
        // Pages 0, 2, 3 and 7 get copies; 1 and 4..6 are zero pages; 9 is zero but past the end.
        let leaders = [p(0), p(2), p(3), p(7)];
        let zero_at: HashMap<usize, u32> = [(p(1), 11), (p(4), 14), (p(5), 15), (p(6), 16)]
            .into_iter()
            .chain([(p(9), 19)])
            .collect();
        use Slot::*;
        assert_eq!(
            lay_out(&leaders, &zero_at),
            [
                Copy(0),
                Hole(11),
                Copy(1),
                Copy(2),
                Hole(14),
                Hole(15),
                Hole(16),
                Copy(3)
            ]
        );
    }

    #[test]
    fn a_gap_with_a_page_that_is_not_zero_gets_no_hole() {
        let p = |k: usize| 0x10000 + k * PAGE;
        let zero_at: HashMap<usize, u32> = [(p(1), 1), (p(3), 3)].into_iter().collect();
        // Page 2 is not zero: the gap 1..4 is not all zero.
        assert_eq!(
            lay_out(&[p(0), p(4)], &zero_at),
            [Slot::Copy(0), Slot::Copy(1)]
        );
        // Leaders out of address order get no holes either.
        assert_eq!(
            lay_out(&[p(2), p(0)], &zero_at),
            [Slot::Copy(0), Slot::Copy(1)]
        );
    }

    #[test]
    fn zero_pages_between_merges_take_the_ids_their_copies_leave_between_them() {
        let p = |k: usize| 0x10000 + k * PAGE;
        // Pages 0 and 3 merge onto copies 10 and 13, pages 5 and 7 onto 20 and 30, page 9 onto
        // 40; 1, 2, 6 and 8 are zero pages; 8 has no merge after it.
        let merged: HashMap<usize, KeyId> =
            [(p(0), 10), (p(3), 13), (p(5), 20), (p(7), 30), (p(9), 40)]
                .into_iter()
                .collect();
        let zero_at: HashMap<usize, u32> = [(p(1), 1), (p(2), 2), (p(6), 6), (p(10), 10)]
            .into_iter()
            .collect();
        let mut got = between_merges(&merged, &zero_at);
        got.sort_unstable();
        // Page 6 lies between copies 20 and 30: no room for one hole.
        assert_eq!(got, [(1, 11), (2, 12)]);
        // A page that is no zero page between them: none.
        let zero_at: HashMap<usize, u32> = [(p(1), 1)].into_iter().collect();
        assert!(between_merges(&merged, &zero_at).is_empty());
    }

    proptest! {
        /// Every leader gets exactly one slot, in order; every hole is a zero page lying between
        /// the two leaders around it, and those two are no further apart than allowed.
        #[test]
        fn slots_keep_leaders_in_order_and_holes_between_them(
            kinds in proptest::collection::vec(0u8..3, 1..300),
        ) {
            // Page k: 0 a leader, 1 a zero page, 2 anything else.
            let p = |k: usize| 0x10000 + k * PAGE;
            let leaders: Vec<usize> =
                (0..kinds.len()).filter(|&k| kinds[k] == 0).map(p).collect();
            let zero_at: HashMap<usize, u32> = (0..kinds.len())
                .filter(|&k| kinds[k] == 1)
                .map(|k| (p(k), k as u32))
                .collect();
            let slots = lay_out(&leaders, &zero_at);
            let copies: Vec<usize> = slots
                .iter()
                .filter_map(|s| match s { Slot::Copy(j) => Some(*j), _ => None })
                .collect();
            prop_assert_eq!(copies, (0..leaders.len()).collect::<Vec<_>>());
            let mut last_leader = None;
            for (i, s) in slots.iter().enumerate() {
                match *s {
                    Slot::Copy(j) => last_leader = Some(j),
                    Slot::Hole(k) => {
                        let j = last_leader.expect("a hole follows a leader");
                        let next = slots[i..]
                            .iter()
                            .find_map(|s| match s { Slot::Copy(j) => Some(*j), _ => None })
                            .expect("a hole precedes a leader");
                        prop_assert_eq!(next, j + 1);
                        prop_assert_eq!(kinds[k as usize], 1);
                        let a = p(k as usize);
                        prop_assert!(leaders[j] < a && a < leaders[next]);
                        prop_assert!(leaders[next] - leaders[j] <= (MAX_HOLE_GAP + 1) * PAGE);
                    }
                }
            }
        }
    }
}
