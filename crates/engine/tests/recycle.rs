//! PPR on the real kernel: pages a program marks free are released within a period, unmarked
//! pages keep their contents, forged marks release nothing, and writers racing the recycler never
//! lose a write.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pageone_engine::recycler::Pool;
use pageone_engine::Engine;

mod common;
use common::{wait_for, PAGE};

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// Periods run only when a test kicks them.
const NEVER: Duration = Duration::from_secs(3600);

/// A fresh private anonymous region of `pages` pages, each filled with its own value (past the
/// first 24 bytes, which a mark overwrites).
fn region(pages: usize) -> &'static mut [u8] {
    let p = pageone_sys::mmap_anonymous(pages * PAGE).unwrap();
    // SAFETY: a fresh private mapping of this length that nothing else uses; it is leaked (the
    // test process ends soon), so the slice stays valid.
    let s = unsafe { std::slice::from_raw_parts_mut(p, pages * PAGE) };
    for (i, page) in s.chunks_mut(PAGE).enumerate() {
        write_value(page, i as u64 + 1);
    }
    s
}

fn write_value(page: &mut [u8], v: u64) {
    page.fill(0);
    for w in page[64..].chunks_mut(8) {
        w.copy_from_slice(&v.to_le_bytes());
    }
}

fn holds(page: &[u8], v: u64) -> bool {
    page[24..64].iter().all(|&b| b == 0)
        && page[64..]
            .chunks(8)
            .all(|w| u64::from_le_bytes(w.try_into().unwrap()) == v)
}

/// Pages of `s` holding memory of their own by the kernel's page tables (present, and not the
/// shared zero page, which released pages map).
fn present(s: &[u8]) -> usize {
    let pm = pageone_sys::Pagemap::open().unwrap();
    let (start, n) = (s.as_ptr() as usize, s.len() / PAGE);
    let present = pm
        .pages_with(start, n, pageone_sys::uapi::PAGE_IS_PRESENT)
        .unwrap();
    let zero = pm
        .pages_with(start, n, pageone_sys::uapi::PAGE_IS_PFNZERO)
        .unwrap();
    present.iter().zip(&zero).filter(|(&p, &z)| p && !z).count()
}

/// An engine with `period` recycling from `pool`, and a registered region of `pages` pages
/// (see [`region`]).
fn recycling(period: Duration, pages: usize, pool: &Arc<Pool>) -> (Engine, &'static mut [u8]) {
    let e = Engine::builder().merge_period(period).build().unwrap();
    let s = region(pages);
    e.register(s.as_mut_ptr(), s.len()).unwrap();
    e.recycle_from(pool.clone());
    (e, s)
}

#[test]
fn marked_pages_are_released_and_the_others_keep_their_contents() {
    let _g = serial();
    let n = 512;
    let pool = Arc::new(Pool::new(1024).unwrap());
    let (e, s) = recycling(NEVER, n, &pool);
    let marked = |i: usize| i % 3 == 1;
    let m = (0..n).filter(|&i| marked(i)).count() as u64;
    for i in (0..n).filter(|&i| marked(i)) {
        // SAFETY: the test's own page, not used again before it is unmarked.
        assert!(unsafe { pool.mark(s.as_mut_ptr().add(i * PAGE)) });
    }
    let st = wait_for(&e, |st| st.pages_recycled >= m);
    assert_eq!(st.pages_recycled, m, "{st:?}");
    assert_eq!(pool.stats().recycled, m);
    // Measured by the kernel: the released pages are gone from the page tables.
    assert_eq!(present(s) as u64, n as u64 - m);
    for (i, page) in s.chunks_mut(PAGE).enumerate() {
        if marked(i) {
            // SAFETY: marked above, not unmarked since.
            unsafe { pool.unmark(page.as_mut_ptr()) };
            assert!(
                page.iter().all(|&b| b == 0),
                "recycled page {i} reads as zeros"
            );
            // A reused page takes writes.
            write_value(page, 1000 + i as u64);
            assert!(holds(page, 1000 + i as u64));
        } else {
            assert!(holds(page, i as u64 + 1), "page {i} kept its contents");
        }
    }
    // The reused pages are watched and merged like any others afterwards.
    for _ in 0..4 {
        e.wait_periods(1, Duration::from_secs(10));
    }
    for (i, page) in s.chunks(PAGE).enumerate() {
        let want = if marked(i) {
            1000 + i as u64
        } else {
            i as u64 + 1
        };
        assert!(
            holds(page, want),
            "page {i} kept what was written: {:?}",
            e.stats()
        );
    }
    e.unregister(s.as_mut_ptr(), s.len()).unwrap();
}

#[test]
fn pages_unmarked_before_a_period_keep_their_contents() {
    let _g = serial();
    let n = 256;
    let pool = Arc::new(Pool::new(1024).unwrap());
    let e = Engine::builder().merge_period(NEVER).build().unwrap();
    let s = region(n);
    e.register(s.as_mut_ptr(), s.len()).unwrap();
    for i in 0..n {
        // SAFETY: the test's own pages.
        unsafe { pool.mark(s.as_mut_ptr().add(i * PAGE)) };
    }
    // Half are reused before the engine looks: the pool is handed over only after that. (Handed
    // over first, the engine's start-up period could claim a page between its mark and its
    // unmark, and release it: an unmarked page may then read as zeros, which `unmark` allows,
    // but this test checks that unmarked pages keep their contents.)
    for i in (0..n).step_by(2) {
        // SAFETY: marked above.
        unsafe { pool.unmark(s.as_mut_ptr().add(i * PAGE)) };
    }
    e.recycle_from(pool.clone());
    let st = wait_for(&e, |st| st.pages_recycled >= n as u64 / 2);
    for _ in 0..3 {
        e.wait_periods(1, Duration::from_secs(10));
    }
    assert_eq!(e.stats().pages_recycled, n as u64 / 2, "{st:?}");
    for (i, page) in s.chunks(PAGE).enumerate() {
        if i % 2 == 0 {
            assert!(
                holds(page, i as u64 + 1),
                "unmarked page {i} kept its contents"
            );
        } else {
            assert!(page.iter().all(|&b| b == 0), "page {i} was recycled");
        }
    }
    e.unregister(s.as_mut_ptr(), s.len()).unwrap();
}

#[test]
fn forged_marks_and_pages_outside_registered_memory_are_never_released() {
    let _g = serial();
    let n = 64;
    let pool = Arc::new(Pool::with_values(64, 0xabcd, 0x1234_5678_9abc_def1));
    let (e, s) = recycling(NEVER, n, &pool);
    let outside = region(4);
    // A mark on memory the engine does not watch.
    // SAFETY: the test's own page.
    assert!(unsafe { pool.mark(outside.as_mut_ptr()) });
    // Page 0 is marked; page 1 gets a copy of page 0's mark words (naming page 0's slot), and
    // page 2 words naming a slot nobody took.
    // SAFETY: the test's own page.
    assert!(unsafe { pool.mark(s.as_mut_ptr()) });
    let (head, rest) = s.split_at_mut(PAGE);
    rest[..24].copy_from_slice(&head[..24]);
    rest[PAGE..PAGE + 24].copy_from_slice(&head[..24]);
    rest[PAGE + 8..PAGE + 16].copy_from_slice(&40u64.to_le_bytes());
    let st = wait_for(&e, |st| st.pages_recycled >= 1);
    for _ in 0..3 {
        e.wait_periods(1, Duration::from_secs(10));
    }
    assert_eq!(e.stats().pages_recycled, 1, "{st:?}");
    assert!(
        s[..PAGE].iter().all(|&b| b == 0),
        "the marked page was released"
    );
    for i in 1..n {
        assert!(s[i * PAGE + 64..(i + 1) * PAGE]
            .chunks(8)
            .all(|w| u64::from_le_bytes(w.try_into().unwrap()) == i as u64 + 1));
    }
    assert!(
        holds(&outside[..PAGE], 1),
        "the page outside was not released"
    );
    assert_eq!(present(&s[PAGE..]), n - 1);
    e.unregister(s.as_mut_ptr(), s.len()).unwrap();
}

#[test]
fn writers_racing_the_recycler_never_lose_a_write() {
    let _g = serial();
    let threads = 4;
    let per = 128;
    let pool = Arc::new(Pool::new(1024).unwrap());
    let (e, s) = recycling(Duration::from_millis(5), threads * per, &pool);
    let base = s.as_mut_ptr() as usize;
    let end = Instant::now() + Duration::from_secs(8);
    let checks: Vec<u64> = std::thread::scope(|sc| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let pool = pool.clone();
                let e = &e;
                sc.spawn(move || {
                    // Each thread owns its pages: value written (0 = marked free).
                    let mut shadow: Vec<u64> = (0..per).map(|i| (t * per + i) as u64 + 1).collect();
                    let mut rng = 0x9e37_79b9_7f4a_7c15u64 ^ t as u64;
                    let mut checked = 0u64;
                    let mut serial = 1u64 << 32;
                    let mut ops = 0u64;
                    while Instant::now() < end {
                        ops += 1;
                        if ops % 64 == 0 {
                            // Marks must live a few periods for the recycler to meet them.
                            std::thread::sleep(Duration::from_millis(1));
                        }
                        rng ^= rng << 13;
                        rng ^= rng >> 7;
                        rng ^= rng << 17;
                        let i = (rng % per as u64) as usize;
                        let addr = base + (t * per + i) * PAGE;
                        // SAFETY: this thread's own page of the registered region, which stays
                        // mapped while the scope runs.
                        let page = unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, PAGE) };
                        if shadow[i] == 0 {
                            // Reuse: unmark, then the page holds its old value or zeros.
                            // SAFETY: marked by this thread, not unmarked since.
                            unsafe { pool.unmark(addr as *mut u8) };
                            serial += 1;
                            write_value(page, serial);
                            shadow[i] = serial;
                        } else {
                            assert!(
                                holds(page, shadow[i]),
                                "thread {t} page {i} addr {addr:#x} lost a write: wanted {:#x}, head {:x?}, at 64 {:#x}, zero {} {:?} {:?}",
                                shadow[i],
                                &page[..24],
                                u64::from_le_bytes(page[64..72].try_into().unwrap()),
                                page.iter().all(|&b| b == 0),
                                e.stats(),
                                pool.stats()
                            );
                            checked += 1;
                            // SAFETY: this thread's page; not used again before its unmark.
                            if unsafe { pool.mark(addr as *mut u8) } {
                                shadow[i] = 0;
                            }
                        }
                    }
                    for (i, v) in shadow.iter_mut().enumerate() {
                        let addr = base + (t * per + i) * PAGE;
                        if *v == 0 {
                            // SAFETY: as above.
                            unsafe { pool.unmark(addr as *mut u8) };
                            // SAFETY: as above.
                            let page = unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, PAGE) };
                            serial += 1;
                            write_value(page, serial);
                            *v = serial;
                        }
                    }
                    // SAFETY: as above.
                    let all = unsafe { std::slice::from_raw_parts((base + t * per * PAGE) as *const u8, per * PAGE) };
                    for (i, page) in all.chunks(PAGE).enumerate() {
                        assert!(holds(page, shadow[i]), "thread {t} page {i} lost a write");
                    }
                    checked
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let st = e.stats();
    let ps = pool.stats();
    eprintln!(
        "checks {checks:?}, pool {ps:?}, engine recycled {}",
        st.pages_recycled
    );
    assert!(
        checks.iter().all(|&c| c > 1000),
        "every writer made progress"
    );
    assert!(
        st.pages_recycled > 100,
        "the recycler released pages meanwhile: {ps:?}"
    );
    e.unregister(s.as_mut_ptr(), s.len()).unwrap();
}

/// An engine that only recycles (`merging` off) never write-protects registered memory nor
/// merges its duplicates, and releases a page marked again after its reuse, period after period.
#[test]
fn an_engine_that_only_recycles_recycles_pages_again_and_merges_nothing() {
    let _g = serial();
    let n = 256;
    let pool = Arc::new(Pool::new(1024).unwrap());
    let e = Engine::builder()
        .merge_period(NEVER)
        .merging(false)
        .build()
        .unwrap();
    let s = region(n);
    // Every page alike: an engine that merges would merge them all within a few periods.
    for page in s.chunks_mut(PAGE) {
        write_value(page, 7);
    }
    e.register(s.as_mut_ptr(), s.len()).unwrap();
    e.recycle_from(pool.clone());
    let pm = pageone_sys::Pagemap::open().unwrap();
    let start = s.as_ptr() as usize;
    let not_protected = || {
        pm.pages_with(start, n, pageone_sys::uapi::PAGE_IS_WRITTEN)
            .unwrap()
            .iter()
            .filter(|&&w| w)
            .count()
    };
    if e.watch_mode() == pageone_engine::WatchMode::UffdWp {
        // (With async write-protection, a page not write-protected reads as written.)
        assert_eq!(not_protected(), n, "no page is write-protected");
    }
    let marked = |i: usize| i % 2 == 0;
    let m = (0..n).filter(|&i| marked(i)).count() as u64;
    for round in 1..=3u64 {
        for i in (0..n).filter(|&i| marked(i)) {
            // SAFETY: the test's own page, not used again before it is unmarked.
            assert!(unsafe { pool.mark(s.as_mut_ptr().add(i * PAGE)) });
        }
        let st = wait_for(&e, |st| st.pages_recycled >= round * m);
        assert_eq!(st.pages_recycled, round * m, "round {round}: {st:?}");
        assert_eq!(st.merges, 0, "round {round}: {st:?}");
        assert_eq!(present(s) as u64, n as u64 - m, "round {round}");
        for (i, page) in s.chunks_mut(PAGE).enumerate() {
            if marked(i) {
                // SAFETY: marked above, not unmarked since.
                unsafe { pool.unmark(page.as_mut_ptr()) };
                assert!(page.iter().all(|&b| b == 0), "page {i} reads as zeros");
                write_value(page, 7);
            }
            assert!(holds(page, 7), "round {round}: page {i}");
        }
    }
    if e.watch_mode() == pageone_engine::WatchMode::UffdWp {
        assert_eq!(not_protected(), n, "still no page is write-protected");
    }
    e.unregister(s.as_mut_ptr(), s.len()).unwrap();
    assert!(s.chunks(PAGE).all(|p| holds(p, 7)));
}
