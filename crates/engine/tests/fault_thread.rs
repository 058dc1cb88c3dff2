//! The fault thread records the kernel's reports without allocating, however many come in one
//! period: an allocation can wait on a thread that itself waits until the fault thread reads its
//! report (a `free` whose `madvise` of registered memory the kernel holds while the allocator's
//! lock is held, say). Checked by this test binary's allocator, which counts the allocations made
//! on the fault thread.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use pageone_engine::Engine;

mod common;
use common::{check, fill, wait_for, PAGE};

/// Allocations made on the engine's fault thread.
static ON_FAULT_THREAD: AtomicUsize = AtomicUsize::new(0);

/// The system's allocator, counting what the fault thread allocates.
struct Counting;

fn on_fault_thread() -> bool {
    let mut name = [0u8; 16];
    // SAFETY: the buffer's length is passed; the kernel's thread names take 16 bytes at most.
    let r = unsafe {
        libc::pthread_getname_np(libc::pthread_self(), name.as_mut_ptr().cast(), name.len())
    };
    r == 0 && name.starts_with(b"pageone-faults\0")
}

// SAFETY: every call is forwarded to the system's allocator with its arguments.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if on_fault_thread() {
            // Relaxed: a counter read after the fault thread answered (see the test).
            ON_FAULT_THREAD.fetch_add(1, Ordering::Relaxed);
        }
        // SAFETY: the caller's contract, forwarded.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract, forwarded.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if on_fault_thread() {
            // Relaxed: as in `alloc`.
            ON_FAULT_THREAD.fetch_add(1, Ordering::Relaxed);
        }
        // SAFETY: the caller's contract, forwarded.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// Many more reports in one period than the change log keeps room for (`MADV_DONTNEED` of one
/// page at a time, each held by the kernel until the fault thread read it): none allocates, and
/// the engine applies them all at its next period.
#[test]
fn the_fault_thread_records_many_reports_without_allocating() {
    // Periods run only when kicked (wait_for): the reports pile up meanwhile.
    let e = Engine::builder()
        .merge_period(Duration::from_secs(3600))
        .build()
        .unwrap();
    let n = 12 * 1024;
    let mut r = e.alloc_region(n * PAGE).unwrap();
    for (i, p) in r.as_mut_slice().chunks_mut(PAGE).enumerate() {
        fill(p, 1 + i as u64);
    }
    let before = ON_FAULT_THREAD.load(Ordering::Relaxed);
    for i in 0..n {
        let page = r.as_ptr().wrapping_add(i * PAGE);
        // SAFETY: a page of the test's own region.
        let dropped = unsafe { libc::madvise(page.cast(), PAGE, libc::MADV_DONTNEED) };
        assert_eq!(dropped, 0);
    }
    // Relaxed: each madvise returned after the fault thread read its report.
    let allocated = ON_FAULT_THREAD.load(Ordering::Relaxed) - before;
    assert_eq!(
        allocated, 0,
        "the fault thread allocated while recording {n} reports"
    );
    // The reports are applied: the pages read zeros, and written again in pairs they merge.
    assert!(r.as_slice().chunks(PAGE).all(|p| check(p, 0)));
    for (i, p) in r.as_mut_slice().chunks_mut(PAGE).enumerate() {
        fill(p, 1 + (i % (n / 2)) as u64);
    }
    let s = wait_for(&e, |s| s.pages_sharing >= (n / 2) as u64);
    assert!(s.pages_sharing >= (n / 2) as u64, "{s:?}");
    for (i, p) in r.as_slice().chunks(PAGE).enumerate() {
        assert!(check(p, 1 + (i % (n / 2)) as u64), "page {i}");
    }
}
