//! What a scope knows of each content: its copy in the store, or the clients that noted it while
//! no copy existed (one table for both), and the slots each client holds.

/// The daemon's maps: keys are content hashes clients send, so their hashing is seeded per
/// daemon (a client cannot pick keys that all collide), and fast (every lookup and copy goes
/// through them).
pub(crate) type Seeded = foldhash::fast::RandomState;

/// The slots one client holds: a bit per slot (holds are checked and changed for every page a
/// client looks up, copies or releases).
#[derive(Default)]
pub(crate) struct SlotSet {
    bits: Vec<u64>,
    len: usize,
}

impl SlotSet {
    /// Adds `slot`; returns whether it was absent.
    pub(crate) fn insert(&mut self, slot: u32) -> bool {
        let (w, b) = (slot as usize / 64, slot % 64);
        if w >= self.bits.len() {
            self.bits.resize(w + 1, 0);
        }
        let absent = self.bits[w] & (1 << b) == 0;
        self.bits[w] |= 1 << b;
        self.len += absent as usize;
        absent
    }

    /// Removes `slot`; returns whether it was present.
    pub(crate) fn remove(&mut self, slot: u32) -> bool {
        let (w, b) = (slot as usize / 64, slot % 64);
        let present = self.bits.get(w).is_some_and(|x| x & (1 << b) != 0);
        if present {
            self.bits[w] &= !(1 << b);
            self.len -= 1;
        }
        present
    }

    /// Whether `slot` is in the set.
    pub(crate) fn contains(&self, slot: u32) -> bool {
        let (w, b) = (slot as usize / 64, slot % 64);
        self.bits.get(w).is_some_and(|x| x & (1 << b) != 0)
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn into_slots(self) -> impl Iterator<Item = u32> {
        self.bits.into_iter().enumerate().flat_map(|(w, mut x)| {
            std::iter::from_fn(move || {
                (x != 0).then(|| {
                    let b = x.trailing_zeros();
                    x &= x - 1;
                    (w * 64) as u32 + b
                })
            })
        })
    }
}

/// Clients that saw one content (by hash) while no copy existed. Kept small (48 bytes with its
/// hash): a scope notes every distinct page its clients have until copies exist.
#[derive(Default)]
pub(crate) struct Noted {
    pub(crate) hash: u128,
    /// The first client that noted it (0: none; client ids start at 1) and any others (rare:
    /// clients that asked while a copy was pending).
    first: u64,
    // Boxed: 8 bytes in every note instead of a `Vec`'s 24, for a list that is rarely there.
    #[allow(clippy::box_collection)]
    more: Option<Box<Vec<u64>>>,
    /// The client asked to send the bytes (0: none) and when, in milliseconds since the scope
    /// began: others are told `NOTED` meanwhile (and get the copy offered), so one copy is made,
    /// not one per client.
    pub(crate) wanted_by: u64,
    pub(crate) wanted_at: u32,
}

impl Noted {
    pub(crate) fn clients(&self) -> impl Iterator<Item = u64> + '_ {
        std::iter::once(self.first)
            .filter(|&c| c != 0)
            .chain(self.more.iter().flat_map(|m| m.iter().copied()))
    }

    pub(crate) fn contains(&self, id: u64) -> bool {
        self.first == id || self.more.as_ref().is_some_and(|m| m.contains(&id))
    }

    pub(crate) fn add(&mut self, id: u64) {
        if self.first == 0 {
            self.first = id;
        } else {
            self.more.get_or_insert_with(Box::default).push(id);
        }
    }

    /// Removes `id`; returns whether it was there.
    pub(crate) fn remove(&mut self, id: u64) -> bool {
        if self.wanted_by == id {
            self.wanted_by = 0;
        }
        if self.first == id {
            self.first = self.more.as_mut().and_then(|m| m.pop()).unwrap_or(0);
            return true;
        }
        let Some(more) = &mut self.more else {
            return false;
        };
        let before = more.len();
        more.retain(|&c| c != id);
        more.len() < before
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.first == 0
    }
}

/// Set in a table entry that names a note; clear in one that names a slot (so a store has at most
/// 2^31 slots: 8 TiB).
pub(crate) const NOTE: u32 = 1 << 31;

/// What a scope knows of each content, by hash: the copy in the store, or the clients that
/// noted it while no copy existed. One table holds both (4 bytes an entry: a slot number, or a
/// note's with [`NOTE`] set, hashed through the content hash kept with the slot or note), so a
/// lookup or a copy finds its content with one probe.
pub(crate) struct Contents {
    table: hashbrown::HashTable<u32>,
    /// Per slot, the hash of what it holds (meaningful while the slot is live).
    pub(crate) hash_of: Vec<u128>,
    /// Notes by number; freed numbers are reused.
    notes: Vec<Noted>,
    free_notes: Vec<u32>,
    hasher: Seeded,
}

/// What [`Contents::lookup`] found for a content.
pub(crate) enum Found<'a> {
    Copy(u32),
    Note(&'a mut Noted),
    /// Nothing, and no note was made (the notes are full).
    Nothing,
}

/// The note an entry names, if it names one (else it names a slot).
fn note_of(e: u32) -> Option<usize> {
    (e & NOTE != 0).then_some((e & !NOTE) as usize)
}

/// The content hash an entry stands for.
fn content_of(hash_of: &[u128], notes: &[Noted], e: u32) -> u128 {
    match note_of(e) {
        Some(i) => notes[i].hash,
        None => hash_of[e as usize],
    }
}

/// Takes note `i` out and makes its number reusable.
fn release_note(notes: &mut [Noted], free_notes: &mut Vec<u32>, i: usize) -> Noted {
    free_notes.push(i as u32);
    std::mem::take(&mut notes[i])
}

impl Contents {
    pub(crate) fn new() -> Self {
        Self {
            table: hashbrown::HashTable::new(),
            hash_of: Vec::new(),
            notes: Vec::new(),
            free_notes: Vec::new(),
            hasher: Seeded::default(),
        }
    }

    pub(crate) fn key(hasher: &Seeded, h: u128) -> u64 {
        std::hash::BuildHasher::hash_one(hasher, h)
    }

    pub(crate) fn find(&self, h: u128) -> Option<u32> {
        let Self { hash_of, notes, .. } = self;
        self.table
            .find(Self::key(&self.hasher, h), |&e| {
                content_of(hash_of, notes, e) == h
            })
            .copied()
    }

    /// The copy stored for `h`.
    pub(crate) fn copy_of(&self, h: u128) -> Option<u32> {
        self.find(h).filter(|&e| note_of(e).is_none())
    }

    /// The positions of `hashes` in the order of their buckets in the table. A batch looked up
    /// in that order probes the table front to back instead of at random: the table is much
    /// larger than the cache, and each random probe missed it twice (control bytes, entry).
    pub(crate) fn table_order(&self, hashes: &[u128]) -> Vec<usize> {
        // hashbrown fills at most 7/8 of a power-of-two number of buckets, and a probe starts at
        // the bucket the hash's low bits name. (Were the table to grow meanwhile, the order is
        // only less good.)
        let mask = ((self.table.capacity() * 8 / 7).max(1).next_power_of_two() - 1) as u64;
        let mut keyed: Vec<u64> = hashes
            .iter()
            .enumerate()
            .map(|(i, &h)| ((Self::key(&self.hasher, h) & mask) << 32) | i as u64)
            .collect();
        keyed.sort_unstable();
        keyed
            .into_iter()
            .map(|k| (k & 0xffff_ffff) as usize)
            .collect()
    }

    /// The note of `h`.
    pub(crate) fn note_mut(&mut self, h: u128) -> Option<&mut Noted> {
        let i = note_of(self.find(h)?)?;
        Some(&mut self.notes[i])
    }

    /// The table entry of `h` (found, or where it goes), with the notes beside it.
    pub(crate) fn entry(
        &mut self,
        h: u128,
    ) -> (
        hashbrown::hash_table::Entry<'_, u32>,
        &mut Vec<Noted>,
        &mut Vec<u32>,
    ) {
        let Self {
            table,
            hash_of,
            notes,
            free_notes,
            hasher,
        } = self;
        let entry = table.entry(
            Self::key(hasher, h),
            |&e| content_of(hash_of, notes, e) == h,
            |&e| Self::key(hasher, content_of(hash_of, notes, e)),
        );
        (entry, notes, free_notes)
    }

    /// The copy or note of `h`; a new empty note if there is neither and `may_note`.
    pub(crate) fn lookup(&mut self, h: u128, may_note: bool) -> Found<'_> {
        let (entry, notes, free_notes) = self.entry(h);
        let at = match entry {
            hashbrown::hash_table::Entry::Occupied(e) => match note_of(*e.get()) {
                Some(i) => i,
                None => return Found::Copy(*e.get()),
            },
            hashbrown::hash_table::Entry::Vacant(_) if !may_note => return Found::Nothing,
            hashbrown::hash_table::Entry::Vacant(v) => {
                let note = Noted {
                    hash: h,
                    ..Noted::default()
                };
                let at = match free_notes.pop() {
                    Some(i) => {
                        notes[i as usize] = note;
                        i as usize
                    }
                    None => {
                        notes.push(note);
                        notes.len() - 1
                    }
                };
                v.insert(at as u32 | NOTE);
                at
            }
        };
        Found::Note(&mut notes[at])
    }

    /// Makes `slot` (holding content `h`) the copy answered for `h`, unless `h` has a copy and
    /// not `replace` (then that copy is the error). A note of `h` is taken out and returned.
    pub(crate) fn set_copy(
        &mut self,
        h: u128,
        slot: u32,
        replace: bool,
    ) -> Result<Option<Noted>, u32> {
        // (Set first: meaningful only while the slot is live, and the slot is not in the table.)
        self.hash_of[slot as usize] = h;
        let (entry, notes, free_notes) = self.entry(h);
        match entry {
            hashbrown::hash_table::Entry::Occupied(e)
                if note_of(*e.get()).is_none() && !replace =>
            {
                Err(*e.get())
            }
            hashbrown::hash_table::Entry::Occupied(mut e) => {
                let was = std::mem::replace(e.get_mut(), slot);
                Ok(note_of(was).map(|i| release_note(notes, free_notes, i)))
            }
            hashbrown::hash_table::Entry::Vacant(v) => {
                v.insert(slot);
                Ok(None)
            }
        }
    }

    /// Takes `slot` out of the table, if it is the copy answered for its content.
    pub(crate) fn remove_copy(&mut self, slot: u32) {
        let key = Self::key(&self.hasher, self.hash_of[slot as usize]);
        if let Ok(e) = self.table.find_entry(key, |&e| e == slot) {
            e.remove();
        }
    }

    /// Drops the note of `h`.
    pub(crate) fn remove_note(&mut self, h: u128) {
        let key = Self::key(&self.hasher, h);
        let Self {
            table,
            notes,
            free_notes,
            ..
        } = self;
        if let Ok(e) = table.find_entry(key, |&e| note_of(e).is_some_and(|i| notes[i].hash == h)) {
            if let Some(i) = note_of(e.remove().0) {
                release_note(notes, free_notes, i);
            }
        }
    }

    /// Keeps the notes for which `keep` says so.
    pub(crate) fn retain_notes(&mut self, mut keep: impl FnMut(&mut Noted) -> bool) {
        let Self {
            table,
            notes,
            free_notes,
            ..
        } = self;
        table.retain(|&mut e| match note_of(e) {
            Some(i) if !keep(&mut notes[i]) => {
                release_note(notes, free_notes, i);
                false
            }
            _ => true,
        });
    }

    /// Gives memory back once most entries are gone.
    pub(crate) fn compact(&mut self) {
        if self.table.capacity() > 4 * self.table.len() + COMPACT_MIN {
            let Self {
                table,
                hash_of,
                notes,
                hasher,
                ..
            } = self;
            table.shrink_to(0, |&e| Self::key(hasher, content_of(hash_of, notes, e)));
        }
        if self.free_notes.len() == self.notes.len() && self.notes.capacity() > COMPACT_MIN {
            self.notes = Vec::new();
            self.free_notes = Vec::new();
        }
    }
}

/// Tables are shrunk when at most a quarter full and over this many entries of capacity.
const COMPACT_MIN: usize = 4096;

#[cfg(test)]
mod tests {
    use super::{Contents, Found, Noted, SlotSet};
    use proptest::prelude::*;
    use std::collections::{BTreeSet, HashMap};

    /// A scope notes every distinct page its clients have until copies exist: a note stays at
    /// 48 bytes with its hash.
    #[test]
    fn a_note_is_small() {
        assert!(std::mem::size_of::<Noted>() <= 48);
    }

    proptest! {
        /// A note's clients behave as a set (the first kept inline, the others in a list).
        #[test]
        fn noted_clients_are_a_set(ops in proptest::collection::vec((any::<bool>(), 1u64..6), 0..60)) {
            let (mut n, mut set) = (Noted::default(), BTreeSet::new());
            for (add, id) in ops {
                if add {
                    if !n.contains(id) {
                        n.add(id);
                    }
                    set.insert(id);
                } else {
                    prop_assert_eq!(n.remove(id), set.remove(&id));
                }
                prop_assert_eq!(n.clients().collect::<BTreeSet<_>>(), set.clone());
                prop_assert_eq!(n.clients().count(), set.len());
                prop_assert_eq!(n.is_empty(), set.is_empty());
            }
        }

        /// The table answers like a map from content to the latest copy stored for it, or else
        /// to its note, as slots are stored (a free slot, maybe of content another slot has)
        /// and freed, notes are made, dropped and turned into copies, and across shrinking.
        #[test]
        fn contents_are_a_map_to_the_latest_copy_or_a_note(
            ops in proptest::collection::vec((0u8..6, 0u128..12, 0u32..40), 0..300)
        ) {
            let mut contents = Contents::new();
            contents.hash_of = vec![0; 40];
            let mut live = HashMap::<u32, u128>::new();
            let mut copies = HashMap::<u128, u32>::new();
            let mut notes = HashMap::<u128, BTreeSet<u64>>::new();
            for (op, h, slot) in ops {
                match op {
                    0 | 1 if !live.contains_key(&slot) => {
                        let replace = op == 0;
                        match contents.set_copy(h, slot, replace) {
                            Err(e) => prop_assert_eq!(Some(&e), copies.get(&h).filter(|_| !replace)),
                            Ok(note) => {
                                prop_assert!(replace || !copies.contains_key(&h));
                                let want = notes.remove(&h);
                                prop_assert_eq!(note.as_ref().map(|n| n.hash), want.as_ref().map(|_| h));
                                prop_assert_eq!(note.map(|n| n.clients().collect()), want);
                                live.insert(slot, h);
                                copies.insert(h, slot);
                            }
                        }
                    }
                    2 => {
                        if let Some(h) = live.remove(&slot) {
                            contents.remove_copy(slot);
                            if copies.get(&h) == Some(&slot) {
                                copies.remove(&h);
                            }
                        }
                    }
                    3 => contents.compact(),
                    4 => match contents.lookup(h, true) {
                        Found::Copy(s) => prop_assert_eq!(Some(&s), copies.get(&h)),
                        Found::Note(n) => {
                            prop_assert!(!copies.contains_key(&h));
                            let id = slot as u64 + 1;
                            if !n.contains(id) {
                                n.add(id);
                            }
                            notes.entry(h).or_default().insert(id);
                        }
                        Found::Nothing => prop_assert!(false, "a note may be made"),
                    },
                    5 => {
                        contents.remove_note(h);
                        notes.remove(&h);
                    }
                    _ => {}
                }
                for c in 0..12 {
                    prop_assert_eq!(contents.copy_of(c), copies.get(&c).copied());
                    let clients = contents.note_mut(c).map(|n| n.clients().collect::<BTreeSet<_>>());
                    prop_assert_eq!(clients.as_ref(), notes.get(&c));
                }
                prop_assert_eq!(contents.table.len(), copies.len() + notes.len());
                // Every note number not in use is free to reuse.
                prop_assert_eq!(contents.notes.len() - contents.free_notes.len(), notes.len());
            }
        }
    }

    proptest! {
        /// A batch is looked up in an order that visits every hash once, front to back by the
        /// bucket its probe starts at.
        #[test]
        fn table_order_is_a_permutation_by_bucket(
            stored in proptest::collection::vec(any::<u128>(), 0..200),
            batch in proptest::collection::vec(any::<u128>(), 0..300),
        ) {
            let mut contents = Contents::new();
            contents.hash_of = vec![0; stored.len()];
            for (slot, &h) in stored.iter().enumerate() {
                let _ = contents.set_copy(h, slot as u32, true);
            }
            let order = contents.table_order(&batch);
            let mut seen = order.clone();
            seen.sort_unstable();
            prop_assert_eq!(seen, (0..batch.len()).collect::<Vec<_>>());
            let buckets = (contents.table.capacity() * 8 / 7).max(1).next_power_of_two() as u64;
            let bucket = |i: usize| Contents::key(&contents.hasher, batch[i]) % buckets;
            prop_assert!(order.windows(2).all(|w| bucket(w[0]) <= bucket(w[1])));
        }
    }

    proptest! {
        /// The bitmap behaves as a set of slots: same answers, same length, same members.
        #[test]
        fn slot_set_is_a_set(ops in proptest::collection::vec((any::<bool>(), 0u32..2000), 0..400)) {
            let (mut bits, mut set) = (SlotSet::default(), BTreeSet::new());
            for (add, slot) in ops {
                if add {
                    prop_assert_eq!(bits.insert(slot), set.insert(slot));
                } else {
                    prop_assert_eq!(bits.remove(slot), set.remove(&slot));
                }
                prop_assert_eq!(bits.len(), set.len());
            }
            prop_assert_eq!(bits.into_slots().collect::<Vec<_>>(), set.into_iter().collect::<Vec<_>>());
        }
    }
}
