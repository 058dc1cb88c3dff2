//! Page access: reading registered pages, which their owner may be writing (or unmapping)
//! meanwhile, and what a read finds ([`Pre`]: zero, equal to a stable copy, or the xxh3-128 hash
//! of the contents, with [`IdentityHasher`] for the maps keyed by such hashes).
//!
//! Registered memory is never loaded from directly: the kernel copies it into buffers of the
//! engine's own ([`PageReader`], `process_vm_readv` of this process). So no engine thread races
//! the program's writes in the language's sense, and a range the program unmaps meanwhile (for
//! instance inside `free()`, where no shim sees it) is a failed read, not a fault that would end
//! the program. What a read concludes is a hint only: every merge is verified on frozen bytes by
//! the commit.

use pageone_index::{KeyId, SdTree, WordKey};
use pageone_sys as sys;

use crate::store::StoreKeys;

/// Bytes of a page.
pub(crate) const PAGE: usize = sys::PAGE_SIZE;
/// 64-bit words of a page.
pub(crate) const WORDS: usize = PAGE / 8;
/// Pages one read copies at most (one system call): 16 reads cost about as much per page as
/// more (measured on the development machine: 0.9 us/page, against 1.9 one page at a time).
pub(crate) const READ_BATCH: usize = 16;

/// A page copied out of registered memory.
pub(crate) type PageBuf = [u64; WORDS];

/// Reads registered pages through the kernel into a buffer of its own (see the module
/// documentation), up to [`READ_BATCH`] at a time.
pub(crate) struct PageReader {
    buf: Box<[PageBuf; READ_BATCH]>,
}

impl PageReader {
    pub(crate) fn new() -> Self {
        PageReader {
            buf: Box::new([[0; WORDS]; READ_BATCH]),
        }
    }

    /// Reads the pages at `addrs` in batches and calls `f(address, bytes)` for each, in order;
    /// `bytes` is `None` for a page that could not be read (unmapped meanwhile).
    pub(crate) fn read_each(
        &mut self,
        addrs: impl IntoIterator<Item = usize>,
        mut f: impl FnMut(usize, Option<&PageBuf>),
    ) {
        let mut batch = [0usize; READ_BATCH];
        let mut n = 0;
        for addr in addrs {
            batch[n] = addr;
            n += 1;
            if n == READ_BATCH {
                self.read_batch(&batch[..n], &mut f);
                n = 0;
            }
        }
        self.read_batch(&batch[..n], &mut f);
    }

    fn read_batch(&mut self, addrs: &[usize], f: &mut impl FnMut(usize, Option<&PageBuf>)) {
        let mut at = 0;
        while at < addrs.len() {
            let read = self.read(&addrs[at..]);
            for (k, &addr) in addrs[at..at + read].iter().enumerate() {
                f(addr, Some(&self.buf[k]));
            }
            at += read;
            if at < addrs.len() {
                // The page after the last one read could not be: skip it.
                f(addrs[at], None);
                at += 1;
            }
        }
    }

    /// Reads the pages at `addrs` (at most [`READ_BATCH`]) into the buffer; returns how many,
    /// from the first, were read.
    fn read(&mut self, addrs: &[usize]) -> usize {
        let mut pieces = [(0usize, 0usize); READ_BATCH];
        for (p, &a) in pieces.iter_mut().zip(addrs) {
            *p = (a, PAGE);
        }
        let n = addrs.len().min(READ_BATCH);
        // SAFETY: the buffer holds READ_BATCH pages, and n <= READ_BATCH pieces of a page each.
        let bytes = unsafe { sys::read_own_memory(self.buf.as_mut_ptr().cast(), &pieces[..n]) };
        bytes.map_or(0, |b| b / PAGE)
    }

    /// Reads one page; `None` if it cannot be read.
    pub(crate) fn read_one(&mut self, addr: usize) -> Option<&PageBuf> {
        (self.read(&[addr]) == 1).then_some(&self.buf[0])
    }
}

/// The first `N` words of each page at `addrs` into `marks` (e.g. PPR marks' places; `None` for a
/// page that could not be read, unmapped meanwhile), read through the kernel, with one system
/// call for all of them unless one cannot be read.
pub(crate) fn read_words_each<const N: usize>(addrs: &[usize], marks: &mut [Option<[u64; N]>]) {
    let mut buf = vec![[0u64; N]; addrs.len()];
    let mut k = 0;
    while k < addrs.len() {
        let srcs: Vec<(usize, usize)> = addrs[k..].iter().map(|&a| (a, N * 8)).collect();
        // SAFETY: `buf[k..]` holds exactly the words asked for.
        let bytes = unsafe { sys::read_own_memory(buf[k..].as_mut_ptr().cast(), &srcs) };
        // Whole pieces are read up to the first that could not be (the next one).
        let done = bytes.unwrap_or(0) / (N * 8);
        for j in k..k + done {
            marks[j] = Some(buf[j]);
        }
        if let Some(m) = marks.get_mut(k + done) {
            *m = None;
        }
        k += done + 1;
    }
}

pub(crate) fn as_bytes(buf: &PageBuf) -> &[u8] {
    // SAFETY: a [u64; 512] is 4096 initialised bytes; u8 has no alignment requirement.
    unsafe { std::slice::from_raw_parts(buf.as_ptr().cast::<u8>(), PAGE) }
}

/// Checksum-mode watching: whether the page at `addr` changed since the last call (a page that
/// cannot be read counts as changed).
pub(crate) fn checksum_changed(reader: &mut PageReader, addr: usize, last: &mut u64) -> bool {
    let Some(sum) = reader
        .read_one(addr)
        .map(|b| twox_hash::XxHash3_64::oneshot(as_bytes(b)))
    else {
        *last = 0;
        return true;
    };
    let changed = *last != sum;
    *last = sum;
    changed
}

/// Whether `bytes` equal copy `copy` of the store's view (an immutable published copy).
pub(crate) fn equals_copy(bytes: &PageBuf, copy: usize) -> bool {
    (0..WORDS).all(|i| {
        // SAFETY: `copy` is a mapped page of the store's view, immutable while referenced, and
        // i < WORDS.
        bytes[i] == unsafe { std::ptr::read_volatile((copy as *const u64).add(i)) }
    })
}

/// Whether the page read into `bytes` holds only zeros.
pub(crate) fn is_zero(bytes: &PageBuf) -> bool {
    bytes.iter().all(|&w| w == 0)
}

/// What classification finds for a page read into `bytes`: zero, equal to a stable copy, or else
/// its hash (of a snapshot: the page may change meanwhile).
pub(crate) fn classify_bytes(
    bytes: &PageBuf,
    tree: Option<&SdTree<StoreKeys>>,
    store_base: usize,
) -> Pre {
    if is_zero(bytes) {
        return Pre::Zero;
    }
    if let Some(id) = tree.and_then(|t| stable_copy(bytes, t, store_base)) {
        return Pre::Stable(id);
    }
    let h = twox_hash::XxHash3_128::oneshot(as_bytes(bytes));
    Pre::Hash([h as u64, (h >> 64) as u64])
}

/// The stable copy equal to `bytes`, if the tree has one. The tree names the only copy that can
/// match; the full compare is done here with plain word loads, faster than through the tree's key
/// accessor (and the commit compares again, on frozen bytes).
pub(crate) fn stable_copy(
    bytes: &PageBuf,
    tree: &SdTree<StoreKeys>,
    store_base: usize,
) -> Option<KeyId> {
    let key = WordKey(|i| u64::from_be(bytes[i]));
    let e = tree.candidate(&key)?;
    equals_copy(bytes, store_base + e.key() as usize * PAGE).then(|| e.key())
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Pages are read through the kernel: an unmapped page is a failed read (`None`), not a fault,
    /// and the pages around it are read all the same.
    #[test]
    fn a_reader_skips_unmapped_pages_instead_of_faulting() {
        let n = READ_BATCH + 3;
        let base = sys::mmap_anonymous(n * PAGE).unwrap() as usize;
        for k in 0..n {
            // SAFETY: page k of the fresh mapping, ours alone.
            unsafe { std::ptr::write((base + k * PAGE) as *mut u64, k as u64 + 1) };
        }
        let hole = 5;
        // SAFETY: one page of our own mapping, not referenced.
        unsafe { sys::munmap((base + hole * PAGE) as *mut u8, PAGE) }.unwrap();
        let mut reader = PageReader::new();
        let mut seen = Vec::new();
        reader.read_each((0..n).map(|k| base + k * PAGE), |addr, bytes| {
            seen.push(((addr - base) / PAGE, bytes.map(|b| b[0])));
        });
        let want: Vec<_> = (0..n)
            .map(|k| (k, (k != hole).then_some(k as u64 + 1)))
            .collect();
        assert_eq!(seen, want);
        // Words of each page, the hole's none, and the pages after it still read.
        let addrs: Vec<usize> = (0..n).map(|k| base + k * PAGE).collect();
        let mut words = vec![Some([0u64; 2]); n];
        read_words_each::<2>(&addrs, &mut words);
        let want: Vec<_> = (0..n)
            .map(|k| (k != hole).then_some([k as u64 + 1, 0]))
            .collect();
        assert_eq!(words, want);
        // SAFETY: the rest of our own mapping.
        unsafe { sys::munmap(base as *mut u8, n * PAGE) }.unwrap();
    }
}
