//! Registered memory the program made read-only: the kernel moves only writable pages
//! (`UFFDIO_MOVE`), so its pages cannot be frozen. They are refused and wait at no cost per
//! period, a try makes copies for a batch of them at most, and they merge once the program makes
//! them writable again. (Where the host runs the kernel's KSM, such a region is handed to it:
//! `tests/read_only_ksm.rs`.)

use std::time::{Duration, Instant};

mod common;
use common::{check, fill, make_read_only, small_engine, wait_for, PAGE};

#[test]
fn read_only_pages_wait_refused_at_no_cost_and_merge_once_writable() {
    let e = small_engine(false);
    let n = 2048;
    // Pairs of equal pages side by side (page i holds i / 2 + 1), so a batch of refused pages
    // tried again holds pairs, which get copies.
    let mut r = e.alloc_region(2 * n * PAGE).unwrap();
    for (i, p) in r.as_mut_slice().chunks_mut(PAGE).enumerate() {
        fill(p, (i / 2) as u64 + 1);
    }
    make_read_only(&r);
    // Refused, they wait at no cost per period instead of being copied and tried again every
    // few periods. (That kept the engine's threads 27% busy for these 16 MiB at these periods;
    // the watch and the retries in batches cost 0.47-0.54% here.)
    let s = wait_for(&e, |s| s.pages_refused == 2 * n as u64);
    assert_eq!(s.pages_sharing, 0, "read-only memory merged: {s:?}");
    let (cpu0, t1) = (s.worker_cpu_ns, Instant::now());
    // (Slept through: waiting for periods runs them back to back.) A try makes copies for a
    // batch of refused pages at most (512 pairs), not for all of them (2048). Tries are 8
    // periods apart at the least (160 ms here), so the copies made between two looks 10 ms apart
    // are one try's; looks further apart (a busy machine) are not judged.
    let (mut made, mut most_made, mut tries, mut most_held) = (e.copies_made(), 0, 0, 0);
    let mut seen = Instant::now();
    while t1.elapsed() < Duration::from_secs(3) {
        std::thread::sleep(Duration::from_millis(10));
        let (now, m) = (Instant::now(), e.copies_made());
        if m > made && now - seen < Duration::from_millis(100) {
            most_made = most_made.max(m - made);
            tries += 1;
        }
        (made, seen) = (m, now);
        most_held = most_held.max(e.stats().copies_held);
    }
    let s = e.stats();
    assert!(
        tries > 0,
        "refused pages were not tried again in 3 s ({s:?})"
    );
    assert!(
        most_made <= 512,
        "a try made copies for more than a batch of refused pages: {most_made} ({s:?})"
    );
    // A copy no page ever mapped is reused at once, not held until the mappings are read.
    assert_eq!(most_held, 0, "copies of refused merges were held ({s:?})");
    let busy = (s.worker_cpu_ns - cpu0) as f64 / t1.elapsed().as_nanos() as f64;
    eprintln!("refused pages cost {:.2}% of a CPU", busy * 100.0);
    assert!(
        busy < 0.08,
        "refused pages cost {:.1}% of a CPU ({s:?})",
        busy * 100.0
    );
    // Writable again, they are tried again (after a wait of 256 periods at most) and merge.
    let rw = libc::PROT_READ | libc::PROT_WRITE;
    // SAFETY: the test's own region, which no live reference writes.
    assert_eq!(unsafe { libc::mprotect(r.as_ptr().cast(), r.len(), rw) }, 0);
    let s = wait_for(&e, |s| s.pages_sharing == n as u64 && s.pages_refused == 0);
    assert_eq!((s.pages_sharing, s.pages_refused), (n as u64, 0), "{s:?}");
    for (i, page) in r.as_slice().chunks(PAGE).enumerate() {
        assert!(
            check(page, (i / 2) as u64 + 1),
            "page {i} reads wrong bytes"
        );
    }
}
