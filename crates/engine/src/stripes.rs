//! Stripes: a group of equal pages larger than one copy may serve (`Config::max_sharing` pages of
//! this process) is spread over several copies that lie side by side in the store, the pages
//! taking them in turn in address order.
//!
//! A run of equal pages (a guest's memory filled with one poison pattern, `0xcc` for the init
//! memory a Linux guest frees, tens of thousands of pages) used to be cut into chunks of
//! `max_sharing` consecutive pages, each chunk on one copy: every page of a chunk mapped the same
//! copy, which takes a mapping per page (a mapping maps consecutive pages of the file). Taken in
//! turn, `c` copies side by side serve `c` consecutive pages with one mapping, and the group
//! needs no more copies than before: each still serves at most `max_sharing` pages.
//!
//! Side by side: a batch's new copies are laid out in the order the pages, in address order,
//! first take them (see `classify`), which puts a run's stripe in order, and interleaved
//! contents' copies in turn too (pages of contents `a, b, a, b, ...` take `a0, b0, a1, b1, ...`).

use std::collections::HashMap;

/// The copies of one split group that its pages take in turn, each named by the page that leads
/// it, in the order the pages take them: a new group's leader first (its own copy), then pages
/// that get fresh copies (never deduplicated onto the full copy, nor indexed). A group whose
/// adopted copy is full here leads the first fresh one itself; one whose adopted copy has room
/// keeps it for its leader alone, and its stripe is all fresh copies.
pub(crate) type Stripe = Vec<u32>;

/// What a group's leader may serve of its group.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Room {
    /// A new copy: `max_sharing` pages.
    New,
    /// A copy the daemon holds, with room for this many more pages of this process (0: full,
    /// and the leader takes a fresh copy).
    Adopted(usize),
}

/// Splits groups so that no copy serves more than `cap` pages (at least 2). `leaders` are the
/// groups' leaders with their room, `member_of` the other pages as (candidate, leader), `addr`
/// a candidate's address. Members of split groups are re-pointed to the leader of the copy they
/// take (a stripe's leader to itself). Returns the stripes, in the order of `leaders`.
pub(crate) fn split(
    cap: usize,
    leaders: &[(u32, Room)],
    member_of: &mut [(u32, u32)],
    addr: impl Fn(u32) -> usize,
) -> Vec<Stripe> {
    let cap = cap.max(2);
    let mut members: HashMap<u32, Vec<usize>> = HashMap::new();
    for (k, &(_, l)) in member_of.iter().enumerate() {
        members.entry(l).or_default().push(k);
    }
    let mut stripes = Vec::new();
    for &(l, room) in leaders {
        // A copy serves `cap` pages at most, whatever room it was said to have.
        let room = match room {
            Room::Adopted(r) => Room::Adopted(r.min(cap)),
            new => new,
        };
        let mut mine = members.remove(&l).unwrap_or_default();
        let n = mine.len();
        let fits = match room {
            Room::New => n < cap,
            Room::Adopted(r) => r > 0 && n < r,
        };
        if fits {
            continue;
        }
        mine.sort_unstable_by_key(|&k| (addr(member_of[k].0), member_of[k].0));
        let pages: Vec<u32> = mine.iter().map(|&k| member_of[k].0).collect();
        let (stripe, takes) = match room {
            // The leader keeps the adopted copy for itself; its members take the stripe.
            Room::Adopted(r) if r > 0 => in_turn(&pages, None, n.div_ceil(cap)),
            // New, or adopted and full (the leader's own copy is then a fresh one): the leader's
            // copy is the stripe's first.
            _ => {
                let all = with_leader(&pages, l, &addr);
                let (stripe, takes) = in_turn(&all, Some(l), (n + 1).div_ceil(cap));
                // `takes` covers the leader too: keep the members' entries only.
                let takes = all
                    .iter()
                    .zip(takes)
                    .filter(|&(&p, _)| p != l)
                    .map(|(_, t)| t)
                    .collect();
                (stripe, takes)
            }
        };
        for (&k, t) in mine.iter().zip(takes) {
            member_of[k].1 = t;
        }
        stripes.push(stripe);
    }
    stripes
}

/// `members` (in address order) with the leader `l` put in its place by address.
fn with_leader(members: &[u32], l: u32, addr: &impl Fn(u32) -> usize) -> Vec<u32> {
    let at = members.partition_point(|&m| (addr(m), m) < (addr(l), l));
    let mut all = Vec::with_capacity(members.len() + 1);
    all.extend_from_slice(&members[..at]);
    all.push(l);
    all.extend_from_slice(&members[at..]);
    all
}

/// Deals `pages` (in address order) over `c` copies in turn, the copy of `anchor` (one of the
/// pages) being the first: returns each copy's leader (a page that takes it), in the copies'
/// order, and the leader of the copy each page takes.
fn in_turn(pages: &[u32], anchor: Option<u32>, c: usize) -> (Vec<u32>, Vec<u32>) {
    let c = c.clamp(1, pages.len().max(1));
    let p = anchor
        .and_then(|a| pages.iter().position(|&q| q == a))
        .unwrap_or(0);
    // Page k takes copy (k - p) mod c: the anchor copy 0, its successors 1, 2, ...
    let copy_of = |k: usize| (k + c - p % c) % c;
    let mut leaders: Vec<Option<u32>> = vec![None; c];
    for (k, &q) in pages.iter().enumerate() {
        let j = copy_of(k);
        if leaders[j].is_none() || Some(q) == anchor {
            leaders[j] = Some(q);
        }
    }
    // Every copy has a page: c <= pages.len(), and the residues of consecutive positions cover
    // every copy.
    let leaders: Vec<u32> = leaders.into_iter().flatten().collect();
    let takes = (0..pages.len()).map(|k| leaders[copy_of(k)]).collect();
    (leaders, takes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::{BTreeMap, HashSet};

    /// A group of `n` members (candidates 0..n) of leader 1000.
    fn group(n: usize) -> Vec<(u32, u32)> {
        (0..n as u32).map(|c| (c, 1000)).collect()
    }

    #[test]
    fn a_run_of_equal_pages_takes_side_by_side_copies_in_turn() {
        // 1 leader + 9 members at consecutive pages, 4 pages per copy: 3 copies, taken in turn.
        let mut m = group(9);
        let addr = |c: u32| {
            if c == 1000 {
                0
            } else {
                (c as usize + 1) * 4096
            }
        };
        let s = split(4, &[(1000, Room::New)], &mut m, addr);
        assert_eq!(s, vec![vec![1000, 0, 1]]);
        let takes: Vec<u32> = m.iter().map(|&(_, t)| t).collect();
        assert_eq!(takes, vec![0, 1, 1000, 0, 1, 1000, 0, 1, 1000]);
    }

    #[test]
    fn groups_within_their_room_are_left_alone() {
        let mut m = group(3);
        let before = m.clone();
        let s = split(4, &[(1000, Room::New)], &mut m, |c| c as usize);
        assert!(s.is_empty());
        assert_eq!(m, before);
        let s = split(4, &[(1000, Room::Adopted(4))], &mut m, |c| c as usize);
        assert!(s.is_empty());
        assert_eq!(m, before);
    }

    #[test]
    fn a_full_adopted_copy_gives_its_leader_a_fresh_one() {
        let mut m = Vec::new();
        let s = split(256, &[(7, Room::Adopted(0))], &mut m, |c| c as usize);
        assert_eq!(s, vec![vec![7]]);
    }

    fn rooms() -> impl Strategy<Value = Room> {
        prop_oneof![Just(Room::New), (0usize..6).prop_map(Room::Adopted)]
    }

    proptest! {
        /// Every copy serves at most its room, no more copies are made than the room requires,
        /// every page takes a copy of its own group, and consecutive pages of a group take
        /// consecutive copies of its stripe.
        #[test]
        fn copies_serve_at_most_cap_pages_and_runs_take_them_in_turn(
            cap in 2usize..8,
            sizes in proptest::collection::vec((0usize..40, rooms()), 1..4),
            salt in any::<u64>(),
        ) {
            // Members numbered from 0, leaders 10_000 + g; addresses shuffled across groups.
            let mut member_of = Vec::new();
            let mut leaders = Vec::new();
            for (g, &(n, room)) in sizes.iter().enumerate() {
                let l = 10_000 + g as u32;
                leaders.push((l, room));
                for _ in 0..n {
                    member_of.push((member_of.len() as u32, l));
                }
            }
            let addr = |c: u32| (c as u64).wrapping_mul(salt | 1).rotate_left(17) as usize;
            let group: BTreeMap<u32, u32> = member_of.iter().copied().collect();
            let group_of = |c: u32| group.get(&c).copied().unwrap_or(c);
            let stripes = split(cap, &leaders, &mut member_of, addr);
            // The copy each page takes, by the page that leads it: leaders take their own.
            let takes: Vec<(u32, u32)> = member_of
                .iter()
                .copied()
                .chain(leaders.iter().map(|&(l, _)| (l, l)))
                .collect();
            let mut served: HashMap<u32, usize> = HashMap::new();
            for &(c, t) in &takes {
                prop_assert_eq!(group_of(t), group_of(c), "page {} took {}", c, t);
                *served.entry(t).or_default() += 1;
            }
            // Copies made beyond the leaders' own (new, or adopted with room).
            let own = |l: u32, room: Room| !matches!(room, Room::Adopted(0)) && l >= 10_000;
            let fresh: HashSet<u32> = stripes
                .iter()
                .flatten()
                .copied()
                .filter(|&c| !leaders.iter().any(|&(l, room)| l == c && own(l, room)))
                .collect();
            for (&(l, room), &(n, _)) in leaders.iter().zip(&sizes) {
                let room = match room {
                    Room::Adopted(r) => Room::Adopted(r.min(cap)),
                    new => new,
                };
                let limit = match room {
                    Room::Adopted(r) if r > 0 => r,
                    _ => cap,
                };
                prop_assert!(served[&l] <= limit, "leader {} serves {} > {}", l, served[&l], limit);
                let made = fresh.iter().filter(|&&f| group_of(f) == l).count();
                let needed = match room {
                    Room::New => (n + 1).div_ceil(cap) - 1,
                    Room::Adopted(0) => (n + 1).div_ceil(cap),
                    Room::Adopted(r) if n < r => 0,
                    Room::Adopted(_) => n.div_ceil(cap),
                };
                prop_assert_eq!(made, needed, "group {} of {} pages", l, n + 1);
            }
            for (&t, &s) in &served {
                prop_assert!(s <= cap, "the copy of {} serves {}", t, s);
            }
            // In each stripe, the pages that take its copies, in address order, take them in
            // turn.
            for copies in &stripes {
                let pos = |t: u32| copies.iter().position(|&x| x == t);
                let mut pages: Vec<(usize, u32, usize)> = takes
                    .iter()
                    .filter_map(|&(c, t)| Some((addr(c), c, pos(t)?)))
                    .collect();
                pages.sort_unstable();
                for w in pages.windows(2) {
                    prop_assert_eq!((w[0].2 + 1) % copies.len(), w[1].2, "{:?}", w);
                }
            }
        }
    }
}
