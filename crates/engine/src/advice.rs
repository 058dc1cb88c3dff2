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

/// The program's advice in force, by address: a set per kind of [`KINDS`].
struct Table([RangeSet; KINDS.len()]);

#[allow(clippy::declare_interior_mutable_const)] // The initialiser of the table below.
const EMPTY: RangeSet = RangeSet::new();

static TABLE: Mutex<Table> = Mutex::new(Table([EMPTY; KINDS.len()]));

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
    for (k, set) in KINDS.iter().zip(&mut t.0) {
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
    t.0.iter_mut().for_each(|set| set.remove(range.clone()));
}

/// `range` is being registered: where the table holds advice over it, that advice becomes the
/// kernel's (stale advice of memory unmapped unseen is dropped, advice given unseen is added).
pub(crate) fn check_registered(range: Range<usize>) {
    if !ANY.load(Ordering::Relaxed) {
        return;
    }
    let held = {
        let t = lock(&TABLE);
        t.0.iter()
            .any(|set| set.within(range.clone()).next().is_some())
    };
    if !held {
        return;
    }
    let flags = KINDS.map(|k| k.flag);
    let Ok(kernel) = sys::self_mappings_flagged_each(&flags) else {
        // Unread, the table stands.
        return;
    };
    let mut t = lock(&TABLE);
    for (set, flagged) in t.0.iter_mut().zip(kernel) {
        set.remove(range.clone());
        for m in flagged {
            set.add(m.start.max(range.start)..m.end.min(range.end));
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
    for (kind, set) in t.0.iter().enumerate() {
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

    fn in_table(r: Range<usize>) -> (bool, bool) {
        let t = lock(&TABLE);
        let dump = t.0[0].within(r.clone()).next().is_some();
        let fork = t.0[1].within(r).next().is_some();
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
        let dump: Vec<_> = t.0[0].within(p..p + len).collect();
        assert_eq!(dump, vec![p + 4096..p + 2 * 4096]);
        assert_eq!(t.0[1].within(p..p + len).next(), None);
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
