//! Atomics shim: the one place the crate names its synchronisation primitives, so the lock-free code
//! can be model-checked by loom (`RUSTFLAGS="--cfg loom"`) without edits (crossbeam's `primitive`
//! pattern).

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{
    fence, AtomicPtr, AtomicU32, AtomicU64, AtomicUsize, Ordering,
};

#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{fence, AtomicPtr, AtomicU32, AtomicU64, AtomicUsize, Ordering};
