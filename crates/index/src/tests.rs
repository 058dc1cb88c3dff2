//! Unit and property tests of the SD tree against a `BTreeMap` model.

use std::collections::BTreeMap;

use proptest::prelude::*;

use crate::{Insert, Key, KeyId, KeySource, SdTree};

/// Keys held in plain vectors, never mutated while in a tree.
struct VecSource(Vec<Vec<u8>>);

impl KeySource for VecSource {
    fn word(&self, id: KeyId, i: usize) -> u64 {
        self.0[id as usize].as_slice().word(i)
    }
}

/// Small alphabet and zero prefixes of varying length, so keys share long prefixes and collide often.
fn key_strategy(len: usize) -> impl Strategy<Value = Vec<u8>> {
    (
        0..=len,
        proptest::collection::vec(
            prop_oneof![Just(0u8), Just(1), Just(0x80), Just(0xff), any::<u8>()],
            len,
        ),
    )
        .prop_map(move |(zeros, mut bytes)| {
            bytes[..zeros].iter_mut().for_each(|b| *b = 0);
            bytes
        })
}

#[derive(Debug, Clone)]
enum Op {
    Insert(usize),
    Lookup(usize),
    Remove(usize),
}

fn op_strategy(pool: usize) -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0..pool).prop_map(Op::Insert),
        2 => (0..pool).prop_map(Op::Lookup),
        2 => (0..pool).prop_map(Op::Remove),
    ]
}

fn run_model(
    key_len: usize,
    route_bits: u32,
    pool: Vec<Vec<u8>>,
    ops: Vec<Op>,
) -> Result<(), TestCaseError> {
    let tree = SdTree::with_route_bits(VecSource(pool.clone()), key_len, route_bits).unwrap();
    let mut model: BTreeMap<Vec<u8>, crate::Entry> = BTreeMap::new();
    for op in ops {
        match op {
            Op::Insert(i) => {
                let got = tree.insert_or_get(i as KeyId).unwrap();
                match model.get(&pool[i]) {
                    Some(&e) => prop_assert_eq!(got, Insert::Found(e)),
                    None => {
                        prop_assert!(got.inserted());
                        prop_assert_eq!(got.entry().key(), i as KeyId);
                        model.insert(pool[i].clone(), got.entry());
                    }
                }
            }
            Op::Lookup(i) => {
                prop_assert_eq!(
                    tree.lookup(pool[i].as_slice()),
                    model.get(&pool[i]).copied()
                );
            }
            Op::Remove(i) => match model.remove(&pool[i]) {
                Some(e) => {
                    prop_assert!(tree.remove(e));
                    prop_assert!(!tree.remove(e), "a second removal of one handle must fail");
                }
                None => prop_assert_eq!(tree.lookup(pool[i].as_slice()), None),
            },
        }
        prop_assert_eq!(tree.len(), model.len());
    }
    tree.check_invariants().map_err(TestCaseError::fail)?;
    let mut keys: Vec<Vec<u8>> = tree
        .entries()
        .iter()
        .map(|e| pool[e.key() as usize].clone())
        .collect();
    keys.sort();
    prop_assert_eq!(keys, model.keys().cloned().collect::<Vec<_>>());
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    // Route bits: none (one trie per first-set-bit position), a few (routing that stops inside a
    // byte and, for short keys, past the key's end), and the default.
    #[test]
    fn matches_btreemap_model(
        route_bits in prop_oneof![Just(0u32), Just(3), Just(crate::DEFAULT_ROUTE_BITS)],
        (key_len, pool, ops) in prop_oneof![Just(1usize), Just(8), Just(13), Just(24)]
            .prop_flat_map(|len| (Just(len), proptest::collection::vec(key_strategy(len), 1..40)))
            .prop_flat_map(|(len, pool)| {
                let n = pool.len();
                (Just(len), Just(pool), proptest::collection::vec(op_strategy(n), 0..200))
            })
    ) {
        run_model(key_len, route_bits, pool, ops)?;
    }
}

/// 4 KiB keys that share a random non-zero prefix of 2 KiB or more: each is one random page with
/// an 8-byte window from the small alphabet at a random offset near the end (often the same offset,
/// so that keys also share the bytes around it and the trie below the prefix is deep).
fn shared_prefix_pool() -> impl Strategy<Value = Vec<Vec<u8>>> {
    let window = proptest::collection::vec(
        prop_oneof![Just(0u8), Just(1), Just(0x80), Just(0xff), any::<u8>()],
        8,
    );
    let at = prop_oneof![2048usize..4096, 4080usize..4096, Just(4090usize)];
    (
        proptest::collection::vec(1u8..=255, 4096),
        proptest::collection::vec((at, window), 1..40),
    )
        .prop_map(|(base, windows)| {
            windows
                .into_iter()
                .map(|(at, window)| {
                    let mut k = base.clone();
                    for (b, w) in k[at..].iter_mut().zip(window) {
                        *b = w;
                    }
                    k
                })
                .collect()
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn matches_btreemap_model_on_pages_with_long_shared_prefixes(
        route_bits in prop_oneof![Just(0u32), Just(crate::DEFAULT_ROUTE_BITS)],
        (pool, ops) in shared_prefix_pool().prop_flat_map(|pool| {
            let n = pool.len();
            (Just(pool), proptest::collection::vec(op_strategy(n), 0..200))
        })
    ) {
        run_model(4096, route_bits, pool, ops)?;
    }
}

#[test]
fn rejects_bad_key_lengths() {
    assert!(SdTree::new(VecSource(vec![]), 0).is_err());
    assert!(SdTree::new(VecSource(vec![]), 4097).is_err());
}

#[test]
fn route_bits_past_the_key_end_and_across_words() {
    // 1-byte keys: fewer than 8 bits follow any first set bit. 9-byte keys with the first set bit
    // late in word 0: the route bits continue into word 1.
    for (len, keys) in [
        (
            1usize,
            vec![vec![0x80u8], vec![0x81], vec![0x01], vec![0x00], vec![0x40]],
        ),
        (
            9,
            vec![
                vec![0, 0, 0, 0, 0, 0, 0, 1, 0x00],
                vec![0, 0, 0, 0, 0, 0, 0, 1, 0x80],
                vec![0, 0, 0, 0, 0, 0, 0, 1, 0x81],
                vec![0, 0, 0, 0, 0, 0, 0, 3, 0x81],
                vec![0, 0, 0, 0, 0, 0, 0, 0, 0x81],
                vec![0; 9],
            ],
        ),
    ] {
        for route_bits in [0, 1, 7, 8, crate::MAX_ROUTE_BITS] {
            let tree = SdTree::with_route_bits(VecSource(keys.clone()), len, route_bits).unwrap();
            for i in 0..keys.len() {
                assert!(tree.insert_or_get(i as KeyId).unwrap().inserted());
            }
            tree.check_invariants().unwrap();
            for (i, k) in keys.iter().enumerate() {
                assert_eq!(tree.lookup(k.as_slice()).map(|e| e.key()), Some(i as KeyId));
            }
            let mut absent = keys[keys.len() - 2].clone();
            absent[len - 1] ^= 0x10;
            assert_eq!(tree.lookup(absent.as_slice()), None);
        }
    }
}

#[test]
#[should_panic(expected = "route_bits")]
fn too_many_route_bits_panics() {
    let _ = SdTree::with_route_bits(VecSource(vec![]), 8, crate::MAX_ROUTE_BITS + 1);
}

#[test]
fn stale_handle_is_refused_after_reuse() {
    let pool = vec![vec![1u8; 8], vec![2u8; 8], vec![3u8; 8]];
    let tree = SdTree::new(VecSource(pool), 8).unwrap();
    let a = tree.insert_or_get(0).unwrap().entry();
    tree.insert_or_get(1).unwrap();
    assert!(tree.remove(a));
    // Force the grace period so the node can be recycled, then insert again.
    for _ in 0..128 {
        crossbeam_epoch::pin().flush();
    }
    tree.insert_or_get(2).unwrap();
    tree.insert_or_get(0).unwrap();
    assert!(
        !tree.remove(a),
        "an old handle must never remove a recycled node's entry"
    );
    assert_eq!(tree.len(), 3);
    tree.check_invariants().unwrap();
}

/// Seed "hard" pages: a distinct random 8-byte value at a random offset 0..252, zeros elsewhere.
pub(crate) fn hard_pages(n: usize, seed: u64) -> (Vec<Vec<u8>>, Vec<usize>) {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
    let mut seen = std::collections::HashSet::new();
    let mut pages = Vec::with_capacity(n);
    let mut offsets = Vec::with_capacity(n);
    while pages.len() < n {
        let off = rng.gen_range(0..=252usize);
        let v: u64 = rng.gen::<u64>() | (1 << 63); // a set top bit makes the offset the first set byte
        if !seen.insert((off, v)) {
            continue;
        }
        let mut p = vec![0u8; 4096];
        p[off..off + 8].copy_from_slice(&v.to_be_bytes());
        pages.push(p);
        offsets.push(off);
    }
    (pages, offsets)
}

#[test]
fn hard_keys_read_each_word_once_and_misses_stop_at_the_distinguishing_prefix() {
    let (pages, _) = hard_pages(20_000, 7);
    let (probes, offsets) = hard_pages(2_000, 8);
    let tree = SdTree::new(VecSource(pages.clone()), 4096).unwrap();
    for i in 0..pages.len() {
        assert!(tree.insert_or_get(i as KeyId).unwrap().inserted());
    }
    for p in pages.iter().take(2000) {
        let (hit, stats) = tree.lookup_with_stats(p.as_slice());
        assert!(hit.is_some());
        // A hit must confirm every byte, and reads each query word exactly once.
        assert_eq!(
            stats.query_bytes, 4096,
            "hit read {} bytes",
            stats.query_bytes
        );
    }
    let mut misses = 0;
    for (p, off) in probes.iter().zip(offsets) {
        let (hit, stats) = tree.lookup_with_stats(p.as_slice());
        if hit.is_none() {
            misses += 1;
            // Zero run (skipped a word at a time) + the 8-byte value + at most one word of slack.
            let bound = (off + 8).div_ceil(8) * 8 + 8;
            assert!(
                stats.query_bytes as usize <= bound,
                "miss read {} bytes, bound {bound}",
                stats.query_bytes
            );
        }
    }
    assert!(misses > 1900);
}

#[test]
fn candidate_names_every_present_key_and_nothing_for_an_empty_tree() {
    let (pages, _) = hard_pages(2_000, 11);
    let (probes, _) = hard_pages(500, 12);
    let tree = SdTree::new(VecSource(pages.clone()), 4096).unwrap();
    assert!(tree.candidate(pages[0].as_slice()).is_none());
    for i in 0..pages.len() {
        tree.insert_or_get(i as KeyId).unwrap();
    }
    for (i, p) in pages.iter().enumerate() {
        let c = tree
            .candidate(p.as_slice())
            .expect("a present key has a candidate");
        assert_eq!(c.key(), i as KeyId);
        assert_eq!(tree.lookup(p.as_slice()), Some(c));
    }
    for p in &probes {
        if let Some(c) = tree.candidate(p.as_slice()) {
            // Not confirmed: an absent key's candidate is some other stored key.
            assert_ne!(pages[c.key() as usize], *p);
        }
    }
}

#[test]
fn misses_decided_in_the_leaf_copies_read_no_stored_key() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    struct Counting(VecSource, AtomicUsize);
    impl KeySource for Counting {
        fn word(&self, id: KeyId, i: usize) -> u64 {
            self.1.fetch_add(1, Ordering::Relaxed);
            self.0.word(id, i)
        }
    }
    let (pages, _) = hard_pages(5_000, 21);
    let (probes, _) = hard_pages(1_000, 22);
    let tree = SdTree::new(
        Counting(VecSource(pages.clone()), AtomicUsize::new(0)),
        4096,
    )
    .unwrap();
    for i in 0..pages.len() {
        tree.insert_or_get(i as KeyId).unwrap();
    }
    tree.check_invariants().unwrap();
    tree.source().1.store(0, Ordering::Relaxed);
    let mut misses = 0;
    for p in &probes {
        // The 8-byte values differ within the two words from the first set bit on.
        if tree.lookup(p.as_slice()).is_none() {
            misses += 1;
        }
    }
    assert!(misses > 990);
    assert_eq!(tree.source().1.load(Ordering::Relaxed), 0);
    // A hit still confirms every word after the zero run, the two copied ones from the leaf.
    let (hit, stats) = tree.lookup_with_stats(pages[17].as_slice());
    assert_eq!(hit.map(|e| e.key()), Some(17));
    assert_eq!(stats.query_bytes, 4096);
    let w0 = pages[17].iter().position(|&b| b != 0).unwrap() / 8;
    assert_eq!(tree.source().1.load(Ordering::Relaxed), 512 - w0 - 2);
}

/// Reading key 1's last word (which happens once per attempt of its insert, at the leaf that ends
/// the walk, before the publishing CAS) inserts the next of keys `2..`, which land exactly on the
/// edge that walk ended at: every attempt of the insert fails while they last.
struct Interfering {
    keys: Vec<Vec<u8>>,
    tree: std::sync::OnceLock<std::sync::Weak<SdTree<Interfering>>>,
    next: std::sync::atomic::AtomicUsize,
}

impl KeySource for Interfering {
    fn word(&self, id: KeyId, i: usize) -> u64 {
        use std::sync::atomic::Ordering;
        if id == 1 && i == self.keys[1].len() / 8 - 1 {
            // Relaxed: one thread.
            let k = 2 + self.next.fetch_add(1, Ordering::Relaxed);
            if let (Some(t), true) = (
                self.tree.get().and_then(std::sync::Weak::upgrade),
                k < self.keys.len(),
            ) {
                assert!(t.insert_or_get(k as KeyId).unwrap().inserted());
            }
        }
        self.keys[id as usize].as_slice().word(i)
    }
}

#[test]
fn an_insert_gives_up_after_its_attempts_and_the_tree_stays_whole() {
    use std::sync::atomic::Ordering;
    const LEN: usize = 64;
    const EXTRA: usize = 5;
    // Non-zero bytes throughout; key 1 flips the last bit, key 2 + k flips bit 16 + k (each one
    // deeper on key 0's side of the previous one, where key 1's walk ends).
    let base: Vec<u8> = (0..LEN)
        .map(|i| 0x80 | (i as u8).wrapping_mul(29))
        .collect();
    let flip = |bit: usize| {
        let mut k = base.clone();
        k[bit / 8] ^= 0x80 >> (bit % 8);
        k
    };
    let mut keys = vec![base.clone(), flip(LEN * 8 - 1)];
    let interferers = crate::INSERT_ATTEMPTS as usize + EXTRA;
    keys.extend((0..interferers).map(|k| flip(16 + k)));
    let tree = std::sync::Arc::new(
        SdTree::new(
            Interfering {
                keys: keys.clone(),
                tree: Default::default(),
                next: Default::default(),
            },
            LEN,
        )
        .unwrap(),
    );
    tree.source()
        .tree
        .set(std::sync::Arc::downgrade(&tree))
        .unwrap();
    assert!(tree.insert_or_get(0).unwrap().inserted());
    let (r, stats) = tree.insert_or_get_with_stats(1);
    assert_eq!(r, Err(crate::IndexError::Contended(crate::INSERT_ATTEMPTS)));
    assert_eq!(stats.retries, crate::INSERT_ATTEMPTS);
    let done = tree.source().next.load(Ordering::Relaxed);
    assert_eq!(
        done,
        crate::INSERT_ATTEMPTS as usize,
        "one interferer per attempt"
    );
    assert_eq!(tree.lookup(keys[1].as_slice()), None);
    // The interference runs out EXTRA attempts into the next insert, which then succeeds.
    let (r, stats) = tree.insert_or_get_with_stats(1);
    assert!(r.unwrap().inserted());
    assert_eq!(stats.retries, EXTRA as u32);
    tree.check_invariants().unwrap();
    assert_eq!(tree.len(), keys.len());
    for (i, k) in keys.iter().enumerate() {
        assert_eq!(tree.lookup(k.as_slice()).map(|e| e.key()), Some(i as KeyId));
    }
}

/// 4 KiB pages in `groups` groups: each group's pages are one random page of non-zero bytes
/// except for 8 bytes from a random offset in 2048..4088, so they share their first 2 to 4 KiB
/// (non-zero: no zero run to skip) with every page of the group and differ only near the end.
pub(crate) fn shared_prefix_pages(n: usize, groups: usize, seed: u64) -> Vec<Vec<u8>> {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
    let bases: Vec<Vec<u8>> = (0..groups)
        .map(|_| (0..4096).map(|_| rng.gen_range(1..=255u8)).collect())
        .collect();
    let mut seen = std::collections::HashSet::new();
    let mut pages = Vec::with_capacity(n);
    while pages.len() < n {
        let mut p = bases[rng.gen_range(0..groups)].clone();
        let at = rng.gen_range(2048..4088);
        p[at] ^= rng.gen_range(1..=255u8); // differs from the group's page here
        for b in &mut p[at + 1..at + 8] {
            *b = rng.gen();
        }
        if seen.insert(p.clone()) {
            pages.push(p);
        }
    }
    pages
}

#[test]
fn pages_with_long_shared_prefixes_are_read_once_and_misses_stop_past_the_shared_prefix() {
    let pages = shared_prefix_pages(3_000, 4, 31);
    let probes = shared_prefix_pages(1_000, 4, 32);
    let tree = SdTree::new(VecSource(pages.clone()), 4096).unwrap();
    for i in 0..pages.len() {
        assert!(tree.insert_or_get(i as KeyId).unwrap().inserted());
    }
    tree.check_invariants().unwrap();
    for (i, p) in pages.iter().enumerate().step_by(7) {
        let (hit, stats) = tree.lookup_with_stats(p.as_slice());
        assert_eq!(hit.map(|e| e.key()), Some(i as KeyId));
        assert_eq!(stats.query_bytes, 4096, "a hit reads the whole query, once");
    }
    // The longest prefix a probe shares with a stored page is shared with a sorted neighbour.
    let mut sorted = pages.clone();
    sorted.sort();
    let lcp = |a: &[u8], b: &[u8]| a.iter().zip(b).take_while(|(x, y)| x == y).count();
    let mut misses = 0;
    for p in &probes {
        let at = sorted.partition_point(|s| s < p);
        let shared = [at.checked_sub(1), Some(at)]
            .into_iter()
            .flatten()
            .filter_map(|j| sorted.get(j))
            .map(|s| lcp(s, p))
            .max()
            .unwrap();
        let (hit, stats) = tree.lookup_with_stats(p.as_slice());
        if shared == 4096 {
            assert!(hit.is_some());
            continue;
        }
        assert!(hit.is_none());
        misses += 1;
        // Every word up to the first byte no stored page shares, and at most one more.
        let bound = (shared / 8 + 2) * 8;
        assert!(
            stats.query_bytes as usize <= bound && stats.query_bytes as usize > shared,
            "miss sharing {shared} bytes read {} bytes",
            stats.query_bytes
        );
    }
    assert!(misses > 990);
}
