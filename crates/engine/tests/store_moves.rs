//! The program's moves of store mappings are counted (a held copy is given back only with none
//! between two reads of the process's mappings: see the engine's `held` module); the engine's
//! own moves, which map copies as pages merge, are not.

use std::time::{Duration, Instant};

mod common;
use common::{check, halves, small_engine, wait_for, PAGE};

/// Whether the page at `addr` lies in a mapping of a file (the store's, in this test).
fn in_store_mapping(addr: usize) -> bool {
    pageone_sys::self_mappings()
        .unwrap()
        .iter()
        .any(|m| m.start <= addr && addr < m.end && m.inode != 0)
}

#[test]
fn a_move_of_a_store_mapping_by_the_program_is_counted_and_the_engines_are_not() {
    let e = small_engine(false);
    let n = 64;
    let r = halves(&e, n);
    let s = wait_for(&e, |s| s.pages_sharing >= n as u64);
    assert_eq!(s.pages_sharing, n as u64, "{s:?}");
    assert_eq!(e.store_moves(), 0, "the engine's own moves were counted");
    let from = r.as_ptr() as usize + (n + 5) * PAGE;
    assert!(in_store_mapping(from), "page {} is not merged", n + 5);
    // Somewhere to move it: a page of address space of the test's own.
    let to = pageone_sys::mmap_anonymous(PAGE).unwrap() as usize;
    // SAFETY: moves one page of the test's region (a raw system call: no shim in this test) over
    // the page mapped just above; nothing refers to either.
    let moved = unsafe {
        libc::syscall(
            libc::SYS_mremap,
            from,
            PAGE,
            PAGE,
            libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED,
            to,
        )
    };
    assert_eq!(moved as usize, to, "{}", std::io::Error::last_os_error());
    // The kernel lets the mover go once the fault thread has read the report; it counts the
    // move right after.
    let deadline = Instant::now() + Duration::from_secs(10);
    while e.store_moves() == 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(e.store_moves(), 1);
    // SAFETY: the page moved above, mapped at `to`; read only.
    let page = unsafe { std::slice::from_raw_parts(to as *const u8, PAGE) };
    assert!(check(page, 6), "the moved page changed");
    // More merges (the engine's own moves of copies into place) count nothing.
    let more = halves(&e, n);
    let s = wait_for(&e, |s| s.pages_sharing >= 2 * n as u64 - 1);
    assert!(s.pages_sharing >= 2 * n as u64 - 1, "{s:?}");
    assert_eq!(e.store_moves(), 1);
    drop(more);
    // SAFETY: the moved page is the test's own; nothing refers to it.
    unsafe { pageone_sys::munmap(to as *mut u8, PAGE) }.unwrap();
}
