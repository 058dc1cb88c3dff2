//! The period schedule around registrations (on the real kernel): the regions of one burst of
//! registrations become candidates in the same period, wherever the burst falls between scans.

use std::time::{Duration, Instant};

use pageone_engine::Engine;

mod common;
use common::{check, filled, PAGE};

#[test]
fn a_burst_of_registrations_late_in_a_period_merges_in_one_period() {
    // Long periods, so that the steps below are far apart from the engine's (this test only
    // observes the schedule: nothing here kicks a period).
    let period = Duration::from_millis(400);
    let e = Engine::builder().merge_period(period).build().unwrap();
    let n = 1024;
    let regions: Vec<&'static mut [u8]> = (0..4).map(|_| filled(n, |i| i as u64 + 1)).collect();
    // Wait for a period to end, then start the burst 0.6 periods later and spread it over half
    // a period: its last region is armed after the scan a period after the first one's.
    let scans = e.stats().full_scans;
    let deadline = Instant::now() + Duration::from_secs(10);
    while e.stats().full_scans == scans && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(2));
    }
    std::thread::sleep(period * 6 / 10);
    let first = Instant::now();
    // Between registrations the program writes other memory (fresh pages: a minor fault each),
    // enough to end an idle stretch early; the burst still holds the period off.
    let mut elsewhere = Vec::new();
    for r in &regions {
        e.register(r.as_ptr() as *mut u8, r.len()).unwrap();
        elsewhere.push(filled(64, |i| i as u64 + 7));
        std::thread::sleep(period / 6);
    }
    // The burst is meant to span half a period; on a machine too busy to keep it under three
    // quarters, the schedule's promise does not cover it.
    let spread = first.elapsed() - period / 6;
    // At the end of every period, the merges so far: all or nothing, never some regions
    // without the others. (Sampled once the period's commit, which runs behind the scan, is
    // done: a third of a period later, the count stays put for 40 ms; the next scan is most of
    // a period later.)
    let full = 3 * n as u64;
    let mut ends = Vec::new();
    let mut last = e.stats().full_scans;
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(2));
        let st = e.stats();
        if st.full_scans != last {
            last = st.full_scans;
            // A third of a period on (the next scan is most of a period away): on a busy
            // machine the committer, at idle priority, may pause inside a commit for longer than
            // the 40 ms below.
            std::thread::sleep(period / 3);
            let sharing = settled_sharing(&e, e.stats().pages_sharing);
            ends.push(sharing);
            if sharing >= full {
                break;
            }
        }
    }
    assert_eq!(
        ends.last(),
        Some(&full),
        "merges at each period's end: {ends:?}"
    );
    if spread > period * 3 / 4 {
        println!("the burst took {spread:?} (machine busy): the schedule is not judged");
    } else {
        assert!(
            ends.iter().all(|&s| s == 0 || s == full),
            "some regions merged a period after the others: {ends:?} (burst {spread:?})"
        );
    }
    for r in &regions {
        for (i, page) in r.chunks(PAGE).enumerate() {
            assert!(check(page, i as u64 + 1), "page {i} changed");
        }
    }
    for r in &regions {
        e.unregister(r.as_ptr() as *mut u8, r.len()).unwrap();
    }
    assert_eq!(e.stable_pages(), 0);
}

/// `pages_sharing` once it stays put for 40 ms (the commit of a period's merges is done), from
/// `now`, its latest reading.
fn settled_sharing(e: &Engine, mut now: u64) -> u64 {
    loop {
        std::thread::sleep(Duration::from_millis(40));
        let again = e.stats().pages_sharing;
        if again == now {
            return now;
        }
        now = again;
    }
}
