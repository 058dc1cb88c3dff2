//! Where the shared contents lie in each process (or region) of the merging benchmark.
//!
//! Every region holds the same contents `0..pages`, each exactly once; the layout decides at which
//! position each content sits:
//!
//! * [`Layout::Clustered`]: position `i` holds content `i` in every region (long runs at the same
//!   order, what pageone's mappings are best at).
//! * [`Layout::Scattered`]: each region holds the contents in its own random order (guests' page
//!   caches once they diverge).
//! * [`Layout::Runs`]: the contents are cut into runs of random length 1 to [`MAX_RUN`] pages (the
//!   same runs in every region), and each region lays the runs out in its own random order: each
//!   run is whole and in order, at a different place in each region.
//! * [`Layout::Mixed`]: the first half of each region scattered (its contents in the region's own
//!   random order), the second half clustered: where the mapping budget binds, merges that save
//!   many pages per mapping should not wait behind single pages at lower addresses.
//!
//! The writers of the benchmark write every [`WRITER_STRIDE`]th position; [`possible_saving`]
//! counts what can still be saved then.

use std::ops::Range;

use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

/// The longest run of [`Layout::Runs`], in pages.
pub const MAX_RUN: u32 = 64;

/// Writers write the positions that are multiples of this.
pub const WRITER_STRIDE: usize = 16;

/// A layout of the shared contents (see the module's documentation).
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize, clap::ValueEnum,
)]
#[serde(rename_all = "lowercase")]
pub enum Layout {
    Clustered,
    Scattered,
    Runs,
    Mixed,
}

impl std::fmt::Display for Layout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Layout::Clustered => "clustered",
            Layout::Scattered => "scattered",
            Layout::Runs => "runs",
            Layout::Mixed => "mixed",
        })
    }
}

fn rng(seed: u64, region: usize) -> rand::rngs::SmallRng {
    // Distinct streams per region; the runs' cut uses region usize::MAX.
    rand::rngs::SmallRng::seed_from_u64(seed ^ (region as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15))
}

/// The runs the contents `0..pages` are cut into for `seed`: consecutive, covering all of them,
/// each 1 to [`MAX_RUN`] long (the last one possibly shorter than drawn).
pub fn runs(pages: usize, seed: u64) -> Vec<Range<u32>> {
    let mut r = rng(seed, usize::MAX);
    let mut out = Vec::new();
    let mut start = 0u32;
    while (start as usize) < pages {
        let len = r.gen_range(1..=MAX_RUN).min(pages as u32 - start);
        out.push(start..start + len);
        start += len;
    }
    out
}

/// The content at each position of region `region` (`pages` pages) under `layout`.
pub fn contents(layout: Layout, pages: usize, region: usize, seed: u64) -> Vec<u32> {
    match layout {
        Layout::Clustered => (0..pages as u32).collect(),
        Layout::Scattered => {
            let mut v: Vec<u32> = (0..pages as u32).collect();
            v.shuffle(&mut rng(seed, region));
            v
        }
        Layout::Runs => {
            let mut rs = runs(pages, seed);
            rs.shuffle(&mut rng(seed, region));
            rs.into_iter().flatten().collect()
        }
        Layout::Mixed => {
            let half = (pages / 2) as u32;
            let mut v: Vec<u32> = (0..half).collect();
            v.shuffle(&mut rng(seed, region));
            v.extend(half..pages as u32);
            v
        }
    }
}

/// Whether writers (if any) write position `i`.
pub fn written(i: usize) -> bool {
    i % WRITER_STRIDE == 0
}

/// Pages that merging can save: for each content, one less than the number of regions holding it
/// at a position nobody writes (`writers`: whether the positions of [`written`] are written).
pub fn possible_saving(regions: &[Vec<u32>], writers: bool, zero_every: usize) -> u64 {
    let n = regions.iter().map(Vec::len).max().unwrap_or(0);
    let mut stable = vec![0u32; n];
    for r in regions {
        for (i, &c) in r.iter().enumerate() {
            if !(writers && written(i)) {
                stable[c as usize] += 1;
            }
        }
    }
    stable
        .iter()
        .enumerate()
        .map(|(c, &k)| {
            // A zero page saves all of itself (released; KSM keeps one page for all of them at
            // most).
            let zero = is_zero_content(c as u32, zero_every);
            (if zero { k } else { k.saturating_sub(1) }) as u64
        })
        .sum()
}

/// Whether content `c` is all zero when one content in `zero_every` is (0: none): those whose
/// number is `zero_every / 2` past a multiple of it, so that in the clustered layout zero pages
/// lie alone between pages of other contents.
pub fn is_zero_content(c: u32, zero_every: usize) -> bool {
    zero_every > 1 && c as usize % zero_every == zero_every / 2
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn layout() -> impl Strategy<Value = Layout> {
        prop_oneof![
            Just(Layout::Clustered),
            Just(Layout::Scattered),
            Just(Layout::Runs),
            Just(Layout::Mixed)
        ]
    }

    proptest! {
        /// Every content appears exactly once in every region, whatever the layout.
        #[test]
        fn every_content_once_per_region(
            l in layout(), pages in 1usize..3000, regions in 1usize..5, seed in any::<u64>()
        ) {
            for k in 0..regions {
                let mut c = contents(l, pages, k, seed);
                prop_assert_eq!(c.len(), pages);
                c.sort_unstable();
                prop_assert!(c.iter().enumerate().all(|(i, &x)| x as usize == i));
            }
        }

        /// The runs cover the contents in order, each 1..=64 long, and every region holds each
        /// run whole and in order (somewhere).
        #[test]
        fn runs_are_whole_and_in_order_in_every_region(
            pages in 1usize..5000, regions in 1usize..4, seed in any::<u64>()
        ) {
            let rs = runs(pages, seed);
            let mut next = 0;
            for r in &rs {
                prop_assert_eq!(r.start, next);
                prop_assert!((1..=MAX_RUN as usize).contains(&r.len()), "run of {}", r.len());
                next = r.end;
            }
            prop_assert_eq!(next as usize, pages);
            for k in 0..regions {
                let c = contents(Layout::Runs, pages, k, seed);
                let mut at = vec![0usize; pages];
                for (i, &x) in c.iter().enumerate() {
                    at[x as usize] = i;
                }
                for r in &rs {
                    let first = at[r.start as usize];
                    for (j, x) in r.clone().enumerate() {
                        prop_assert_eq!(at[x as usize], first + j);
                    }
                }
            }
        }

        /// With no writers every content is saved in all regions but one; with writers, what
        /// they write is not counted, and never more is counted than without them.
        #[test]
        fn possible_saving_counts_unwritten_copies(
            l in layout(), pages in 1usize..2000, regions in 1usize..5, seed in any::<u64>()
        ) {
            let rs: Vec<_> = (0..regions).map(|k| contents(l, pages, k, seed)).collect();
            let all = possible_saving(&rs, false, 0);
            prop_assert_eq!(all, ((regions - 1) * pages) as u64);
            let with = possible_saving(&rs, true, 0);
            prop_assert!(with <= all);
            let written_per_region = pages.div_ceil(WRITER_STRIDE);
            prop_assert!(with >= all.saturating_sub((regions * written_per_region) as u64));
        }
    }

    #[test]
    fn clustered_is_the_identity_and_scattered_differs_per_region() {
        assert_eq!(contents(Layout::Clustered, 5, 3, 1), [0, 1, 2, 3, 4]);
        let a = contents(Layout::Scattered, 1000, 0, 7);
        let b = contents(Layout::Scattered, 1000, 1, 7);
        assert_ne!(a, b);
        assert_eq!(a, contents(Layout::Scattered, 1000, 0, 7), "seeded");
        let r0 = contents(Layout::Runs, 1000, 0, 7);
        assert_ne!(r0, contents(Layout::Runs, 1000, 1, 7));
    }

    #[test]
    fn clustered_writers_leave_fifteen_sixteenths_per_extra_region() {
        let rs: Vec<_> = (0..4)
            .map(|k| contents(Layout::Clustered, 1024, k, 0))
            .collect();
        assert_eq!(possible_saving(&rs, true, 0), 3 * (1024 - 64));
    }
}
