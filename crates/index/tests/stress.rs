//! Multithreaded stress of the SD tree: concurrent inserts of identical content, removals racing
//! inserts of neighbouring keys, and lookups throughout; invariants checked at the end of each round.
//! Two key shapes: short keys with zero prefixes, and 4 KiB pages that share 4 KiB less a few
//! bytes of non-zero content. The key source fails the test if the tree reads a key after
//! releasing it. Run in release mode in CI (`cargo test --release`); debug mode uses fewer keys.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Barrier, Mutex};

use pageone_index::{Entry, KeyId, KeySource, SdTree, WordKey, DEFAULT_ROUTE_BITS};
use rand::{Rng, SeedableRng};

#[derive(Clone, Copy, Debug)]
enum Shape {
    /// 64-byte keys: zeros with a few bytes set at a random offset (zero runs of every length).
    Short,
    /// 4 KiB pages of random non-zero bytes, one page per group, with a few bytes changed in the
    /// last 256: they share a non-zero prefix of 3840 bytes or more.
    SharedPrefix,
}

impl Shape {
    fn key_len(self) -> usize {
        match self {
            Shape::Short => 64,
            Shape::SharedPrefix => 4096,
        }
    }
}

/// A content: its group's base page, with bytes `at`, `at + 1` and `at + 3` XORed with `x`
/// (`x[0]` non-zero, so contents with different `at` differ at their smaller `at`).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct Content {
    group: u8,
    at: u16,
    x: [u8; 3],
}

/// Contents are described, not stored: 4 KiB pages for every id would take gigabytes.
struct Pool {
    bases: Vec<Vec<u8>>,
    contents: Vec<Content>,
    /// Per id (`copy * contents + content`): released by the tree.
    released: Vec<AtomicBool>,
    releases: AtomicUsize,
}

impl Pool {
    fn new(shape: Shape, contents: usize, copies: usize, seed: u64) -> Arc<Pool> {
        let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
        let len = shape.key_len();
        let (bases, window): (Vec<Vec<u8>>, _) = match shape {
            Shape::Short => (vec![vec![0; len]], 0..len - 4),
            Shape::SharedPrefix => (
                (0..4)
                    .map(|_| (0..len).map(|_| rng.gen_range(1..=255u8)).collect())
                    .collect(),
                len - 256..len - 4,
            ),
        };
        let mut set = std::collections::HashSet::new();
        while set.len() < contents {
            set.insert(Content {
                group: rng.gen_range(0..bases.len()) as u8,
                at: rng.gen_range(window.clone()) as u16,
                x: [rng.gen_range(1..4), rng.gen(), rng.gen_range(0..2)],
            });
        }
        Arc::new(Pool {
            bases,
            contents: set.into_iter().collect(),
            released: (0..contents * copies)
                .map(|_| AtomicBool::new(false))
                .collect(),
            releases: AtomicUsize::new(0),
        })
    }

    fn content_of(&self, id: KeyId) -> usize {
        id as usize % self.contents.len()
    }

    /// Word `i` of content `c`.
    fn word(&self, c: usize, i: usize) -> u64 {
        let c = self.contents[c];
        let mut b: [u8; 8] = self.bases[c.group as usize][i * 8..i * 8 + 8]
            .try_into()
            .unwrap();
        for (off, x) in [(0, c.x[0]), (1, c.x[1]), (3, c.x[2])] {
            let at = c.at as usize + off;
            if at / 8 == i {
                b[at % 8] ^= x;
            }
        }
        u64::from_be_bytes(b)
    }

    /// Content `c` as a query.
    fn query(&self, c: usize) -> WordKey<impl Fn(usize) -> u64 + '_> {
        WordKey(move |i| self.word(c, i))
    }
}

/// The tree's view of a shared pool (a newtype: `KeySource` cannot be implemented on `Arc` here).
struct Src(Arc<Pool>);

impl KeySource for Src {
    fn word(&self, id: KeyId, i: usize) -> u64 {
        assert!(
            !self.0.released[id as usize].load(Ordering::Relaxed),
            "the tree read key {id} after releasing it"
        );
        self.0.word(self.0.content_of(id), i)
    }
    fn release(&self, id: KeyId) {
        let was = self.0.released[id as usize].swap(true, Ordering::Relaxed);
        assert!(!was, "key {id} released twice");
        self.0.releases.fetch_add(1, Ordering::Relaxed);
    }
}

fn scale(shape: Shape) -> usize {
    match (cfg!(debug_assertions), shape) {
        (true, Shape::Short) => 1_000,
        (true, Shape::SharedPrefix) => 300,
        (false, Shape::Short) => 20_000,
        (false, Shape::SharedPrefix) => 5_000,
    }
}

/// Every (shape, threads, route bits) combination the tests run.
fn configs() -> impl Iterator<Item = (Shape, usize, u32)> {
    [Shape::Short, Shape::SharedPrefix]
        .into_iter()
        .flat_map(|s| [2, 4, 8].map(|t| (s, t)))
        .flat_map(|(s, t)| [(s, t, 0), (s, t, DEFAULT_ROUTE_BITS)])
}

#[test]
fn concurrent_inserts_of_identical_content_store_each_content_once() {
    // Without route bits the keys share deep tries; with the default most races on short keys are
    // on root edges (shared-prefix pages stay in a few clusters either way).
    for (shape, threads, route_bits) in configs() {
        let n = scale(shape);
        let p = Pool::new(shape, n, threads, threads as u64);
        let tree =
            Arc::new(SdTree::with_route_bits(Src(p.clone()), shape.key_len(), route_bits).unwrap());
        let barrier = Arc::new(Barrier::new(threads));
        let results: Vec<Vec<(bool, Entry)>> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..threads)
                .map(|t| {
                    let tree = tree.clone();
                    let barrier = barrier.clone();
                    s.spawn(move || {
                        barrier.wait();
                        // Each thread inserts its own ids of the same contents, in its own order.
                        let mut order: Vec<usize> = (0..n).collect();
                        let mut rng = rand::rngs::SmallRng::seed_from_u64(t as u64);
                        for i in (1..n).rev() {
                            order.swap(i, rng.gen_range(0..=i));
                        }
                        let mut out = vec![None; n];
                        for c in order {
                            let r = tree.insert_or_get((t * n + c) as KeyId).unwrap();
                            out[c] = Some((r.inserted(), r.entry()));
                        }
                        out.into_iter()
                            .map(|r| r.expect("every content inserted"))
                            .collect()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for c in 0..n {
            let winners = results.iter().filter(|r| r[c].0).count();
            assert_eq!(
                winners, 1,
                "{shape:?}: content {c} inserted {winners} times with {threads} threads"
            );
            let e = results[0][c].1;
            assert!(
                results.iter().all(|r| r[c].1 == e),
                "{shape:?}: threads disagree on the entry of {c}"
            );
        }
        assert_eq!(tree.len(), n);
        tree.check_invariants().unwrap();
    }
}

/// Rounds of toggling in `removals_race_inserts_and_lookups`; every insertion uses a fresh id
/// (`round * n + content`), so a released id is never stored again and any read of it is a bug.
const ROUNDS: usize = 3;

#[test]
fn removals_race_inserts_and_lookups() {
    for (shape, threads, route_bits) in configs() {
        let n = scale(shape);
        // Contents 0..n: thread t owns contents c with c % threads == t.
        let p = Pool::new(shape, n, ROUNDS + 1, 100 + threads as u64);
        let tree =
            Arc::new(SdTree::with_route_bits(Src(p.clone()), shape.key_len(), route_bits).unwrap());
        // Start with the even contents stored.
        let stored: Vec<Mutex<Option<Entry>>> = (0..n).map(|_| Mutex::new(None)).collect();
        for c in (0..n).step_by(2) {
            *stored[c].lock().unwrap() = Some(tree.insert_or_get(c as KeyId).unwrap().entry());
        }
        let barrier = Barrier::new(threads);
        std::thread::scope(|s| {
            for t in 0..threads {
                let (tree, stored, barrier, p) = (&tree, &stored, &barrier, &p);
                s.spawn(move || {
                    barrier.wait();
                    let mut rng = rand::rngs::SmallRng::seed_from_u64(t as u64 + 77);
                    for round in 1..=ROUNDS {
                        for c in (t..n).step_by(threads) {
                            let mut slot = stored[c].lock().unwrap();
                            match *slot {
                                // Toggle: remove what is stored, insert what is not.
                                Some(e) => {
                                    assert!(tree.remove(e), "remove of a stored entry failed");
                                    *slot = None;
                                }
                                None => {
                                    let id = (round * n + c) as KeyId;
                                    let r = tree.insert_or_get(id).unwrap();
                                    assert!(
                                        r.inserted(),
                                        "content {c} was present while owned-absent"
                                    );
                                    *slot = Some(r.entry());
                                }
                            }
                            drop(slot);
                            // Lookups of other threads' contents see them present or absent, and a
                            // hit always names the content asked for.
                            let other = rng.gen_range(0..n);
                            if let Some(e) = tree.lookup(&p.query(other)) {
                                assert_eq!(p.content_of(e.key()), other);
                            }
                        }
                    }
                });
            }
        });
        // After three toggles, every content is in the opposite state of the start.
        for (c, slot) in stored.iter().enumerate() {
            let present = tree.lookup(&p.query(c)).is_some();
            assert_eq!(present, c % 2 == 1, "content {c} has the wrong final state");
            assert_eq!(present, slot.lock().unwrap().is_some());
        }
        assert_eq!(tree.len(), n / 2);
        tree.check_invariants().unwrap();
        // Removed keys are released after a grace period. Each flush collects a few bags of the
        // global queue, oldest first, and earlier rounds of this test left many; exiting workers
        // hand their last bags over in thread-local destructors, which may run after the scope ends.
        let mut flushes = 0;
        while p.releases.load(Ordering::Relaxed) == 0 && flushes < 1_000_000 {
            crossbeam_epoch::pin().flush();
            flushes += 1;
            if flushes % 1000 == 0 {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        }
        assert!(
            p.releases.load(Ordering::Relaxed) > 0,
            "no removed key was released after {flushes} flushes ({shape:?}, {threads} threads, {route_bits} route bits)"
        );
    }
}
