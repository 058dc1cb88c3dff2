//! Workloads, baselines and measurements for pageone's benchmarks (run by the `pageone-bench`
//! command, this crate's binary; `pageone bench` is a front for it).
//!
//! * [`sdtree`]: the SD tree against a memcmp-ordered tree (KSM's design) and an xxh3-128 hash index,
//!   on 4 KiB keys of the seed's "easy" and "hard" kinds, with 1 and 2 threads.
//! * [`dedup`]: the whole engine against the kernel's KSM on identical regions of seed data: time to
//!   99% of the possible saving and CPU-seconds, both measured in the same run.
//! * [`processes`]: the engine's side of that benchmark as one process per region, sharing through
//!   `pageone daemon`.
//! * [`ksm`]: KSM's knobs (every one saved and restored), counters and `ksmd` CPU time;
//!   [`procfs`]: what `/proc` says about the benchmarks' processes; [`mapping_cost`]: the kernel
//!   memory of VMAs; [`latency`]: latency histograms; [`layout`]: where shared contents lie.
//! * [`ppr`]: PPR (marking freed pages, the engine releasing them) against `madvise(MADV_DONTNEED)`.
//!
//! Benchmarks report numbers; they never assert timings. Every run checks the data it measured on.

pub mod dedup;
pub mod ksm;
pub mod latency;
pub mod layout;
pub mod mapping_cost;
pub mod ppr;
pub mod processes;
pub mod procfs;
pub mod sdtree;
