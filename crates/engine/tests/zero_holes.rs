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
    assert_eq!(
        (s.pages_shared, s.pages_sharing),
        (distinct, distinct),
        "{s:?}"
    );
    assert_eq!(s.zero_pages, zeros, "{s:?}");
    assert_eq!(s.compare_mismatches, 0, "{s:?}");
    let maps = mappings_over(base, len);
    assert_eq!(
        maps.len(),
        2,
        "each half is one mapping of the store, zero pages included: {maps:#?}"
    );
    for (i, p) in mem.chunks(PAGE).enumerate() {
        assert!(check(p, content(i)), "page {i} changed by merging");
    }
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
