//! A fixed-capacity array in memory of its own, mapped with a raw system call and kept out of
//! what the engine registers: where the fault thread records what does not fit the change log's
//! room, since it must never call the allocator (see `changes::ROOM`). The mapping takes no memory
//! until written (`MAP_NORESERVE`), and what was written goes back to the kernel when cleared.

use std::marker::PhantomData;
use std::ptr::NonNull;

use pageone_sys as sys;

use crate::apart::{keep_apart, KeptApart};

/// Up to `cap` values of `T` in a mapping of the process's own.
pub(crate) struct SpillBuffer<T: Copy> {
    ptr: NonNull<T>,
    len: usize,
    cap: usize,
    /// Kept out of registrations while mapped.
    _apart: Option<KeptApart>,
    _owns: PhantomData<T>,
}

// SAFETY: the buffer owns its mapping; it is only reached through `&self`/`&mut self`.
unsafe impl<T: Copy + Send> Send for SpillBuffer<T> {}
// SAFETY: as above; `&self` only reads.
unsafe impl<T: Copy + Sync> Sync for SpillBuffer<T> {}

impl<T: Copy> SpillBuffer<T> {
    /// Maps room for `cap` values; `None` if the kernel refuses the mapping.
    pub(crate) fn new(cap: usize) -> Option<Self> {
        let bytes = Self::bytes(cap);
        // (A raw system call, `MAP_NORESERVE`: no interposed `mmap`, the shim's, sees it.)
        let p = sys::mmap_anonymous(bytes).ok()?;
        let start = p as usize;
        Some(Self {
            ptr: NonNull::new(p.cast())?,
            len: 0,
            cap,
            _apart: keep_apart(start..start + bytes),
            _owns: PhantomData,
        })
    }

    fn bytes(cap: usize) -> usize {
        (cap * std::mem::size_of::<T>()).next_multiple_of(sys::PAGE_SIZE)
    }

    /// Appends `v`; gives it back if the buffer is full. Never allocates.
    pub(crate) fn push(&mut self, v: T) -> Result<(), T> {
        if self.len == self.cap {
            return Err(v);
        }
        // SAFETY: `len < cap`: inside the mapping, which only this buffer writes.
        unsafe { self.ptr.as_ptr().add(self.len).write(v) };
        self.len += 1;
        Ok(())
    }

    pub(crate) fn as_slice(&self) -> &[T] {
        // SAFETY: the first `len` values were written by `push`; the mapping lives as long as
        // `self`, and nothing writes it while `&self` is borrowed.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Empties the buffer, giving the memory it used back to the kernel.
    pub(crate) fn clear(&mut self) {
        if self.len == 0 {
            return;
        }
        let used = Self::bytes(self.len);
        // SAFETY: the buffer's own mapping, whose contents are no longer needed; it is not
        // registered (kept apart), so the kernel reports nothing.
        let _ = unsafe { sys::madvise(self.ptr.as_ptr().cast(), used, libc::MADV_DONTNEED) };
        self.len = 0;
    }
}

impl<T: Copy> Drop for SpillBuffer<T> {
    fn drop(&mut self) {
        // SAFETY: the buffer's own mapping, unmapped once (raw: no interposed `munmap` sees it).
        let _ = unsafe { sys::munmap(self.ptr.as_ptr().cast(), Self::bytes(self.cap)) };
    }
}

impl<T: Copy + std::fmt::Debug> std::fmt::Debug for SpillBuffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SpillBuffer")
            .field("len", &self.len)
            .field("cap", &self.cap)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spill_buffer_holds_what_fits_and_gives_back_the_rest() {
        let mut b = SpillBuffer::<u64>::new(1000).unwrap();
        assert!(b.is_empty());
        for i in 0..1000 {
            assert_eq!(b.push(i), Ok(()));
        }
        assert_eq!(b.push(1000), Err(1000));
        assert_eq!(b.as_slice().len(), 1000);
        assert!(b.as_slice().iter().copied().eq(0..1000));
        b.clear();
        assert!(b.is_empty() && b.as_slice().is_empty());
        assert_eq!(b.push(7), Ok(()));
        assert_eq!(b.as_slice(), &[7]);
    }
}
