//! A process that locks its future mappings (`mlockall(MCL_FUTURE)`, as QEMU's `mem-lock=on`
//! and databases do) before the engine starts: the engine's views of its store (as large as the
//! memory by default) are not filled, and merging keeps every byte. Its own test binary: the
//! lock covers the whole process.

use std::time::Duration;

use pageone_engine::Engine;

mod common;
use common::{check, fill, PAGE};

/// The store's size here: a failure fills this much, not the machine's memory.
const STORE_PAGES: u32 = 65_536;

fn status_kib(field: &str) -> u64 {
    pageone_sys::self_status_kib(field).unwrap()
}

#[test]
fn a_process_locking_its_future_mappings_gets_no_view_filled() {
    // SAFETY: locks this test process's memory; no memory-safety preconditions.
    if unsafe { libc::mlockall(libc::MCL_CURRENT | libc::MCL_FUTURE) } != 0 {
        eprintln!(
            "skipped: mlockall refused ({}); it needs root or a memlock limit",
            std::io::Error::last_os_error()
        );
        return;
    }
    let e = Engine::builder()
        .merge_period(Duration::from_millis(20))
        .store_pages(STORE_PAGES)
        .build()
        .expect("the engine starts on this kernel");
    let n = 256;
    let mut r = e.alloc_region(2 * n * PAGE).unwrap();
    for (i, p) in r.as_mut_slice().chunks_mut(PAGE).enumerate() {
        fill(p, (i % n) as u64 + 1);
    }
    // Merged or not (locked memory is not merged), periods commit, and a commit makes the
    // staging area: a private mapping of the whole store.
    let store_bytes = STORE_PAGES as usize * PAGE;
    let area_made = || {
        pageone_sys::self_mappings().unwrap().iter().any(|m| {
            pageone_engine::is_store_mapping(m)
                && m.perms == "rw-p"
                && m.end - m.start == store_bytes
        })
    };
    let t0 = std::time::Instant::now();
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
    for (i, page) in r.as_slice().chunks(PAGE).enumerate() {
        assert!(
            check(page, (i % n) as u64 + 1),
            "page {i} reads wrong bytes"
        );
    }
    drop(r);
    drop(e);
    // SAFETY: undoes the lock above.
    unsafe { libc::munlockall() };
}
