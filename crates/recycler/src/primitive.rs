//! Atomics shim: the crate names its synchronisation primitives through `pageone_sync::atomic`,
//! so the slot protocol can be model-checked by loom (`RUSTFLAGS="--cfg loom"`) without edits.

pub(crate) use pageone_sync::atomic::{fence, AtomicU64, Ordering};
