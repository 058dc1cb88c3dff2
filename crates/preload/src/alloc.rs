//! The engine's memory, kept apart from the program's: the shim's global allocator.
//!
//! The engine must never touch memory it may freeze, and must never wait on its own fault thread.
//! With the program's `malloc`, both can happen: the program may mark its heap mergeable, and a
//! `free` on an engine thread may make glibc give memory of a registered arena back (`madvise`,
//! `brk`), which the kernel holds until the fault thread reads its report. So every allocation of
//! the shim and the engine comes from one reservation of address space of its own
//! ([`RESERVE`]), made with raw system calls, declared to the engine as memory it never registers
//! ([`pageone_engine::keep_apart`]), and handed out by dlmalloc. The reservation is `PROT_NONE`
//! (it costs no memory and no commit charge); a read/write prefix grows as it is used, and freed
//! spans go back to the kernel (`MADV_DONTNEED`) and are reused.
//!
//! If the address space cannot be reserved (a low `RLIMIT_AS`), the program's `malloc` serves
//! instead and [`apart`] says so: `PR_SET_MEMORY_MERGE` then keeps to the large mappings, where
//! glibc's arenas cannot be.
//!
//! One lock serialises the allocator; the fork hooks hold it across `fork` ([`before_fork`]), so
//! a child never finds it held by a thread it does not have.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use dlmalloc::{Allocator, Dlmalloc};

/// Address space reserved, tried from the largest down (halving) to the smallest.
const RESERVE: usize = 64 << 30;
const RESERVE_MIN: usize = 256 << 20;
/// The read/write prefix grows by this much at a time (fewer `mprotect`s).
const COMMIT_STEP: usize = 2 << 20;
/// Spans are handed out in multiples of this.
const GRAIN: usize = 64 << 10;
const PAGE: usize = 4096;
/// Blocks this large or larger are spans of their own, given back when freed (as glibc's `malloc`
/// maps large blocks apart): dlmalloc gives back only the top of its heap, and the engine's large
/// buffers come and go.
const LARGE: usize = 256 << 10;
/// Freed spans remembered for reuse; past this, a freed span's address space is not reused (its
/// memory still goes back to the kernel).
const FREE_SPANS: usize = 256;

/// The reservation and its free spans (guarded by [`LOCK`]).
struct Reserve {
    base: usize,
    len: usize,
    /// Spans at or above `base + top` were never handed out (or were given back at the top).
    top: usize,
    /// `base..base + committed` is read/write.
    committed: usize,
    /// Freed spans `(start, end)` below `top`, sorted, not touching one another.
    free: [(usize, usize); FREE_SPANS],
    nfree: usize,
    /// The reservation was tried and failed.
    failed: bool,
}

/// The allocator's state: touched only with [`LOCK`] held.
struct Heap(UnsafeCell<Dlmalloc<Space>>);
// SAFETY: every access holds LOCK.
unsafe impl Sync for Heap {}

/// dlmalloc's system allocator: spans of the reservation.
struct Space(UnsafeCell<Reserve>);
// SAFETY: used only with LOCK held (through Heap).
unsafe impl Send for Space {}

static HEAP: Heap = Heap(UnsafeCell::new(Dlmalloc::new_with_allocator(Space(
    UnsafeCell::new(Reserve {
        base: 0,
        len: 0,
        top: 0,
        committed: 0,
        free: [(0, 0); FREE_SPANS],
        nfree: 0,
        failed: false,
    }),
))));

struct Lock(UnsafeCell<libc::pthread_mutex_t>);
// SAFETY: a pthread mutex is made to be shared between threads.
unsafe impl Sync for Lock {}
static LOCK: Lock = Lock(UnsafeCell::new(libc::PTHREAD_MUTEX_INITIALIZER));

/// The engine's memory is apart (the reservation was made): set once, never cleared.
static APART: AtomicBool = AtomicBool::new(false);
/// The reservation (0 until made), for telling its blocks from the program allocator's.
static BASE: AtomicUsize = AtomicUsize::new(0);
static LEN: AtomicUsize = AtomicUsize::new(0);

fn lock() {
    // SAFETY: a statically initialised mutex, never destroyed.
    unsafe { libc::pthread_mutex_lock(LOCK.0.get()) };
}

fn unlock() {
    // SAFETY: as in `lock`; called by the thread that locked it (or, after a fork, by the child's
    // one thread, which was that thread).
    unsafe { libc::pthread_mutex_unlock(LOCK.0.get()) };
}

/// Whether the engine's memory is kept apart from the program's (see the module doc).
pub(crate) fn apart() -> bool {
    // Acquire: pairs with the Release in Reserve::reserve.
    if !APART.load(Ordering::Acquire) {
        // The first allocation reserves; make sure one was tried.
        drop(Box::new(0u8));
    }
    APART.load(Ordering::Acquire)
}

/// Before `fork`, last of the shim's hooks: no allocation is under way across it.
pub(crate) fn before_fork() {
    lock();
}

/// After `fork`, in the parent or the child, first of the shim's hooks.
pub(crate) fn after_fork() {
    unlock();
}

impl Reserve {
    /// Reserves the address space at the first use; false if it cannot be.
    fn reserve(&mut self) -> bool {
        if self.base != 0 {
            return true;
        }
        if self.failed {
            return false;
        }
        let mut len = RESERVE;
        while len >= RESERVE_MIN {
            let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE;
            // SAFETY: a new mapping at an address the kernel chooses; nothing is replaced.
            let p = unsafe {
                pageone_sys::raw_mmap(std::ptr::null_mut(), len, libc::PROT_NONE, flags, -1, 0)
            };
            if p != libc::MAP_FAILED {
                // Unlocked, whatever the program asked for its future mappings
                // (`mlockall(MCL_FUTURE)`): else the whole reservation counts as locked memory,
                // and every part made read/write is filled as it is.
                // SAFETY: the mapping just made, which holds nothing; unlocking changes no
                // contents.
                unsafe { libc::syscall(libc::SYS_munlock, p, len) };
                let (base, len) = (p as usize, len);
                // Kept apart for the life of the process (the guard is leaked).
                match pageone_engine::keep_apart(base..base + len) {
                    Some(kept) => std::mem::forget(kept),
                    None => {
                        // SAFETY: the mapping just made, not used.
                        unsafe { pageone_sys::raw_munmap(p, len) };
                        break;
                    }
                }
                (self.base, self.len) = (base, len);
                // Relaxed: see `ours`.
                LEN.store(len, Ordering::Relaxed);
                BASE.store(base, Ordering::Relaxed);
                // Release: pairs with the Acquire in `apart`.
                APART.store(true, Ordering::Release);
                return true;
            }
            len /= 2;
        }
        self.failed = true;
        false
    }

    /// Makes `base..base + end` read/write.
    fn commit(&mut self, end: usize) -> bool {
        if end <= self.committed {
            return true;
        }
        let to = end.next_multiple_of(COMMIT_STEP).min(self.len);
        let (addr, len) = (self.base + self.committed, to - self.committed);
        // SAFETY: a part of the reservation that holds nothing yet.
        let r = unsafe {
            libc::syscall(
                libc::SYS_mprotect,
                addr,
                len,
                libc::PROT_READ | libc::PROT_WRITE,
            )
        };
        if r == -1 {
            return false;
        }
        self.committed = to;
        true
    }

    fn take(&mut self, size: usize) -> Option<usize> {
        if !self.reserve() {
            return None;
        }
        let size = size.next_multiple_of(GRAIN);
        if let Some(k) = self.free[..self.nfree]
            .iter()
            .position(|&(s, e)| e - s >= size)
        {
            let (s, e) = self.free[k];
            if e - s == size {
                self.free.copy_within(k + 1..self.nfree, k);
                self.nfree -= 1;
            } else {
                self.free[k].0 = s + size;
            }
            return Some(s);
        }
        let end = self.top.checked_add(size)?;
        if end > self.len || !self.commit(end) {
            return None;
        }
        let s = self.base + self.top;
        self.top = end;
        Some(s)
    }

    /// Gives `start..end` (page-aligned) back: its memory to the kernel, its addresses to later
    /// allocations.
    fn give_back(&mut self, start: usize, end: usize) {
        if start >= end {
            return;
        }
        // SAFETY: a span of the reservation dlmalloc no longer uses.
        unsafe { libc::syscall(libc::SYS_madvise, start, end - start, libc::MADV_DONTNEED) };
        let (mut start, mut end) = (start, end);
        // Join the free spans it touches.
        let mut k = 0;
        while k < self.nfree {
            let (s, e) = self.free[k];
            if e == start || s == end {
                start = start.min(s);
                end = end.max(e);
                self.free.copy_within(k + 1..self.nfree, k);
                self.nfree -= 1;
            } else {
                k += 1;
            }
        }
        if end == self.base + self.top {
            self.top = start - self.base;
            return;
        }
        if self.nfree == FREE_SPANS {
            return;
        }
        let at = self.free[..self.nfree].partition_point(|&(s, _)| s < start);
        self.free.copy_within(at..self.nfree, at + 1);
        self.free[at] = (start, end);
        self.nfree += 1;
    }
}

// SAFETY: spans handed out are parts of the reservation, read/write, page-aligned, used by
// dlmalloc alone until given back; each method runs with LOCK held (see Heap).
unsafe impl Allocator for Space {
    fn alloc(&self, size: usize) -> (*mut u8, usize, u32) {
        // SAFETY: LOCK is held.
        let r = unsafe { &mut *self.0.get() };
        match r.take(size) {
            Some(s) => (s as *mut u8, size.next_multiple_of(GRAIN), 0),
            None => (std::ptr::null_mut(), 0, 0),
        }
    }

    fn remap(&self, _: *mut u8, _: usize, _: usize, _: bool) -> *mut u8 {
        std::ptr::null_mut()
    }

    fn free_part(&self, ptr: *mut u8, oldsize: usize, newsize: usize) -> bool {
        // SAFETY: LOCK is held.
        let r = unsafe { &mut *self.0.get() };
        let start = (ptr as usize + newsize).next_multiple_of(PAGE);
        let end = ptr as usize + oldsize;
        if start != ptr as usize + newsize {
            return false;
        }
        r.give_back(start, end);
        true
    }

    fn free(&self, ptr: *mut u8, size: usize) -> bool {
        // SAFETY: LOCK is held.
        let r = unsafe { &mut *self.0.get() };
        r.give_back(ptr as usize, ptr as usize + size);
        true
    }

    fn can_release_part(&self, _: u32) -> bool {
        true
    }

    fn allocates_zeros(&self) -> bool {
        true
    }

    fn page_size(&self) -> usize {
        PAGE
    }
}

/// The shim's global allocator (see the module doc).
pub(crate) struct EngineAlloc;

/// Whether `ptr` came from the reservation (else from the program's `malloc`).
fn ours(ptr: *mut u8) -> bool {
    // Relaxed: set once, before any block of the reservation is handed out (and a block reaches
    // another thread only through a synchronising hand-over).
    let (base, len) = (BASE.load(Ordering::Relaxed), LEN.load(Ordering::Relaxed));
    base != 0 && (ptr as usize).wrapping_sub(base) < len
}

/// Logs (once, without allocating) that a block came from the program's allocator.
fn fell_back() {
    static SAID: AtomicBool = AtomicBool::new(false);
    // Relaxed: a once-only message.
    if !SAID.swap(true, Ordering::Relaxed) {
        let msg = b"pageone: the engine's own memory ran out; the program's allocator serves it\n";
        // SAFETY: writes a static message.
        unsafe { libc::write(2, msg.as_ptr().cast(), msg.len()) };
    }
}

fn is_large(layout: Layout) -> bool {
    layout.size() >= LARGE && layout.align() <= GRAIN
}

/// Runs `f` on the allocator's state with [`LOCK`] held.
fn locked<T>(f: impl FnOnce(&mut Dlmalloc<Space>) -> T) -> T {
    lock();
    // SAFETY: LOCK is held: nothing else touches the state meanwhile.
    let r = f(unsafe { &mut *HEAP.0.get() });
    unlock();
    r
}

/// The reservation's spans (for large blocks); LOCK must be held (see [`locked`]).
fn spans(heap: &mut Dlmalloc<Space>) -> &mut Reserve {
    // SAFETY: the caller holds LOCK (it has the state exclusively).
    unsafe { &mut *heap.allocator().0.get() }
}

/// A block of the reservation: a span of its own if large, else from dlmalloc; null if the
/// reservation is used up or could not be made. Spans read zeros (never used, or given back
/// with `MADV_DONTNEED`).
fn from_reservation(layout: Layout, zeroed: bool) -> *mut u8 {
    locked(|heap| {
        if is_large(layout) {
            let r = spans(heap).take(layout.size());
            return r.map_or(std::ptr::null_mut(), |s| s as *mut u8);
        }
        // SAFETY: a valid size and alignment (the caller's layout).
        unsafe {
            if zeroed {
                heap.calloc(layout.size(), layout.align())
            } else {
                heap.malloc(layout.size(), layout.align())
            }
        }
    })
}

// SAFETY: memory comes from the reservation (dlmalloc for small blocks, spans of their own for
// large ones: told apart by the layout, which the caller gives back unchanged), or from System
// when the reservation is used up or could not be made (told apart by the address).
unsafe impl GlobalAlloc for EngineAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = from_reservation(layout, false);
        if p.is_null() {
            fell_back();
            // SAFETY: forwarded.
            return unsafe { System.alloc(layout) };
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = from_reservation(layout, true);
        if p.is_null() {
            fell_back();
            // SAFETY: forwarded.
            return unsafe { System.alloc_zeroed(layout) };
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if !ours(ptr) {
            // SAFETY: ptr came from System with this layout.
            return unsafe { System.dealloc(ptr, layout) };
        }
        locked(|heap| {
            if is_large(layout) {
                let end = ptr as usize + layout.size().next_multiple_of(GRAIN);
                spans(heap).give_back(ptr as usize, end);
            } else {
                // SAFETY: ptr came from this dlmalloc with this layout.
                unsafe { heap.free(ptr, layout.size(), layout.align()) };
            }
        });
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: the caller's alignment, a size it asked for.
        let new = unsafe { Layout::from_size_align_unchecked(new_size, layout.align()) };
        if ours(ptr) && !is_large(layout) && !is_large(new) {
            // SAFETY: ptr came from this dlmalloc with this layout.
            let p = locked(|heap| unsafe {
                heap.realloc(ptr, layout.size(), layout.align(), new_size)
            });
            if !p.is_null() {
                return p;
            }
        }
        if ours(ptr) && is_large(layout) && is_large(new) {
            let held = layout.size().next_multiple_of(GRAIN);
            if new_size.next_multiple_of(GRAIN) == held {
                return ptr;
            }
        }
        // Moved: a new block, the bytes, the old block given back.
        // SAFETY: a valid layout.
        let q = unsafe { self.alloc(new) };
        if !q.is_null() {
            // SAFETY: both blocks are live and do not overlap; ptr is then given back.
            unsafe {
                std::ptr::copy_nonoverlapping(ptr, q, layout.size().min(new_size));
                self.dealloc(ptr, layout);
            }
        }
        q
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reserve(len: usize) -> Reserve {
        Reserve {
            base: 1 << 40,
            len,
            top: 0,
            committed: len,
            free: [(0, 0); FREE_SPANS],
            nfree: 0,
            failed: false,
        }
    }

    #[test]
    fn freed_spans_are_joined_and_reused() {
        // Bookkeeping only: give_back's madvise fails harmlessly on the unmapped addresses.
        let mut r = reserve(1 << 30);
        let a = r.take(GRAIN).unwrap();
        let b = r.take(3 * GRAIN).unwrap();
        let c = r.take(GRAIN).unwrap();
        assert_eq!((b - a, c - b), (GRAIN, 3 * GRAIN));
        r.give_back(a, a + GRAIN);
        r.give_back(b, b + 3 * GRAIN);
        assert_eq!(&r.free[..r.nfree], &[(a, c)]);
        // The first fit is the joined span.
        assert_eq!(r.take(2 * GRAIN), Some(a));
        // Giving back the top span lowers the top, joined with the free span below it.
        r.give_back(c, c + GRAIN);
        assert_eq!(r.nfree, 0);
        assert_eq!(r.top, a + 2 * GRAIN - r.base);
    }

    #[test]
    fn a_reservation_runs_out_without_handing_out_memory_twice() {
        let mut r = reserve(4 * GRAIN);
        let a = r.take(2 * GRAIN).unwrap();
        let b = r.take(2 * GRAIN).unwrap();
        assert_eq!(r.take(GRAIN), None);
        r.give_back(a, a + 2 * GRAIN);
        assert_eq!(r.take(GRAIN), Some(a));
        assert_eq!(r.take(GRAIN), Some(a + GRAIN));
        assert_eq!(r.take(GRAIN), None);
        assert_ne!(a, b);
    }
}
