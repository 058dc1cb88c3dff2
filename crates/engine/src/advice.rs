//! Advice the program gave its memory that the engine's mappings carry over: not to be dumped
//! (`MADV_DONTDUMP`) and not to be inherited by a child (`MADV_DONTFORK`).
//!
//! The kernel keeps such advice in the flags of a mapping, and what the engine maps over
//! registered memory (merged pages, released pages, memory given back as anonymous memory) is a
//! mapping of its own, made without them: merged guest memory that QEMU asked to leave out of
//! core dumps would be dumped, and a child would inherit memory the program kept from it. So the
//! embedder (the `LD_PRELOAD` shim) reports the program's advice ([`advised`]), and the engine
//! gives what it maps the advice the memory it replaces was given ([`carry_over`]).
//!
//! One table for the process, by address: advice may come before the memory is registered. A
//! range is forgotten where the program unmaps, maps over or moves memory, as the embedder or the
//! kernel (for registered memory) reports it ([`mapping_gone`]). Memory unmapped and mapped again
//! where neither sees it (glibc's `free` and `malloc` of large blocks) would keep stale advice,
//! so where the table holds advice over memory being registered, it is checked against the
//! kernel's flags (`/proc/self/smaps`, read only then: [`check_registered`]).
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

/// Most parts advised at once (more take another pass): a fixed array, so that the committer
/// allocates nothing while a run is frozen.
const PARTS: usize = 8;

/// Gives `[addr, addr + len)`, just mapped by the engine over registered memory, the advice the
/// program gave that memory. The table's lock is not held during the calls (the fault thread
/// takes it while it holds the changes' lock, which mapping may take). Allocates nothing. A
/// failure leaves the part as it is: dumped and inherited, as unadvised memory.
pub(crate) fn carry_over(addr: usize, len: usize) {
    carry_over_to(addr, addr, len);
}

/// As [`carry_over`], for memory of the engine's at `to` about to be moved over
/// `[addr, addr + len)`.
pub(crate) fn carry_over_to(to: usize, addr: usize, len: usize) {
    if !ANY.load(Ordering::Relaxed) {
        return;
    }
    let end = addr + len;
    for advice in [libc::MADV_DONTDUMP, libc::MADV_DONTFORK] {
        let mut from = addr;
        while from < end {
            let mut parts: [Range<usize>; PARTS] = std::array::from_fn(|_| 0..0);
            let mut n = 0;
            {
                let t = lock(&TABLE);
                let set = if advice == libc::MADV_DONTDUMP {
                    &t.no_dump
                } else {
                    &t.no_fork
                };
                for r in set.within(from..end).take(PARTS) {
                    parts[n] = r;
                    n += 1;
                }
            }
            for r in &parts[..n] {
                let at = to + (r.start - addr);
                // SAFETY: the advice changes no contents; the range is the engine's (just mapped
                // over registered memory, or about to be).
                let _ = unsafe { sys::madvise(at as *mut u8, r.len(), advice) };
            }
            if n < PARTS {
                break;
            }
            // Full: the rest in another pass (the parts are in address order).
            from = parts[n - 1].end;
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

    /// What the engine maps is given the advice the table holds for it, in as many passes as it
    /// takes.
    #[test]
    fn mapped_memory_carries_the_advice_in_passes() {
        let n = 2 * PARTS + 3;
        let len = 2 * n * 4096;
        let p = sys::mmap_anonymous(len).unwrap() as usize;
        for k in 0..n {
            advised(
                p + 2 * k * 4096..p + (2 * k + 1) * 4096,
                libc::MADV_DONTDUMP,
            );
        }
        advised(p..p + len, libc::MADV_DONTFORK);
        carry_over(p, len);
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
