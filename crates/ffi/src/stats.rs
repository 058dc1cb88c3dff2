//! Plain data out: [`pageone_stats`], the engine's counters as a `#[repr(C)]` struct, and the
//! small C enums its watch mode and daemon link become ([`pageone_watch_mode`], [`pageone_daemon_link`]).

/// How written pages are detected (`pageone_config_set_watch`, `pageone_stats.watch_mode`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum pageone_watch_mode {
    /// Async userfaultfd write-protection when the kernel has it, else checksums (config only).
    PAGEONE_WATCH_AUTO = 0,
    /// userfaultfd `WP_ASYNC` + `PAGEMAP_SCAN`: no page is read to detect a write.
    PAGEONE_WATCH_UFFD_WP = 1,
    /// A per-page checksum compared every period, as KSM does.
    PAGEONE_WATCH_CHECKSUM = 2,
}

/// The engine's link to a pageone daemon (`pageone_stats.daemon`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum pageone_daemon_link {
    /// This process deduplicates alone.
    PAGEONE_DAEMON_LINK_NONE = 0,
    /// Joined: copies are shared with the scope's other processes.
    PAGEONE_DAEMON_LINK_CONNECTED = 1,
    /// The daemon went away; running unshared since.
    PAGEONE_DAEMON_LINK_LOST = 2,
    /// A daemon was configured but could not be joined at start; running unshared.
    PAGEONE_DAEMON_LINK_UNREACHABLE = 3,
    /// A state this version of the C ABI does not know.
    PAGEONE_DAEMON_LINK_UNKNOWN = 255,
}

/// The numeric counters of the engine (`pageone_engine_stats`). The first group has the names
/// and meanings of KSM's counters in `/sys/kernel/mm/ksm`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct pageone_stats {
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
    /// Zero pages released.
    pub zero_pages: u64,
    /// Bytes saved minus the engine's own metadata and VMAs (may be negative).
    pub general_profit: i64,
    /// Successful page merges since start.
    pub merges: u64,
    /// Merged pages later written (copy-on-write broken).
    pub cow_breaks: u64,
    /// Frozen pages that differed from their copy at compare time and were moved back.
    pub compare_mismatches: u64,
    /// VMAs of this process now.
    pub vmas_used: u64,
    /// The VMA limit the engine respects.
    pub vma_limit: u64,
    /// Merges skipped because they would have exceeded the VMA budget.
    pub vma_limited_merges: u64,
    /// CPU time of the engine's threads (workers and committer), in nanoseconds.
    pub worker_cpu_ns: u64,
    /// Registered bytes.
    pub registered_bytes: u64,
    /// How writes are detected: a `pageone_watch_mode` (`PAGEONE_WATCH_UFFD_WP` or
    /// `PAGEONE_WATCH_CHECKSUM`).
    pub watch_mode: u32,
    /// The daemon link: a `pageone_daemon_link`.
    pub daemon: u32,
    /// Pages the program marked free (`pageone_pool_mark`) that the engine released.
    pub pages_recycled: u64,
}

impl From<&::pageone_engine::Stats> for pageone_stats {
    fn from(s: &::pageone_engine::Stats) -> Self {
        let watch_mode = match s.watch_mode {
            ::pageone_engine::WatchMode::UffdWp => pageone_watch_mode::PAGEONE_WATCH_UFFD_WP,
            ::pageone_engine::WatchMode::Checksum => pageone_watch_mode::PAGEONE_WATCH_CHECKSUM,
            ::pageone_engine::WatchMode::Auto => pageone_watch_mode::PAGEONE_WATCH_AUTO,
        };
        let daemon = match s.daemon {
            ::pageone_engine::DaemonLink::None => pageone_daemon_link::PAGEONE_DAEMON_LINK_NONE,
            ::pageone_engine::DaemonLink::Connected => {
                pageone_daemon_link::PAGEONE_DAEMON_LINK_CONNECTED
            }
            ::pageone_engine::DaemonLink::Lost => pageone_daemon_link::PAGEONE_DAEMON_LINK_LOST,
            ::pageone_engine::DaemonLink::Unreachable => {
                pageone_daemon_link::PAGEONE_DAEMON_LINK_UNREACHABLE
            }
            _ => pageone_daemon_link::PAGEONE_DAEMON_LINK_UNKNOWN,
        };
        Self {
            pages_shared: s.pages_shared,
            pages_sharing: s.pages_sharing,
            pages_unshared: s.pages_unshared,
            pages_volatile: s.pages_volatile,
            pages_scanned: s.pages_scanned,
            full_scans: s.full_scans,
            zero_pages: s.zero_pages,
            general_profit: s.general_profit,
            merges: s.merges,
            cow_breaks: s.cow_breaks,
            compare_mismatches: s.compare_mismatches,
            vmas_used: s.vmas_used,
            vma_limit: s.vma_limit,
            vma_limited_merges: s.vma_limited_merges,
            worker_cpu_ns: s.worker_cpu_ns,
            registered_bytes: s.registered_bytes,
            watch_mode: watch_mode as u32,
            daemon: daemon as u32,
            pages_recycled: s.pages_recycled,
        }
    }
}
