//! Unregistering memory whose merged pages are single-page mappings of the store (duplicates in
//! another order than their twins): the mappings side by side are made anonymous a span at a
//! time, and writes made meanwhile are kept.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use pageone_engine::Engine;
use pageone_sys as sys;

mod common;
use common::{check, fill, wait_for, PAGE};

/// The word every test write goes to: `fill` never puts content there (its offsets are multiples
/// of 8 up to `PAGE - 16`).
const LAST_WORD: usize = PAGE - 8;

/// Content of page `i` of a region of two halves of `n` pages (`n` a power of two): the second
/// half holds the first half's contents in an order where no two neighbours stay neighbours.
fn content(i: usize, n: usize) -> u64 {
    let k = if i < n { i } else { ((i - n) * 1237) % n };
    k as u64 + 1
}

/// Mappings that meet `[start, end)`, and how many of them map a file (the store).
fn mappings(start: usize, end: usize) -> (Vec<sys::Mapping>, usize) {
    let maps: Vec<_> = sys::self_mappings()
        .unwrap()
        .into_iter()
        .filter(|m| m.end > start && m.start < end)
        .collect();
    let files = maps.iter().filter(|m| m.inode != 0).count();
    (maps, files)
}

#[test]
fn scattered_merged_pages_become_anonymous_in_spans_and_keep_concurrent_writes() {
    let e = Engine::builder()
        .merge_period(Duration::from_millis(20))
        .build()
        .expect("the engine starts on this kernel");
    let n = 2048;
    let mut r = e.alloc_region(2 * n * PAGE).unwrap();
    for (i, p) in r.as_mut_slice().chunks_mut(PAGE).enumerate() {
        fill(p, content(i, n));
    }
    let s = wait_for(&e, |s| s.pages_sharing >= n as u64);
    assert_eq!(s.pages_sharing, n as u64, "{s:?}");
    let (base, len) = (r.as_ptr() as usize, r.len());
    let (_, store_maps) = mappings(base, base + len);
    assert!(
        store_maps >= n / 2,
        "the second half's pages did not merge as single pages: {store_maps} store mappings"
    );

    let writers = 2;
    let stop = AtomicBool::new(false);
    let shadows: Vec<Vec<u64>> = std::thread::scope(|sc| {
        let threads: Vec<_> = (0..writers)
            .map(|t| {
                let stop = &stop;
                sc.spawn(move || write_until(base, 2 * n, (t, writers), stop))
            })
            .collect();
        std::thread::sleep(Duration::from_millis(30));
        e.unregister(base as *mut u8, len).unwrap();
        std::thread::sleep(Duration::from_millis(30));
        stop.store(true, Ordering::Relaxed);
        threads.into_iter().map(|t| t.join().unwrap()).collect()
    });

    let (maps, store_maps) = mappings(base, base + len);
    assert_eq!(store_maps, 0, "store mappings are left: {maps:?}");
    assert!(maps.iter().all(|m| m.is_private_anonymous_rw()), "{maps:?}");
    // A mapping made anonymous alone per store mapping would leave about n mappings.
    assert!(
        maps.len() <= n / 16,
        "{} mappings left in the range: store mappings were made anonymous one by one",
        maps.len()
    );
    let mem = r.as_mut_slice();
    for (i, p) in mem.chunks_mut(PAGE).enumerate() {
        let written = shadows[i % writers][i / writers];
        let word = u64::from_ne_bytes(p[LAST_WORD..].try_into().unwrap());
        assert_eq!(word, written, "page {i}: a write was lost");
        p[LAST_WORD..].fill(0);
        assert!(check(p, content(i, n)), "page {i} changed by unregister");
    }
}

/// Writes the last word of random pages among `pages` (those `k * of.1 + of.0`) until `stop`,
/// checking first that each holds what this thread wrote last; returns what each holds.
fn write_until(base: usize, pages: usize, of: (usize, usize), stop: &AtomicBool) -> Vec<u64> {
    let mine = pages / of.1;
    let mut shadow = vec![0u64; mine];
    let mut x = 0x9E37_79B9_7F4A_7C15u64 ^ of.0 as u64;
    let mut v = 0u64;
    // Relaxed: a stop flag only.
    while !stop.load(Ordering::Relaxed) {
        for _ in 0..64 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let k = x as usize % mine;
            let at = (base + (k * of.1 + of.0) * PAGE + LAST_WORD) as *mut u64;
            // SAFETY: a word of the test's region that only this thread writes; the engine
            // changes the mapping under it but never its bytes.
            let now = unsafe { std::ptr::read_volatile(at) };
            assert_eq!(now, shadow[k], "a write was lost");
            v += 1;
            // SAFETY: as above.
            unsafe { std::ptr::write_volatile(at, v) };
            shadow[k] = v;
        }
        std::thread::sleep(Duration::from_micros(100));
    }
    shadow
}
