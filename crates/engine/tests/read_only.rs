//! Registered memory the program made read-only: the kernel moves only writable pages
//! (`UFFDIO_MOVE`), so its pages cannot be frozen. They are refused and wait at no cost per
//! period, a try makes copies for a batch of them at most, and they merge once the program makes
//! them writable again. (Where the host runs the kernel's KSM, such a region is handed to it:
//! `tests/read_only_ksm.rs`.)

use std::time::{Duration, Instant};

mod common;
use common::{check, halves, make_read_only, small_engine, wait_for, PAGE};

#[test]
fn read_only_pages_wait_refused_at_no_cost_and_merge_once_writable() {
    let e = small_engine(false);
    let n = 2048;
    let r = halves(&e, n);
    make_read_only(&r);
    // Refused, they wait at no cost per period instead of being copied and tried again every
    // few periods. (That kept the engine's threads 27% busy for these 16 MiB at these periods;
    // the watch and the retries in batches cost 0.47-0.54% here.)
    let s = wait_for(&e, |s| s.pages_refused == 2 * n as u64);
    assert_eq!(s.pages_sharing, 0, "read-only memory merged: {s:?}");
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
    // Writable again, they are tried again (after a wait of 256 periods at most) and merge.
    let rw = libc::PROT_READ | libc::PROT_WRITE;
    // SAFETY: the test's own region, which no live reference writes.
    assert_eq!(unsafe { libc::mprotect(r.as_ptr().cast(), r.len(), rw) }, 0);
    let s = wait_for(&e, |s| s.pages_sharing == n as u64 && s.pages_refused == 0);
    assert_eq!((s.pages_sharing, s.pages_refused), (n as u64, 0), "{s:?}");
    for (i, page) in r.as_slice().chunks(PAGE).enumerate() {
        assert!(
            check(page, (i % n) as u64 + 1),
            "page {i} reads wrong bytes"
        );
    }
}
