//! Candidates: the pages a period may merge, what was read of each (`Pre`), what the commit should
//! do with each (`Action`), and their order into batches by content.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;

use pageone_index::KeyId;

use crate::access::{HashOfHash, Pre, PAGE};
use crate::pool::Pool;
use crate::zero_holes::MAX_HOLE_GAP;

/// Candidates classified together and handed to the committer as one batch (16 MiB of pages):
/// small enough that the committer's frees feed the next batch's copies and the two stages overlap
/// finely, large enough that per-batch costs stay small.
pub(crate) const BATCH: usize = 4096;
/// Contents with at least this many candidates in a period are batched by address, not whole
/// (see [`ContentBatches`]).
pub(crate) const BULK: usize = 64;
/// How many batches' worth of pages one address window of bulk contents holds.
pub(crate) const BULK_WINDOW: usize = 8;
/// The same with a daemon (4 MiB of pages). The processes of a scope merge the same contents at
/// about the same time, comparing their pages with copies another process just made: in
/// alternating runs four processes took up to 14% more CPU with 16 MiB batches, while one
/// process alone took 5% less (docs/benchmarks.md).
pub(crate) const REMOTE_BATCH: usize = 1024;

/// What the committer should do with one candidate page.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Action {
    Zero,
    Merge(KeyId),
    /// Release the page if its frozen bytes still hold the PPR mark of this slot's ticket.
    Recycle(u32),
}

/// A page's address and what was read ahead for it, in 24 bytes: the kind of `Pre` goes in the
/// address's low bits (a page address has 12 zero bits there). Read-ahead results and
/// candidates are made for every page of a registered range at once, in memory that costs a page
/// fault per 4 KiB.
#[derive(Clone, Copy)]
pub(crate) struct PagePre {
    addr_pre: usize,
    /// `Pre::Hash`'s hash, or `Pre::Stable`'s copy in the low word.
    word: [u64; 2],
}

impl PagePre {
    pub(crate) fn new(addr: usize, pre: Pre) -> Self {
        debug_assert!(addr % PAGE == 0);
        let mut p = PagePre {
            addr_pre: addr,
            word: [0; 2],
        };
        p.set_pre(pre);
        p
    }

    pub(crate) fn addr(&self) -> usize {
        self.addr_pre & !(PAGE - 1)
    }

    pub(crate) fn pre(&self) -> Pre {
        match self.addr_pre & 3 {
            0 => Pre::None,
            1 => Pre::Zero,
            2 => Pre::Stable(self.word[0] as KeyId),
            _ => Pre::Hash(self.word),
        }
    }

    pub(crate) fn set_pre(&mut self, pre: Pre) {
        let (tag, word) = match pre {
            Pre::None => (0, [0; 2]),
            Pre::Zero => (1, [0; 2]),
            Pre::Stable(id) => (2, [u64::from(id), 0]),
            Pre::Hash(h) => (3, h),
        };
        self.addr_pre = self.addr() | tag;
        self.word = word;
    }
}

/// A page that may be merged this period (32 bytes; its index is derived from its address).
#[derive(Clone, Copy)]
pub(crate) struct Candidate {
    /// Start address of the page's region (its key in `State::regions`).
    pub(crate) region: usize,
    page: PagePre,
}

const _: () = assert!(std::mem::size_of::<PagePre>() == 24);
const _: () = assert!(std::mem::size_of::<Candidate>() == 32);

impl Candidate {
    pub(crate) fn new(region: usize, addr: usize, pre: Pre) -> Self {
        debug_assert!(addr >= region);
        Candidate {
            region,
            page: PagePre::new(addr, pre),
        }
    }

    pub(crate) fn addr(&self) -> usize {
        self.page.addr()
    }

    /// The page's index in its region.
    pub(crate) fn index(&self) -> usize {
        (self.addr() - self.region) / PAGE
    }

    /// Read ahead, when the page is unwritten since.
    pub(crate) fn pre(&self) -> Pre {
        self.page.pre()
    }

    pub(crate) fn set_pre(&mut self, pre: Pre) {
        self.page.set_pre(pre);
    }
}

/// A set of candidate numbers (dense, from 0): a flag each, no hashing.
#[derive(Default)]
pub(crate) struct CandidateSet(Vec<bool>);

impl CandidateSet {
    pub(crate) fn insert(&mut self, i: u32) {
        let i = i as usize;
        if i >= self.0.len() {
            self.0.resize(i + 1, false);
        }
        self.0[i] = true;
    }

    pub(crate) fn contains(&self, i: u32) -> bool {
        self.0.get(i as usize).copied().unwrap_or(false)
    }
}

/// Adds a candidate with no action yet; returns its number.
pub(crate) fn push_candidate(
    cands: &mut Vec<Candidate>,
    actions: &mut Vec<Option<Action>>,
    c: Candidate,
) -> u32 {
    cands.push(c);
    actions.push(None);
    (cands.len() - 1) as u32
}

/// Orders candidates so that the pages of one content fall in one batch (by the hash or stable
/// copy read ahead): every batch then pairs its own duplicates and its merges start at once,
/// instead of the first batches only filling the first-sighting map. Each batch is in address
/// order (runs of pages get runs of copies). Pages not read ahead keep their order. Contents
/// with [`BULK`] pages or more come last, by address, in windows of [`BULK_WINDOW`] batches:
/// contents that take turns in memory (page `i` holding content `i % 16`) then share a batch,
/// whose copies are laid out in turn as the pages take them (one mapping for a turn of pages),
/// where batches of one content each gave every page a mapping of its own; each content still
/// has enough pages in a window to pair there.
///
/// The contents are chained in one pass (no sort: this runs while the committer waits for the
/// first batch), split by content over the workers and this thread (each chains the contents
/// of its share of the key space), and each batch is gathered only when it is taken.
pub(crate) fn batches_by_content(
    cands: Vec<Candidate>,
    pool: &Pool,
    batch: usize,
) -> ContentBatches {
    let n = cands.len();
    if cands.iter().all(|c| content_key(c) == 0) {
        return ContentBatches {
            cands,
            next: vec![u32::MAX; n],
            head: vec![true; n],
            at: 0,
            batch,
            bulk: Vec::new(),
            bulk_at: 0,
        };
    }
    let parts = if n >= 4 * BATCH { pool.size() + 1 } else { 1 };
    // next[i]: the next candidate of i's content; heads start a content (or stand alone). Each
    // index is written by the one part that owns its key. (Memory made for this period costs a
    // page fault per 4 KiB: keys are computed where needed, and the atomics become the result.)
    let cands = Arc::new(cands);
    let next: Arc<Vec<AtomicU32>> = Arc::new((0..n).map(|_| AtomicU32::new(u32::MAX)).collect());
    let head: Arc<Vec<AtomicBool>> = Arc::new((0..n).map(|_| AtomicBool::new(true)).collect());
    let (cs, nx, hd) = (cands.clone(), next.clone(), head.clone());
    pool.run(
        parts,
        Arc::new(move |part| {
            // Parts split on high bits: the map's buckets use the low ones.
            let mine = |key: u64| key != 0 && (key >> 40) as usize % parts == part;
            // The last candidate of each content of this part so far, by the key's low half (two
            // contents sharing it are only batched together), in a map sized for as many
            // contents as it has keys (mostly so: pages that wait this long are mostly unique),
            // not grown into fresh memory doubling after doubling.
            let mut last: HashMap<u32, u32, HashOfHash> = HashMap::with_capacity_and_hasher(
                cs.iter().filter(|c| mine(content_key(c))).count(),
                HashOfHash::default(),
            );
            for (i, c) in cs.iter().enumerate() {
                let key = content_key(c);
                if !mine(key) {
                    continue;
                }
                let i = i as u32;
                match last.entry(key as u32) {
                    std::collections::hash_map::Entry::Occupied(mut o) => {
                        // Relaxed: read after `pool.run` returns, which waits for this part
                        // under the pool's latch (its mutex orders the stores before the reads).
                        nx[*o.get() as usize].store(i, Ordering::Relaxed);
                        *o.get_mut() = i;
                        hd[i as usize].store(false, Ordering::Relaxed);
                    }
                    std::collections::hash_map::Entry::Vacant(v) => {
                        v.insert(i);
                    }
                }
            }
        }),
    );
    // `pool.run` returned: every part ran and dropped its clones of the Arcs (see `Task::run`),
    // so the vectors are taken back as they are, the atomics in place (same layout). Relaxed:
    // after the parts finished (see above).
    let cands = Arc::try_unwrap(cands).unwrap_or_else(|c| c.as_ref().clone());
    let next = match Arc::try_unwrap(next) {
        Ok(v) => v.into_iter().map(AtomicU32::into_inner).collect(),
        Err(v) => v.iter().map(|x| x.load(Ordering::Relaxed)).collect(),
    };
    let head = match Arc::try_unwrap(head) {
        Ok(v) => v.into_iter().map(AtomicBool::into_inner).collect(),
        Err(v) => v.iter().map(|x| x.load(Ordering::Relaxed)).collect(),
    };
    ContentBatches {
        cands,
        next,
        head,
        at: 0,
        batch,
        bulk: Vec::new(),
        bulk_at: 0,
    }
}

/// A candidate's content key for batching: the low word of its hash, or its stable copy spread
/// over the key space (an odd multiplier is a bijection; the map uses the low bits as they are).
/// Keys shared by two contents only batch them together. 0: not read ahead (no chain).
fn content_key(c: &Candidate) -> u64 {
    match c.pre() {
        Pre::Hash(h) => h[0].max(1),
        Pre::Stable(id) => (id as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15),
        Pre::None | Pre::Zero => 0,
    }
}

/// The batches of [`batches_by_content`], gathered one at a time.
pub(crate) struct ContentBatches {
    cands: Vec<Candidate>,
    next: Vec<u32>,
    head: Vec<bool>,
    /// The next candidate to look at for a head.
    at: usize,
    /// Pages a batch reaches before it is cut (between contents).
    batch: usize,
    /// Candidates of bulk contents (and the zero pages after them), set aside for the windows
    /// by address; sorted once the other contents are all taken.
    bulk: Vec<u32>,
    /// The next bulk candidate to take, once sorted.
    bulk_at: usize,
}

impl Iterator for ContentBatches {
    type Item = Vec<Candidate>;

    fn next(&mut self) -> Option<Vec<Candidate>> {
        let mut take: Vec<u32> = Vec::with_capacity(self.batch);
        // Whole contents, in the order of their first candidate, until the batch is full; bulk
        // ones are set aside.
        while take.len() < self.batch && self.at < self.cands.len() {
            if self.head[self.at] {
                let mut content = Vec::new();
                let mut i = self.at as u32;
                while i != u32::MAX {
                    content.push(i);
                    i = self.next[i as usize];
                }
                if content.len() >= BULK {
                    self.pull_zero_followers(&mut content);
                    self.bulk.append(&mut content);
                } else {
                    take.append(&mut content);
                }
            }
            self.at += 1;
        }
        if take.is_empty() {
            take = self.bulk_window();
        } else {
            self.pull_zero_followers(&mut take);
        }
        if take.is_empty() {
            return None;
        }
        take.sort_unstable_by_key(|&i| self.cands[i as usize].addr());
        Some(take.iter().map(|&i| self.cands[i as usize]).collect())
    }
}

impl ContentBatches {
    /// The next window of bulk candidates by address (once every other content is taken).
    fn bulk_window(&mut self) -> Vec<u32> {
        if self.bulk_at == 0 {
            let cands = &self.cands;
            self.bulk
                .sort_unstable_by_key(|&i| cands[i as usize].addr());
        }
        let end = (self.bulk_at + self.batch * BULK_WINDOW).min(self.bulk.len());
        let window = self.bulk[self.bulk_at..end].to_vec();
        self.bulk_at = end;
        window
    }

    /// Zero pages read ahead just after a page taken (at most `MAX_HOLE_GAP` in a row, at the
    /// following addresses) join its batch: a run of merges with zero pages inside is then
    /// committed as one, the zero pages merging onto the holes between the copies (see the
    /// `zero_holes` module), instead of coming alone in a later batch and splitting the run.
    fn pull_zero_followers(&mut self, take: &mut Vec<u32>) {
        for t in 0..take.len() {
            let i = take[t] as usize;
            let mut j = i + 1;
            // Heads before `at` are taken already.
            while j < self.cands.len()
                && j >= self.at
                && j - i <= MAX_HOLE_GAP
                && self.head[j]
                && self.cands[j].pre() == Pre::Zero
                && self.cands[j].region == self.cands[i].region
                && self.cands[j].addr() == self.cands[j - 1].addr() + PAGE
            {
                self.head[j] = false;
                take.push(j as u32);
                j += 1;
            }
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.cands.is_empty()
    }

    /// Candidates read ahead whose content no other candidate has.
    pub(crate) fn singles(&self) -> usize {
        (0..self.cands.len())
            .filter(|&i| {
                self.head[i]
                    && self.next[i] == u32::MAX
                    && matches!(self.cands[i].pre(), Pre::Hash(_))
            })
            .count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::sync::Mutex;

    fn pre_of(k: u8) -> Pre {
        match k {
            0 => Pre::None,
            1 => Pre::Zero,
            2..=5 => Pre::Stable(k as KeyId),
            // Spread over the key space, as real hashes are (the ordering splits it).
            _ => Pre::Hash([(k as u64 % 24).wrapping_mul(0x9e37_79b9_7f4a_7c15), 7]),
        }
    }

    proptest! {
        /// A packed page address and read-ahead result give back what was packed, whatever the
        /// result, and setting it again replaces it without touching the address.
        #[test]
        fn page_pre_keeps_address_and_result(
            page in 0usize..(1 << 35),
            kind in 0u8..4,
            words in any::<[u64; 2]>(),
            id in any::<KeyId>(),
            again in 0u8..4,
        ) {
            let pre = |k: u8| match k {
                0 => Pre::None,
                1 => Pre::Zero,
                2 => Pre::Stable(id),
                _ => Pre::Hash(words),
            };
            let region = page / 2 * PAGE;
            let mut c = Candidate::new(region, page * PAGE, pre(kind));
            prop_assert_eq!(c.addr(), page * PAGE);
            prop_assert_eq!(c.index(), page - page / 2);
            prop_assert_eq!(c.pre(), pre(kind));
            c.set_pre(pre(again));
            prop_assert_eq!(c.addr(), page * PAGE);
            prop_assert_eq!(c.pre(), pre(again));
        }

        /// Every candidate lands in exactly one batch, batches are in address order, pages of
        /// one content (hash or stable copy) share a batch unless it has `BULK` pages or more, a
        /// batch is cut only between contents once it holds the batch length (alone or with a
        /// daemon), and the bulk contents come last, by address, in full windows.
        #[test]
        fn batches_by_content_keep_every_candidate_and_whole_contents(
            kinds in proptest::collection::vec(0u16..1200, 0..(6 * BATCH)),
            len in prop_oneof![Just(REMOTE_BATCH), Just(BATCH)],
        ) {
            // From 4 * BATCH candidates on, the chaining is split over the workers. Kinds:
            // mostly small contents (hashes of 1000 kinds), a few bulk ones (kinds 2..=9).
            let pre = |k: u16| if k < 200 { pre_of((k % 10) as u8) } else {
                Pre::Hash([(k as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15), 9])
            };
            let pool = Pool::new(2, Arc::new(Mutex::new(Vec::new()))).unwrap();
            let cands: Vec<Candidate> = kinds
                .iter()
                .enumerate()
                .map(|(i, &k)| Candidate::new(PAGE, (i + 1) * PAGE, pre(k)))
                .collect();
            let key = |c: &Candidate| match c.pre() {
                Pre::Hash(h) => Some(format!("h{h:?}")),
                Pre::Stable(id) => Some(format!("s{id}")),
                Pre::None | Pre::Zero => None,
            };
            // Bulk by the batching's key (two contents sharing one are batched as one).
            let mut count: HashMap<u64, usize> = HashMap::new();
            for c in &cands {
                *count.entry(content_key(c) as u32 as u64).or_default() += 1;
            }
            let bulk = |c: &Candidate| {
                content_key(c) != 0 && count[&(content_key(c) as u32 as u64)] >= BULK
            };
            let batches: Vec<Vec<Candidate>> = batches_by_content(cands.clone(), &pool, len).collect();
            let mut seen: Vec<usize> = batches.iter().flatten().map(|c| c.index()).collect();
            seen.sort_unstable();
            prop_assert_eq!(seen, (0..cands.len()).collect::<Vec<_>>());
            let mut batch_of: HashMap<String, usize> = HashMap::new();
            // Batches holding bulk contents: the last ones.
            let first_bulk = batches.iter().position(|b| b.iter().any(bulk)).unwrap_or(batches.len());
            for (b, batch) in batches.iter().enumerate() {
                prop_assert!(batch.windows(2).all(|w| w[0].addr() < w[1].addr()));
                for c in batch {
                    let Some(k) = key(c) else { continue };
                    if bulk(c) {
                        prop_assert!(b >= first_bulk);
                        continue;
                    }
                    prop_assert!(b < first_bulk, "a small content among the bulk windows");
                    let first = *batch_of.entry(k).or_insert(b);
                    prop_assert_eq!(first, b, "one content split over two batches");
                }
            }
            // Cuts come only after a batch is full: every batch of small contents but the last
            // holds `len` pages or more, every window but the last `len * BULK_WINDOW`.
            for batch in batches[..first_bulk].iter().rev().skip(1) {
                prop_assert!(batch.len() >= len);
            }
            for batch in batches[first_bulk..].iter().rev().skip(1) {
                prop_assert!(batch.len() >= len * BULK_WINDOW);
            }
        }
    }
}
