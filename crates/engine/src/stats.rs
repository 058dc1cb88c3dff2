//! The engine's counters as the program reads them ([`Stats`]).

use std::sync::atomic::Ordering;

use pageone_sync::lock;

use crate::access::PAGE;
use crate::candidates::PagePre;
use crate::config::WatchMode;
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
    /// Copies no page counts any more, held back from reuse until no mapping of the store
    /// covers them (a page written after its merge keeps its place there; dropped, it reads the
    /// copy again). Checked about once a second.
    pub copies_held: u64,
    /// Frozen pages that differed from their copy at compare time and were moved back.
    pub compare_mismatches: u64,
    /// VMAs of this process now, and the limit the engine respects.
    pub vmas_used: u64,
    pub vma_limit: u64,
    /// Pages that would merge but wait for room under the VMA budget (`vm.max_map_count` minus
    /// the margin): they cost nothing per period until the limit is raised or mappings go away.
    /// Raising `vm.max_map_count` by twice this many lets them merge.
    pub pages_waiting_on_limit: u64,
    /// Merges skipped because they would have exceeded the VMA budget.
    pub vma_limited_merges: u64,
    /// Unchanged pages the kernel would not freeze: memory the program locked (`mlock`,
    /// `mlockall`), or made read-only where the engine could not see it. Not merged; they cost
    /// nothing per period and are tried again now and then (after up to 256 periods).
    pub pages_refused: u64,
    /// Regions handed to the kernel's KSM whole, their merges costing a mapping per page beyond
    /// the VMA budget, or their pages locked (see `Config::ksm_when_limited`); KSM's own counters
    /// (`/sys/kernel/mm/ksm`) count what it merged there.
    pub regions_to_ksm: u64,
    /// How writes are detected: [`WatchMode::UffdWp`] or [`WatchMode::Checksum`] (serialised as
    /// "uffd-wp" or "checksum").
    pub watch_mode: WatchMode,
    /// CPU time of the engine's threads (workers and committer), in nanoseconds.
    pub worker_cpu_ns: u64,
    /// Registered bytes.
    pub registered_bytes: u64,
    /// The daemon link. A lost or unreachable daemon is asked for again every second; see
    /// `daemon_joins`.
    pub daemon: DaemonLink,
    /// The scope joined at the daemon (empty when alone).
    pub scope: String,
    /// Times a daemon was joined after the start (after losing one, or after it was unreachable):
    /// pages merged before move to the new daemon's store.
    pub daemon_joins: u64,
    /// Pages that had not moved to the new store some periods after a join (written since,
    /// dropped by the program, or still waiting) and were made private so that the old store can
    /// be freed; they merge again like any page.
    pub pages_left_private: u64,
    /// Missing faults the engine's fault thread answered (with the zero page): touches of
    /// registered memory that was empty. Each costs the touching thread a round trip to that
    /// thread; the engine maps the zero page over memory it registers and pages it releases so that
    /// first touches stay in the kernel.
    pub faults_answered: u64,
    /// Huge pages the engine collapsed again where the watch had split them and nothing merged
    /// (see `docs/DESIGN.md`, "Huge pages").
    pub huge_pages_restored: u64,
}

impl Stats {
    /// The `vm.max_map_count` that would let the pages waiting on the limit merge, or `None`
    /// when none waits: the mappings in use, two more per waiting page (a merged page between
    /// private neighbours splits its mapping in three), and the engine's default margin,
    /// rounded up to a multiple of 65536. Never below the limit in force.
    pub fn max_map_count_to_merge(&self) -> Option<u64> {
        if self.pages_waiting_on_limit == 0 {
            return None;
        }
        let margin = crate::config::Config::default().vma_margin as u64;
        let need = self
            .vmas_used
            .saturating_add(self.pages_waiting_on_limit.saturating_mul(2))
            .saturating_add(margin);
        Some(
            need.div_ceil(65536)
                .saturating_mul(65536)
                .max(self.vma_limit),
        )
    }
}

/// The engine's link to a `pageone daemon` (serialised in lower case: "none", "connected", "lost",
/// "unreachable").
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum DaemonLink {
    /// No daemon configured: the process runs alone.
    #[default]
    None,
    /// Joined: the scope's store is shared with its other processes.
    Connected,
    /// The daemon went away: the process runs unshared since.
    Lost,
    /// Configured, but it could not be joined at the start.
    Unreachable,
}

impl DaemonLink {
    pub fn as_str(self) -> &'static str {
        match self {
            DaemonLink::None => "none",
            DaemonLink::Connected => "connected",
            DaemonLink::Lost => "lost",
            DaemonLink::Unreachable => "unreachable",
        }
    }
}

impl std::fmt::Display for DaemonLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A snapshot of the counters, as the holder of the state lock sees them.
pub(crate) fn stats_of(sh: &Shared, st: &State) -> Stats {
    let c = &sh.counters;
    let registered: usize = st.regions.values().map(|r| r.len()).sum();
    let shared = st.store.shared;
    let sharing = st.store.sharing_refs.saturating_sub(shared);
    // Zero pages released, and zero pages kept inside runs of merged pages (zero holes).
    let zero = st.zero + st.store.hole_refs;
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
        zero_pages: zero,
        pages_recycled: c.recycled.load(Ordering::Relaxed),
        daemon_joins: c.joins.load(Ordering::Relaxed),
        pages_left_private: c.left_private.load(Ordering::Relaxed),
        faults_answered: c.faults_answered.load(Ordering::Relaxed),
        huge_pages_restored: c.huge_restored.load(Ordering::Relaxed),
        general_profit: ((sharing + zero) * PAGE as u64) as i64 - meta as i64,
        merges: c.merges.load(Ordering::Relaxed),
        cow_breaks: c.cow_breaks.load(Ordering::Relaxed),
        copies_held: st.store.held() as u64,
        compare_mismatches: c.mismatches.load(Ordering::Relaxed),
        vmas_used: vmas,
        vma_limit: c.vma_limit.load(Ordering::Relaxed),
        vma_limited_merges: c.vma_limited.load(Ordering::Relaxed),
        pages_waiting_on_limit: st.parked,
        pages_refused: st.refusals.pages,
        regions_to_ksm: st.regions.values().filter(|r| r.to_ksm).count() as u64,
        watch_mode: sh.mode,
        worker_cpu_ns: sh.cpu_ns(),
        registered_bytes: registered as u64,
        daemon: match st.store.daemon_state() {
            "connected" => DaemonLink::Connected,
            "lost" => DaemonLink::Lost,
            // "none": alone, or unreachable at the start.
            _ if sh.daemon_unreachable => DaemonLink::Unreachable,
            _ => DaemonLink::None,
        },
        scope: st
            .store
            .remote
            .as_ref()
            .map(|r| r.scope.clone())
            .unwrap_or_default(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The JSON the daemon and `pageone scope` read keeps its lowercase words.
    #[test]
    fn stats_serialise_their_links_and_modes_as_words() {
        let s = Stats {
            watch_mode: WatchMode::UffdWp,
            daemon: DaemonLink::Unreachable,
            ..Stats::default()
        };
        let v: serde_json::Value = serde_json::to_value(&s).unwrap();
        assert_eq!(v["watch_mode"], "uffd-wp");
        assert_eq!(v["daemon"], "unreachable");
        for link in [
            DaemonLink::None,
            DaemonLink::Connected,
            DaemonLink::Lost,
            DaemonLink::Unreachable,
        ] {
            let json = serde_json::to_string(&link).unwrap();
            assert_eq!(json, format!("\"{link}\""));
        }
    }

    /// The advised limit covers every waiting page, is a multiple of 65536 and never lowers
    /// the limit in force; with nothing waiting there is no advice.
    #[test]
    fn the_advised_limit_lets_every_waiting_page_merge() {
        let mut s = Stats {
            vmas_used: 65_000,
            vma_limit: 65_530,
            ..Stats::default()
        };
        assert_eq!(s.max_map_count_to_merge(), None);
        s.pages_waiting_on_limit = 100_000;
        let n = s.max_map_count_to_merge().unwrap();
        assert!(n >= 65_000 + 200_000 + 1024, "{n}");
        assert_eq!(n % 65536, 0);
        s.vma_limit = 10_000_000;
        assert_eq!(s.max_map_count_to_merge(), Some(10_000_000));
    }
}
