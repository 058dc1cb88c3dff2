//! Atomics shim: the one place the crate names its synchronisation primitives, so the slot
//! protocol can be model-checked by loom (`RUSTFLAGS="--cfg loom"`) without edits.

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{fence, AtomicU64, Ordering};

#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{fence, AtomicU64, Ordering};
