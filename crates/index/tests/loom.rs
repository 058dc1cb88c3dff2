//! Loom models of the SD tree's races: insert/insert, insert/remove and remove/remove on sibling
//! leaves, and reclamation: under loom the tree frees unlinked nodes, reuses them and releases
//! their keys while other threads walk (a model of crossbeam-epoch, see the crate's `reclaim`).
//! Run with `RUSTFLAGS="--cfg loom" cargo test -p pageone-index --test loom --release`.
//!
//! Keys are 24 bytes that share a 16-byte non-zero prefix and differ in byte 16: every walk
//! compares the prefix, and a representative's third word is read from the key source (the first
//! two are copied in the leaf), so a read of a released key is seen by [`Keys`].
#![cfg(loom)]

use std::sync::atomic::{AtomicU32, Ordering};

use loom::sync::Arc;
use loom::thread;
use pageone_index::{Key, KeyId, KeySource, SdTree};

const LEN: usize = 24;
/// Key ids start here, so that no small number the tree might mistake for one (a node id, a
/// free-list link) names a key.
const FIRST_ID: KeyId = 100;

/// A key: the shared prefix, then `tail` in byte 16.
fn key(tail: u8) -> [u8; LEN] {
    let mut k = [0u8; LEN];
    for (i, b) in k[..16].iter_mut().enumerate() {
        *b = 0x80 | (i as u8 * 37);
    }
    k[16] = tail;
    k
}

/// The keys of a model and what the tree did with them. Plain (not loom) atomics: they only
/// record what happened in the interleaving loom runs, in its order.
struct Keys {
    keys: Vec<[u8; LEN]>,
    /// Times each key was released.
    released: Vec<AtomicU32>,
}

impl Keys {
    fn index(&self, id: KeyId) -> usize {
        let i = id.wrapping_sub(FIRST_ID) as usize;
        assert!(
            i < self.keys.len(),
            "the tree used id {id}, which names no key"
        );
        i
    }

    fn releases(&self, id: KeyId) -> u32 {
        self.released[self.index(id)].load(Ordering::Relaxed)
    }
}

/// The tree's view of [`Keys`] (shared with the test, which checks releases at the end).
struct Src(std::sync::Arc<Keys>);

impl KeySource for Src {
    fn word(&self, id: KeyId, i: usize) -> u64 {
        let k = &self.0;
        let at = k.index(id);
        assert_eq!(
            k.released[at].load(Ordering::Relaxed),
            0,
            "the tree read key {id} after releasing it"
        );
        k.keys[at].as_slice().word(i)
    }

    fn release(&self, id: KeyId) {
        let at = self.0.index(id);
        let before = self.0.released[at].fetch_add(1, Ordering::Relaxed);
        assert_eq!(before, 0, "key {id} released twice");
    }
}

/// A tree over keys with the given tails, their ids `id(0)`, `id(1)`, ..., and the keys' record.
fn tree_with(tails: &[u8], route_bits: u32) -> (Arc<SdTree<Src>>, std::sync::Arc<Keys>) {
    let keys = std::sync::Arc::new(Keys {
        keys: tails.iter().map(|&t| key(t)).collect(),
        released: tails.iter().map(|_| AtomicU32::new(0)).collect(),
    });
    let t = SdTree::with_route_bits(Src(keys.clone()), LEN, route_bits).unwrap();
    (Arc::new(t), keys)
}

/// Without route bits, so that the keys share one trie (with route bits the 8 bits after the
/// first set bit are in the shared prefix anyway, and leave them in one cluster too).
fn tree(tails: &[u8]) -> (Arc<SdTree<Src>>, std::sync::Arc<Keys>) {
    tree_with(tails, 0)
}

/// `loom::model` with a longer path allowed: a model's single-threaded set-up and final checks
/// (`check_invariants` loads every root edge: 193 for 24-byte keys) are loom branches too. The
/// preemption bound and the rest still come from the environment.
fn model(f: impl Fn() + Sync + Send + 'static) {
    let mut builder = loom::model::Builder::new();
    builder.max_branches = builder.max_branches.max(10_000);
    builder.check(f);
}

fn id(i: usize) -> KeyId {
    FIRST_ID + i as KeyId
}

/// Drops the last handle of `t` (which runs its outstanding frees) and checks that exactly the
/// keys `removed` were released, once each.
fn released_exactly(t: Arc<SdTree<Src>>, keys: &Keys, removed: &[usize]) {
    drop(t);
    for i in 0..keys.keys.len() {
        let want = removed.contains(&i) as u32;
        assert_eq!(keys.releases(id(i)), want, "releases of key {}", id(i));
    }
}

#[test]
fn insert_insert_distinct_siblings() {
    model(|| {
        // Tail 0x80 is stored; 0x81 and 0x83 race into the same cluster.
        let (t, keys) = tree(&[0x80, 0x81, 0x83]);
        t.insert_or_get(id(0)).unwrap();
        let t1 = t.clone();
        let h = thread::spawn(move || assert!(t1.insert_or_get(id(1)).unwrap().inserted()));
        assert!(t.insert_or_get(id(2)).unwrap().inserted());
        h.join().unwrap();
        assert_eq!(t.len(), 3);
        t.check_invariants().unwrap();
        released_exactly(t, &keys, &[]);
    });
}

#[test]
fn insert_insert_below_a_routed_root() {
    model(|| {
        // 4 route bits after bit 0 take bits 1..5 of the shared prefix; the keys race below it.
        let (t, keys) = tree_with(&[0x80, 0x81, 0x83], 4);
        t.insert_or_get(id(0)).unwrap();
        let t1 = t.clone();
        let h = thread::spawn(move || assert!(t1.insert_or_get(id(1)).unwrap().inserted()));
        assert!(t.insert_or_get(id(2)).unwrap().inserted());
        h.join().unwrap();
        assert_eq!(t.len(), 3);
        assert!(t.lookup(key(0x82).as_slice()).is_none());
        t.check_invariants().unwrap();
        released_exactly(t, &keys, &[]);
    });
}

#[test]
fn insert_insert_same_content_stores_it_once() {
    model(|| {
        let (t, keys) = tree(&[0x80, 0x85, 0x85]);
        t.insert_or_get(id(0)).unwrap();
        let t1 = t.clone();
        let h = thread::spawn(move || t1.insert_or_get(id(1)).unwrap());
        let b = t.insert_or_get(id(2)).unwrap();
        let a = h.join().unwrap();
        assert!(
            a.inserted() ^ b.inserted(),
            "exactly one insert stores the content"
        );
        assert_eq!(a.entry(), b.entry());
        assert_eq!(t.len(), 2);
        t.check_invariants().unwrap();
        released_exactly(t, &keys, &[]);
    });
}

/// Removes key 0 while inserting key 2; key 1 is the removed leaf's sibling.
fn insert_races_removal(tails: [u8; 3]) {
    model(move || {
        let (t, keys) = tree(&tails);
        let a = t.insert_or_get(id(0)).unwrap().entry();
        t.insert_or_get(id(1)).unwrap();
        let t1 = t.clone();
        let h = thread::spawn(move || assert!(t1.remove(a)));
        assert!(t.insert_or_get(id(2)).unwrap().inserted());
        h.join().unwrap();
        assert_eq!(t.len(), 2);
        assert!(t.lookup(key(tails[0]).as_slice()).is_none());
        assert!(t.lookup(key(tails[1]).as_slice()).is_some());
        assert!(t.lookup(key(tails[2]).as_slice()).is_some());
        t.check_invariants().unwrap();
        released_exactly(t, &keys, &[0]);
    });
}

#[test]
fn insert_on_the_sibling_edge_races_removal() {
    // 0x80 and 0xc0 split at the tail's bit 1; 0xc1 is inserted below 0xc0, on the edge the splice
    // freezes.
    insert_races_removal([0x80, 0xc0, 0xc1]);
}

#[test]
fn insert_above_the_parent_races_removal() {
    // 0x80 and 0x81 split at the tail's bit 7; 0x83 differs at bit 6 and goes above their parent.
    insert_races_removal([0x80, 0x81, 0x83]);
}

#[test]
fn removals_of_both_siblings() {
    model(|| {
        let (t, keys) = tree(&[0x80, 0x81, 0xc0]);
        let a = t.insert_or_get(id(0)).unwrap().entry();
        let b = t.insert_or_get(id(1)).unwrap().entry();
        t.insert_or_get(id(2)).unwrap();
        let t1 = t.clone();
        let h = thread::spawn(move || assert!(t1.remove(a)));
        assert!(t.remove(b));
        h.join().unwrap();
        assert_eq!(t.len(), 1);
        assert!(t.lookup(key(0xc0).as_slice()).is_some());
        t.check_invariants().unwrap();
        released_exactly(t, &keys, &[0, 1]);
    });
}

#[test]
fn lookup_during_removal_sees_present_or_absent() {
    model(|| {
        let (t, keys) = tree(&[0x80, 0x81]);
        let a = t.insert_or_get(id(0)).unwrap().entry();
        t.insert_or_get(id(1)).unwrap();
        let t1 = t.clone();
        let h = thread::spawn(move || assert!(t1.remove(a)));
        // The sibling is never lost while its neighbour is spliced out.
        assert!(t.lookup(key(0x81).as_slice()).is_some());
        h.join().unwrap();
        t.check_invariants().unwrap();
        released_exactly(t, &keys, &[0]);
    });
}

#[test]
fn lookup_through_a_representative_whose_leaf_is_removed_freed_and_reused() {
    model(|| {
        // A (0x80) and L (0x88) split at the tail's bit 4 into N, whose representative is L; M
        // (0x89) then splits L's edge at bit 7. Removing L leaves N's representative naming a
        // leaf that is no longer linked; the insert of Z (0x81, below A) that follows frees L's
        // and its parent's nodes at its pin (reclamation is two epochs behind) and reuses them.
        // A concurrent lookup of A compares its prefix with N's representative the whole time.
        let (t, keys) = tree(&[0x80, 0x88, 0x89, 0x81]);
        for i in 0..3 {
            t.insert_or_get(id(i)).unwrap();
        }
        let l = t.lookup(key(0x88).as_slice()).unwrap();
        let t1 = t.clone();
        let h = thread::spawn(move || {
            let hit = t1.lookup(key(0x80).as_slice()).map(|e| e.key());
            assert_eq!(hit, Some(id(0)), "a stored key was missed");
        });
        assert!(t.remove(l));
        assert!(t.insert_or_get(id(3)).unwrap().inserted());
        h.join().unwrap();
        assert!(t.lookup(key(0x88).as_slice()).is_none());
        assert!(t.lookup(key(0x89).as_slice()).is_some());
        assert!(t.lookup(key(0x81).as_slice()).is_some());
        t.check_invariants().unwrap();
        released_exactly(t, &keys, &[1]);
    });
}

#[test]
fn removals_of_one_entry_race_and_its_key_is_read_only_while_held() {
    model(|| {
        // Two removals of the same handle: exactly one succeeds. The other must not walk with
        // the key once it is released: the next operation (the insert) lets it be freed.
        let (t, keys) = tree(&[0x80, 0x88, 0x89]);
        for i in 0..2 {
            t.insert_or_get(id(i)).unwrap();
        }
        let a = t.lookup(key(0x80).as_slice()).unwrap();
        let t1 = t.clone();
        let h = thread::spawn(move || t1.remove(a));
        let mine = t.remove(a);
        assert!(t.insert_or_get(id(2)).unwrap().inserted());
        let theirs = h.join().unwrap();
        assert!(mine ^ theirs, "exactly one removal of a handle succeeds");
        t.check_invariants().unwrap();
        released_exactly(t, &keys, &[0]);
    });
}
