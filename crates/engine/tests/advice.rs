//! Memory the program advised not to be dumped (`MADV_DONTDUMP`) or inherited
//! (`MADV_DONTFORK`) keeps that advice through everything the engine maps over it: the merge
//! itself, a written page merged again, a zeroed one released, pages dropped, and the anonymous
//! memory given back when it is unregistered; advice to use huge pages (`MADV_HUGEPAGE`) is kept
//! by the anonymous memory it maps. Stale advice (memory unmapped and mapped again
//! where the embedder did not see it) is not carried. The engine's view of its store is left out
//! of core dumps.

use pageone_engine::{DropAdvice, Engine};
use pageone_sys as sys;

mod common;
use common::{
    advise, fill, fill_halves, halves_unregistered, holds, pages_without, small_engine,
    store_mappings, unmap, wait_for, PAGE,
};

/// Every page of the range is in mappings that are neither dumped nor inherited.
fn assert_advised(base: usize, pages: usize, when: &str) {
    assert_eq!(
        pages_without("dd", base, pages),
        [0usize; 0],
        "dumped {when}"
    );
    assert_eq!(
        pages_without("dc", base, pages),
        [0usize; 0],
        "inherited {when}"
    );
}

#[test]
fn advice_given_before_registering_stays_through_every_mapping_over_it() {
    let e = small_engine(false);
    let n = 64;
    let (base, len) = (halves_unregistered(n), 2 * n * PAGE);
    advise(base, len, libc::MADV_DONTDUMP);
    advise(base, len, libc::MADV_DONTFORK);
    advise(base, len, libc::MADV_HUGEPAGE);
    e.merge(base as *mut u8, len).unwrap();
    let s = wait_for(&e, |s| s.pages_sharing >= n as u64);
    assert_eq!(s.pages_sharing, n as u64, "{s:?}");
    assert!(store_mappings(base, len) > 0);
    assert_advised(base, 2 * n, "once merged");
    // Mappings of the store are not given huge pages (they would fill the file's holes).
    assert_eq!(pages_without("hg", base, 2 * n).len(), 2 * n);
    // A page written, then written back: merged again.
    let at = (base + 7 * PAGE + 9) as *mut u8;
    // SAFETY: a byte of the test's mapping, which only this thread writes.
    unsafe { at.write_volatile(at.read_volatile() ^ 0xff) };
    let merges = wait_for(&e, |s| s.cow_breaks >= 1).merges;
    // SAFETY: as above.
    unsafe { at.write_volatile(at.read_volatile() ^ 0xff) };
    let s = wait_for(&e, |s| s.pages_sharing >= n as u64 && s.merges > merges);
    assert_eq!(s.pages_sharing, n as u64, "not merged again: {s:?}");
    assert_advised(base, 2 * n, "merged again");
    // A merged page zeroed: released.
    // SAFETY: a page of the test's mapping, which only this thread writes.
    fill(
        unsafe { std::slice::from_raw_parts_mut((base + 3 * PAGE) as *mut u8, PAGE) },
        0,
    );
    let s = wait_for(&e, |s| s.zero_pages >= 1);
    assert!(s.zero_pages >= 1, "{s:?}");
    assert_advised(base, 2 * n, "released");
    assert!(
        !pages_without("hg", base, 2 * n).contains(&3),
        "no huge pages once released"
    );
    // Dropped.
    e.drop_pages((base + 10 * PAGE) as *mut u8, PAGE, DropAdvice::DontNeed)
        .unwrap();
    assert!(holds(base, 10, 0), "a dropped page is not zero");
    assert_advised(base, 2 * n, "dropped");
    assert!(
        !pages_without("hg", base, 2 * n).contains(&10),
        "no huge pages once dropped"
    );
    // Given back as anonymous memory.
    e.unregister(base as *mut u8, len).unwrap();
    assert_eq!(store_mappings(base, len), 0);
    assert_advised(base, 2 * n, "given back");
    assert_eq!(
        pages_without("hg", base, 2 * n),
        [0usize; 0],
        "no huge pages given back"
    );
    for i in (0..2 * n).filter(|&i| i != 3 && i != 10) {
        assert!(holds(base, i, (i % n) as u64 + 1), "page {i}");
    }
    unmap(base, len);
}

/// Advice taken back, or given only to part of the memory, is carried as the kernel holds it.
#[test]
fn advice_taken_back_is_not_carried_and_part_advice_stays_in_its_part() {
    let e = small_engine(false);
    let n = 64;
    let (base, len) = (halves_unregistered(n), 2 * n * PAGE);
    e.merge(base as *mut u8, len).unwrap();
    // The first half's first 16 pages and the second half's last 16 are advised; the rest was
    // advised and taken back.
    advise(base, len, libc::MADV_DONTFORK);
    advise(base + 16 * PAGE, len - 32 * PAGE, libc::MADV_DOFORK);
    let s = wait_for(&e, |s| s.pages_sharing >= n as u64);
    assert_eq!(s.pages_sharing, n as u64, "{s:?}");
    assert!(store_mappings(base, len) > 0);
    let inherited = pages_without("dc", base, 2 * n);
    assert_eq!(inherited, (16..2 * n - 16).collect::<Vec<_>>());
    assert_eq!(pages_without("dd", base, 2 * n).len(), 2 * n);
    e.unregister(base as *mut u8, len).unwrap();
    assert_eq!(pages_without("dc", base, 2 * n), inherited);
    unmap(base, len);
}

/// Memory unmapped and mapped again where the embedder did not see it (as glibc's `free` and
/// `malloc` do) does not inherit the advice the old memory had.
#[test]
fn stale_advice_of_memory_mapped_again_unseen_is_not_carried() {
    let e = small_engine(false);
    let n = 32;
    let (base, len) = (halves_unregistered(n), 2 * n * PAGE);
    advise(base, len, libc::MADV_DONTDUMP);
    advise(base, len, libc::MADV_DONTFORK);
    // SAFETY: the test's own mapping, which nothing refers to, is replaced by a fresh private
    // anonymous mapping with a raw call, unreported. (In one call, as a program's `free` and
    // `malloc` would in two: between two, another test's thread may map the range.)
    unsafe { sys::mmap_anonymous_fixed(base as *mut u8, len, libc::PROT_READ | libc::PROT_WRITE) }
        .unwrap();
    fill_halves(base, n);
    e.merge(base as *mut u8, len).unwrap();
    let s = wait_for(&e, |s| s.pages_sharing >= n as u64);
    assert_eq!(s.pages_sharing, n as u64, "{s:?}");
    assert_eq!(pages_without("dd", base, 2 * n).len(), 2 * n, "not dumped");
    assert_eq!(
        pages_without("dc", base, 2 * n).len(),
        2 * n,
        "not inherited"
    );
    e.unregister(base as *mut u8, len).unwrap();
    // SAFETY: the test's own mapping, which nothing refers to any more.
    unsafe { sys::munmap(base as *mut u8, len) }.unwrap();
}

/// Moves `len` bytes of registered memory at `from` to a new place, as the shim does where they
/// are several mappings (merged pages among them): a range reserved, each mapping moved onto its
/// place in it, the engine told. Returns the new place.
fn move_piecewise(from: usize, len: usize) -> usize {
    let to = sys::mmap_anonymous(len).unwrap() as usize;
    for m in sys::self_mappings_in(from, from + len).unwrap() {
        let (s, e) = (m.start.max(from), m.end.min(from + len));
        // SAFETY: a whole mapping of the test's own memory moves onto its place in the range
        // reserved above; nothing else refers to either.
        let moved = unsafe {
            libc::syscall(
                libc::SYS_mremap,
                s,
                e - s,
                e - s,
                libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED,
                to + (s - from),
            )
        };
        assert_eq!(
            moved as usize,
            to + (s - from),
            "{}",
            std::io::Error::last_os_error()
        );
    }
    pageone_engine::mapping_moved(from..from + len, to..to + len);
    to
}

/// Merged memory the program moves keeps its advice to use huge pages: mappings of the store do
/// not carry it, but the anonymous memory given back there later does.
#[test]
fn huge_page_advice_moves_with_merged_memory() {
    let e = small_engine(false);
    let n = 64;
    let (base, len) = (halves_unregistered(n), 2 * n * PAGE);
    advise(base, len, libc::MADV_HUGEPAGE);
    e.merge(base as *mut u8, len).unwrap();
    let s = wait_for(&e, |s| s.pages_sharing >= n as u64);
    assert_eq!(s.pages_sharing, n as u64, "{s:?}");
    let to = move_piecewise(base, len);
    // The kernel's reports of the moves applied.
    e.wait_periods(2, std::time::Duration::from_secs(10));
    assert!(store_mappings(to, len) > 0, "the merged pages did not move");
    assert!(e.is_registered(to as *mut u8, len));
    e.unregister(to as *mut u8, len).unwrap();
    assert_eq!(store_mappings(to, len), 0);
    assert_eq!(
        pages_without("hg", to, 2 * n),
        [0usize; 0],
        "memory given back without huge pages after the move"
    );
    for i in 0..2 * n {
        assert!(holds(to, i, (i % n) as u64 + 1), "page {i}");
    }
    unmap(to, len);
}

/// The engine's view of its store (every copy it holds) is not dumped.
#[test]
fn the_stores_view_is_left_out_of_core_dumps() {
    let e: Engine = small_engine(false);
    let r = common::halves(&e, 16);
    wait_for(&e, |s| s.pages_sharing >= 16);
    let maps = sys::self_mappings().unwrap();
    let views: Vec<_> = maps
        .iter()
        .filter(|m| pageone_engine::is_store_mapping(m) && m.perms.ends_with('s'))
        .collect();
    assert!(!views.is_empty(), "no view of the store found");
    let dd = sys::self_mappings_flagged("dd").unwrap();
    for v in views {
        assert!(
            dd.iter().any(|m| m.contains(&v.start)),
            "the view at {:#x} is dumped",
            v.start
        );
    }
    drop(r);
}
