//! A copy held back from reuse stays held once the process forks: a child may still map it (its
//! copy of a mapping the parent has unmapped since), so the parent's mappings no longer decide.
//! (Own process: a fork pins copies for the rest of the test binary's life.)

use std::time::Duration;

use pageone_engine::Engine;
use pageone_sys as sys;

mod common;
use common::{check, fill, wait_for, PAGE};

/// The page at `p`, of this test's own memory, as a slice.
///
/// # Safety
/// `p` is a mapped page that nothing else writes while the slice lives.
unsafe fn page<'a>(p: *mut u8) -> &'a mut [u8] {
    // SAFETY: the caller's.
    unsafe { std::slice::from_raw_parts_mut(p, PAGE) }
}

#[test]
fn a_copy_held_before_a_fork_is_never_reused_under_the_child() {
    // One copy: any later merge must reuse it.
    let e = Engine::builder()
        .merge_period(Duration::from_millis(20))
        .store_pages(1)
        .build()
        .expect("engine");
    let a = sys::mmap_anonymous(2 * PAGE).unwrap();
    // SAFETY: pages of this test's own mapping (unmapped below only after their last use); the
    // engine moves pages but never changes their bytes, and no other thread touches them.
    let (a0, a1) = unsafe { (page(a), page(a.wrapping_add(PAGE))) };
    fill(a0, 1);
    fill(a1, 1);
    e.register(a, 2 * PAGE).unwrap();
    let s = wait_for(&e, |s| s.pages_sharing == 1);
    assert_eq!(s.pages_sharing, 1, "{s:?}");
    // Both pages written: the copy is freed, and held (the pages lie over it).
    fill(a0, 5);
    fill(a1, 6);
    let s = wait_for(&e, |s| s.copies_held == 1);
    assert_eq!(s.copies_held, 1, "{s:?}");
    let (r, w) = sys::pipe().unwrap();
    // SAFETY: the child only reads a pipe, calls madvise and reads its own memory, then
    // `_exit`s (no allocation, no lock another thread of the parent might hold).
    let child = unsafe { libc::fork() };
    assert!(child >= 0);
    if child == 0 {
        let mut b = [0u8; 1];
        // SAFETY: reads one byte into `b` from the pipe's read end.
        unsafe {
            libc::read(
                std::os::fd::AsRawFd::as_raw_fd(&r),
                b.as_mut_ptr().cast(),
                1,
            )
        };
        // SAFETY: the child's own page, dropped where no engine sees it (none runs here).
        unsafe { libc::madvise(a.cast(), PAGE, libc::MADV_DONTNEED) };
        let ok = check(a0, 0) || check(a0, 1);
        // SAFETY: ends the child at once.
        unsafe { libc::_exit(if ok { 0 } else { 1 }) };
    }
    // The parent's pages over the copy go: only the child's remain.
    // SAFETY: the parent's own mapping; nothing refers to it any more.
    unsafe { sys::munmap(a, 2 * PAGE) }.unwrap();
    let b = sys::mmap_anonymous(2 * PAGE).unwrap();
    // SAFETY: as for `a`.
    let (b0, b1) = unsafe { (page(b), page(b.wrapping_add(PAGE))) };
    fill(b0, 3);
    fill(b1, 3);
    e.register(b, 2 * PAGE).unwrap();
    // Long enough for the held copy to be checked again (about once a second) and reused, were
    // the parent's mappings to decide.
    std::thread::sleep(Duration::from_millis(2500));
    e.wait_periods(3, Duration::from_secs(10));
    // SAFETY: writes one byte from a local to the pipe's write end.
    unsafe {
        libc::write(
            std::os::fd::AsRawFd::as_raw_fd(&w),
            [1u8].as_ptr().cast(),
            1,
        )
    };
    let mut status = 0;
    // SAFETY: waits for the child forked above.
    assert_eq!(unsafe { libc::waitpid(child, &mut status, 0) }, child);
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "the child's dropped page read other bytes (status {status}); {:?}",
        e.stats()
    );
    assert!(check(b0, 3));
}
