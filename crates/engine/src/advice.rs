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
//! range is forgotten where the program unmaps, maps over or moves memory, as the embedder or the
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
//! Not carried: advice given with a raw system call the embedder does not see, and advice over
//! memory the program moved (`mremap`: forgotten at both ends, so what the engine maps there
//! later is dumped and inherited, as memory the program never advised).

use std::ops::Range;
// std's atomics: a process-wide static hint (loom models the lock-free index, not the engine).
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use pageone_sync::lock;
use pageone_sys as sys;

use crate::ranges::RangeSet;

/// The program's advice in force, by address.
struct Table {
    /// Not dumped (`MADV_DONTDUMP`; `MADV_DODUMP` takes it back).
    no_dump: RangeSet,
    /// Not inherited by a child (`MADV_DONTFORK`; `MADV_DOFORK` takes it back).
    no_fork: RangeSet,
}

static TABLE: Mutex<Table> = Mutex::new(Table {
    no_dump: RangeSet::new(),
    no_fork: RangeSet::new(),
});

/// Whether any advice was ever reported: until then, unmapping costs no lock. (Relaxed: a
/// hint; an `advised` racing with a `mapping_gone` of the same range is the program's race.)
static ANY: AtomicBool = AtomicBool::new(false);

/// The program gave `range` `advice` (the kernel accepted it): `MADV_DONTDUMP`, `MADV_DODUMP`,
/// `MADV_DONTFORK` or `MADV_DOFORK`, which what the engine maps there later carries too. Other
/// advice is ignored.
pub fn advised(range: Range<usize>, advice: i32) {
    if matches!(advice, libc::MADV_DONTDUMP | libc::MADV_DONTFORK) {
        ANY.store(true, Ordering::Relaxed);
    }
    let mut t = lock(&TABLE);
    match advice {
        libc::MADV_DONTDUMP => t.no_dump.add(range),
        libc::MADV_DODUMP => t.no_dump.remove(range),
        libc::MADV_DONTFORK => t.no_fork.add(range),
        libc::MADV_DOFORK => t.no_fork.remove(range),
        _ => {}
    }
}

/// The program unmapped `range`, mapped something new over it, or moved it: its advice is gone
/// with the mapping.
pub fn mapping_gone(range: Range<usize>) {
    if !ANY.load(Ordering::Relaxed) {
        return;
    }
    let mut t = lock(&TABLE);
    t.no_dump.remove(range.clone());
    t.no_fork.remove(range);
}

/// `range` is being registered: where the table holds advice over it, that advice becomes the
/// kernel's (stale advice of memory unmapped unseen is dropped, advice given unseen is added).
pub(crate) fn check_registered(range: Range<usize>) {
    if !ANY.load(Ordering::Relaxed) {
        return;
    }
    let held = {
        let t = lock(&TABLE);
        t.no_dump.within(range.clone()).next().is_some()
            || t.no_fork.within(range.clone()).next().is_some()
    };
    if !held {
        return;
    }
    let (Ok(no_dump), Ok(no_fork)) = (
        sys::self_mappings_flagged("dd"),
        sys::self_mappings_flagged("dc"),
    ) else {
        // Unread, the table stands.
        return;
    };
    let mut guard = lock(&TABLE);
    let t = &mut *guard;
    for (set, kernel) in [(&mut t.no_dump, no_dump), (&mut t.no_fork, no_fork)] {
        set.remove(range.clone());
        for m in kernel {
            set.add(m.start.max(range.start)..m.end.min(range.end));
        }
    }
}

/// The program's advice over a range, read before the engine holds writers off there (see the
/// module's comment), to give what it maps there while they are held.
#[derive(Debug, Default)]
pub(crate) struct Advice {
    parts: Vec<(Range<usize>, i32)>,
}

/// The advice the table holds over `range` now (none without a lock where none was ever given).
pub(crate) fn over(range: Range<usize>) -> Advice {
    let mut out = Advice::default();
    if !ANY.load(Ordering::Relaxed) {
        return out;
    }
    let t = lock(&TABLE);
    for (set, advice) in [
        (&t.no_dump, libc::MADV_DONTDUMP),
        (&t.no_fork, libc::MADV_DONTFORK),
    ] {
        out.parts
            .extend(set.within(range.clone()).map(|r| (r, advice)));
    }
    out
}

impl Advice {
    /// Gives the parts of `[addr, addr + len)`, just mapped by the engine, the advice read for
    /// them. Allocates nothing and takes no lock. A failure leaves the part as it is: dumped and
    /// inherited, as unadvised memory.
    pub(crate) fn give(&self, addr: usize, len: usize) {
        self.give_at(addr, addr, len);
    }

    /// As [`give`](Self::give), for memory of the engine's at `to` about to be moved over
    /// `[addr, addr + len)`.
    pub(crate) fn give_at(&self, to: usize, addr: usize, len: usize) {
        for (r, advice) in &self.parts {
            let (s, e) = (r.start.max(addr), r.end.min(addr + len));
            if s < e {
                // SAFETY: the advice changes no contents; the range is the engine's, just mapped
                // over registered memory or about to be moved there.
                let _ = unsafe { sys::madvise((to + (s - addr)) as *mut u8, e - s, *advice) };
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

    fn in_table(r: Range<usize>) -> (bool, bool) {
        let t = lock(&TABLE);
        let dump = t.no_dump.within(r.clone()).next().is_some();
        let fork = t.no_fork.within(r).next().is_some();
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

    /// Advice left by memory unmapped unseen is dropped when the range is registered: the
    /// kernel's flags are what holds.
    #[test]
    fn registering_checks_the_tables_advice_against_the_kernels() {
        let len = 4 * 4096;
        let p = sys::mmap_anonymous(len).unwrap() as usize;
        // SAFETY: the test's own mapping.
        unsafe { sys::madvise((p + 4096) as *mut u8, 4096, libc::MADV_DONTDUMP) }.unwrap();
        // The table says more than the kernel: stale advice.
        advised(p..p + len, libc::MADV_DONTDUMP);
        advised(p..p + len, libc::MADV_DONTFORK);
        check_registered(p..p + len);
        let t = lock(&TABLE);
        let dump: Vec<_> = t.no_dump.within(p..p + len).collect();
        assert_eq!(dump, vec![p + 4096..p + 2 * 4096]);
        assert_eq!(t.no_fork.within(p..p + len).next(), None);
        drop(t);
        mapping_gone(p..p + len);
        // SAFETY: the test's own mapping, which nothing refers to.
        unsafe { sys::munmap(p as *mut u8, len) }.unwrap();
    }

    /// What the engine maps is given the advice the table holds for it, part by part.
    #[test]
    fn mapped_memory_carries_the_advice_part_by_part() {
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
        over(p..p + len).give(p, len);
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
