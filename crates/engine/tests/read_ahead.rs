//! Read-ahead of newly registered memory (on the real kernel): a page read at registration and
//! written before it is merged is classified from its new contents, and a page read before a copy
//! of its contents was published still finds that copy.

use std::sync::Mutex;
use std::time::Duration;

use pageone_engine::Engine;

mod common;
use common::{check, fill, filled, wait_for, PAGE};

static SERIAL: Mutex<()> = Mutex::new(());

/// A merge period no test waits out: periods run when `wait_for`/`wait_periods` kick them.
const NEVER: Duration = Duration::from_secs(3600);

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

#[test]
fn pages_written_after_their_read_ahead_are_classified_by_their_new_contents() {
    let _g = serial();
    // Periods run only when the test asks (`wait_for` kicks them): the writes below land after
    // the read-ahead (microseconds here) and before the first period.
    let e = Engine::builder().merge_period(NEVER).build().unwrap();
    let n = 768;
    // Two identical halves of n distinct pages.
    let mut want: Vec<u64> = (0..2 * n).map(|i| (i % n) as u64 + 1).collect();
    let s = filled(2 * n, |i| want[i]);
    e.register(s.as_mut_ptr(), s.len()).unwrap();
    std::thread::sleep(Duration::from_millis(30));
    // In the second half: a third of the pages get unique contents, a third all get one common
    // content (new to the read-ahead), a third stay twins of the first half.
    for i in n..2 * n {
        let c = match i % 3 {
            0 => 1_000_000 + i as u64,
            1 => 5_000_000,
            _ => continue,
        };
        want[i] = c;
        fill(&mut s[i * PAGE..(i + 1) * PAGE], c);
    }
    let twins = (n..2 * n).filter(|i| i % 3 == 2).count() as u64;
    let common = (n..2 * n).filter(|i| i % 3 == 1).count() as u64;
    let st = wait_for(&e, |st| st.pages_sharing >= twins + common - 1);
    assert_eq!(st.pages_sharing, twins + common - 1, "{st:?}");
    assert_eq!(st.pages_shared, twins + 1, "{st:?}");
    // A stale read-ahead result would have grouped written pages with their former twins, and
    // the comparison on frozen bytes would have refused them.
    assert_eq!(st.compare_mismatches, 0, "{st:?}");
    for (i, page) in s.chunks(PAGE).enumerate() {
        assert!(
            check(page, want[i]),
            "page {i} does not hold what was written"
        );
    }
    e.unregister(s.as_mut_ptr(), s.len()).unwrap();
    assert_eq!(e.stable_pages(), 0);
}

#[test]
fn a_page_read_ahead_finds_a_copy_published_after_its_read() {
    let _g = serial();
    // Three unchanged periods to merge; two kicked periods after registering `a` count one or
    // two of them (the first may not count), so `a` is due strictly before `b`, registered then.
    let e = Engine::builder()
        .merge_period(NEVER)
        .merge_periods(3)
        .build()
        .unwrap();
    // `a` holds content 7 twice, `b` once more. `b` is read ahead at its registration, before
    // `a` is due and its copy published; when `b` is due, its page is the only one of its
    // content in its batch and must look the copy up (else it waits as a first sighting that
    // nothing will ever pair with).
    let a = filled(2, |_| 7);
    let b = filled(1, |_| 7);
    e.register(a.as_mut_ptr(), a.len()).unwrap();
    for _ in 0..2 {
        assert!(e.wait_periods(1, Duration::from_secs(10)));
    }
    assert_eq!(e.stats().pages_sharing, 0, "a is not due yet");
    e.register(b.as_mut_ptr(), b.len()).unwrap();
    std::thread::sleep(Duration::from_millis(30));
    let a_alone = std::cell::Cell::new(false);
    let st = wait_for(&e, |st| {
        a_alone.set(a_alone.get() || st.pages_sharing == 1);
        st.pages_sharing >= 2
    });
    assert!(a_alone.get(), "a merged before b was due: {st:?}");
    assert_eq!((st.pages_shared, st.pages_sharing), (1, 2), "{st:?}");
    assert!(a.chunks(PAGE).all(|p| check(p, 7)));
    assert!(check(b, 7));
    e.unregister(a.as_mut_ptr(), a.len()).unwrap();
    e.unregister(b.as_mut_ptr(), b.len()).unwrap();
    assert_eq!(e.stable_pages(), 0);
}

#[test]
fn read_ahead_over_parts_holes_and_zero_pages_merges_by_contents() {
    let _g = serial();
    let e = Engine::builder().merge_period(NEVER).build().unwrap();
    // Two halves of n pages with the same contents, over several read-ahead parts (1024 pages
    // each), with pages never touched (holes) and pages only read (the shared zero page) here
    // and there: every part must pair its results with the right addresses.
    let n = 2500;
    let p = pageone_sys::mmap_anonymous(2 * n * PAGE).unwrap();
    // SAFETY: a fresh private mapping of this length that nothing else uses; it is leaked (the
    // test process ends soon), so the slice stays valid.
    let s = unsafe { std::slice::from_raw_parts_mut(p, 2 * n * PAGE) };
    let hole = |i: usize| i % 7 == 3;
    let zero = |i: usize| i % 11 == 5;
    let mut count = vec![0u64; n + 1];
    for i in 0..2 * n {
        if hole(i) {
            continue;
        }
        if zero(i) {
            // SAFETY: the address is inside the mapping above; a read maps the zero page.
            let _ = unsafe { std::ptr::read_volatile(p.add(i * PAGE)) };
            continue;
        }
        let c = (i % n) as u64 + 1;
        fill(&mut s[i * PAGE..(i + 1) * PAGE], c);
        count[c as usize] += 1;
    }
    let shared = count.iter().filter(|&&m| m >= 2).count() as u64;
    let sharing: u64 = count.iter().filter(|&&m| m >= 2).map(|m| m - 1).sum();
    assert!(sharing > 1000, "the layout leaves pairs to merge");
    e.register(s.as_mut_ptr(), s.len()).unwrap();
    let st = wait_for(&e, |st| st.pages_sharing >= sharing);
    assert_eq!(
        (st.pages_shared, st.pages_sharing),
        (shared, sharing),
        "{st:?}"
    );
    // A result given to the wrong page would group pages of different contents, and the
    // comparison on frozen bytes would refuse them.
    assert_eq!(st.compare_mismatches, 0, "{st:?}");
    for (i, page) in s.chunks(PAGE).enumerate() {
        let want = if hole(i) || zero(i) {
            0
        } else {
            (i % n) as u64 + 1
        };
        assert!(check(page, want), "page {i} changed");
    }
    e.unregister(s.as_mut_ptr(), s.len()).unwrap();
    assert_eq!(e.stable_pages(), 0);
}
