//! The VMA-limit path, in its own test binary because it lowers `vm.max_map_count`, which
//! applies to every thread of the process.

use std::time::Duration;

use pageone_engine::Engine;
use pageone_sys as sys;

mod common;
use common::{check, fill, wait_for, PAGE};

/// Restores `vm.max_map_count` when dropped, even if the test fails.
struct MapCountGuard(usize);
impl Drop for MapCountGuard {
    fn drop(&mut self) {
        let _ = sys::set_max_map_count(self.0);
    }
}

/// Page `i` of a region of `2n` pages: every other page duplicates a page of the other half,
/// and its neighbours are unique, so each merge is a separate VMA.
fn content(n: usize, i: usize) -> u64 {
    if i % 2 == 0 {
        (i % n) as u64 + 1
    } else {
        (i + 10 * n) as u64
    }
}

/// The parent runs the test body in a child process and restores `vm.max_map_count` after it
/// exits, however it exits.
#[test]
fn vma_limit_degrades_merging_not_the_process() {
    if std::env::var_os("PAGEONE_VMA_CHILD").is_some() {
        return vma_limit_child();
    }
    let old = sys::max_map_count().unwrap();
    if sys::set_max_map_count(old).is_err() {
        eprintln!("skipped: vm.max_map_count is not writable (needs root)");
        return;
    }
    let _restore = MapCountGuard(old);
    let status = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "vma_limit_degrades_merging_not_the_process",
            "--exact",
            "--nocapture",
        ])
        .env("PAGEONE_VMA_CHILD", "1")
        .status()
        .unwrap();
    drop(_restore);
    assert_eq!(
        sys::max_map_count().unwrap(),
        old,
        "vm.max_map_count was not restored"
    );
    assert!(status.success(), "the VMA-limit scenario failed: {status}");
}

fn vma_limit_child() {
    // Periods run only when kicked (wait_for), so the limit is in place before the first merge.
    let e = Engine::builder()
        .merge_period(Duration::from_secs(3600))
        .vma_margin(64)
        .build()
        .unwrap();
    let n = 4096;
    let mut r = e.alloc_region(2 * n * PAGE).unwrap();
    let content = |i: usize| content(n, i);
    for (i, p) in r.as_mut_slice().chunks_mut(PAGE).enumerate() {
        fill(p, content(i));
    }
    let limit = sys::map_count().unwrap() + 64 + 300;
    sys::set_max_map_count(limit).unwrap();
    let s = wait_for(&e, |s| s.vma_limited_merges > 0 && s.merges > 0);
    assert!(s.vma_limited_merges > 0, "{s:?}");
    assert!(s.merges > 0, "{s:?}");
    assert!(
        sys::map_count().unwrap() <= limit,
        "the VMA budget was exceeded: {} > {limit}; {s:?}",
        sys::map_count().unwrap()
    );
    // The process still works: it can map memory and every page is intact.
    let extra = sys::mmap_anonymous(PAGE).unwrap();
    // SAFETY: `extra` was just mapped and is not referenced.
    unsafe { sys::munmap(extra, PAGE).unwrap() };
    for (i, p) in r.as_slice().chunks(PAGE).enumerate() {
        assert!(check(p, content(i)), "page {i} changed");
    }
    drop(r);
}

/// At its VMA budget (set low with the margin knob, not the sysctl) the engine stops spending:
/// pages it cannot afford to merge wait without being classified or frozen again, the engine's
/// CPU stays near zero, and they merge once the budget has room again.
#[test]
fn at_the_budget_waiting_pages_cost_nothing_until_there_is_room() {
    let e = Engine::builder()
        .merge_period(Duration::from_millis(20))
        .build()
        .unwrap();
    let n = 4096;
    let mut r = e.alloc_region(2 * n * PAGE).unwrap();
    // Room for about 300 more VMAs: each merge here is one or two. The budget is set before
    // the pages are written, so no merge happens before it is in place.
    let limit = sys::max_map_count().unwrap();
    let margin = limit - sys::map_count().unwrap() - 300;
    e.reconfigure(|c| c.vma_margin = margin).unwrap();
    let content = |i: usize| content(n, i);
    for (i, p) in r.as_mut_slice().chunks_mut(PAGE).enumerate() {
        fill(p, content(i));
    }
    let s = wait_for(&e, |s| s.pages_waiting_on_limit > 0 && s.merges > 0);
    assert!(s.pages_waiting_on_limit > 0, "{s:?}");
    // Settled at the budget: a few seconds of periods cost next to nothing.
    e.wait_periods(10, Duration::from_secs(10));
    let (t0, cpu0) = (std::time::Instant::now(), e.stats().worker_cpu_ns);
    std::thread::sleep(Duration::from_secs(2));
    let cpu = (e.stats().worker_cpu_ns - cpu0) as f64 / t0.elapsed().as_nanos() as f64;
    assert!(
        cpu < 0.05,
        "the engine used {:.1}% of a CPU at its budget: {:?}",
        cpu * 100.0,
        e.stats()
    );
    let merged = e.stats().pages_sharing;
    // Room again: the waiting pages merge.
    e.reconfigure(|c| c.vma_margin = 1024).unwrap();
    let s = wait_for(&e, |s| {
        s.pages_waiting_on_limit == 0 && s.pages_sharing > merged
    });
    assert!(s.pages_sharing > merged, "{s:?}");
    assert_eq!(s.pages_waiting_on_limit, 0, "{s:?}");
    for (i, p) in r.as_slice().chunks(PAGE).enumerate() {
        assert!(check(p, content(i)), "page {i} changed");
    }
    drop(r);
}
