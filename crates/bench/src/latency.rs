//! Latency histograms: many nanosecond samples in little memory, percentiles within ~3%, the
//! largest sample exact.
//!
//! Values below 64 ns have a bucket each; above, each power of two is cut into 32 buckets, so a
//! bucket is at most 1/32 of its values wide. A percentile is read as the upper end of its bucket
//! (never below the true value, at most ~3% above), capped at the exact maximum.

/// Sub-buckets per power of two (2^5).
const SUB_BITS: u32 = 5;
const SUB: u64 = 1 << SUB_BITS;
/// Values below this have a bucket each.
const LINEAR: u64 = 2 * SUB;
/// Enough buckets for any u64.
const BUCKETS: usize = (LINEAR + (64 - SUB_BITS as u64 - 1) * SUB) as usize;

/// A histogram of nanosecond samples.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Histogram {
    counts: Vec<u64>,
    count: u64,
    max: u64,
    sum: u128,
}

impl Default for Histogram {
    fn default() -> Self {
        Self {
            counts: vec![0; BUCKETS],
            count: 0,
            max: 0,
            sum: 0,
        }
    }
}

fn bucket(v: u64) -> usize {
    if v < LINEAR {
        return v as usize;
    }
    let e = 63 - v.leading_zeros(); // >= SUB_BITS + 1
    let sub = (v >> (e - SUB_BITS)) & (SUB - 1);
    (LINEAR + (e - SUB_BITS - 1) as u64 * SUB + sub) as usize
}

/// The largest value of bucket `b`.
fn upper(b: usize) -> u64 {
    let b = b as u64;
    if b < LINEAR {
        return b;
    }
    let e = (b - LINEAR) / SUB + SUB_BITS as u64 + 1;
    let sub = (b - LINEAR) % SUB;
    let low = (1u64 << e) | (sub << (e - SUB_BITS as u64));
    // (The low bits of `low` are zero: `|` cannot overflow where `+` would, at the top.)
    low | ((1u64 << (e - SUB_BITS as u64)) - 1)
}

/// Percentiles of a histogram, in nanoseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Summary {
    pub count: u64,
    pub p50: u64,
    pub p99: u64,
    pub p999: u64,
    pub max: u64,
    pub mean: f64,
}

impl Histogram {
    pub fn record(&mut self, ns: u64) {
        self.counts[bucket(ns)] += 1;
        self.count += 1;
        self.max = self.max.max(ns);
        self.sum += ns as u128;
    }

    pub fn merge(&mut self, o: &Histogram) {
        for (a, b) in self.counts.iter_mut().zip(&o.counts) {
            *a += b;
        }
        self.count += o.count;
        self.max = self.max.max(o.max);
        self.sum += o.sum;
    }

    pub fn count(&self) -> u64 {
        self.count
    }

    pub fn max(&self) -> u64 {
        self.max
    }

    /// Samples at or above `ns` (counted by bucket: exact at bucket edges, else within a bucket).
    pub fn at_least(&self, ns: u64) -> u64 {
        self.counts[bucket(ns)..].iter().sum()
    }

    /// The value at quantile `q` (0..=1): the smallest bucket bound with at least `q` of the
    /// samples at or below it, capped at the maximum. 0 when empty.
    pub fn quantile(&self, q: f64) -> u64 {
        if self.count == 0 {
            return 0;
        }
        let want = ((q * self.count as f64).ceil() as u64).clamp(1, self.count);
        let mut seen = 0;
        for (b, &c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= want {
                return upper(b).min(self.max);
            }
        }
        self.max
    }

    pub fn summary(&self) -> Summary {
        Summary {
            count: self.count,
            p50: self.quantile(0.50),
            p99: self.quantile(0.99),
            p999: self.quantile(0.999),
            max: self.max,
            mean: if self.count == 0 {
                0.0
            } else {
                self.sum as f64 / self.count as f64
            },
        }
    }

    /// The non-empty buckets as (a value of the bucket, count) pairs: enough to rebuild the
    /// histogram in another process ([`Histogram::from_sparse`]).
    pub fn to_sparse(&self) -> Sparse {
        Sparse {
            buckets: self
                .counts
                .iter()
                .enumerate()
                .filter(|(_, &c)| c > 0)
                .map(|(b, &c)| (upper(b), c))
                .collect(),
            max: self.max,
            sum: self.sum as f64,
        }
    }

    pub fn from_sparse(s: &Sparse) -> Self {
        let mut h = Self::default();
        for &(v, c) in &s.buckets {
            h.counts[bucket(v)] += c;
            h.count += c;
        }
        h.max = s.max;
        h.sum = s.sum as u128;
        h
    }
}

/// A histogram as JSON carries it between processes.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Sparse {
    pub buckets: Vec<(u64, u64)>,
    pub max: u64,
    pub sum: f64,
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn buckets_tile_the_values() {
        let mut prev = None;
        for b in 0..BUCKETS {
            let hi = upper(b);
            assert_eq!(bucket(hi), b, "upper({b}) = {hi}");
            if let Some(p) = prev {
                assert_eq!(bucket(p + 1), b, "bucket {b} starts after {p}");
            }
            prev = Some(hi);
        }
        assert_eq!(prev, Some(u64::MAX));
    }

    proptest! {
        /// Percentiles are never below the exact ones and at most 1/32 above; the maximum and
        /// count are exact; merging is the same as recording both sets.
        #[test]
        fn percentiles_within_a_bucket_of_the_exact_ones(
            a in proptest::collection::vec(0u64..50_000_000_000, 1..400),
            b in proptest::collection::vec(0u64..5_000, 0..50),
        ) {
            let (mut h, mut hb) = (Histogram::default(), Histogram::default());
            a.iter().for_each(|&v| h.record(v));
            b.iter().for_each(|&v| hb.record(v));
            h.merge(&hb);
            let mut all: Vec<u64> = a.iter().chain(&b).copied().collect();
            all.sort_unstable();
            for q in [0.5, 0.9, 0.99, 0.999, 1.0] {
                let k = ((q * all.len() as f64).ceil() as usize).clamp(1, all.len()) - 1;
                let (exact, got) = (all[k], h.quantile(q));
                prop_assert!(got >= exact, "q {}: {} < {}", q, got, exact);
                prop_assert!(got <= exact + exact / 32 + 1, "q {}: {} vs {}", q, got, exact);
            }
            prop_assert_eq!(h.max(), *all.last().unwrap());
            prop_assert_eq!(h.count(), all.len() as u64);
            prop_assert_eq!(Histogram::from_sparse(&h.to_sparse()), h);
        }
    }

    #[test]
    fn counts_at_or_above_a_bound() {
        let mut h = Histogram::default();
        for v in [10, 100, 100_000, 2_000_000, 20_000_000] {
            h.record(v);
        }
        assert_eq!(h.at_least(100_000), 3);
        assert_eq!(h.at_least(1_000_000), 2);
        assert_eq!(h.at_least(10_000_000), 1);
        assert_eq!(h.summary().max, 20_000_000);
        assert_eq!(Histogram::default().summary().p99, 0);
    }
}
