//! The node arena: fixed-size nodes named by 32-bit ids, never by pointers.
//!
//! Every node is four 64-bit words, each changed only by atomic stores or CAS. Because links are ids
//! plus generation tags, the same layout can later live in a memfd mapped at different addresses by
//! several processes (the chunk directory would then hold file offsets instead of pointers, and a walker
//! bounds-checks each id, which [`Arena::node`] already does). Nodes come from a bump allocator over
//! lazily allocated chunks and from a free list; the free list is a Treiber stack whose head carries a
//! tag incremented on every change, so a stale head can never be swapped back in (no ABA). Its CAS
//! loops are lock-free: a CAS fails only because another thread's push or pop succeeded.
//!
//! A node's life: allocated (private until a CAS publishes it), linked, unlinked by one CAS and at
//! once [`invalidate`](Arena::invalidate)d (its generation bumped), then after a grace period
//! [`free`](Arena::free)d, and allocated again under the new generation.

use crate::primitive::{AtomicPtr, AtomicU32, AtomicU64, Ordering};

/// Bits of a node id that select the slot within a chunk.
#[cfg(not(loom))]
const CHUNK_SHIFT: u32 = 14;
#[cfg(loom)]
const CHUNK_SHIFT: u32 = 3;
const CHUNK_NODES: usize = 1 << CHUNK_SHIFT;
/// Chunks the directory can name; capacity is `DIR_CHUNKS * CHUNK_NODES` nodes.
#[cfg(not(loom))]
const DIR_CHUNKS: usize = 4096;
#[cfg(loom)]
const DIR_CHUNKS: usize = 8;

/// Generation tags are 30 bits: they share an edge word with a 32-bit id and two flag bits.
pub(crate) const GEN_MASK: u64 = (1 << 30) - 1;
/// `meta` flag: the node is a leaf (else an internal node).
pub(crate) const META_LEAF: u64 = 1 << 30;

/// One tree node.
///
/// - `meta`: generation (bits 0..30), leaf flag (bit 30), critical bit position (bits 32..48).
/// - `a`: a leaf's key id; an internal node's representative leaf (an untagged edge).
/// - `c`: an internal node's children (edges) for bit value 0 and 1; a leaf's copy of its key's
///   words `w0` and `w0 + 1`, where `w0` holds the key's first set bit. Free nodes keep the
///   free-list link in `a`.
pub(crate) struct Node {
    pub(crate) meta: AtomicU64,
    pub(crate) a: AtomicU64,
    pub(crate) c: [AtomicU64; 2],
}

impl Node {
    fn new() -> Self {
        Node {
            meta: AtomicU64::new(0),
            a: AtomicU64::new(0),
            c: [AtomicU64::new(0), AtomicU64::new(0)],
        }
    }
}

/// Ids a thread takes from the bump counter at once, so that concurrent inserters do not bounce
/// the counter's cache line on every node.
#[cfg(not(loom))]
const RESERVE: u32 = 64;

#[cfg(not(loom))]
static ARENA_SERIAL: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

#[cfg(not(loom))]
thread_local! {
    /// This thread's reserved ids: (arena serial, next, end). A serial, not an address, names the
    /// arena: a new arena may be allocated where a dropped one was.
    static RESERVED: std::cell::Cell<(u64, u32, u32)> = const { std::cell::Cell::new((0, 0, 0)) };
}

pub(crate) struct Arena {
    #[cfg(not(loom))]
    serial: u64,
    dir: Box<[AtomicPtr<Node>]>,
    /// Next never-used id; id 0 is reserved as "null".
    next: AtomicU32,
    /// Free-list head: tag (high 32 bits) and id (low 32 bits).
    free: AtomicU64,
}

impl Arena {
    pub(crate) fn new() -> Self {
        Arena {
            // Relaxed: only uniqueness matters.
            #[cfg(not(loom))]
            serial: ARENA_SERIAL.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            dir: (0..DIR_CHUNKS)
                .map(|_| AtomicPtr::new(std::ptr::null_mut()))
                .collect(),
            next: AtomicU32::new(1),
            free: AtomicU64::new(0),
        }
    }

    /// Most nodes this arena can hold.
    pub(crate) fn capacity() -> usize {
        DIR_CHUNKS * CHUNK_NODES - 1
    }

    /// The node named `id`.
    ///
    /// Panics if `id` was never allocated: ids only reach the tree from [`Arena::alloc`], so this is an
    /// internal-consistency check, cheap because the chunk pointer is loaded anyway.
    #[inline]
    pub(crate) fn node(&self, id: u32) -> &Node {
        let chunk = self.dir[(id >> CHUNK_SHIFT) as usize].load(Ordering::Acquire); // pairs with the publishing CAS in `chunk_for`
        assert!(
            !chunk.is_null(),
            "index node id {id} names an unallocated chunk"
        );
        // SAFETY: `chunk` is non-null, so it points to a live chunk of CHUNK_NODES nodes created by
        // `chunk_for` and never freed before the arena is dropped; the index is masked to that size.
        unsafe { &*chunk.add(id as usize & (CHUNK_NODES - 1)) }
    }

    /// Allocates a node and returns its id and current generation, or `None` when the arena is full.
    /// The node's fields are left for the caller to initialise before publishing it.
    pub(crate) fn alloc(&self) -> Option<(u32, u64)> {
        if let Some(id) = self.pop_free() {
            // Relaxed: the last write of `meta` (`invalidate`, or the initialisation of a node
            // never published) happens before the `free` that pushed the node, whose Release CAS
            // our pop acquired.
            let gen = self.node(id).meta.load(Ordering::Relaxed) & GEN_MASK;
            return Some((id, gen));
        }
        let id = self.bump();
        if id as usize > Self::capacity() {
            return None;
        }
        self.chunk_for(id);
        let gen = self.node(id).meta.load(Ordering::Relaxed) & GEN_MASK;
        Some((id, gen))
    }

    /// A never-used id: from this thread's reservation, refilled `RESERVE` at a time.
    #[cfg(not(loom))]
    fn bump(&self) -> u32 {
        let (serial, next, end) = RESERVED.get();
        if serial == self.serial && next < end {
            RESERVED.set((serial, next + 1, end));
            return next;
        }
        // Relaxed: uniqueness only; chunk publication in `chunk_for` orders the memory.
        let start = self.next.fetch_add(RESERVE, Ordering::Relaxed);
        RESERVED.set((
            self.serial,
            start.saturating_add(1),
            start.saturating_add(RESERVE),
        ));
        start
    }

    #[cfg(loom)]
    fn bump(&self) -> u32 {
        self.next.fetch_add(1, Ordering::Relaxed) // uniqueness only
    }

    fn chunk_for(&self, id: u32) {
        let slot = &self.dir[(id >> CHUNK_SHIFT) as usize];
        if !slot.load(Ordering::Acquire).is_null() {
            return;
        }
        let chunk: Box<[Node]> = (0..CHUNK_NODES).map(|_| Node::new()).collect();
        let ptr = Box::into_raw(chunk) as *mut Node;
        // Release publishes the initialised chunk; pairs with the Acquire loads in `node`.
        if slot
            .compare_exchange(
                std::ptr::null_mut(),
                ptr,
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .is_err()
        {
            // SAFETY: `ptr` came from Box::into_raw of a CHUNK_NODES slice just above and was never shared.
            drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(ptr, CHUNK_NODES)) });
        }
    }

    /// Marks node `id`, just unlinked, as no longer the node its edges and hints name: bumps its
    /// generation, keeping the leaf flag and critical bit that walkers still inside it read. From
    /// then on a generation check (representatives, entry handles) refuses it. Called exactly once,
    /// by the thread whose CAS unlinked the node, before that thread defers the node's [`free`];
    /// see [`crate::reclaim`] for why a reader that passed the check before the bump is safe.
    ///
    /// [`free`]: Arena::free
    pub(crate) fn invalidate(&self, id: u32) {
        let node = self.node(id);
        // Relaxed load: `meta` was last written when the node was initialised, by this thread or
        // before the publishing CAS that the unlinking CAS of this thread read.
        let meta = node.meta.load(Ordering::Relaxed);
        let gen = ((meta & GEN_MASK) + 1) & GEN_MASK;
        // Relaxed: readers that see the new generation only refuse the node, so nothing is
        // published with it. Its ordering before the free is the reclamation's: it is sequenced
        // before `Guard::defer`, whose SeqCst fence makes a later reader see it (`Fd` in
        // `reclaim`), and before the deferred free, which a later allocator reads it after.
        node.meta.store((meta & !GEN_MASK) | gen, Ordering::Relaxed);
    }

    /// Returns node `id` to the free list. The caller guarantees that no thread can reach it any
    /// more: either it was never published, or it was [`invalidate`](Arena::invalidate)d when it
    /// was unlinked and a grace period has passed since. Leaves `meta` (and so the generation the
    /// next allocation gets) alone: a node that was published already carries a new generation,
    /// and one that never was is named by no edge.
    pub(crate) fn free(&self, id: u32) {
        let node = self.node(id);
        let mut head = self.free.load(Ordering::Acquire);
        loop {
            // Relaxed: published by the Release CAS below. No reader of the tree reads `a` of a
            // free node: a reader that accepted the node as allocated finished before this free
            // (see `invalidate`), and one that loads the new generation refuses it first.
            node.a.store(head & 0xffff_ffff, Ordering::Relaxed);
            let new = (((head >> 32) + 1) << 32) | id as u64;
            // Release pairs with the Acquire in `pop_free`, publishing the link (and the generation
            // written before the grace period) to the next allocator of this node.
            match self
                .free
                .compare_exchange_weak(head, new, Ordering::Release, Ordering::Acquire)
            {
                Ok(_) => return,
                Err(h) => head = h,
            }
        }
    }

    fn pop_free(&self) -> Option<u32> {
        let mut head = self.free.load(Ordering::Acquire); // pairs with the Release CAS in `free`
        loop {
            let id = (head & 0xffff_ffff) as u32;
            if id == 0 {
                return None;
            }
            // A stale read here (the node was popped and reused meanwhile) is harmless: the tag in
            // `head` has changed too, so the CAS below fails.
            let next = self.node(id).a.load(Ordering::Relaxed);
            let new = (((head >> 32) + 1) << 32) | (next & 0xffff_ffff);
            match self
                .free
                .compare_exchange_weak(head, new, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => return Some(id),
                Err(h) => head = h,
            }
        }
    }

    /// Nodes ever handed out by the bump allocator (an upper bound on live nodes).
    pub(crate) fn high_water(&self) -> usize {
        self.next.load(Ordering::Relaxed) as usize - 1
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        for slot in self.dir.iter() {
            let ptr = slot.load(Ordering::Acquire);
            if !ptr.is_null() {
                // SAFETY: every non-null directory entry is a leaked Box of CHUNK_NODES nodes, and `&mut
                // self` means no other reference into the arena exists.
                drop(unsafe {
                    Box::from_raw(std::ptr::slice_from_raw_parts_mut(ptr, CHUNK_NODES))
                });
            }
        }
    }
}
