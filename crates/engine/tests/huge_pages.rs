//! Transparent huge pages in registered memory, on the real kernel: registering keeps them
//! (nothing sets `MADV_NOHUGEPAGE`), memory first written after registration still gets them,
//! and only the huge pages that hold a merged page are split.

use std::sync::Mutex;
use std::time::Duration;

use pageone_engine::{Engine, WatchMode};
use pageone_sys as sys;

mod common;
use common::{check, fill, wait_for, PAGE};

const HUGE: usize = 2 << 20;
const PER: usize = HUGE / PAGE;

/// The tests run one at a time: they count the process's huge pages.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn engine() -> Engine {
    Engine::builder()
        .merge_period(Duration::from_millis(20))
        .watch(WatchMode::Auto)
        .build()
        .expect("the engine starts on this kernel")
}

/// Private anonymous memory of `len` bytes (a multiple of 2 MiB) aligned to 2 MiB and advised
/// `MADV_HUGEPAGE`, untouched; unmapped on drop.
struct HugeMapping {
    raw: *mut u8,
    base: usize,
    len: usize,
}

impl HugeMapping {
    fn new(len: usize) -> Self {
        let raw = sys::mmap_anonymous(len + HUGE).unwrap();
        let base = (raw as usize + HUGE - 1) & !(HUGE - 1);
        // SAFETY: the range lies inside the mapping made above, which only this test uses.
        unsafe { sys::madvise(base as *mut u8, len, libc::MADV_HUGEPAGE) }.unwrap();
        Self { raw, base, len }
    }

    /// The memory, as the test's own slice (only this thread touches it).
    #[allow(clippy::mut_from_ref)]
    fn bytes(&self) -> &mut [u8] {
        // SAFETY: inside the mapping, which this test owns; callers do not keep two slices.
        unsafe { std::slice::from_raw_parts_mut(self.base as *mut u8, self.len) }
    }

    fn page(&self, i: usize) -> &mut [u8] {
        &mut self.bytes()[i * PAGE..(i + 1) * PAGE]
    }
}

impl Drop for HugeMapping {
    fn drop(&mut self) {
        // SAFETY: the test's own mapping; nothing refers to it any more.
        let _ = unsafe { sys::munmap(self.raw, self.len + HUGE) };
    }
}

/// `AnonHugePages` (bytes) of the mappings of `[a, a+len)` and their `VmFlags`, from
/// `/proc/self/smaps` (a mapping reaching outside the range counts whole).
fn smaps_of(a: usize, len: usize) -> (usize, Vec<String>) {
    let text = std::fs::read_to_string("/proc/self/smaps").unwrap();
    let (mut huge, mut flags, mut inside) = (0, Vec::new(), false);
    for line in text.lines() {
        let first = line.split_whitespace().next().unwrap_or("");
        if let Some((s, e)) = first.split_once('-').filter(|_| !first.ends_with(':')) {
            let (s, e) = (
                usize::from_str_radix(s, 16).unwrap(),
                usize::from_str_radix(e, 16).unwrap(),
            );
            inside = s < a + len && e > a;
        } else if inside {
            if let Some(kb) = line.strip_prefix("AnonHugePages:") {
                huge += kb
                    .trim()
                    .trim_end_matches("kB")
                    .trim()
                    .parse::<usize>()
                    .unwrap()
                    << 10;
            } else if let Some(f) = line.strip_prefix("VmFlags:") {
                flags.push(f.trim().to_string());
            }
        }
    }
    (huge, flags)
}

/// A counter of `/proc/vmstat`.
fn vmstat(name: &str) -> u64 {
    let text = std::fs::read_to_string("/proc/vmstat").unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("/proc/vmstat has no {name}"))
}

/// How many of the pages of `[a, a+len)` a huge page maps (`PAGEMAP_SCAN`'s `PAGE_IS_HUGE`).
fn huge_mapped(a: usize, len: usize) -> usize {
    let pm = sys::Pagemap::open().unwrap();
    pm.count_pages(a, len / PAGE, sys::uapi::PAGE_IS_HUGE)
        .unwrap()
}

/// Whether every page of `m` is mapped by a huge page (filled before); if not, the test is
/// skipped (said on stderr).
fn all_huge(m: &HugeMapping) -> bool {
    let all = huge_mapped(m.base, m.len) == m.len / PAGE;
    if !all {
        eprintln!("skipped: transparent huge pages are not available here");
    }
    all
}

/// The engine `b` builds, if it watches by write-protection; else `None` and the test is skipped
/// (said on stderr).
fn watching_by_write_protection(b: pageone_engine::Builder) -> Option<Engine> {
    let e = b.build().unwrap();
    if e.watch_mode() != WatchMode::UffdWp {
        eprintln!("skipped: no async write-protection here");
        return None;
    }
    Some(e)
}

/// Whether this kernel gives a whole huge page to the first write to the huge zero page (6.18
/// does, 6.8 splits it), tried on memory of the test's own.
fn huge_page_on_first_write() -> bool {
    let m = HugeMapping::new(HUGE);
    // SAFETY: the test's own mapping; reading maps the huge zero page, contents unchanged.
    unsafe { sys::madvise(m.base as *mut u8, HUGE, libc::MADV_POPULATE_READ) }.unwrap();
    m.bytes()[0] = 1;
    huge_mapped(m.base, HUGE) == PER
}

/// (a) A region advised `MADV_HUGEPAGE` with a different content in every page keeps all of its
/// huge pages through registration and many periods, and its mappings are not marked `nh`; the
/// part of it first written after registration gets whole huge pages too (where the kernel gives
/// them to a write to the huge zero page).
#[test]
fn huge_pages_stay_where_nothing_merges() {
    let _g = serial();
    let (filled, fresh) = (8, 4);
    let m = HugeMapping::new((filled + fresh) * HUGE);
    let content = |i: usize| (i + 1) as u64;
    for i in 0..filled * PER {
        fill(m.page(i), content(i));
    }
    let (before, _) = smaps_of(m.base, m.len);
    if before < filled * HUGE {
        eprintln!("skipped: transparent huge pages are not available here");
        return;
    }
    let e = engine();
    e.register(m.base as *mut u8, m.len).unwrap();
    let s = wait_for(&e, |s| s.full_scans >= 8);
    assert_eq!(s.pages_sharing, 0, "{s:?}");
    let (after, flags) = smaps_of(m.base, m.len);
    assert!(
        after >= before,
        "registering split huge pages: AnonHugePages {before} before, {after} after"
    );
    assert_eq!(huge_mapped(m.base, filled * HUGE), filled * PER);
    for f in &flags {
        let words: Vec<&str> = f.split_whitespace().collect();
        assert!(!words.contains(&"nh"), "registered memory lost THP: {f}");
        assert!(
            words.contains(&"hg"),
            "the program's MADV_HUGEPAGE was dropped: {f}"
        );
    }
    // First touches after registration: a whole huge page per 2 MiB where the kernel gives one
    // to a write to the huge zero page, and never a fault the engine's thread answers. Each 2 MiB
    // is looked at just after its first write: a later write to it, once a watch has protected
    // the new huge page, splits its mapping (async write-protection tracks 4 KiB pages; see
    // `docs/DESIGN.md`), and the watch runs every 20 ms here.
    let answered = s.faults_answered;
    let whole_on_write = huge_page_on_first_write();
    let mut small = Vec::new();
    for c in filled..filled + fresh {
        // A huge page the kernel could not allocate (memory too fragmented at the moment) is a
        // fallback it counts, not the engine's doing.
        let fallbacks_before = vmstat("thp_fault_fallback");
        fill(m.page(c * PER), content(c * PER));
        let huge = huge_mapped(m.base + c * HUGE, HUGE) == PER;
        if !huge && vmstat("thp_fault_fallback") == fallbacks_before {
            small.push(c);
        }
        for i in c * PER + 1..(c + 1) * PER {
            fill(m.page(i), content(i));
        }
    }
    let s = wait_for(&e, |t| t.full_scans >= s.full_scans + 4);
    assert_eq!(
        s.faults_answered, answered,
        "first touches reached the engine"
    );
    if whole_on_write {
        assert!(
            small.is_empty(),
            "2 MiB first written after registering got small pages: {small:?} of {filled}..{}",
            filled + fresh
        );
    } else {
        eprintln!("(this kernel splits the huge zero page on a write: first touches are small)");
    }
    for i in 0..m.len / PAGE {
        assert!(check(m.page(i), content(i)), "page {i} changed");
    }
    e.unregister(m.base as *mut u8, m.len).unwrap();
    for i in 0..m.len / PAGE {
        assert!(
            check(m.page(i), content(i)),
            "page {i} changed by unregistering"
        );
    }
}

/// (b) Huge pages half of whose pages are duplicates: those pages merge (one copy each, every
/// byte right), the other pages stay as they were, huge pages with nothing to merge stay huge, a
/// write to a merged page breaks only its copy-on-write, and unregistering gives every byte
/// back.
#[test]
fn half_duplicate_huge_pages_merge_their_duplicates_only() {
    let _g = serial();
    let (halves, unique) = (6, 2);
    let m = HugeMapping::new((halves + unique) * HUGE);
    // In the first huge pages, even pages hold the same contents in each (duplicates), odd
    // pages contents of their own; the last huge pages hold contents of their own only.
    let content = |i: usize| {
        let (h, o) = (i / PER, i % PER);
        if h < halves && o % 2 == 0 {
            o as u64 + 1
        } else {
            (i + 1_000_000) as u64
        }
    };
    for i in 0..m.len / PAGE {
        fill(m.page(i), content(i));
    }
    if !all_huge(&m) {
        return;
    }
    let splits_before = vmstat("thp_split_page");
    let e = engine();
    e.register(m.base as *mut u8, m.len).unwrap();
    let distinct = (PER / 2) as u64;
    let sharing = distinct * (halves as u64 - 1);
    let s = wait_for(&e, |s| s.pages_sharing >= sharing);
    assert_eq!(
        (s.pages_shared, s.pages_sharing),
        (distinct, sharing),
        "{s:?}"
    );
    assert_eq!(s.zero_pages, 0, "{s:?}");
    for i in 0..m.len / PAGE {
        assert!(check(m.page(i), content(i)), "page {i} changed by merging");
    }
    // Only the huge pages holding a merged page were split.
    let rest = halves * HUGE;
    assert_eq!(
        huge_mapped(m.base + rest, unique * HUGE),
        unique * PER,
        "a huge page with nothing to merge was split"
    );
    assert_eq!(
        huge_mapped(m.base, rest),
        0,
        "a huge page holding merged pages"
    );
    // Their folios were split too (the count is the system's: other processes only add to it),
    // so the merged pages' memory was freed, not kept by partly mapped huge folios.
    let splits = vmstat("thp_split_page") - splits_before;
    assert!(
        splits >= halves as u64,
        "{splits} huge folios split, not {halves}"
    );
    // Copy-on-write: a write to a merged page changes that page only.
    let w = PER + 4;
    m.page(w)[100] = 0xAB;
    let s = wait_for(&e, |s| s.cow_breaks >= 1);
    assert_eq!(s.cow_breaks, 1, "{s:?}");
    assert_eq!(s.pages_sharing, sharing - 1, "{s:?}");
    for i in (0..m.len / PAGE).filter(|&i| i != w) {
        assert!(
            check(m.page(i), content(i)),
            "page {i} changed by the write"
        );
    }
    assert_eq!(m.page(w)[100], 0xAB);
    e.unregister(m.base as *mut u8, m.len).unwrap();
    assert_eq!(e.stable_pages(), 0);
    for i in 0..m.len / PAGE {
        let mut want = [0u8; PAGE];
        fill(&mut want, content(i));
        if i == w {
            want[100] = 0xAB;
        }
        assert!(m.page(i) == want, "page {i} changed by unregistering");
    }
}

/// (c) Huge pages split by writes after registration (async write-protection splits a protected
/// huge page at its first write) are collapsed back once their pages are unique and quiet, every
/// byte unchanged; a write after that is still seen (a page made a duplicate merges). With
/// `restore_huge_pages` off they stay split.
#[test]
fn huge_pages_split_by_writes_come_back_where_nothing_merges() {
    let _g = serial();
    for restore in [true, false] {
        let n = 6;
        let m = HugeMapping::new(n * HUGE);
        let content = |i: usize, round: u64| (i as u64 + 1) * 1000 + round;
        for i in 0..m.len / PAGE {
            fill(m.page(i), content(i, 0));
        }
        if !all_huge(&m) {
            return;
        }
        let Some(e) = watching_by_write_protection(
            Engine::builder()
                .merge_period(Duration::from_millis(20))
                .watch(WatchMode::Auto)
                .restore_huge_pages(restore),
        ) else {
            return;
        };
        e.register(m.base as *mut u8, m.len).unwrap();
        wait_for(&e, |s| s.full_scans >= 4);
        // Written again: each huge page's first write splits it.
        for i in 0..m.len / PAGE {
            fill(m.page(i), content(i, 1));
        }
        assert_eq!(huge_mapped(m.base, m.len), 0, "the writes split them");
        let scans = e.stats().full_scans;
        let s = wait_for(&e, |s| {
            s.huge_pages_restored >= n as u64 || (!restore && s.full_scans >= scans + 12)
        });
        let scans = s.full_scans;
        let s = wait_for(&e, |s| s.full_scans >= scans + 6);
        assert_eq!(s.pages_sharing, 0, "{s:?}");
        for i in 0..m.len / PAGE {
            assert!(check(m.page(i), content(i, 1)), "page {i} changed");
        }
        if !restore {
            assert_eq!(s.huge_pages_restored, 0, "{s:?}");
            assert_eq!(huge_mapped(m.base, m.len), 0, "nothing collapses them");
            e.unregister(m.base as *mut u8, m.len).unwrap();
            continue;
        }
        assert!(s.huge_pages_restored >= n as u64, "{s:?}");
        assert_eq!(
            huge_mapped(m.base, m.len),
            m.len / PAGE,
            "collapsed back, and not split again while nothing is written"
        );
        // A write after the collapse is seen: page 1 becomes a copy of page 0 and merges.
        fill(m.page(1), content(0, 1));
        let s = wait_for(&e, |s| s.pages_sharing >= 1);
        assert_eq!(s.pages_sharing, 1, "{s:?}");
        assert!(check(m.page(1), content(0, 1)));
        for i in (0..m.len / PAGE).filter(|&i| i != 1) {
            assert!(check(m.page(i), content(i, 1)), "page {i} changed");
        }
        e.unregister(m.base as *mut u8, m.len).unwrap();
        for i in (0..m.len / PAGE).filter(|&i| i != 1) {
            assert!(
                check(m.page(i), content(i, 1)),
                "page {i} changed by unregistering"
            );
        }
    }
}

/// (d) Writers keep writing unique contents into one huge page after another (each keeps a
/// shadow of what it wrote and checks every page it reads) while the engine collapses the quiet
/// ones back: no write is lost, whether it lands before, during or after a collapse.
#[test]
fn no_write_is_lost_while_huge_pages_are_collapsed_back() {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    let _g = serial();
    let chunks = 16;
    let m = HugeMapping::new(chunks * HUGE);
    let n = m.len / PAGE;
    // Every page a content of its own in every round: nothing merges.
    let word =
        |page: usize, round: u64, w: usize| ((page as u64 + 1) << 32) ^ (round << 12) ^ w as u64;
    let base = m.base;
    let write = move |page: usize, round: u64| {
        let p = (base + page * PAGE) as *mut u64;
        for w in 0..PAGE / 8 {
            // SAFETY: the page is inside the test's mapping and owned by the writing thread.
            unsafe { std::ptr::write_volatile(p.add(w), word(page, round, w)) };
        }
    };
    let read_ok = move |page: usize, round: u64| {
        let p = (base + page * PAGE) as *const u64;
        // SAFETY: as above.
        (0..PAGE / 8).all(|w| unsafe { std::ptr::read_volatile(p.add(w)) } == word(page, round, w))
    };
    for page in 0..n {
        write(page, 0);
    }
    if !all_huge(&m) {
        return;
    }
    let Some(e) = watching_by_write_protection(
        Engine::builder()
            .merge_period(Duration::from_millis(10))
            .merge_periods(1),
    ) else {
        return;
    };
    e.register(m.base as *mut u8, m.len).unwrap();
    let writers = 2;
    let (stop, lost, writes) = (AtomicBool::new(false), AtomicU64::new(0), AtomicU64::new(0));
    std::thread::scope(|s| {
        for t in 0..writers {
            let (stop, lost, writes) = (&stop, &lost, &writes);
            s.spawn(move || {
                let mut shadow = vec![0u64; n];
                let mut x: u64 = 0x9E37_79B9_7F4A_7C15 ^ t as u64;
                let mut next = || {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x
                };
                let t0 = std::time::Instant::now();
                while !stop.load(Ordering::Relaxed) {
                    // The hot huge page moves on every 150 ms; the others go quiet.
                    let hot = (t0.elapsed().as_millis() / 150) as usize * 5 % chunks;
                    for _ in 0..16 {
                        let page = hot * PER + (next() as usize % (PER / writers)) * writers + t;
                        if !read_ok(page, shadow[page]) {
                            lost.fetch_add(1, Ordering::Relaxed);
                        }
                        shadow[page] += 1;
                        write(page, shadow[page]);
                        writes.fetch_add(1, Ordering::Relaxed);
                    }
                    std::thread::sleep(Duration::from_micros(300));
                }
                for page in (t..n).step_by(writers) {
                    if !read_ok(page, shadow[page]) {
                        lost.fetch_add(1, Ordering::Relaxed);
                    }
                }
            });
        }
        // At least 4 s, and until enough huge pages were collapsed back under the writers (a
        // busy machine starves the engine's idle-priority threads): 30 s at most.
        let t0 = std::time::Instant::now();
        while t0.elapsed() < Duration::from_secs(4)
            || (e.stats().huge_pages_restored < 4 && t0.elapsed() < Duration::from_secs(30))
        {
            std::thread::sleep(Duration::from_millis(100));
        }
        stop.store(true, Ordering::Relaxed);
    });
    let s = e.stats();
    eprintln!("{} writes; {s:?}", writes.load(Ordering::Relaxed));
    assert_eq!(lost.load(Ordering::Relaxed), 0, "writes were lost");
    assert!(
        s.huge_pages_restored >= 4,
        "too few huge pages collapsed back to prove anything: {s:?}"
    );
    assert_eq!(s.pages_sharing, 0, "{s:?}");
    e.unregister(m.base as *mut u8, m.len).unwrap();
}
