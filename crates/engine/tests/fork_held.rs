//! A copy held back from reuse stays held once the process forks: a child may still map it (its
//! copy of a mapping the parent has unmapped since), so the parent's mappings no longer decide.
//! (Own process: a fork pins copies for the rest of the test binary's life.)

use std::time::Duration;

use pageone_engine::Engine;
use pageone_sys as sys;

const PAGE: usize = 4096;

/// Fills the page at `p` with content `c` (a word at a content-dependent offset).
fn fill(p: *mut u8, c: u64) {
    // SAFETY: `p` is a whole mapped page of this test's own memory.
    unsafe {
        std::ptr::write_bytes(p, 0, PAGE);
        std::ptr::write_volatile(p.add(c as usize * 8).cast::<u64>(), c);
    }
}

/// The content the page at `p` holds: 0 for zeros, `c` for `fill(p, c)`, `u64::MAX` otherwise.
fn content(p: *const u8) -> u64 {
    let mut page = [0u8; PAGE];
    // SAFETY: `p` is a whole mapped page of this test's own memory.
    unsafe { std::ptr::copy_nonoverlapping(p, page.as_mut_ptr(), PAGE) };
    let nonzero: Vec<usize> = (0..PAGE).filter(|&i| page[i] != 0).collect();
    match nonzero.first() {
        None => 0,
        Some(&i) => {
            let at = i / 8 * 8;
            let c = u64::from_le_bytes(page[at..at + 8].try_into().unwrap());
            if at == c as usize * 8 && nonzero.iter().all(|&j| j / 8 * 8 == at) {
                c
            } else {
                u64::MAX
            }
        }
    }
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
    fill(a, 1);
    fill(a.wrapping_add(PAGE), 1);
    e.register(a, 2 * PAGE).unwrap();
    let merged = |e: &Engine, f: &dyn Fn(&pageone_engine::Stats) -> bool| {
        for _ in 0..500 {
            e.wait_periods(1, Duration::from_secs(10));
            if f(&e.stats()) {
                return true;
            }
        }
        false
    };
    assert!(merged(&e, &|s| s.pages_sharing == 1), "{:?}", e.stats());
    // Both pages written: the copy is freed, and held (the pages lie over it).
    fill(a, 5);
    fill(a.wrapping_add(PAGE), 6);
    assert!(merged(&e, &|s| s.copies_held == 1), "{:?}", e.stats());
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
        let c = content(a);
        // SAFETY: ends the child at once.
        unsafe { libc::_exit(if c == 0 || c == 1 { 0 } else { 1 }) };
    }
    // The parent's pages over the copy go: only the child's remain.
    // SAFETY: the parent's own mapping; nothing refers to it any more.
    unsafe { sys::munmap(a, 2 * PAGE) }.unwrap();
    let b = sys::mmap_anonymous(2 * PAGE).unwrap();
    fill(b, 3);
    fill(b.wrapping_add(PAGE), 3);
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
    assert_eq!(content(b), 3);
}
