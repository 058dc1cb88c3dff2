//! Store mappings in registered memory made anonymous memory again, holding the same bytes: on
//! unregistering, on leaving a replaced store, and for pieces stranded at the mapping limit.
//!
//! Each step holds writers off a span with write-protection, copies it into a fresh anonymous
//! mapping and moves that over the span in one `mremap`. The step's fixed costs (a report of the
//! unmapping the kernel holds the caller for until the fault thread reads it, a TLB flush, four
//! system calls) dwarf its copy for one page, and single merged pages are a mapping each: so
//! store mappings side by side are made anonymous together, a span at a time.

use std::ops::Range;
// std's atomic: a process-wide flag for tests (loom models the lock-free index, not the engine).
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use pageone_sync::lock;
use pageone_sys::{self as sys, uapi::*};

use crate::access::PAGE;
use crate::advice::Advice;
use crate::changes::Change;
use crate::state::{Shared, State};
use crate::store::is_private_store_mapping;

/// The longest span of store mappings made anonymous in one step (a single mapping longer than
/// this is done whole, as it stands): writers of the span wait for its copy, and the fresh
/// mapping holds a second copy of its bytes until it replaces the old.
const SPAN: usize = 256 * PAGE;

/// A piece of registered memory that is a mapping of the store (merged pages, and pages written
/// after their merge), with its protection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct StorePiece {
    pub(crate) start: usize,
    pub(crate) end: usize,
    pub(crate) prot: libc::c_int,
}

/// The pieces of `range` that are mappings of a store (this engine's, one it replaced, or the one
/// of the process it was forked from), from the process's mappings there (asked of the kernel for
/// the range alone).
pub(crate) fn store_pieces(sh: &Shared, st: &State, range: Range<usize>) -> Vec<StorePiece> {
    sh.maps
        .in_range(range.start, range.end)
        .unwrap_or_default()
        .iter()
        .filter(|m| st.store.maps_inode(m.inode) || is_private_store_mapping(m))
        .map(|m| StorePiece {
            start: m.start.max(range.start),
            end: m.end.min(range.end),
            prot: m.prot(),
        })
        .collect()
}

/// What [`anonymize_pieces`] does after a piece that could not be made anonymous.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum OnFailure {
    /// Tries every other piece (unregistering: each piece left is stranded).
    TryTheRest,
    /// Tries no more (a retry once a period, which the mapping limit would fail alike).
    Stop,
}

/// Makes the store mappings `pieces` anonymous memory, those side by side with the same
/// protection together (see the module's comment), and returns the ranges made anonymous and
/// the pieces that were not. A span that fails is tried again mapping by mapping.
pub(crate) fn anonymize_pieces(
    sh: &Shared,
    pieces: Vec<StorePiece>,
    on_failure: OnFailure,
) -> (Vec<Range<usize>>, Vec<StorePiece>) {
    let (mut done, mut failed) = (Vec::new(), Vec::new());
    let mut trying = true;
    for group in spans(&pieces, SPAN) {
        let (first, last) = (&pieces[group.start], &pieces[group.end - 1]);
        if trying && anonymize(sh, first.start, last.end, first.prot) {
            done.push(first.start..last.end);
            continue;
        }
        for p in &pieces[group.clone()] {
            if trying && group.len() > 1 && anonymize(sh, p.start, p.end, p.prot) {
                done.push(p.start..p.end);
            } else {
                failed.push(*p);
                trying &= on_failure == OnFailure::TryTheRest;
            }
        }
    }
    (done, failed)
}

/// `pieces` (in address order) in groups, as index ranges: each group's pieces lie side by side
/// with the same protection, and span at most `max` bytes unless it is one piece alone.
fn spans(pieces: &[StorePiece], max: usize) -> Vec<Range<usize>> {
    let mut groups: Vec<Range<usize>> = Vec::new();
    for (i, p) in pieces.iter().enumerate() {
        let joins = groups.last().is_some_and(|g| {
            let (first, last) = (&pieces[g.start], &pieces[g.end - 1]);
            last.end == p.start && last.prot == p.prot && p.end - first.start <= max
        });
        match groups.last_mut() {
            Some(g) if joins => g.end = i + 1,
            _ => groups.push(i..i + 1),
        }
    }
    groups
}

/// Replaces the store mapping `[s, e)` by anonymous memory with the same contents: writers are
/// held off with write-protection, the pages are copied into a fresh anonymous mapping, and that
/// mapping is moved over the old one in one step (`mremap`), then writers are woken. Returns false
/// (changing nothing) if any step is not possible.
pub(crate) fn anonymize(sh: &Shared, s: usize, e: usize, prot: libc::c_int) -> bool {
    let Some(u2) = &sh.store_uffd else {
        return false;
    };
    let len = e - s;
    // The program's advice, read before writers are held off (see `advice`), and where it
    // changes (allocating: not while they are).
    let advice = crate::advice::over(s..e);
    let cuts = advice.cuts(s, e);
    // Registered for write-protection through the store mappings' context, which kernels before
    // 6.17 dropped when the main context unregistered the range: register again if so.
    let protected = u2.writeprotect(s, len, true).is_ok()
        || (u2.register(s, len, UFFDIO_REGISTER_MODE_WP).is_ok()
            && u2.writeprotect(s, len, true).is_ok());
    if !protected {
        let _ = u2.writeprotect(s, len, false);
        return false;
    }
    // Pages of the span lost to a refusal after unmapping (see `into_the_hole`).
    let mut lost = 0;
    // How far the copy was moved over the span: `e` once all of it was.
    let moved_to = match sys::mmap_anonymous(len) {
        Ok(tmp) => {
            // Filled in one call first: 1.5 times faster than a fault per page during the copy
            // (64 MiB: 35 ms against 45-57). Best effort: the copy faults what is not.
            // SAFETY: `tmp` is ours alone; populating it writes nothing into it.
            let _ = unsafe { sys::madvise(tmp, len, libc::MADV_POPULATE_WRITE) };
            // The source is held still (writers block on write-protection) and read through the
            // kernel, as the program's memory; `tmp` is ours alone, `len` bytes long.
            // SAFETY: `tmp` is writable for `len` bytes.
            let copied = unsafe { sys::read_own_memory(tmp, &[(s, len)]) }.ok() == Some(len);
            // With the protection the program gave the pages.
            let copied = copied
                && (prot == RW
                    // SAFETY: `tmp` is ours alone.
                    || unsafe { sys::raw_mprotect(tmp.cast(), len, prot) } == 0);
            // Advised as the memory it replaces.
            advice.give_anonymous(tmp as usize, s, len);
            if copied {
                let copy = Copy {
                    tmp: tmp as usize,
                    prot,
                    advice: &advice,
                };
                move_over(sh, &copy, s..e, &cuts, &mut lost)
            } else {
                // SAFETY: `tmp` is ours and nothing refers to it.
                let _ = unsafe { sys::munmap(tmp, len) };
                s
            }
        }
        Err(_) => s,
    };
    if moved_to < e {
        // Writers let go over the store mappings left, from where the move stopped: the kernel
        // stops at the first mapping in the range this context does not hold, which the parts
        // moved (anonymous memory now) would be.
        let _ = u2.writeprotect(moved_to, e - moved_to, false);
    }
    // Writers blocked on the old mapping retry their fault in the new one.
    let _ = u2.wake(s, len);
    if lost > 0 {
        tracing::error!(
            pages = lost,
            at = format_args!("{s:#x}"),
            "pages of merged memory were lost: the kernel refused to move their copy after \
             unmapping them, and another thread mapped memory in their place meanwhile"
        );
    }
    moved_to == e
}

/// A span's copy, in a fresh anonymous mapping at `tmp`, with what the memory it replaces had.
struct Copy<'a> {
    tmp: usize,
    prot: libc::c_int,
    advice: &'a Advice,
}

/// A failure a test asked for (`Engine::fail_a_copys_move_after`). (Taken only by the engine's
/// moves and the test's request, never by a program thread that could write a span held still.)
static FAIL: Mutex<Option<Failure>> = Mutex::new(None);

/// Whether a test ever asked for a failure: until then, no move takes the lock. (Relaxed: the
/// test asks before it unregisters, which hands the range to the engine through locks.)
static ASKED: AtomicBool = AtomicBool::new(false);

/// The part moves inside `within` to let through before one fails, and how that one fails.
struct Failure {
    after: usize,
    within: Range<usize>,
    how: MoveFailure,
}

/// How the move of a copy's part a test asks to fail fails (`Engine::fail_a_copys_move_after`).
#[doc(hidden)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MoveFailure {
    /// Refused, the destination left as it was.
    Refused,
    /// Refused after unmapping the destination (as Linux 6.8 to 6.16 may).
    AfterUnmapping,
    /// As `AfterUnmapping`, with another thread's mapping of `pages` pages (each holding
    /// [`SQUATTER`] in every word) made at the end of the hole before the engine goes on.
    AfterUnmappingTaken { pages: usize },
    /// As `AfterUnmapping`, and the move into the hole refused too, before unmapping anything.
    AfterUnmappingTwice,
}

/// Whether the next move into a hole is to be refused (`MoveFailure::AfterUnmappingTwice`).
static REFUSE_INTO_THE_HOLE: AtomicBool = AtomicBool::new(false);

/// What each word of a mapping made in a hole by [`MoveFailure::AfterUnmappingTaken`] holds.
#[doc(hidden)]
pub const SQUATTER: u64 = 0x5351_5541_5454_4552;

pub(crate) fn fail_a_move_after(after: usize, within: Range<usize>, how: MoveFailure) {
    *lock(&FAIL) = Some(Failure { after, within, how });
    ASKED.store(true, Ordering::Relaxed);
}

/// Whether the failure a test asked for has not happened yet.
pub(crate) fn failure_pending() -> bool {
    lock(&FAIL).is_some()
}

/// Whether the move of the part `[at, end)` is the one a test asked to fail (then it is unmapped
/// first if asked).
fn move_fails_here(at: usize, end: usize) -> bool {
    if !ASKED.load(Ordering::Relaxed) {
        return false;
    }
    let mut fail = lock(&FAIL);
    let Some(f) = fail.as_mut().filter(|f| f.within.contains(&at)) else {
        return false;
    };
    if f.after > 0 {
        f.after -= 1;
        return false;
    }
    if f.how != MoveFailure::Refused {
        // SAFETY: the part's bytes are in the copy; this is what the kernel does before it
        // refuses.
        let _ = unsafe { sys::munmap(at as *mut u8, end - at) };
    }
    match f.how {
        MoveFailure::AfterUnmappingTaken { pages } => squat(end - pages * PAGE..end),
        MoveFailure::AfterUnmappingTwice => REFUSE_INTO_THE_HOLE.store(true, Ordering::Relaxed),
        _ => {}
    }
    *fail = None;
    true
}

/// Maps `r`, a hole, as another thread of the program would, filled with [`SQUATTER`].
fn squat(r: Range<usize>) {
    if sys::mmap_anonymous_where_free(r.start, r.end - r.start, RW).is_err() {
        return;
    }
    for w in (r).step_by(8) {
        // SAFETY: a word of the mapping just made, which nothing else refers to yet.
        unsafe { (w as *mut u64).write_volatile(SQUATTER) };
    }
}

/// Moves the copy at `tmp` over `to` part by part, between the places `cuts` where the advice
/// given to it changes: each part is one mapping. (Advice given part by part splits the copy into
/// several mappings, and kernels before 6.17 move only one mapping a call; they refuse only after
/// unmapping the destination, whose bytes were then lost with the copy.) Returns how far it
/// moved (`to.end` once all of it was); the parts of the copy not moved are unmapped. (A part
/// moved stays moved: it is anonymous memory holding the bytes of the pages it replaced.)
fn move_over(
    sh: &Shared,
    copy: &Copy,
    to: Range<usize>,
    cuts: &[usize],
    lost: &mut usize,
) -> usize {
    let ends = cuts.iter().copied().chain(std::iter::once(to.end));
    let mut at = to.start;
    for end in ends {
        // Moving it over the store mapping unmaps that: the engine's own change.
        let change = Change::Unmap { start: at, end };
        lock(&sh.changes).expect(change);
        let from = copy.tmp + (at - to.start);
        let mut moved = if move_fails_here(at, end) {
            Err(std::io::Error::from_raw_os_error(libc::ENOMEM))
        } else {
            // SAFETY: `[from, from + (end - at))` is one whole mapping of ours (see above); the
            // destination holds exactly the bytes just copied and belongs to the registered
            // region.
            unsafe { sys::mremap_fixed(from as *mut u8, end - at, at as *mut u8) }
        };
        if moved.is_err() && sys::is_unmapped(at) {
            // Linux 6.8 to 6.16 may refuse after unmapping the destination (short of memory):
            // the pages' bytes are the copy's alone, and go into the hole.
            *lost += into_the_hole(copy, from, at..end);
            moved = Ok(());
        }
        // A report was read before the call returned (the kernel waits for that), and the
        // fault thread records what it reads before it lets go of the log: an announcement
        // still there now had no report (the range was not registered, or not moved), and
        // must not swallow a later one.
        lock(&sh.changes).unexpect(change);
        if moved.is_err() {
            // SAFETY: the rest of the copy is ours and nothing refers to it.
            let _ = unsafe { sys::munmap(from as *mut u8, to.end - at) };
            return at;
        }
        at = end;
    }
    at
}

/// Puts the copy's part at `from` into the hole `part` that a move refused after unmapping it
/// left, and returns how many of its pages were lost. The hole is address space the kernel may
/// give another thread of the program meanwhile, whose mapping there must not be replaced: so
/// the part goes there whole where nothing is mapped, else page by page around what is (see
/// [`put`]). A page another thread took is lost: its place is that thread's memory now.
fn into_the_hole(copy: &Copy, from: usize, part: Range<usize>) -> usize {
    let lost = if put(copy, from, part.clone()) {
        0
    } else {
        (part.clone())
            .step_by(PAGE)
            .filter(|&p| !put(copy, from + (p - part.start), p..p + PAGE))
            .count()
    };
    // What is left of the copy's part (pages not put), ours alone.
    // SAFETY: nothing refers to it.
    let _ = unsafe { sys::munmap(from as *mut u8, part.end - part.start) };
    lost
}

/// Puts the copy's bytes at `src` into `r`, part of a hole, if nothing is mapped anywhere in it:
/// `r` is claimed first with an inaccessible mapping made only where nothing is
/// (`MAP_FIXED_NOREPLACE`), and the bytes move over the claim in one step. Where that move is
/// refused with the claim still in place, they are copied into it. False (the bytes stay at
/// `src`) if `r` could not be claimed, or the claim went with a refused move.
fn put(copy: &Copy, src: usize, r: Range<usize>) -> bool {
    let len = r.end - r.start;
    if sys::mmap_anonymous_where_free(r.start, len, libc::PROT_NONE).is_err() {
        return false;
    }
    // (Refused as a test asked, the claim left in place.)
    let refused = REFUSE_INTO_THE_HOLE.swap(false, Ordering::Relaxed);
    // SAFETY: `[src, src + len)` lies in one mapping of ours (the copy's part), the destination
    // is the claim just made, which nothing refers to.
    if !refused && unsafe { sys::mremap_fixed(src as *mut u8, len, r.start as *mut u8) }.is_ok() {
        return true;
    }
    if !is_claim(&r) {
        return false;
    }
    if copy.prot & libc::PROT_READ == 0 {
        // Readable to be copied. SAFETY: the copy is ours alone.
        unsafe { sys::raw_mprotect(src as *mut libc::c_void, len, libc::PROT_READ) };
    }
    // SAFETY: the claim is ours; inaccessible until now, nothing refers to it.
    let writable = unsafe { sys::raw_mprotect(r.start as *mut libc::c_void, len, RW) } == 0;
    // SAFETY: as above, now writable.
    let copied = writable
        && unsafe { sys::read_own_memory(r.start as *mut u8, &[(src, len)]) }.ok() == Some(len);
    if !copied {
        // No page is better than a wrong one. SAFETY: as above.
        let _ = unsafe { sys::munmap(r.start as *mut u8, len) };
        return false;
    }
    copy.advice.give_anonymous(r.start, r.start, len);
    if copy.prot != RW {
        // SAFETY: as above.
        unsafe { sys::raw_mprotect(r.start as *mut libc::c_void, len, copy.prot) };
    }
    true
}

/// Whether `r` is exactly one inaccessible anonymous mapping: the claim [`put`] made, left in
/// place by a refused move.
fn is_claim(r: &Range<usize>) -> bool {
    sys::self_mappings_in(r.start, r.end).is_ok_and(|maps| {
        matches!(maps.as_slice(), [m] if m.start == r.start && m.end == r.end
            && m.inode == 0 && m.perms.starts_with("---"))
    })
}

/// Read and write: the protection of a fresh copy.
const RW: libc::c_int = libc::PROT_READ | libc::PROT_WRITE;

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Pieces from (gap before, pages, protection) triples, from address 1 MiB on.
    fn pieces(shape: &[(u8, u8, bool)]) -> Vec<StorePiece> {
        let mut at = 1 << 20;
        shape
            .iter()
            .map(|&(gap, pages, ro)| {
                let start = at + usize::from(gap) * PAGE;
                at = start + (usize::from(pages) + 1) * PAGE;
                StorePiece {
                    start,
                    end: at,
                    prot: if ro {
                        libc::PROT_READ
                    } else {
                        libc::PROT_READ | libc::PROT_WRITE
                    },
                }
            })
            .collect()
    }

    proptest! {
        #[test]
        fn spans_cover_every_piece_in_order_and_join_only_neighbours(
            shape in prop::collection::vec((0u8..2, 0u8..6, any::<bool>()), 0..64),
            max_pages in 1usize..12,
        ) {
            let ps = pieces(&shape);
            let max = max_pages * PAGE;
            let groups = spans(&ps, max);
            let mut next = 0;
            for g in &groups {
                prop_assert_eq!(g.start, next);
                prop_assert!(g.end > g.start);
                next = g.end;
                let (first, last) = (&ps[g.start], &ps[g.end - 1]);
                prop_assert!(g.len() == 1 || last.end - first.start <= max);
                for w in ps[g.clone()].windows(2) {
                    prop_assert_eq!(w[0].end, w[1].start);
                    prop_assert_eq!(w[0].prot, w[1].prot);
                }
            }
            prop_assert_eq!(next, ps.len());
            // Greedy: a group ends only where the next piece could not join it.
            for w in groups.windows(2) {
                let (first, last, next) = (&ps[w[0].start], &ps[w[0].end - 1], &ps[w[1].start]);
                prop_assert!(
                    last.end != next.start || last.prot != next.prot || next.end - first.start > max
                );
            }
        }
    }
}
