//! The in-process PageONE deduplication engine: watch, freeze, compare, merge.
//!
//! # Design
//!
//! Memory is *registered* (the equivalent of `madvise(MADV_MERGEABLE)`); the engine then runs in
//! *periods*. Each period:
//!
//! 1. **Watch.** One `PAGEMAP_SCAN` ioctl per region returns the pages written since the last period
//!    and write-protects them again (userfaultfd async write-protection: a write costs one minor
//!    fault in the kernel and nothing in user space). Pages are never read to find out whether they
//!    changed. Where the kernel lacks this, a per-page xxh3 checksum is compared instead, as KSM
//!    does ([`WatchMode::Checksum`]). A page becomes a *candidate* once it stayed unchanged for
//!    `merge_periods` whole periods (counted from when its write-protection was armed, so a page
//!    registered just before a scan does not count that scan); a page written k times waits up to
//!    k periods (capped), so pages that keep changing cost nothing but the scan.
//! 2. **Classify** (N worker threads at `SCHED_IDLE`). Zero pages first: an all-zero candidate is
//!    released without touching any index. Then the stable index (an SD tree over the stable copies,
//!    which never change while indexed) is searched; a unique page is rejected after reading its
//!    distinguishing prefix. Pages not found are grouped by an xxh3-128 hash of their contents (first
//!    sightings: their bytes are live memory that may change, which suits a per-period hash better
//!    than an index keyed in place; see `docs/DESIGN.md` for the numbers behind the choice). Each
//!    group of two or more gets a new stable copy; copies of a run of pages get consecutive ids.
//! 3. **Commit** (one committer thread: remaps of one address space serialise on `mmap_lock`
//!    anyway; it commits one batch of candidates while the engine thread classifies the next). Runs of
//!    pages are *frozen* with `UFFDIO_MOVE` into a private scratch area: while a page is moved out,
//!    any access to its address blocks in the kernel as a missing fault that the engine does not
//!    answer. The frozen bytes are compared byte for byte with the stable copy (or checked for zero);
//!    equal runs are replaced by one `mmap(MAP_PRIVATE | MAP_FIXED)` of the copies (the kernel copies
//!    on write), unequal pages are moved back, then blocked writers are woken. So a write is never
//!    lost and pages that differ are never merged, whatever the hash or the index said; a blocked
//!    writer waits for one run at most.
//!
//! Copy-on-write breaks are seen without hashing: a merged page that is present but no longer
//! file-backed was written. Its copy's reference is dropped; a copy nobody maps is freed with
//! `fallocate(PUNCH_HOLE)`. Missing faults that are not frozen pages (first touches, released zero
//! pages) are answered with the shared zero page by a fault thread.
//!
//! A period holds the *period lock* from watch to the end of its last commit; `register` and
//! `unregister` take it too, so a region never changes shape under a period. The state lock is
//! held only for bookkeeping: copies are written, indexed, frozen and compared without it.
//!
//! One copy serves at most `max_sharing` pages (KSM's `max_page_sharing`): a larger group is split
//! into chunks, each led by a page that gets a copy of its own, so content repeated many times
//! still merges in one pass.
//!
//! A process whose memory has settled is scanned less often: after a few periods that changed
//! little, the engine waits 2, 4, then 8 periods between scans until something changes again.
//!
//! Every non-coalescing merge costs VMAs; the committer counts them and stays under
//! `vm.max_map_count` with a margin: a merge that would cross it is not even frozen, the page
//! backs off (waits longer each time), and [`Stats`] counts it, rather than failing the host
//! process.

mod engine;
mod pool;
mod remote;
mod store;

use std::time::Duration;

pub use engine::{Engine, Region};
/// The wire protocol with `pageone daemon` (its own crate, shared with the daemon).
pub use pageone_proto as proto;
/// PPR, the per-page recycler: pools of pages a program marks free (see [`Engine::recycle_from`]).
pub use pageone_recycler as recycler;

/// How written pages are detected.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum WatchMode {
    /// Use async uffd write-protection when the kernel has it, else checksums.
    #[default]
    Auto,
    /// userfaultfd `WP_ASYNC` + `PAGEMAP_SCAN` (Linux 6.7+): no page is read to detect a write.
    UffdWp,
    /// A per-page xxh3 checksum compared every period, as KSM does.
    Checksum,
}

impl std::fmt::Display for WatchMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            WatchMode::Auto => "auto",
            WatchMode::UffdWp => "uffd-wp",
            WatchMode::Checksum => "checksum",
        })
    }
}

/// Engine settings; every field can be changed at run time with [`Engine::reconfigure`].
#[derive(Clone, Debug)]
pub struct Config {
    /// Worker threads for classification (at least 1).
    pub workers: usize,
    /// Length of one merge period.
    pub merge_period: Duration,
    /// Periods a page must stay unchanged before it is merged (at least 1; default 2).
    pub merge_periods: u8,
    /// Cap of the adaptive back-off for pages that keep changing, in periods.
    pub max_backoff: u8,
    /// Most pages mapping one stable copy (KSM's `max_page_sharing`).
    pub max_sharing: u32,
    /// Scope (tenant) name; only pages of one scope are ever shared.
    pub scope: String,
    /// How written pages are detected.
    pub watch: WatchMode,
    /// VMAs kept free below `vm.max_map_count`.
    pub vma_margin: usize,
    /// The `pageone daemon` socket to join (its scope's store is shared with the scope's other
    /// processes); `None`: this process alone. Default: `$PAGEONE_SOCKET` (ignored, like every
    /// `PAGEONE_*` variable, in a set-user-ID, set-group-ID or file-capability program).
    pub daemon: Option<std::path::PathBuf>,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            workers: 2,
            merge_period: Duration::from_millis(200),
            merge_periods: 2,
            max_backoff: 16,
            max_sharing: 256,
            // (`proto::setting`: nothing from the environment in a set-user-ID program, whose
            // environment is its caller's.)
            scope: proto::setting("PAGEONE_SCOPE")
                .and_then(|s| s.into_string().ok())
                .unwrap_or_else(|| "default".into()),
            watch: WatchMode::Auto,
            vma_margin: 1024,
            daemon: proto::setting("PAGEONE_SOCKET").map(Into::into),
        }
    }
}

/// Builds an [`Engine`].
#[derive(Clone, Debug, Default)]
pub struct Builder {
    config: Config,
}

impl Builder {
    pub fn workers(mut self, n: usize) -> Self {
        self.config.workers = n;
        self
    }
    pub fn merge_period(mut self, d: Duration) -> Self {
        self.config.merge_period = d;
        self
    }
    pub fn merge_periods(mut self, n: u8) -> Self {
        self.config.merge_periods = n;
        self
    }
    pub fn max_sharing(mut self, n: u32) -> Self {
        self.config.max_sharing = n;
        self
    }
    pub fn scope(mut self, s: impl Into<String>) -> Self {
        self.config.scope = s.into();
        self
    }
    pub fn watch(mut self, m: WatchMode) -> Self {
        self.config.watch = m;
        self
    }
    pub fn vma_margin(mut self, n: usize) -> Self {
        self.config.vma_margin = n;
        self
    }
    /// Joins the daemon at `socket` (`None`: run alone even if `$PAGEONE_SOCKET` is set).
    pub fn daemon(mut self, socket: Option<std::path::PathBuf>) -> Self {
        self.config.daemon = socket;
        self
    }
    /// Starts the engine.
    pub fn build(self) -> Result<Engine, EngineError> {
        Engine::start(self.config)
    }
}

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

/// Why an engine operation failed.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("the kernel lacks a feature pageone needs: {0}")]
    Unsupported(&'static str),
    #[error("userfaultfd could not be set up")]
    Uffd(#[source] std::io::Error),
    #[error("the stable store could not be created")]
    Store(#[source] std::io::Error),
    #[error("the content index failed")]
    Index(#[source] pageone_index::IndexError),
    #[error("range {addr:#x}+{len:#x} is not page-aligned and non-empty")]
    Unaligned { addr: usize, len: usize },
    #[error("range {addr:#x}+{len:#x} is not entirely private anonymous read/write memory")]
    NotAnonymous { addr: usize, len: usize },
    #[error("range {addr:#x}+{len:#x} overlaps a registered region without matching it")]
    Overlap { addr: usize, len: usize },
    #[error("range {addr:#x}+{len:#x} is not registered")]
    NotRegistered { addr: usize, len: usize },
    #[error("invalid configuration: {0}")]
    Config(&'static str),
    #[error("memory could not be mapped")]
    Map(#[source] std::io::Error),
    #[error("the engine thread could not be started")]
    Thread(#[source] std::io::Error),
    #[error("the pageone daemon could not be joined: {0}")]
    Daemon(String),
}
