//! Page access: reading registered pages, which their owner may be writing meanwhile, and what a
//! read finds ([`Pre`]: zero, equal to a stable copy, or the xxh3-128 hash of the contents, with
//! [`IdentityHasher`] for the maps keyed by such hashes).
//!
//! No reference is ever formed to such memory: words are read with volatile loads and whole pages
//! are copied into buffers of the engine's own. What a read concludes is a hint only: every merge
//! is verified on frozen bytes by the commit.

use pageone_index::{KeyId, SdTree, WordKey};
use pageone_sys as sys;

use crate::store::StoreKeys;

/// Bytes of a page.
pub(crate) const PAGE: usize = sys::PAGE_SIZE;
/// 64-bit words of a page.
pub(crate) const WORDS: usize = PAGE / 8;

/// Reads word `i` of the page at `addr`, big-endian, with a volatile load (the owner may write it).
pub(crate) fn page_word(addr: usize, i: usize) -> u64 {
    // SAFETY: addr is a registered, mapped page and i < WORDS; volatile because another thread
    // may write it concurrently. A torn view only affects which index entry is proposed: every
    // merge is verified on frozen bytes.
    u64::from_be(unsafe { std::ptr::read_volatile((addr as *const u64).add(i)) })
}

/// Copies the page at `addr` (which its owner may be writing) into `buf`, to be read there.
pub(crate) fn copy_page(addr: usize, buf: &mut [u64; WORDS]) {
    // SAFETY: addr is a registered, mapped page and `buf` a page of this thread's own; no reference
    // to the page is formed, and what a concurrent writer can cause is a torn copy, which only
    // affects which copy or hash is proposed (every merge is verified on frozen bytes). A plain
    // copy rather than word-by-word volatile loads, as rust-vmm's vm-memory copies guest memory
    // longer than a word: `memcpy` runs at memory speed (this copy and hash is most of the
    // read-ahead's time).
    unsafe { std::ptr::copy_nonoverlapping(addr as *const u64, buf.as_mut_ptr(), WORDS) };
}

pub(crate) fn as_bytes(buf: &[u64; WORDS]) -> &[u8] {
    // SAFETY: a [u64; 512] is 4096 initialised bytes; u8 has no alignment requirement.
    unsafe { std::slice::from_raw_parts(buf.as_ptr().cast::<u8>(), PAGE) }
}

/// Checksum-mode watching: whether the page at `addr` changed since the last call.
pub(crate) fn checksum_changed(addr: usize, last: &mut u64) -> bool {
    let mut buf = [0u64; WORDS];
    copy_page(addr, &mut buf);
    let sum = twox_hash::XxHash3_64::oneshot(as_bytes(&buf));
    let changed = *last != sum;
    *last = sum;
    changed
}

/// The first three words of the page at `addr` (a PPR mark's place), read volatile.
///
/// # Safety
/// `addr` is a mapped, readable page that stays mapped during the call.
pub(crate) unsafe fn mark_words(addr: usize) -> [u64; 3] {
    // SAFETY: by the caller's contract; volatile because another thread may write the page.
    [0, 1, 2].map(|w| unsafe { std::ptr::read_volatile((addr as *const u64).add(w)) })
}

/// Whether the page at `live` (held still by write-protection) equals copy `copy`. Volatile
/// reads: the page is someone else's memory even while writers are held off.
pub(crate) fn live_page_equals(live: usize, copy: usize) -> bool {
    (0..WORDS).all(|i| {
        // SAFETY: both are mapped pages and i < WORDS; `copy` is an immutable published copy.
        unsafe {
            std::ptr::read_volatile((live as *const u64).add(i))
                == std::ptr::read_volatile((copy as *const u64).add(i))
        }
    })
}

/// What classification finds for the page at `addr`: zero, equal to a stable copy, or else its
/// hash (of a snapshot: the page may change meanwhile).
pub(crate) fn read_page(
    addr: usize,
    tree: Option<&SdTree<StoreKeys>>,
    store_base: usize,
    buf: &mut [u64; WORDS],
) -> Pre {
    if (0..WORDS).all(|i| page_word(addr, i) == 0) {
        return Pre::Zero;
    }
    if let Some(id) = tree.and_then(|t| stable_copy(addr, t, store_base)) {
        return Pre::Stable(id);
    }
    copy_page(addr, buf);
    let h = twox_hash::XxHash3_128::oneshot(as_bytes(buf));
    Pre::Hash([h as u64, (h >> 64) as u64])
}

/// The stable copy equal to the page at `addr`, if the tree has one. The tree names the only copy
/// that can match; the full compare is done here with plain word loads, faster than through the
/// tree's key accessor (and the commit compares again, on frozen bytes).
pub(crate) fn stable_copy(
    addr: usize,
    tree: &SdTree<StoreKeys>,
    store_base: usize,
) -> Option<KeyId> {
    let key = WordKey(|i| page_word(addr, i));
    let e = tree.candidate(&key)?;
    live_page_equals(addr, store_base + e.key() as usize * PAGE).then(|| e.key())
}

/// The hash of `Pre::Hash` as one number.
pub(crate) fn joined(h: [u64; 2]) -> u128 {
    h[0] as u128 | (h[1] as u128) << 64
}

/// What reading a page ahead found (see `read_ahead`). A hint only: every merge is verified on
/// frozen bytes.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Pre {
    /// Nothing known: classification reads the page.
    None,
    Zero,
    /// Equal to this stable copy when read.
    Stable(KeyId),
    /// Matched no stable copy; the xxh3-128 hash of its contents (low word first).
    Hash([u64; 2]),
}

/// Keys that are xxh3 hashes already need no hashing again: use their low bits.
#[derive(Default, Clone, Copy)]
pub(crate) struct IdentityHasher(u64);

impl std::hash::Hasher for IdentityHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes.iter().take(8) {
            self.0 = (self.0 << 8) | b as u64;
        }
    }
    fn write_u128(&mut self, v: u128) {
        self.0 = v as u64;
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = v;
    }
    /// Spread over the whole word (an odd multiplier is a bijection): the map's tags come from
    /// the top bits, which a `u32` leaves zero.
    fn write_u32(&mut self, v: u32) {
        self.0 = u64::from(v).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

pub(crate) type HashOfHash = std::hash::BuildHasherDefault<IdentityHasher>;
