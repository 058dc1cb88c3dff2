//! Loom models of the SD tree's races: insert/insert, insert/remove and remove/remove on sibling
//! leaves. Run with `RUSTFLAGS="--cfg loom" cargo test -p pageone-index --test loom --release`.
#![cfg(loom)]

use loom::sync::Arc;
use loom::thread;
use pageone_index::{Key, KeyId, KeySource, SdTree};

/// One-byte keys: small enough for loom, still several trie levels.
struct Bytes(Vec<u8>);

impl KeySource for Bytes {
    fn word(&self, id: KeyId, i: usize) -> u64 {
        [self.0[id as usize]].as_slice().word(i)
    }
}

/// Without route bits, so that the one-byte keys below share a trie (with the default route bits
/// every one of them would have a root edge of its own).
fn tree(keys: &[u8]) -> Arc<SdTree<Bytes>> {
    Arc::new(SdTree::with_route_bits(Bytes(keys.to_vec()), 1, 0).unwrap())
}

#[test]
fn insert_insert_distinct_siblings() {
    loom::model(|| {
        // 0b1000_0000 is stored; 0b1000_0001 and 0b1000_0011 race into the same cluster.
        let t = tree(&[0x80, 0x81, 0x83]);
        t.insert_or_get(0).unwrap();
        let t1 = t.clone();
        let h = thread::spawn(move || assert!(t1.insert_or_get(1).unwrap().inserted()));
        assert!(t.insert_or_get(2).unwrap().inserted());
        h.join().unwrap();
        assert_eq!(t.len(), 3);
        t.check_invariants().unwrap();
    });
}

#[test]
fn insert_insert_below_a_routed_root() {
    loom::model(|| {
        // 4 route bits after bit 0 take bits 1..5, which the three keys share; they race below it.
        let t = Arc::new(SdTree::with_route_bits(Bytes(vec![0x80, 0x81, 0x83]), 1, 4).unwrap());
        t.insert_or_get(0).unwrap();
        let t1 = t.clone();
        let h = thread::spawn(move || assert!(t1.insert_or_get(1).unwrap().inserted()));
        assert!(t.insert_or_get(2).unwrap().inserted());
        h.join().unwrap();
        assert_eq!(t.len(), 3);
        assert!(t.lookup([0x82u8].as_slice()).is_none());
        t.check_invariants().unwrap();
    });
}

#[test]
fn insert_insert_same_content_stores_it_once() {
    loom::model(|| {
        let t = tree(&[0x80, 0x85, 0x85]);
        t.insert_or_get(0).unwrap();
        let t1 = t.clone();
        let h = thread::spawn(move || t1.insert_or_get(1).unwrap());
        let b = t.insert_or_get(2).unwrap();
        let a = h.join().unwrap();
        assert!(
            a.inserted() ^ b.inserted(),
            "exactly one insert stores the content"
        );
        assert_eq!(a.entry(), b.entry());
        assert_eq!(t.len(), 2);
        t.check_invariants().unwrap();
    });
}

/// Removes `keys[0]` while inserting `keys[2]`; `keys[1]` is the removed leaf's sibling.
fn insert_races_removal(keys: [u8; 3]) {
    loom::model(move || {
        let t = tree(&keys);
        let a = t.insert_or_get(0).unwrap().entry();
        t.insert_or_get(1).unwrap();
        let t1 = t.clone();
        let h = thread::spawn(move || assert!(t1.remove(a)));
        assert!(t.insert_or_get(2).unwrap().inserted());
        h.join().unwrap();
        assert_eq!(t.len(), 2);
        assert!(t.lookup([keys[0]].as_slice()).is_none());
        assert!(t.lookup([keys[1]].as_slice()).is_some());
        assert!(t.lookup([keys[2]].as_slice()).is_some());
        t.check_invariants().unwrap();
    });
}

#[test]
fn insert_on_the_sibling_edge_races_removal() {
    // 0x80 and 0xc0 split at bit 1; 0xc1 is inserted below 0xc0, on the edge the splice freezes.
    insert_races_removal([0x80, 0xc0, 0xc1]);
}

#[test]
fn insert_above_the_parent_races_removal() {
    // 0x80 and 0x81 split at bit 7; 0x83 differs at bit 6 and goes above their parent.
    insert_races_removal([0x80, 0x81, 0x83]);
}

#[test]
fn removals_of_both_siblings() {
    loom::model(|| {
        let t = tree(&[0x80, 0x81, 0xc0]);
        let a = t.insert_or_get(0).unwrap().entry();
        let b = t.insert_or_get(1).unwrap().entry();
        t.insert_or_get(2).unwrap();
        let t1 = t.clone();
        let h = thread::spawn(move || assert!(t1.remove(a)));
        assert!(t.remove(b));
        h.join().unwrap();
        assert_eq!(t.len(), 1);
        assert!(t.lookup([0xc0u8].as_slice()).is_some());
        t.check_invariants().unwrap();
    });
}

#[test]
fn lookup_during_removal_sees_present_or_absent() {
    loom::model(|| {
        let t = tree(&[0x80, 0x81]);
        let a = t.insert_or_get(0).unwrap().entry();
        t.insert_or_get(1).unwrap();
        let t1 = t.clone();
        let h = thread::spawn(move || assert!(t1.remove(a)));
        // The sibling is never lost while its neighbour is spliced out.
        assert!(t.lookup([0x81u8].as_slice()).is_some());
        h.join().unwrap();
        t.check_invariants().unwrap();
    });
}
