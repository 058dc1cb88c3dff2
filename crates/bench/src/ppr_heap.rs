//! A heap whose large frees go back to the kernel through PPR: the pages of a freed block are
//! marked in a [`Pool`] (no system call), the engine releases them within a period, and a block
//! handed out again is unmarked page by page first. What an allocator can do with PPR instead of
//! a decay timer (jemalloc, mimalloc) or a `madvise` per free.
//!
//! Blocks of at least [`PprHeap::LARGE`] bytes come from page runs of one arena (best fit, freed
//! runs coalesced); smaller ones from the system allocator. The arena grows by chunks of
//! [`CHUNK`] bytes, each written once by the kernel (`MADV_POPULATE_WRITE`) and then registered
//! with the heap's own engine: a first touch of registered memory would go through the engine's
//! fault thread (tens of microseconds a page), a populated chunk's does not. The engine only
//! recycles ([`Config::merging`](pageone_engine::Config::merging) off): the arena is never
//! write-protected, so neither the heap's writes nor its marks fault.
//!
//! [`PprHeap`] implements [`GlobalAlloc`]; the benchmark calls it through that trait. It is not
//! meant to be a process's `#[global_allocator]`: the engine's own large allocations would then
//! come from the memory it watches.

use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pageone_engine::recycler::Pool;
use pageone_engine::Engine;
use pageone_sync::lock;

const PAGE: usize = 4096;
/// Bytes the arena grows by.
pub const CHUNK: usize = 2 << 20;

/// Settings of a [`PprHeap`].
#[derive(Clone, Copy, Debug)]
pub struct PprHeapConfig {
    /// Address space reserved for large blocks (not memory: only what is used is populated).
    pub arena_bytes: usize,
    /// The engine's period: marked pages are released within about one.
    pub period: Duration,
    /// The engine's worker threads.
    pub workers: usize,
}

impl Default for PprHeapConfig {
    fn default() -> Self {
        Self {
            arena_bytes: 4 << 30,
            period: Duration::from_millis(100),
            workers: 1,
        }
    }
}

/// Free runs and the arena's populated end.
struct Arena {
    base: usize,
    len: usize,
    /// Bytes populated and registered, from `base`.
    top: usize,
    /// Bytes handed out from `top` so far (the rest of the last chunk is not yet used).
    used: usize,
    by_addr: BTreeMap<usize, usize>,
    by_size: BTreeSet<(usize, usize)>,
}

impl Arena {
    fn insert(&mut self, addr: usize, pages: usize) {
        self.by_addr.insert(addr, pages);
        self.by_size.insert((pages, addr));
    }

    fn remove(&mut self, addr: usize, pages: usize) {
        self.by_addr.remove(&addr);
        self.by_size.remove(&(pages, addr));
    }

    /// The smallest free run of at least `pages` pages, split; its address.
    fn take_free(&mut self, pages: usize) -> Option<usize> {
        let &(have, addr) = self.by_size.range((pages, 0)..).next()?;
        self.remove(addr, have);
        if have > pages {
            self.insert(addr + pages * PAGE, have - pages);
        }
        Some(addr)
    }

    /// Puts a run back, joined with free neighbours.
    fn give_back(&mut self, mut addr: usize, mut pages: usize) {
        if let Some((&a, &p)) = self.by_addr.range(..addr).next_back() {
            if a + p * PAGE == addr {
                self.remove(a, p);
                addr = a;
                pages += p;
            }
        }
        let end = addr + pages * PAGE;
        if let Some(&p) = self.by_addr.get(&end) {
            self.remove(end, p);
            pages += p;
        }
        self.insert(addr, pages);
    }
}

/// The heap (see the module documentation).
pub struct PprHeap {
    engine: Engine,
    pool: Arc<Pool>,
    arena: Mutex<Arena>,
}

/// Counters of a heap.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PprHeapStats {
    /// Pages marked by frees, and marks not made (pool full).
    pub marked: u64,
    pub mark_full: u64,
    /// Pages the engine released.
    pub recycled: u64,
    /// Bytes of the arena populated so far (its high-water mark).
    pub arena_bytes: usize,
}

impl PprHeap {
    /// Blocks of this size or more come from the arena and are recycled when freed.
    pub const LARGE: usize = 64 << 10;

    pub fn new(c: PprHeapConfig) -> Result<Self, String> {
        let len = c.arena_bytes.div_ceil(CHUNK) * CHUNK;
        let engine = Engine::builder()
            .workers(c.workers.max(1))
            .merge_period(c.period)
            .merging(false)
            .daemon(None)
            .build()
            .map_err(|e| format!("the heap's engine did not start: {e}"))?;
        let pool = Arc::new(Pool::new(len / PAGE).map_err(|e| e.to_string())?);
        engine.recycle_from(pool.clone());
        // Reserved, not committed (`MAP_NORESERVE`): pages exist only once a chunk is populated.
        let base = pageone_sys::mmap_anonymous(len)
            .map_err(|e| format!("could not reserve {len} bytes for the heap: {e}"))?;
        Ok(Self {
            engine,
            pool,
            arena: Mutex::new(Arena {
                base: base as usize,
                len,
                top: 0,
                used: 0,
                by_addr: BTreeMap::new(),
                by_size: BTreeSet::new(),
            }),
        })
    }

    pub fn stats(&self) -> PprHeapStats {
        let p = self.pool.stats();
        PprHeapStats {
            marked: p.marked,
            mark_full: p.full,
            recycled: p.recycled,
            arena_bytes: lock(&self.arena).top,
        }
    }

    /// The heap's engine (its statistics: CPU, pages recycled).
    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// `pages` pages from the unused end of the arena, growing it by whole chunks.
    fn take_new(&self, a: &mut Arena, pages: usize) -> Option<usize> {
        let bytes = pages * PAGE;
        if a.used + bytes > a.len {
            return None;
        }
        while a.used + bytes > a.top {
            let chunk = (a.base + a.top) as *mut u8;
            // SAFETY: the next chunk of the reservation made in `new`, not handed out yet.
            unsafe { pageone_sys::madvise(chunk, CHUNK, libc::MADV_POPULATE_WRITE) }.ok()?;
            self.engine.register(chunk, CHUNK).ok()?;
            a.top += CHUNK;
        }
        let addr = a.base + a.used;
        a.used += bytes;
        Some(addr)
    }
}

impl Drop for PprHeap {
    fn drop(&mut self) {
        let a = lock(&self.arena);
        if a.top > 0 {
            let _ = self.engine.unregister(a.base as *mut u8, a.top);
        }
        // SAFETY: the reservation made in `new`; every block in it belongs to this heap, which
        // is going away (its blocks must not be used after it, as with any allocator).
        unsafe { libc::munmap(a.base as *mut libc::c_void, a.len) };
    }
}

fn is_large(layout: Layout) -> bool {
    layout.size() >= PprHeap::LARGE && layout.align() <= PAGE
}

// SAFETY: blocks are disjoint: small ones come from `System`; a large block is a page run taken
// from the free runs or the arena's unused end under the arena lock, and given back only by
// `dealloc` of that block. Every page of a reused run is unmarked before it is handed out.
unsafe impl GlobalAlloc for PprHeap {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if !is_large(layout) {
            // SAFETY: the caller's layout, non-zero sized per GlobalAlloc's contract.
            return unsafe { System.alloc(layout) };
        }
        let pages = layout.size().div_ceil(PAGE);
        let (addr, reused) = {
            let mut a = lock(&self.arena);
            match a.take_free(pages) {
                Some(addr) => (addr, true),
                None => match self.take_new(&mut a, pages) {
                    Some(addr) => (addr, false),
                    None => return std::ptr::null_mut(),
                },
            }
        };
        if reused {
            for i in 0..pages {
                // SAFETY: every page of a free run was marked by `dealloc` (or its mark failed:
                // then unmark finds no indicator and does nothing); the run is ours now.
                unsafe { self.pool.unmark((addr + i * PAGE) as *mut u8) };
            }
        }
        addr as *mut u8
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if !is_large(layout) {
            // SAFETY: allocated by `alloc` above with the same layout, from System.
            return unsafe { System.dealloc(ptr, layout) };
        }
        let pages = layout.size().div_ceil(PAGE);
        for i in 0..pages {
            // SAFETY: the block's pages, freed by the caller; not handed out again before
            // `alloc` unmarks them.
            unsafe { self.pool.mark(ptr.add(i * PAGE)) };
        }
        lock(&self.arena).give_back(ptr as usize, pages);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn free_runs_are_split_best_fit_and_coalesced() {
        let mut a = Arena {
            base: 0,
            len: 1 << 30,
            top: 0,
            used: 0,
            by_addr: BTreeMap::new(),
            by_size: BTreeSet::new(),
        };
        a.give_back(0x10000, 4);
        a.give_back(0x40000, 2);
        // Best fit: the 2-page run for a 1-page request, the rest stays.
        assert_eq!(a.take_free(1), Some(0x40000));
        assert_eq!(a.take_free(3), Some(0x10000));
        assert_eq!(a.take_free(2), None);
        // A run joins the free run after it, then before it, then both.
        a.give_back(0x10000, 3);
        assert_eq!(a.by_addr[&0x10000], 4);
        a.give_back(0x40000, 1);
        assert_eq!(a.by_addr.len(), 2);
        assert_eq!(a.by_addr[&0x40000], 2);
        a.give_back(0x14000, 0x2c);
        assert_eq!(a.by_addr.len(), 1, "{:?}", a.by_addr);
        assert_eq!(a.by_addr[&0x10000], 0x32);
        assert_eq!(a.by_size.len(), 1);
    }

    fn layout(bytes: usize) -> Layout {
        Layout::from_size_align(bytes, 16).unwrap()
    }

    /// Writes `v` at offset 64 of every page of the block.
    fn fill(p: *mut u8, bytes: usize, v: u64) {
        for off in (0..bytes).step_by(PAGE) {
            // SAFETY: inside the block, which the test owns.
            unsafe { p.add(off + 64).cast::<u64>().write_volatile(v + off as u64) };
        }
    }

    fn check(p: *mut u8, bytes: usize, v: u64) {
        for off in (0..bytes).step_by(PAGE) {
            // SAFETY: as in `fill`.
            let got = unsafe { p.add(off + 64).cast::<u64>().read_volatile() };
            assert_eq!(got, v + off as u64, "page at {off:#x}");
        }
    }

    #[test]
    fn freed_blocks_are_released_by_the_engine_and_reused_intact() {
        let heap = PprHeap::new(PprHeapConfig {
            arena_bytes: 64 << 20,
            period: Duration::from_millis(20),
            workers: 1,
        })
        .unwrap();
        let big = 1 << 20;
        // SAFETY: non-zero layouts; the blocks are freed with the same layouts.
        let (a, b) = unsafe { (heap.alloc(layout(big)), heap.alloc(layout(big))) };
        assert!(!a.is_null() && !b.is_null());
        fill(a, big, 1);
        fill(b, big, 2);
        // SAFETY: allocated above with this layout.
        unsafe { heap.dealloc(a, layout(big)) };
        assert_eq!(heap.stats().marked, (big / PAGE) as u64);
        let t = std::time::Instant::now();
        while heap.stats().recycled < (big / PAGE) as u64 {
            assert!(t.elapsed() < Duration::from_secs(20), "{:?}", heap.stats());
            heap.engine().kick();
            std::thread::sleep(Duration::from_millis(5));
        }
        // The block still held is untouched; the freed one comes back (best fit) and is usable.
        check(b, big, 2);
        // SAFETY: as above.
        let c = unsafe { heap.alloc(layout(big)) };
        assert_eq!(c, a);
        fill(c, big, 3);
        check(c, big, 3);
        // Small blocks are the system's.
        // SAFETY: as above.
        let s = unsafe { heap.alloc(layout(100)) };
        assert!(!s.is_null());
        // SAFETY: allocated above with these layouts.
        unsafe {
            heap.dealloc(s, layout(100));
            heap.dealloc(b, layout(big));
            heap.dealloc(c, layout(big));
        }
        assert_eq!(heap.stats().arena_bytes, CHUNK);
    }

    #[test]
    fn a_full_arena_answers_null() {
        let heap = PprHeap::new(PprHeapConfig {
            arena_bytes: CHUNK,
            ..Default::default()
        })
        .unwrap();
        // SAFETY: non-zero layouts.
        let a = unsafe { heap.alloc(layout(CHUNK)) };
        assert!(!a.is_null());
        // SAFETY: as above.
        assert!(unsafe { heap.alloc(layout(PprHeap::LARGE)) }.is_null());
        // SAFETY: allocated above.
        unsafe { heap.dealloc(a, layout(CHUNK)) };
    }
}
