//! Workloads, baselines and measurements for pageone's benchmarks (run by the `pageone-bench`
//! command, this crate's binary; `pageone bench` is a front for it).
//!
//! * [`sdtree`]: the SD tree against a memcmp-ordered tree (KSM's design) and an xxh3-128 hash index,
//!   on 4 KiB keys of the seed's "easy" and "hard" kinds, with 1 and 2 threads.
//! * [`dedup`]: the whole engine against the kernel's KSM on identical regions of seed data: time to
//!   99% of the possible saving and CPU-seconds, both measured in the same run.
//! * [`processes`]: the engine's side of that benchmark as one process per region, sharing through
//!   `pageone daemon`.
//! * [`ksm`]: KSM's knobs (saved and restored), counters and `ksmd` CPU time.
//! * [`density`]: how many small QEMU guests with an allocate/free churn fit in one memory budget
//!   under each way of merging or returning memory ([`guest`]: the guests; [`host`]: the cgroup,
//!   KSM's knobs and Ctrl-C, each undone by a guard), and how fast freed guest memory comes back.
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
pub mod ppr;
pub mod ppr_heap;
pub mod processes;
pub mod sdtree;
