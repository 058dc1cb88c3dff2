//! The committer and the fault thread on one CPU while a batch commits.
//!
//! Every mapping the commit makes over registered memory (a copy mapped over a frozen page, the
//! scratch area discarded) is reported on the userfaultfd, and the kernel holds the committer
//! until the fault thread has read the report: a round trip between the two threads for each
//! mapping, which with scattered duplicates is one per merged page. On different CPUs each trip
//! wakes a sleeping CPU with an interrupt, twice (the fault thread's to read, the committer's to
//! go on), which in a virtual machine costs an exit to the hypervisor each, more than all the rest
//! of the merge (measured: docs/benchmarks.md, "Scattered duplicates across processes"). On one
//! CPU the committer's wait hands the CPU to the fault thread and back, which is the cheapest a
//! round trip gets.
//!
//! Only for the commit of a batch that holds pages still: the CPU is the one the committer runs
//! on when the first run is held, and both threads get their own CPUs back when the commit ends
//! (the guard's drop). The fault thread still answers the program's faults meanwhile, from that
//! CPU.

use std::sync::atomic::Ordering;

use pageone_sys as sys;

use crate::state::Shared;

/// The committer (the calling thread) and the fault thread confined to the CPU the committer runs
/// on, until dropped: then each may run where it could before.
pub(crate) struct Colocated {
    fault_tid: i32,
    committer: sys::Affinity,
    fault: sys::Affinity,
}

impl Colocated {
    /// Confines both threads to the calling thread's CPU; `None` (nothing changed) when that is
    /// not possible or gains nothing: the fault thread is not running, the committer may use one
    /// CPU only anyway, or the fault thread may not use that CPU.
    pub(crate) fn enter(sh: &Shared) -> Option<Self> {
        // Relaxed: an id the fault thread stored when it started (0 before).
        let fault_tid = sh.fault_thread_id.load(Ordering::Relaxed);
        if fault_tid == 0 {
            return None;
        }
        let committer = sys::thread_affinity(0).ok()?;
        if committer.count() < 2 {
            return None;
        }
        let fault = sys::thread_affinity(fault_tid).ok()?;
        let one = sys::Affinity::only(sys::current_cpu()?)?;
        sys::set_thread_affinity(0, &one).ok()?;
        if sys::set_thread_affinity(fault_tid, &one).is_err() {
            let _ = sys::set_thread_affinity(0, &committer);
            return None;
        }
        Some(Colocated {
            fault_tid,
            committer,
            fault,
        })
    }
}

impl Drop for Colocated {
    fn drop(&mut self) {
        let _ = sys::set_thread_affinity(self.fault_tid, &self.fault);
        let _ = sys::set_thread_affinity(0, &self.committer);
    }
}
