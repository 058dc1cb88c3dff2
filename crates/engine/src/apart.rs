//! Memory the engine uses itself, kept out of what it registers: the stacks of its threads, and
//! whatever an embedder declares (the `LD_PRELOAD` shim's allocator). An engine thread must never
//! touch memory the engine may freeze: the fault thread would wait for itself, the committer for
//! its own run. Registering a range that overlaps such memory is refused.
//!
//! One table for the process, of fixed size, read and written without a lock and without
//! allocating (an allocator declares its memory from inside an allocation).

use std::ops::Range;
use std::thread::JoinHandle;

// std's atomics: a process-wide static table (loom models the lock-free index, not the engine).
use pageone_sys as sys;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Most ranges kept apart at once (an engine's threads take one each).
const SLOTS: usize = 512;

/// A slot being written or cleared: readers skip it.
const BUSY: usize = usize::MAX;

/// `(start, end)` of a range kept apart; `end` 0 is a free slot.
struct Slot {
    start: AtomicUsize,
    end: AtomicUsize,
}

#[allow(clippy::declare_interior_mutable_const)] // The initialiser of the array below.
const FREE: Slot = Slot {
    start: AtomicUsize::new(0),
    end: AtomicUsize::new(0),
};

static TABLE: [Slot; SLOTS] = [FREE; SLOTS];

/// A range kept apart while this guard lives (see [`keep_apart`]).
#[must_use = "the range is kept apart only while the guard lives"]
pub struct KeptApart {
    slot: usize,
}

impl Drop for KeptApart {
    fn drop(&mut self) {
        let s = &TABLE[self.slot];
        // Relaxed then Release: readers that see the slot BUSY or free skip it; one that read the
        // old end before this and the new start after it re-reads end and skips (see is_kept_apart).
        s.end.store(BUSY, Ordering::Relaxed);
        s.start.store(0, Ordering::Relaxed);
        s.end.store(0, Ordering::Release);
    }
}

/// Keeps `range` out of what any engine of this process registers while the returned guard lives
/// (leak it to keep it for good). `None` if the table is full. Allocates nothing.
pub fn keep_apart(range: Range<usize>) -> Option<KeptApart> {
    for (slot, s) in TABLE.iter().enumerate() {
        // Acquire on success: pairs with the Release in KeptApart::drop (the slot is free).
        if s.end
            .compare_exchange(0, BUSY, Ordering::Acquire, Ordering::Relaxed)
            .is_ok()
        {
            s.start.store(range.start, Ordering::Relaxed);
            // Release: pairs with the Acquire in is_kept_apart (start is written before end).
            s.end.store(range.end, Ordering::Release);
            return Some(KeptApart { slot });
        }
    }
    None
}

/// Whether `range` overlaps memory kept apart. A range being added concurrently may be missed:
/// a range matters from when [`keep_apart`] returned.
pub fn is_kept_apart(range: &Range<usize>) -> bool {
    TABLE.iter().any(|s| {
        // Acquire: pairs with the Release in keep_apart (start is visible once end is).
        let end = s.end.load(Ordering::Acquire);
        if end == 0 || end == BUSY {
            return false;
        }
        let start = s.start.load(Ordering::Relaxed);
        // Acquire: a slot cleared and reused between the two loads reads a different end.
        let again = s.end.load(Ordering::Acquire);
        again == end && start < range.end && range.start < end
    })
}

/// A thread of the engine whose stack is kept apart until it is joined (forgotten, for good).
pub struct EngineThread<T> {
    handle: JoinHandle<T>,
    _stack: Option<KeptApart>,
}

impl<T> EngineThread<T> {
    pub fn join(self) -> std::thread::Result<T> {
        self.handle.join()
    }
}

/// Starts a thread named `name` running `f`, with its stack kept apart before this returns (so
/// before anything the caller registers next). If the stack cannot be found or the table is
/// full, the thread runs all the same, logged: only memory registered over it could then hold it.
pub fn spawn<T: Send + 'static>(
    name: String,
    f: impl FnOnce() -> T + Send + 'static,
) -> std::io::Result<EngineThread<T>> {
    use std::os::unix::thread::JoinHandleExt;
    let handle = std::thread::Builder::new().name(name).spawn(f)?;
    let stack = match sys::thread_stack(handle.as_pthread_t()) {
        Ok(range) => keep_apart(range),
        Err(e) => {
            tracing::warn!(error = %e, "the stack of an engine thread could not be found");
            None
        }
    };
    if stack.is_none() {
        tracing::warn!("an engine thread's stack is not kept out of registered memory");
    }
    Ok(EngineThread {
        handle,
        _stack: stack,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_range_is_kept_apart_while_its_guard_lives() {
        let r = 0x7000_0000_0000..0x7000_0001_0000;
        assert!(!is_kept_apart(&r));
        let g = keep_apart(r.clone()).expect("a free slot");
        assert!(is_kept_apart(&(r.start + 0x1000..r.start + 0x2000)));
        assert!(is_kept_apart(&(r.start - 0x1000..r.start + 1)));
        assert!(!is_kept_apart(&(r.end..r.end + 0x1000)));
        assert!(!is_kept_apart(&(r.start - 0x1000..r.start)));
        drop(g);
        assert!(!is_kept_apart(&r));
    }

    #[test]
    fn an_engine_thread_stack_is_kept_apart_until_it_is_joined() {
        let (tx, rx) = std::sync::mpsc::channel();
        let (go, wait) = std::sync::mpsc::channel::<()>();
        let t = spawn("apart-test".into(), move || {
            let local = 0u8;
            tx.send(&local as *const u8 as usize).unwrap();
            wait.recv().unwrap();
        })
        .unwrap();
        let on_stack = rx.recv().unwrap();
        assert!(is_kept_apart(&(on_stack..on_stack + 1)));
        go.send(()).unwrap();
        t.join().unwrap();
        assert!(!is_kept_apart(&(on_stack..on_stack + 1)));
    }
}
