//! Dropping pages (`MADV_DONTNEED`, `MADV_FREE`) of registered memory with the kernel's result:
//! merged pages live in private mappings of a store file, which would read their copy again after
//! the kernel's drop, so they are made empty anonymous memory (reading zeros), watched like the
//! rest. Everything here costs what the range holds: its regions, its mappings, its pages.

use std::io;
use std::ops::Range;

use pageone_sync::lock;
use pageone_sys::{self as sys, uapi::MADV_DONTNEED_LOCKED};

use crate::anonymize::{store_pieces, StorePiece};
use crate::changes::Change;
use crate::error::EngineError;
use crate::freeze::STORE_MODE;
use crate::layout::{apply_changes, changing_mappings};
use crate::registry::{checked_range, dropped_pages, overlapping};
use crate::state::{pages_in_mut, region_at, region_at_mut, PageKind, Shared, State};
use crate::store::is_store_mapping;
use crate::stranded;

/// How [`drop_pages`] drops pages (`Engine::drop_pages`): `madvise`'s advice.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DropAdvice {
    /// `MADV_DONTNEED`: the pages read zeros afterwards.
    DontNeed,
    /// `MADV_DONTNEED_LOCKED`: the same, locked pages too.
    DontNeedLocked,
    /// `MADV_FREE`: the pages read zeros or what they held, until written. The kernel refuses it
    /// on file mappings, which merged pages are: those are dropped instead (what it allows).
    Free,
}

impl DropAdvice {
    /// The advice `madvise` takes for it, if it is one of these.
    pub fn from_madvise(advice: libc::c_int) -> Option<Self> {
        match advice {
            libc::MADV_DONTNEED => Some(DropAdvice::DontNeed),
            MADV_DONTNEED_LOCKED => Some(DropAdvice::DontNeedLocked),
            libc::MADV_FREE => Some(DropAdvice::Free),
            _ => None,
        }
    }

    fn raw(self) -> libc::c_int {
        match self {
            DropAdvice::DontNeed => libc::MADV_DONTNEED,
            DropAdvice::DontNeedLocked => MADV_DONTNEED_LOCKED,
            DropAdvice::Free => libc::MADV_FREE,
        }
    }

    /// The advice for a mapping of the store.
    fn for_merged(self) -> libc::c_int {
        match self {
            DropAdvice::Free => libc::MADV_DONTNEED,
            other => other.raw(),
        }
    }
}

/// `madvise(a, len, advice)` as the kernel answers it, with merged pages made empty anonymous
/// memory (see `Engine::drop_pages`). `EngineError::Refused` carries the kernel's refusal.
pub(crate) fn drop_pages(
    sh: &Shared,
    a: usize,
    len: usize,
    advice: DropAdvice,
) -> Result<(), EngineError> {
    let end = checked_range(a, len)?;
    let _change = changing_mappings();
    if drop_whole(sh, a..end, advice)? {
        return Ok(());
    }
    drop_piecewise(sh, a..end, advice)
}

/// The program dropped the pages of `[a, a+len)` itself (`MADV_DONTNEED`; see
/// `Engine::discard`): those in mappings of the store would read their copy again, not zeros, so
/// they become anonymous memory holding nothing. The other pages are not touched: the kernel
/// dropped them.
pub(crate) fn discard(sh: &Shared, a: usize, len: usize) -> Result<(), EngineError> {
    let end = checked_range(a, len)?;
    let _change = changing_mappings();
    let unreported = Unreported::new(sh, merged_pieces(sh, a..end));
    empty_pieces(sh, unreported)
}

/// The whole range in one call to the kernel. The store mappings in it leave the store mappings'
/// context first, so that the kernel's drop reports nothing there: a report holds the caller until
/// the fault thread has read it, a round trip between threads that cost more than the rest.
/// `false` if the kernel refused the call (a locked mapping; `MADV_FREE` of a range holding both
/// kinds of mapping), having applied it to the mappings before the one it refused: the store
/// mappings are then as they were.
fn drop_whole(sh: &Shared, range: Range<usize>, advice: DropAdvice) -> Result<bool, EngineError> {
    let pieces = merged_pieces(sh, range.clone());
    let all_merged = !pieces.is_empty() && covers(&pieces, range.clone());
    let unreported = Unreported::new(sh, pieces);
    let raw = if all_merged {
        advice.for_merged()
    } else {
        advice.raw()
    };
    // SAFETY: the program asked for these pages to be dropped.
    if unsafe { sys::madvise(range.start as *mut u8, range.len(), raw) }.is_err() {
        return Ok(false);
    }
    empty_pieces(sh, unreported).map(|()| true)
}

/// The range mapping by mapping, as the kernel applies `madvise`: it stops at the first mapping it
/// refuses (having dropped the pages before it), and answers `ENOMEM` after a range with holes.
fn drop_piecewise(sh: &Shared, range: Range<usize>, advice: DropAdvice) -> Result<(), EngineError> {
    let maps = sys::self_mappings_in(range.start, range.end).map_err(EngineError::Map)?;
    let (mut at, mut hole) = (range.start, false);
    for m in maps
        .iter()
        .filter(|m| m.end > range.start && m.start < range.end)
    {
        hole |= m.start > at;
        let (s, t) = (m.start.max(range.start), m.end.min(range.end));
        let raw = if is_store_mapping(m) {
            advice.for_merged()
        } else {
            advice.raw()
        };
        // SAFETY: as in `drop_whole`.
        unsafe { sys::madvise(s as *mut u8, t - s, raw) }.map_err(EngineError::Refused)?;
        discard(sh, s, t - s)?;
        at = t;
    }
    if hole || at < range.end {
        return Err(EngineError::Refused(io::Error::from_raw_os_error(
            libc::ENOMEM,
        )));
    }
    Ok(())
}

/// The store mappings of `range` if the engine's pages there say some are merged (else none,
/// without asking the kernel).
fn merged_pieces(sh: &Shared, range: Range<usize>) -> Vec<StorePiece> {
    let mut st = lock(&sh.state);
    apply_changes(sh, &mut st);
    let in_store = stranded::any_in(&st, &range)
        || overlapping(&st, range.clone()).any(|(r, pages)| {
            r.pages[pages].iter().any(|p| {
                matches!(
                    p.kind,
                    PageKind::Merged | PageKind::Broken | PageKind::Foreign
                )
            })
        });
    if in_store {
        store_pieces(sh, &st, range)
    } else {
        Vec::new()
    }
}

/// Whether `pieces` (in address order) cover all of `range`.
fn covers(pieces: &[StorePiece], range: Range<usize>) -> bool {
    let mut at = range.start;
    for p in pieces {
        if p.start > at {
            return false;
        }
        at = at.max(p.end);
    }
    at >= range.end
}

/// Store mappings taken out of the store mappings' context, so that dropping or replacing them
/// reports nothing there; dropped unused, they are registered there again.
struct Unreported<'a> {
    sh: &'a Shared,
    pieces: Vec<(StorePiece, bool)>,
}

impl<'a> Unreported<'a> {
    fn new(sh: &'a Shared, pieces: Vec<StorePiece>) -> Self {
        let pieces = pieces
            .into_iter()
            .map(|p| {
                let out = sh
                    .store_uffd
                    .as_ref()
                    .is_some_and(|u| u.unregister(p.start, p.end - p.start).is_ok());
                (p, out)
            })
            .collect();
        Self { sh, pieces }
    }
}

impl Drop for Unreported<'_> {
    fn drop(&mut self) {
        let Some(u) = &self.sh.store_uffd else { return };
        for (p, out) in self.pieces.drain(..) {
            if out {
                // Still the store mapping: watched again, so that it can be merged again.
                let _ = u.register(p.start, p.end - p.start, STORE_MODE);
            }
        }
    }
}

/// Makes the store mappings of `unreported` empty anonymous memory, registered like the regions
/// around them, and records that their pages hold nothing.
fn empty_pieces(sh: &Shared, mut unreported: Unreported<'_>) -> Result<(), EngineError> {
    if unreported.pieces.is_empty() {
        return Ok(());
    }
    let mut st = lock(&sh.state);
    apply_changes(sh, &mut st);
    let mut result = Ok(());
    // Pieces left mappings of the store, registered there again when `unreported` is dropped.
    let mut kept = Vec::new();
    while let Some((piece, out)) = unreported.pieces.pop() {
        if let Some(r) = region_at_mut(&mut st.regions, piece.start) {
            // Unlocked by a call the engine did not see: emptied unlocked.
            r.forget_unlocked(piece.start, piece.end - piece.start);
        }
        if let Err(e) = empty_store_piece(sh, &st, &piece) {
            let zeroed = zero_in_place(&mut st, &piece);
            kept.push((piece, out));
            if zeroed.is_err() {
                result = Err(e);
                break;
            }
            continue;
        }
        dropped_pages(&mut st, piece.start..piece.end);
        stranded::emptied(&mut st, piece.start..piece.end);
        if let Err(e) = stranded::rewatch(sh, &st, piece.start..piece.end) {
            result = Err(e);
            break;
        }
    }
    unreported.pieces.extend(kept);
    st.store.punch_pending();
    result
}

/// Where the store mapping of `piece` could not be replaced (no mapping to spare at
/// `vm.max_map_count`: replacing part of a mapping splits it), its pages are made to read zeros
/// where they are: zeros written over them make private copies inside the store's mapping, as a
/// write after a merge does. Their copies are released; the pages are watched like any written
/// after a merge.
fn zero_in_place(st: &mut State, piece: &StorePiece) -> Result<(), EngineError> {
    // SAFETY: the program asked for these pages to be dropped: their contents are not kept.
    unsafe { sys::zero_own_memory(piece.start, piece.end - piece.start) }
        .map_err(EngineError::Map)?;
    let State { regions, store, .. } = st;
    for p in pages_in_mut(regions, piece.start..piece.end) {
        if p.kind == PageKind::Merged {
            store.drop_ref(p.sid);
        }
        p.kind = PageKind::Broken;
        p.unchanged = 0;
        p.epoch = p.epoch.wrapping_add(1);
    }
    Ok(())
}

/// Replaces the store mapping of `piece` by an anonymous mapping of the same protection holding
/// nothing (to be watched like the region around it: `watch_emptied`).
///
/// The piece left the store mappings' context first ([`Unreported`]), so replacing it reports
/// nothing there: the kernel would hold this thread until the fault thread read the report. A
/// write to the old mapping meanwhile is dropped with it, as if made before the program's
/// `MADV_DONTNEED` (it is concurrent with the call); one after the replacement lands in the new
/// mapping.
fn empty_store_piece(sh: &Shared, st: &State, piece: &StorePiece) -> Result<(), EngineError> {
    let (s, len) = (piece.start, piece.end - piece.start);
    // Announced all the same, for a context still registered there: its report is the engine's
    // own.
    let change = Change::Unmap {
        start: s,
        end: s + len,
    };
    lock(&sh.changes).expect(change);
    // SAFETY: the range is a mapping of the store the program asked to drop; it is replaced, as a
    // whole, by an empty private anonymous mapping.
    let mapped = unsafe { sys::mmap_anonymous_fixed(s as *mut u8, len, piece.prot) };
    if mapped.is_ok() {
        // Locked and advised where it was (see `locking`, `advice`).
        if let Some(r) = region_at(&st.regions, s) {
            r.relock(s, len);
        }
        crate::advice::over(s..s + len).give_anonymous(s, s, len);
    }
    // A report was read before the call returned (the kernel waits for that), and the fault
    // thread records what it reads before it lets go of the log: an announcement still there
    // now had no report, and must not swallow a later one.
    lock(&sh.changes).unexpect(change);
    mapped.map(drop).map_err(EngineError::Map)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn piece(start: usize, end: usize) -> StorePiece {
        StorePiece {
            start,
            end,
            prot: libc::PROT_READ,
        }
    }

    #[test]
    fn pieces_cover_a_range_only_without_gaps() {
        let p = [piece(0, 4), piece(4, 8), piece(8, 12)];
        assert!(covers(&p, 0..12));
        assert!(covers(&p, 2..10));
        assert!(!covers(&p, 0..13));
        assert!(!covers(&[piece(0, 4), piece(5, 8)], 0..8));
        assert!(!covers(&[], 0..1));
    }

    #[test]
    fn merged_pages_are_dropped_where_the_kernel_refuses_to_free_them() {
        assert_eq!(DropAdvice::Free.for_merged(), libc::MADV_DONTNEED);
        assert_eq!(DropAdvice::Free.raw(), libc::MADV_FREE);
        assert_eq!(DropAdvice::DontNeed.for_merged(), libc::MADV_DONTNEED);
        assert_eq!(DropAdvice::DontNeedLocked.for_merged(), 24);
        for a in [
            DropAdvice::DontNeed,
            DropAdvice::DontNeedLocked,
            DropAdvice::Free,
        ] {
            assert_eq!(DropAdvice::from_madvise(a.raw()), Some(a));
        }
        assert_eq!(DropAdvice::from_madvise(libc::MADV_WILLNEED), None);
    }
}
