//! Atomics shim: the crate names its synchronisation primitives through `pageone_sync::atomic`,
//! so the lock-free code can be model-checked by loom (`RUSTFLAGS="--cfg loom"`) without edits.

#[cfg(loom)]
pub(crate) use pageone_sync::atomic::fence;
pub(crate) use pageone_sync::atomic::{AtomicPtr, AtomicU32, AtomicU64, AtomicUsize, Ordering};
