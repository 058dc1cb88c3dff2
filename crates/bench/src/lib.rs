//! Workloads, baselines and measurements for pageone's benchmarks (run by the `pageone-bench`
//! command, this crate's binary; `pageone bench` is a front for it).
//!
//! * [`sdtree`]: the SD tree against a memcmp-ordered tree (KSM's design) and an xxh3-128 hash index,
//!   on 4 KiB keys of the seed's "easy" and "hard" kinds, with 1 and 2 threads.
//! * [`density`]: how many small QEMU guests with an allocate/free churn fit in one memory budget
//!   under each way of merging or returning memory ([`guest`]: the guests; [`host`]: the cgroup,
//!   KSM's knobs and Ctrl-C, each undone by a guard), and how fast freed guest memory comes back.
//! * [`merging`]: pageone against the kernel's KSM on the same workload processes
//!   ([`workload`]: identical regions laid out by [`layout`], optional writers): t50/t90/t99,
//!   CPU-seconds, the saving by Pss and `MemAvailable`, the mappings used and their kernel memory
//!   ([`mapping_cost`]), and the CPU once settled; [`dedup`] holds the results, [`processes`]
//!   the processes and the daemon.
//! * [`overhead`]: what each memory operation costs the program (ns per page) with no merging,
//!   under KSM and under pageone's `LD_PRELOAD` shim, and the longest writer stalls while pages
//!   merge ([`latency`] histograms).
//! * [`ksm`]: KSM's knobs (saved and restored), counters and `ksmd` CPU time; [`procfs`]: what
//!   `/proc` says about the processes.
//! * [`ppr`]: PPR (marking freed pages, the engine releasing them) against `madvise(MADV_DONTNEED)`.
//! * [`ppr_heap`]: a heap whose large frees are marked for PPR, and [`alloc_trace`]: one alloc/free
//!   trace replayed against it, glibc, jemalloc and mimalloc (excess resident GiB·s, `free`
//!   latency, CPU).
//!
//! Benchmarks report numbers; they never assert timings. Every run checks the data it measured on.

pub mod alloc_trace;
pub mod dedup;
pub mod density;
pub mod guest;
pub mod host;
pub mod ksm;
pub mod latency;
pub mod layout;
pub mod mapping_cost;
pub mod merging;
pub mod ops;
pub mod overhead;
pub mod ppr;
pub mod ppr_heap;
pub mod processes;
pub mod procfs;
pub mod sdtree;
pub mod workload;
