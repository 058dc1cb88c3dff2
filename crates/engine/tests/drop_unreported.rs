//! Dropping registered pages that hold no merged page through the engine (`Engine::drop_pages`,
//! as the shim's `madvise` does) wakes no engine thread: the range leaves the main context for the
//! drop, so the kernel reports nothing and does not hold the caller until the fault thread read a
//! report. The engine records the drop itself, and the range stays watched.

use std::time::Duration;

use pageone_engine::{DropAdvice, Engine};

mod common;
use common::{check, fill, wait_for, PAGE};

/// The voluntary context switches of the process's thread named `pageone-faults` (this binary
/// runs one engine).
fn fault_thread_switches() -> u64 {
    for t in std::fs::read_dir("/proc/self/task").unwrap() {
        let dir = t.unwrap().path();
        let comm = std::fs::read_to_string(dir.join("comm")).unwrap_or_default();
        if comm.trim_end() != "pageone-faults" {
            continue;
        }
        let status = std::fs::read_to_string(dir.join("status")).unwrap();
        return status
            .lines()
            .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:"))
            .map(|v| v.trim().parse().unwrap())
            .unwrap();
    }
    panic!("no fault thread");
}

#[test]
fn dropping_unmerged_pages_through_the_engine_reports_nothing_and_keeps_them_watched() {
    // Periods run only when kicked (wait_for): nothing else wakes the fault thread.
    let e = Engine::builder()
        .merge_period(Duration::from_secs(3600))
        .build()
        .unwrap();
    let n = 256;
    let calls = 64;
    let mut r = e.alloc_region(n * PAGE).unwrap();
    for (i, p) in r.as_mut_slice().chunks_mut(PAGE).enumerate() {
        fill(p, 1000 + i as u64);
    }
    wait_for(&e, |s| s.full_scans >= 2);
    let base = r.as_ptr();
    // The measure works: a raw drop of each of the odd pages is a report the fault thread reads.
    let before = fault_thread_switches();
    for k in 0..calls {
        // SAFETY: a page of the test's own region.
        let dropped = unsafe {
            libc::madvise(
                base.wrapping_add((2 * k + 1) * PAGE).cast(),
                PAGE,
                libc::MADV_DONTNEED,
            )
        };
        assert_eq!(dropped, 0);
    }
    let raw = fault_thread_switches() - before;
    assert!(
        raw >= calls as u64 / 2,
        "{raw} switches for {calls} raw drops"
    );
    // Through the engine, the even pages.
    let before = fault_thread_switches();
    for k in 0..calls {
        e.drop_pages(base.wrapping_add(2 * k * PAGE), PAGE, DropAdvice::DontNeed)
            .unwrap();
    }
    let through = fault_thread_switches() - before;
    assert!(
        through < calls as u64 / 8,
        "{through} switches of the fault thread for {calls} drops through the engine ({raw} raw)"
    );
    let mem = r.as_mut_slice();
    for (i, p) in mem.chunks(PAGE).enumerate() {
        let want = if i < 2 * calls { 0 } else { 1000 + i as u64 };
        assert!(check(p, want), "page {i}");
    }
    // Still watched: pages written there merge.
    fill(&mut mem[..PAGE], 7);
    fill(&mut mem[2 * PAGE..3 * PAGE], 7);
    let s = wait_for(&e, |s| s.pages_sharing >= 1);
    assert_eq!(s.pages_sharing, 1, "{s:?}");
    assert!(check(&mem[..PAGE], 7) && check(&mem[2 * PAGE..3 * PAGE], 7));
}
