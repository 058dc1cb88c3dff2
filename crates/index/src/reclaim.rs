//! Safe memory reclamation for index nodes and the keys their leaves name.
//!
//! Every operation pins the current thread; a node unlinked from the tree is returned to the arena,
//! and a leaf's key released to the caller, only after every thread that could still read it has
//! unpinned (epoch-based reclamation). In-process this is crossbeam-epoch. Under loom it is
//! `Domain`, a small model of the same algorithm written against loom's atomics, so the models
//! free and reuse nodes, and release keys, while other threads walk.
//!
//! # What a pinned reader may read
//!
//! An unlinked node is still reachable in two ways: through edges read before the unlink (by
//! walkers inside the removed subtree), and through *hints*: representatives are edges to leaves
//! that nothing keeps linked, and removals start from a caller's [`Entry`](crate::Entry). The
//! thread whose CAS unlinks a node therefore first bumps its generation
//! ([`Arena::invalidate`](crate::arena::Arena::invalidate)), then defers the free and the key
//! release. A hint is accepted only if the node's generation, loaded while pinned, is still the
//! hint's. The bump is to hints what the unlinking CAS is to edges: a reader that loaded the
//! generation before the bump is waited for, exactly like a reader that loaded an edge before the
//! CAS. So nothing is freed or released under a reader that accepted it, and a node's fields never
//! change while any thread that accepted it is pinned: no seqlock re-check is needed.
//!
//! Why the wait holds (the argument is crossbeam's, and the loom `Domain` follows it step by step): the
//! reader's pin stores its epoch then executes a SeqCst fence `Fr`; the deferring thread executes a
//! SeqCst fence `Fd` after the bump, then reads the global epoch `e` that tags the garbage, which
//! is freed once the global epoch reaches `e + 2`. If `Fd` preceded `Fr` in the SeqCst order, the
//! reader's later generation load would see the bump (C++20 [atomics.fences]); it did not, so
//! `Fr` precedes `Fd`. An advance from `e + 1` to `e + 2` reads `e + 1` then fences (`Fa`); the
//! deferrer's read of `e` is coherence-ordered before that read, so `Fd` precedes `Fa`, hence `Fr`
//! precedes `Fa` and the advancer sees the reader pinned (or already unpinned). The reader's
//! epoch was read before `Fr`, so it is at most `e` (had it read `e + 1`, `Fd` would precede
//! `Fr` by the same coherence rule), and the advance to `e + 2` waits for it to unpin.

#[cfg(not(loom))]
mod imp {
    use std::marker::PhantomData;

    /// Pins the current thread in crossbeam-epoch's global collector; see the module documentation.
    pub(crate) struct Domain;

    pub(crate) struct Guard<'d>(crossbeam_epoch::Guard, PhantomData<&'d Domain>);

    impl Domain {
        pub(crate) fn new() -> Self {
            Domain
        }

        pub(crate) fn pin(&self) -> Guard<'_> {
            Guard(crossbeam_epoch::pin(), PhantomData)
        }
    }

    impl Guard<'_> {
        /// Runs `f` once no thread can still hold a reference obtained before this call.
        pub(crate) fn defer<F: FnOnce() + Send + 'static>(&self, f: F) {
            self.0.defer(f);
        }
    }
}

#[cfg(loom)]
mod imp {
    use crate::primitive::{fence, AtomicUsize, Ordering};

    /// Threads a model may pin at once (the models run two).
    const SLOTS: usize = 2;
    /// Slot value of a pinned thread: `epoch << 1 | PINNED`; 0 is a free slot.
    const PINNED: usize = 1;

    type Deferred = Box<dyn FnOnce() + Send>;

    /// crossbeam-epoch's algorithm, per tree, with loom's atomics: a global epoch, one slot per
    /// pinned thread, and garbage tagged with the epoch it was deferred in, run once the global
    /// epoch is two ahead. Unlike crossbeam (which collects every 128 pins), every unpin that sees
    /// garbage advances the epoch as far as it can (twice) and runs what expired, so that nodes
    /// are freed, reused and their keys released within a model's few operations. Advancing only
    /// when there is garbage changes nothing for safety (epochs only ever need to move to free).
    pub(crate) struct Domain {
        epoch: AtomicUsize,
        slots: [AtomicUsize; SLOTS],
        /// Entries in `garbage`, so that an unpin with nothing to free touches no lock.
        pending: AtomicUsize,
        garbage: loom::sync::Mutex<Vec<(usize, Deferred)>>,
    }

    impl Domain {
        pub(crate) fn new() -> Self {
            Domain {
                epoch: AtomicUsize::new(0),
                slots: std::array::from_fn(|_| AtomicUsize::new(0)),
                pending: AtomicUsize::new(0),
                garbage: loom::sync::Mutex::new(Vec::new()),
            }
        }
    }

    pub(crate) struct Guard<'d> {
        domain: &'d Domain,
        slot: usize,
        /// This operation's garbage, pushed at unpin (crossbeam's thread-local bag).
        bag: std::cell::RefCell<Vec<Deferred>>,
    }

    impl Domain {
        pub(crate) fn pin(&self) -> Guard<'_> {
            // Relaxed: a stale epoch only pins us earlier, which holds the advance back longer.
            let e = self.epoch.load(Ordering::Relaxed);
            let slot = (0..SLOTS)
                .find(|&i| {
                    // Relaxed: the fence below orders the slot's store before our reads of the tree.
                    self.slots[i]
                        .compare_exchange(0, e << 1 | PINNED, Ordering::Relaxed, Ordering::Relaxed)
                        .is_ok()
                })
                .expect("more threads pinned than the loom reclamation model has slots");
            // `Fr` of the module documentation: pairs with the fences in `defer` and `try_advance`.
            fence(Ordering::SeqCst);
            Guard {
                domain: self,
                slot,
                bag: Default::default(),
            }
        }

        /// Advances the global epoch if every pinned thread is in it. Returns the epoch that this
        /// thread has synchronised with: everything the advances up to it observed happens before
        /// our next steps.
        fn try_advance(&self) -> usize {
            // Relaxed, then the fence: `Fa` orders this read before the slot reads (see the module
            // documentation) and acquires the advance that stored `e`.
            let e = self.epoch.load(Ordering::Relaxed);
            fence(Ordering::SeqCst);
            for s in &self.slots {
                let v = s.load(Ordering::Relaxed);
                if v & PINNED != 0 && v >> 1 != e {
                    return e;
                }
            }
            // Acquire: the unpinning stores (Release) we read above happen before any garbage we
            // run, so a thread's last reads come before the frees they allowed.
            fence(Ordering::Acquire);
            // A CAS, not a store: an advancer that is not pinned itself must not move the epoch
            // back from a later value it did not scan against. Release pairs with the fence after
            // the epoch read above, in the next advancer. On failure we know only `e`.
            match self
                .epoch
                .compare_exchange(e, e + 1, Ordering::Release, Ordering::Relaxed)
            {
                Ok(_) => e + 1,
                Err(_) => e,
            }
        }

        /// Runs the garbage whose grace period is over.
        fn collect(&self) {
            // Relaxed: a stale zero only postpones collection to a later unpin.
            if self.pending.load(Ordering::Relaxed) == 0 {
                return;
            }
            self.try_advance();
            let now = self.try_advance();
            let ready: Vec<Deferred> = {
                let mut garbage = self.garbage.lock().unwrap();
                let (ready, keep): (Vec<_>, Vec<_>) = std::mem::take(&mut *garbage)
                    .into_iter()
                    .partition(|&(e, _)| e + 2 <= now);
                *garbage = keep;
                ready.into_iter().map(|(_, f)| f).collect()
            };
            if !ready.is_empty() {
                // Relaxed: a count for the fast path above; the lock orders the garbage itself.
                self.pending.fetch_sub(ready.len(), Ordering::Relaxed);
            }
            for f in ready {
                f();
            }
        }

        /// Runs all garbage: for the tree's drop, when no thread can be pinned on it any more.
        pub(crate) fn drain(&self) {
            let all = std::mem::take(&mut *self.garbage.lock().unwrap());
            for (_, f) in all {
                f();
            }
        }
    }

    impl Guard<'_> {
        /// Runs `f` once no thread can still hold a reference obtained before this call.
        pub(crate) fn defer<F: FnOnce() + Send + 'static>(&self, f: F) {
            self.bag.borrow_mut().push(Box::new(f));
        }
    }

    impl Drop for Guard<'_> {
        fn drop(&mut self) {
            let d = self.domain;
            let bag = self.bag.take();
            if !bag.is_empty() {
                // `Fd` of the module documentation: everything before it (the unlinking CASes,
                // the generation bumps) precedes the epoch read that tags the garbage.
                fence(Ordering::SeqCst);
                let e = d.epoch.load(Ordering::Relaxed);
                let n = bag.len();
                d.garbage
                    .lock()
                    .unwrap()
                    .extend(bag.into_iter().map(|f| (e, f)));
                // Relaxed: see `collect`.
                d.pending.fetch_add(n, Ordering::Relaxed);
            }
            // Release pairs with the Acquire fence in `try_advance`: our reads precede the frees.
            d.slots[self.slot].store(0, Ordering::Release);
            d.collect();
        }
    }
}

pub(crate) use imp::{Domain, Guard};
