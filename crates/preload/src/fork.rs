//! Forks: what a forked child inherits from the shim, and when its own engine starts (see the
//! crate documentation, "Re-entrancy and fork").
//!
//! In the forking thread, before the fork, the registered ranges are recorded in a fixed buffer
//! (under [`START`], which the fork hooks hold across the fork with the pending ranges' lock, so
//! that neither is found held in the child by a thread that does not exist there). In the child,
//! the parent's engine (whose threads do not exist there) is forgotten; the child's own engine
//! starts at its first call that needs one, or a merge period after the fork from a small thread
//! (which an `exec` ends first), and registers the private anonymous read/write parts of the
//! recorded ranges.

use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard};

use libc::c_void;
use pageone_sync::lock;
use pageone_sys as sys;

use crate::pending::Pending;
use crate::{current, errno, guarded, set_errno_raw, ACTIVE, CHILD, ENGINE, MERGE_ALL, PENDING};

/// Most registered ranges (adjacent regions joined) a child inherits; the engine reports how many
/// there were, and a child with more registers the first ones (logged).
pub(crate) const MAX_INHERITED: usize = 4096;

/// The registered ranges of the parent at the last `fork` (`(start, end)`, in address order), for
/// the child's engine; `len` may exceed the buffer (see [`MAX_INHERITED`]).
pub(crate) struct Inherited {
    pub(crate) ranges: [(usize, usize); MAX_INHERITED],
    pub(crate) len: usize,
}

/// Serializes engine starts and holds the ranges a forked child inherited until its engine
/// registers them. Held by the forking thread across `fork` (see [`before_fork`]).
pub(crate) static START: Mutex<Inherited> = Mutex::new(Inherited {
    ranges: [(0, 0); MAX_INHERITED],
    len: 0,
});

/// Set in a child that inherited something to merge (registered ranges, `PR_SET_MEMORY_MERGE`)
/// until its engine starts: the starter thread is started (see [`spawn_starter`]).
static OWED: AtomicBool = AtomicBool::new(false);

/// The locks the forking thread holds across `fork`.
type Held = (MutexGuard<'static, Inherited>, MutexGuard<'static, Pending>);

thread_local! {
    static FORKING: RefCell<Option<Held>> = const { RefCell::new(None) };
}

/// Installs the fork hooks (run when the shim is loaded, before any engine starts: a fork
/// during the first start then waits for it, so [`START`] is never found held in a child).
pub(crate) fn watch_forks() -> std::io::Result<()> {
    sys::at_fork(before_fork, in_parent, in_child)
}

/// Before `fork`, in the forking thread (after the engine's own hook, which waits for a run it
/// holds still): takes [`START`] and the pending ranges' lock, and records the registered ranges.
extern "C" fn before_fork() {
    let saved = errno();
    let mut start = lock(&START);
    let st = &mut *start;
    st.len = 0;
    if let Some(eng) = current() {
        st.len = guarded(|| eng.registered_ranges(&mut st.ranges)).unwrap_or(0);
    }
    let pending = lock(&PENDING);
    FORKING.with(|f| *f.borrow_mut() = Some((start, pending)));
    set_errno_raw(saved);
    // Last: nothing allocates from here to the fork.
    crate::alloc::before_fork();
}

/// After `fork`, in the parent: the locks are released (the record is the child's alone).
extern "C" fn in_parent() {
    crate::alloc::after_fork();
    if let Some((mut start, pending)) = FORKING.with(|f| f.borrow_mut().take()) {
        start.len = 0;
        drop(pending);
        drop(start);
    }
}

/// After `fork`, in the child (one thread, this one): the locks are released, the parent's
/// engine is forgotten (leaked: its threads do not exist here), and a start of the child's own
/// is owed if it inherited something to merge.
extern "C" fn in_child() {
    crate::alloc::after_fork();
    let inherited = FORKING
        .with(|f| f.borrow_mut().take())
        .map(|(start, pending)| {
            drop(pending);
            start.len
        })
        .unwrap_or(0);
    // Relaxed: the child has one thread; threads it starts later are ordered by their creation.
    CHILD.store(true, Ordering::Relaxed);
    crate::WATCHING.store(false, Ordering::Relaxed);
    ACTIVE.store(false, Ordering::Relaxed);
    ENGINE.store(std::ptr::null_mut(), Ordering::Relaxed);
    OWED.store(
        inherited > 0 || MERGE_ALL.load(Ordering::Relaxed),
        Ordering::Relaxed,
    );
}

/// Whether a start is owed (see [`OWED`]); the caller starts the engine.
pub(crate) fn owed() -> bool {
    // Relaxed: see in_child.
    OWED.load(Ordering::Relaxed)
}

/// The engine started: nothing more is owed.
pub(crate) fn paid() {
    // Relaxed: see in_child.
    OWED.store(false, Ordering::Relaxed);
}

/// Installs [`spawn_starter`] as a child hook once the process's first engine runs: installed
/// after the engine's own hooks, it runs after them in a child (which then has its own layout
/// lock). Inherited by children (once per line of processes).
pub(crate) fn watch_forks_late() {
    static DONE: AtomicBool = AtomicBool::new(false);
    // Relaxed: called under START.
    if DONE.swap(true, Ordering::Relaxed) {
        return;
    }
    extern "C" fn nothing() {}
    if let Err(e) = sys::at_fork(nothing, nothing, spawn_starter) {
        crate::log(&format!(
            "cannot watch fork() ({e}); forked children merge only once they call madvise, mmap \
             or prctl"
        ));
    }
}

/// In a child owed a start: a detached thread, with every signal blocked (the program's handlers
/// never run on it), waits a merge period and starts the engine unless the child started it (or
/// exec'd, which ends the thread) first. Nothing else happens before that: a child that execs
/// right away pays only for the thread.
extern "C" fn spawn_starter() {
    if !owed() {
        return;
    }
    let saved = errno();
    let Ok(_mask) = sys::block_all_signals() else {
        return;
    };
    // SAFETY: a zeroed pthread_attr_t initialised by pthread_attr_init before use and destroyed
    // after; the thread runs `starter`, a plain function, with no argument.
    unsafe {
        let mut attr: libc::pthread_attr_t = std::mem::zeroed();
        let mut thread: libc::pthread_t = 0;
        if libc::pthread_attr_init(&mut attr) == 0 {
            libc::pthread_attr_setstacksize(&mut attr, 512 << 10);
            libc::pthread_attr_setdetachstate(&mut attr, libc::PTHREAD_CREATE_DETACHED);
            libc::pthread_create(&mut thread, &attr, starter, std::ptr::null_mut());
            libc::pthread_attr_destroy(&mut attr);
        }
    }
    set_errno_raw(saved);
}

/// The starter thread (see [`spawn_starter`]).
extern "C" fn starter(_: *mut c_void) -> *mut c_void {
    let ms = crate::env_number(c"PAGEONE_MERGE_PERIOD_MS").unwrap_or(200);
    std::thread::sleep(std::time::Duration::from_millis(ms));
    if owed() {
        guarded(crate::engine);
    }
    std::ptr::null_mut()
}
