//! Zero pages inside runs of merged pages: they keep the run one mapping of the store (zero
//! holes, see the engine's `zero_holes` module), read zeros, take no memory, and behave as any
//! merged page when written, dropped or unregistered.

use std::time::Duration;

use pageone_engine::{Engine, WatchMode};
use pageone_sys as sys;

mod common;
use common::{check, filled, wait_for, PAGE};

/// Pages per half of the region: both halves hold the same pages.
const N: usize = 256;

/// Page `i`: one page in eight is zero (never the first or last of a half), the others differ
/// within a half and repeat in the other half.
fn content(i: usize) -> u64 {
    let j = i % N;
    if j % 8 == 3 {
        0
    } else {
        j as u64 + 1
    }
}

/// The mappings of the process that cover part of `[start, start + len)`.
fn mappings_over(start: usize, len: usize) -> Vec<sys::Mapping> {
    sys::self_mappings()
        .unwrap()
        .into_iter()
        .filter(|m| m.end > start && m.start < start + len)
        .collect()
}

fn zero_pfn_pages(start: usize, pages: usize) -> usize {
    let pm = sys::Pagemap::open().unwrap();
    pm.count_pages(start, pages, sys::uapi::PAGE_IS_PFNZERO)
        .unwrap()
}

/// An engine with 20 ms periods (and `vma_margin` if given) and the two halves of `content`,
/// filled before they are registered (every page is a candidate in the same period); `None`
/// (the test skipped) where zero holes are not used.
fn engine_with_halves(vma_margin: Option<usize>) -> Option<(Engine, &'static mut [u8])> {
    let b = Engine::builder()
        .merge_period(Duration::from_millis(20))
        .watch(WatchMode::Auto);
    let b = match vma_margin {
        Some(m) => b.vma_margin(m),
        None => b,
    };
    let e = b.build().expect("the engine starts on this kernel");
    if e.watch_mode() != WatchMode::UffdWp {
        eprintln!("skipped: zero holes need userfaultfd write-protection of store mappings");
        return None;
    }
    let mem = filled(2 * N, content);
    e.register(mem.as_mut_ptr(), mem.len()).unwrap();
    Some((e, mem))
}

#[test]
fn zero_pages_inside_a_merged_run_keep_it_one_mapping() {
    let Some((e, mem)) = engine_with_halves(None) else {
        return;
    };
    let (base, len) = (mem.as_ptr() as usize, mem.len());
    let (distinct, zeros) = ((N - N / 8) as u64, (2 * N / 8) as u64);
    let s = wait_for(&e, |s| s.pages_sharing >= distinct && s.zero_pages >= zeros);
    assert_eq!(s.zero_pages, zeros, "{s:?}");
    assert_merged_whole(&s, mem);
    // Read, the zero pages map the kernel's zero page (the store's holes took no page).
    assert_eq!(zero_pfn_pages(base, 2 * N), zeros as usize);

    // Written, a zero page is the program's own again; the other half is untouched.
    let w = 3 * PAGE;
    mem[w + 17] = 0x5a;
    let s = wait_for(&e, |s| s.zero_pages < zeros);
    assert_eq!(s.zero_pages, zeros - 1, "{s:?}");
    assert_eq!(mem[w + 17], 0x5a);
    assert!(check(&mem[(N + 3) * PAGE..(N + 4) * PAGE], 0));
    // Dropped, a zero page in a store mapping reads zeros, as the kernel's `MADV_DONTNEED` would.
    let d = base + (N + 11) * PAGE;
    e.discard(d as *mut u8, PAGE).unwrap();
    assert!(check(&mem[(N + 11) * PAGE..(N + 12) * PAGE], 0));

    e.unregister(base as *mut u8, len).unwrap();
    for (i, p) in mem.chunks(PAGE).enumerate() {
        let want = if i == 3 { None } else { Some(content(i)) };
        match want {
            Some(c) => assert!(check(p, c), "page {i} changed by unmerging"),
            None => assert_eq!((p[17], p.iter().filter(|&&b| b != 0).count()), (0x5a, 1)),
        }
    }
    let left = mappings_over(base, len);
    assert!(
        left.iter().all(|m| m.is_private_anonymous_rw()),
        "unregistered memory is anonymous again: {left:#?}"
    );
}

/// With no room for mappings, the pages whose merges the budget cannot afford wait for room, but
/// the zero pages among them (planned onto holes) are released as zero pages, which costs none.
#[test]
fn zero_pages_are_released_where_the_mapping_budget_has_no_room() {
    let Some((e, mem)) = engine_with_halves(Some(1 << 30)) else {
        return;
    };
    let (base, len) = (mem.as_ptr() as usize, mem.len());
    let zeros = (2 * N / 8) as u64;
    let s = wait_for(&e, |s| {
        s.zero_pages >= zeros && s.pages_waiting_on_limit > 0
    });
    assert_eq!(s.zero_pages, zeros, "{s:?}");
    assert_eq!(s.pages_sharing, 0, "nothing could be mapped: {s:?}");
    assert!(s.pages_waiting_on_limit > 0, "{s:?}");

    for (i, p) in mem.chunks(PAGE).enumerate() {
        assert!(check(p, content(i)), "page {i} changed");
    }
    e.unregister(base as *mut u8, len).unwrap();
}

/// Checks the region `mem` once merged: each half onto the same copies, a mapping of the store
/// each, zero pages included, every page as `content` has it.
fn assert_merged_whole(s: &pageone_engine::Stats, mem: &[u8]) {
    let distinct = (N - N / 8) as u64;
    assert_eq!(
        (s.pages_shared, s.pages_sharing),
        (distinct, distinct),
        "{s:?}"
    );
    assert_eq!(s.compare_mismatches, 0, "{s:?}");
    let maps = mappings_over(mem.as_ptr() as usize, mem.len());
    assert_eq!(
        maps.len(),
        2,
        "each half is one mapping of the store, zero pages included: {maps:#?}"
    );
    for (i, p) in mem.chunks(PAGE).enumerate() {
        assert!(check(p, content(i)), "page {i} changed by merging");
    }
}

/// An engine with 20 ms periods and a region whose first half is as `content` has it and whose
/// second half is all zero, registered, once every zero page was released (nothing merged yet);
/// the region's address and length. `None` (the test skipped) where zero holes are not used.
fn engine_with_zeros_released() -> Option<(Engine, usize, usize)> {
    let e = Engine::builder()
        .merge_period(Duration::from_millis(20))
        .watch(WatchMode::Auto)
        .build()
        .expect("the engine starts on this kernel");
    if e.watch_mode() != WatchMode::UffdWp {
        eprintln!("skipped: zero holes need userfaultfd write-protection of store mappings");
        return None;
    }
    let mem = filled(2 * N, |i| if i < N { content(i) } else { 0 });
    let (base, len) = (mem.as_mut_ptr() as usize, mem.len());
    e.register(base as *mut u8, len).unwrap();
    let s = wait_for(&e, |s| s.zero_pages >= (N + N / 8) as u64);
    assert_eq!(
        (s.zero_pages, s.pages_sharing),
        ((N + N / 8) as u64, 0),
        "{s:?}"
    );
    Some((e, base, len))
}

/// Writes the second half of the region at `base` as `content` has it, but for its zero pages,
/// left as they are: the first half's duplicates, around zero pages released already.
fn write_second_half(base: usize) {
    for i in (N..2 * N).filter(|&i| content(i) != 0) {
        // SAFETY: page i of the test's region; no other thread writes it.
        let page = unsafe { std::slice::from_raw_parts_mut((base + i * PAGE) as *mut u8, PAGE) };
        common::fill(page, content(i));
    }
}

/// Zero pages released before the pages around them merge (their duplicates were written
/// later): they merge onto zero holes all the same once their neighbours merge, untouched
/// since their release, so each half is one mapping of the store again.
#[test]
fn zero_pages_released_before_their_neighbours_merge_join_the_run() {
    let Some((e, base, len)) = engine_with_zeros_released() else {
        return;
    };
    let (distinct, zeros) = ((N - N / 8) as u64, (2 * N / 8) as u64);
    write_second_half(base);
    // SAFETY: the test's region, written by no other thread from here on.
    let mem = unsafe { std::slice::from_raw_parts(base as *const u8, len) };
    let s = wait_for(&e, |s| {
        s.pages_sharing >= distinct && s.zero_pages == zeros && mappings_over(base, len).len() == 2
    });
    assert_merged_whole(&s, mem);
    e.unregister(base as *mut u8, len).unwrap();
    for (i, p) in mem.chunks(PAGE).enumerate() {
        assert!(check(p, content(i)), "page {i} changed by unmerging");
    }
}

/// Zero pages released before their neighbours merge, written by another thread all along
/// (before, while and after their neighbours merge, with them onto holes or not): every write
/// is kept, and every page reads what was last written there.
#[test]
fn released_zero_pages_written_while_their_neighbours_merge_keep_every_write() {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::Arc;
    let Some((e, base, len)) = engine_with_zeros_released() else {
        return;
    };
    // The writer writes word 1 of the zero pages at random (SeqCst: a test, plain reasoning).
    let zero_pages: Vec<usize> = (0..2 * N).filter(|&i| content(i) == 0).collect();
    let shadow: Arc<Vec<AtomicU64>> = Arc::new((0..2 * N).map(|_| AtomicU64::new(0)).collect());
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let (shadow, stop) = (shadow.clone(), stop.clone());
        std::thread::spawn(move || {
            let (mut x, mut n) = (0x9E37_79B9_7F4A_7C15u64, 0u64);
            while !stop.load(Ordering::SeqCst) {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let i = zero_pages[x as usize % zero_pages.len()];
                n += 1;
                let v = n << 16 | i as u64;
                // SAFETY: word 1 of page i of the registered region, which stays mapped until
                // the writer is joined; only this thread writes the zero pages meanwhile.
                unsafe { std::ptr::write_volatile((base + i * PAGE + 8) as *mut u64, v) };
                shadow[i].store(v, Ordering::SeqCst);
                std::thread::sleep(Duration::from_micros(100));
            }
        })
    };
    // The second half's duplicates come now, around its zero pages (the writer writes only
    // those).
    write_second_half(base);
    let distinct = (N - N / 8) as u64;
    let s = wait_for(&e, |s| s.pages_sharing >= distinct);
    e.wait_periods(25, Duration::from_secs(10));
    stop.store(true, Ordering::SeqCst);
    writer.join().unwrap();
    assert!(s.pages_sharing >= distinct, "{s:?}");
    // SAFETY: the test's region, written by no other thread from here on.
    let mem = unsafe { std::slice::from_raw_parts(base as *const u8, len) };
    let expected = |i: usize, p: &[u8]| {
        let mut want = [0u8; PAGE];
        common::fill(&mut want, content(i));
        let v = shadow[i].load(Ordering::SeqCst);
        if v != 0 {
            want[8..16].copy_from_slice(&v.to_ne_bytes());
        }
        p == want
    };
    for (i, p) in mem.chunks(PAGE).enumerate() {
        assert!(expected(i, p), "page {i} lost a write or changed");
    }
    e.unregister(base as *mut u8, len).unwrap();
    for (i, p) in mem.chunks(PAGE).enumerate() {
        assert!(expected(i, p), "page {i} changed by unmerging");
    }
}
