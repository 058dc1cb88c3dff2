//! Memory the program locked with `mlock` merges, and stays locked through everything the engine
//! maps over it: the merge itself, a written page merged again, a zeroed one released, pages
//! dropped, and the anonymous memory given back when it is unregistered. Unlocked, what the
//! engine maps there later is not locked.

use std::sync::atomic::{AtomicBool, Ordering};

use pageone_engine::{DropAdvice, Engine, Region};

mod common;
use common::{check, fill, halves, small_engine, unlocked_pages, wait_for, PAGE};

/// Two identical halves of `n` pages each, registered, locked (or `None` where `mlock` is
/// refused: the test is skipped) and merged.
fn locked_halves(e: &Engine, n: usize) -> Option<Region<'_>> {
    let r = halves(e, n);
    // SAFETY: locks the test's own region; it changes no contents.
    if unsafe { libc::mlock(r.as_ptr().cast(), r.len()) } != 0 {
        let err = std::io::Error::last_os_error();
        eprintln!("skipped: mlock refused ({err})");
        return None;
    }
    e.locking_changed(r.as_ptr(), r.len(), true);
    let s = wait_for(e, |s| s.pages_sharing >= n as u64);
    assert_eq!((s.pages_sharing, s.pages_refused), (n as u64, 0), "{s:?}");
    Some(r)
}

/// Whether page `i` of the halves holds `c` (its own contents unless rewritten).
fn holds(r: &Region<'_>, i: usize, c: u64) -> bool {
    check(&r.as_slice()[i * PAGE..(i + 1) * PAGE], c)
}

#[test]
fn locked_pages_merge_and_stay_locked_through_every_mapping_over_them() {
    let e = small_engine(false);
    let n = 64;
    let Some(mut r) = locked_halves(&e, n) else {
        return;
    };
    let base = r.as_ptr() as usize;
    assert_eq!(
        unlocked_pages(base, 2 * n),
        0,
        "the merge left pages unlocked"
    );
    // A page written, then written back: merged again, and locked again.
    let mem = r.as_mut_slice();
    mem[7 * PAGE + 9] ^= 0xff;
    wait_for(&e, |s| s.cow_breaks >= 1);
    r.as_mut_slice()[7 * PAGE + 9] ^= 0xff;
    let s = wait_for(&e, |s| s.pages_sharing >= n as u64);
    assert_eq!(
        s.pages_sharing, n as u64,
        "the restored page did not merge again: {s:?}"
    );
    assert_eq!(
        unlocked_pages(base, 2 * n),
        0,
        "the merge again left pages unlocked"
    );
    // A merged page zeroed (as a guest frees memory): released, and still locked. Another
    // thread reads it throughout: it stays readable while it is held and replaced.
    fill(&mut r.as_mut_slice()[3 * PAGE..4 * PAGE], 0);
    let done = AtomicBool::new(false);
    let at = base + 3 * PAGE;
    let s = std::thread::scope(|sc| {
        sc.spawn(|| {
            while !done.load(Ordering::Relaxed) {
                // SAFETY: a page of the test's region, read only, as the engine replaces it.
                unsafe { std::ptr::read_volatile((at + 100) as *const u8) };
            }
        });
        let s = wait_for(&e, |s| s.pages_sharing < n as u64 && s.zero_pages >= 1);
        done.store(true, Ordering::Relaxed);
        s
    });
    assert!(s.zero_pages >= 1, "{s:?}");
    assert!(holds(&r, 3, 0));
    // Locked pages are dropped with `MADV_DONTNEED_LOCKED` (the kernel refuses `MADV_DONTNEED`).
    let at = r.as_ptr().wrapping_add(10 * PAGE);
    e.drop_pages(at, PAGE, DropAdvice::DontNeedLocked).unwrap();
    assert!(holds(&r, 10, 0), "a dropped page is not zero");
    assert_eq!(
        unlocked_pages(base, 2 * n),
        0,
        "releases left pages unlocked"
    );
    for i in (0..2 * n).filter(|&i| i != 3 && i != 10) {
        assert!(holds(&r, i, (i % n) as u64 + 1), "page {i}");
    }
    // Given back as anonymous memory, locked as it was.
    e.unregister(r.as_ptr(), r.len()).unwrap();
    assert_eq!(
        unlocked_pages(base, 2 * n),
        0,
        "unregistering left pages unlocked"
    );
    for i in (0..2 * n).filter(|&i| i != 3 && i != 10) {
        assert!(
            holds(&r, i, (i % n) as u64 + 1),
            "page {i} after unregistering"
        );
    }
    // SAFETY: undoes the lock above.
    unsafe { libc::munlock(r.as_ptr().cast(), r.len()) };
}

#[test]
fn memory_unlocked_after_its_merge_is_given_back_unlocked() {
    let e = small_engine(false);
    let n = 16;
    let Some(r) = locked_halves(&e, n) else {
        return;
    };
    let base = r.as_ptr() as usize;
    // SAFETY: undoes the lock of the test's own region.
    assert_eq!(unsafe { libc::munlock(r.as_ptr().cast(), r.len()) }, 0);
    e.locking_changed(r.as_ptr(), r.len(), false);
    e.unregister(r.as_ptr(), r.len()).unwrap();
    assert_eq!(unlocked_pages(base, 2 * n), 2 * n, "pages left locked");
    for i in 0..2 * n {
        assert!(holds(&r, i, (i % n) as u64 + 1), "page {i}");
    }
}

/// Unlocked by a call the engine does not see (a raw `munlock`: the engine is not told), merged
/// memory is not locked again by what the engine maps there later: a written page merged again,
/// a dropped page, the memory given back at unregistering.
#[test]
fn memory_unlocked_behind_the_engine_is_not_locked_again() {
    let e = small_engine(false);
    let n = 16;
    let Some(mut r) = locked_halves(&e, n) else {
        return;
    };
    let base = r.as_ptr() as usize;
    // SAFETY: undoes the lock of the test's own region; the engine is not told.
    assert_eq!(unsafe { libc::munlock(r.as_ptr().cast(), r.len()) }, 0);
    assert_eq!(unlocked_pages(base, 2 * n), 2 * n);
    r.as_mut_slice()[7 * PAGE + 9] ^= 0xff;
    wait_for(&e, |s| s.cow_breaks >= 1);
    r.as_mut_slice()[7 * PAGE + 9] ^= 0xff;
    let s = wait_for(&e, |s| s.pages_sharing >= n as u64);
    assert_eq!(s.pages_sharing, n as u64, "{s:?}");
    assert_eq!(
        unlocked_pages(base, 2 * n),
        2 * n,
        "the page merged again was locked"
    );
    e.drop_pages(
        r.as_ptr().wrapping_add(10 * PAGE),
        PAGE,
        DropAdvice::DontNeed,
    )
    .unwrap();
    assert!(holds(&r, 10, 0));
    assert_eq!(
        unlocked_pages(base, 2 * n),
        2 * n,
        "the dropped page was locked"
    );
    e.unregister(r.as_ptr(), r.len()).unwrap();
    assert_eq!(
        unlocked_pages(base, 2 * n),
        2 * n,
        "unregistering locked pages"
    );
    for i in (0..2 * n).filter(|&i| i != 10) {
        assert!(holds(&r, i, (i % n) as u64 + 1), "page {i}");
    }
}
