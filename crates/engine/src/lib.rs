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
//! `fallocate(PUNCH_HOLE)`. Registered memory is populated with the shared zero page when it is
//! registered, and released zero pages get it back, so first touches stay in the kernel; the few
//! missing faults left (memory the program dropped behind the shim's back) are answered with the
//! zero page by a fault thread.
//!
//! The program may unmap, move, drop or re-protect registered memory at any time, also by calls
//! no shim sees: the kernel reports those changes (userfaultfd events), the fault thread records
//! them under a lock the committer holds while it freezes, and the engine applies them to its
//! regions (see the `changes` module). A change the shim does see waits for the run being merged
//! ([`changing_mappings`]), and so does `fork`. Registration calls never wait for a period. The
//! state lock is held only for bookkeeping: copies are written, indexed, frozen and compared
//! without it; between a run's freeze and its wake the committer takes no lock a program thread
//! can hold, allocates and logs nothing, and runs at normal priority.
//!
//! One copy serves at most `max_sharing` pages (KSM's `max_page_sharing`): a larger group is split
//! into chunks, each led by a page that gets a copy of its own, so content repeated many times
//! still merges in one pass.
//!
//! A process whose memory has settled is scanned less often: after a few periods that changed
//! little, the engine waits 2, 4, then 8 periods between scans, and at least 100 times what its
//! last scan cost (more below a GiB registered: 1% of a core per GiB), until something changes
//! again.
//!
//! Every non-coalescing merge costs VMAs; the committer counts them and stays under
//! `vm.max_map_count` with a margin: a merge that would cross it is not even frozen, the page
//! backs off (waits longer each time), and [`Stats`] counts it, rather than failing the host
//! process.
//!
//! # Layout
//!
//! Modules named for what they do, each using only those listed before it (besides the leaves
//! `config`, `error`, `pool`, `store`, `remote` and `proto`). The one exception is data: `state`
//! holds what the stages keep between periods, and names the types `sightings`, `watch` and
//! `read_ahead` define for it.
//!
//! * `access`: reading pages of live memory (through the kernel), and what a read finds.
//!   `apart`: the memory the engine uses itself (its threads' stacks, an embedder's allocator),
//!   which it never registers.
//! * `changes`: changes to registered memory the kernel reports; `layout`: the regions cut and
//!   moved by them, and the lock that holds mapping changes and `fork` off a frozen run.
//! * `candidates`: the pages a period may merge, and their order into batches by content.
//! * `ranges`: sets of addresses kept as ranges. `advice`: the program's advice not to dump or
//!   inherit memory, which the engine's mappings carry over.
//! * `locking`: locked memory, frozen into a locked area and locked again once merged.
//! * `freeze`: the guards that hold a run of pages still for a merge, and let it go on drop.
//! * `state`: per-page and per-region bookkeeping, the state lock's contents, what the threads
//!   share.
//! * `sightings`: the first-sighting map. `watch`: written and unchanged pages. `read_ahead`:
//!   reading newly registered pages while they wait. `registry`: registering and unregistering.
//! * `classify` → `commit`: what to do with each candidate, then doing it.
//! * `lock_all`: locking the whole process (`mlockall(MCL_CURRENT)`) but the engine's own
//!   memory.
//! * `stats`: the counters. `rejoin`: joining a daemon again. `period`: the engine and committer
//!   threads, running watch, classify and commit. `faults`: the fault thread.
//! * `engine`: the [`Engine`] handle that starts and stops it all.

mod access;
mod advice;
mod anonymize;
mod apart;
mod candidates;
mod changes;
mod classify;
mod colocate;
mod commit;
mod config;
mod dropping;
mod engine;
mod error;
mod faults;
mod freeze;
mod held;
mod huge;
mod ksm;
mod layout;
mod lock_all;
mod locking;
mod parking;
mod period;
mod pool;
mod ranges;
mod read_ahead;
mod refusals;
mod registry;
mod rejoin;
mod remote;
mod sightings;
mod spill;
mod staging;
mod state;
mod stats;
mod store;
mod stranded;
mod stripes;
mod unfilled;
mod watch;
mod zero_holes;

pub use advice::{advised, mapping_gone, mapping_moved};
pub use anonymize::{MoveFailure, SQUATTER};
pub use apart::{is_kept_apart, keep_apart, spawn as spawn_apart, EngineThread, KeptApart};
pub use config::{Builder, Config, WatchMode};
pub use dropping::DropAdvice;
pub use engine::{Engine, Region};
pub use error::{DaemonError, EngineError};
pub use layout::{changing_mappings, MappingChange};
/// The wire protocol with `pageone daemon` (its own crate, shared with the daemon).
pub use pageone_proto as proto;
/// PPR, the per-page recycler: pools of pages a program marks free (see [`Engine::recycle_from`]).
pub use pageone_recycler as recycler;
pub use pageone_sys::Priority;
pub use stats::{DaemonLink, Stats};
pub use store::{is_merged_mapping, is_store_mapping};
