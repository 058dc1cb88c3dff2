//! A process that locks its future mappings (`mlockall(MCL_FUTURE)`, as QEMU's `mem-lock=on`
//! and databases do) before the engine starts: the engine's views of its store (as large as the
//! memory by default) and its scratch area are not filled, locked pages merge, keeping every
//! byte, and stay locked. Its own test binary: the lock covers the whole process.

use std::time::{Duration, Instant};

mod common;
use common::{check, fill, halves, lock_all_memory, small_engine, wait_for, PAGE};

/// The store's size (`small_engine`).
const STORE_PAGES: u32 = 65_536;

fn status_kib(field: &str) -> u64 {
    pageone_sys::self_status_kib(field).unwrap()
}

#[test]
fn a_process_locking_its_future_mappings_gets_no_view_filled() {
    if !lock_all_memory() {
        return;
    }
    let e = small_engine(false);
    let n = 2048;
    let mut r = halves(&e, n);
    // Periods commit, and a commit makes the staging area: a private mapping of the whole
    // store.
    let store_bytes = STORE_PAGES as usize * PAGE;
    let area_made = || {
        pageone_sys::self_mappings().unwrap().iter().any(|m| {
            pageone_engine::is_store_mapping(m)
                && m.perms == "rw-p"
                && m.end - m.start == store_bytes
        })
    };
    let t0 = Instant::now();
    while !area_made() {
        assert!(t0.elapsed() < Duration::from_secs(30), "no staging area");
        e.wait_periods(1, Duration::from_secs(10));
    }
    e.wait_periods(5, Duration::from_secs(10));
    let s = e.stats();
    let store_kib = store_bytes as u64 / 1024;
    let (shmem, anon) = (status_kib("RssShmem"), status_kib("RssAnon"));
    assert!(
        shmem < store_kib / 2 && anon < store_kib / 2,
        "the store's views were filled: RssShmem {shmem} KiB, RssAnon {anon} KiB for a store of \
         {store_kib} KiB ({s:?})"
    );
    let intact = |r: &pageone_engine::Region| {
        for (i, page) in r.as_slice().chunks(PAGE).enumerate() {
            assert!(
                check(page, (i % n) as u64 + 1),
                "page {i} reads wrong bytes"
            );
        }
    };
    intact(&r);
    // Locked pages are frozen into a locked area, merged, and their copies locked.
    let s = wait_for(&e, |s| s.pages_sharing == n as u64);
    assert_eq!((s.pages_sharing, s.pages_refused), (n as u64, 0), "{s:?}");
    intact(&r);
    let base = r.as_ptr() as usize;
    let unlocked = common::unlocked_pages(base, 2 * n);
    assert_eq!(unlocked, 0, "merged pages left unlocked ({s:?})");
    // Written, a merged page is the program's own again, locked as the kernel faults it in.
    let w = 5;
    fill(&mut r.as_mut_slice()[w * PAGE..(w + 1) * PAGE], 0xdead);
    assert!(check(&r.as_slice()[w * PAGE..(w + 1) * PAGE], 0xdead));
    assert_eq!(common::unlocked_pages(base + w * PAGE, 1), 0);
    drop(r);
    drop(e);
}
