//! Memory the program made read-only where the host runs the kernel's KSM: pageone cannot freeze
//! pages that are not writable (see `tests/read_only.rs`), so the region is handed to KSM, which
//! merges them. Its own test binary: it runs the kernel's KSM.

use std::time::{Duration, Instant};

mod common;
use common::{check, halves, make_read_only, small_engine, wait_for, KsmRunning, PAGE};

#[test]
fn read_only_memory_is_handed_to_the_kernels_ksm_where_it_runs() {
    let Some(ksm) = KsmRunning::start() else {
        eprintln!("skipped: the kernel's KSM is not there or not writable (needs root)");
        return;
    };
    let e = small_engine(true);
    let n = 2048;
    let before = KsmRunning::merging_here();
    let r = halves(&e, n);
    make_read_only(&r);
    let s = wait_for(&e, |s| s.regions_to_ksm > 0);
    assert_eq!(s.regions_to_ksm, 1, "{s:?}");
    assert_eq!(s.pages_sharing, 0, "pageone merged read-only pages: {s:?}");
    // Every page has a twin in the other half: KSM merges the n pairs.
    let deadline = Instant::now() + Duration::from_secs(60);
    while KsmRunning::merged_since(before) < 2 * n as u64 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        KsmRunning::merged_since(before) >= 2 * n as u64,
        "KSM merged {} of the {n} pairs' pages: {:?}",
        KsmRunning::merged_since(before),
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
    drop(ksm);
}
