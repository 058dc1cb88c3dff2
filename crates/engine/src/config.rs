//! The engine's settings: [`Config`], its [`Builder`], and how writes are watched ([`WatchMode`]).

use std::time::Duration;

use pageone_sys as sys;

use crate::{Engine, EngineError};

/// How written pages are detected.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
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
    /// Cap of the adaptive back-off for pages that keep changing, in periods (default 4).
    pub max_backoff: u8,
    /// Most pages mapping one stable copy (KSM's `max_page_sharing`).
    pub max_sharing: u32,
    /// Scope (tenant) name; only pages of one scope are ever shared.
    pub scope: String,
    /// How written pages are detected.
    pub watch: WatchMode,
    /// VMAs kept free below `vm.max_map_count`.
    pub vma_margin: usize,
    /// Map the page-table entries of merged pages as they are merged (`MADV_POPULATE_READ`), so
    /// that the program's first read of each is a load, not a page fault. The engine does so
    /// anyway wherever it can register store mappings for minor faults (Linux 5.14, always where
    /// the engine runs): it must, since the kernel then does no fault-around there and a first
    /// touch would wait for the engine. This setting only matters where it cannot. Off by
    /// default.
    pub populate_merged: bool,
    /// (For tests of the fallback.) Stage each mapping of copies on its own instead of moving
    /// them from the staging area (see `docs/DESIGN.md`), as where the area cannot be made.
    #[doc(hidden)]
    pub stage_each_mapping: bool,
    /// Merge pages (the default). Off, the engine only recycles the pages the program marks free
    /// in its PPR pool ([`Engine::recycle_from`]): registered memory is then neither
    /// write-protected nor scanned nor read, so the program's writes and marks cost what they
    /// cost without an engine, and a period with nothing marked costs a look at the pool.
    /// Changed at run time, it applies from the next period (pages registered while it was off
    /// are watched from their first write after it is turned on).
    pub merging: bool,
    /// Collapse registered memory back into huge pages where the watch's write-protection split
    /// them and nothing merged (`MADV_COLLAPSE`, a few per period; see `docs/DESIGN.md`, "Huge
    /// pages"). On by default; only where the kernel gave the region huge pages.
    pub restore_huge_pages: bool,
    /// Give the C heap's free memory back to the kernel after periods that allocated much
    /// (`malloc_trim`), on by default: the engine allocates through the program's `malloc`,
    /// and glibc keeps freed memory otherwise. Off where the engine's memory comes from an
    /// allocator of its own (the `LD_PRELOAD` shim's): then trimming would only touch the
    /// program's heap, which may be registered. (Dropping registered memory, the trim waits
    /// for the fault thread to read the kernel's report while it holds the allocator's lock:
    /// safe because that thread never allocates.)
    pub trim_c_heap: bool,
    /// Hand the parts of a region (64 MiB chunks) whose merges cost half a mapping per page or
    /// more (whatever the mapping budget, `vm.max_map_count`, allows: KSM merges such memory
    /// faster, with less CPU) to the kernel's KSM, where the host runs it: their pages
    /// become private again, the engine stops watching them, and they are marked
    /// `madvise(MADV_MERGEABLE)` for `ksmd`, which merges single pages without a mapping each.
    /// Parts whose pages merge in runs stay the engine's. A region most of whose pages the
    /// kernel refuses to freeze (not read/write, which KSM merges: see `ksm::refuses_pageone`)
    /// is handed over too. On by default; nothing is handed over where KSM does not run.
    /// See the `ksm` module and `docs/DESIGN.md`, "Handing memory to the kernel's KSM".
    pub ksm_when_limited: bool,
    /// The `pageone daemon` socket to join (its scope's store is shared with the scope's other
    /// processes); `None`: this process alone. Default: `$PAGEONE_SOCKET` (ignored, like every
    /// `PAGEONE_*` variable, in a set-user-ID, set-group-ID or file-capability program).
    pub daemon: Option<std::path::PathBuf>,
    /// Most copies a store of the engine's own holds (`None`: a page per page of RAM, which costs
    /// only address space until copies are made). Full, pages wait unmerged. Read when the engine
    /// starts.
    pub store_pages: Option<u32>,
    /// How the engine's threads are scheduled (for the whole process: the last engine started
    /// or reconfigured sets it). `Auto` (the default): at idle priority, except for a couple of
    /// seconds at a time when busy threads starve them while memory is short (the memory
    /// cgroup three quarters full, or the host's available memory under a quarter): then in the
    /// normal class, so that memory still merges where every CPU is busy and memory is needed.
    /// `Idle`: spare CPU only. `Normal`: as the program's threads. See `docs/DESIGN.md`,
    /// "Priority".
    pub priority: sys::Priority,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            workers: 2,
            merge_period: Duration::from_millis(200),
            merge_periods: 2,
            max_backoff: 4,
            max_sharing: 256,
            // (`proto::setting`: nothing from the environment in a set-user-ID program, whose
            // environment is its caller's.)
            scope: crate::proto::setting("PAGEONE_SCOPE")
                .and_then(|s| s.into_string().ok())
                .unwrap_or_else(|| "default".into()),
            watch: WatchMode::Auto,
            vma_margin: 1024,
            populate_merged: false,
            stage_each_mapping: false,
            restore_huge_pages: true,
            trim_c_heap: true,
            ksm_when_limited: true,
            merging: true,
            daemon: crate::proto::setting("PAGEONE_SOCKET").map(Into::into),
            store_pages: None,
            priority: sys::Priority::default(),
        }
    }
}

impl Config {
    /// Checks the settings the engine cannot run with.
    pub(crate) fn validate(&self) -> Result<(), EngineError> {
        if self.workers == 0 {
            return Err(EngineError::Config("workers must be at least 1"));
        }
        if self.merge_periods == 0 {
            return Err(EngineError::Config("merge_periods must be at least 1"));
        }
        if self.max_sharing < 2 {
            return Err(EngineError::Config("max_sharing must be at least 2"));
        }
        if self.store_pages == Some(0) {
            return Err(EngineError::Config("store_pages must be at least 1"));
        }
        if self.merge_period.is_zero() {
            return Err(EngineError::Config("merge_period must be positive"));
        }
        Ok(())
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
    pub fn populate_merged(mut self, on: bool) -> Self {
        self.config.populate_merged = on;
        self
    }
    /// Off: the C heap is never trimmed by the engine (see [`Config::trim_c_heap`]).
    pub fn trim_c_heap(mut self, on: bool) -> Self {
        self.config.trim_c_heap = on;
        self
    }
    /// Off: no region is ever handed to the kernel's KSM (see [`Config::ksm_when_limited`]).
    pub fn ksm_when_limited(mut self, on: bool) -> Self {
        self.config.ksm_when_limited = on;
        self
    }
    /// Off: huge pages split by the watch stay split (see [`Config::restore_huge_pages`]).
    pub fn restore_huge_pages(mut self, on: bool) -> Self {
        self.config.restore_huge_pages = on;
        self
    }
    /// Off: recycle only, never merge (see [`Config::merging`]).
    pub fn merging(mut self, on: bool) -> Self {
        self.config.merging = on;
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
    /// See [`Config::stage_each_mapping`].
    #[doc(hidden)]
    pub fn stage_each_mapping(mut self, on: bool) -> Self {
        self.config.stage_each_mapping = on;
        self
    }
    /// Joins the daemon at `socket` (`None`: run alone even if `$PAGEONE_SOCKET` is set).
    pub fn daemon(mut self, socket: Option<std::path::PathBuf>) -> Self {
        self.config.daemon = socket;
        self
    }
    /// Caps a store of the engine's own at `pages` copies (see [`Config::store_pages`]).
    pub fn store_pages(mut self, pages: u32) -> Self {
        self.config.store_pages = Some(pages);
        self
    }
    /// How the engine's threads are scheduled (see [`Config::priority`]).
    pub fn priority(mut self, p: sys::Priority) -> Self {
        self.config.priority = p;
        self
    }
    /// Starts the engine.
    pub fn build(self) -> Result<Engine, EngineError> {
        Engine::start(self.config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn watch_modes_serialise_as_they_display() {
        for m in [WatchMode::Auto, WatchMode::UffdWp, WatchMode::Checksum] {
            let json = serde_json::to_string(&m).unwrap();
            assert_eq!(json, format!("\"{m}\""));
        }
    }

    #[test]
    fn settings_the_engine_cannot_run_with_are_refused() {
        assert!(Config::default().validate().is_ok());
        let bad: [fn(&mut Config); 4] = [
            |c| c.workers = 0,
            |c| c.merge_periods = 0,
            |c| c.max_sharing = 1,
            |c| c.merge_period = Duration::ZERO,
        ];
        for f in bad {
            let mut c = Config::default();
            f(&mut c);
            assert!(matches!(c.validate(), Err(EngineError::Config(_))));
        }
    }
}
