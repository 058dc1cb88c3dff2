//! Advice the program gave its memory that the engine's mappings carry over: not to be dumped
//! (`MADV_DONTDUMP`) and not to be inherited by a child (`MADV_DONTFORK`).
//!
//! The kernel keeps such advice in the flags of a mapping, and what the engine maps over
//! registered memory (merged pages, released pages, memory given back as anonymous memory) is a
//! mapping of its own, made without them: merged guest memory that QEMU asked to leave out of
//! core dumps would be dumped, and a child would inherit memory the program kept from it. So the
//! embedder (the `LD_PRELOAD` shim) reports the program's advice ([`advised`]), and the engine
//! gives what it maps the advice the memory it replaces was given ([`over`]).
//!
//! One table for the process, by address: advice may come before the memory is registered. A
//! range is forgotten where the program unmaps or maps over memory, as the embedder or the
//! kernel (for registered memory) reports it ([`mapping_gone`]). Memory unmapped and mapped again
//! where neither sees it (glibc's `free` and `malloc` of large blocks) would keep stale advice,
//! so where the table holds advice over memory being registered, it is checked against the
//! kernel's flags (`/proc/self/smaps`, read only then: [`check_registered`]).
//!
//! The table's lock is never taken while the engine holds writers off, nor by the fault thread:
//! a program thread holds it in [`advised`], where it may allocate, and so may wait for a thread
//! that waits on a frozen run. So the advice over a run is read before its writers are held off
//! ([`over`]) and given to what the engine maps there while they still are (as locking is), and
//! the kernel's reports of the program's unmaps and moves are applied with the rest of its
//! changes (`layout::apply_changes`), before the engine maps anything there.
//!
//! Memory the program moves (`mremap`) takes its advice along ([`mapping_moved`]), as the
//! embedder or the kernel reports the move; the advice where it went is then checked against the
//! kernel's flags, except huge-page advice over merged pages, which mappings of the store do not
//! carry: the table's stands there.
//!
//! The kernel's reports are applied up to a period after they were read, and the memory they
//! name may have been mapped again and advised meanwhile by another thread: they apply only where
//! the embedder reported nothing since they were read (see [`clock`]).
//!
//! Not carried: advice given with a raw system call the embedder does not see (a raw
//! `MADV_DOFORK` leaves the engine giving `MADV_DONTFORK`), and the old place's advice after a
//! move with `MREMAP_DONTUNMAP` that the embedder does not see (taken along; the kernel leaves
//! it at both places).

use std::collections::VecDeque;
use std::ops::Range;
// std's atomics: a process-wide static hint and clock (loom models the lock-free index, not the
// engine).
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;

use pageone_sync::lock;
use pageone_sys as sys;

use crate::ranges::RangeSet;

/// Advice the kernel keeps in a mapping's flags, which the engine's mappings carry over.
struct Kind {
    /// The advice that sets it, and the one that clears it.
    on: i32,
    off: i32,
    /// Its name among the `VmFlags` of `/proc/self/smaps`.
    flag: &'static str,
    /// Whether mappings of the store carry it too, or only anonymous memory the engine maps (a
    /// huge page in a mapping of the store would fill the file's holes).
    on_copies: bool,
}

const KINDS: [Kind; 4] = [
    // Not dumped.
    Kind {
        on: libc::MADV_DONTDUMP,
        off: libc::MADV_DODUMP,
        flag: "dd",
        on_copies: true,
    },
    // Not inherited by a child.
    Kind {
        on: libc::MADV_DONTFORK,
        off: libc::MADV_DOFORK,
        flag: "dc",
        on_copies: true,
    },
    // Huge pages wanted (where the system gives them only on advice, as Debian and Ubuntu do).
    Kind {
        on: libc::MADV_HUGEPAGE,
        off: libc::MADV_NOHUGEPAGE,
        flag: "hg",
        on_copies: false,
    },
    // Huge pages refused.
    Kind {
        on: libc::MADV_NOHUGEPAGE,
        off: libc::MADV_HUGEPAGE,
        flag: "nh",
        on_copies: false,
    },
];

/// The program's advice in force, by address.
struct Table {
    /// A set per kind of [`KINDS`].
    sets: [RangeSet; KINDS.len()],
    /// The ranges the embedder reported lately, each with the [`clock`] after its report, the
    /// newest last: a report of the kernel's read before then does not apply there (see
    /// [`untouched`]).
    touched: VecDeque<(Range<usize>, u64)>,
}

/// The most reports of the embedder's kept in [`Table::touched`]: past it, the oldest go (a
/// kernel's report applied after that many newer may then undo one: advice, never contents).
const TOUCHED: usize = 1024;

/// Counts the embedder's reports: the kernel's reports are applied a period late, and memory
/// unmapped or moved away may be mapped again and advised by then (by another thread of the
/// program), which they must not undo.
static CLOCK: AtomicU64 = AtomicU64::new(0);

/// The clock now: read by the fault thread before it reads the kernel's reports, the changes
/// read then apply to advice reported before (see [`Table::touched`]). Lock-free. (SeqCst,
/// pairing with the `fetch_add` of [`touch`]: a report of the embedder's after the kernel's
/// event was read, which the kernel's locks order after that read, counts past it.)
pub(crate) fn clock() -> u64 {
    CLOCK.load(Ordering::SeqCst)
}

/// Notes a report of the embedder's over `range` (see [`Table::touched`]).
fn touch(t: &mut Table, range: Range<usize>) {
    // SeqCst: see `clock`.
    let at = CLOCK.fetch_add(1, Ordering::SeqCst) + 1;
    if t.touched.len() == TOUCHED {
        t.touched.pop_front();
    }
    t.touched.push_back((range, at));
}

/// The parts of `range` the embedder reported nothing over since the clock read `since`.
/// (Reports before then are kept for others: each engine of the process applies its own.)
fn untouched(t: &Table, range: Range<usize>, since: u64) -> Vec<Range<usize>> {
    let mut left = RangeSet::new();
    left.add(range.clone());
    for (r, _) in t.touched.iter().filter(|&&(_, at)| at > since) {
        left.remove(r.clone());
    }
    left.within(range).collect()
}

#[allow(clippy::declare_interior_mutable_const)] // The initialiser of the table below.
const EMPTY: RangeSet = RangeSet::new();

static TABLE: Mutex<Table> = Mutex::new(Table {
    sets: [EMPTY; KINDS.len()],
    touched: VecDeque::new(),
});

/// Whether any advice was ever reported: until then, unmapping costs no lock. (Relaxed: a
/// hint; an `advised` racing with a `mapping_gone` of the same range is the program's race.)
static ANY: AtomicBool = AtomicBool::new(false);

/// The program gave `range` `advice` (the kernel accepted it): `MADV_DONTDUMP`, `MADV_DODUMP`,
/// `MADV_DONTFORK`, `MADV_DOFORK`, `MADV_HUGEPAGE` or `MADV_NOHUGEPAGE`, which what the engine
/// maps there later carries too. Other advice is ignored.
pub fn advised(range: Range<usize>, advice: i32) {
    if KINDS.iter().any(|k| k.on == advice) {
        ANY.store(true, Ordering::Relaxed);
    }
    let mut t = lock(&TABLE);
    if KINDS.iter().any(|k| advice == k.on || advice == k.off) {
        touch(&mut t, range.clone());
    }
    for (k, set) in KINDS.iter().zip(&mut t.sets) {
        if advice == k.on {
            set.add(range.clone());
        } else if advice == k.off {
            set.remove(range.clone());
        }
    }
}

/// The program unmapped `range`, mapped something new over it, or moved it: its advice is gone
/// with the mapping.
pub fn mapping_gone(range: Range<usize>) {
    if !ANY.load(Ordering::Relaxed) {
        return;
    }
    let mut t = lock(&TABLE);
    touch(&mut t, range.clone());
    t.sets.iter_mut().for_each(|set| set.remove(range.clone()));
}

/// The kernel reported that the program unmapped registered memory, in a report read when the
/// clock read `since`: its advice is gone, but where the embedder reported something since
/// (memory mapped there again, and advised).
pub(crate) fn unmapped_by_kernel(range: Range<usize>, since: u64) {
    if !ANY.load(Ordering::Relaxed) {
        return;
    }
    let mut t = lock(&TABLE);
    for part in untouched(&t, range, since) {
        t.sets.iter_mut().for_each(|set| set.remove(part.clone()));
    }
}

/// The program moved the memory at `from` to `to` (`mremap`; `to` as long as the memory is
/// now), as the embedder saw it: its advice goes with it, as the kernel's flags go with the
/// moved mapping. Where the table holds none at `from` but some at `to`, the kernel's report
/// of the same move was applied first (see [`moved_by_kernel`]), which knows the old length
/// only: the kernel's flags say what holds over all of `to`.
pub fn mapping_moved(from: Range<usize>, to: Range<usize>) {
    if !ANY.load(Ordering::Relaxed) {
        return;
    }
    let mut t = lock(&TABLE);
    touch(&mut t, from.clone());
    touch(&mut t, to.clone());
    // Advice at `to` already: the kernel reported the move, or a part of it (a move of several
    // mappings is reported one by one, and the engine may apply some before this report). What
    // it moved stays beside the rest, and the kernel's flags then settle `to`.
    let reported = holds(&t, &to);
    if holds(&t, &from) {
        move_advice(&mut t, from, to.clone());
    }
    drop(t);
    if reported {
        refresh(to);
    }
}

/// The kernel reported that the program moved registered memory from `from` to `to`: the
/// advice goes with it unless the embedder moved it already (it reports the moves it sees, in
/// either order with this), and then the table's advice at `to` becomes what the kernel's
/// flags say there (whoever moved it; advice the table held at `to` from memory unmapped there
/// unseen is dropped).
#[cfg(test)]
pub(crate) fn moved_by_kernel(from: Range<usize>, to: Range<usize>) {
    let mut later = Vec::new();
    moved_by_kernel_later(from, to, clock(), &mut later);
    refresh_all(&later);
}

/// As `moved_by_kernel`, for a report read when the clock read `since`, and with the check
/// against the kernel's flags put off: the range to check is added to `later`, for one read of
/// the kernel's flags after all the moves reported together ([`refresh_all`]). (A move of many
/// mappings is reported one by one: a read of `/proc/self/smaps` for each, each of them long
/// with many merged pages, took minutes.) Where the embedder reported something since (its
/// report of the same move, or memory mapped at `from` again and advised), nothing moves.
pub(crate) fn moved_by_kernel_later(
    from: Range<usize>,
    to: Range<usize>,
    since: u64,
    later: &mut Vec<Range<usize>>,
) {
    if !ANY.load(Ordering::Relaxed) {
        return;
    }
    let mut t = lock(&TABLE);
    let (parts, there) = (
        untouched(&t, from.clone(), since),
        untouched(&t, to.clone(), since),
    );
    for set in &mut t.sets {
        let moved: Vec<Range<usize>> = parts.iter().flat_map(|p| set.within(p.clone())).collect();
        if moved.is_empty() {
            // (What `to` holds of this kind went there by the embedder's report, or is checked
            // below.)
            continue;
        }
        parts.iter().for_each(|p| set.remove(p.clone()));
        there.iter().for_each(|p| set.remove(p.clone()));
        for r in moved.into_iter().map(|r| shifted(r, &from, &to)) {
            for p in &there {
                let (s, e) = (r.start.max(p.start), r.end.min(p.end));
                if s < e {
                    set.add(s..e);
                }
            }
        }
    }
    if holds(&t, &to) {
        later.push(to);
    }
}

/// Moves the table's advice at `from` to `to`, beside what it holds there.
fn move_advice(t: &mut Table, from: Range<usize>, to: Range<usize>) {
    for set in &mut t.sets {
        let moved: Vec<Range<usize>> = set.within(from.clone()).collect();
        set.remove(from.clone());
        for r in moved {
            set.add(shifted(r, &from, &to));
        }
    }
}

/// Part `r` of `from`, where the memory moved to `to` holds it (clipped to `to` where the memory
/// shrank; where it grew, a part at `from`'s end reaches `to`'s: the kernel's flags are the
/// mapping's).
fn shifted(r: Range<usize>, from: &Range<usize>, to: &Range<usize>) -> Range<usize> {
    let at = |a: usize| (a - from.start + to.start).min(to.end);
    let end = if r.end == from.end { to.end } else { at(r.end) };
    at(r.start)..end
}

/// Whether the table holds any advice over `range`.
fn holds(t: &Table, range: &Range<usize>) -> bool {
    t.sets
        .iter()
        .any(|set| set.within(range.clone()).next().is_some())
}

/// `range` is being registered: where the table holds advice over it, that advice becomes the
/// kernel's (stale advice of memory unmapped unseen is dropped, advice given unseen is added).
pub(crate) fn check_registered(range: Range<usize>) {
    if !ANY.load(Ordering::Relaxed) {
        return;
    }
    if !holds(&lock(&TABLE), &range) {
        return;
    }
    refresh(range);
}

/// The table's advice over `range` becomes what the kernel's flags say (see [`refresh_all`]).
fn refresh(range: Range<usize>) {
    refresh_all(&[range]);
}

/// The table's advice over each of `ranges` becomes what the kernel's flags say
/// (`/proc/self/smaps`, read once), except advice that mappings of the store never carry (huge
/// pages), which stands over them: the kernel's flags there say what the engine gave, not what
/// the program asked.
pub(crate) fn refresh_all(ranges: &[Range<usize>]) {
    if ranges.is_empty() {
        return;
    }
    let flags = KINDS.map(|k| k.flag);
    let Ok(kernel) = sys::self_mappings_flagged_each(&flags) else {
        // Unread, the table stands.
        return;
    };
    for range in ranges {
        let Ok(maps) = sys::self_mappings_in(range.start, range.end) else {
            continue;
        };
        let store: Vec<Range<usize>> = maps
            .iter()
            .filter(|m| crate::store::is_store_mapping(m))
            .map(|m| m.start..m.end)
            .collect();
        let clip = |m: &Range<usize>| m.start.max(range.start)..m.end.min(range.end);
        let mut t = lock(&TABLE);
        for ((set, flagged), kind) in t.sets.iter_mut().zip(&kernel).zip(&KINDS) {
            let standing: Vec<Range<usize>> = if kind.on_copies {
                Vec::new()
            } else {
                store.iter().flat_map(|m| set.within(clip(m))).collect()
            };
            set.remove(range.clone());
            // (In address order: those ending after the range's start, up to its end.)
            let first = flagged.partition_point(|m| m.end <= range.start);
            let within = flagged[first..].iter().take_while(|m| m.start < range.end);
            for m in within.map(clip).chain(standing) {
                set.add(m);
            }
        }
    }
}

/// The program's advice over a range, read before the engine holds writers off there (see the
/// module's comment), to give what it maps there while they are held.
#[derive(Debug, Default)]
pub(crate) struct Advice {
    /// The parts advised, with the kind ([`KINDS`]) of each.
    parts: Vec<(Range<usize>, usize)>,
}

/// The advice the table holds over `range` now (none without a lock where none was ever given).
pub(crate) fn over(range: Range<usize>) -> Advice {
    let mut out = Advice::default();
    if !ANY.load(Ordering::Relaxed) {
        return out;
    }
    let t = lock(&TABLE);
    for (kind, set) in t.sets.iter().enumerate() {
        out.parts
            .extend(set.within(range.clone()).map(|r| (r, kind)));
    }
    out
}

impl Advice {
    /// Gives the parts of `[addr, addr + len)`, just mapped by the engine as mappings of the
    /// store, the advice read for them that such mappings carry. Allocates nothing and takes no
    /// lock. A failure leaves the part unadvised.
    pub(crate) fn give_copies(&self, addr: usize, len: usize) {
        self.give(addr, addr, len, true);
    }

    /// The places inside `(s, e)` where the advice changes, in address order: where memory
    /// given it may be split into mappings.
    pub(crate) fn cuts(&self, s: usize, e: usize) -> Vec<usize> {
        let mut cuts: Vec<usize> = (self.parts.iter())
            .flat_map(|(r, _)| [r.start, r.end])
            .filter(|&a| s < a && a < e)
            .collect();
        cuts.sort_unstable();
        cuts.dedup();
        cuts
    }

    /// As [`give_copies`](Self::give_copies), for anonymous memory the engine mapped at `addr`
    /// (or at `to`, to be moved there): every kind of advice.
    pub(crate) fn give_anonymous(&self, to: usize, addr: usize, len: usize) {
        self.give(to, addr, len, false);
    }

    fn give(&self, to: usize, addr: usize, len: usize, copies: bool) {
        for (r, kind) in &self.parts {
            let k = &KINDS[*kind];
            let (s, e) = (r.start.max(addr), r.end.min(addr + len));
            if s < e && (k.on_copies || !copies) {
                // SAFETY: the advice changes no contents; the range is the engine's, just mapped
                // over registered memory or about to be moved there.
                let _ = unsafe { sys::madvise((to + (s - addr)) as *mut u8, e - s, k.on) };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A test's own range, far from anything mapped, so tests in parallel do not meet.
    fn range(k: usize) -> Range<usize> {
        let base = 0x5a5a_0000_0000 + k * 0x1000_0000;
        base..base + 64 * 4096
    }

    /// Held by the tests that advise memory they map: one unmaps an address another may map and
    /// advise next, and the table is the process's (a test found another's advice where its own
    /// memory had been).
    fn own_mappings() -> std::sync::MutexGuard<'static, ()> {
        static ONE: Mutex<()> = Mutex::new(());
        ONE.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn in_table(r: Range<usize>) -> (bool, bool) {
        let t = lock(&TABLE);
        let dump = t.sets[0].within(r.clone()).next().is_some();
        let fork = t.sets[1].within(r).next().is_some();
        (dump, fork)
    }

    #[test]
    fn advice_is_kept_taken_back_and_forgotten_by_address() {
        let r = range(1);
        advised(r.clone(), libc::MADV_DONTDUMP);
        advised(r.start..r.start + 4096, libc::MADV_DONTFORK);
        advised(r.clone(), libc::MADV_WIPEONFORK);
        assert_eq!(in_table(r.clone()), (true, true));
        advised(r.start..r.start + 4096, libc::MADV_DOFORK);
        assert_eq!(in_table(r.clone()), (true, false));
        mapping_gone(r.start + 4096..r.end);
        assert_eq!(in_table(r.start + 4096..r.end), (false, false));
        advised(r.clone(), libc::MADV_DODUMP);
        assert_eq!(in_table(r), (false, false));
    }

    /// A part of the memory moved goes where the memory went: clipped where it shrank, and a part
    /// at its end reaches the new end where it grew.
    #[test]
    fn a_moved_part_lands_where_the_memory_went() {
        let (from, to) = (0x10000..0x20000, 0x50000..0x58000);
        assert_eq!(shifted(0x11000..0x12000, &from, &to), 0x51000..0x52000);
        assert_eq!(shifted(0x17000..0x1a000, &from, &to), 0x57000..0x58000);
        assert_eq!(shifted(0x1a000..0x1b000, &from, &to), 0x58000..0x58000);
        let grown = 0x50000..0x60000 + 0x4000;
        assert_eq!(shifted(0x1f000..0x20000, &from, &grown), 0x5f000..0x64000);
        assert_eq!(shifted(0x11000..0x12000, &from, &grown), 0x51000..0x52000);
    }

    /// Memory moved (and grown) takes its advice along, whichever reports the move first: the
    /// embedder, or the kernel (whose report also checks the advice at the new place against
    /// the kernel's flags).
    #[test]
    fn moved_memory_takes_its_advice_along_whoever_reports_it_first() {
        let _one = own_mappings();
        let (len, grown) = (4 * 4096, 6 * 4096);
        for embedder_first in [true, false] {
            let a = sys::mmap_anonymous(len).unwrap() as usize;
            let b = sys::mmap_anonymous(grown).unwrap() as usize;
            // SAFETY: the test's own mappings, which nothing refers to.
            let moved = unsafe {
                sys::madvise(a as *mut u8, len, libc::MADV_DONTFORK).unwrap();
                advised(a..a + len, libc::MADV_DONTFORK);
                libc::mremap(
                    a as *mut libc::c_void,
                    len,
                    grown,
                    libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED,
                    b as *mut libc::c_void,
                )
            };
            assert_eq!(moved as usize, b);
            if embedder_first {
                mapping_moved(a..a + len, b..b + grown);
                moved_by_kernel(a..a + len, b..b + len);
            } else {
                moved_by_kernel(a..a + len, b..b + len);
                mapping_moved(a..a + len, b..b + grown);
            }
            assert_eq!(in_table(a..a + len), (false, false));
            let t = lock(&TABLE);
            let fork: Vec<_> = t.sets[1].within(b..b + grown).collect();
            let whole = b..b + grown;
            assert_eq!(fork, vec![whole], "embedder first: {embedder_first}");
            drop(t);
            mapping_gone(b..b + grown);
            // SAFETY: the test's own mapping, which nothing refers to.
            unsafe { sys::munmap(b as *mut u8, grown) }.unwrap();
        }
    }

    /// The places where advice over a range changes: the ends of its parts inside the range,
    /// once each, in order.
    #[test]
    fn advice_is_cut_where_its_parts_end_inside_the_range() {
        let advice = Advice {
            parts: vec![
                (0x3000..0x9000, 0),
                (0x1000..0x5000, 1),
                (0x9000..0xa000, 2),
            ],
        };
        assert_eq!(advice.cuts(0x2000, 0x9000), vec![0x3000, 0x5000]);
        assert_eq!(
            advice.cuts(0x0, 0x10000),
            vec![0x1000, 0x3000, 0x5000, 0x9000, 0xa000]
        );
        assert_eq!(advice.cuts(0x5000, 0x9000), Vec::<usize>::new());
        assert_eq!(Advice::default().cuts(0, 0x1000), Vec::<usize>::new());
    }

    /// A move of two mappings the kernel reports one by one, the embedder's report of the whole
    /// move coming between the two: each part's advice lands where it went (the embedder's
    /// report once dropped the part the kernel had moved already).
    #[test]
    fn a_move_reported_in_parts_around_the_embedders_report_keeps_every_parts_advice() {
        let _one = own_mappings();
        let (half, len) = (2 * 4096, 4 * 4096);
        let a = sys::mmap_anonymous(len).unwrap() as usize;
        let b = sys::mmap_anonymous(len).unwrap() as usize;
        // SAFETY: the test's own mapping, which nothing refers to.
        unsafe { sys::madvise(a as *mut u8, len, libc::MADV_DONTFORK) }.unwrap();
        advised(a..a + len, libc::MADV_DONTFORK);
        for part in [0, half] {
            // SAFETY: a part of the test's own mapping moves onto its place in the other.
            let moved = unsafe {
                libc::mremap(
                    (a + part) as *mut libc::c_void,
                    half,
                    half,
                    libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED,
                    (b + part) as *mut libc::c_void,
                )
            };
            assert_eq!(moved as usize, b + part);
        }
        moved_by_kernel(a..a + half, b..b + half);
        mapping_moved(a..a + len, b..b + len);
        moved_by_kernel(a + half..a + len, b + half..b + len);
        assert_eq!(in_table(a..a + len), (false, false));
        let t = lock(&TABLE);
        let fork: Vec<_> = t.sets[1].within(b..b + len).collect();
        assert_eq!(fork, vec![b..b + len]);
        drop(t);
        mapping_gone(b..b + len);
        // SAFETY: the test's own mapping, which nothing refers to.
        unsafe { sys::munmap(b as *mut u8, len) }.unwrap();
    }

    /// The kernel's report of a move applied after the embedder's, and after memory with other
    /// advice was mapped at the old place (by another thread of the program): the new memory
    /// keeps its advice, and the moved memory keeps the huge-page advice the embedder's report
    /// moved (both were lost once; the second made 64 pages of a move come back without huge
    /// pages on Linux 6.12). An unmapping reported late leaves the new memory's advice too.
    #[test]
    fn the_kernels_late_reports_leave_advice_reported_since() {
        let (a, b) = (range(7), range(8));
        let half = a.start + 32 * 4096;
        advised(a.clone(), libc::MADV_HUGEPAGE);
        // The kernel's report of the move of the first half is read.
        let read = clock();
        mapping_moved(a.clone(), b.clone());
        advised(a.start..half, libc::MADV_DONTDUMP);
        let mut later = Vec::new();
        moved_by_kernel_later(
            a.start..half,
            b.start..b.start + (half - a.start),
            read,
            &mut later,
        );
        let t = lock(&TABLE);
        let huge: Vec<_> = t.sets[2].within(b.clone()).collect();
        let dump: Vec<_> = t.sets[0].within(a.clone()).collect();
        let first_half = a.start..half;
        assert_eq!((huge, dump), (vec![b.clone()], vec![first_half]));
        drop(t);
        // And the report of its unmapping, read before it was mapped again and advised.
        let read = clock();
        advised(a.start..half, libc::MADV_DONTFORK);
        unmapped_by_kernel(a.clone(), read);
        assert_eq!(in_table(a.clone()), (true, true));
        unmapped_by_kernel(a.clone(), clock());
        assert_eq!(in_table(a.clone()), (false, false));
        mapping_gone(b);
    }

    /// A move the kernel reports from memory with no advice, to where the table holds advice
    /// the kernel's flags do not (memory unmapped there unseen): that advice is dropped.
    #[test]
    fn a_reported_move_onto_stale_advice_drops_it() {
        let _one = own_mappings();
        let len = 4 * 4096;
        let p = sys::mmap_anonymous(len).unwrap() as usize;
        advised(p..p + len, libc::MADV_DONTFORK);
        moved_by_kernel(range(5), p..p + len);
        assert_eq!(in_table(p..p + len), (false, false));
        // SAFETY: the test's own mapping, which nothing refers to.
        unsafe { sys::munmap(p as *mut u8, len) }.unwrap();
    }

    /// Advice left by memory unmapped unseen is dropped when the range is registered: the
    /// kernel's flags are what holds.
    #[test]
    fn registering_checks_the_tables_advice_against_the_kernels() {
        let _one = own_mappings();
        let len = 4 * 4096;
        let p = sys::mmap_anonymous(len).unwrap() as usize;
        // SAFETY: the test's own mapping.
        unsafe { sys::madvise((p + 4096) as *mut u8, 4096, libc::MADV_DONTDUMP) }.unwrap();
        // The table says more than the kernel: stale advice.
        advised(p..p + len, libc::MADV_DONTDUMP);
        advised(p..p + len, libc::MADV_DONTFORK);
        check_registered(p..p + len);
        let t = lock(&TABLE);
        let dump: Vec<_> = t.sets[0].within(p..p + len).collect();
        assert_eq!(dump, vec![p + 4096..p + 2 * 4096]);
        assert_eq!(t.sets[1].within(p..p + len).next(), None);
        drop(t);
        mapping_gone(p..p + len);
        // SAFETY: the test's own mapping, which nothing refers to.
        unsafe { sys::munmap(p as *mut u8, len) }.unwrap();
    }

    /// What the engine maps is given the advice the table holds for it, part by part.
    #[test]
    fn mapped_memory_carries_the_advice_part_by_part() {
        let _one = own_mappings();
        let n = 19;
        let len = 2 * n * 4096;
        let p = sys::mmap_anonymous(len).unwrap() as usize;
        for k in 0..n {
            advised(
                p + 2 * k * 4096..p + (2 * k + 1) * 4096,
                libc::MADV_DONTDUMP,
            );
        }
        advised(p..p + len, libc::MADV_DONTFORK);
        over(p..p + len).give_copies(p, len);
        let dd = sys::self_mappings_flagged("dd").unwrap();
        let dc = sys::self_mappings_flagged("dc").unwrap();
        mapping_gone(p..p + len);
        for k in 0..2 * n {
            let at = p + k * 4096;
            let dumped = !dd.iter().any(|m| m.contains(&at));
            assert_eq!(dumped, k % 2 == 1, "page {k}");
            assert!(dc.iter().any(|m| m.contains(&at)), "page {k} inherited");
        }
        // SAFETY: the test's own mapping, which nothing refers to.
        unsafe { sys::munmap(p as *mut u8, len) }.unwrap();
    }
}
