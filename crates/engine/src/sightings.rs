//! First sightings: unchanged pages that matched nothing wait in a map, by the hash of their
//! contents, until a page of the same contents shows up or they are written (the role of KSM's
//! unstable tree; see `docs/DESIGN.md` for why a hash map).

use std::collections::{BTreeMap, HashMap};

use crate::access::{HashOfHash, Pre, PAGE};
use crate::candidates::Candidate;
use crate::state::{page_at, PageKind, RegionState, State};

/// Stale first sightings worth a sweep (below this the map is small anyway).
const SWEEP_MIN_STALE: usize = 4096;

/// A content hash as two words: 8-byte aligned, so that a first-sighting entry takes 24 bytes,
/// not the 32 a `u128` key pads it to (the map holds every page waiting for a twin).
#[derive(Clone, Copy, PartialEq, Eq)]
struct HashKey([u64; 2]);

impl std::hash::Hash for HashKey {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        state.write_u64(self.0[0]);
    }
}

impl HashKey {
    fn new(h: u128) -> Self {
        Self([h as u64, (h >> 64) as u64])
    }

    fn get(self) -> u128 {
        self.0[0] as u128 | (self.0[1] as u128) << 64
    }
}

/// The first-sighting map: hash of contents -> (address, epoch) of the UNIQUE page waiting for
/// another page of that content. The epoch rides in the address's page offset bits.
#[derive(Default)]
pub(crate) struct FirstSightings(HashMap<HashKey, u64, HashOfHash>);

impl FirstSightings {
    pub(crate) fn insert(&mut self, h: u128, addr: usize, epoch: u8) {
        debug_assert_eq!(addr % PAGE, 0);
        self.0.insert(HashKey::new(h), addr as u64 | epoch as u64);
    }

    pub(crate) fn remove(&mut self, h: u128) -> Option<(usize, u8)> {
        self.0.remove(&HashKey::new(h)).map(unpack_sighting)
    }

    pub(crate) fn retain(&mut self, mut keep: impl FnMut(u128, usize, u8) -> bool) {
        self.0.retain(|k, &mut v| {
            let (addr, epoch) = unpack_sighting(v);
            keep(k.get(), addr, epoch)
        });
    }

    /// Drops the entries whose page (address, epoch) `gone` says went; returns their hashes
    /// (for the daemon to forget).
    pub(crate) fn drop_gone(&mut self, mut gone: impl FnMut(usize, u8) -> bool) -> Vec<u128> {
        let mut dropped = Vec::new();
        self.retain(|h, addr, epoch| {
            let went = gone(addr, epoch);
            if went {
                dropped.push(h);
            }
            !went
        });
        dropped
    }

    pub(crate) fn contains(&self, h: u128) -> bool {
        self.0.contains_key(&HashKey::new(h))
    }

    pub(crate) fn keys(&self) -> impl Iterator<Item = u128> + Clone + '_ {
        self.0.keys().map(|k| k.get())
    }

    pub(crate) fn len(&self) -> usize {
        self.0.len()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub(crate) fn capacity(&self) -> usize {
        self.0.capacity()
    }

    pub(crate) fn reserve(&mut self, n: usize) {
        self.0.reserve(n);
    }

    pub(crate) fn shrink_to_fit(&mut self) {
        self.0.shrink_to_fit();
    }
}

fn unpack_sighting(v: u64) -> (usize, u8) {
    ((v & !(PAGE as u64 - 1)) as usize, v as u8)
}

/// Takes the first sighting waiting under hash `h` out of the map: its page, if that is still
/// the UNIQUE page of the same epoch (unwritten since it was hashed).
pub(crate) fn take_waiting(st: &mut State, h: u128) -> Option<Candidate> {
    let (addr, epoch) = st.unstable.remove(h)?;
    let region = still_waiting(&st.regions, addr, epoch)?;
    Some(Candidate::new(region, addr, Pre::None))
}

/// The region of the page at `addr` if a first-sighting entry made at `epoch` still
/// describes it: it is the UNIQUE page of that epoch (unwritten since it was hashed).
fn still_waiting(regions: &BTreeMap<usize, RegionState>, addr: usize, epoch: u8) -> Option<usize> {
    let (start, _, p) = page_at(regions, addr)?;
    (p.kind == PageKind::Unique && p.epoch == epoch).then_some(start)
}

/// Drops the first sightings of pages in `range` (unregistered, or handed to the kernel's KSM:
/// the range may be registered again later, with page epochs starting over), and tells the
/// daemon, if any, that this process no longer has them: else it keeps its notes of them, and
/// offers this process, held for it, every copy another process makes of them.
pub(crate) fn forget_range(st: &mut State, range: std::ops::Range<usize>) {
    let gone = st.unstable.drop_gone(|addr, _| range.contains(&addr));
    if let Some(r) = &st.store.remote {
        r.forget(gone);
    }
}

/// Drops first-sighting entries whose page was written or released since (found by the page's
/// kind and epoch), once they are a good part of the map: a guest that keeps rewriting unique
/// pages would otherwise grow the map by an entry per content it ever held, and the daemon's
/// notes with it (it is told to forget them). The map's memory shrinks with it.
pub(crate) fn sweep_first_sightings(st: &mut State) {
    let stale = st.stale_sightings;
    if stale < SWEEP_MIN_STALE || stale * 4 < st.unstable.len() {
        // Entries taken by merges leave the table large and mostly empty (touched memory).
        if st.unstable.capacity() > 4 * st.unstable.len() + SWEEP_MIN_STALE {
            st.unstable.shrink_to_fit();
        }
        return;
    }
    st.stale_sightings = 0;
    let State {
        unstable,
        regions,
        store,
        ..
    } = st;
    let gone = unstable.drop_gone(|addr, epoch| still_waiting(regions, addr, epoch).is_none());
    if unstable.capacity() > 2 * unstable.len() + SWEEP_MIN_STALE {
        unstable.shrink_to_fit();
    }
    if let Some(r) = &store.remote {
        r.forget(gone);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A first sighting keeps its address, epoch and whole hash, in 24 bytes of map entry (the
    /// map holds every page waiting for a twin).
    #[test]
    fn first_sightings_are_small_and_exact() {
        assert_eq!(std::mem::size_of::<(HashKey, u64)>(), 24);
        let mut f = FirstSightings::default();
        let h = (0xfeed_u128 << 64) | 0xbeef;
        f.insert(h, 0x7f12_3456_7000, 255);
        f.insert(h ^ (1 << 64), 0x1000, 0);
        assert_eq!(f.keys().filter(|&k| k == h).count(), 1);
        assert_eq!(f.remove(h), Some((0x7f12_3456_7000, 255)));
        assert_eq!(f.remove(h), None);
        assert_eq!(f.remove(h ^ (1 << 64)), Some((0x1000, 0)));
    }
}
