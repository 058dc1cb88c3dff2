//! Joining a daemon again: when the engine has no link to its configured daemon (lost, or
//! unreachable at the start), it asks for one every second; once joined, merged pages move to the
//! new store, and what is left on the replaced stores some periods later is made private.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use pageone_sync::lock;
use pageone_sys as sys;

use crate::access::PAGE;
use crate::anonymize::anonymize;
use crate::config::{Config, WatchMode};
use crate::error::Chain;
use crate::read_ahead::forget_read_ahead;
use crate::remote::Remote;
use crate::state::{PageKind, Shared, State};
use crate::store::Store;

/// How often a daemon that was lost (or unreachable at the start) is asked for again.
const REJOIN_INTERVAL: Duration = Duration::from_secs(1);

/// Periods after a join in which merged pages move to the new store on their own (merged again,
/// or given a copy of their own) before the rest is made private (`leave_replaced_stores`).
const RETIRE_PERIODS: u32 = 20;

/// When the engine thread next asks for the daemon, and gives up waiting for pages to move off
/// the stores replaced by a join.
pub(crate) struct Rejoin {
    next_join: Instant,
    retire_at: Option<Instant>,
}

impl Rejoin {
    pub(crate) fn new() -> Self {
        Rejoin {
            next_join: Instant::now() + REJOIN_INTERVAL,
            retire_at: None,
        }
    }

    /// Between periods (the one starting at `t0`): joins the configured daemon when due, and
    /// leaves the replaced stores when the pages had their periods to move. Returns whether it
    /// joined.
    pub(crate) fn between_periods(&mut self, sh: &Shared, config: &Config, t0: Instant) -> bool {
        let period = config.merge_period;
        let mut joined = false;
        if t0 >= self.next_join {
            self.next_join = t0 + REJOIN_INTERVAL;
            if join_again(sh, config) {
                joined = true;
                self.retire_at = Some(t0 + period * RETIRE_PERIODS);
            }
        }
        if self.retire_at.is_some_and(|t| t0 >= t) {
            let _period = lock(&sh.period_lock);
            let mut st = lock(&sh.state);
            self.retire_at =
                (!leave_replaced_stores(sh, &mut st)).then(|| t0 + period * RETIRE_PERIODS);
        }
        joined
    }
}

impl Rejoin {
    /// When the engine must wake to try joining its configured daemon again, however idle: it
    /// has no link to it. (An idle engine may sleep for many seconds; its clients should be back
    /// within about a second of a restarted daemon.)
    /// `link` is the engine's live link to a daemon, if any (see [`live_link`]).
    pub(crate) fn wake_at(&self, config: &Config, link: Option<&Arc<Remote>>) -> Option<Instant> {
        (config.daemon.is_some() && link.is_none()).then_some(self.next_join)
    }
}

/// The engine's link to a daemon, if it has a live one.
pub(crate) fn live_link(sh: &Shared) -> Option<Arc<Remote>> {
    lock(&sh.state)
        .store
        .remote
        .clone()
        .filter(|r| !r.is_lost())
}

/// Whether the engine has a live link to a daemon.
fn linked(sh: &Shared) -> bool {
    live_link(sh).is_some()
}

/// Joins the configured daemon when the engine has no link to one (lost, or unreachable at the
/// start): the new scope store replaces the current one between periods, and every merged page
/// becomes `Foreign`, to be merged again onto the new store (given a copy of its own if no other
/// process has its content) while it keeps mapping the old copy meanwhile. Returns whether it
/// joined.
fn join_again(sh: &Shared, config: &Config) -> bool {
    let Some(path) = &config.daemon else {
        return false;
    };
    if linked(sh) {
        return false;
    }
    // Connecting and greeting happen without locks: the program's calls go on meanwhile.
    let store = match crate::remote::Remote::connect(path, &config.scope)
        .and_then(|(remote, fd, capacity)| Store::shared(fd, capacity, remote))
    {
        Ok(s) => s,
        Err(e) => {
            tracing::debug!(error = %Chain(&e), "the pageone daemon is still not reachable");
            return false;
        }
    };
    let _period = lock(&sh.period_lock);
    let mut st = lock(&sh.state);
    // Read-ahead results may name copies of the old store.
    forget_read_ahead(&mut st);
    // Offers set aside name slots of the old store (held there, not here).
    st.offers_aside.clear();
    let old = std::mem::replace(&mut st.store, store);
    st.store.take_over(old);
    sh.staging.release(sh);
    let mut foreign = 0u64;
    for r in st.regions.values_mut() {
        for p in r.pages.iter_mut().filter(|p| p.kind == PageKind::Merged) {
            p.kind = PageKind::Foreign;
            p.unchanged = 0;
            p.writes = 0;
            foreign += 1;
        }
    }
    // Relaxed: a counter.
    sh.counters.joins.fetch_add(1, Ordering::Relaxed);
    tracing::info!(
        pages = foreign,
        "joined the pageone daemon again; merged pages move to its store"
    );
    true
}

/// Turns what is left of replaced stores' mappings in registered memory into anonymous memory
/// (pages written since the join, pages still waiting to move, pages the program dropped): as
/// long as one page maps a replaced store, all of that store's memory stays allocated (nobody
/// frees its copies any more). Those pages are watched again like any anonymous page. Returns
/// whether no such mapping is left.
fn leave_replaced_stores(sh: &Shared, st: &mut State) -> bool {
    if !st.store.has_replaced() {
        return true;
    }
    let Ok(maps) = sys::self_mappings() else {
        return false;
    };
    let mut left = false;
    for m in maps
        .iter()
        .filter(|m| st.store.replaced_inode(m.inode) && m.perms == "rw-p")
    {
        let Some((_, r)) = st.regions.range_mut(..=m.start).next_back() else {
            left = true;
            continue;
        };
        let (s, e) = (m.start, m.end.min(r.start + r.len()));
        // A mapping reaching into the next region is done there at the next call.
        left |= m.end > e;
        if s < e {
            // Unlocked by a call the engine did not see: given back unlocked.
            r.forget_unlocked(s, e - s);
        }
        if s >= e || !anonymize(sh, s, e, m.prot()) {
            left = true;
            continue;
        }
        // Locked again where the engine's mapping was (see `locking`).
        r.relock(s, e - s);
        // The anonymous mapping moved in carries no registration: watch it as the region's.
        if let Err(err) = sh.uffd.register(s, e - s, sh.reg_mode) {
            tracing::warn!(error = %err, "a range left unwatched after leaving a replaced store");
        } else if sh.mode == WatchMode::UffdWp {
            let _ = st.pagemap.write_protect(s, e);
        }
        let mut made_private = 0;
        for p in &mut r.pages[(s - r.start) / PAGE..(e - r.start) / PAGE] {
            if p.kind.in_store_mapping() {
                p.kind = PageKind::Anon;
                p.unchanged = 0;
                made_private += 1;
            }
        }
        // Relaxed: a counter.
        sh.counters
            .left_private
            .fetch_add(made_private, Ordering::Relaxed);
    }
    if !left {
        st.store.forget_replaced();
    }
    !left
}
