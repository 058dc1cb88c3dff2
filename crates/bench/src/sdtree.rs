//! `pageone bench sdtree`: the SD tree against a KSM-style memcmp-ordered tree and a hash index.
//!
//! Keys are 4 KiB pages of two kinds: "easy", the seed's (a random 8-byte value at offset 0, the
//! rest zero; see [`crate::dedup::fill_page`]), and "hard" (`fill_hard_key`): pages of random
//! non-zero bytes in 16 groups, each page identical to the others of its group for its first 2 to
//! 4 KiB and differing only after that, so that telling keys apart means reading kilobytes of
//! shared prefix (no zero run to skip, no difference in the first words). `keys` distinct pages are
//! inserted, then present keys (hits) and absent keys of the same kind (misses) are looked up in a
//! shuffled order, with 1 and 2 threads. Baselines:
//!
//! * memcmp tree: a `BTreeMap` ordered by the page bytes (every node visit compares from byte 0,
//!   as KSM's red-black trees do), behind a `RwLock` for two threads (readers share the lock, which
//!   favours the baseline: KSM serialises on a mutex);
//! * hash index: xxh3-128 of the whole page in a `HashMap`, confirmed by a full memcmp.
//!
//! All keys live in one read-only buffer built before timing; the SD tree reads them in place
//! through its `KeySource`.

use std::borrow::Borrow;
use std::collections::{BTreeMap, HashMap};
use std::sync::RwLock;
use std::time::Instant;

use pageone_index::{KeyId, KeySource, SdTree};
use rand::seq::SliceRandom;
use rand::SeedableRng;

use crate::dedup::{fill_page, Data};

const PAGE: usize = 4096;
const WORDS: usize = PAGE / 8;

/// The keys of one data set: `present` keys (ids `0..present`), then `absent` ones.
pub struct KeySet {
    words: Vec<u64>,
    pub present: usize,
    pub absent: usize,
}

impl KeySet {
    pub fn new(data: Data, present: usize, absent: usize) -> Self {
        let n = present + absent;
        let mut words = vec![0u64; n * WORDS];
        let groups = HardGroups::new();
        for (i, page) in words.chunks_mut(WORDS).enumerate() {
            match data {
                // SAFETY: `page` is 4096 bytes of a buffer this function owns.
                Data::Easy => unsafe { fill_page(page.as_mut_ptr().cast(), data, i as u64) },
                Data::Hard => fill_hard_key(page, &groups, i as u64),
            }
        }
        Self {
            words,
            present,
            absent,
        }
    }

    pub fn bytes(&self, id: usize) -> &[u8] {
        let w = &self.words[id * WORDS..(id + 1) * WORDS];
        // SAFETY: 512 initialised u64s are 4096 initialised bytes; u8 has no alignment needs.
        unsafe { std::slice::from_raw_parts(w.as_ptr().cast(), PAGE) }
    }
}

/// Groups of hard keys.
const HARD_GROUPS: usize = 16;
/// Prefix lengths a hard key shares with its group: 2048, 2112, ..., 4032 bytes.
const HARD_PREFIXES: u64 = 32;

/// SplitMix64: a seeded, stateless generator, so every run sees the same keys.
fn splitmix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Eight random non-zero bytes from seed `x`.
fn nonzero_bytes(x: u64) -> [u8; 8] {
    splitmix(x)
        .to_le_bytes()
        .map(|b| if b == 0 { 0x5A } else { b })
}

/// The page each group of hard keys shares a prefix of: random non-zero bytes.
struct HardGroups(Vec<[u8; PAGE]>);

impl HardGroups {
    fn new() -> Self {
        Self(
            (0..HARD_GROUPS as u64)
                .map(|g| {
                    let mut page = [0u8; PAGE];
                    for (w, b) in page.chunks_mut(8).enumerate() {
                        b.copy_from_slice(&nonzero_bytes((g << 32) | w as u64));
                    }
                    page
                })
                .collect(),
        )
    }
}

/// Writes hard key `i` into `page` (512 words): its group's page for the first `2048 + 64k`
/// bytes (`k` random below 32), then bytes of its own: random and non-zero, the first one
/// different from the group's, the last eight naming `i` (a nibble each, `0x80 | nibble`), so
/// every key is distinct and non-zero throughout.
fn fill_hard_key(page: &mut [u64], groups: &HardGroups, i: u64) {
    let group = &groups.0[(splitmix(i ^ 0xA5A5) % HARD_GROUPS as u64) as usize];
    let shared = 2048 + 64 * (splitmix(i ^ 0x5A5A) % HARD_PREFIXES) as usize;
    let mut bytes = [0u8; PAGE];
    bytes[..shared].copy_from_slice(&group[..shared]);
    for (w, b) in bytes.chunks_mut(8).enumerate().skip(shared / 8) {
        b.copy_from_slice(&nonzero_bytes(splitmix(i) ^ w as u64));
    }
    if bytes[shared] == group[shared] {
        bytes[shared] = !group[shared] | 1;
    }
    for (k, b) in bytes[PAGE - 8..].iter_mut().enumerate() {
        *b = 0x80 | ((i >> (4 * k)) & 0xF) as u8;
    }
    for (w, b) in page.iter_mut().zip(bytes.chunks(8)) {
        // The page's bytes in memory order, as `KeySet::bytes` and `SetKeys` read them.
        *w = u64::from_ne_bytes(b.try_into().expect("8 bytes"));
    }
}

/// The SD tree's view of a key set (read-only for the benchmark's lifetime, so plain reads).
struct SetKeys(&'static KeySet);

impl KeySource for SetKeys {
    fn word(&self, id: KeyId, i: usize) -> u64 {
        u64::from_be(self.0.words[id as usize * WORDS + i])
    }
}

/// Throughputs and bytes examined for one structure, data set and thread count.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Row {
    pub structure: &'static str,
    pub data: Data,
    pub threads: usize,
    pub insert_ops_per_s: f64,
    pub hit_ops_per_s: f64,
    pub miss_ops_per_s: f64,
    pub bytes_examined_per_miss: f64,
}

/// A structure under test, behind one interface.
trait Index: Sync {
    fn insert(&self, id: usize);
    fn lookup(&self, key: &[u8]) -> bool;
}

struct Sd(SdTree<SetKeys>);
impl Index for Sd {
    fn insert(&self, id: usize) {
        self.0.insert_or_get(id as KeyId).expect("arena has room");
    }
    fn lookup(&self, key: &[u8]) -> bool {
        self.0.lookup(key).is_some()
    }
}

/// A page compared with memcmp from byte 0, as KSM's trees do.
#[derive(PartialEq, Eq, PartialOrd, Ord)]
struct PageRef(&'static [u8]);

impl Borrow<[u8]> for PageRef {
    fn borrow(&self) -> &[u8] {
        self.0
    }
}

struct MemcmpTree {
    set: &'static KeySet,
    map: RwLock<BTreeMap<PageRef, u32>>,
}
impl Index for MemcmpTree {
    fn insert(&self, id: usize) {
        let mut m = self.map.write().unwrap_or_else(|e| e.into_inner());
        m.entry(PageRef(self.set.bytes(id))).or_insert(id as u32);
    }
    fn lookup(&self, key: &[u8]) -> bool {
        let m = self.map.read().unwrap_or_else(|e| e.into_inner());
        m.contains_key(key)
    }
}

struct HashIndex {
    set: &'static KeySet,
    map: RwLock<HashMap<u128, Vec<u32>>>,
}
impl Index for HashIndex {
    fn insert(&self, id: usize) {
        let key = self.set.bytes(id);
        let h = xxhash_rust::xxh3::xxh3_128(key);
        let mut m = self.map.write().unwrap_or_else(|e| e.into_inner());
        let v = m.entry(h).or_default();
        if !v.iter().any(|&o| self.set.bytes(o as usize) == key) {
            v.push(id as u32);
        }
    }
    fn lookup(&self, key: &[u8]) -> bool {
        let h = xxhash_rust::xxh3::xxh3_128(key);
        let m = self.map.read().unwrap_or_else(|e| e.into_inner());
        m.get(&h)
            .is_some_and(|v| v.iter().any(|&o| self.set.bytes(o as usize) == key))
    }
}

/// Runs `f(part)` on `threads` threads and returns the wall time in seconds.
fn timed(threads: usize, f: impl Fn(usize) + Sync) -> f64 {
    let t = Instant::now();
    std::thread::scope(|s| {
        for p in 0..threads {
            let f = &f;
            s.spawn(move || f(p));
        }
    });
    t.elapsed().as_secs_f64()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// One sample of one structure on one key set with `threads` threads: ops/s for insert, hit,
/// miss.
fn sample(name: &str, set: &'static KeySet, threads: usize, idx: &dyn Index) -> [f64; 3] {
    let mut rng = rand::rngs::SmallRng::seed_from_u64(7);
    let mut hits: Vec<usize> = (0..set.present).collect();
    hits.shuffle(&mut rng);
    let mut misses: Vec<usize> = (set.present..set.present + set.absent).collect();
    misses.shuffle(&mut rng);
    let per = set.present.div_ceil(threads);
    let t = timed(threads, |p| {
        for id in (p * per)..((p + 1) * per).min(set.present) {
            idx.insert(id);
        }
    });
    let ins = set.present as f64 / t;
    // Every thread looks up every key (in its own rotation of the shuffled order).
    let t = timed(threads, |p| {
        let mut found = 0usize;
        let rot = p * hits.len() / threads;
        for k in 0..hits.len() {
            found += idx.lookup(set.bytes(hits[(k + rot) % hits.len()])) as usize;
        }
        assert_eq!(found, hits.len(), "{name}: a present key was not found");
    });
    let hit = (hits.len() * threads) as f64 / t;
    let t = timed(threads, |p| {
        let rot = p * misses.len() / threads;
        for k in 0..misses.len() {
            assert!(
                !idx.lookup(set.bytes(misses[(k + rot) % misses.len()])),
                "{name}: false hit"
            );
        }
    });
    let miss = (misses.len() * threads) as f64 / t;
    [ins, hit, miss]
}

/// Bytes a memcmp-ordered tree compares on a miss, counted by walking a sorted array the way a
/// balanced search tree would (binary search: the same comparisons, from byte 0 each time).
fn memcmp_bytes_per_miss(set: &KeySet) -> f64 {
    let mut sorted: Vec<usize> = (0..set.present).collect();
    sorted.sort_by(|&a, &b| set.bytes(a).cmp(set.bytes(b)));
    let mut total = 0u64;
    for q in set.present..set.present + set.absent {
        let key = set.bytes(q);
        let (mut lo, mut hi) = (0usize, sorted.len());
        while lo < hi {
            let mid = (lo + hi) / 2;
            let other = set.bytes(sorted[mid]);
            let d = key
                .iter()
                .zip(other)
                .position(|(a, b)| a != b)
                .unwrap_or(PAGE - 1);
            total += d as u64 + 1;
            if key < other {
                hi = mid;
            } else {
                lo = mid + 1;
            }
        }
    }
    total as f64 / set.absent as f64
}

/// The SD tree's bytes examined per miss, from its own counters.
fn sdtree_bytes_per_miss(arc: &'static KeySet) -> f64 {
    let t = SdTree::new(SetKeys(arc), PAGE).expect("tree");
    for id in 0..arc.present {
        t.insert_or_get(id as KeyId).expect("room");
    }
    let mut total = 0u64;
    for q in arc.present..arc.present + arc.absent {
        let (r, st) = t.lookup_with_stats(arc.bytes(q));
        assert!(r.is_none());
        total += st.query_bytes as u64;
    }
    total as f64 / arc.absent as f64
}

/// The whole benchmark. Runs are the outer loop, so every structure, data set and thread count
/// is sampled in every run and slow drifts of the machine spread evenly over them.
pub fn run(keys: usize, runs: usize, log: &mut dyn FnMut(&str)) -> Vec<Row> {
    const NAMES: [&str; 3] = ["sdtree", "memcmp_tree", "hash_xxh3"];
    let mut sets = Vec::new();
    for data in [Data::Easy, Data::Hard] {
        log(&format!("building {keys} {data} keys..."));
        // Structures borrow keys for 'static; the sets live until the process exits.
        let set: &'static KeySet = Box::leak(Box::new(KeySet::new(data, keys, keys / 4)));
        let bytes = [
            sdtree_bytes_per_miss(set),
            memcmp_bytes_per_miss(set),
            PAGE as f64,
        ];
        sets.push((data, set, bytes));
    }
    // samples[(set, threads, structure)] = per-run [insert, hit, miss]
    let mut samples: Vec<Vec<[f64; 3]>> = vec![Vec::new(); 2 * 2 * 3];
    for r in 0..runs {
        log(&format!("run {} of {runs}", r + 1));
        for (si, &(_, set, _)) in sets.iter().enumerate() {
            for (ti, threads) in [1usize, 2].into_iter().enumerate() {
                for (ni, name) in NAMES.into_iter().enumerate() {
                    let idx: Box<dyn Index> = match ni {
                        0 => Box::new(Sd(SdTree::new(SetKeys(set), PAGE).expect("tree"))),
                        1 => Box::new(MemcmpTree {
                            set,
                            map: RwLock::new(BTreeMap::new()),
                        }),
                        _ => Box::new(HashIndex {
                            set,
                            map: RwLock::new(HashMap::new()),
                        }),
                    };
                    samples[(si * 2 + ti) * 3 + ni].push(sample(name, set, threads, &*idx));
                }
            }
        }
    }
    let mut rows = Vec::new();
    for (si, &(data, _, bytes)) in sets.iter().enumerate() {
        for (ti, threads) in [1usize, 2].into_iter().enumerate() {
            for (ni, name) in NAMES.into_iter().enumerate() {
                let s = &samples[(si * 2 + ti) * 3 + ni];
                let col = |c: usize| median(s.iter().map(|x| x[c]).collect());
                rows.push(Row {
                    structure: name,
                    data,
                    threads,
                    insert_ops_per_s: col(0),
                    hit_ops_per_s: col(1),
                    miss_ops_per_s: col(2),
                    bytes_examined_per_miss: bytes[ni],
                });
            }
        }
    }
    rows
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_have_their_shapes() {
        let lcp = |a: &[u8], b: &[u8]| a.iter().zip(b).take_while(|(x, y)| x == y).count();
        for data in [Data::Easy, Data::Hard] {
            let s = KeySet::new(data, 160, 40);
            let mut seen = std::collections::HashSet::new();
            for id in 0..200 {
                let b = s.bytes(id);
                assert!(seen.insert(b.to_vec()), "duplicate key");
                if data == Data::Easy {
                    let first = b.iter().position(|&x| x != 0).expect("nonzero key");
                    let last = b.iter().rposition(|&x| x != 0).unwrap();
                    assert!(
                        first < 8 && last - first < 8,
                        "easy key {id} spans {first}..={last}"
                    );
                    continue;
                }
                assert!(b.iter().all(|&x| x != 0), "hard key {id} has a zero byte");
                // 200 keys in 16 groups: every key has group mates, and shares 2 to 4 KiB with
                // the closest one (and never the bytes that name it).
                let shared = (0..200)
                    .filter(|&o| o != id)
                    .map(|o| lcp(b, s.bytes(o)))
                    .max()
                    .unwrap();
                assert!(
                    (2048..PAGE - 8).contains(&shared),
                    "hard key {id} shares {shared} bytes"
                );
            }
        }
    }

    #[test]
    fn every_structure_finds_present_and_rejects_absent_keys() {
        let rows = run(256, 1, &mut |_| {});
        assert_eq!(rows.len(), 12);
        for r in rows {
            assert!(r.insert_ops_per_s > 0.0 && r.hit_ops_per_s > 0.0 && r.miss_ops_per_s > 0.0);
        }
    }
}
