//! Pages the kernel would not freeze.
//!
//! `UFFDIO_MOVE` moves writable pages only, between mappings alike in protection and locking.
//! Registered memory that the program made read-only with a call the engine never saw cannot
//! move to the engine's read/write scratch area, so it is not merged; nor can locked memory
//! where the engine's locked area could not be locked (see the `locking` module).
//!
//! Such a page used to be a candidate again two periods later, with a copy made for it each
//! time: an engine serving locked memory made and dropped copies without end. Now a refused page
//! waits ([`PageKind::Refused`]) at no cost per period until the program drops it, or until the
//! engine tries refused pages again; the wait doubles while they keep being refused (the program
//! may unlock its memory) and starts over once a whole wait passed with none refused.
//!
//! A try makes copies for the pages that pair up, as any merge does, so it would briefly take as
//! much memory again as the refused memory's duplicates. So a try takes a batch of
//! [`RETRY_PAGES`] refused pages at most, the next batch at the next try; a page of the batch
//! that moves out shows that its mapping refuses no longer, and then every refused page is tried
//! at the next period.

use std::ops::Range;

use crate::access::PAGE;
use crate::state::{PageKind, State};

/// Periods refused pages wait before they are tried again, at first.
pub(crate) const FIRST_WAIT: u64 = 8;
/// The longest wait, in periods (51 s at the default period).
pub(crate) const LONGEST_WAIT: u64 = 256;
/// Refused pages tried at once (4 MiB), unless one of the last batch moved.
pub(crate) const RETRY_PAGES: usize = 1024;

/// What a period's try takes.
#[derive(Debug, PartialEq, Eq)]
enum Retry {
    /// Nothing: the wait is not over.
    Nothing,
    /// The next batch of refused pages.
    Batch,
    /// Every refused page: a page of the last batch moved out.
    All,
}

/// Pages refused and when they are tried again (kept in [`State`]).
#[derive(Debug)]
pub(crate) struct Refusals {
    /// Pages waiting as refused: counted by the watch, added to by the committer.
    pub(crate) pages: u64,
    /// The period the refused pages are tried again in, once set.
    retry_at: Option<u64>,
    /// The wait after the next retry, in periods.
    wait: u64,
    /// The addresses of the last batch tried, sorted.
    tried: Vec<usize>,
    /// Where the next batch starts (it wraps around).
    next_from: usize,
    /// Whether a page of the last batch moved out since it was tried.
    moved: bool,
}

impl Default for Refusals {
    fn default() -> Self {
        Refusals {
            pages: 0,
            retry_at: None,
            wait: FIRST_WAIT,
            tried: Vec::new(),
            next_from: 0,
            moved: false,
        }
    }
}

impl Refusals {
    /// What the refused pages get in `period` (called once per period, before the watch counts
    /// them).
    fn retry_due(&mut self, period: u64) -> Retry {
        if std::mem::take(&mut self.moved) && self.pages > 0 {
            self.wait = FIRST_WAIT;
            self.retry_at = Some(period + self.wait);
            self.pages = 0;
            return Retry::All;
        }
        match self.retry_at {
            // None refused for a whole wait: the next refusal waits the first wait again.
            Some(at) if self.pages == 0 && period >= at => {
                self.wait = FIRST_WAIT;
                self.retry_at = None;
                Retry::Nothing
            }
            _ if self.pages == 0 => Retry::Nothing,
            None => {
                self.retry_at = Some(period + self.wait);
                Retry::Nothing
            }
            Some(at) if period >= at => {
                self.wait = (self.wait * 2).min(LONGEST_WAIT);
                self.retry_at = Some(period + self.wait);
                self.pages = 0;
                Retry::Batch
            }
            Some(_) => Retry::Nothing,
        }
    }

    /// Notes that the page at `addr` moved out (was frozen): if it was tried in the last batch,
    /// its mapping refuses no longer.
    pub(crate) fn moved_out(&mut self, addr: usize) {
        if !self.tried.is_empty() && self.tried.binary_search(&addr).is_ok() {
            self.moved = true;
            self.tried.clear();
        }
    }
}

/// Makes refused pages candidates again in `period` if their wait is over (a batch), or all of
/// them if a page of the last batch moved out; they are unchanged long enough already
/// (`merge_periods`).
pub(crate) fn retry_if_due(st: &mut State, period: u64, merge_periods: u8) {
    let retry = st.refusals.retry_due(period);
    if retry == Retry::Nothing {
        return;
    }
    let mut batch = Batch {
        max: if retry == Retry::All {
            usize::MAX
        } else {
            RETRY_PAGES
        },
        merge_periods,
        taken: 0,
        last: None,
        tried: Vec::new(),
    };
    // From where the last batch ended to the end, then from the start.
    let from = st.refusals.next_from;
    for range in [from..usize::MAX, 0..from] {
        batch.take(st, range, retry == Retry::Batch);
    }
    let r = &mut st.refusals;
    r.next_from = batch.last.map_or(0, |a| a + PAGE);
    batch.tried.sort_unstable();
    r.tried = batch.tried;
}

/// The refused pages one try takes.
struct Batch {
    /// Pages it takes at most.
    max: usize,
    merge_periods: u8,
    taken: usize,
    /// The address of the last page taken.
    last: Option<usize>,
    /// The addresses of the pages taken, if kept (a batch, not all of them).
    tried: Vec<usize>,
}

impl Batch {
    /// Makes the refused pages of `range` candidates again, in address order, until `max` are
    /// taken; keeps their addresses if `keep`.
    fn take(&mut self, st: &mut State, range: Range<usize>, keep: bool) {
        for (&start, r) in &mut st.regions {
            if self.taken >= self.max {
                return;
            }
            let end = start + r.len();
            if end <= range.start || start >= range.end {
                continue;
            }
            let first = range.start.saturating_sub(start) / PAGE;
            for (i, p) in r.pages.iter_mut().enumerate().skip(first) {
                let addr = start + i * PAGE;
                if self.taken >= self.max || addr >= range.end {
                    break;
                }
                if p.kind == PageKind::Refused {
                    p.kind = PageKind::Anon;
                    p.unchanged = self.merge_periods;
                    self.taken += 1;
                    self.last = Some(addr);
                    if keep {
                        self.tried.push(addr);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The periods in `0..until` in which pages refused at every try are tried again.
    fn retries(until: u64) -> Vec<u64> {
        let mut r = Refusals {
            pages: 5,
            ..Refusals::default()
        };
        let mut at = Vec::new();
        for period in 0..until {
            if r.retry_due(period) == Retry::Batch {
                at.push(period);
                // Refused again by the commit that tries them.
                r.pages = 5;
            }
        }
        at
    }

    #[test]
    fn pages_refused_again_wait_twice_as_long_up_to_the_longest_wait() {
        let at = retries(2000);
        assert_eq!(
            &at[..4],
            [FIRST_WAIT, 3 * FIRST_WAIT, 7 * FIRST_WAIT, 15 * FIRST_WAIT]
        );
        let gaps: Vec<u64> = at.windows(2).map(|w| w[1] - w[0]).collect();
        assert!(gaps
            .windows(2)
            .all(|g| g[1] == (2 * g[0]).min(LONGEST_WAIT)));
        assert_eq!(*gaps.last().unwrap(), LONGEST_WAIT);
    }

    /// The first period from `from` in which a batch is tried.
    fn next_batch(r: &mut Refusals, from: u64) -> u64 {
        (from..).find(|&p| r.retry_due(p) == Retry::Batch).unwrap()
    }

    #[test]
    fn the_wait_starts_over_once_a_whole_wait_passed_with_none_refused() {
        let mut r = Refusals {
            pages: 1,
            ..Refusals::default()
        };
        let mut period = 0;
        // Three retries: the wait grew to 8 times the first.
        for _ in 0..3 {
            period = next_batch(&mut r, period);
            r.pages = 1;
        }
        assert_eq!(r.wait, 8 * FIRST_WAIT);
        // The program unlocked its memory: the last retry merged everything.
        r.pages = 0;
        while r.retry_at.is_some() {
            assert_eq!(r.retry_due(period), Retry::Nothing);
            period += 1;
        }
        assert_eq!(r.wait, FIRST_WAIT);
        // Refused again later: tried again after the first wait.
        r.pages = 1;
        assert_eq!(next_batch(&mut r, period) - period, FIRST_WAIT);
    }

    /// A page of the last batch that moved out (its mapping no longer refuses) has every refused
    /// page tried at the next period, and the waits start over; a page outside the batch does
    /// not count.
    #[test]
    fn a_batch_page_that_moved_out_has_every_refused_page_tried() {
        let mut r = Refusals {
            pages: 100,
            ..Refusals::default()
        };
        let period = next_batch(&mut r, 0);
        r.tried = vec![0x1000, 0x3000];
        r.pages = 98;
        r.moved_out(0x2000);
        assert_eq!(r.retry_due(period + 1), Retry::Nothing);
        r.moved_out(0x3000);
        assert_eq!(r.retry_due(period + 2), Retry::All);
        assert_eq!(r.wait, FIRST_WAIT);
        assert!(r.tried.is_empty());
        // Refused again (the program locked its memory anew): waits the first wait.
        r.pages = 98;
        assert_eq!(next_batch(&mut r, period + 3), period + 2 + FIRST_WAIT);
    }

    #[test]
    fn nothing_is_retried_while_nothing_is_refused() {
        let mut r = Refusals::default();
        assert!((0..1000).all(|p| r.retry_due(p) == Retry::Nothing));
    }
}
