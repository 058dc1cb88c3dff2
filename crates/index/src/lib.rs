//! The SD tree: a lock-free content index over page bytes that examines each key bit at most once.
//!
//! # Design
//!
//! Keys are byte strings of one fixed length up to 4 KiB (pages). The tree never copies a whole key:
//! it stores the caller's [`KeyId`] in a leaf and reads key bytes through a [`KeySource`] (stored
//! keys) or a [`Key`] (queries), one big-endian 64-bit word at a time, so watched memory can be read
//! with volatile loads. A leaf also keeps a copy of the two words from its key's first set bit on
//! (in the leaf node's otherwise unused child words): a miss almost always differs from the leaf or
//! representative it is compared with within those 16 bytes, so it is rejected without touching the
//! stored page, a cold cache line and TLB entry (1 stored-key word per miss before, 0 after, on both
//! benchmark key sets).
//!
//! **Upper level (static).** Each key is routed by the position of its first set bit, found with
//! find-first-set while the cursor skips the zero run a word at a time, and by the
//! [`DEFAULT_ROUTE_BITS`] (8) bits after it, to one of `(8 * key_len + 1) << 8` cluster roots. Pages
//! often begin with runs of zeros of varying length; in a plain crit-bit trie those keys hang off one
//! long spine of zero bits (one node per distinct run length). Routing removes that spine: a key with
//! a 128-byte zero prefix reaches its cluster after reading 17 words. The 8 bits after the first set
//! bit replace the top 8 levels of every cluster's trie with one indexed load: those levels are
//! dependent node loads, cold for keys spread over many positions (hard keys: 8.5 nodes per miss
//! without route bits, 1.1 with them). The root table is zero-filled on demand (`alloc_zeroed`), so
//! it commits 2 KiB per first-set-bit position in use (16 KiB for keys whose first set bit is in the
//! first byte; 64 MiB if keys used all 32769 positions of a page).
//!
//! **Lower level (dynamic).** Each cluster is a crit-bit (PATRICIA) trie over the bits after the
//! route bits. An internal node holds the critical bit `crit` where its two subtrees first differ, a
//! representative leaf, and two child edges. A walk keeps a cursor into the query that only moves forward: at a node it compares the query's
//! bits from the cursor up to `crit` against the representative (XOR of words, leading-zero count),
//! then takes the side given by the query's bit at `crit`. A query that differs from every stored key
//! is rejected at the first differing bit, after reading only its distinguishing prefix; a hit reads
//! the query exactly once. Compare a KSM-style tree ordered by `memcmp`, which re-reads the common
//! prefix at every level.
//!
//! **Words, ids, CAS.** A node is four 64-bit words in an [`arena`](crate::arena) addressed by 32-bit
//! ids. An edge word packs a node id, the node's 30-bit generation, and two flags. Every change to the
//! shared structure is a single CAS on one edge:
//! - *insert*: build a leaf and an internal node privately, then swing the edge where the query left
//!   the tree to the new internal node (Release publishes the private writes);
//! - *remove by handle*: the handle names the leaf and its generation, never the key's current
//!   content; the remover CASes the DEL flag onto the leaf's edge (the linearisation point), then the
//!   parent is spliced out by freezing the sibling edge (FROZEN) and swinging the grandparent edge to
//!   the sibling. Any mutating walk that meets a flagged node helps finish the splice before going on,
//!   so no thread waits for another.
//!
//! **Progress.** Lookups ([`SdTree::lookup`], [`SdTree::candidate`]) are wait-free: one descent,
//! at most one node per key bit, never restarted. An insert attempt fails only because another
//! thread's CAS changed its path (or a removal on it is being finished, which the next attempt
//! helps); after [`INSERT_ATTEMPTS`] failures in a row it returns [`IndexError::Contended`], which
//! the caller handles like any failed insert. Removals are lock-free but not bounded: each retry
//! also follows another thread's change on the path to the leaf (an insert above it, the splice
//! of a neighbour), so some operation always completes, but a removal has no honest way to give
//! up (it must neither report a stored entry absent nor leave its key unreleased). Without
//! concurrent changes to that path, a removal takes two walks.
//!
//! **Reclamation.** Unlinked nodes are freed, and leaf keys released to the caller, only after an epoch
//! grace period (crossbeam-epoch; a loom model of it under loom). Generations in edges make a recycled
//! node unmistakable even to a stale CAS (no ABA). A node's generation is bumped by the thread that
//! unlinks it, *before* the grace period starts, so the hints that outlive the unlink (representatives,
//! entry handles) are refused from then on, and a reader that accepted one before the bump is waited
//! for like any reader of the unlinked node: no node is reused, and no key released, under a thread
//! that may still read it (see the `reclaim` module). Representatives are repaired on use.
//!
//! **Shared memory.** Nodes hold ids, never pointers, and every id read goes through a bounds-checked
//! arena lookup, so the same layout can be placed in a memfd mapped by several processes; that version
//! (for the cross-process engine) replaces the epoch by per-client quiescent-state counters in the shared
//! header. Thread count is never fixed.
//!
//! Counters for tests and benchmarks come back per operation in [`OpStats`].

mod arena;
mod key;
mod primitive;
mod reclaim;
mod tree;

pub use key::{Key, KeyId, KeySource, WordKey, MAX_KEY_BYTES};
pub use tree::{
    Entry, IndexError, Insert, OpStats, SdTree, DEFAULT_ROUTE_BITS, INSERT_ATTEMPTS, MAX_ROUTE_BITS,
};

#[cfg(all(test, not(loom)))]
mod tests;
