//! Frozen pages that could not be put back: kept, never dropped.
//!
//! A frozen page goes back with `UFFDIO_MOVE`, or with `UFFDIO_COPY` where the kernel refuses the
//! move (see `FrozenRun::restore`). The copy needs a new page; when the program's memory cgroup
//! has none to give (`ENOMEM`), the page's bytes are copied here, into memory the engine
//! populated at its start, and its address stays empty. Until the bytes are back, a thread that
//! touches the address waits in the kernel (a missing fault the fault thread leaves unanswered
//! rather than answer with a zero page); the fault thread tries again every time it wakes, and
//! the copy wakes the waiters. A change the program makes meanwhile is followed: unmapping the
//! page or `MADV_DONTNEED` of it drops the parked bytes (the program asked for that), `mremap`
//! moves them with the mapping; unregistering the page puts its bytes back first.
//!
//! A `fork` waits until no page of the process is parked (see [`wait_for_parked_pages`]): a
//! child copies the parent's memory as it is, and a parked page's address is empty (the child
//! would read zeros there). The fork waits as a touch of the parked page would: for memory.

use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use pageone_sync::lock;
use pageone_sys as sys;

use crate::access::PAGE;
use crate::changes::Change;

/// Pages that can be parked at once (256 KiB, resident for the engine's life).
pub(crate) const PARK_SLOTS: usize = 64;

/// Pages parked by every engine of the process (see [`wait_for_parked_pages`]).
static PARKED: AtomicUsize = AtomicUsize::new(0);

/// Whether a page of the process is parked.
pub(crate) fn any_parked() -> bool {
    // SeqCst: pairs with the updates in `Parking`: a fork that holds the layout lock (no run
    // can park a page meanwhile) and reads 0 here sees every page that went back.
    PARKED.load(Ordering::SeqCst) > 0
}

/// Waits until no page of the process is parked: the engines' fault threads put parked pages
/// back as soon as there is memory for them (every 10 ms while any is parked).
pub(crate) fn wait_for_parked_pages() {
    let mut wait = Duration::from_millis(1);
    while any_parked() {
        std::thread::sleep(wait);
        wait = (wait * 2).min(Duration::from_millis(10));
    }
}

/// How a parked page went back.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Return {
    /// Its bytes are back at its address, and its waiters woken.
    Back,
    /// Its address is no longer registered memory (the program unmapped it): dropped.
    Gone,
    /// Still no memory for it: it stays parked.
    Later,
}

/// A parking slot: the page it holds the bytes of (`addr`, 0 if free) and the registration
/// modes the page gets back with them (`rearm`: those of the rest of its run, which is watched by
/// write-protection, or 0). While parked the page is registered for missing faults only, so that
/// a touch waits for its bytes; afterwards it is watched as the rest of its run is.
#[derive(Clone, Copy, Default)]
struct Parked {
    addr: usize,
    rearm: u64,
}

/// The parked pages and their slots (see the module doc).
pub(crate) struct Parking {
    area: usize,
    /// The address each slot holds the bytes of (0: free), and the registration modes its
    /// address gets once they are back (0: left as it is).
    slots: Mutex<[Parked; PARK_SLOTS]>,
    /// How many slots are taken, for a check without the lock.
    taken: AtomicUsize,
    /// In tests: how many more copies back fail as out of memory.
    #[cfg(test)]
    pub(crate) fail_copies: AtomicUsize,
}

impl Parking {
    /// The parking area: [`PARK_SLOTS`] pages, populated now (parking must not need memory) and
    /// not inherited by forked children.
    pub(crate) fn new() -> std::io::Result<Self> {
        let len = PARK_SLOTS * PAGE;
        let area = sys::mmap_anonymous(len)?;
        // SAFETY: the engine's own fresh mapping: neither advice changes what it reads (zeros).
        let populated = unsafe {
            sys::madvise(area, len, libc::MADV_DONTFORK)
                .and_then(|()| sys::madvise(area, len, libc::MADV_POPULATE_WRITE))
        };
        if populated.is_err() {
            // Before Linux 5.14: populate by writing. SAFETY: as above, `len` bytes of ours.
            unsafe { std::ptr::write_bytes(area, 0, len) };
        }
        Ok(Parking {
            area: area as usize,
            slots: Mutex::new([Parked { addr: 0, rearm: 0 }; PARK_SLOTS]),
            taken: AtomicUsize::new(0),
            #[cfg(test)]
            fail_copies: AtomicUsize::new(0),
        })
    }

    /// Whether any page is parked.
    pub(crate) fn is_empty(&self) -> bool {
        // Relaxed: a hint; the slots are read under their lock.
        self.taken.load(Ordering::Relaxed) == 0
    }

    /// Whether the page at `addr` is parked.
    pub(crate) fn holds(&self, addr: usize) -> bool {
        !self.is_empty() && lock(&self.slots).iter().any(|p| p.addr == addr)
    }

    /// Parks the page of `addr`, whose bytes are at `from` (a frozen page's scratch slot):
    /// copies them into a free slot. Once they are back, `addr` is registered with `rearm`
    /// (unless 0). False if every slot is taken.
    ///
    /// # Safety
    ///
    /// `from` is a page of the engine's own memory that nobody writes meanwhile.
    pub(crate) unsafe fn park(&self, addr: usize, from: usize, rearm: u64) -> bool {
        let mut slots = lock(&self.slots);
        let Some(i) = slots.iter().position(|p| p.addr == 0) else {
            return false;
        };
        // SAFETY: slot `i` is a free page of the parking area, which only this engine uses and
        // only under this lock; `from` is a page nobody writes (the caller's contract).
        unsafe { std::ptr::copy_nonoverlapping(from as *const u8, self.slot(i) as *mut u8, PAGE) };
        slots[i] = Parked { addr, rearm };
        self.count(1);
        true
    }

    fn slot(&self, i: usize) -> usize {
        self.area + i * PAGE
    }

    /// `n` more pages parked (under the slots' lock).
    fn count(&self, n: usize) {
        // Relaxed: the slots themselves are read under the lock.
        self.taken.fetch_add(n, Ordering::Relaxed);
        // SeqCst: see `any_parked`.
        PARKED.fetch_add(n, Ordering::SeqCst);
    }

    /// `n` fewer pages parked (under the slots' lock, once they are back or dropped).
    fn uncount(&self, n: usize) {
        // Relaxed: as in `count`.
        self.taken.fetch_sub(n, Ordering::Relaxed);
        // SeqCst: see `any_parked`.
        PARKED.fetch_sub(n, Ordering::SeqCst);
    }

    /// Follows a change the program made (read by the fault thread): parked pages that were
    /// unmapped or dropped are forgotten, moved ones move. A thread waiting on a forgotten or
    /// moved page is woken (through `uffd`) to fault again: on a dropped page it gets the zero
    /// page, on an unmapped one the signal any access there gets.
    pub(crate) fn follow(&self, uffd: &sys::Uffd, change: &Change) {
        if self.is_empty() {
            return;
        }
        let mut slots = lock(&self.slots);
        let range = change.range();
        for p in slots.iter_mut().filter(|p| range.contains(&p.addr)) {
            let _ = uffd.wake(p.addr, PAGE);
            match *change {
                Change::Unmap { .. } | Change::Remove { .. } => {
                    p.addr = 0;
                    self.uncount(1);
                }
                Change::Remap { from, to, .. } => p.addr = to + (p.addr - from),
            }
        }
    }

    /// Tries to put every parked page in `range` back (a copy through `uffd`, which wakes its
    /// waiters); returns how many are still parked there.
    pub(crate) fn put_back(&self, uffd: &sys::Uffd, range: Range<usize>) -> usize {
        if self.is_empty() {
            return 0;
        }
        let mut slots = lock(&self.slots);
        let mut left = 0;
        for i in 0..PARK_SLOTS {
            let Parked { addr, rearm } = slots[i];
            if addr == 0 || !range.contains(&addr) {
                continue;
            }
            match self.copy_back(uffd, addr, i) {
                Return::Later => left += 1,
                Return::Back | Return::Gone => {
                    if rearm != 0 {
                        // Watched again as the rest of its run (refused if it is gone).
                        let _ = uffd.register(addr, PAGE, rearm);
                    }
                    slots[i].addr = 0;
                    self.uncount(1);
                }
            }
        }
        left
    }

    /// Puts back the parked pages of `range`, waiting for memory as long as it takes: the range
    /// is about to be unregistered, after which nothing would hold its waiters.
    pub(crate) fn put_back_before_unregistering(&self, uffd: &sys::Uffd, range: Range<usize>) {
        let mut wait = Duration::from_millis(1);
        while self.put_back(uffd, range.clone()) > 0 {
            std::thread::sleep(wait);
            wait = (wait * 2).min(Duration::from_millis(100));
        }
    }

    fn copy_back(&self, uffd: &sys::Uffd, addr: usize, i: usize) -> Return {
        #[cfg(test)]
        if self
            .fail_copies
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
            .is_ok()
        {
            return Return::Later;
        }
        // SAFETY: slot `i` is a page of the parking area, written only under the slots' lock,
        // which the caller holds.
        match unsafe { uffd.copy(addr, self.slot(i) as *const u8, PAGE) } {
            Ok(()) => Return::Back,
            // Something is mapped there again: the waiters only need the wake. (Not expected: a
            // parked address stays empty, and nothing fills it but this.)
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {
                tracing::error!(addr, "a parked page's address was filled meanwhile");
                let _ = uffd.wake(addr, PAGE);
                Return::Back
            }
            // No registered mapping there any more.
            Err(e) if matches!(e.raw_os_error(), Some(libc::ENOENT | libc::EINVAL)) => Return::Gone,
            // Out of memory, or a change under way whose event is unread (`EAGAIN`).
            Err(_) => Return::Later,
        }
    }
}

impl Drop for Parking {
    fn drop(&mut self) {
        // Pages still parked here are gone with the engine (which put back those of its
        // registered memory when unregistering it): a fork must not wait for them.
        let left = lock(&self.slots).iter().filter(|p| p.addr != 0).count();
        self.uncount(left);
        // SAFETY: the engine's own mapping, not used any more.
        let _ = unsafe { sys::munmap(self.area as *mut u8, PARK_SLOTS * PAGE) };
    }
}
