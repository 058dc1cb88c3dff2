//! Memory whose duplicates lie scattered in one part and in runs in another: with the kernel's
//! KSM running, only the scattered part is handed to it, and pageone keeps merging the runs.

use std::time::{Duration, Instant};

mod common;
use common::{check, fill, wait_for, with_ksm, KsmRunning, PAGE};

/// Pages of a chunk the engine judges apart (`ksm::CHUNK_PAGES`, 64 MiB).
const CHUNK: usize = 16_384;

/// Page `i` of a region of two chunks. The first chunk's even pages in its lower half have a
/// twin `CHUNK / 2` pages higher, among pages of their own: each merge there is a single page,
/// a mapping each. The second chunk's halves hold the same pages in the same order: runs.
fn content(i: usize) -> u64 {
    let half = CHUNK / 2;
    match (i / CHUNK, i % CHUNK) {
        (0, j) if j % 2 == 0 => (j % half) as u64 + 1,
        (0, j) => (j + 10 * CHUNK) as u64,
        (_, j) => (j % half + 100 * CHUNK) as u64,
    }
}

#[test]
fn only_the_chunk_merging_single_pages_goes_to_ksm_and_the_runs_stay_merged() {
    let Some((_ksm, e)) = with_ksm() else {
        return;
    };
    let mut r = e.alloc_region(2 * CHUNK * PAGE).unwrap();
    let before = KsmRunning::merging_here();
    for (i, p) in r.as_mut_slice().chunks_mut(PAGE).enumerate() {
        fill(p, content(i));
    }
    let runs = (CHUNK / 2) as u64;
    let s = wait_for(&e, |s| s.regions_to_ksm > 0 && s.pages_sharing >= runs);
    assert_eq!(s.regions_to_ksm, 1, "{s:?}");
    assert_eq!(
        (s.pages_shared, s.pages_sharing),
        (runs, runs),
        "the runs' chunk is pageone's, merged, and nothing of the other: {s:?}"
    );
    // The first chunk is the kernel's: marked mergeable, and merged by it (its pairs).
    let base = r.as_ptr() as usize;
    let (ksm, pageone) = mergeable_bytes(base, 2 * CHUNK * PAGE);
    assert_eq!(
        (ksm, pageone),
        (CHUNK * PAGE, 0),
        "bytes marked for KSM in each chunk"
    );
    let pairs = (CHUNK / 4) as u64;
    let deadline = Instant::now() + Duration::from_secs(60);
    while KsmRunning::merged_since(before) < 2 * pairs && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        KsmRunning::merged_since(before) >= 2 * pairs,
        "{:?}",
        e.stats()
    );
    for (i, p) in r.as_slice().chunks(PAGE).enumerate() {
        assert!(check(p, content(i)), "page {i}");
    }
    // Written, every page keeps what was written, on either side.
    let mem = r.as_mut_slice();
    for i in (0..2 * CHUNK).step_by(3) {
        fill(&mut mem[i * PAGE..(i + 1) * PAGE], 1 << 40 | i as u64);
    }
    e.wait_periods(3, Duration::from_secs(10));
    for (i, p) in r.as_slice().chunks(PAGE).enumerate() {
        let want = if i % 3 == 0 {
            1 << 40 | i as u64
        } else {
            content(i)
        };
        assert!(check(p, want), "page {i} lost a write");
    }
    let (p, len) = (r.as_ptr(), r.len());
    e.unregister(p, len).unwrap();
    assert_eq!(mergeable_bytes(base, len), (0, 0), "taken back from KSM");
}

/// Bytes of `[base, base + len)` in mappings marked mergeable (`mg` in `/proc/self/smaps`), in
/// its first chunk and in the rest.
fn mergeable_bytes(base: usize, len: usize) -> (usize, usize) {
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
    let (mut first, mut rest) = (0, 0);
    let mut range = 0..0;
    for line in smaps.lines() {
        if let Some((s, e)) = line
            .split_whitespace()
            .next()
            .and_then(|r| r.split_once('-'))
            .and_then(|(s, e)| {
                Some((
                    usize::from_str_radix(s, 16).ok()?,
                    usize::from_str_radix(e, 16).ok()?,
                ))
            })
        {
            range = s.max(base)..e.min(base + len);
        } else if line.starts_with("VmFlags:") && line.split_whitespace().any(|f| f == "mg") {
            let split = base + CHUNK * PAGE;
            first += range.end.min(split).saturating_sub(range.start);
            rest += range.end.saturating_sub(range.start.max(split));
        }
    }
    (first, rest)
}

/// One process, two regions of a chunk each holding the same pages: the first in order, the
/// second in another order. The first region's pages merge onto the copies made of them, in
/// runs, which judge nothing; the second's merge one by one, and it goes to KSM. Then the first
/// region's copies are mapped by no other page: it goes to KSM too, which merges the pairs.
#[test]
fn a_chunk_left_holding_copies_no_other_page_maps_follows_its_twins_to_ksm() {
    let Some((_ksm, e)) = with_ksm() else {
        return;
    };
    let content = |region: usize, j: usize| {
        let k = if region == 0 { j } else { (j * 1237) % CHUNK };
        k as u64 + 1
    };
    let mut regions = [
        e.alloc_region(CHUNK * PAGE).unwrap(),
        e.alloc_region(CHUNK * PAGE).unwrap(),
    ];
    let before = KsmRunning::merging_here();
    for (n, r) in regions.iter_mut().enumerate() {
        for (j, p) in r.as_mut_slice().chunks_mut(PAGE).enumerate() {
            fill(p, content(n, j));
        }
    }
    let s = wait_for(&e, |s| s.regions_to_ksm == 2 && s.pages_shared == 0);
    assert_eq!((s.regions_to_ksm, s.pages_shared), (2, 0), "{s:?}");
    let pairs = CHUNK as u64;
    let deadline = Instant::now() + Duration::from_secs(60);
    while KsmRunning::merged_since(before) < 2 * pairs && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        KsmRunning::merged_since(before) >= 2 * pairs,
        "{:?}",
        e.stats()
    );
    for (n, r) in regions.iter().enumerate() {
        for (j, p) in r.as_slice().chunks(PAGE).enumerate() {
            assert!(check(p, content(n, j)), "region {n} page {j}");
        }
    }
}

/// One process, four regions of several chunks, filled before they are registered, holding the
/// same pages in four orders. The lowest region's pages are the ones copies are made of: its
/// merges are runs, which judge nothing. The others' chunks merge one page at a time and are
/// marked for KSM within the first period; from then on their pages are left out of the
/// batches, and the lowest region's pages there find no duplicate. They count for their chunks
/// as pages whose duplicates went to KSM, and those chunks go too: KSM merges every page.
#[test]
fn chunks_whose_duplicates_went_to_ksm_follow_them() {
    let Some((_ksm, e)) = with_ksm() else {
        return;
    };
    let n = 4 * CHUNK;
    let content = |region: usize, j: usize| {
        let step = [1, 1237, 4111, 7919][region];
        ((j * step) % n) as u64 + 1
    };
    let regions: Vec<&mut [u8]> = (0..4)
        .map(|k| common::filled(n, |j| content(k, j)))
        .collect();
    let before = KsmRunning::merging_here();
    for r in &regions {
        e.merge(r.as_ptr().cast_mut(), n * PAGE).unwrap();
    }
    // Every region is KSM's, whole, and pageone merges nothing.
    let s = wait_for(&e, |s| s.regions_to_ksm == 4 && s.pages_shared == 0);
    for r in &regions {
        let (first, rest) = mergeable_bytes(r.as_ptr() as usize, n * PAGE);
        assert_eq!(first + rest, n * PAGE, "not all marked for KSM: {s:?}");
    }
    // KSM merges the four copies of every content.
    let merging = 4 * n as u64;
    let deadline = Instant::now() + Duration::from_secs(60);
    while KsmRunning::merged_since(before) < merging && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        KsmRunning::merged_since(before) >= merging,
        "{:?}",
        e.stats()
    );
    for (k, r) in regions.iter().enumerate() {
        for (j, p) in r.chunks(PAGE).enumerate() {
            assert!(check(p, content(k, j)), "region {k} page {j}");
        }
        e.unregister(r.as_ptr().cast_mut(), n * PAGE).unwrap();
    }
}
