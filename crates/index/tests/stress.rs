//! Multithreaded stress of the SD tree: concurrent inserts of identical content, removals racing
//! inserts of neighbouring keys, and lookups throughout; invariants checked at the end of each round.
//! Run in release mode in CI (`cargo test --release`); debug mode uses fewer keys.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Barrier, Mutex};

use pageone_index::{Entry, Key, KeyId, KeySource, SdTree, DEFAULT_ROUTE_BITS};
use rand::{Rng, SeedableRng};

const KEY_LEN: usize = 64;

struct Pool {
    keys: Vec<[u8; KEY_LEN]>,
    released: AtomicUsize,
}

/// The tree's view of a shared pool (a newtype: `KeySource` cannot be implemented on `Arc` here).
struct Src(Arc<Pool>);

impl KeySource for Src {
    fn word(&self, id: KeyId, i: usize) -> u64 {
        self.0.keys[id as usize].as_slice().word(i)
    }
    fn release(&self, _id: KeyId) {
        self.0.released.fetch_add(1, Ordering::Relaxed);
    }
}

/// `copies` ids per content; contents share zero prefixes and long common runs, so neighbours are
/// siblings in the trie and splices race with inserts.
fn pool(contents: usize, copies: usize, seed: u64) -> Arc<Pool> {
    let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
    let mut set = std::collections::HashSet::new();
    while set.len() < contents {
        let mut k = [0u8; KEY_LEN];
        let off = rng.gen_range(0..KEY_LEN - 4);
        k[off] = rng.gen_range(1..4);
        k[off + 1] = rng.gen();
        k[off + 3] = rng.gen_range(0..2);
        set.insert(k);
    }
    let contents: Vec<_> = set.into_iter().collect();
    let mut keys = Vec::new();
    for _ in 0..copies {
        keys.extend_from_slice(&contents);
    }
    Arc::new(Pool {
        keys,
        released: AtomicUsize::new(0),
    })
}

fn scale() -> usize {
    if cfg!(debug_assertions) {
        1_000
    } else {
        20_000
    }
}

#[test]
fn concurrent_inserts_of_identical_content_store_each_content_once() {
    // Without route bits the keys share deep tries; with the default most races are on root edges.
    for (threads, route_bits) in [2, 4, 8]
        .into_iter()
        .flat_map(|t| [(t, 0), (t, DEFAULT_ROUTE_BITS)])
    {
        let n = scale();
        let p = pool(n, threads, threads as u64);
        let tree = Arc::new(SdTree::with_route_bits(Src(p.clone()), KEY_LEN, route_bits).unwrap());
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
                "content {c} inserted {winners} times with {threads} threads"
            );
            let e = results[0][c].1;
            assert!(
                results.iter().all(|r| r[c].1 == e),
                "threads disagree on the entry of {c}"
            );
        }
        assert_eq!(tree.len(), n);
        tree.check_invariants().unwrap();
    }
}

#[test]
fn removals_race_inserts_and_lookups() {
    for (threads, route_bits) in [2, 4, 8]
        .into_iter()
        .flat_map(|t| [(t, 0), (t, DEFAULT_ROUTE_BITS)])
    {
        let n = scale();
        // Contents 0..n: thread t owns contents c with c % threads == t.
        let p = pool(n, 1, 100 + threads as u64);
        let tree = Arc::new(SdTree::with_route_bits(Src(p.clone()), KEY_LEN, route_bits).unwrap());
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
                    for round in 0..3 {
                        for c in (t..n).step_by(threads) {
                            let mut slot = stored[c].lock().unwrap();
                            match *slot {
                                // Toggle: remove what is stored, insert what is not.
                                Some(e) => {
                                    assert!(tree.remove(e), "remove of a stored entry failed");
                                    *slot = None;
                                }
                                None => {
                                    let r = tree.insert_or_get(c as KeyId).unwrap();
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
                            if let Some(e) = tree.lookup(p.keys[other].as_slice()) {
                                assert_eq!(p.keys[e.key() as usize], p.keys[other]);
                            }
                        }
                        let _ = round;
                    }
                });
            }
        });
        // After three toggles, every content is in the opposite state of the start.
        for (c, slot) in stored.iter().enumerate() {
            let present = tree.lookup(p.keys[c].as_slice()).is_some();
            assert_eq!(present, c % 2 == 1, "content {c} has the wrong final state");
            assert_eq!(present, slot.lock().unwrap().is_some());
        }
        assert_eq!(tree.len(), n / 2);
        tree.check_invariants().unwrap();
        // Removed keys are released after a grace period. Each flush collects a few bags of the
        // global queue, oldest first, and earlier rounds of this test left many; exiting workers
        // hand their last bags over in thread-local destructors, which may run after the scope ends.
        let mut flushes = 0;
        while p.released.load(Ordering::Relaxed) == 0 && flushes < 1_000_000 {
            crossbeam_epoch::pin().flush();
            flushes += 1;
            if flushes % 1000 == 0 {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        }
        assert!(
            p.released.load(Ordering::Relaxed) > 0,
            "no removed key was released after {flushes} flushes ({threads} threads, {route_bits} route bits)"
        );
    }
}
