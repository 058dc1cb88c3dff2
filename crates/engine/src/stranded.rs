//! Store mappings left behind where memory stopped being registered at the mapping limit.
//!
//! Unregistering makes merged pages anonymous memory again (`registry::anonymize`), through a
//! temporary mapping; at `vm.max_map_count` there is none to spare, and such a piece stays a
//! private mapping of the store, each page a private copy of its bytes. After a `MADV_DONTNEED`
//! it would read its copy again, not zeros. So the engine remembers the piece:
//! - it keeps the copies its merged pages mapped, so that a drop it does not see reads the page's
//!   own old bytes, never another page's (a copy released could be given to other contents);
//! - it drops the piece's pages as it drops merged ones when the program drops them through it
//!   (`Engine::drop_pages`, which the shim calls): they read zeros;
//! - it tries once a period to make the piece anonymous memory again, and forgets it when that
//!   is done or when the piece no longer maps the store (unmapped or replaced by the program).

use std::ops::Range;

use pageone_index::KeyId;
use pageone_sync::lock;

use crate::access::PAGE;
use crate::error::EngineError;
use crate::layout::{apply_changes, changing_mappings};
use crate::registry::{anonymize, dropped_pages, overlapping, store_pieces, watch_emptied};
use crate::state::{Shared, State};

/// A piece of memory no longer registered that still maps the store.
#[derive(Debug)]
pub(crate) struct Stranded {
    pub(crate) range: Range<usize>,
    /// The copies its merged pages map, by page address: kept while it is stranded.
    pub(crate) copies: Vec<(usize, KeyId)>,
}

impl Stranded {
    fn meets(&self, range: &Range<usize>) -> bool {
        self.range.start < range.end && range.start < self.range.end
    }
}

/// Whether a stranded piece meets `range`.
pub(crate) fn any_in(st: &State, range: &Range<usize>) -> bool {
    st.stranded.iter().any(|s| s.meets(range))
}

/// The pages of `range` no longer map the store (the engine replaced them by empty anonymous
/// memory): the copies they mapped are released and the pieces cut around the range.
pub(crate) fn emptied(st: &mut State, range: Range<usize>) {
    if !any_in(st, &range) {
        return;
    }
    let State {
        stranded, store, ..
    } = st;
    let mut kept = Vec::with_capacity(stranded.len() + 1);
    for s in stranded.drain(..) {
        if !s.meets(&range) {
            kept.push(s);
            continue;
        }
        let (inside, outside): (Vec<_>, Vec<_>) =
            s.copies.into_iter().partition(|c| range.contains(&c.0));
        for (_, id) in inside {
            store.drop_ref(id);
        }
        for part in [s.range.start..range.start, range.end..s.range.end] {
            if part.start < part.end {
                let copies = outside
                    .iter()
                    .copied()
                    .filter(|c| part.contains(&c.0))
                    .collect();
                kept.push(Stranded {
                    range: part,
                    copies,
                });
            }
        }
    }
    *stranded = kept;
}

/// Tries to make every stranded piece anonymous memory again (see the module), between periods.
/// Costs nothing when there is none.
pub(crate) fn repair(sh: &Shared) {
    if lock(&sh.state).stranded.is_empty() {
        return;
    }
    let _change = changing_mappings();
    let mut st = lock(&sh.state);
    apply_changes(sh, &mut st);
    let pieces = std::mem::take(&mut st.stranded);
    for piece in pieces {
        if let Some(left) = repair_piece(sh, &mut st, piece) {
            st.stranded.push(left);
        }
    }
    st.store.punch_pending();
}

/// Makes the store mappings of `piece` anonymous memory, as far as mappings allow; returns what
/// is still stranded.
fn repair_piece(sh: &Shared, st: &mut State, piece: Stranded) -> Option<Stranded> {
    let maps = store_pieces(sh, st, piece.range.clone());
    if maps.is_empty() {
        // Unmapped or replaced by the program, or moved (`mremap`): the copies may still be
        // mapped elsewhere, so they are kept (never released to other contents).
        tracing::debug!(
            pages = piece.copies.len(),
            "a stranded piece of the store no longer maps there; its copies stay held"
        );
        return None;
    }
    let mut left = piece;
    for m in maps {
        if !anonymize(sh, m.start, m.end, m.prot) {
            break;
        }
        let range = m.start..m.end;
        // Registered again by the program meanwhile, its pages there were mappings of the store
        // (COW-broken, or merged since): anonymous now, holding their bytes.
        dropped_pages(st, range.clone());
        if let Err(e) = rewatch(sh, st, range.clone()) {
            tracing::warn!(error = %e, "memory made anonymous again could not be watched");
        }
        let store = &mut st.store;
        left.copies.retain(|&(addr, id)| {
            let gone = range.contains(&addr);
            if gone {
                store.drop_ref(id);
            }
            !gone
        });
    }
    let still = !store_pieces(sh, st, left.range.clone()).is_empty();
    still.then_some(left)
}

/// Registers `range`, just made empty or anonymous memory, with the regions it lies in (none if
/// the program no longer asks to merge it): watched like them, and marked for the kernel's KSM
/// where they were handed to it. Every part is tried; the first failure is returned.
pub(crate) fn rewatch(sh: &Shared, st: &State, range: Range<usize>) -> Result<(), EngineError> {
    let parts: Vec<(Range<usize>, bool)> = overlapping(st, range)
        .map(|(r, pages)| {
            (
                r.start + pages.start * PAGE..r.start + pages.end * PAGE,
                r.to_ksm,
            )
        })
        .collect();
    let mut result = Ok(());
    for (part, to_ksm) in parts {
        let watched = if to_ksm {
            // Registered in name only, as `registry::hand_to_ksm` leaves it (the kernel still
            // reports it unmapped or moved), and the kernel's KSM's to merge.
            crate::ksm::mark(part.start, part.len());
            sh.uffd
                .register(part.start, part.len(), sh.reg_mode)
                .map_err(EngineError::Uffd)
        } else {
            watch_emptied(sh, part)
        };
        result = result.and(watched);
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_piece_meets_the_ranges_it_overlaps() {
        let s = Stranded {
            range: 0x1000..0x4000,
            copies: Vec::new(),
        };
        assert!(s.meets(&(0x3000..0x5000)));
        assert!(s.meets(&(0..0x2000)));
        assert!(!s.meets(&(0x4000..0x5000)));
        assert!(!s.meets(&(0..0x1000)));
    }
}
