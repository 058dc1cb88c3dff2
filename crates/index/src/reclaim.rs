//! Safe memory reclamation for index nodes.
//!
//! In-process the tree uses epoch-based reclamation (crossbeam-epoch): every operation pins the
//! current thread, and a node unlinked from the tree is returned to the arena (and its key released to
//! the caller) only after every thread pinned at unlink time has unpinned. That is what makes node
//! reuse safe for walkers still reading it; the generation tags in edges are a second, independent
//! guard against ABA.
//!
//! Under loom, reclamation is disabled (retired nodes leak): the models check the linking protocol,
//! and crossbeam-epoch's internals are not modelled.

#[cfg(not(loom))]
pub(crate) struct Guard(crossbeam_epoch::Guard);

#[cfg(not(loom))]
impl Guard {
    /// Runs `f` once no thread can still hold a reference obtained before this call.
    pub(crate) fn defer<F: FnOnce() + Send + 'static>(&self, f: F) {
        self.0.defer(f);
    }
}

#[cfg(not(loom))]
pub(crate) fn pin() -> Guard {
    Guard(crossbeam_epoch::pin())
}

#[cfg(loom)]
pub(crate) struct Guard;

#[cfg(loom)]
impl Guard {
    pub(crate) fn defer<F: FnOnce() + Send + 'static>(&self, f: F) {
        // Leak on purpose: see the module comment.
        std::mem::forget(f);
    }
}

#[cfg(loom)]
pub(crate) fn pin() -> Guard {
    Guard
}
