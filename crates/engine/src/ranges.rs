//! Sets of addresses kept as ranges: where the engine locks what it maps (per region, see
//! `locking`), and where the program advised its memory not to be dumped or inherited (see
//! `advice`).

use std::ops::Range;

/// A set of addresses (or offsets) kept as ranges, sorted and apart.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct RangeSet(Vec<Range<usize>>);

impl RangeSet {
    pub(crate) const fn new() -> Self {
        RangeSet(Vec::new())
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Adds `r`, joining the ranges it touches.
    pub(crate) fn add(&mut self, r: Range<usize>) {
        if r.is_empty() {
            return;
        }
        let first = self.0.partition_point(|x| x.end < r.start);
        let last = self.0.partition_point(|x| x.start <= r.end);
        let joined = self.0[first..last]
            .iter()
            .fold(r, |a, x| a.start.min(x.start)..a.end.max(x.end));
        self.0.splice(first..last, [joined]);
    }

    /// Takes `r` out.
    pub(crate) fn remove(&mut self, r: Range<usize>) {
        if r.is_empty() || self.0.is_empty() {
            return;
        }
        let first = self.0.partition_point(|x| x.end <= r.start);
        let last = self.0.partition_point(|x| x.start < r.end);
        let mut kept = Vec::new();
        for x in &self.0[first..last] {
            if x.start < r.start {
                kept.push(x.start..r.start);
            }
            if x.end > r.end {
                kept.push(r.end..x.end);
            }
        }
        self.0.splice(first..last, kept);
    }

    /// Splits at offset `at`: keeps the ranges below it, returns those above, as offsets from
    /// `at` (a region split there: see `layout::split_off`).
    pub(crate) fn split_off(&mut self, at: usize) -> RangeSet {
        let i = self.0.partition_point(|x| x.end <= at);
        let mut right = self.0.split_off(i);
        if let Some(first) = right.first_mut().filter(|x| x.start < at) {
            self.0.push(first.start..at);
            first.start = at;
        }
        right.iter_mut().for_each(|x| *x = x.start - at..x.end - at);
        RangeSet(right)
    }

    /// The parts of `r` in the set, in order.
    pub(crate) fn within(&self, r: Range<usize>) -> impl Iterator<Item = Range<usize>> + '_ {
        let first = self.0.partition_point(|x| x.end <= r.start);
        self.0[first..]
            .iter()
            .take_while(move |x| x.start < r.end)
            .map(move |x| x.start.max(r.start)..x.end.min(r.end))
            .filter(|p| !p.is_empty())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn pages(v: &RangeSet) -> Vec<bool> {
        let mut out = vec![false; 64];
        for r in &v.0 {
            out[r.clone()].iter_mut().for_each(|b| *b = true);
        }
        out
    }

    proptest! {
        /// Ranges added and removed at random hold exactly the pages a plain set would, sorted,
        /// apart and never empty.
        #[test]
        fn ranges_behave_as_a_set_of_pages(ops in proptest::collection::vec((any::<bool>(), 0usize..64, 0usize..64), 0..40)) {
            let mut v = RangeSet::default();
            let mut model = vec![false; 64];
            for (add, a, b) in ops {
                let r = a.min(b)..a.max(b);
                if add {
                    v.add(r.clone());
                } else {
                    v.remove(r.clone());
                }
                model[r].iter_mut().for_each(|m| *m = add);
                prop_assert_eq!(pages(&v), model.clone());
                prop_assert!(v.0.windows(2).all(|w| w[0].end < w[1].start));
                prop_assert!(v.0.iter().all(|r| !r.is_empty()));
            }
        }

        /// A split keeps what lies below the offset and gives the rest, counted from it.
        #[test]
        fn a_split_divides_the_pages(adds in proptest::collection::vec((0usize..64, 0usize..64), 0..10), at in 0usize..64) {
            let mut v = RangeSet::default();
            for (x, y) in adds {
                v.add(x.min(y)..x.max(y));
            }
            let all = pages(&v);
            let right = v.split_off(at);
            let (left, right) = (pages(&v), pages(&right));
            for i in 0..64 {
                prop_assert_eq!(left[i], all[i] && i < at);
                prop_assert_eq!(right[i], i + at < 64 && all[i + at]);
            }
        }

        /// `within` gives the locked parts of a range, clipped to it.
        #[test]
        fn within_clips_to_the_range(adds in proptest::collection::vec((0usize..64, 0usize..64), 0..10), a in 0usize..64, b in 0usize..64) {
            let mut v = RangeSet::default();
            for (x, y) in adds {
                v.add(x.min(y)..x.max(y));
            }
            let r = a.min(b)..a.max(b);
            let mut got = vec![false; 64];
            for p in v.within(r.clone()) {
                prop_assert!(p.start >= r.start && p.end <= r.end && !p.is_empty());
                got[p].iter_mut().for_each(|g| *g = true);
            }
            let want: Vec<bool> = pages(&v).iter().enumerate().map(|(i, &l)| l && r.contains(&i)).collect();
            prop_assert_eq!(got, want);
        }
    }
}
