//! The SD tree proper: routing by first set bit, then a lock-free crit-bit trie per cluster.

use std::sync::Arc;

use crate::arena::{Arena, Node, GEN_MASK, META_LEAF};
use crate::key::{Key, KeyId, KeySource, StoredKey, MAX_KEY_BYTES};
use crate::primitive::{AtomicU64, AtomicUsize, Ordering};
use crate::reclaim::{Domain, Guard};

/// Edge flag: the leaf this edge points to is logically deleted; the edge never changes again.
const DEL: u64 = 1 << 63;
/// Edge flag: the edge's sibling is a deleted leaf, so the owning node is being spliced out; the edge
/// never changes again.
const FROZEN: u64 = 1 << 62;
const FLAGS: u64 = DEL | FROZEN;
const ID_MASK: u64 = 0xffff_ffff;

/// Bits after a key's first set bit that [`SdTree::new`] routes on: 256 clusters per position take
/// the top 8 levels off every cluster's trie (each a dependent, often cold, node load).
pub const DEFAULT_ROUTE_BITS: u32 = 8;
/// Most route bits [`SdTree::with_route_bits`] accepts.
pub const MAX_ROUTE_BITS: u32 = 12;

/// Attempts [`SdTree::insert_or_get`] makes before it reports [`IndexError::Contended`]. An attempt
/// fails only when another thread changed the path to where the key belongs (its CAS succeeded,
/// or a removal on the path is being finished), so this many failures in a row mean the key's
/// neighbourhood is being rewritten faster than one walk: the caller may try again later.
pub const INSERT_ATTEMPTS: u32 = 64;

/// A zeroed edge table. Outside loom it comes from `alloc_zeroed`, so a large table's untouched
/// pages stay uncommitted (the kernel's zero page) until an edge in them is written.
#[cfg(not(loom))]
fn zeroed_edges(n: usize) -> Box<[AtomicU64]> {
    let layout = std::alloc::Layout::array::<AtomicU64>(n).expect("root table size");
    // SAFETY: `layout` has a nonzero size (n >= 1: the all-zero key's position always exists).
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) }.cast::<AtomicU64>();
    if ptr.is_null() {
        std::alloc::handle_alloc_error(layout);
    }
    // SAFETY: `ptr` is a fresh allocation of exactly `Layout::array::<AtomicU64>(n)`, which is the
    // layout a `Box<[AtomicU64]>` of length n frees with, and all-zero bytes are a valid AtomicU64.
    unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(ptr, n)) }
}

#[cfg(loom)]
fn zeroed_edges(n: usize) -> Box<[AtomicU64]> {
    (0..n).map(|_| AtomicU64::new(0)).collect()
}

#[inline]
fn edge_id(e: u64) -> u32 {
    (e & ID_MASK) as u32
}

#[inline]
fn edge_gen(e: u64) -> u64 {
    (e >> 32) & GEN_MASK
}

#[inline]
fn make_edge(id: u32, gen: u64) -> u64 {
    id as u64 | (gen << 32)
}

/// Errors from index operations.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum IndexError {
    /// The key length is zero or longer than a page.
    #[error("key length {0} is outside 1..={MAX_KEY_BYTES} bytes")]
    KeyLength(usize),
    /// Every node of the arena is in use.
    #[error("the index arena is full ({0} nodes)")]
    Full(usize),
    /// Every attempt of an insert was undone by other threads changing the same path.
    #[error(
        "the insert gave up after {0} attempts, each undone by another thread's change on its path"
    )]
    Contended(u32),
}

/// Handle to an entry stored in the tree. It names the entry itself, not its content, so removing it
/// is correct even if the caller's page changed since it was inserted.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Entry {
    node: u32,
    gen: u32,
    key: KeyId,
}

impl Entry {
    /// The caller's id of the stored key.
    pub fn key(&self) -> KeyId {
        self.key
    }
}

/// Outcome of [`SdTree::insert_or_get`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Insert {
    /// The key was new and is now stored.
    Inserted(Entry),
    /// An identical key was already stored; this is its entry.
    Found(Entry),
}

impl Insert {
    /// The entry stored for the key, new or existing.
    pub fn entry(&self) -> Entry {
        match *self {
            Insert::Inserted(e) | Insert::Found(e) => e,
        }
    }

    /// Whether this call stored the key.
    pub fn inserted(&self) -> bool {
        matches!(self, Insert::Inserted(_))
    }
}

/// What one operation cost, for tests and benchmarks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OpStats {
    /// Bytes of the query key read (whole words of 8; each word at most once per attempt of the
    /// walk). An insert also counts the two words it copies into its new leaf.
    pub query_bytes: u32,
    /// Tree nodes visited, over all attempts.
    pub nodes: u32,
    /// Attempts restarted because another thread changed the path (lock-free retries).
    pub retries: u32,
}

/// Reads the query key through a forward-only cursor that caches the current word, so each word is
/// loaded once per attempt.
struct Cursor<'k, K: Key + ?Sized> {
    key: &'k K,
    word_index: usize,
    word: u64,
    loads: u32,
}

impl<'k, K: Key + ?Sized> Cursor<'k, K> {
    fn new(key: &'k K) -> Self {
        Cursor {
            key,
            word_index: usize::MAX,
            word: 0,
            loads: 0,
        }
    }

    #[inline]
    fn word(&mut self, i: usize) -> u64 {
        if i != self.word_index {
            self.word = self.key.word(i);
            self.word_index = i;
            self.loads += 1;
        }
        self.word
    }

    #[inline]
    fn bit(&mut self, b: u32) -> usize {
        ((self.word(b as usize / 64) >> (63 - b % 64)) & 1) as usize
    }
}

/// Where a walk ended.
struct Walk<'t> {
    /// The edge location where the walk stopped, and the value it read there.
    loc: &'t AtomicU64,
    edge: u64,
    /// The edge that points to the node owning `loc`; `None` when `loc` is a cluster root.
    up: Option<(&'t AtomicU64, u64)>,
    /// `None`: `edge` is a leaf equal to the query. `Some(x)`: the query first differs from every key
    /// below `edge` at bit `x` (or `loc` is an empty cluster root when `edge` is 0).
    diff: Option<u32>,
    /// The word holding the cluster's first set bit: leaves keep a copy of it and the next one.
    w0: usize,
}

struct Inner<S> {
    arena: Arena,
    /// Defers frees and key releases until no pinned thread can read them.
    reclaim: Domain,
    /// The static upper level: one root edge per position of a key's first set bit (the last one for
    /// the all-zero key) and value of the `route_bits` bits after it, at `position << route_bits | value`.
    roots: Box<[AtomicU64]>,
    route_bits: u32,
    source: S,
    key_len: usize,
    key_bits: u32,
    words: usize,
    len: AtomicUsize,
}

/// A lock-free content index keyed by page bytes; see the crate documentation for the design.
pub struct SdTree<S: KeySource> {
    inner: Arc<Inner<S>>,
}

impl<S: KeySource> SdTree<S> {
    /// An empty tree over keys of exactly `key_len` bytes, read through `source`, routing on
    /// [`DEFAULT_ROUTE_BITS`] bits after each key's first set bit.
    pub fn new(source: S, key_len: usize) -> Result<Self, IndexError> {
        Self::with_route_bits(source, key_len, DEFAULT_ROUTE_BITS)
    }

    /// [`SdTree::new`] with `route_bits` (at most [`MAX_ROUTE_BITS`]) bits after a key's first set
    /// bit choosing its cluster. The root table has `(8 * key_len + 1) << route_bits` edges of 8
    /// bytes, zero-filled on demand: memory is committed only for the positions keys use.
    ///
    /// Panics if `route_bits > MAX_ROUTE_BITS`.
    pub fn with_route_bits(source: S, key_len: usize, route_bits: u32) -> Result<Self, IndexError> {
        assert!(
            route_bits <= MAX_ROUTE_BITS,
            "route_bits {route_bits} > {MAX_ROUTE_BITS}"
        );
        if key_len == 0 || key_len > MAX_KEY_BYTES {
            return Err(IndexError::KeyLength(key_len));
        }
        let key_bits = (key_len * 8) as u32;
        let inner = Inner {
            arena: Arena::new(),
            reclaim: Domain::new(),
            roots: zeroed_edges((key_bits as usize + 1) << route_bits),
            route_bits,
            source,
            key_len,
            key_bits,
            words: key_len.div_ceil(8),
            len: AtomicUsize::new(0),
        };
        Ok(SdTree {
            inner: Arc::new(inner),
        })
    }

    /// The key source given at construction.
    pub fn source(&self) -> &S {
        &self.inner.source
    }

    /// Length of every key, in bytes.
    pub fn key_len(&self) -> usize {
        self.inner.key_len
    }

    /// Number of entries stored.
    pub fn len(&self) -> usize {
        self.inner.len.load(Ordering::Relaxed)
    }

    /// Whether no entry is stored.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Stores key `id` unless an identical key is already stored, and returns the entry for it.
    pub fn insert_or_get(&self, id: KeyId) -> Result<Insert, IndexError> {
        self.insert_or_get_with_stats(id).0
    }

    /// [`SdTree::insert_or_get`], also reporting what it cost.
    pub fn insert_or_get_with_stats(&self, id: KeyId) -> (Result<Insert, IndexError>, OpStats) {
        let inner = &*self.inner;
        let guard = inner.reclaim.pin();
        let key = StoredKey {
            source: &inner.source,
            id,
        };
        let mut stats = OpStats::default();
        // Allocated at most once and reused across retries; freed directly if never published.
        let mut leaf: Option<(u32, u64)> = None;
        let mut node: Option<(u32, u64)> = None;
        let mut attempts = 0;
        let result = loop {
            if attempts == INSERT_ATTEMPTS {
                break Err(IndexError::Contended(attempts));
            }
            attempts += 1;
            let mut cur = Cursor::new(&key);
            let walk = self.walk(&mut cur, &mut stats, Some(&guard), true);
            stats.query_bytes += cur.loads * 8;
            let Some(walk) = walk else {
                stats.retries += 1;
                continue;
            };
            if walk.edge & FLAGS != 0 {
                // Deleted or frozen since we passed its parent: the next walk helps at the parent.
                stats.retries += 1;
                continue;
            }
            let Some(crit) = walk.diff else {
                let found = self.entry_of(walk.edge);
                break Ok(Insert::Found(found));
            };
            let (leaf_id, leaf_gen) = match leaf {
                Some(l) => l,
                None => match inner.arena.alloc() {
                    Some(l) => *leaf.insert(l),
                    None => break Err(IndexError::Full(Arena::capacity())),
                },
            };
            let leaf_node = inner.arena.node(leaf_id);
            // Private until the publishing CAS below (Release); Relaxed is enough.
            leaf_node
                .meta
                .store(leaf_gen | META_LEAF, Ordering::Relaxed);
            leaf_node.a.store(id as u64, Ordering::Relaxed);
            // The two words from the first set bit on, where a miss usually differs from this key:
            // compared here, they spare a walk the stored page (a cold line and TLB entry).
            for (i, c) in leaf_node.c.iter().enumerate() {
                let w = walk.w0 + i;
                let word = if w < inner.words {
                    stats.query_bytes += 8;
                    inner.source.word(id, w)
                } else {
                    0
                };
                c.store(word, Ordering::Relaxed);
            }
            let leaf_edge = make_edge(leaf_id, leaf_gen);
            let new_edge = if walk.edge == 0 {
                leaf_edge
            } else {
                let (node_id, node_gen) = match node {
                    Some(n) => n,
                    None => match inner.arena.alloc() {
                        Some(n) => *node.insert(n),
                        None => break Err(IndexError::Full(Arena::capacity())),
                    },
                };
                let n = inner.arena.node(node_id);
                let dir = cur.bit(crit);
                n.meta
                    .store(node_gen | ((crit as u64) << 32), Ordering::Relaxed);
                n.a.store(leaf_edge, Ordering::Relaxed);
                n.c[dir].store(leaf_edge, Ordering::Relaxed);
                n.c[1 - dir].store(walk.edge, Ordering::Relaxed);
                make_edge(node_id, node_gen)
            };
            // Release publishes the new nodes' fields; pairs with the Acquire edge loads in `walk`.
            if walk
                .loc
                .compare_exchange(walk.edge, new_edge, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
            {
                inner.len.fetch_add(1, Ordering::Relaxed);
                let published_node = walk.edge != 0;
                leaf = None;
                if published_node {
                    node = None;
                }
                break Ok(Insert::Inserted(Entry {
                    node: leaf_id,
                    gen: leaf_gen as u32,
                    key: id,
                }));
            }
            stats.retries += 1;
        };
        for (id, _) in leaf.into_iter().chain(node) {
            inner.arena.free(id);
        }
        (result, stats)
    }

    /// The entry whose key equals `key`, if one is stored.
    pub fn lookup<K: Key + ?Sized>(&self, key: &K) -> Option<Entry> {
        self.lookup_with_stats(key).0
    }

    /// [`SdTree::lookup`], also reporting what it cost.
    pub fn lookup_with_stats<K: Key + ?Sized>(&self, key: &K) -> (Option<Entry>, OpStats) {
        let _guard = self.inner.reclaim.pin();
        key.prefetch(256);
        let mut stats = OpStats::default();
        let mut cur = Cursor::new(key);
        let walk = self
            .walk(&mut cur, &mut stats, None, true)
            .expect("lookups never restart");
        stats.query_bytes = cur.loads * 8;
        let found = (walk.edge != 0 && walk.diff.is_none() && walk.edge & DEL == 0)
            .then(|| self.entry_of(walk.edge));
        (found, stats)
    }

    /// The only entry that can equal `key`, without confirming the bytes the walk did not need:
    /// the leaf that a lookup would compare in full. For callers that compare the whole key
    /// themselves anyway (the engine does, faster, on frozen bytes); `None` means absent.
    pub fn candidate<K: Key + ?Sized>(&self, key: &K) -> Option<Entry> {
        let _guard = self.inner.reclaim.pin();
        key.prefetch(256);
        let mut stats = OpStats::default();
        let mut cur = Cursor::new(key);
        let walk = self
            .walk(&mut cur, &mut stats, None, false)
            .expect("lookups never restart");
        (walk.edge != 0 && walk.diff.is_none() && walk.edge & DEL == 0)
            .then(|| self.entry_of(walk.edge))
    }

    /// Removes the entry named by `entry`. Returns false if it was not stored (already removed, or a
    /// stale handle). The key's storage is handed back through [`KeySource::release`] after a grace
    /// period. The entry is found by walking with its own stored key, which must not have changed.
    pub fn remove(&self, entry: Entry) -> bool {
        let inner = &*self.inner;
        let guard = inner.reclaim.pin();
        let target = make_edge(entry.node, entry.gen as u64);
        {
            let n = inner.arena.node(entry.node);
            // Relaxed, loaded while pinned: the handle's generation, still there, means the leaf
            // was not yet unlinked, so its key is not released before we unpin and the walks
            // below may read it (see `reclaim`). A changed one means it was removed already.
            let meta = n.meta.load(Ordering::Relaxed);
            if meta & GEN_MASK != entry.gen as u64 || meta & META_LEAF == 0 {
                return false;
            }
        }
        let key = StoredKey {
            source: &inner.source,
            id: entry.key,
        };
        let mut marked = false;
        let mut stats = OpStats::default();
        loop {
            let mut cur = Cursor::new(&key);
            let Some(walk) = self.walk(&mut cur, &mut stats, Some(&guard), true) else {
                continue;
            };
            if walk.diff.is_some() || walk.edge & !FLAGS != target {
                // Unreachable now: our splice (or a helper's) completed, or someone else removed it.
                return marked;
            }
            if walk.edge & DEL != 0 {
                if !marked {
                    return false;
                }
                // Ours, still linked: the next walk helps splice it out.
                continue;
            }
            if walk.edge & FROZEN != 0 {
                continue;
            }
            // Linearisation point of the removal. AcqRel pairs with the loads of walkers and helpers.
            if walk
                .loc
                .compare_exchange(
                    walk.edge,
                    walk.edge | DEL,
                    Ordering::AcqRel,
                    Ordering::Relaxed,
                )
                .is_ok()
            {
                marked = true;
                inner.len.fetch_sub(1, Ordering::Relaxed);
                match walk.up {
                    Some((up_loc, up_edge)) => {
                        self.splice(up_loc, up_edge, &guard);
                    }
                    None => {
                        if walk
                            .loc
                            .compare_exchange(
                                walk.edge | DEL,
                                0,
                                Ordering::AcqRel,
                                Ordering::Relaxed,
                            )
                            .is_ok()
                        {
                            self.retire(walk.edge, &guard);
                        }
                    }
                }
            }
        }
    }

    /// A weakly consistent snapshot of the stored entries (entries inserted or removed concurrently
    /// may or may not appear).
    pub fn entries(&self) -> Vec<Entry> {
        let _guard = self.inner.reclaim.pin();
        let mut out = Vec::with_capacity(self.len());
        let mut stack = Vec::new();
        for root in self.inner.roots.iter() {
            stack.push(root.load(Ordering::Acquire));
            while let Some(e) = stack.pop() {
                if edge_id(e) == 0 {
                    continue;
                }
                let n = self.inner.arena.node(edge_id(e));
                if n.meta.load(Ordering::Relaxed) & META_LEAF != 0 {
                    if e & DEL == 0 {
                        out.push(self.entry_of(e));
                    }
                } else {
                    stack.push(n.c[1].load(Ordering::Acquire));
                    stack.push(n.c[0].load(Ordering::Acquire));
                }
            }
        }
        out
    }

    /// Nodes the arena has handed out so far (memory use of the index is 32 bytes per node).
    pub fn nodes_allocated(&self) -> usize {
        self.inner.arena.high_water()
    }

    /// Checks the structural invariants; for tests, on a quiescent tree. Verifies routing, strictly
    /// increasing critical bits, that every key sits on the side of each critical bit it has, that
    /// every representative is a live leaf sharing its node's prefix, that no flag is left behind, and
    /// that the entry count matches.
    #[doc(hidden)]
    pub fn check_invariants(&self) -> Result<(), String> {
        let inner = &*self.inner;
        let mut count = 0usize;
        for (r, root) in inner.roots.iter().enumerate() {
            let e = root.load(Ordering::Acquire);
            if e == 0 {
                continue;
            }
            let mut leaves = Vec::new();
            let first = (r >> inner.route_bits) as u32;
            let w0 = first as usize / 64;
            let min_crit = first
                + 1
                + inner
                    .route_bits
                    .min(inner.key_bits.saturating_sub(first + 1));
            self.check_subtree(e, min_crit, w0, &mut leaves)?;
            for &k in &leaves {
                let key = StoredKey {
                    source: &inner.source,
                    id: k,
                };
                let mut cur = Cursor::new(&key);
                let (slot, next) = inner.route(&mut cur);
                if slot != r || next != min_crit {
                    return Err(format!(
                        "key {k} under root {r} (bits from {min_crit}) but routes to {slot} (bits from {next})"
                    ));
                }
            }
            count += leaves.len();
        }
        if count != self.len() {
            return Err(format!(
                "{count} leaves reachable but len() is {}",
                self.len()
            ));
        }
        Ok(())
    }

    fn check_subtree(
        &self,
        e: u64,
        min_crit: u32,
        w0: usize,
        leaves: &mut Vec<KeyId>,
    ) -> Result<(), String> {
        let inner = &*self.inner;
        if e & FLAGS != 0 {
            return Err(format!("flag left on edge {e:#x}"));
        }
        let n = inner.arena.node(edge_id(e));
        let meta = n.meta.load(Ordering::Acquire);
        if meta & GEN_MASK != edge_gen(e) {
            return Err(format!("edge {e:#x} names a stale generation"));
        }
        if meta & META_LEAF != 0 {
            let id = n.a.load(Ordering::Relaxed) as KeyId;
            for w in (w0..w0 + 2).filter(|&w| w < inner.words) {
                if inner.leaf_word(n, id, w0, w) != inner.source.word(id, w) {
                    return Err(format!("leaf of key {id} has a wrong copy of word {w}"));
                }
            }
            leaves.push(id);
            return Ok(());
        }
        let crit = ((meta >> 32) & 0xffff) as u32;
        if crit < min_crit || crit >= inner.key_bits {
            return Err(format!("critical bit {crit} out of order (min {min_crit})"));
        }
        // By induction the leaves below each child agree on every bit before the child's critical
        // bit, which is after ours: comparing one leaf of each side (and the representative with
        // one of them) checks all of them, in time linear in the tree instead of in its depth.
        let mut first = [0; 2];
        for (dir, first) in first.iter_mut().enumerate() {
            *first = leaves.len();
            self.check_subtree(n.c[dir].load(Ordering::Acquire), crit + 1, w0, leaves)?;
        }
        let [k0, k1] = first.map(|i| leaves[i]);
        let key = StoredKey {
            source: &inner.source,
            id: k0,
        };
        let mut cur = Cursor::new(&key);
        if let Some(x) = inner.mismatch(&mut cur, |w| inner.source.word(k1, w), 0, crit) {
            return Err(format!(
                "keys {k0} and {k1} on the two sides of bit {crit} differ at {x}"
            ));
        }
        for (k, dir) in [(k0, 0), (k1, 1)] {
            let key = StoredKey {
                source: &inner.source,
                id: k,
            };
            if Cursor::new(&key).bit(crit) != dir {
                return Err(format!("key {k} on side {dir} of bit {crit}"));
            }
        }
        let rep = n.a.load(Ordering::Acquire);
        let rep_node = inner.arena.node(edge_id(rep));
        let rep_meta = rep_node.meta.load(Ordering::Acquire);
        if rep_meta & GEN_MASK == edge_gen(rep) && rep_meta & META_LEAF != 0 {
            let rep_key = rep_node.a.load(Ordering::Relaxed) as KeyId;
            let stored = |w| inner.source.word(rep_key, w);
            if let Some(x) = inner.mismatch(&mut cur, stored, 0, crit) {
                return Err(format!(
                    "key {k0} differs from representative {rep_key} at {x} < {crit}"
                ));
            }
        }
        Ok(())
    }

    fn entry_of(&self, e: u64) -> Entry {
        let n = self.inner.arena.node(edge_id(e));
        Entry {
            node: edge_id(e),
            gen: edge_gen(e) as u32,
            key: n.a.load(Ordering::Relaxed) as KeyId,
        }
    }

    /// Walks from the query's cluster root to where the query belongs.
    ///
    /// With `helper` (inserts and removals) the walk helps, top-down, every splice it meets and then
    /// returns `None` so the caller restarts; lookups pass `None` and read past flags. The cursor only
    /// moves forward: the zero run is skipped by find-first-set, then each node's segment is compared
    /// with the node's representative key and one bit chooses the side.
    fn walk<'t, K: Key + ?Sized>(
        &'t self,
        cur: &mut Cursor<'_, K>,
        stats: &mut OpStats,
        helper: Option<&Guard<'_>>,
        verify_leaf: bool,
    ) -> Option<Walk<'t>> {
        let inner = &*self.inner;
        // Every key in this cluster has the query's bits before `bit`.
        let (slot, mut bit) = inner.route(cur);
        let w0 = (slot >> inner.route_bits) / 64;
        let mut loc = &inner.roots[slot];
        let mut up: Option<(&AtomicU64, u64)> = None;
        loop {
            // Acquire pairs with the Release CAS that published the node behind this edge.
            let e = loc.load(Ordering::Acquire);
            if e == 0 {
                // An empty cluster: the key is absent and becomes the root leaf.
                return Some(Walk {
                    loc,
                    edge: e,
                    up,
                    diff: Some(u32::MAX),
                    w0,
                });
            }
            stats.nodes += 1;
            let n = inner.arena.node(edge_id(e));
            // Relaxed: the edge load above acquired the node's initialisation, and its leaf flag
            // and critical bit never change while it is allocated (unlinking bumps only the
            // generation, which walks ignore); it is not freed before we unpin.
            let meta = n.meta.load(Ordering::Relaxed);
            if meta & META_LEAF != 0 {
                if let (Some(guard), None) = (helper, up) {
                    if e & DEL != 0 {
                        // A deleted leaf alone in its cluster: unlink it from the root.
                        if loc
                            .compare_exchange(e, 0, Ordering::AcqRel, Ordering::Relaxed)
                            .is_ok()
                        {
                            self.retire(e, guard);
                        }
                        return None;
                    }
                }
                let key = n.a.load(Ordering::Relaxed) as KeyId;
                let diff = if verify_leaf {
                    let stored = |w| inner.leaf_word(n, key, w0, w);
                    inner.mismatch(cur, stored, bit.min(inner.key_bits), inner.key_bits)
                } else {
                    None
                };
                return Some(Walk {
                    loc,
                    edge: e,
                    up,
                    diff,
                    w0,
                });
            }
            if let Some(guard) = helper {
                if e & FLAGS != 0 {
                    // Our parent is being spliced; the restarted walk helps it from above.
                    return None;
                }
                // Acquire pairs with the flag-setting CASes of removers and helpers.
                let flags =
                    (n.c[0].load(Ordering::Acquire) | n.c[1].load(Ordering::Acquire)) & FLAGS;
                if flags != 0 {
                    self.splice(loc, e, guard);
                    return None;
                }
            }
            let crit = ((meta >> 32) & 0xffff) as u32;
            if bit < crit {
                if let Some(x) = self.segment_mismatch(n, cur, w0, bit, crit) {
                    return Some(Walk {
                        loc,
                        edge: e,
                        up,
                        diff: Some(x),
                        w0,
                    });
                }
            }
            let dir = cur.bit(crit);
            bit = crit + 1;
            up = Some((loc, e));
            loc = &n.c[dir];
        }
    }

    /// Compares query bits `[from, to)` with node `n`'s representative key.
    ///
    /// The representative is a hint, not an edge that keeps its leaf linked: it is accepted only if
    /// the leaf still has the hint's generation, and replaced by a leaf found below `n` if not. Any
    /// leaf ever below `n` shares `n`'s prefix, so a leaf of that generation is a valid witness.
    fn segment_mismatch<K: Key + ?Sized>(
        &self,
        n: &Node,
        cur: &mut Cursor<'_, K>,
        w0: usize,
        from: u32,
        to: u32,
    ) -> Option<u32> {
        let inner = &*self.inner;
        // Acquire pairs with the AcqRel CAS below that installed a repaired representative (its
        // author had acquired the leaf's publication); the first one was written before the CAS
        // that published `n`, which the edge load that led here acquired. Either way the leaf's
        // initialisation happens before what we read of it.
        let rep = n.a.load(Ordering::Acquire);
        let leaf = inner.arena.node(edge_id(rep));
        // Relaxed, loaded while pinned: the hint's generation, still there, means the leaf was not
        // yet unlinked (its generation is bumped first), so it is not freed, nor its key released,
        // before we unpin (see `reclaim`): its key id, word copies and key bytes stay the ones
        // of this generation while we read them. No re-check is needed after the reads.
        let meta = leaf.meta.load(Ordering::Relaxed);
        if meta & GEN_MASK == edge_gen(rep) && meta & META_LEAF != 0 {
            let key = leaf.a.load(Ordering::Relaxed) as KeyId;
            return inner.mismatch(cur, |w| inner.leaf_word(leaf, key, w0, w), from, to);
        }
        // Stale representative: any leaf reachable below `n` now is protected by our pin.
        let mut e = n.c[0].load(Ordering::Acquire);
        let m = loop {
            let m = inner.arena.node(edge_id(e));
            // Relaxed: as in `walk`, the leaf flag is fixed while the node is allocated.
            if m.meta.load(Ordering::Relaxed) & META_LEAF != 0 {
                break m;
            }
            e = m.c[0].load(Ordering::Acquire);
        };
        let key = m.a.load(Ordering::Relaxed) as KeyId;
        // The edge's generation, never the node's: a leaf unlinked since we read the edge already
        // carries the generation of its next allocation, which must not validate this hint.
        let fresh = e & !FLAGS;
        // Best effort; a failure means another thread installed a fresh one.
        let _ =
            n.a.compare_exchange(rep, fresh, Ordering::AcqRel, Ordering::Relaxed);
        inner.mismatch(cur, |w| inner.leaf_word(m, key, w0, w), from, to)
    }

    /// Splices out the node behind `up_edge` (stored at `up_loc`), one of whose children is a deleted
    /// leaf: freezes the other child's edge so no insert can change it, then swings `up_loc` to it.
    /// Any thread may do this; exactly one CAS succeeds and that thread retires the two nodes.
    fn splice(&self, up_loc: &AtomicU64, up_edge: u64, guard: &Guard<'_>) -> bool {
        if up_edge & FLAGS != 0 {
            return false;
        }
        let p = self.inner.arena.node(edge_id(up_edge));
        let c0 = p.c[0].load(Ordering::Acquire);
        let c1 = p.c[1].load(Ordering::Acquire);
        let dead = if c0 & DEL != 0 {
            0
        } else if c1 & DEL != 0 {
            1
        } else {
            return false;
        };
        let sibling = &p.c[1 - dead];
        let mut s = sibling.load(Ordering::Acquire);
        while s & FLAGS == 0 {
            // AcqRel: an insert's CAS on this edge either happened before (we move its node up) or
            // fails after (it sees the flag and helps).
            match sibling.compare_exchange(s, s | FROZEN, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => s |= FROZEN,
                Err(v) => s = v,
            }
        }
        // The sibling keeps a DEL flag (both children deleted: it moves up still deleted).
        if up_loc
            .compare_exchange(up_edge, s & !FROZEN, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
        {
            let dead_edge = p.c[dead].load(Ordering::Relaxed); // immutable once flagged
            self.retire(up_edge, guard);
            self.retire(dead_edge, guard);
            true
        } else {
            false
        }
    }

    /// Retires the node behind `e`, which this thread's CAS just unlinked: invalidates it at once,
    /// so that hints naming it are refused from now on, then frees it after a grace period and
    /// releases a leaf's key to the caller (see `reclaim` for why that order keeps every reader
    /// that accepted the node safe).
    fn retire(&self, e: u64, guard: &Guard<'_>) {
        let inner = Arc::clone(&self.inner);
        let id = edge_id(e);
        let n = inner.arena.node(id);
        // Relaxed: fixed since the node's initialisation, which our unlinking CAS acquired.
        let meta = n.meta.load(Ordering::Relaxed);
        let key = (meta & META_LEAF != 0).then(|| n.a.load(Ordering::Relaxed) as KeyId);
        inner.arena.invalidate(id);
        guard.defer(move || {
            inner.arena.free(id);
            if let Some(k) = key {
                inner.source.release(k);
            }
        });
    }
}

/// Under loom, the tree's own reclamation domain holds deferred frees that hold the tree: run
/// them when the last handle goes (no thread can be pinned on the tree then).
#[cfg(loom)]
impl<S: KeySource> Drop for SdTree<S> {
    fn drop(&mut self) {
        self.inner.reclaim.drain();
    }
}

impl<S: KeySource> Inner<S> {
    /// Position of the key's first set bit, or `key_bits` for the all-zero key. Reads the zero run a
    /// word at a time (find-first-set), which is how hard keys skip their prefix.
    fn first_set<K: Key + ?Sized>(&self, cur: &mut Cursor<'_, K>) -> u32 {
        for w in 0..self.words {
            let mut q = cur.word(w);
            let end = (w as u32 + 1) * 64;
            if end > self.key_bits {
                q &= !(u64::MAX >> (64 - (end - self.key_bits)));
            }
            if q != 0 {
                return w as u32 * 64 + q.leading_zeros();
            }
        }
        self.key_bits
    }

    /// The root slot for the query and the first bit below it: the position of the first set bit and
    /// the `route_bits` bits after it (as many as the key has, then zeros). Reads no word twice: the
    /// route bits are in the first set bit's word or the next, which the walk reads first anyway.
    #[inline]
    fn route<K: Key + ?Sized>(&self, cur: &mut Cursor<'_, K>) -> (usize, u32) {
        let first = self.first_set(cur);
        let from = first + 1;
        let n = self.route_bits.min(self.key_bits.saturating_sub(from));
        let mut value = 0u64;
        if n > 0 {
            let w = (from / 64) as usize;
            let off = from % 64;
            let mut v = cur.word(w) << off;
            if off + n > 64 {
                // off > 64 - MAX_ROUTE_BITS here, so the shift is in range.
                v |= cur.word(w + 1) >> (64 - off);
            }
            value = (v >> (64 - n)) << (self.route_bits - n);
        }
        (
            ((first as usize) << self.route_bits) | value as usize,
            from + n,
        )
    }

    /// Word `w` of the key stored in leaf `leaf` (key `id`, in a cluster whose first set bit is in
    /// word `w0`): from the leaf's copy for words `w0` and `w0 + 1`, else from the key source.
    #[inline]
    fn leaf_word(&self, leaf: &Node, id: KeyId, w0: usize, w: usize) -> u64 {
        // Written before the leaf was published and immutable while it is allocated; ordered by the
        // Acquire load of the edge or representative that named it (and re-validated by generation
        // where that is a hint).
        match w.wrapping_sub(w0) {
            0 => leaf.c[0].load(Ordering::Relaxed),
            1 => leaf.c[1].load(Ordering::Relaxed),
            _ => self.source.word(id, w),
        }
    }

    /// First bit in `[from, to)` where the query differs from the stored key whose words `stored`
    /// returns.
    #[inline]
    fn mismatch<K: Key + ?Sized>(
        &self,
        cur: &mut Cursor<'_, K>,
        stored: impl Fn(usize) -> u64,
        from: u32,
        to: u32,
    ) -> Option<u32> {
        let mut bit = from;
        while bit < to {
            let w = (bit / 64) as usize;
            let mut x = cur.word(w) ^ stored(w);
            x &= u64::MAX >> (bit % 64);
            let word_end = (w as u32 + 1) * 64;
            if to < word_end {
                // 0 < to - 64w < 64 here: keep only the bits before `to`.
                x &= !(u64::MAX >> (to % 64));
            }
            if x != 0 {
                return Some(w as u32 * 64 + x.leading_zeros());
            }
            bit = word_end;
        }
        None
    }
}
