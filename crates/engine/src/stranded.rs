//! Store mappings left behind where memory stopped being registered at the mapping limit.
//!
//! Unregistering makes merged pages anonymous memory again (`anonymize`), through a
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
use crate::anonymize::{anonymize_pieces, store_pieces, OnFailure};
use crate::error::EngineError;
use crate::layout::{apply_changes, changing_mappings};
use crate::registry::{dropped_pages, overlapping, watch_emptied};
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
    let (kept, released) = cut_out(std::mem::take(&mut st.stranded), &range);
    st.stranded = kept;
    for id in released {
        st.store.drop_ref(id);
    }
}

/// `pieces` less `range`: the parts of each piece on either side of it, with their copies, and
/// the copies of the pages inside it.
fn cut_out(pieces: Vec<Stranded>, range: &Range<usize>) -> (Vec<Stranded>, Vec<KeyId>) {
    let mut kept = Vec::with_capacity(pieces.len() + 1);
    let mut released = Vec::new();
    for s in pieces {
        if !s.meets(range) {
            kept.push(s);
            continue;
        }
        let (inside, outside): (Vec<_>, Vec<_>) =
            s.copies.into_iter().partition(|c| range.contains(&c.0));
        released.extend(inside.into_iter().map(|(_, id)| id));
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
    (kept, released)
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
    let (anonymous, _) = anonymize_pieces(sh, maps, OnFailure::Stop);
    for range in anonymous {
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
    use proptest::prelude::*;

    /// Disjoint pieces (page numbers: each a start, a length of 1-8 pages after a gap of 0-4),
    /// every page with a copy or not.
    fn pieces() -> impl Strategy<Value = Vec<Stranded>> {
        prop::collection::vec((0..5usize, 1..9usize, any::<u8>()), 0..6).prop_map(|spec| {
            let mut at = 0;
            let mut id = 0;
            spec.into_iter()
                .map(|(gap, len, mask)| {
                    let start = (at + gap) * PAGE;
                    at += gap + len;
                    let copies = (0..len)
                        .filter(|k| mask & (1 << (k % 8)) != 0)
                        .map(|k| {
                            id += 1;
                            (start + k * PAGE, id)
                        })
                        .collect();
                    Stranded {
                        range: start..start + len * PAGE,
                        copies,
                    }
                })
                .collect()
        })
    }

    proptest! {
        #[test]
        fn cutting_out_a_range_keeps_every_other_page_and_copy(
            before in pieces(),
            lo in 0..70usize,
            len in 0..20usize,
        ) {
            let range = lo * PAGE..(lo + len) * PAGE;
            let (kept, released) = cut_out(
                before.iter().map(|s| Stranded { range: s.range.clone(), copies: s.copies.clone() }).collect(),
                &range,
            );
            for s in &kept {
                prop_assert!(!s.meets(&range) && s.range.start < s.range.end);
                prop_assert!(s.copies.iter().all(|c| s.range.contains(&c.0)));
            }
            // Every page: kept exactly when it was stranded and lies outside the range.
            for page in 0..80 {
                let addr = page * PAGE;
                let was = before.iter().any(|s| s.range.contains(&addr));
                let now = kept.iter().filter(|s| s.range.contains(&addr)).count();
                prop_assert_eq!(now, usize::from(was && !range.contains(&addr)));
            }
            // Every copy: released if its page is inside the range, else kept once.
            for s in &before {
                for &(addr, id) in &s.copies {
                    let kept_n = kept.iter().flat_map(|k| &k.copies).filter(|c| c.1 == id).count();
                    let released_n = released.iter().filter(|&&r| r == id).count();
                    if range.contains(&addr) {
                        prop_assert_eq!((kept_n, released_n), (0, 1));
                    } else {
                        prop_assert_eq!((kept_n, released_n), (1, 0));
                    }
                }
            }
        }
    }

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
