//! A quick probe of SD-tree miss costs on the benchmark's key shapes (for tuning; the real benchmark
//! is `pageone bench sdtree`): `cargo run --release -p pageone-index --example misses [keys] [runs]`.
//! Prints per-run 1-thread insert/hit/miss throughput for easy and hard keys, interleaved, then the
//! medians, the hard/easy miss ratio, and what an average miss touched.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use pageone_index::{KeyId, KeySource, SdTree};
use rand::seq::SliceRandom;
use rand::SeedableRng;

const WORDS: usize = 512;

/// The benchmark's easy keys (crates/bench/src/dedup.rs, `fill_page`).
fn mix(mut x: u64) -> u64 {
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    x.wrapping_mul(0x2545_F491_4F6C_DD1D)
}

/// The benchmark's hard keys (crates/bench/src/sdtree.rs, `fill_hard_key`): 16 groups of
/// non-zero pages that share their first 2048 + 64k bytes (k < 32) with their group.
fn splitmix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn nonzero_bytes(x: u64) -> [u8; 8] {
    splitmix(x)
        .to_le_bytes()
        .map(|b| if b == 0 { 0x5A } else { b })
}

fn hard_key(groups: &[[u8; 4096]], bytes: &mut [u8], i: u64) {
    let group = &groups[(splitmix(i ^ 0xA5A5) % groups.len() as u64) as usize];
    let shared = 2048 + 64 * (splitmix(i ^ 0x5A5A) % 32) as usize;
    bytes[..shared].copy_from_slice(&group[..shared]);
    for (w, b) in bytes.chunks_mut(8).enumerate().skip(shared / 8) {
        b.copy_from_slice(&nonzero_bytes(splitmix(i) ^ w as u64));
    }
    if bytes[shared] == group[shared] {
        bytes[shared] = !group[shared] | 1;
    }
    for (k, b) in bytes[4096 - 8..].iter_mut().enumerate() {
        *b = 0x80 | ((i >> (4 * k)) & 0xF) as u8;
    }
}

fn keys(hard: bool, n: usize) -> Vec<u64> {
    let groups: Vec<[u8; 4096]> = (0..16u64)
        .map(|g| {
            let mut page = [0u8; 4096];
            for (w, b) in page.chunks_mut(8).enumerate() {
                b.copy_from_slice(&nonzero_bytes((g << 32) | w as u64));
            }
            page
        })
        .collect();
    let mut words = vec![0u64; n * WORDS];
    for (i, page) in words.chunks_mut(WORDS).enumerate() {
        let i = i as u64;
        let bytes: &mut [u8] =
            // SAFETY: a u64 slice viewed as bytes, same length in bytes, u8 has no alignment needs.
            unsafe { std::slice::from_raw_parts_mut(page.as_mut_ptr().cast(), WORDS * 8) };
        if hard {
            hard_key(&groups, bytes, i);
            continue;
        }
        let v = mix(i.wrapping_add(0x9E37_79B9_7F4A_7C15)) | 1;
        let v = (v & !0xFFFF_FFFF) | i;
        bytes[..8].copy_from_slice(&v.to_le_bytes());
    }
    words
}

struct Src(&'static [u64], Option<&'static AtomicU64>);

impl KeySource for Src {
    fn word(&self, id: KeyId, i: usize) -> u64 {
        if let Some(c) = self.1 {
            c.fetch_add(1, Ordering::Relaxed);
        }
        u64::from_be(self.0[id as usize * WORDS + i])
    }
}

fn page(words: &[u64], id: usize) -> &[u8] {
    let w = &words[id * WORDS..(id + 1) * WORDS];
    // SAFETY: 512 initialised u64s are 4096 initialised bytes.
    unsafe { std::slice::from_raw_parts(w.as_ptr().cast(), WORDS * 8) }
}

/// `ROUTE_BITS` from the environment, else the tree's default.
fn route_bits() -> u32 {
    std::env::var("ROUTE_BITS")
        .map(|v| v.parse().expect("ROUTE_BITS is a number"))
        .unwrap_or(pageone_index::DEFAULT_ROUTE_BITS)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("number"))
        .collect();
    let present = args.first().copied().unwrap_or(256 << 10);
    let runs = args.get(1).copied().unwrap_or(5);
    let absent = present / 4;
    let sets: Vec<(&str, &'static [u64])> = [("easy", false), ("hard", true)]
        .into_iter()
        .map(|(n, h)| (n, &*Vec::leak(keys(h, present + absent))))
        .collect();
    for &(name, words) in &sets {
        static READS: AtomicU64 = AtomicU64::new(0);
        let t = SdTree::with_route_bits(Src(words, Some(&READS)), 4096, route_bits()).unwrap();
        for id in 0..present {
            t.insert_or_get(id as KeyId).unwrap();
        }
        READS.store(0, Ordering::Relaxed);
        let (mut qb, mut nodes) = (0u64, 0u64);
        for q in present..present + absent {
            let (r, st) = t.lookup_with_stats(page(words, q));
            assert!(r.is_none());
            qb += st.query_bytes as u64;
            nodes += st.nodes as u64;
        }
        let a = absent as f64;
        println!(
            "{name}: per miss {:.1} query bytes, {:.2} nodes, {:.2} stored-key words; {} nodes allocated",
            qb as f64 / a,
            nodes as f64 / a,
            READS.load(Ordering::Relaxed) as f64 / a,
            t.nodes_allocated()
        );
    }
    let mut rng = rand::rngs::SmallRng::seed_from_u64(7);
    let mut hits: Vec<usize> = (0..present).collect();
    hits.shuffle(&mut rng);
    let mut misses: Vec<usize> = (present..present + absent).collect();
    misses.shuffle(&mut rng);
    let mut samples = vec![Vec::new(); 2];
    for r in 0..runs {
        for (si, &(name, words)) in sets.iter().enumerate() {
            let t = SdTree::with_route_bits(Src(words, None), 4096, route_bits()).unwrap();
            let s = Instant::now();
            for id in 0..present {
                t.insert_or_get(id as KeyId).unwrap();
            }
            let ins = present as f64 / s.elapsed().as_secs_f64();
            let s = Instant::now();
            for &h in &hits {
                assert!(t.lookup(page(words, h)).is_some());
            }
            let hit = present as f64 / s.elapsed().as_secs_f64();
            let s = Instant::now();
            for &m in &misses {
                assert!(t.lookup(page(words, m)).is_none());
            }
            let miss = absent as f64 / s.elapsed().as_secs_f64();
            println!("run {r} {name}: insert {ins:.0}/s hit {hit:.0}/s miss {miss:.0}/s");
            samples[si].push([ins, hit, miss]);
        }
    }
    let med = |si: usize, c: usize| median(samples[si].iter().map(|x| x[c]).collect());
    for (si, &(name, _)) in sets.iter().enumerate() {
        println!(
            "median {name}: insert {:.0}/s hit {:.0}/s miss {:.0}/s",
            med(si, 0),
            med(si, 1),
            med(si, 2)
        );
    }
    let ratios: Vec<f64> = (0..runs)
        .map(|r| samples[1][r][2] / samples[0][r][2])
        .collect();
    println!(
        "hard/easy miss: median of medians {:.3}; per run {:?}",
        med(1, 2) / med(0, 2),
        ratios
            .iter()
            .map(|x| (x * 1000.0).round() / 1000.0)
            .collect::<Vec<_>>()
    );
}
