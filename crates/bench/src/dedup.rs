//! The merging benchmark's results and the measures they share: what one side (pageone or KSM)
//! did on one data set ([`Sample`]), the host memory before and after, and the medians over runs.
//! The runs themselves are [`crate::merging`]'s.
//!
//! The data are the seed's: "easy" pages hold a random 8-byte value at offset 0, "hard" pages the
//! same at a random offset in 0..252 (mean 128 leading zero bytes); identical across regions,
//! unique within, laid out by [`crate::layout`].

use std::time::Duration;

use pageone_sys as sys;

use crate::layout::Layout;
use crate::mapping_cost::MappingCost;

pub use pageone_seed::{fill_page, Data};

/// One measurement of one side.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Sample {
    pub side: &'static str,
    pub data: Data,
    /// Seconds from registration to 99% of the possible saving (None: not reached in time).
    pub seconds_to_99: Option<f64>,
    /// CPU-seconds spent by the side's threads until then (until the end of the wait if 99% was
    /// never reached): `ksmd`; the engines' threads (every thread of the workload processes but
    /// their main thread and writers) and the daemon.
    pub cpu_seconds: f64,
    /// Pages saved at the end, by the side's counters (KSM's `pages_sharing`; the engines' pages
    /// mapping a copy, less the copies).
    pub pages_saved: u64,
    pub possible: u64,
    /// Host memory the merging gave back, by the kernel ([`HostMemory`] before registration
    /// minus after merging settled): the pages freed less everything the side spent to free them
    /// (its copies, heaps, page tables, VMAs; KSM's rmap items and stable nodes).
    pub memory_saved_kib: Option<i64>,
    pub layout: Layout,
    /// Writer threads per process.
    pub writers: usize,
    /// Seconds from registration to 50%, 90% and 99% of the possible saving (by the counters,
    /// sampled every ~100 ms).
    pub t50: Option<f64>,
    pub t90: Option<f64>,
    pub t99: Option<f64>,
    /// The workload processes' (and the daemon's) Pss before registration minus after settling.
    pub saved_pss_kib: Option<i64>,
    /// `MemAvailable` after settling minus before registration.
    pub saved_memavailable_kib: Option<i64>,
    /// VMAs of the workload processes, summed, before registration and after settling.
    pub vmas_before: u64,
    pub vmas_after: u64,
    /// The kernel memory of the VMAs added (slab caches, or an estimate said to be one).
    pub mapping_kernel: MappingCost,
    /// The Pss saving less that kernel memory.
    pub net_saved_kib: Option<i64>,
    /// CPU once settled, over a window after the saving stopped growing (or the wait ended).
    pub settled: Settled,
    /// Writes the writers made during the run (all processes).
    pub writes: u64,
    /// Pages of the regions' first and second halves mapping pageone's store once settled (the
    /// scattered and the clustered half with `Layout::Mixed`; none on KSM's side).
    pub merged_halves: [u64; 2],
    /// The saving over time, from registration.
    pub series: Series,
}

/// The side's CPU over a window once settled.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct Settled {
    pub window_seconds: f64,
    pub cpu_seconds: f64,
    /// CPU-seconds per second per GiB registered.
    pub cpu_per_second_per_gib: f64,
    /// Percent of one core, per workload process.
    pub core_percent_per_process: f64,
}

/// The saving sampled over time: seconds from registration, pages saved by the counters, and
/// `MemAvailable`'s growth in KiB.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct Series {
    pub t: Vec<f64>,
    pub saved_pages: Vec<u64>,
    pub memavailable_saved_kib: Vec<i64>,
}

impl Series {
    pub fn push(&mut self, t: f64, saved_pages: u64, memavailable_saved_kib: i64) {
        self.t.push(t);
        self.saved_pages.push(saved_pages);
        self.memavailable_saved_kib.push(memavailable_saved_kib);
    }

    /// The first time the counters reached `fraction` of `possible`.
    pub fn time_to(&self, fraction: f64, possible: u64) -> Option<f64> {
        let want = (possible as f64 * fraction).ceil() as u64;
        self.t
            .iter()
            .zip(&self.saved_pages)
            .find(|(_, &s)| s >= want.max(1))
            .map(|(&t, _)| t)
    }
}

/// Host memory in use by processes and for them, in KiB, by `/proc/meminfo` field: anonymous
/// pages, shared memory (pageone's stores), page tables, and unreclaimable kernel objects (VMAs,
/// KSM's rmap items). Page cache and reclaimable slab are left out: they come and go with
/// whatever else the host does.
#[derive(Clone, Copy, Debug)]
pub struct HostMemory([i64; 4]);

const HOST_FIELDS: [&str; 4] = ["AnonPages", "Shmem", "PageTables", "SUnreclaim"];

impl HostMemory {
    pub fn now() -> Option<Self> {
        let mut v = [0; 4];
        for (x, f) in v.iter_mut().zip(HOST_FIELDS) {
            *x = sys::meminfo_kib(f).ok()? as i64;
        }
        Some(Self(v))
    }

    pub fn total(&self) -> i64 {
        self.0.iter().sum()
    }

    /// Per field, how much `self` is above `before`, as text (MiB).
    pub fn growth_since(&self, before: &Self) -> String {
        HOST_FIELDS
            .iter()
            .zip(self.0.iter().zip(before.0))
            .map(|(f, (a, b))| format!("{f} {:+.1}", (a - b) as f64 / 1024.0))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// How long a side may take past 99% to save the rest before memory is measured.
pub const SETTLE_GRACE: Duration = Duration::from_secs(2);

/// Benchmark parameters.
#[derive(Clone, Debug)]
pub struct Params {
    pub regions: usize,
    pub region_mib: usize,
    pub workers: usize,
    pub merge_period: Duration,
    pub timeout: Duration,
}

/// The median of the samples' times (None if any run did not reach 99%).
pub fn median_time(samples: &[&Sample]) -> Option<f64> {
    let mut t: Vec<f64> = samples
        .iter()
        .map(|s| s.seconds_to_99)
        .collect::<Option<_>>()?;
    t.sort_by(f64::total_cmp);
    t.get(t.len() / 2).copied()
}

/// The median memory saved (KiB) of the samples that measured it.
pub fn median_memory_saved(samples: &[&Sample]) -> Option<i64> {
    let mut m: Vec<i64> = samples.iter().filter_map(|s| s.memory_saved_kib).collect();
    m.sort_unstable();
    m.get(m.len() / 2).copied()
}

/// The median CPU-seconds of the samples.
pub fn median_cpu(samples: &[&Sample]) -> f64 {
    let mut t: Vec<f64> = samples.iter().map(|s| s.cpu_seconds).collect();
    t.sort_by(f64::total_cmp);
    t.get(t.len() / 2).copied().unwrap_or(0.0)
}

/// The median of `f` over the samples; None if any sample has none (e.g. a time never reached).
pub fn median_all(samples: &[&Sample], f: impl Fn(&Sample) -> Option<f64>) -> Option<f64> {
    let mut v: Vec<f64> = samples.iter().map(|s| f(s)).collect::<Option<_>>()?;
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied()
}

/// The median of `f` over the samples that have it.
pub fn median_some(samples: &[&Sample], f: impl Fn(&Sample) -> Option<f64>) -> Option<f64> {
    let mut v: Vec<f64> = samples.iter().filter_map(|s| f(s)).collect();
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied()
}
