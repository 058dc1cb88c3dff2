//! The engine's counters as the program reads them ([`Stats`]).

use std::sync::atomic::Ordering;

use pageone_sync::lock;
use pageone_sys as sys;

use crate::access::PAGE;
use crate::candidates::PagePre;
use crate::read_ahead::ahead_pages;
use crate::state::{Shared, State};

/// Live counters. The first group has KSM's names and meanings (`/sys/kernel/mm/ksm`).
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Stats {
    /// Stable copies in use.
    pub pages_shared: u64,
    /// Pages mapping a stable copy beyond one per copy: the pages saved.
    pub pages_sharing: u64,
    /// Candidates that matched nothing in the last period.
    pub pages_unshared: u64,
    /// Present pages still changing (not yet candidates).
    pub pages_volatile: u64,
    /// Pages examined (all registered pages, every period).
    pub pages_scanned: u64,
    /// Periods completed (each examines all registered memory).
    pub full_scans: u64,
    /// Zero pages released (pages recycled through PPR included).
    pub zero_pages: u64,
    /// Pages the program marked free (PPR) that the engine released.
    pub pages_recycled: u64,
    /// Bytes saved minus the engine's own metadata and VMAs (may be negative).
    pub general_profit: i64,
    /// Successful page merges since start.
    pub merges: u64,
    /// Merged pages later written (copy-on-write broken).
    pub cow_breaks: u64,
    /// Frozen pages that differed from their copy at compare time and were moved back.
    pub compare_mismatches: u64,
    /// VMAs of this process now, and the limit the engine respects.
    pub vmas_used: u64,
    pub vma_limit: u64,
    /// Merges skipped because they would have exceeded the VMA budget.
    pub vma_limited_merges: u64,
    /// How writes are detected: "uffd-wp" or "checksum".
    pub watch_mode: String,
    /// CPU time of the engine's threads (workers and committer), in nanoseconds.
    pub worker_cpu_ns: u64,
    /// Registered bytes.
    pub registered_bytes: u64,
    /// The daemon link: "none" (alone), "connected", "lost" (running unshared since it went away)
    /// or "unreachable" (configured but could not be joined at start). A lost or unreachable
    /// daemon is asked for again every second; see `daemon_joins`.
    pub daemon: String,
    /// The scope joined at the daemon (empty when alone).
    pub scope: String,
    /// Times a daemon was joined after the start (after losing one, or after it was unreachable):
    /// pages merged before move to the new daemon's store.
    pub daemon_joins: u64,
    /// Pages that had not moved to the new store some periods after a join (written since,
    /// dropped by the program, or still waiting) and were made private so that the old store can
    /// be freed; they merge again like any page.
    pub pages_left_private: u64,
}

/// A snapshot of the counters, as the holder of the state lock sees them.
pub(crate) fn stats_of(sh: &Shared, st: &State) -> Stats {
    let c = &sh.counters;
    let registered: usize = st.regions.values().map(|r| r.len()).sum();
    let shared = st.store.shared;
    let sharing = st.store.sharing_refs.saturating_sub(shared);
    let vmas = c.vmas.load(Ordering::Relaxed);
    // Our costs: per-page state, the store's index, each VMA (~200 bytes in the kernel),
    // read-ahead results while kept (an address and a result per page), and the watch's scratch.
    let ahead_bytes = ahead_pages(st) * std::mem::size_of::<PagePre>();
    let meta = (registered / PAGE) as u64 * 8
        + st.store.metadata_bytes()
        + vmas * 200
        + ahead_bytes as u64
        + st.scan.bytes() as u64;
    Stats {
        pages_shared: shared,
        pages_sharing: sharing,
        pages_unshared: st.unshared,
        pages_volatile: st.volatile,
        pages_scanned: c.scanned.load(Ordering::Relaxed),
        full_scans: *lock(&sh.periods),
        zero_pages: st.zero,
        pages_recycled: c.recycled.load(Ordering::Relaxed),
        daemon_joins: c.joins.load(Ordering::Relaxed),
        pages_left_private: c.left_private.load(Ordering::Relaxed),
        general_profit: ((sharing + st.zero) * PAGE as u64) as i64 - meta as i64,
        merges: c.merges.load(Ordering::Relaxed),
        cow_breaks: c.cow_breaks.load(Ordering::Relaxed),
        compare_mismatches: c.mismatches.load(Ordering::Relaxed),
        vmas_used: vmas,
        vma_limit: c.vma_limit.load(Ordering::Relaxed),
        vma_limited_merges: c.vma_limited.load(Ordering::Relaxed),
        watch_mode: sh.mode.to_string(),
        worker_cpu_ns: lock(&sh.clocks).iter().map(sys::CpuClock::ns).sum(),
        registered_bytes: registered as u64,
        daemon: match st.store.daemon_state() {
            "none" => sh.daemon_note,
            s => s,
        }
        .into(),
        scope: st
            .store
            .remote
            .as_ref()
            .map(|r| r.scope.clone())
            .unwrap_or_default(),
    }
}
