//! The one place pageone names its synchronisation primitives.
//!
//! * [`atomic`]: the standard atomics, or loom's under `RUSTFLAGS="--cfg loom"`, so lock-free code
//!   can be model-checked without edits (crossbeam's `primitive` pattern). Every ordering written
//!   against them says, where it is used, which access it pairs with.
//! * [`lock`]: takes a mutex even if a thread panicked while holding it. pageone's locks guard
//!   bookkeeping that stays consistent between statements, and a panicking engine or client thread
//!   must not take the host program's memory API (or the daemon's other clients) down with it.

use std::sync::{Mutex, MutexGuard};

/// Atomics: `std::sync::atomic`, or loom's models of them under `--cfg loom`.
pub mod atomic {
    #[cfg(loom)]
    pub use loom::sync::atomic::{
        fence, AtomicBool, AtomicPtr, AtomicU32, AtomicU64, AtomicUsize, Ordering,
    };

    #[cfg(not(loom))]
    pub use std::sync::atomic::{
        fence, AtomicBool, AtomicPtr, AtomicU32, AtomicU64, AtomicUsize, Ordering,
    };
}

/// Locks `m`, ignoring poisoning (see the crate documentation).
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::lock;
    use std::sync::{Arc, Mutex};

    #[test]
    fn a_lock_poisoned_by_a_panicking_holder_is_still_taken() {
        let m = Arc::new(Mutex::new(1));
        let m2 = m.clone();
        let r = std::thread::spawn(move || {
            let mut g = m2.lock().unwrap();
            *g = 2;
            panic!("holder panics");
        })
        .join();
        assert!(r.is_err());
        assert!(m.is_poisoned());
        assert_eq!(*lock(&m), 2);
    }
}
