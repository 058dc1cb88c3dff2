//! Ranges the program asked to merge that the engine could not register because of their
//! protection (`PROT_NONE`, read-only): the kernel keeps `VM_MERGEABLE` on such a mapping and
//! merges it once it is read/write, so the shim registers them when the program makes them so.
//!
//! A fixed number of disjoint page ranges, kept without allocation: the calls that consult them
//! (`munmap`, `mmap`, `mremap`, `mprotect`) are hot paths of some programs.

/// How many ranges are remembered: a program's reservations and the guard pages inside ranges it
/// marks mergeable. A range beyond it goes to the kernel's flag, as before ranges were remembered.
pub(crate) const CAPACITY: usize = 64;

/// A page range `[start, end)`, as a pair (copyable, so the store needs no allocation).
pub(crate) type Span = (usize, usize);

/// The remembered ranges: disjoint, not touching (neighbours are joined), in no order.
pub(crate) struct Pending {
    spans: [Span; CAPACITY],
    len: usize,
}

/// The parts of the remembered ranges taken out by [`Pending::cut`].
pub(crate) struct Cut {
    spans: [Span; CAPACITY],
    len: usize,
    /// A remembered part outside the range that could not be kept (a range cut in two while every
    /// slot is in use): the caller gives it to the kernel's flag.
    pub(crate) dropped: Option<Span>,
}

impl Cut {
    /// The parts taken out, in no order.
    pub(crate) fn spans(&self) -> &[Span] {
        &self.spans[..self.len]
    }
}

/// Every slot is in use and the range touches none of the remembered ones.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Full;

impl Pending {
    pub(crate) const fn new() -> Self {
        Self {
            spans: [(0, 0); CAPACITY],
            len: 0,
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The remembered ranges, in no order.
    #[cfg(test)]
    pub(crate) fn spans(&self) -> &[Span] {
        &self.spans[..self.len]
    }

    /// Remembers `[start, end)`, joined with the remembered ranges it overlaps or touches (so it
    /// takes no new slot unless it touches none).
    pub(crate) fn add(&mut self, start: usize, end: usize) -> Result<(), Full> {
        if start >= end {
            return Ok(());
        }
        let (mut s, mut e) = (start, end);
        let mut i = 0;
        while i < self.len {
            let (rs, re) = self.spans[i];
            if rs <= e && re >= s {
                s = s.min(rs);
                e = e.max(re);
                self.remove(i);
            } else {
                i += 1;
            }
        }
        if self.len == CAPACITY {
            return Err(Full);
        }
        self.spans[self.len] = (s, e);
        self.len += 1;
        Ok(())
    }

    /// Takes the parts of the remembered ranges inside `[start, end)` out; the parts outside stay.
    pub(crate) fn cut(&mut self, start: usize, end: usize) -> Cut {
        let mut out = Cut {
            spans: [(0, 0); CAPACITY],
            len: 0,
            dropped: None,
        };
        let mut i = 0;
        while i < self.len {
            let (rs, re) = self.spans[i];
            if re <= start || rs >= end {
                i += 1;
                continue;
            }
            out.spans[out.len] = (rs.max(start), re.min(end));
            out.len += 1;
            match (rs < start, re > end) {
                (false, false) => {
                    self.remove(i);
                    continue;
                }
                (true, false) => self.spans[i] = (rs, start),
                (false, true) => self.spans[i] = (end, re),
                (true, true) => {
                    // The one range holding all of [start, end): no other meets it.
                    self.spans[i] = (rs, start);
                    if self.len < CAPACITY {
                        self.spans[self.len] = (end, re);
                        self.len += 1;
                    } else {
                        out.dropped = Some((end, re));
                    }
                }
            }
            i += 1;
        }
        out
    }

    fn remove(&mut self, i: usize) {
        self.len -= 1;
        self.spans[i] = self.spans[self.len];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sorted(spans: &[Span]) -> Vec<Span> {
        let mut v = spans.to_vec();
        v.sort_unstable();
        v
    }

    #[test]
    fn ranges_that_meet_are_joined() {
        let mut p = Pending::new();
        p.add(10, 20).unwrap();
        p.add(30, 40).unwrap();
        p.add(20, 30).unwrap();
        assert_eq!(sorted(p.spans()), [(10, 40)]);
        p.add(5, 12).unwrap();
        p.add(50, 60).unwrap();
        assert_eq!(sorted(p.spans()), [(5, 40), (50, 60)]);
    }

    #[test]
    fn a_cut_takes_the_parts_inside_and_keeps_the_rest() {
        let mut p = Pending::new();
        p.add(0, 10).unwrap();
        p.add(20, 30).unwrap();
        p.add(40, 50).unwrap();
        let c = p.cut(5, 45);
        assert_eq!(sorted(c.spans()), [(5, 10), (20, 30), (40, 45)]);
        assert_eq!(c.dropped, None);
        assert_eq!(sorted(p.spans()), [(0, 5), (45, 50)]);
        let c = p.cut(100, 200);
        assert!(c.spans().is_empty());
        assert_eq!(sorted(p.spans()), [(0, 5), (45, 50)]);
    }

    #[test]
    fn a_cut_inside_one_range_splits_it() {
        let mut p = Pending::new();
        p.add(0, 100).unwrap();
        let c = p.cut(40, 60);
        assert_eq!(c.spans(), [(40, 60)]);
        assert_eq!(sorted(p.spans()), [(0, 40), (60, 100)]);
        assert!(p.cut(0, 100).spans().len() == 2 && p.is_empty());
    }

    #[test]
    fn when_full_a_new_range_is_refused_and_a_split_drops_its_upper_part() {
        let mut p = Pending::new();
        for k in 0..CAPACITY {
            p.add(k * 10, k * 10 + 5).unwrap();
        }
        assert_eq!(p.add(10_000, 10_005), Err(Full));
        // Joined with one it touches: no new slot needed.
        p.add(5, 7).unwrap();
        assert_eq!(p.spans().len(), CAPACITY);
        let c = p.cut(2, 3);
        assert_eq!(c.spans(), [(2, 3)]);
        assert_eq!(c.dropped, Some((3, 7)));
        assert!(p.spans().contains(&(0, 2)));
        assert_eq!(p.spans().len(), CAPACITY);
    }
}
