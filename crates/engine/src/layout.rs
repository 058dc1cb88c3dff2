//! The layout of registered memory as the engine keeps it: regions cut where the program unmapped,
//! moved or dropped part of them, and the changes the kernel reported applied to them (see the
//! `changes` module). Only bookkeeping: the mappings themselves were changed by the program.

use std::cell::RefCell;
use std::ops::Range;
use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::{Once, RwLock, RwLockReadGuard, RwLockWriteGuard};

use pageone_sync::lock;
use pageone_sys as sys;

use crate::access::PAGE;
use crate::changes::Change;
use crate::read_ahead::forget_read_ahead;
use crate::state::{pages_in_mut, PageKind, RegionState, Shared, State};

/// Held shared by whatever changes the program's mappings of registered memory (the shim around
/// `munmap`, `mremap`, `mmap(MAP_FIXED)`, `mprotect`, `mlock` and `madvise`; `fork`), and
/// exclusively by the committer for each run it holds still: such a change waits for the run
/// (one run at most), and no run starts while it is under way. One for the process: runs of all
/// engines and changes of all threads.
static FIRST: RwLock<()> = RwLock::new(());

/// The lock in use: [`FIRST`], or after a `fork` (in the child) a new one (see [`layout`]).
static LAYOUT: AtomicPtr<RwLock<()>> = AtomicPtr::new(&FIRST as *const RwLock<()> as *mut _);

/// The layout lock of this process. A forked child gets a lock of its own: its copy of the
/// parent's may count readers that were other threads of the parent (holding it at the fork),
/// which do not exist in the child and would never release it.
fn layout() -> &'static RwLock<()> {
    // Acquire: pairs with the Release of the exchange below (the new lock is initialized).
    let p = LAYOUT.load(Ordering::Acquire);
    if !p.is_null() {
        // SAFETY: FIRST, or a lock leaked below: never freed.
        return unsafe { &*p };
    }
    let fresh = Box::into_raw(Box::new(RwLock::new(())));
    // Release/Acquire: publishes the new lock; on failure, reads the one another thread put.
    match LAYOUT.compare_exchange(
        std::ptr::null_mut(),
        fresh,
        Ordering::AcqRel,
        Ordering::Acquire,
    ) {
        // SAFETY: leaked here, never freed.
        Ok(_) => unsafe { &*fresh },
        Err(other) => {
            // SAFETY: `fresh` was never shared; `other` is a leaked lock, never freed.
            unsafe {
                drop(Box::from_raw(fresh));
                &*other
            }
        }
    }
}

/// A change of the program's mappings of registered memory under way (see [`changing_mappings`]).
#[must_use = "the change is covered only while the guard lives"]
pub struct MappingChange {
    /// The outermost guard of the thread holds the lock.
    _held: Option<RwLockReadGuard<'static, ()>>,
}

thread_local! {
    /// Guards this thread holds (only the outermost holds the lock: a writer waiting between two
    /// shared acquisitions of one thread would otherwise deadlock it).
    static DEPTH: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

impl Drop for MappingChange {
    fn drop(&mut self) {
        DEPTH.with(|d| d.set(d.get() - 1));
    }
}

/// Covers a change the caller is about to make to mappings of registered memory (`munmap`,
/// `mremap`, `mmap(MAP_FIXED)` over it, `mprotect`, `mlock`, `madvise`): it waits until no run
/// is held still by an engine of this process and keeps new runs from starting until the guard is
/// dropped. The `LD_PRELOAD` shim does this for unmodified programs; without it, such a change is
/// learnt from the kernel's reports (see `docs/DESIGN.md`). Guards nest within a thread; the
/// engine's own calls that change mappings (`Engine::unregister`, `Engine::discard`) take one.
pub fn changing_mappings() -> MappingChange {
    let outer = DEPTH.with(|d| {
        d.set(d.get() + 1);
        d.get() == 1
    });
    MappingChange {
        _held: outer.then(|| layout().read().unwrap_or_else(|e| e.into_inner())),
    }
}

/// Held by the committer while a run is frozen or write-protected.
pub(crate) fn holding_still() -> RwLockWriteGuard<'static, ()> {
    layout().write().unwrap_or_else(|e| e.into_inner())
}

thread_local! {
    /// The guard the forking thread holds across `fork` (see [`watch_forks`]).
    static FORKING: RefCell<Option<MappingChange>> = const { RefCell::new(None) };
}

/// Before `fork`: waits for a run held still and for parked pages (see the `parking` module),
/// then holds new runs (which alone park pages) off until the fork returns.
extern "C" fn before_fork() {
    let held = loop {
        crate::parking::wait_for_parked_pages();
        let held = changing_mappings();
        if !crate::parking::any_parked() {
            break held;
        }
    };
    FORKING.with(|f| *f.borrow_mut() = Some(held));
}

extern "C" fn after_fork() {
    FORKING.with(|f| drop(f.borrow_mut().take()));
}

/// In a forked child: the guard taken before the fork is dropped (its lock is the parent's copy),
/// and the next use makes a new lock (see [`layout`]), not allocated here.
extern "C" fn after_fork_in_child() {
    after_fork();
    // Relaxed: the child has one thread now; later loads by threads it starts are ordered by
    // their creation.
    LAYOUT.store(std::ptr::null_mut(), Ordering::Relaxed);
}

/// Makes `fork` wait for a run held still and for parked pages, and hold new runs off until it
/// returns: a child copies the parent's memory as it is, and a frozen or parked page is not in it
/// (the child would read it empty). Installed once per process.
pub(crate) fn watch_forks() -> std::io::Result<()> {
    static ONCE: Once = Once::new();
    let mut r = Ok(());
    ONCE.call_once(|| r = sys::at_fork(before_fork, after_fork, after_fork_in_child));
    r
}

/// Takes the pages of `range` out of the regions: the parts of a region outside it stay
/// registered as regions of their own; the parts inside are returned, in address order.
pub(crate) fn cut(st: &mut State, range: Range<usize>) -> Vec<RegionState> {
    let keys: Vec<usize> = st
        .regions
        .range(..range.end)
        .filter(|(_, r)| r.start + r.len() > range.start)
        .map(|(&k, _)| k)
        .collect();
    let mut out = Vec::with_capacity(keys.len());
    for k in keys {
        let mut r = st.regions.remove(&k).expect("listed above");
        let end = r.start + r.len();
        if end > range.end {
            let right = split_off(&mut r, range.end);
            st.regions.insert(right.start, right);
        }
        if r.start < range.start {
            let mid = split_off(&mut r, range.start);
            st.regions.insert(r.start, r);
            out.push(mid);
        } else {
            out.push(r);
        }
    }
    out
}

/// Splits region `r` at `at` (page-aligned, inside it): `r` keeps the pages below, the region
/// returned holds the others.
fn split_off(r: &mut RegionState, at: usize) -> RegionState {
    let i = (at - r.start) / PAGE;
    RegionState {
        start: at,
        pages: r.pages.split_off(i),
        locked: r.locked.split_off(at - r.start),
        merged_ever: r.merged_ever,
        armed_at: r.armed_at,
        sums: r.sums.split_off(i.min(r.sums.len())),
        huge_seen: r.huge_seen,
        to_ksm: r.to_ksm,
        wants_ksm: r.wants_ksm,
        spending: r.spending,
        chunks: split_chunks(&mut r.chunks, i),
    }
}

/// The chunks (see `RegionState::chunks`) of the pages from `i` on, taken from `chunks`: where
/// `i` starts a chunk they keep their places; otherwise chunks no longer line up with the
/// region's start and the upper part starts with none.
fn split_chunks(chunks: &mut Vec<crate::state::Chunk>, i: usize) -> Vec<crate::state::Chunk> {
    let c = i / crate::ksm::CHUNK_PAGES;
    if i % crate::ksm::CHUNK_PAGES == 0 {
        chunks.split_off(c.min(chunks.len()))
    } else {
        chunks.truncate(c + 1);
        Vec::new()
    }
}

/// Forgets the pages of `piece`, whose mappings are gone: the copies they mapped lose a
/// reference, released zero pages are no longer counted, first sightings of them go stale.
pub(crate) fn forget_pages(st: &mut State, piece: &RegionState) {
    for p in &piece.pages {
        match p.kind {
            PageKind::Merged => st.store.drop_ref(p.sid),
            PageKind::Zero => st.zero -= 1,
            PageKind::Unique => st.stale_sightings += 1,
            PageKind::Anon
            | PageKind::Broken
            | PageKind::Foreign
            | PageKind::Parked
            | PageKind::Refused => {}
        }
    }
}

/// Applies the changes the kernel reported and the engine has not applied yet to the regions
/// (the caller holds the state lock: lock order state, then change log).
pub(crate) fn apply_changes(sh: &Shared, st: &mut State) {
    fill_dropped_store_pages(sh);
    if lock(&sh.changes).is_empty() {
        return;
    }
    // Allocated before the log's lock: the fault thread may wait for it (see `changes::ROOM`).
    let room = Vec::with_capacity(crate::changes::ROOM);
    let changes = lock(&sh.changes).take(room);
    // Read-ahead results name addresses that may have changed. Dropped pages change none: their
    // epochs move on (see `dropped`), so their results go unused, and the wait for a read-ahead
    // under way (a whole registration's) is not put on a `MADV_DONTNEED`.
    if changes.iter().any(|c| !matches!(c, Change::Remove { .. })) {
        forget_read_ahead(st);
    }
    // Where memory moved, the program's advice is checked against the kernel's once, after all
    // the moves (see `advice::moved_by_kernel_later`).
    let mut moved_to = Vec::new();
    for c in changes.iter() {
        match c {
            Change::Unmap { start, end } => {
                // The program's advice went with the mapping (see `advice`).
                crate::advice::unmapped_by_kernel(start..end, changes.since);
                for piece in cut(st, start..end) {
                    forget_pages(st, &piece);
                }
            }
            Change::Remap { from, to, len } => {
                // The program's advice went with the memory (see `advice`).
                let (old, new) = (from..from + len, to..to + len);
                crate::advice::moved_by_kernel_later(old, new, changes.since, &mut moved_to);
                moved(st, from, to, len);
            }
            Change::Remove { start, end } => dropped(st, start..end),
        }
    }
    crate::advice::refresh_all(&moved_to);
    if let Some(mut spill) = changes.spill {
        // Emptied (its memory given back) before the log's lock, which the fault thread needs.
        spill.clear();
        lock(&sh.changes).give_back(spill);
    }
    st.store.punch_pending();
}

/// Maps the zero page over the store mappings' pages the program dropped behind the engine's
/// back since the last time (see the `unfilled` module). Called with the state lock held, so no
/// store mapping is made meanwhile.
fn fill_dropped_store_pages(sh: &Shared) {
    let Some(u) = &sh.store_uffd else { return };
    if lock(&sh.changes).unfilled.nothing_to_fill() {
        return;
    }
    // Allocated before the log's lock: the fault thread may wait for it (see `changes::ROOM`).
    let room = Vec::with_capacity(crate::unfilled::ROOM);
    let mut waiting = lock(&sh.changes).unfilled.to_fill(room);
    waiting.retain(|w| crate::unfilled::fill(u, &w.range));
    lock(&sh.changes).unfilled.filled(&waiting);
}

/// `[from, from+len)` moved to `to`, its pages with it (and its registration: the kernel keeps
/// it when reporting moves). Whatever was registered at `to` was unmapped (reported before).
fn moved(st: &mut State, from: usize, to: usize, len: usize) {
    for piece in cut(st, to..to + len) {
        forget_pages(st, &piece);
    }
    for mut piece in cut(st, from..from + len) {
        piece.start = piece.start - from + to;
        for p in &mut piece.pages {
            if p.kind == PageKind::Unique {
                // Its first sighting names the old address.
                p.kind = PageKind::Anon;
                p.unchanged = 0;
                st.stale_sightings += 1;
            }
        }
        st.regions.insert(piece.start, piece);
    }
}

/// The pages of `range` were dropped (`MADV_DONTNEED`): they read zeros now, anonymous ones as
/// the kernel gives them, pages of store mappings through the engine (see the `unfilled`
/// module): those are private pages of a store mapping from now on, like pages written since
/// their merge, and a merged one no longer counts its copy.
fn dropped(st: &mut State, range: Range<usize>) {
    let State {
        regions,
        store,
        stale_sightings,
        ..
    } = st;
    for p in pages_in_mut(regions, range) {
        match p.kind {
            PageKind::Anon | PageKind::Unique | PageKind::Parked | PageKind::Refused => {
                if p.kind == PageKind::Unique {
                    *stale_sightings += 1;
                }
                p.kind = PageKind::Anon;
            }
            PageKind::Merged => {
                store.drop_ref(p.sid);
                p.kind = PageKind::Broken;
            }
            PageKind::Broken | PageKind::Foreign => p.kind = PageKind::Broken,
            PageKind::Zero => continue,
        }
        p.unchanged = 0;
        p.epoch = p.epoch.wrapping_add(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::Page;

    fn region(start: usize, n: usize) -> RegionState {
        let pages = (0..n)
            .map(|i| Page {
                epoch: i as u8,
                ..Page::default()
            })
            .collect();
        RegionState {
            sums: vec![0; n],
            ..RegionState::new(start, pages)
        }
    }

    /// A thread of the parent holding the lock shared at a fork does not exist in the child,
    /// which must not wait for it: the child's lock is its own.
    #[test]
    fn a_forked_child_gets_a_layout_lock_of_its_own() {
        watch_forks().unwrap();
        let (held, wait_held) = std::sync::mpsc::channel();
        let (release, wait_release) = std::sync::mpsc::channel::<()>();
        let holder = std::thread::spawn(move || {
            let _change = changing_mappings();
            held.send(()).unwrap();
            let _ = wait_release.recv();
        });
        wait_held.recv().unwrap();
        let no_run = crate::freeze::tests::NO_FORK
            .write()
            .unwrap_or_else(|e| e.into_inner());
        // SAFETY: the child only tries the lock (allocating once, which glibc allows after a
        // fork) and _exits.
        let pid = unsafe { libc::fork() };
        drop(no_run);
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            let free = layout().try_write().is_ok();
            // SAFETY: leaves without running the parent's destructors or test harness.
            unsafe { libc::_exit(if free { 0 } else { 1 }) };
        }
        release.send(()).unwrap();
        holder.join().unwrap();
        let mut status = 0;
        // SAFETY: waits for our own child.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert!(
            libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
            "the child found its layout lock held by a thread of its parent"
        );
    }

    #[test]
    fn splitting_keeps_every_page_in_order() {
        let mut r = region(10 * PAGE, 8);
        let right = split_off(&mut r, 13 * PAGE);
        assert_eq!((r.start, r.pages.len(), r.sums.len()), (10 * PAGE, 3, 3));
        assert_eq!((right.start, right.pages.len()), (13 * PAGE, 5));
        assert_eq!(right.pages[0].epoch, 3);
    }

    #[test]
    fn split_at_a_chunk_the_chunks_keep_their_places_elsewhere_the_upper_part_has_none() {
        use crate::ksm::CHUNK_PAGES as C;
        let mut r = region(0, 3 * C + 5);
        for (c, pages) in [(0, 10), (1, 20), (2, 30), (3, 40)] {
            r.chunk_mut(c * C).spending.pages = pages;
        }
        let spent = |r: &RegionState| {
            r.chunks
                .iter()
                .map(|c| c.spending.pages)
                .collect::<Vec<_>>()
        };
        let right = split_off(&mut r, 2 * C * PAGE);
        assert_eq!((spent(&r), spent(&right)), (vec![10, 20], vec![30, 40]));
        let right = split_off(&mut r, (C + 7) * PAGE);
        assert_eq!((spent(&r), spent(&right)), (vec![10, 20], vec![]));
    }
}
