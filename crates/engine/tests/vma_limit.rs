//! The VMA-limit path, in its own test binary because it lowers `vm.max_map_count`, which
//! applies to every thread of the process.

use std::time::Duration;

use pageone_engine::{DropAdvice, Engine, Region};
use pageone_sys as sys;

mod common;
use common::{check, fill, filled, wait_for, with_ksm, KsmRunning, PAGE};

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

/// Runs the test `name` of this binary alone in a child process, with `var` set (which the test
/// reads to run its body there), and returns how the child ended.
fn in_a_child(name: &str, var: &str) -> std::process::ExitStatus {
    std::process::Command::new(std::env::current_exe().unwrap())
        .args([name, "--exact", "--nocapture"])
        .env(var, "1")
        .status()
        .unwrap()
}

/// The parent's side of a test whose body fills the process's mappings to the limit: runs it in
/// a child (see [`in_a_child`]), where nothing else of this binary runs, and asserts it passed.
fn passes_in_a_child(name: &str, var: &str) {
    let status = in_a_child(name, var);
    assert!(
        status.success(),
        "the scenario at the mapping limit failed: {status}"
    );
}

/// An engine whose periods run only when asked for (an hour's period: `wait_for` and
/// `wait_periods` kick them), so that none runs while the test holds the mappings full, and
/// which never hands memory to the kernel's KSM.
fn engine_on_demand() -> Engine {
    Engine::builder()
        .merge_period(Duration::from_secs(3600))
        .ksm_when_limited(false)
        .build()
        .unwrap()
}

/// `2n` pages of the test's own memory whose halves hold the same contents (page `i` holds
/// `i % n + 1`), registered with `e` and merged.
fn registered_halves(e: &Engine, n: usize) -> &'static mut [u8] {
    let mem = filled(2 * n, |i| (i % n) as u64 + 1);
    e.register(mem.as_mut_ptr(), mem.len()).unwrap();
    let s = wait_for(e, |s| s.pages_sharing >= n as u64);
    assert!(s.pages_sharing >= n as u64, "{s:?}");
    mem
}

/// A region of `2n` pages whose halves hold the same contents (page `i` holds content
/// `i % n + 1`), once they merged: the second half's pages map their copies in one mapping.
fn merged_halves(e: &Engine, n: usize) -> Region<'_> {
    let mut r = e.alloc_region(2 * n * PAGE).unwrap();
    for (i, p) in r.as_mut_slice().chunks_mut(PAGE).enumerate() {
        fill(p, (i % n) as u64 + 1);
    }
    let s = wait_for(e, |s| s.pages_sharing >= n as u64);
    assert!(s.pages_sharing >= n as u64, "{s:?}");
    r
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
    let status = in_a_child(
        "vma_limit_degrades_merging_not_the_process",
        "PAGEONE_VMA_CHILD",
    );
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
        .ksm_when_limited(false)
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

/// A merged page dropped (`MADV_DONTNEED`, `MADV_FREE`) when the process has no mapping to spare
/// reads zeros all the same: its store mapping cannot be split to put empty memory there, so
/// zeros are written in place. The parent runs the body in a child process, which fills its
/// own mappings up to `vm.max_map_count` (the other tests here run in this process).
#[test]
fn a_merged_page_dropped_at_the_mapping_limit_reads_zeros() {
    if std::env::var_os("PAGEONE_VMA_FULL_CHILD").is_some() {
        return dropped_at_the_limit_child();
    }
    passes_in_a_child(
        "a_merged_page_dropped_at_the_mapping_limit_reads_zeros",
        "PAGEONE_VMA_FULL_CHILD",
    );
}

/// Single pages mapped, of alternating protections (so that the kernel cannot join them), until
/// the process has no mapping left to spare; unmapped when dropped.
struct FilledMappings(Vec<*mut u8>);

impl FilledMappings {
    fn to_the_limit() -> Self {
        let mut maps = Vec::with_capacity(sys::max_map_count().unwrap());
        loop {
            let prot = if maps.len() % 2 == 0 {
                libc::PROT_READ
            } else {
                libc::PROT_NONE
            };
            // SAFETY: a fresh anonymous mapping where the kernel chooses.
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    PAGE,
                    prot,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
            if p == libc::MAP_FAILED {
                return Self(maps);
            }
            maps.push(p.cast());
        }
    }
}

impl Drop for FilledMappings {
    fn drop(&mut self) {
        for &p in &self.0 {
            // SAFETY: mapped by `to_the_limit`, used by nothing.
            unsafe { libc::munmap(p.cast(), PAGE) };
        }
    }
}

fn dropped_at_the_limit_child() {
    let e = engine_on_demand();
    let n = 64;
    let mut r = merged_halves(&e, n);
    let page = |i: usize| r.as_ptr().wrapping_add(i * PAGE);
    let (a, b) = (n + n / 2, n + n / 2 + 2);
    {
        let full = FilledMappings::to_the_limit();
        assert!(!full.0.is_empty());
        e.drop_pages(page(a), PAGE, DropAdvice::DontNeed).unwrap();
        e.drop_pages(page(b), PAGE, DropAdvice::Free).unwrap();
    }
    let mem = r.as_slice();
    assert!(
        check(&mem[a * PAGE..(a + 1) * PAGE], 0),
        "MADV_DONTNEED: not zeros"
    );
    let freed = &mem[b * PAGE..(b + 1) * PAGE];
    let was = (b % n) as u64 + 1;
    assert!(
        check(freed, 0) || check(freed, was),
        "MADV_FREE: neither zeros nor its bytes"
    );
    for i in (0..2 * n).filter(|&i| i != a && i != b) {
        assert!(
            check(&mem[i * PAGE..(i + 1) * PAGE], (i % n) as u64 + 1),
            "page {i}"
        );
    }
    // With room again, a dropped page written like its twin merges again.
    let s = e.stats();
    fill(
        &mut r.as_mut_slice()[a * PAGE..(a + 1) * PAGE],
        (a % n) as u64 + 1,
    );
    let s2 = wait_for(&e, |t| t.merges > s.merges);
    assert!(s2.merges > s.merges, "{s2:?}");
    for (i, p) in r.as_slice().chunks(PAGE).enumerate() {
        let want = if i == b && check(p, 0) {
            0
        } else {
            (i % n) as u64 + 1
        };
        assert!(check(p, want), "page {i} after merging again");
    }
    drop(r);
}

/// Memory unregistered when the process has no mapping to spare keeps its merged pages' copies:
/// their store mappings cannot be replaced by anonymous memory there (that takes a mapping), so
/// the pages are made private where they are, and the store must not give their copies to other
/// contents. Dropped through the engine (as the shim drops them), pages read zeros; once mappings
/// are to spare again, the engine makes the memory anonymous and releases the copies, so that a
/// drop it does not see reads zeros too.
#[test]
fn memory_unregistered_at_the_mapping_limit_never_reads_another_pages_bytes() {
    if std::env::var_os("PAGEONE_VMA_UNREGISTER_CHILD").is_some() {
        return unregistered_at_the_limit_child();
    }
    passes_in_a_child(
        "memory_unregistered_at_the_mapping_limit_never_reads_another_pages_bytes",
        "PAGEONE_VMA_UNREGISTER_CHILD",
    );
}

fn unregistered_at_the_limit_child() {
    let e = engine_on_demand();
    let n = 64;
    let old = registered_halves(&e, n);
    let (p, len) = (old.as_mut_ptr(), old.len());
    let stored = || {
        let maps = sys::self_mappings_in(p as usize, p as usize + len).unwrap();
        maps.iter()
            .filter(|m| pageone_engine::is_store_mapping(m))
            .count()
    };
    let full = FilledMappings::to_the_limit();
    e.unregister(p, len).unwrap();
    for (i, page) in old.chunks(PAGE).enumerate() {
        assert!(
            check(page, (i % n) as u64 + 1),
            "page {i} after unregistering"
        );
    }
    // The pages are still store mappings there: their copies are kept while no mapping is to
    // spare, whatever the periods do.
    assert_eq!(stored(), 2, "the scenario did not happen");
    e.wait_periods(2, Duration::from_secs(10));
    let s = e.stats();
    assert_eq!(
        s.pages_shared, n as u64,
        "copies still mapped were released: {s:?}"
    );
    // Dropped through the engine (the shim's path), a page reads zeros, its neighbours their
    // bytes.
    let (a, b) = (3, n + 5);
    for i in [a, b] {
        // SAFETY: the test's own memory.
        let at = unsafe { p.add(i * PAGE) };
        e.drop_pages(at, PAGE, DropAdvice::DontNeed).unwrap();
    }
    let want = |i: usize| {
        if i == a || i == b {
            0
        } else {
            (i % n) as u64 + 1
        }
    };
    for (i, page) in old.chunks(PAGE).enumerate() {
        assert!(check(page, want(i)), "page {i} after a drop at the limit");
    }
    drop(full);
    // With mappings to spare, the memory becomes anonymous again and the copies are released.
    let s = wait_for(&e, |s| s.pages_shared == 0);
    assert_eq!(s.pages_shared, 0, "copies still held: {s:?}");
    assert_eq!(stored(), 0, "the memory still maps the store");
    for (i, page) in old.chunks(PAGE).enumerate() {
        assert!(check(page, want(i)), "page {i} once anonymous again");
    }
    // Dropped by the program alone (which the engine no longer sees), every page reads zeros.
    // SAFETY: the test's own memory, no longer registered.
    let dropped = unsafe { libc::madvise(p.cast(), len, libc::MADV_DONTNEED) };
    assert_eq!(dropped, 0);
    for (i, page) in old.chunks(PAGE).enumerate() {
        assert!(check(page, 0), "page {i} dropped does not read zeros");
    }
}

/// Memory unregistered at the mapping limit and registered again before a period could make it
/// anonymous: its pages are mappings of the store there (copy-on-write broken, as far as the
/// region knows). Once mappings are to spare, the period makes them anonymous memory, and the
/// region merges them again like any other.
#[test]
fn memory_registered_again_after_an_unregister_at_the_limit_merges_again() {
    if std::env::var_os("PAGEONE_VMA_REREGISTER_CHILD").is_some() {
        return registered_again_child();
    }
    passes_in_a_child(
        "memory_registered_again_after_an_unregister_at_the_limit_merges_again",
        "PAGEONE_VMA_REREGISTER_CHILD",
    );
}

fn registered_again_child() {
    let e = engine_on_demand();
    let n = 64;
    let old = registered_halves(&e, n);
    let (p, len) = (old.as_mut_ptr(), old.len());
    {
        let _full = FilledMappings::to_the_limit();
        e.unregister(p, len).unwrap();
    }
    let maps = sys::self_mappings_in(p as usize, p as usize + len).unwrap();
    assert!(
        maps.iter().all(pageone_engine::is_store_mapping),
        "the scenario did not happen"
    );
    // Registered again before any period: no period runs until asked for (an hour's period).
    e.register(p, len).unwrap();
    let s = wait_for(&e, |s| s.pages_sharing >= n as u64);
    assert_eq!(s.pages_sharing, n as u64, "not merged again: {s:?}");
    for (i, page) in old.chunks(PAGE).enumerate() {
        assert!(check(page, (i % n) as u64 + 1), "page {i} merged again");
    }
}

/// At its VMA budget (set low with the margin knob, not the sysctl) the engine stops spending:
/// pages it cannot afford to merge wait without being classified or frozen again, the engine's
/// CPU stays near zero, and they merge once the budget has room again.
#[test]
fn at_the_budget_waiting_pages_cost_nothing_until_there_is_room() {
    // (Not handed to the kernel's KSM, which the next test runs.)
    let e = Engine::builder()
        .merge_period(Duration::from_millis(20))
        .ksm_when_limited(false)
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

/// A merged page written since (a private copy inside a mapping of the store) whose merge again the
/// budget refuses stays known as living in the store's mapping: dropped, it reads zeros, not the
/// copy it was merged onto.
#[test]
fn a_written_merged_page_the_budget_refuses_reads_zeros_once_dropped() {
    let e = Engine::builder()
        .merge_period(Duration::from_millis(20))
        .ksm_when_limited(false)
        .build()
        .unwrap();
    let n = 32;
    let mut r = merged_halves(&e, n);
    // No room for any merge from now on.
    let limit = sys::max_map_count().unwrap();
    e.reconfigure(|c| c.vma_margin = limit).unwrap();
    // Two merged pages written with one new content: equal private copies, each a candidate to
    // merge onto a copy of the other once unchanged, which the budget refuses.
    let (a, b, new) = (3, n + 7, 999);
    let limited = e.stats().vma_limited_merges;
    let mem = r.as_mut_slice();
    fill(&mut mem[a * PAGE..(a + 1) * PAGE], new);
    fill(&mut mem[b * PAGE..(b + 1) * PAGE], new);
    let s = wait_for(&e, |s| s.cow_breaks >= 2 && s.vma_limited_merges > limited);
    assert!(
        s.vma_limited_merges > limited,
        "no merge was refused: {s:?}"
    );
    // Refused more than once (waiting longer each time), they are still what they were.
    e.wait_periods(8, Duration::from_secs(10));
    let page = |i: usize| r.as_ptr().wrapping_add(i * PAGE);
    e.drop_pages(page(a), PAGE, DropAdvice::DontNeed).unwrap();
    e.drop_pages(page(b), PAGE, DropAdvice::Free).unwrap();
    let mem = r.as_slice();
    assert!(
        check(&mem[a * PAGE..(a + 1) * PAGE], 0),
        "MADV_DONTNEED: not zeros"
    );
    let freed = &mem[b * PAGE..(b + 1) * PAGE];
    assert!(
        check(freed, 0) || check(freed, new),
        "MADV_FREE: neither zeros nor the bytes written"
    );
    for i in (0..2 * n).filter(|&i| i != a && i != b) {
        assert!(
            check(&mem[i * PAGE..(i + 1) * PAGE], (i % n) as u64 + 1),
            "page {i}"
        );
    }
    drop(r);
}

/// A writer thread, stopped and joined when finished or dropped: before the memory it writes is
/// unmapped, even when the test fails (else it would fault there, and the process die before
/// `KsmRunning` restores the kernel's KSM).
struct Writer {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    handle: Option<std::thread::JoinHandle<u64>>,
}

impl Writer {
    /// Stops the thread; returns its rounds.
    fn finish(mut self) -> u64 {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.handle.take().expect("joined once").join().unwrap()
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

/// With the kernel's KSM running, a region whose merges cost a mapping per page, more than the
/// VMA budget has, is handed to KSM whole: pageone's merges there are undone (its copies
/// released), the engine stops watching it, and KSM merges every duplicate without a mapping
/// each. Every page keeps its bytes, a write to a page KSM merged is kept, the region stays
/// registered (nothing registers it again) and unregistering gives its pages back private.
#[test]
fn a_region_merging_a_mapping_per_page_beyond_the_budget_is_handed_to_the_kernels_ksm() {
    let Some((ksm, e)) = with_ksm() else {
        return;
    };
    let n = 4096;
    let mut r = e.alloc_region(2 * n * PAGE).unwrap();
    let limit = sys::max_map_count().unwrap();
    let margin = limit - sys::map_count().unwrap() - 1000;
    e.reconfigure(|c| c.vma_margin = margin).unwrap();
    let content = |i: usize| content(n, i);
    let before = KsmRunning::merging_here();
    for (i, p) in r.as_mut_slice().chunks_mut(PAGE).enumerate() {
        fill(p, content(i));
    }
    // A writer rewrites every 16th page throughout, across the hand-over.
    let written = |i: usize| i % 16 == 8;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = Writer {
        stop: stop.clone(),
        handle: Some({
            let base = r.as_ptr() as usize;
            std::thread::spawn(move || {
                let mut round = 0u64;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    round += 1;
                    for i in (0..2 * n).filter(|&i| written(i)) {
                        // SAFETY: only this thread touches these pages of the test's region
                        // until it is joined, which `Writer` does before the region (declared
                        // before it) is dropped, even when the test fails.
                        let page = unsafe {
                            std::slice::from_raw_parts_mut((base + i * PAGE) as *mut u8, PAGE)
                        };
                        fill(page, (round << 32) + i as u64);
                    }
                }
                round
            })
        }),
    };
    let s = wait_for(&e, |s| s.regions_to_ksm > 0);
    assert_eq!(s.regions_to_ksm, 1, "{s:?}");
    assert_eq!(
        s.pages_shared, 0,
        "pageone kept copies in a region it handed over: {s:?}"
    );
    assert!(e.is_registered(r.as_ptr(), r.len()), "no longer registered");
    // Every other page has a twin in the other half: KSM merges the n/2 pairs (less those the
    // writer keeps changing: every 16th page's pair).
    let pairs = (n / 2 - n / 16) as u64;
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while KsmRunning::merged_since(before) < 2 * pairs && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        KsmRunning::merged_since(before) >= 2 * pairs,
        "KSM merged {} of the {pairs} pairs' pages: {:?}",
        KsmRunning::merged_since(before),
        e.stats()
    );
    std::thread::sleep(Duration::from_millis(200));
    let rounds = writer.finish();
    for (i, p) in r.as_slice().chunks(PAGE).enumerate() {
        let want = if written(i) {
            (rounds << 32) + i as u64
        } else {
            content(i)
        };
        assert!(check(p, want), "page {i} changed (writer rounds {rounds})");
    }
    // Written, every page keeps what was written (KSM's pages break copy-on-write).
    let mem = r.as_mut_slice();
    for i in (0..2 * n).step_by(2) {
        fill(&mut mem[i * PAGE..(i + 1) * PAGE], 1_000_000 + i as u64);
    }
    e.wait_periods(3, Duration::from_secs(10));
    for (i, p) in r.as_slice().chunks(PAGE).enumerate() {
        let want = if i % 2 == 0 {
            1_000_000 + i as u64
        } else {
            content(i)
        };
        assert!(check(p, want), "page {i} lost a write");
    }
    let s = e.stats();
    assert_eq!((s.pages_shared, s.merges > 0), (0, true), "{s:?}");
    // Unmapped by the program (not unregistered), half of it is forgotten: the kernel still
    // reports it. The rest is unregistered and unmapped as usual.
    let (p, len) = (r.as_ptr(), r.len());
    // SAFETY: the second half of the test's region; nothing refers to it.
    unsafe { sys::munmap(p.add(len / 2), len / 2) }.unwrap();
    e.wait_periods(2, Duration::from_secs(10));
    assert_eq!(e.stats().registered_bytes, (len / 2) as u64);
    assert!(!e.is_registered(p.wrapping_add(len / 2), PAGE));
    e.unregister(p, len / 2).unwrap();
    // SAFETY: the first half, unregistered; `r` is forgotten so that it unmaps nothing again.
    unsafe { sys::munmap(p, len / 2) }.unwrap();
    std::mem::forget(r);
    assert_eq!(e.stats().registered_bytes, 0);
    drop(ksm);
}

/// Where the VMA budget binds, it goes to the merges that save the most pages per VMA: single
/// pages scattered among others (at lower addresses, so met first) take half the room at most,
/// and two halves holding the same pages in the same order (runs, a VMA per hundreds of pages)
/// merge whole. In a child: the VMAs other tests of this binary map meanwhile would take the
/// room.
#[test]
fn at_the_budget_runs_merge_before_single_pages() {
    if std::env::var_os("PAGEONE_PROFIT_CHILD").is_some() {
        return runs_before_singles_child();
    }
    passes_in_a_child(
        "at_the_budget_runs_merge_before_single_pages",
        "PAGEONE_PROFIT_CHILD",
    );
}

fn runs_before_singles_child() {
    let e = Engine::builder()
        .merge_period(Duration::from_millis(20))
        .ksm_when_limited(false)
        .build()
        .unwrap();
    // Singles: 2n pages whose merges are a VMA or two each; runs: two halves of `runs` pages.
    let (n, runs) = (2048, 2048);
    let mut r = e.alloc_region((2 * n + 2 * runs) * PAGE).unwrap();
    // Room for about 300 more VMAs, set before the pages are written (see the test above).
    let limit = sys::max_map_count().unwrap();
    let margin = limit - sys::map_count().unwrap() - 300;
    e.reconfigure(|c| c.vma_margin = margin).unwrap();
    let content = |i: usize| {
        if i < 2 * n {
            content(n, i)
        } else {
            1_000_000 + ((i - 2 * n) % runs) as u64
        }
    };
    for (i, p) in r.as_mut_slice().chunks_mut(PAGE).enumerate() {
        fill(p, content(i));
    }
    let base = r.as_slice().as_ptr() as usize;
    let in_store = |from: usize, to: usize| -> usize {
        let (lo, hi) = (base + from * PAGE, base + to * PAGE);
        sys::self_mappings()
            .unwrap()
            .iter()
            .filter(|m| pageone_engine::is_merged_mapping(m))
            .map(|m| m.end.min(hi).saturating_sub(m.start.max(lo)) / PAGE)
            .sum()
    };
    let s = wait_for(&e, |s| {
        s.pages_waiting_on_limit > 0 && in_store(2 * n, 2 * n + 2 * runs) == 2 * runs
    });
    let (singles, whole) = (in_store(0, 2 * n), in_store(2 * n, 2 * n + 2 * runs));
    assert_eq!(whole, 2 * runs, "the runs merged whole: {s:?}");
    assert!(
        singles > 0,
        "single pages merged while half the room was left: {s:?}"
    );
    assert!(s.pages_waiting_on_limit > 0, "{s:?}");
    for (i, p) in r.as_slice().chunks(PAGE).enumerate() {
        assert!(check(p, content(i)), "page {i} changed");
    }
    drop(r);
}
