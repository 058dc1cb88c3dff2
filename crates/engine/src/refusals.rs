//! Pages the kernel would not freeze.
//!
//! `UFFDIO_MOVE` moves a page only between mappings alike in protection and locking. Registered
//! memory that the program locked (`mlock`, `mlockall(MCL_FUTURE)` before the engine started) or
//! made read-only with a call the engine never saw cannot move to the engine's read/write,
//! unlocked scratch area, so it is not merged. (Merging it would leave its pages in an unlocked
//! mapping of the store: see `docs/DESIGN.md`, "Locked memory".)
//!
//! Such a page used to be a candidate again two periods later, with a copy made for it each
//! time: an engine serving locked memory made and dropped copies without end. Now a refused page
//! waits ([`PageKind::Refused`]) at no cost per period until the program drops it, or until the
//! engine tries the refused pages again; the wait doubles while they keep being refused (the
//! program may unlock its memory) and starts over once a whole wait passed with none refused.

use crate::state::{PageKind, State};

/// Periods refused pages wait before they are tried again, at first.
pub(crate) const FIRST_WAIT: u64 = 8;
/// The longest wait, in periods (51 s at the default period).
pub(crate) const LONGEST_WAIT: u64 = 256;

/// Pages refused and when they are tried again (kept in [`State`]).
#[derive(Debug)]
pub(crate) struct Refusals {
    /// Pages waiting as refused: counted by the watch, added to by the committer.
    pub(crate) pages: u64,
    /// The period the refused pages are tried again in, once set.
    retry_at: Option<u64>,
    /// The wait after the next retry, in periods.
    wait: u64,
}

impl Default for Refusals {
    fn default() -> Self {
        Refusals {
            pages: 0,
            retry_at: None,
            wait: FIRST_WAIT,
        }
    }
}

impl Refusals {
    /// Whether the refused pages are to be tried again in `period` (called once per period,
    /// before the watch counts them).
    fn retry_due(&mut self, period: u64) -> bool {
        match self.retry_at {
            // None refused for a whole wait: the next refusal waits the first wait again.
            Some(at) if self.pages == 0 && period >= at => {
                self.wait = FIRST_WAIT;
                self.retry_at = None;
                false
            }
            _ if self.pages == 0 => false,
            None => {
                self.retry_at = Some(period + self.wait);
                false
            }
            Some(at) if period >= at => {
                self.wait = (self.wait * 2).min(LONGEST_WAIT);
                self.retry_at = Some(period + self.wait);
                self.pages = 0;
                true
            }
            Some(_) => false,
        }
    }
}

/// Makes the refused pages candidates again in `period` if their wait is over; they are
/// unchanged long enough already (`merge_periods`).
pub(crate) fn retry_if_due(st: &mut State, period: u64, merge_periods: u8) {
    if !st.refusals.retry_due(period) {
        return;
    }
    for r in st.regions.values_mut() {
        for p in r.pages.iter_mut().filter(|p| p.kind == PageKind::Refused) {
            p.kind = PageKind::Anon;
            p.unchanged = merge_periods;
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
            if r.retry_due(period) {
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

    #[test]
    fn the_wait_starts_over_once_a_whole_wait_passed_with_none_refused() {
        let mut r = Refusals {
            pages: 1,
            ..Refusals::default()
        };
        let mut period = 0;
        // Three retries: the wait grew to 8 times the first.
        for _ in 0..3 {
            while !r.retry_due(period) {
                period += 1;
            }
            r.pages = 1;
        }
        assert_eq!(r.wait, 8 * FIRST_WAIT);
        // The program unlocked its memory: the last retry merged everything.
        r.pages = 0;
        while r.retry_at.is_some() {
            assert!(!r.retry_due(period));
            period += 1;
        }
        assert_eq!(r.wait, FIRST_WAIT);
        // Refused again later: tried again after the first wait.
        r.pages = 1;
        let refused_at = period;
        while !r.retry_due(period) {
            period += 1;
        }
        assert_eq!(period - refused_at, FIRST_WAIT);
    }

    #[test]
    fn nothing_is_retried_while_nothing_is_refused() {
        let mut r = Refusals::default();
        assert!((0..1000).all(|p| !r.retry_due(p)));
    }
}
