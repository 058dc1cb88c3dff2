//! Integration tests of the engine on the real kernel mechanisms (userfaultfd, PAGEMAP_SCAN,
//! memfd): our equivalents of the kernel's KSM selftests, the VMA-limit path, and the
//! no-lost-write stress test.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use pageone_engine::{DropAdvice, Engine, EngineError, Region, WatchMode};
use pageone_sys as sys;

mod common;
use common::{check, fill, wait_for, PAGE};

/// The tests run one at a time: the Pss test measures the whole process.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn engine(mode: WatchMode) -> Engine {
    Engine::builder()
        .merge_period(Duration::from_millis(20))
        .watch(mode)
        .build()
        .expect("the engine starts on this kernel")
}

/// Whether the page at `addr` is mapped from the stable store (present and file-backed).
fn file_backed(addr: usize) -> bool {
    let pm = sys::Pagemap::open().unwrap();
    let mut e = Vec::new();
    pm.entries(addr, 1, &mut e).unwrap();
    e[0] & sys::uapi::PM_PRESENT != 0 && e[0] & sys::uapi::PM_FILE != 0
}

/// Whether the page at `addr` lies in a mapping of a file (the stable store's, in these tests).
fn in_store_mapping(addr: usize) -> bool {
    sys::self_mappings()
        .unwrap()
        .iter()
        .any(|m| m.start <= addr && addr < m.end && m.inode != 0)
}

fn merge_cow_and_zero(mode: WatchMode) {
    let _g = serial();
    let e = engine(mode);
    let n = 1024;
    let mut r = e.alloc_region(4 * n * PAGE).unwrap();
    // Four identical quarters of n distinct pages, a quarter of them zero.
    let content = |i: usize| {
        if i % n % 4 == 3 {
            0
        } else {
            (i % n) as u64 + 1
        }
    };
    for (i, p) in r.as_mut_slice().chunks_mut(PAGE).enumerate() {
        fill(p, content(i));
    }
    let distinct = (n - n / 4) as u64;
    let s = wait_for(&e, |s| {
        s.pages_sharing >= 3 * distinct && s.zero_pages >= n as u64
    });
    assert_eq!(s.watch_mode, mode);
    assert_eq!(
        s.pages_shared, distinct,
        "one stable copy per distinct content: {s:?}"
    );
    assert_eq!(s.pages_sharing, 3 * distinct, "{s:?}");
    assert_eq!(s.zero_pages, n as u64, "{s:?}");
    assert_eq!(s.compare_mismatches, 0);
    let base = r.as_ptr() as usize;
    // Contents are intact.
    for (i, p) in r.as_slice().chunks(PAGE).enumerate() {
        assert!(check(p, content(i)), "page {i} changed by merging");
    }
    assert!(file_backed(base), "a merged page maps the stable store");
    // Copy-on-write: a write changes that page only.
    let s = r.as_mut_slice();
    s[5 * PAGE + 100] = 0xAB;
    assert_eq!(s[5 * PAGE + 100], 0xAB);
    for q in [5 + n, 5 + 2 * n, 5 + 3 * n] {
        assert!(
            check(&s[q * PAGE..(q + 1) * PAGE], content(q)),
            "COW leaked into page {q}"
        );
    }
    assert!(!file_backed(base + 5 * PAGE), "the written page is private");
    // Zero pages read as zeros and take writes. One between merged pages may be merged onto a
    // hole of the store between their copies (a zero hole): written, it is a copy-on-write break.
    let z = 3 * PAGE;
    let on_hole = in_store_mapping(base + z);
    assert!(s[z..z + PAGE].iter().all(|&b| b == 0));
    s[z + 7] = 9;
    assert_eq!(s[z + 7], 9);
    let breaks = 1 + u64::from(on_hole);
    let st = wait_for(&e, |s| s.cow_breaks >= breaks);
    assert_eq!(st.cow_breaks, breaks, "{st:?}");
    assert_eq!(st.pages_sharing, 3 * distinct - 1, "{st:?}");
    for (i, p) in r.as_slice().chunks(PAGE).enumerate() {
        if i != 5 && i != 3 {
            assert!(check(p, content(i)), "page {i} changed after the COW test");
        }
    }
    // (The writes above may race a commit of their page: a frozen page found changed is put
    // back and counted as a mismatch, the write kept. Nothing writes from here on.)
    let mismatches_before = e.stats().compare_mismatches;
    // Unmerge: every page private, contents intact, store empty.
    let ptr = r.as_ptr();
    e.unregister(ptr, r.len()).unwrap();
    assert_eq!(e.stable_pages(), 0);
    let s = r.as_slice();
    for i in 0..4 * n {
        assert!(
            !file_backed(base + i * PAGE),
            "page {i} still maps the store"
        );
        let want = match i {
            5 => None,
            3 => None,
            _ => Some(content(i)),
        };
        if let Some(c) = want {
            let pg = &s[i * PAGE..(i + 1) * PAGE];
            assert!(
                check(pg, c),
                "page {i} changed by unmerging: nonzero at {:?}",
                pg.iter().position(|&b| b != 0)
            );
        }
    }
    assert_eq!(s[5 * PAGE + 100], 0xAB);
    assert_eq!(s[z + 7], 9);
    // Registering again merges again, including the pages that are private copies inside
    // mappings of the store now (frozen with write-protection instead of UFFDIO_MOVE).
    e.register(ptr, 4 * n * PAGE).unwrap();
    let s = wait_for(&e, |s| s.pages_sharing >= 3 * distinct - 1);
    assert_eq!(
        (s.pages_shared, s.pages_sharing),
        (distinct, 3 * distinct - 1),
        "{s:?}"
    );
    assert_eq!(s.compare_mismatches, mismatches_before, "{s:?}");
    assert!(r
        .as_slice()
        .chunks(PAGE)
        .enumerate()
        .all(|(i, p)| i == 3 || i == 5 || check(p, content(i))));
    drop(r);
    assert_eq!(e.stable_pages(), 0);
}

#[test]
fn merge_cow_zero_unmerge_uffd_wp() {
    merge_cow_and_zero(WatchMode::UffdWp);
}

#[test]
fn merge_cow_zero_unmerge_checksum_fallback() {
    merge_cow_and_zero(WatchMode::Checksum);
}

/// A new region of two identical halves of `n` distinct pages, once they are merged.
fn merged_halves(e: &Engine, n: usize) -> Region<'_> {
    let mut r = e.alloc_region(2 * n * PAGE).unwrap();
    for (i, p) in r.as_mut_slice().chunks_mut(PAGE).enumerate() {
        fill(p, (i % n) as u64 + 1);
    }
    let s = wait_for(e, |s| s.pages_sharing >= n as u64);
    assert_eq!(s.pages_sharing, n as u64, "{s:?}");
    r
}

/// Changes byte `at` of a merged page of `merged_halves(e, n)` (a copy-on-write break) and waits
/// for the engine to see it; returns the byte it held.
fn break_cow(e: &Engine, r: &mut Region<'_>, n: usize, at: usize) -> u8 {
    let mem = r.as_mut_slice();
    let saved = mem[at];
    mem[at] = saved.wrapping_add(1);
    let s = wait_for(e, |s| s.cow_breaks >= 1);
    assert_eq!((s.cow_breaks, s.pages_sharing), (1, n as u64 - 1), "{s:?}");
    saved
}

/// Waits for every page of `merged_halves(e, n)` to be merged again, and checks their contents.
fn merged_again(e: &Engine, r: &Region<'_>, n: usize) {
    let s = wait_for(e, |s| s.pages_sharing >= n as u64);
    assert_eq!(
        s.pages_sharing, n as u64,
        "the restored page did not merge again: {s:?}"
    );
    assert!(r
        .as_slice()
        .chunks(PAGE)
        .enumerate()
        .all(|(i, p)| check(p, (i % n) as u64 + 1)));
}

/// Breaks a merged page of `merged_halves(e, n)` at byte `at` (see [`break_cow`]), writes it
/// back, and checks that the page merges again and every page holds its contents.
fn break_and_restore(e: &Engine, r: &mut Region<'_>, n: usize, at: usize) {
    let saved = break_cow(e, r, n, at);
    r.as_mut_slice()[at] = saved;
    merged_again(e, r, n);
}

/// A merged page that was written (COW-broken) and later holds a duplicate's contents again is
/// merged again, and writes racing with that are not lost.
#[test]
fn cow_broken_page_merges_again() {
    let _g = serial();
    let e = engine(WatchMode::Auto);
    let n = 64;
    let mut r = merged_halves(&e, n);
    break_and_restore(&e, &mut r, n, 7 * PAGE + 9);
    // And it still copies on write.
    let mem = r.as_mut_slice();
    mem[7 * PAGE] ^= 0xFF;
    assert!(check(&mem[(n + 7) * PAGE..(n + 8) * PAGE], 8));
}

/// Merged memory the program made read-only: a COW-broken page merged again keeps the mapping's
/// protection (it was mapped read/write, so a write the program meant to fault went through).
#[test]
fn a_page_merged_again_keeps_its_protection() {
    let _g = serial();
    let e = engine(WatchMode::Auto);
    let n = 64;
    let mut r = merged_halves(&e, n);
    let base = r.as_ptr() as usize;
    let at = 7 * PAGE + 9;
    let saved = break_cow(&e, &mut r, n, at);
    r.as_mut_slice()[at] = saved;
    {
        let _change = pageone_engine::changing_mappings();
        // SAFETY: the region's own pages; nothing holds a reference into them.
        let ro =
            unsafe { libc::mprotect(base as *mut libc::c_void, 2 * n * PAGE, libc::PROT_READ) };
        assert_eq!(ro, 0);
    }
    merged_again(&e, &r, n);
    let writable: Vec<_> = sys::self_mappings()
        .unwrap()
        .into_iter()
        .filter(|m| {
            m.start < base + 2 * n * PAGE && m.end > base && m.prot() & libc::PROT_WRITE != 0
        })
        .map(|m| (m.start, m.end, m.perms))
        .collect();
    assert!(
        writable.is_empty(),
        "writable again after the merge: {writable:?}"
    );
    // SAFETY: as above; read/write again for the region's drop.
    unsafe {
        libc::mprotect(
            base as *mut libc::c_void,
            2 * n * PAGE,
            libc::PROT_READ | libc::PROT_WRITE,
        )
    };
}

/// How a test drops pages.
#[derive(Clone, Copy)]
enum Dropping {
    /// `madvise(MADV_DONTNEED)`, then `Engine::discard`.
    MadviseThenDiscard,
    /// `Engine::drop_pages` (what the shim does).
    Engine(DropAdvice),
}

/// Merged pages dropped (`how`): the dropped pages read zeros and hold no reference to their
/// copies; every other page keeps its bytes and stays merged; the emptied pages are watched like
/// the rest (written, the bytes stay; equal to a copy again, they merge again).
fn discard_merged_pages_on(mode: WatchMode, how: Dropping) {
    let _g = serial();
    let e = engine(mode);
    let n = 64;
    let mut r = e.alloc_region(2 * n * PAGE).unwrap();
    for (i, p) in r.as_mut_slice().chunks_mut(PAGE).enumerate() {
        fill(p, (i % n) as u64 + 1);
    }
    let s = wait_for(&e, |s| s.pages_sharing >= n as u64);
    assert_eq!(s.pages_sharing, n as u64, "{s:?}");
    let (ptr, base) = (r.as_ptr(), r.as_ptr() as usize);
    let drop_pages = |first: usize, pages: usize| {
        let (at, len) = (ptr.wrapping_add(first * PAGE), pages * PAGE);
        match how {
            Dropping::MadviseThenDiscard => {
                // SAFETY: pages of the test's own region; no reference into it is live.
                unsafe { sys::madvise(at, len, libc::MADV_DONTNEED) }.unwrap();
                e.discard(at, len).unwrap();
            }
            Dropping::Engine(advice) => e.drop_pages(at, len, advice).unwrap(),
        }
    };
    let faults = e.stats().faults_answered;
    drop_pages(5, 1);
    let mem = r.as_mut_slice();
    assert!(
        check(&mem[5 * PAGE..6 * PAGE], 0),
        "a dropped page is not zero"
    );
    if s.watch_mode == WatchMode::UffdWp {
        assert_eq!(
            e.stats().faults_answered,
            faults,
            "reading a dropped page waited for the fault thread (no zero page mapped there)"
        );
    }
    for i in (0..2 * n).filter(|&i| i != 5) {
        assert!(
            check(&mem[i * PAGE..(i + 1) * PAGE], (i % n) as u64 + 1),
            "page {i}"
        );
        assert!(file_backed(base + i * PAGE), "page {i} is no longer merged");
    }
    assert!(!file_backed(base + 5 * PAGE));
    assert_eq!(
        e.stats().pages_sharing,
        n as u64 - 1,
        "the copy keeps a reference"
    );
    // Several pages, one of them written since its merge (a private copy in a store mapping).
    mem[9 * PAGE + 100] = 0xAB;
    wait_for(&e, |s| s.cow_breaks >= 1);
    drop_pages(8, 4);
    let mem = r.as_mut_slice();
    assert!(mem[8 * PAGE..12 * PAGE].iter().all(|&b| b == 0));
    assert_eq!(e.stats().pages_sharing, n as u64 - 5);
    // Written after the drop: kept.
    fill(&mut mem[5 * PAGE..6 * PAGE], 1000);
    e.wait_periods(3, Duration::from_secs(10));
    assert!(
        check(&r.as_mut_slice()[5 * PAGE..6 * PAGE], 1000),
        "a write was lost"
    );
    // Equal to its twin again: merged again.
    fill(&mut r.as_mut_slice()[5 * PAGE..6 * PAGE], 6);
    let s = wait_for(&e, |s| s.pages_sharing >= n as u64 - 4);
    assert_eq!(s.pages_sharing, n as u64 - 4, "{s:?}");
    // (Read first: a merge maps the copy without a page table entry.)
    assert!(check(&r.as_mut_slice()[5 * PAGE..6 * PAGE], 6));
    assert!(file_backed(base + 5 * PAGE), "the page did not merge again");
}

#[test]
fn discarding_merged_pages_gives_zeros_and_keeps_the_rest_merged() {
    discard_merged_pages_on(WatchMode::Auto, Dropping::MadviseThenDiscard);
}

#[test]
fn discarding_merged_pages_gives_zeros_and_keeps_the_rest_merged_checksum_fallback() {
    discard_merged_pages_on(WatchMode::Checksum, Dropping::MadviseThenDiscard);
}

#[test]
fn dropping_merged_pages_gives_zeros_and_keeps_the_rest_merged() {
    discard_merged_pages_on(WatchMode::Auto, Dropping::Engine(DropAdvice::DontNeed));
}

#[test]
fn freeing_merged_pages_drops_them_and_keeps_the_rest_merged() {
    discard_merged_pages_on(WatchMode::Auto, Dropping::Engine(DropAdvice::Free));
}

/// What the kernel refuses, `Engine::drop_pages` refuses alike with the kernel's error: a
/// locked merged page is refused whole (`MADV_DONTNEED`: `EINVAL`) and keeps its bytes. In a range
/// of anonymous then merged pages, `MADV_FREE` (which the kernel refuses on merged pages, mappings
/// of a file) frees the anonymous pages and drops the merged ones, as the kernel applies advice
/// mapping by mapping. Dropped pages are watched again: equal to a copy again, they merge again.
#[test]
fn a_drop_the_kernel_refuses_changes_nothing_merged() {
    let _g = serial();
    let e = engine(WatchMode::Auto);
    let n = 16;
    // Unique pages, then two halves of the same contents.
    let mut r = e.alloc_region(3 * n * PAGE).unwrap();
    for (i, p) in r.as_mut_slice().chunks_mut(PAGE).enumerate() {
        let content = if i < n { 1000 + i } else { (i - n) % n + 1 };
        fill(p, content as u64);
    }
    wait_for(&e, |s| s.pages_sharing >= n as u64);
    let (ptr, base) = (r.as_ptr(), r.as_ptr() as usize);
    let page = |i: usize| ptr.wrapping_add(i * PAGE);
    let locked = n + 3;
    // SAFETY: a page of the test's own region.
    assert_eq!(unsafe { libc::mlock(page(locked).cast(), PAGE) }, 0);
    let refused = e.drop_pages(page(locked), PAGE, DropAdvice::DontNeed);
    // SAFETY: as above.
    assert_eq!(unsafe { libc::munlock(page(locked).cast(), PAGE) }, 0);
    match refused {
        Err(EngineError::Refused(err)) => assert_eq!(err.raw_os_error(), Some(libc::EINVAL)),
        other => panic!("MADV_DONTNEED of a locked page: {other:?}"),
    }
    let mem = r.as_mut_slice();
    for i in n..3 * n {
        let want = ((i - n) % n + 1) as u64;
        assert!(check(&mem[i * PAGE..(i + 1) * PAGE], want), "page {i}");
        // (`mlock` made the locked page a private copy: the kernel's copy-on-write for locking
        // writable memory.)
        assert!(
            i == locked || file_backed(base + i * PAGE),
            "page {i} is no longer merged"
        );
    }
    // Anonymous pages, then merged ones.
    assert!(!file_backed(base + (n / 2) * PAGE));
    e.drop_pages(page(n / 2), n * PAGE, DropAdvice::Free)
        .unwrap();
    let mem = r.as_mut_slice();
    for i in n / 2..n {
        let own = check(&mem[i * PAGE..(i + 1) * PAGE], (1000 + i) as u64);
        assert!(own || check(&mem[i * PAGE..(i + 1) * PAGE], 0), "page {i}");
    }
    for i in n..n + n / 2 {
        assert!(
            check(&mem[i * PAGE..(i + 1) * PAGE], 0),
            "page {i} is not zero"
        );
        assert!(!file_backed(base + i * PAGE), "page {i} is still merged");
    }
    for i in n + n / 2..3 * n {
        let want = ((i - n) % n + 1) as u64;
        assert!(check(&mem[i * PAGE..(i + 1) * PAGE], want), "page {i}");
    }
    // Still watched: equal to a copy again, merged again.
    let again = n + 2;
    fill(&mut mem[again * PAGE..(again + 1) * PAGE], 3);
    wait_for(&e, |s| s.pages_sharing > n as u64 / 2);
    assert!(check(
        &r.as_mut_slice()[again * PAGE..(again + 1) * PAGE],
        3
    ));
    assert!(
        file_backed(base + again * PAGE),
        "the page did not merge again"
    );
}

/// After unregister the range is plain anonymous memory again: no mapping of the store is left,
/// and discarding a page gives zeros (not a stable copy's bytes).
#[test]
fn unregister_gives_back_anonymous_memory() {
    unregister_gives_back_anonymous_memory_on(false);
}

/// The same on a kernel from 6.8 to 6.16 (Ubuntu 24.04 LTS runs 6.8), where unregistering a range
/// from the main context also dropped the store mappings' context's registration there: forced
/// here by dropping it before unregistering.
#[test]
fn unregister_gives_back_anonymous_memory_where_the_kernel_drops_the_other_registration() {
    unregister_gives_back_anonymous_memory_on(true);
}

fn unregister_gives_back_anonymous_memory_on(older_kernel: bool) {
    let _g = serial();
    let e = engine(WatchMode::Auto);
    let n = 256;
    let mut r = e.alloc_region(2 * n * PAGE).unwrap();
    for (i, p) in r.as_mut_slice().chunks_mut(PAGE).enumerate() {
        fill(p, (i % n) as u64 + 1);
    }
    let s = wait_for(&e, |s| s.pages_sharing >= n as u64);
    assert_eq!(s.pages_sharing, n as u64, "{s:?}");
    r.as_mut_slice()[3 * PAGE] ^= 1; // one COW-broken page too
    let s = wait_for(&e, |s| s.cow_breaks >= 1);
    assert_eq!(s.cow_breaks, 1);
    let (ptr, len) = (r.as_ptr(), r.len());
    if older_kernel {
        e.drop_store_registrations(ptr, len);
    }
    e.unregister(ptr, len).unwrap();
    let (start, end) = (ptr as usize, ptr as usize + len);
    for m in sys::self_mappings().unwrap() {
        if m.end > start && m.start < end {
            assert!(
                m.is_private_anonymous_rw(),
                "a mapping is left in the range: {m:?}"
            );
        }
    }
    let mem = r.as_mut_slice();
    for (i, p) in mem.chunks(PAGE).enumerate() {
        if i != 3 {
            assert!(
                check(p, (i % n) as u64 + 1),
                "page {i} changed by unregister"
            );
        }
    }
    // SAFETY: discarding one page of the test's own region; no reference into it is live.
    unsafe { sys::madvise(ptr.add(5 * PAGE), PAGE, libc::MADV_DONTNEED).unwrap() };
    let mem = r.as_mut_slice();
    assert!(
        mem[5 * PAGE..6 * PAGE].iter().all(|&b| b == 0),
        "a discarded page is not zero"
    );
}

/// A page that matched nothing waits in the first-sighting map without being re-read; a
/// duplicate written much later still finds it.
#[test]
fn late_duplicate_finds_a_waiting_unique_page() {
    let _g = serial();
    let e = engine(WatchMode::Auto);
    let mut r = e.alloc_region(8 * PAGE).unwrap();
    fill(&mut r.as_mut_slice()[..PAGE], 777);
    let s = wait_for(&e, |s| s.pages_unshared >= 1 && s.full_scans >= 6);
    assert_eq!(s.pages_unshared, 1, "{s:?}");
    assert_eq!(s.pages_sharing, 0);
    fill(&mut r.as_mut_slice()[5 * PAGE..6 * PAGE], 777);
    let s = wait_for(&e, |s| s.pages_sharing >= 1);
    assert_eq!((s.pages_shared, s.pages_sharing), (1, 1), "{s:?}");
    assert!(check(&r.as_slice()[..PAGE], 777) && check(&r.as_slice()[5 * PAGE..6 * PAGE], 777));
}

/// Transparent huge pages: duplicates inside huge pages merge, and a huge page with nothing to
/// merge stays huge.
#[test]
fn huge_pages_merge_inside_and_unique_ones_stay_huge() {
    let _g = serial();
    const HUGE: usize = 2 << 20;
    let raw = sys::mmap_anonymous(4 * HUGE).unwrap() as usize;
    let base = (raw + HUGE - 1) & !(HUGE - 1); // three aligned huge pages inside
                                               // SAFETY: the range lies inside the mapping made above, which this test owns.
    unsafe { sys::madvise(base as *mut u8, 3 * HUGE, libc::MADV_HUGEPAGE).unwrap() };
    // SAFETY: as above; nothing else references the mapping.
    let mem = unsafe { std::slice::from_raw_parts_mut(base as *mut u8, 3 * HUGE) };
    let per = HUGE / PAGE;
    // Huge page 0 and 2 hold the same 512 contents; huge page 1 holds unique ones.
    let content = |i: usize| match i / per {
        1 => (i + 100_000) as u64,
        _ => (i % per) as u64 + 1,
    };
    for (i, p) in mem.chunks_mut(PAGE).enumerate() {
        fill(p, content(i));
    }
    let huge_pages = |start: usize, len: usize| -> usize {
        let pm = sys::Pagemap::open().unwrap();
        pm.count_pages(start, len / PAGE, sys::uapi::PAGE_IS_HUGE)
            .unwrap()
    };
    if huge_pages(base, 3 * HUGE) < 3 * per {
        eprintln!("skipped: transparent huge pages are not available here");
        // SAFETY: unmapping the test's own mapping; `mem` is not used after this.
        unsafe { sys::munmap(raw as *mut u8, 4 * HUGE).unwrap() };
        return;
    }
    let e = engine(WatchMode::Auto);
    e.register(base as *mut u8, 3 * HUGE).unwrap();
    let s = wait_for(&e, |s| s.pages_sharing >= per as u64);
    assert_eq!(s.pages_sharing, per as u64, "{s:?}");
    for (i, p) in mem.chunks(PAGE).enumerate() {
        assert!(check(p, content(i)), "page {i} changed");
    }
    assert_eq!(
        huge_pages(base + HUGE, HUGE),
        per,
        "the huge page with nothing to merge was split"
    );
    e.unregister(base as *mut u8, 3 * HUGE).unwrap();
    for (i, p) in mem.chunks(PAGE).enumerate() {
        assert!(check(p, content(i)), "page {i} changed by unmerging");
    }
    // SAFETY: unmapping the test's own mapping; `mem` is not used after this.
    unsafe { sys::munmap(raw as *mut u8, 4 * HUGE).unwrap() };
}

#[test]
fn max_sharing_limits_pages_per_copy() {
    let _g = serial();
    let e = Engine::builder()
        .merge_period(Duration::from_millis(20))
        .max_sharing(4)
        .build()
        .unwrap();
    // Filled before registering, so all 64 pages are due in the same period (filling a
    // registered region can straddle a scan, and then the pages come in two groups, each split
    // by the limit on its own: correct, but not the one pass this test is about).
    let len = 64 * PAGE;
    let raw = sys::mmap_anonymous(len).unwrap();
    // SAFETY: a fresh private mapping of `len` bytes used only through this slice until it is
    // unmapped below.
    let r = unsafe { std::slice::from_raw_parts_mut(raw, len) };
    for p in r.chunks_mut(PAGE) {
        fill(p, 42);
    }
    let start = e.stats().full_scans;
    e.register(raw, len).unwrap();
    let s = wait_for(&e, |s| s.pages_sharing + s.pages_shared >= 64);
    // In one pass (the periods to become candidates, then one commit): the 64 pages are split
    // into groups of 4 with a copy each, not merged 4 at a time as copies fill up (which took
    // 153 periods). The margin is for slow debug builds: the fill is seen as writes, and a
    // period that starts late still counts once.
    assert!(
        s.full_scans - start <= 10,
        "took {} periods: {s:?}",
        s.full_scans - start
    );
    assert_eq!(
        s.pages_shared, 16,
        "64 identical pages at most 4 per copy: {s:?}"
    );
    assert_eq!(s.pages_sharing, 48, "{s:?}");
    assert!(r.chunks(PAGE).all(|p| check(p, 42)));
    e.unregister(raw, len).unwrap();
    // SAFETY: nothing refers to the mapping any more (the slice is not used after this).
    unsafe { sys::munmap(raw, len).unwrap() };
}

/// A run of equal pages larger than one copy may serve (a guest's memory filled with one poison
/// pattern) takes its copies in turn, side by side in the store: one mapping serves as many
/// consecutive pages as there are copies, instead of one mapping per page.
#[test]
fn a_long_run_of_equal_pages_maps_its_copies_a_stripe_at_a_time() {
    // 8 copies of 256 pages side by side: a mapping per 8 pages (one per page when each copy
    // served a chunk of 256 pages in a row).
    contents_in_turn_map_their_copies_in_turn(2048, 1, 256);
}

/// Contents in turn (page `i` holds content `i % 2`), each beyond what one copy may serve:
/// pages in address order take `a0, b0, a1, b1, ...`, laid out in that order.
#[test]
fn contents_in_turn_beyond_the_sharing_limit_map_their_copies_in_turn() {
    // 2 contents of 1024 pages, 4 copies each: a mapping per 8 pages (one per 2 pages when
    // copies were laid out by chunk leader, one per page when by content).
    contents_in_turn_map_their_copies_in_turn(2048, 2, 256);
}

/// Many contents in turn, each with more pages than a batch takes whole contents of: they are
/// batched together by address (bulk contents), so their copies are laid out in turn too.
#[test]
fn many_contents_in_turn_map_their_copies_in_turn() {
    // 16 contents of 1024 pages, 4 copies each: a mapping per 64 pages (one per 4 pages when
    // each batch held 4 whole contents).
    contents_in_turn_map_their_copies_in_turn(16384, 16, 256);
}

/// `n` pages whose page `i` holds content `i % distinct`, under a sharing limit of `cap` pages
/// per copy: merged with as few copies as the limit needs, and one mapping of the store per
/// copies' worth of consecutive pages (plus one).
fn contents_in_turn_map_their_copies_in_turn(n: usize, distinct: usize, cap: usize) {
    let _g = serial();
    let e = Engine::builder()
        .merge_period(Duration::from_millis(20))
        .max_sharing(cap as u32)
        .build()
        .unwrap();
    let content = |i: usize| 0xcc + (i % distinct) as u64;
    let mem = common::filled(n, content);
    e.register(mem.as_mut_ptr(), mem.len()).unwrap();
    let s = wait_for(&e, |s| s.pages_sharing + s.pages_shared >= n as u64);
    let copies = n / cap;
    assert_eq!(s.pages_shared, copies as u64, "{s:?}");
    assert_eq!(s.pages_sharing, (n - copies) as u64, "{s:?}");
    let start = mem.as_ptr() as usize;
    let maps = sys::self_mappings_in(start, start + mem.len()).unwrap();
    let stored = maps
        .iter()
        .filter(|m| pageone_engine::is_store_mapping(m))
        .count();
    assert!(
        stored <= n / copies + 1,
        "{stored} mappings of the store for {n} pages on {copies} copies"
    );
    assert!(mem
        .chunks(PAGE)
        .enumerate()
        .all(|(i, p)| check(p, content(i))));
    e.unregister(mem.as_mut_ptr(), mem.len()).unwrap();
    assert!(mem
        .chunks(PAGE)
        .enumerate()
        .all(|(i, p)| check(p, content(i))));
}

#[test]
fn memory_is_really_saved_by_pss() {
    let _g = serial();
    // Periods run only when kicked, so nothing merges before the first measurement.
    let e = Engine::builder()
        .merge_period(Duration::from_secs(3600))
        .build()
        .unwrap();
    e.wait_periods(1, Duration::from_secs(10));
    let n = 8192; // 32 MiB of distinct pages, four copies
    let mut r = e.alloc_region(4 * n * PAGE).unwrap();
    for (i, p) in r.as_mut_slice().chunks_mut(PAGE).enumerate() {
        fill(p, (i % n) as u64 + 1);
    }
    let before = sys::self_smaps_rollup_kib("Pss").unwrap();
    let s = wait_for(&e, |s| s.pages_sharing >= 3 * n as u64);
    let after = sys::self_smaps_rollup_kib("Pss").unwrap();
    let theoretical = (3 * n * PAGE / 1024) as u64;
    let saved = before.saturating_sub(after);
    eprintln!(
        "Pss before {before} KiB, after {after} KiB, saved {saved} of {theoretical} KiB; {s:?}"
    );
    assert!(
        saved * 100 >= theoretical * 95,
        "saved {saved} KiB, less than 95% of {theoretical} KiB"
    );
    for (i, p) in r.as_slice().chunks(PAGE).enumerate() {
        assert!(check(p, (i % n) as u64 + 1));
    }
}

#[test]
fn bad_input_is_rejected_and_changes_nothing() {
    let _g = serial();
    let e = engine(WatchMode::Auto);
    let r = e.alloc_region(4 * PAGE).unwrap();
    let p = r.as_ptr();
    // Unaligned, empty, overlapping, not registered.
    // SAFETY: pointer arithmetic inside the region for error cases; nothing is dereferenced.
    let inside = unsafe { p.add(1) };
    assert!(matches!(
        e.register(inside, PAGE),
        Err(EngineError::Unaligned { .. })
    ));
    assert!(matches!(
        e.register(p, 0),
        Err(EngineError::Unaligned { .. })
    ));
    assert!(matches!(
        e.register(p, PAGE),
        Err(EngineError::Overlap { .. })
    ));
    let other = sys::mmap_anonymous(PAGE).unwrap();
    assert!(matches!(
        e.unregister(other, PAGE),
        Err(EngineError::NotRegistered { .. })
    ));
    // A file mapping is not anonymous memory.
    let fd = sys::memfd_create(c"t").unwrap();
    sys::ftruncate(std::os::fd::AsRawFd::as_raw_fd(&fd), PAGE as u64).unwrap();
    let f = sys::mmap_shared(std::os::fd::AsRawFd::as_raw_fd(&fd), PAGE, 0).unwrap();
    assert!(matches!(
        e.register(f, PAGE),
        Err(EngineError::NotAnonymous { .. })
    ));
    // Unmapped memory is not either.
    // SAFETY: `other` was mapped above and is not referenced.
    unsafe { sys::munmap(other, PAGE).unwrap() };
    assert!(matches!(
        e.register(other, PAGE),
        Err(EngineError::NotAnonymous { .. })
    ));
    // Memory the engine uses itself is never registered, while it is kept apart.
    let own = sys::mmap_anonymous(2 * PAGE).unwrap();
    let kept = pageone_engine::keep_apart(own as usize + PAGE..own as usize + 2 * PAGE).unwrap();
    assert!(matches!(
        e.register(own, 2 * PAGE),
        Err(EngineError::EngineMemory { .. })
    ));
    assert!(matches!(
        e.merge(own, 2 * PAGE),
        Err(EngineError::EngineMemory { .. })
    ));
    drop(kept);
    e.register(own, 2 * PAGE).unwrap();
    e.unregister(own, 2 * PAGE).unwrap();
    // Bad configuration.
    assert!(matches!(
        Engine::builder().workers(0).build(),
        Err(EngineError::Config(_))
    ));
    assert!(e.reconfigure(|c| c.merge_periods = 0).is_err());
    assert_eq!(e.config().merge_periods, 2);
    assert_eq!(e.stats().registered_bytes, 4 * PAGE as u64);
    // SAFETY: `own` was mapped above, unregistered, and is not referenced.
    unsafe { sys::munmap(own, 2 * PAGE).unwrap() };
}

/// Several writer threads keep writing pages (each owns a disjoint set and keeps a shadow of what
/// it wrote) while the engine merges continuously; no write may be lost and merges must happen.
#[test]
#[cfg_attr(debug_assertions, ignore = "stress test: run with --release")]
fn no_lost_write_under_concurrent_writers() {
    let _g = serial();
    lost_write_stress(false, stress_secs(30));
}

/// The same on memory advised `MADV_HUGEPAGE` (2 MiB-aligned), for a few seconds: writes, merges
/// and copy-on-write breaks inside huge pages, split by the kernel as they come.
#[test]
fn no_lost_write_under_concurrent_writers_on_huge_pages() {
    let _g = serial();
    lost_write_stress(true, stress_secs(4));
}

/// `PAGEONE_STRESS_SECS`, else `default`.
fn stress_secs(default: u64) -> u64 {
    std::env::var("PAGEONE_STRESS_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

/// The stress test of [`no_lost_write_under_concurrent_writers`], `secs` long, on memory advised
/// `MADV_HUGEPAGE` with `huge`.
fn lost_write_stress(huge: bool, secs: u64) {
    const HUGE: usize = 2 << 20;
    let e = Engine::builder()
        .merge_period(Duration::from_millis(10))
        .merge_periods(1)
        .build()
        .unwrap();
    let writers = 4;
    let n = 16384;
    let raw = sys::mmap_anonymous(n * PAGE + HUGE).unwrap();
    let base = if huge {
        (raw as usize + HUGE - 1) & !(HUGE - 1)
    } else {
        raw as usize
    };
    if huge {
        // SAFETY: inside the mapping made above, which only this test uses.
        unsafe { sys::madvise(base as *mut u8, n * PAGE, libc::MADV_HUGEPAGE) }.unwrap();
    } else {
        e.register(base as *mut u8, n * PAGE).unwrap();
    }
    // A few contents only, so that pages keep becoming duplicates (and zero) as they are written.
    let write = |page: usize, c: u64| {
        let p = (base + page * PAGE) as *mut u64;
        for w in 0..PAGE / 8 {
            let v = if c == 0 {
                0
            } else {
                c.wrapping_mul(w as u64 + 1)
            };
            // SAFETY: the page is inside the region and owned by this writer thread.
            unsafe { std::ptr::write_volatile(p.add(w), v) };
        }
    };
    let read_ok = |page: usize, c: u64| {
        let p = (base + page * PAGE) as *const u64;
        (0..PAGE / 8).all(|w| {
            let v = if c == 0 {
                0
            } else {
                c.wrapping_mul(w as u64 + 1)
            };
            // SAFETY: as above.
            unsafe { std::ptr::read_volatile(p.add(w)) == v }
        })
    };
    for page in 0..n {
        write(page, (page % 8) as u64);
    }
    if huge {
        // Written first, on huge pages wherever the kernel has them, then registered.
        let pm = sys::Pagemap::open().unwrap();
        let on_huge = pm.count_pages(base, n, sys::uapi::PAGE_IS_HUGE).unwrap();
        eprintln!("{on_huge} of {n} pages on huge pages at registration");
        e.register(base as *mut u8, n * PAGE).unwrap();
    }
    let stop = AtomicBool::new(false);
    let lost = std::sync::atomic::AtomicU64::new(0);
    let writes = std::sync::atomic::AtomicU64::new(0);
    std::thread::scope(|s| {
        for t in 0..writers {
            let (stop, lost, writes) = (&stop, &lost, &writes);
            s.spawn(move || {
                let mut shadow: Vec<u64> = (0..n).map(|p| (p % 8) as u64).collect();
                let mut x: u64 = 0x9E37_79B9_7F4A_7C15 ^ t as u64;
                let mut next = || {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x
                };
                while !stop.load(Ordering::Relaxed) {
                    for _ in 0..32 {
                        let page = (next() as usize % (n / writers)) * writers + t;
                        if !read_ok(page, shadow[page]) {
                            lost.fetch_add(1, Ordering::Relaxed);
                        }
                        let c = next() % 8;
                        write(page, c);
                        shadow[page] = c;
                        // Single-word writes too: the smallest write must survive as well.
                        writes.fetch_add(1, Ordering::Relaxed);
                    }
                    std::thread::sleep(Duration::from_micros(500));
                }
                for (page, &c) in shadow.iter().enumerate() {
                    if page % writers == t && !read_ok(page, c) {
                        lost.fetch_add(1, Ordering::Relaxed);
                    }
                }
            });
        }
        std::thread::sleep(Duration::from_secs(secs));
        stop.store(true, Ordering::Relaxed);
    });
    let s = e.stats();
    eprintln!("{} writes; {s:?}", writes.load(Ordering::Relaxed));
    assert_eq!(lost.load(Ordering::Relaxed), 0, "writes were lost");
    assert!(s.merges >= 1000, "too few merges to prove anything: {s:?}");
    assert!(s.cow_breaks >= 100, "merged pages were not written: {s:?}");
    assert!(s.zero_pages > 0 || s.merges > 0);
    e.unregister(base as *mut u8, n * PAGE).unwrap();
    assert_eq!(e.stable_pages(), 0);
    // SAFETY: unregistered above; the writers are done and nothing refers to the mapping.
    unsafe { sys::munmap(raw, n * PAGE + HUGE) }.unwrap();
}

/// Pages merge only after staying unchanged for `merge_periods` whole periods counted from when
/// they were registered, however registration falls between the engine's scans (without kicks).
#[test]
fn pages_merge_after_two_whole_periods_from_registration() {
    let _g = serial();
    let period = Duration::from_millis(600);
    let e = Engine::builder()
        .merge_period(period)
        .build()
        .expect("the engine starts on this kernel");
    // Land the registration a third into a period.
    std::thread::sleep(Duration::from_millis(200));
    let n = 64;
    let len = 2 * n * PAGE;
    let p = sys::mmap_anonymous(len).unwrap();
    // SAFETY: a fresh private mapping owned by this test.
    let buf = unsafe { std::slice::from_raw_parts_mut(p, len) };
    for (i, page) in buf.chunks_mut(PAGE).enumerate() {
        fill(page, (i % n) as u64 + 1);
    }
    let t0 = std::time::Instant::now();
    e.register(p, len).unwrap();
    let mut first_merge = None;
    while t0.elapsed() < 10 * period {
        if e.stats().merges > 0 {
            first_merge = Some(t0.elapsed());
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let at = first_merge.expect("the duplicates merged");
    assert!(
        at >= 2 * period,
        "merged {at:?} after registering, before two whole periods ({:?})",
        2 * period
    );
    // The next scan waits until a period after the registration, so it counts: the merge comes
    // after two periods, not after the scan a third of a period later and two more (2.67).
    assert!(
        at < 2 * period + period / 2,
        "merged {at:?} after registering: the period schedule did not follow the registration"
    );
    for (i, page) in buf.chunks(PAGE).enumerate() {
        assert!(check(page, (i % n) as u64 + 1), "page {i}");
    }
    e.unregister(p, len).unwrap();
    // SAFETY: unregistered above; nothing refers to the mapping.
    unsafe { sys::munmap(p, len) }.unwrap();
}

/// Once nothing changes, the engine scans less often; a write after that is still seen (the
/// write-protection is armed whatever the scan rate), and the page merges again.
#[test]
fn settled_memory_is_scanned_less_and_writes_are_still_seen() {
    let _g = serial();
    let e = engine(WatchMode::Auto);
    let n = 32;
    let mut r = merged_halves(&e, n);
    // Settle: 8 quiet periods, then scans every 2, 4, 8 periods (20 ms each).
    std::thread::sleep(Duration::from_millis(1500));
    let s0 = e.stats().full_scans;
    std::thread::sleep(Duration::from_secs(2));
    let scans = e.stats().full_scans - s0;
    // Every period would be ~100 scans in 2 s; every 8th is ~12. A slow machine only lowers it.
    assert!(
        scans <= 40,
        "{scans} scans in 2 s of a settled region with 20 ms periods"
    );
    break_and_restore(&e, &mut r, n, 5 * PAGE + 3);
}

/// A region whose merged pages are mappings of their own (every other page merged, the unique
/// pages between them anonymous): the unique pages are still watched for writes, and protected
/// again once seen written. Rewritten to duplicate each other, they are seen written, then
/// unchanged, and merge; a merged page written is seen as a copy-on-write break.
#[test]
fn written_pages_between_merged_runs_are_seen_and_merge() {
    let _g = serial();
    let e = engine(WatchMode::UffdWp);
    let n = 256;
    // Even pages duplicate the other half's, odd ones are unique.
    let content = |i: usize| {
        if i % 2 == 0 {
            (i % n) as u64 + 1
        } else {
            (i + 10 * n) as u64
        }
    };
    let mut r = e.alloc_region(2 * n * PAGE).unwrap();
    for (i, p) in r.as_mut_slice().chunks_mut(PAGE).enumerate() {
        fill(p, content(i));
    }
    let half = n as u64 / 2;
    // (Settled: the unique pages wait as first sightings.)
    let s = wait_for(&e, |s| {
        s.pages_sharing >= half && s.pages_unshared == n as u64
    });
    assert_eq!((s.pages_shared, s.pages_sharing), (half, half), "{s:?}");
    assert_eq!(s.pages_unshared, n as u64, "{s:?}");
    // The unique pages of the first half become copies of those of the second.
    let mem = r.as_mut_slice();
    for i in (1..n).step_by(2) {
        fill(&mut mem[i * PAGE..(i + 1) * PAGE], content(i + n));
    }
    let s = wait_for(&e, |s| s.pages_sharing >= n as u64);
    assert_eq!(
        (s.pages_shared, s.pages_sharing),
        (n as u64, n as u64),
        "the rewritten unique pages did not merge: {s:?}"
    );
    assert_eq!(s.cow_breaks, 0, "{s:?}");
    // A merged page written: its own copy again.
    let mem = r.as_mut_slice();
    mem[6 * PAGE + 1] ^= 1;
    let s = wait_for(&e, |s| s.cow_breaks >= 1);
    assert_eq!((s.cow_breaks, s.pages_sharing), (1, n as u64 - 1), "{s:?}");
    let mem = r.as_slice();
    for i in 0..2 * n {
        let want = if i % 2 == 1 && i < n {
            content(i + n)
        } else {
            content(i)
        };
        let page = &mem[i * PAGE..(i + 1) * PAGE];
        if i == 6 {
            assert_eq!(page[1], 1, "the write to the merged page");
        } else {
            assert!(check(page, want), "page {i}");
        }
    }
}

/// First touches of registered memory stay in the kernel: the engine maps the zero page over
/// what it registers and over the zero pages it releases, so no touch waits for its fault thread
/// (a round trip, 30 times the kernel's own first touch).
#[test]
fn first_touches_of_registered_and_released_memory_do_not_reach_the_engine() {
    let _g = serial();
    let e = engine(WatchMode::UffdWp);
    let n = 4096;
    let r = e.alloc_region(n * PAGE).unwrap();
    let base = r.as_ptr();
    let before = e.stats().faults_answered;
    for i in 0..n {
        // SAFETY: page i of the registered region, first touched here (half read, half written).
        unsafe {
            if i % 2 == 0 {
                std::ptr::read_volatile(base.add(i * PAGE));
            } else {
                std::ptr::write_volatile(base.add(i * PAGE), 1);
            }
        }
    }
    let touched = e.stats().faults_answered - before;
    assert!(
        touched * 100 < n as u64,
        "{touched} of {n} first touches went through the engine"
    );
    // Written pages of zeros are released as zero pages; touching them again stays in the kernel.
    for i in (1..n).step_by(2) {
        // SAFETY: as above.
        unsafe { std::ptr::write_volatile(base.add(i * PAGE), 0) };
    }
    let s = wait_for(&e, |s| s.zero_pages >= (n / 2) as u64);
    assert!(s.zero_pages >= (n / 2) as u64, "{s:?}");
    let before = e.stats().faults_answered;
    for i in 0..n {
        // SAFETY: as above.
        unsafe { std::ptr::write_volatile(base.add(i * PAGE), 2) };
    }
    let touched = e.stats().faults_answered - before;
    assert!(
        touched * 100 < n as u64,
        "{touched} of {n} touches of released pages went through the engine"
    );
    drop(r);
}

/// Memory written often and then zeroed (a program or guest freeing it so) is released one
/// period after its last write, not after the back-off its writes earned.
#[test]
fn zeroed_pages_are_released_a_period_after_their_last_write() {
    let _g = serial();
    let e = Engine::builder()
        .merge_period(Duration::from_millis(20))
        .build()
        .expect("the engine starts on this kernel");
    let n = 64;
    let mut r = e.alloc_region(n * PAGE).unwrap();
    // Written in 8 periods in a row: each page waits 8 unchanged periods before it is merged.
    for round in 0..8u64 {
        for (i, p) in r.as_mut_slice().chunks_mut(PAGE).enumerate() {
            fill(p, round * 1000 + i as u64 + 1);
        }
        e.wait_periods(1, Duration::from_secs(10));
    }
    let before = e.stats();
    assert_eq!(before.zero_pages, 0, "{before:?}");
    r.as_mut_slice().fill(0);
    let periods_before = before.full_scans;
    let s = wait_for(&e, |s| s.zero_pages >= n as u64);
    assert_eq!(s.zero_pages, n as u64, "{s:?}");
    // The write's period, one quiet period, and the commit (the merge wait would be 8).
    assert!(
        s.full_scans - periods_before <= 5,
        "released after {} periods: {s:?}",
        s.full_scans - periods_before
    );
    assert!(r.as_slice().iter().all(|&b| b == 0));
}

/// Memory that waited unchanged (unique) and is then zeroed, as a guest booted with
/// `init_on_free=1` frees its page cache, is released in the period that sees the write.
#[test]
fn unique_pages_zeroed_are_released_in_the_period_that_sees_the_write() {
    let _g = serial();
    let e = Engine::builder()
        .merge_period(Duration::from_secs(3600))
        .build()
        .expect("the engine starts on this kernel");
    let n = 64;
    let mut r = e.alloc_region(n * PAGE).unwrap();
    for (i, p) in r.as_mut_slice().chunks_mut(PAGE).enumerate() {
        fill(p, i as u64 + 1);
    }
    let s = wait_for(&e, |s| s.pages_unshared >= n as u64);
    assert_eq!(s.pages_unshared, n as u64, "every page waits unique: {s:?}");
    r.as_mut_slice().fill(0);
    // The period that sees the writes (the one under way may have scanned before them): a page
    // that waited for a period after its write would take a third.
    assert!(e.wait_periods(2, Duration::from_secs(10)));
    let s = e.stats();
    assert_eq!(s.zero_pages, n as u64, "released at once: {s:?}");
    assert!(r.as_slice().iter().all(|&b| b == 0));
    // A write after the release is kept.
    r.as_mut_slice()[5 * PAGE + 7] = 9;
    assert!(e.wait_periods(2, Duration::from_secs(10)));
    assert_eq!(r.as_slice()[5 * PAGE + 7], 9);
    e.unregister(r.as_mut_slice().as_mut_ptr(), n * PAGE)
        .unwrap();
}

/// Merged memory that the program then zeroes (a guest freeing shared pages with
/// `init_on_free=1`: each write breaks the copy-on-write) is released as zero pages.
#[test]
fn merged_pages_zeroed_are_released() {
    let _g = serial();
    let e = Engine::builder()
        .merge_period(Duration::from_secs(3600))
        .build()
        .expect("the engine starts on this kernel");
    let n = 64;
    let mem = common::filled(2 * n, |i| (i % n) as u64 + 1);
    e.register(mem.as_mut_ptr(), mem.len()).unwrap();
    let s = wait_for(&e, |s| s.pages_sharing >= n as u64);
    assert_eq!(s.pages_sharing, n as u64, "{s:?}");
    let zero_before = s.zero_pages;
    mem.fill(0);
    let s = wait_for(&e, |s| s.zero_pages >= zero_before + 2 * n as u64);
    assert_eq!(s.zero_pages, zero_before + 2 * n as u64, "{s:?}");
    if e.watch_mode() == WatchMode::UffdWp {
        // Measured by the kernel: no page holds memory (each is empty, or maps the shared zero
        // page once read).
        let pm = sys::Pagemap::open().unwrap();
        let start = mem.as_ptr() as usize;
        let present = pm
            .pages_with(start, 2 * n, sys::uapi::PAGE_IS_PRESENT)
            .unwrap();
        let zero = pm
            .pages_with(start, 2 * n, sys::uapi::PAGE_IS_PFNZERO)
            .unwrap();
        assert!(
            present.iter().zip(&zero).all(|(&p, &z)| !p || z),
            "{present:?} {zero:?}"
        );
    }
    assert!(mem.iter().all(|&b| b == 0));
    // Writes after the release are kept, and the pages are watched as before.
    mem[3 * PAGE + 5] = 7;
    fill(&mut mem[10 * PAGE..11 * PAGE], 99);
    assert!(e.wait_periods(3, Duration::from_secs(10)));
    assert_eq!(mem[3 * PAGE + 5], 7);
    assert!(check(&mem[10 * PAGE..11 * PAGE], 99));
    e.unregister(mem.as_mut_ptr(), mem.len()).unwrap();
    assert_eq!(mem[3 * PAGE + 5], 7);
    assert!(check(&mem[10 * PAGE..11 * PAGE], 99));
}

/// A writer racing the release of zeroed merged pages never loses a write: each page ends with
/// the last value written to it (values and zeros, so that pages keep becoming zero again).
#[test]
fn writes_racing_the_release_of_zeroed_merged_pages_are_kept() {
    let _g = serial();
    let e = Engine::builder()
        .merge_period(Duration::from_millis(2))
        .build()
        .expect("the engine starts on this kernel");
    let n = 256;
    let mem = common::filled(2 * n, |i| (i % n) as u64 + 1);
    e.register(mem.as_mut_ptr(), mem.len()).unwrap();
    let base = mem.as_mut_ptr() as usize;
    let mut released = 0;
    for round in 0..4u64 {
        for (i, p) in mem.chunks_mut(PAGE).enumerate() {
            fill(p, (i % n) as u64 + 1);
        }
        // They merge again (all of them within 125 ms in each round of 12 runs measured; half
        // is asked for: two copy-on-write broken twins meet only as candidates of one period,
        // which their back-offs bring about within 16 periods, see `watch::on_beat`).
        let s = wait_for(&e, |s| s.pages_sharing >= n as u64 / 2);
        assert!(s.pages_sharing >= n as u64 / 2, "round {round}: {s:?}");
        // Every merged page written: a private copy of zeros in a mapping of the store.
        mem.fill(0);
        let zero_before = e.stats().zero_pages;
        let stop = AtomicBool::new(false);
        let last = std::thread::scope(|t| {
            let writer = t.spawn(|| race_writes(base, 2 * n, round, &stop));
            std::thread::sleep(Duration::from_millis(300));
            stop.store(true, Ordering::Relaxed);
            writer.join().unwrap()
        });
        for (i, &want) in last.iter().enumerate() {
            // SAFETY: a page of the test's region; the writer has finished.
            let got = unsafe { std::ptr::read_volatile((base + i * PAGE + 8) as *const u64) };
            assert_eq!(
                got,
                want,
                "round {round}: page {i} lost a write: {:?}",
                e.stats()
            );
        }
        released += e.stats().zero_pages.saturating_sub(zero_before);
    }
    assert!(released > 0, "no zeroed page was released: {:?}", e.stats());
    e.unregister(mem.as_mut_ptr(), mem.len()).unwrap();
}

/// Writes a value or zero to word 1 of random pages of `[base, base + pages * PAGE)` until
/// `stop`; returns the last value written to each page (0 where none was).
fn race_writes(base: usize, pages: usize, seed: u64, stop: &AtomicBool) -> Vec<u64> {
    let mut last = vec![0u64; pages];
    let mut x = seed * 1_000_003 + 17;
    let mut v = 0u64;
    while !stop.load(Ordering::Relaxed) {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let page = (x >> 33) as usize % pages;
        v += 1;
        let value = if v % 2 == 0 { 0 } else { v };
        // SAFETY: a page of the test's region, written by this thread alone meanwhile.
        unsafe { std::ptr::write_volatile((base + page * PAGE + 8) as *mut u64, value) };
        last[page] = value;
        if v % 32 == 0 {
            std::thread::sleep(Duration::from_micros(500));
        }
    }
    last
}

/// Merged pages are mapped as they merge: store mappings are registered for minor faults (so that
/// a page dropped behind the engine's back reads zeros), which turns the kernel's fault-around
/// off, so the engine maps their page table entries itself. Reading every merged page then waits
/// for nothing.
#[test]
fn merged_pages_are_mapped_as_they_merge() {
    let _g = serial();
    let e = engine(WatchMode::Auto);
    let n = 256;
    let mem = common::filled(2 * n, |i| (i % n) as u64 + 1);
    e.register(mem.as_mut_ptr(), mem.len()).unwrap();
    let s = wait_for(&e, |s| s.pages_sharing >= n as u64);
    assert_eq!(s.pages_sharing, n as u64, "{s:?}");
    let base = mem.as_ptr() as usize;
    let mapped = (0..2 * n).filter(|&i| file_backed(base + i * PAGE)).count();
    assert_eq!(mapped, 2 * n, "merged pages without a page table entry");
    let faults = e.stats().faults_answered;
    for (i, page) in mem.chunks(PAGE).enumerate() {
        assert!(check(page, (i % n) as u64 + 1), "page {i} changed");
    }
    assert_eq!(
        e.stats().faults_answered,
        faults,
        "a read waited for the engine"
    );
    e.unregister(mem.as_mut_ptr(), mem.len()).unwrap();
    for (i, page) in mem.chunks(PAGE).enumerate() {
        assert!(
            check(page, (i % n) as u64 + 1),
            "page {i} changed by unmerging"
        );
    }
}

/// A merged page written keeps its place in the store's mapping (a private copy there); dropped
/// by the program where the engine cannot see it first (a raw `madvise`), it reads the store at
/// its copy's place again. Its copy, freed when no page counts it, must not be given to other
/// bytes meanwhile: the dropped page reads zeros, never another page's bytes; once the page is
/// gone, the copy is reused.
#[test]
fn a_dropped_page_over_a_freed_copy_never_reads_another_page() {
    let _g = serial();
    // Room for two copies: a third merge must reuse a freed one.
    let e = Engine::builder()
        .merge_period(Duration::from_millis(20))
        .store_pages(2)
        .build()
        .unwrap();
    let mut a = e.alloc_region(4 * PAGE).unwrap();
    for (i, p) in a.as_mut_slice().chunks_mut(PAGE).enumerate() {
        fill(p, 1 + i as u64 / 2);
    }
    let s = wait_for(&e, |s| s.pages_sharing >= 2);
    assert_eq!((s.pages_shared, s.pages_sharing), (2, 2), "{s:?}");
    // Both pages of the first copy written: it is freed.
    fill(&mut a.as_mut_slice()[..PAGE], 50);
    fill(&mut a.as_mut_slice()[PAGE..2 * PAGE], 51);
    let s = wait_for(&e, |s| s.cow_breaks >= 2);
    assert_eq!(s.pages_shared, 1, "{s:?}");
    let mut b = e.alloc_region(2 * PAGE).unwrap();
    for p in b.as_mut_slice().chunks_mut(PAGE) {
        fill(p, 3);
    }
    // Long enough for the freed copy to be reused, were it not held.
    e.wait_periods(25, Duration::from_secs(10));
    // SAFETY: a page of the test's own region; no reference into it is live.
    unsafe { sys::madvise(a.as_ptr(), PAGE, libc::MADV_DONTNEED) }.unwrap();
    assert!(
        check(&a.as_mut_slice()[..PAGE], 0),
        "a dropped page read other bytes"
    );
    assert!(check(&a.as_mut_slice()[PAGE..2 * PAGE], 51));
    assert!(b.as_mut_slice().chunks(PAGE).all(|p| check(p, 3)));
    let s = e.stats();
    assert_eq!((s.copies_held, s.pages_sharing), (1, 1), "{s:?}");
    // The pages over the copy gone, it is reused.
    drop(a);
    let s = wait_for(&e, |s| s.pages_sharing >= 1 && s.copies_held == 0);
    assert_eq!((s.pages_sharing, s.copies_held), (1, 0), "{s:?}");
    assert!(b.as_mut_slice().chunks(PAGE).all(|p| check(p, 3)));
}

/// Merged pages, and a page written since its merge, dropped where the engine cannot see it first
/// (a raw `madvise`, as the C library's own calls are): they read zeros at once, as anonymous
/// memory does, never their copies; every other page keeps its bytes and stays merged; the
/// copies are no longer counted for them; written, they keep the bytes; equal to a copy again,
/// they merge again.
/// A merged page dropped behind the engine's back the moment its copy appears over it (were the
/// copies mapped in place, before the engine could register their mapping, which then reported
/// nothing) reads zeros. A thread watches the page's mapping and drops the page as soon as it
/// is a mapping of the store, in several rounds.
#[test]
fn merged_page_dropped_as_its_copy_appears_reads_zeros() {
    merged_page_dropped_as_its_copy_appears(false);
}

/// The same, with each mapping of copies staged on its own (where the staging area cannot be
/// made).
#[test]
fn merged_page_dropped_as_its_copy_appears_reads_zeros_staged_apart() {
    merged_page_dropped_as_its_copy_appears(true);
}

fn merged_page_dropped_as_its_copy_appears(stage_each_mapping: bool) {
    let _g = serial();
    let e = Engine::builder()
        .merge_period(Duration::from_millis(20))
        .stage_each_mapping(stage_each_mapping)
        .build()
        .expect("the engine starts on this kernel");
    let n = 32;
    let maps = sys::Maps::open().unwrap();
    let (mut dropped, mut rounds) = (0, 0);
    while dropped < 12 && rounds < 48 {
        rounds += 1;
        let mut r = e.alloc_region(2 * n * PAGE).unwrap();
        let base = r.as_ptr() as usize;
        let target = n + rounds % n;
        let at = base + target * PAGE;
        let hit = std::thread::scope(|s| {
            let watcher = s.spawn(|| {
                let deadline = std::time::Instant::now() + Duration::from_secs(10);
                while std::time::Instant::now() < deadline {
                    let m = maps.in_range(at, at + PAGE).unwrap();
                    if m.first().is_some_and(|m| m.start <= at && m.inode != 0) {
                        // SAFETY: a page of the test's own region; no reference into it is
                        // live (the filling thread is done with it).
                        unsafe { sys::madvise(at as *mut u8, PAGE, libc::MADV_DONTNEED) }.unwrap();
                        return true;
                    }
                }
                false
            });
            for (i, p) in r.as_mut_slice().chunks_mut(PAGE).enumerate() {
                fill(p, (i % n) as u64 + 1);
            }
            watcher.join().unwrap()
        });
        if !hit {
            continue;
        }
        dropped += 1;
        e.wait_periods(4, Duration::from_secs(10));
        for (i, page) in r.as_slice().chunks(PAGE).enumerate() {
            let want = if i == target { 0 } else { (i % n) as u64 + 1 };
            assert!(
                check(page, want),
                "round {rounds}: page {i} reads wrong bytes (page {target} was dropped)"
            );
        }
    }
    assert!(
        dropped >= 6,
        "only {dropped} pages were dropped in {rounds} rounds"
    );
}

#[test]
fn merged_pages_dropped_unseen_read_zeros() {
    let _g = serial();
    let e = engine(WatchMode::Auto);
    let n = 64;
    let mut r = merged_halves(&e, n);
    let (ptr, base) = (r.as_ptr(), r.as_ptr() as usize);
    let drop_unseen = |first: usize, pages: usize| {
        // SAFETY: pages of the test's own region; no reference into it is live.
        unsafe {
            sys::madvise(
                ptr.wrapping_add(first * PAGE),
                pages * PAGE,
                libc::MADV_DONTNEED,
            )
        }
        .unwrap();
    };
    // One page, then several, then a page written since its merge.
    drop_unseen(5, 1);
    assert!(
        check(&r.as_slice()[5 * PAGE..6 * PAGE], 0),
        "page 5 read its copy"
    );
    drop_unseen(20, 4);
    assert!(
        r.as_slice()[20 * PAGE..24 * PAGE].iter().all(|&b| b == 0),
        "pages 20..24 read their copies"
    );
    r.as_mut_slice()[40 * PAGE + 7] ^= 0xFF;
    wait_for(&e, |s| s.cow_breaks >= 1);
    drop_unseen(40, 1);
    assert!(
        check(&r.as_slice()[40 * PAGE..41 * PAGE], 0),
        "page 40 read its copy"
    );
    let dropped = [5, 20, 21, 22, 23, 40];
    let s = wait_for(&e, |s| s.pages_sharing <= n as u64 - 6);
    assert_eq!(s.pages_sharing, n as u64 - 6, "{s:?}");
    e.wait_periods(3, Duration::from_secs(10));
    for (i, page) in r.as_slice().chunks(PAGE).enumerate() {
        let want = if dropped.contains(&i) {
            0
        } else {
            (i % n) as u64 + 1
        };
        assert!(check(page, want), "page {i} reads wrong bytes");
        if !dropped.contains(&i) && i != 40 + n {
            assert!(
                in_store_mapping(base + i * PAGE),
                "page {i} is no longer merged"
            );
        }
    }
    // Dropped again once filled: still zeros.
    drop_unseen(5, 1);
    assert!(
        check(&r.as_slice()[5 * PAGE..6 * PAGE], 0),
        "page 5 read its copy"
    );
    // Written after the drop: kept; equal to its twin again: merged again.
    fill(&mut r.as_mut_slice()[20 * PAGE..21 * PAGE], 1000);
    fill(&mut r.as_mut_slice()[5 * PAGE..6 * PAGE], 6);
    e.wait_periods(3, Duration::from_secs(10));
    assert!(
        check(&r.as_slice()[20 * PAGE..21 * PAGE], 1000),
        "a write was lost"
    );
    let s = wait_for(&e, |s| s.pages_sharing >= n as u64 - 5);
    assert_eq!(s.pages_sharing, n as u64 - 5, "{s:?}");
    assert!(check(&r.as_slice()[5 * PAGE..6 * PAGE], 6));
    assert!(file_backed(base + 5 * PAGE), "the page did not merge again");
}

/// Merged pages between unmerged ones (a mapping each), dropped in one call where the engine
/// cannot see it first: every page reads zeros.
#[test]
fn scattered_merged_pages_dropped_unseen_in_one_call_read_zeros() {
    let _g = serial();
    let e = engine(WatchMode::Auto);
    let n = 64;
    // Page i of the first half equals page i of the second where i is even; odd pages are unique.
    let content = |i: usize| {
        if i % 2 == 0 {
            (i % n) as u64 + 1
        } else {
            1000 + i as u64
        }
    };
    let mut r = e.alloc_region(2 * n * PAGE).unwrap();
    for (i, p) in r.as_mut_slice().chunks_mut(PAGE).enumerate() {
        fill(p, content(i));
    }
    let s = wait_for(&e, |s| s.pages_sharing >= n as u64 / 2);
    assert_eq!(s.pages_sharing, n as u64 / 2, "{s:?}");
    let base = r.as_ptr() as usize;
    assert!(in_store_mapping(base + 2 * PAGE) && !in_store_mapping(base + 3 * PAGE));
    // SAFETY: pages of the test's own region; no reference into it is live.
    unsafe {
        sys::madvise(
            r.as_ptr().wrapping_add(PAGE),
            2 * (n - 1) * PAGE,
            libc::MADV_DONTNEED,
        )
    }
    .unwrap();
    for (i, page) in r.as_slice().chunks(PAGE).enumerate() {
        let want = if (1..2 * n - 1).contains(&i) {
            0
        } else {
            content(i)
        };
        assert!(check(page, want), "page {i} reads wrong bytes");
    }
    e.wait_periods(3, Duration::from_secs(10));
    for (i, page) in r.as_slice().chunks(PAGE).enumerate() {
        let want = if (1..2 * n - 1).contains(&i) {
            0
        } else {
            content(i)
        };
        assert!(
            check(page, want),
            "page {i} reads wrong bytes a while later"
        );
    }
}
