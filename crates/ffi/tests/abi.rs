//! The C ABI called as C would call it: NULL and malformed arguments, each engine error as its
//! status code, stats, waits.

use std::ffi::{c_void, CStr};
use std::ptr;

use pageone::*;
use pageone_status::*;

const PAGE: usize = 4096;

fn config() -> *mut pageone_config {
    let mut cfg = ptr::null_mut();
    // SAFETY: `cfg` is a valid out pointer.
    assert_eq!(unsafe { pageone_config_new(&mut cfg) }, PAGEONE_OK);
    assert!(!cfg.is_null());
    cfg
}

/// A quick engine of its own (50 ms periods, no daemon).
fn engine() -> *mut pageone_engine {
    let cfg = config();
    let mut e = ptr::null_mut();
    // SAFETY: `cfg` is live until freed below; `e` is a valid out pointer.
    unsafe {
        assert_eq!(pageone_config_set_merge_period_ms(cfg, 50), PAGEONE_OK);
        assert_eq!(pageone_config_set_daemon(cfg, ptr::null()), PAGEONE_OK);
        assert_eq!(pageone_engine_new(cfg, &mut e), PAGEONE_OK);
        pageone_config_free(cfg);
    }
    assert!(!e.is_null());
    e
}

fn mmap(len: usize, flags: i32) -> *mut c_void {
    // SAFETY: a fresh mapping chosen by the kernel.
    let p = unsafe {
        libc::mmap(
            ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            flags | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert_ne!(p, libc::MAP_FAILED);
    p
}

/// A fresh mapping of two identical halves of `n` pages each (page `i` holds bytes `i % n + 1`).
fn halves(n: usize) -> *mut u8 {
    let p = mmap(2 * n * PAGE, libc::MAP_PRIVATE).cast::<u8>();
    for i in 0..2 * n {
        // SAFETY: a page of the fresh mapping, which nothing else refers to.
        unsafe { ptr::write_bytes(p.add(i * PAGE), (i % n) as u8 + 1, PAGE) };
    }
    p
}

/// Waits (200 periods at most) until engine `e` shares `n` pages; returns whether it does.
///
/// # Safety
///
/// `e` must be a live engine.
unsafe fn merged(e: *const pageone_engine, n: usize) -> bool {
    let mut s = pageone_stats::default();
    for _ in 0..200 {
        // SAFETY: `e` is live (the contract); `s` is valid for writing.
        unsafe {
            assert_eq!(pageone_engine_wait_periods(e, 1, 5000), PAGEONE_OK);
            assert_eq!(pageone_engine_stats(e, &mut s), PAGEONE_OK);
        }
        if s.pages_sharing >= n as u64 {
            break;
        }
    }
    s.pages_sharing == n as u64
}

/// [`halves`], registered with engine `e` and merged.
fn merged_halves(e: *mut pageone_engine, n: usize) -> *mut u8 {
    let p = halves(n);
    // SAFETY: `e` is a live engine (the callers'); the mapping is the caller's.
    unsafe {
        assert_eq!(
            pageone_engine_register(e, p.cast(), 2 * n * PAGE),
            PAGEONE_OK
        );
        assert!(merged(e, n), "nothing merged");
    }
    p
}

#[test]
fn null_arguments_are_refused() {
    let e = engine();
    let cfg = config();
    let mut page = [0u8; 8];
    let p = page.as_mut_ptr().cast::<c_void>();
    // SAFETY: every pointer is NULL or live.
    unsafe {
        assert_eq!(pageone_config_new(ptr::null_mut()), PAGEONE_NULL_ARGUMENT);
        assert_eq!(
            pageone_config_set_workers(ptr::null_mut(), 1),
            PAGEONE_NULL_ARGUMENT
        );
        assert_eq!(
            pageone_config_set_ksm_when_limited(ptr::null_mut(), false),
            PAGEONE_NULL_ARGUMENT
        );
        assert_eq!(
            pageone_engine_drop_pages(e, ptr::null_mut(), 4096, libc::MADV_DONTNEED),
            PAGEONE_NULL_ARGUMENT
        );
        assert_eq!(
            pageone_config_set_scope(cfg, ptr::null()),
            PAGEONE_NULL_ARGUMENT
        );
        assert_eq!(
            pageone_engine_new(cfg, ptr::null_mut()),
            PAGEONE_NULL_ARGUMENT
        );
        assert_eq!(
            pageone_engine_register(ptr::null(), p, PAGE),
            PAGEONE_NULL_ARGUMENT
        );
        assert_eq!(
            pageone_engine_register(e, ptr::null_mut(), PAGE),
            PAGEONE_NULL_ARGUMENT
        );
        assert_eq!(
            pageone_engine_unregister(ptr::null(), p, PAGE),
            PAGEONE_NULL_ARGUMENT
        );
        assert_eq!(
            pageone_engine_stats(ptr::null(), &mut pageone_stats::default()),
            PAGEONE_NULL_ARGUMENT
        );
        assert_eq!(
            pageone_engine_stats(e, ptr::null_mut()),
            PAGEONE_NULL_ARGUMENT
        );
        assert_eq!(
            pageone_engine_wait_periods(ptr::null(), 1, 10),
            PAGEONE_NULL_ARGUMENT
        );
        assert_eq!(pageone_engine_kick(ptr::null()), PAGEONE_NULL_ARGUMENT);
        pageone_engine_free(ptr::null_mut());
        pageone_config_free(ptr::null_mut());
        pageone_config_free(cfg);
        pageone_engine_free(e);
    }
}

#[test]
fn malformed_arguments_are_refused() {
    let cfg = config();
    // SAFETY: `cfg` is live until freed; the strings are NUL-terminated.
    unsafe {
        assert_eq!(pageone_config_set_watch(cfg, 7), PAGEONE_INVALID_ARGUMENT);
        assert_eq!(
            pageone_config_set_watch(cfg, pageone_watch_mode::PAGEONE_WATCH_CHECKSUM as u32),
            PAGEONE_OK
        );
        let not_utf8 = b"sc\xffope\0";
        assert_eq!(
            pageone_config_set_scope(cfg, not_utf8.as_ptr().cast()),
            PAGEONE_INVALID_ARGUMENT
        );
        assert_eq!(pageone_config_set_scope(cfg, c"vms".as_ptr()), PAGEONE_OK);
        assert_eq!(pageone_config_set_ksm_when_limited(cfg, false), PAGEONE_OK);
        assert_eq!(
            pageone_config_set_priority(cfg, 3),
            PAGEONE_INVALID_ARGUMENT
        );
        assert_eq!(
            pageone_config_set_priority(cfg, pageone_priority::PAGEONE_PRIORITY_IDLE as u32),
            PAGEONE_OK
        );
        assert_eq!(
            pageone_config_set_daemon(cfg, c"".as_ptr()),
            PAGEONE_INVALID_ARGUMENT
        );
        pageone_config_free(cfg);
    }
}

#[test]
fn an_invalid_configuration_is_a_config_error() {
    let cfg = config();
    let mut e = ptr::dangling_mut();
    // SAFETY: `cfg` is live until freed; `e` is a valid out pointer.
    unsafe {
        assert_eq!(pageone_config_set_workers(cfg, 0), PAGEONE_OK);
        assert_eq!(pageone_engine_new(cfg, &mut e), PAGEONE_CONFIG);
        pageone_config_free(cfg);
    }
    assert!(e.is_null(), "*out is NULL on failure");
}

#[test]
fn engine_errors_map_to_their_status() {
    let e = engine();
    let len = 16 * PAGE;
    let private = mmap(len, libc::MAP_PRIVATE);
    let shared = mmap(len, libc::MAP_SHARED);
    // SAFETY: `e` is live until freed; the mappings are ours and unregistered before unmapping.
    unsafe {
        let odd = private.cast::<u8>().add(1).cast();
        assert_eq!(pageone_engine_register(e, odd, PAGE), PAGEONE_UNALIGNED);
        assert_eq!(pageone_engine_register(e, private, 0), PAGEONE_UNALIGNED);
        assert_eq!(
            pageone_engine_register(e, shared, len),
            PAGEONE_NOT_ANONYMOUS
        );
        assert_eq!(
            pageone_engine_unregister(e, private, len),
            PAGEONE_NOT_REGISTERED
        );
        assert_eq!(pageone_engine_register(e, private, len), PAGEONE_OK);
        let inner = private.cast::<u8>().add(PAGE).cast();
        assert_eq!(pageone_engine_register(e, inner, PAGE), PAGEONE_OVERLAP);
        // A part of a region can be unregistered; the rest stays registered.
        assert_eq!(pageone_engine_unregister(e, private, PAGE), PAGEONE_OK);
        assert_eq!(
            pageone_engine_unregister(e, private, PAGE),
            PAGEONE_NOT_REGISTERED
        );

        let mut s = pageone_stats::default();
        assert_eq!(pageone_engine_stats(e, &mut s), PAGEONE_OK);
        assert_eq!(s.registered_bytes, (len - PAGE) as u64);
        assert_eq!(
            s.daemon,
            pageone_daemon_link::PAGEONE_DAEMON_LINK_NONE as u32
        );
        assert!(
            s.watch_mode == pageone_watch_mode::PAGEONE_WATCH_UFFD_WP as u32
                || s.watch_mode == pageone_watch_mode::PAGEONE_WATCH_CHECKSUM as u32
        );

        assert_eq!(pageone_engine_unregister(e, private, len), PAGEONE_OK);
        assert_eq!(pageone_engine_stats(e, &mut s), PAGEONE_OK);
        assert_eq!(s.registered_bytes, 0);
        pageone_engine_free(e);
        libc::munmap(private, len);
        libc::munmap(shared, len);
    }
}

#[test]
fn waits_complete_or_time_out() {
    let e = engine();
    // SAFETY: `e` is live until freed.
    unsafe {
        assert_eq!(pageone_engine_kick(e), PAGEONE_OK);
        assert_eq!(pageone_engine_wait_periods(e, 2, u64::MAX), PAGEONE_OK);
        assert_eq!(
            pageone_engine_wait_periods(e, u64::MAX, 20),
            PAGEONE_TIMEOUT
        );
        let mut s = pageone_stats::default();
        assert_eq!(pageone_engine_stats(e, &mut s), PAGEONE_OK);
        assert!(s.full_scans >= 2);
        pageone_engine_free(e);
    }
}

#[test]
fn messages_are_static_strings() {
    // SAFETY: pageone_status_message returns static NUL-terminated strings.
    let m = unsafe { CStr::from_ptr(pageone_status_message(PAGEONE_OVERLAP as i32)) };
    assert!(m.to_str().unwrap().contains("overlaps"));
}

#[test]
fn pages_marked_free_through_the_abi_are_recycled() {
    let e = engine();
    let n = 64;
    let p = mmap(n * PAGE, libc::MAP_PRIVATE).cast::<u8>();
    let mut pool = ptr::null_mut();
    // SAFETY: `p` is this test's mapping of n pages; `e` and `pool` are live until freed below.
    unsafe {
        for i in 0..n {
            p.add(i * PAGE + 100).write(i as u8 + 1);
        }
        assert_eq!(pageone_pool_new(0, &mut pool), PAGEONE_INVALID_ARGUMENT);
        assert!(pool.is_null());
        assert_eq!(pageone_pool_new(256, &mut pool), PAGEONE_OK);
        assert_eq!(
            pageone_engine_recycle_from(e, ptr::null()),
            PAGEONE_NULL_ARGUMENT
        );
        assert_eq!(pageone_engine_recycle_from(e, pool), PAGEONE_OK);
        assert_eq!(pageone_engine_register(e, p.cast(), n * PAGE), PAGEONE_OK);
        assert_eq!(pageone_pool_mark(pool, ptr::null_mut()), 0);
        assert_eq!(pageone_pool_mark(pool, p.add(1).cast()), 0, "unaligned");
        // Even pages freed; page 0 reused at once.
        for i in (0..n).step_by(2) {
            assert_eq!(pageone_pool_mark(pool, p.add(i * PAGE).cast()), 1);
        }
        pageone_pool_unmark(pool, p.cast());
        let mut st = pageone_stats::default();
        for _ in 0..100 {
            assert_eq!(pageone_engine_wait_periods(e, 1, 10_000), PAGEONE_OK);
            assert_eq!(pageone_engine_stats(e, &mut st), PAGEONE_OK);
            if st.pages_recycled >= n as u64 / 2 - 1 {
                break;
            }
        }
        assert_eq!(st.pages_recycled, n as u64 / 2 - 1, "{st:?}");
        for i in 0..n {
            let v = p.add(i * PAGE + 100).read();
            let want = if i % 2 == 0 && i > 0 { 0 } else { i as u8 + 1 };
            assert_eq!(v, want, "page {i}");
        }
        assert_eq!(pageone_engine_unregister(e, p.cast(), n * PAGE), PAGEONE_OK);
        pageone_engine_free(e);
        pageone_pool_free(pool);
        pageone_pool_free(ptr::null_mut());
    }
}

#[test]
fn an_engine_that_only_recycles_merges_nothing() {
    let cfg = config();
    let mut e = ptr::null_mut();
    let n = 64;
    let p = mmap(n * PAGE, libc::MAP_PRIVATE).cast::<u8>();
    let mut pool = ptr::null_mut();
    // SAFETY: `cfg`, `e` and `pool` are live until freed below; `p` is this test's mapping of n
    // pages.
    unsafe {
        assert_eq!(pageone_config_set_merge_period_ms(cfg, 50), PAGEONE_OK);
        assert_eq!(pageone_config_set_daemon(cfg, ptr::null()), PAGEONE_OK);
        assert_eq!(
            pageone_config_set_merging(ptr::null_mut(), false),
            PAGEONE_NULL_ARGUMENT
        );
        assert_eq!(pageone_config_set_merging(cfg, false), PAGEONE_OK);
        assert_eq!(pageone_engine_new(cfg, &mut e), PAGEONE_OK);
        pageone_config_free(cfg);
        // Every page alike: an engine that merges would merge them.
        for i in 0..n {
            p.add(i * PAGE + 100).write(7);
        }
        assert_eq!(pageone_pool_new(256, &mut pool), PAGEONE_OK);
        assert_eq!(pageone_engine_recycle_from(e, pool), PAGEONE_OK);
        assert_eq!(pageone_engine_register(e, p.cast(), n * PAGE), PAGEONE_OK);
        assert_eq!(pageone_pool_mark(pool, p.cast()), 1);
        let mut st = pageone_stats::default();
        for _ in 0..8 {
            assert_eq!(pageone_engine_wait_periods(e, 1, 10_000), PAGEONE_OK);
        }
        assert_eq!(pageone_engine_stats(e, &mut st), PAGEONE_OK);
        assert_eq!(st.pages_recycled, 1, "{st:?}");
        assert_eq!(st.merges, 0, "{st:?}");
        assert_eq!(st.pages_sharing, 0, "{st:?}");
        for i in 1..n {
            assert_eq!(p.add(i * PAGE + 100).read(), 7, "page {i}");
        }
        assert_eq!(pageone_engine_unregister(e, p.cast(), n * PAGE), PAGEONE_OK);
        pageone_engine_free(e);
        pageone_pool_free(pool);
    }
}

/// Merged pages dropped through the ABI read zeros (a plain `madvise` would leave them reading
/// their copy); the rest stays intact. A drop the kernel refuses (a locked page) is
/// `PAGEONE_REFUSED` with the kernel's `errno`; an advice that drops nothing is refused.
#[test]
fn merged_pages_dropped_through_the_abi_read_zeros() {
    let e = engine();
    let n = 16;
    let len = 2 * n * PAGE;
    let p = merged_halves(e, n);
    // SAFETY: `e` is live until freed; the mapping is ours, unregistered before it is unmapped,
    // and read only through raw pointers (the engine maps pages over it).
    unsafe {
        let page = |i: usize| p.add(i * PAGE);
        for (i, advice) in [(2, libc::MADV_DONTNEED), (n + 5, libc::MADV_FREE)] {
            assert_eq!(
                pageone_engine_drop_pages(e, page(i).cast(), PAGE, advice),
                PAGEONE_OK
            );
            assert!(
                (0..PAGE).all(|b| *page(i).add(b) == 0),
                "page {i} is not zero"
            );
        }
        for i in (0..2 * n).filter(|&i| i != 2 && i != n + 5) {
            let want = (i % n) as u8 + 1;
            assert!((0..PAGE).all(|b| *page(i).add(b) == want), "page {i}");
        }
        assert_eq!(
            pageone_engine_drop_pages(e, page(0).cast(), PAGE, libc::MADV_WILLNEED),
            PAGEONE_INVALID_ARGUMENT
        );
        assert_eq!(libc::mlock(page(7).cast(), PAGE), 0);
        *libc::__errno_location() = 0;
        assert_eq!(
            pageone_engine_drop_pages(e, page(7).cast(), PAGE, libc::MADV_DONTNEED),
            PAGEONE_REFUSED
        );
        assert_eq!(*libc::__errno_location(), libc::EINVAL);
        assert!(
            (0..PAGE).all(|b| *page(7).add(b) == 8),
            "a refused drop changed the page"
        );
        assert_eq!(libc::munlock(page(7).cast(), PAGE), 0);
        assert_eq!(pageone_engine_unregister(e, p.cast(), len), PAGEONE_OK);
        pageone_engine_free(e);
        libc::munmap(p.cast(), len);
    }
}

/// Pages of `[p, p + pages * PAGE)` in mappings whose `VmFlags` hold `flag`.
fn flagged_pages(p: *const u8, pages: usize, flag: &str) -> usize {
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
    let (lo, hi) = (p as usize, p as usize + pages * PAGE);
    let mut range = 0..0;
    let mut n = 0;
    for line in smaps.lines() {
        let head = line.split_whitespace().next().unwrap_or("");
        if let Some((a, b)) = head.split_once('-') {
            if let (Ok(a), Ok(b)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16)) {
                range = a..b;
                continue;
            }
        }
        if let Some(flags) = line.strip_prefix("VmFlags:") {
            if flags.split_whitespace().any(|f| f == flag) && range.end > lo && range.start < hi {
                n += (range.end.min(hi) - range.start.max(lo)) / PAGE;
            }
        }
    }
    n
}

/// Advice given through the ABI is kept by the pages the engine merges there (a plain `madvise`
/// would be lost with the mappings the merge replaces); other advice is refused, and advice the
/// kernel refuses is `PAGEONE_REFUSED` with its `errno`.
#[test]
fn advice_given_through_the_abi_is_kept_once_merged() {
    let e = engine();
    let n = 16;
    let len = 2 * n * PAGE;
    let p = halves(n);
    // SAFETY: `e` is live until freed; the mapping is ours, unregistered before it is unmapped,
    // and read only through raw pointers (the engine maps pages over it).
    unsafe {
        assert_eq!(
            pageone_advise(p.cast(), len, libc::MADV_DONTDUMP),
            PAGEONE_OK
        );
        assert_eq!(
            pageone_advise(p.cast(), len, libc::MADV_DONTFORK),
            PAGEONE_OK
        );
        assert_eq!(
            pageone_advise(p.cast(), len, libc::MADV_WILLNEED),
            PAGEONE_INVALID_ARGUMENT
        );
        assert_eq!(
            pageone_advise(ptr::null_mut(), len, libc::MADV_DONTDUMP),
            PAGEONE_NULL_ARGUMENT
        );
        *libc::__errno_location() = 0;
        assert_eq!(
            pageone_advise(p.add(1).cast(), PAGE, libc::MADV_DONTDUMP),
            PAGEONE_REFUSED
        );
        assert_eq!(*libc::__errno_location(), libc::EINVAL);
        assert_eq!(pageone_engine_register(e, p.cast(), len), PAGEONE_OK);
        assert!(merged(e, n), "nothing merged");
        assert_eq!(
            flagged_pages(p, 2 * n, "dd"),
            2 * n,
            "merged pages are dumped"
        );
        assert_eq!(
            flagged_pages(p, 2 * n, "dc"),
            2 * n,
            "merged pages are inherited"
        );
        assert_eq!(pageone_engine_unregister(e, p.cast(), len), PAGEONE_OK);
        assert_eq!(
            flagged_pages(p, 2 * n, "dd"),
            2 * n,
            "given back, it is dumped"
        );
        for i in 0..2 * n {
            let want = (i % n) as u8 + 1;
            assert!((0..PAGE).all(|b| *p.add(i * PAGE + b) == want), "page {i}");
        }
        assert_eq!(libc::munmap(p.cast(), len), 0);
        pageone_engine_free(e);
    }
}

/// Locking reported through the ABI is kept by what the engine maps there later: a merged page
/// dropped is given back as memory locked like the rest.
#[test]
fn locking_reported_through_the_abi_is_kept_by_pages_given_back() {
    let e = engine();
    let n = 16;
    let len = 2 * n * PAGE;
    let p = merged_halves(e, n);
    // SAFETY: `e` is live until freed; the mapping is ours, unregistered before it is unmapped,
    // and read only through raw pointers (the engine maps pages over it).
    unsafe {
        if libc::mlock(p.cast(), len) != 0 {
            eprintln!(
                "skipped: mlock refused ({})",
                std::io::Error::last_os_error()
            );
            return;
        }
        assert_eq!(
            pageone_engine_locking_changed(ptr::null(), p.cast(), len, true),
            PAGEONE_NULL_ARGUMENT
        );
        assert_eq!(
            pageone_engine_locking_changed(e, p.cast(), len, true),
            PAGEONE_OK
        );
        let page = p.add(3 * PAGE);
        assert_eq!(
            pageone_engine_drop_pages(e, page.cast(), PAGE, libc::MADV_DONTNEED_LOCKED),
            PAGEONE_OK
        );
        assert_eq!(
            flagged_pages(page, 1, "lo"),
            1,
            "a page given back is not locked"
        );
        assert_eq!(flagged_pages(p, 2 * n, "lo"), 2 * n);
        assert_eq!(libc::munlock(p.cast(), len), 0);
        assert_eq!(pageone_engine_unregister(e, p.cast(), len), PAGEONE_OK);
        assert_eq!(libc::munmap(p.cast(), len), 0);
        pageone_engine_free(e);
    }
}
