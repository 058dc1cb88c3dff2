//! A process that locks its memory (`mlockall`) where the host runs the kernel's KSM: pageone
//! cannot merge locked pages (see `tests/mlock_future.rs`), so the region is handed to KSM,
//! which merges them. Its own test binary: the lock covers the whole process.

use std::time::{Duration, Instant};

use pageone_engine::Engine;

mod common;
use common::{check, fill, lock_all_memory, wait_for, KsmRunning, PAGE};

#[test]
fn locked_memory_is_handed_to_the_kernels_ksm_where_it_runs() {
    let Some(ksm) = KsmRunning::start() else {
        eprintln!("skipped: the kernel's KSM is not there or not writable (needs root)");
        return;
    };
    if !lock_all_memory() {
        return;
    }
    let e = Engine::builder()
        .merge_period(Duration::from_millis(20))
        .store_pages(65_536)
        .ksm_when_limited(true)
        .build()
        .expect("the engine starts on this kernel");
    let n = 2048;
    let mut r = e.alloc_region(2 * n * PAGE).unwrap();
    let before = KsmRunning::sharing();
    for (i, p) in r.as_mut_slice().chunks_mut(PAGE).enumerate() {
        fill(p, (i % n) as u64 + 1);
    }
    let s = wait_for(&e, |s| s.regions_to_ksm > 0);
    assert_eq!(s.regions_to_ksm, 1, "{s:?}");
    assert_eq!(s.pages_sharing, 0, "pageone merged locked pages: {s:?}");
    // Every page has a twin in the other half: KSM merges the n pairs.
    let deadline = Instant::now() + Duration::from_secs(60);
    while KsmRunning::sharing() - before < n as u64 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        KsmRunning::sharing() - before >= n as u64,
        "KSM merged {} of {n} pairs: {:?}",
        KsmRunning::sharing() - before,
        e.stats()
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
    drop(ksm);
}
