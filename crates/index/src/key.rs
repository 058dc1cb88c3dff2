//! How the tree reads keys: word by word, big-endian, never copying a key in.

/// Identifier of a key, chosen by the caller (a page index, a stable-store slot...).
pub type KeyId = u32;

/// Longest key the tree accepts: one 4 KiB page. Bit positions fit in 15 bits.
pub const MAX_KEY_BYTES: usize = 4096;

/// Resolves the ids of stored keys to their bytes.
///
/// `word(id, i)` returns bytes `[8i, 8i + 8)` of key `id` as a big-endian `u64`, with bytes past the
/// key's end reading as zero. A stored key must not change while it is in the tree; the tree never
/// reads it through an entry after it has called [`KeySource::release`] for that entry. Implementations
/// that read memory another thread or process may write must use volatile or atomic reads, never a
/// `&[u8]`.
///
/// The tree asks only for ids it holds and for `i` below the key's word count, but an
/// implementation must stay memory-safe for any arguments: check the bounds in release builds too
/// (returning any value, e.g. 0, for an id or word that does not exist), so that a bug anywhere
/// cannot become a read outside the keys' storage.
pub trait KeySource: Send + Sync + 'static {
    /// Word `i` of key `id`.
    fn word(&self, id: KeyId, i: usize) -> u64;

    /// Called once the tree can no longer read key `id` (after a removal and a grace period): the
    /// caller may now reuse or free the key's storage.
    fn release(&self, _id: KeyId) {}
}

/// A key to look up that is not stored in the tree.
pub trait Key {
    /// Bytes `[8i, 8i + 8)` of the key as a big-endian `u64`, zero past the key's end.
    fn word(&self, i: usize) -> u64;

    /// A hint that the first `bytes` bytes will be read soon: a lookup's zero-run scan reads them
    /// in order, and asking for them together overlaps their cache misses.
    #[inline]
    fn prefetch(&self, _bytes: usize) {}
}

impl Key for [u8] {
    #[inline]
    fn prefetch(&self, bytes: usize) {
        #[cfg(target_arch = "x86_64")]
        for off in (0..bytes.min(self.len())).step_by(64) {
            // SAFETY: SSE is part of the x86-64 baseline, and a prefetch is only a hint: it never
            // faults and reads nothing architecturally (the address is inside the slice anyway).
            unsafe {
                core::arch::x86_64::_mm_prefetch::<{ core::arch::x86_64::_MM_HINT_T0 }>(
                    self[off..].as_ptr().cast(),
                );
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = bytes;
    }

    #[inline]
    fn word(&self, i: usize) -> u64 {
        let start = i * 8;
        match self.get(start..start + 8) {
            Some(b) => u64::from_be_bytes(b.try_into().expect("slice of 8 bytes")),
            None => {
                let mut buf = [0u8; 8];
                if let Some(tail) = self.get(start..) {
                    buf[..tail.len()].copy_from_slice(tail);
                }
                u64::from_be_bytes(buf)
            }
        }
    }
}

/// Adapts a closure returning words into a [`Key`], e.g. one doing volatile reads of a watched page.
pub struct WordKey<F: Fn(usize) -> u64>(pub F);

impl<F: Fn(usize) -> u64> Key for WordKey<F> {
    #[inline]
    fn word(&self, i: usize) -> u64 {
        (self.0)(i)
    }
}

/// A stored key read through its source, so inserts and removals walk with the same code as lookups.
pub(crate) struct StoredKey<'a, S: KeySource> {
    pub(crate) source: &'a S,
    pub(crate) id: KeyId,
}

impl<S: KeySource> Key for StoredKey<'_, S> {
    #[inline]
    fn word(&self, i: usize) -> u64 {
        self.source.word(self.id, i)
    }
}
