//! A process that locks its future mappings (`mlockall(MCL_FUTURE)`, as QEMU's `mem-lock=on`
//! and databases do) before the engine starts: the engine's views of its store (as large as the
//! memory by default) and its scratch area are not filled, merging keeps every byte, locked
//! pages are refused at no cost per period, and they merge once the program unlocks them. Its
//! own test binary: the lock covers the whole process.

use std::time::{Duration, Instant};

use pageone_engine::Engine;

mod common;
use common::{check, fill, lock_all_memory, wait_for, PAGE};

/// The store's size here: a failure fills this much, not the machine's memory.
const STORE_PAGES: u32 = 65_536;

fn status_kib(field: &str) -> u64 {
    pageone_sys::self_status_kib(field).unwrap()
}

#[test]
fn a_process_locking_its_future_mappings_gets_no_view_filled() {
    if !lock_all_memory() {
        return;
    }
    // (Kept pageone's where the host runs KSM, which takes locked memory: `tests/mlock_ksm.rs`.)
    let e = Engine::builder()
        .merge_period(Duration::from_millis(20))
        .store_pages(STORE_PAGES)
        .ksm_when_limited(false)
        .build()
        .expect("the engine starts on this kernel");
    let n = 2048;
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
    // Locked pages cannot move to the engine's unlocked scratch area: refused, they wait at no
    // cost per period instead of being copied and tried again every few periods. (That kept
    // the engine's threads 27% busy for these 16 MiB at these periods; the watch and the
    // retries in batches cost 0.47-0.54% here.)
    let s = wait_for(&e, |s| s.pages_refused == 2 * n as u64);
    assert_eq!(s.pages_sharing, 0, "locked memory merged: {s:?}");
    let (cpu0, t1) = (s.worker_cpu_ns, Instant::now());
    // (Slept through: waiting for periods runs them back to back.) A try makes copies for a
    // batch of refused pages at most (their pairs), not for all of them: held a second after
    // the try fails, they show how many a try made.
    let mut most_held = 0;
    while t1.elapsed() < Duration::from_secs(3) {
        std::thread::sleep(Duration::from_millis(50));
        if t1.elapsed() > Duration::from_millis(1500) {
            most_held = most_held.max(e.stats().copies_held);
        }
    }
    let s = e.stats();
    assert!(
        most_held <= 1024,
        "a try made copies for more than a batch of refused pages: {most_held} held ({s:?})"
    );
    let busy = (s.worker_cpu_ns - cpu0) as f64 / t1.elapsed().as_nanos() as f64;
    eprintln!("refused pages cost {:.2}% of a CPU", busy * 100.0);
    assert!(
        busy < 0.08,
        "refused pages cost {:.1}% of a CPU ({s:?})",
        busy * 100.0
    );
    // Unlocked, they are tried again (after a wait of 256 periods at most) and merge.
    // SAFETY: undoes the lock above.
    unsafe { libc::munlockall() };
    let s = wait_for(&e, |s| s.pages_sharing > 0 && s.pages_refused == 0);
    assert!(s.pages_sharing > 0 && s.pages_refused == 0, "{s:?}");
    intact(&r);
    drop(r);
    drop(e);
}
