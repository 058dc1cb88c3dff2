//! PPR, the per-page recycler: a program marks the pages it frees ([`Pool::mark`]: a few atomic
//! operations and three stores, no system call), the engine releases marked pages within a
//! period (their memory goes back to the kernel; they read as zeros afterwards), and a program
//! that reuses a page first takes the mark back ([`Pool::unmark`]).
//!
//! # The Pointer-Indicator Pair
//!
//! Page contents are arbitrary, so no value written into a page can by itself say "free": any
//! value could be data. A mark is a *pair*: a **pointer** to the page in a slot of the pool, and
//! an **indicator** in the page's first three words naming the pool (`tag`), the slot, and the
//! pool's random `indicator` value. Only a page whose words name a slot that points back at it is
//! taken as free; a stale or forged indicator names a slot that points elsewhere and is ignored,
//! and a slot pointing at a page without the indicator is ignored too.
//!
//! Marking: take a ticket (`alloc`, modulo the slot count), claim the slot (`0 -> page`), then
//! write the tag and slot, and the indicator last. A full pool (the slot is still taken) leaves
//! the page unmarked: it is simply not recycled.
//!
//! Unmarking: clear the indicator word first, then give the slot back (`page -> 0`). The program
//! never waits: if the engine holds the slot's ticket (`page | CLAIMED`), the engine finishes it.
//!
//! Marking ends by setting the slot's group bit in a summary (one bit per 64 slots), so that
//! the engine's claim visits only groups where something was marked, not every slot: a pool sized
//! for millions of pages costs an idle period a few KiB of reads, not megabytes. A claim clears
//! the bits it visits and sets back those of groups still holding marks it did not take.
//!
//! Recycling (the engine, each period, see [`Pool::claim`]): for every slot holding a page of
//! registered memory whose words hold the mark for that slot, take the ticket (`page ->
//! page | CLAIMED`), freeze the page (move it out of the program's address space: any access
//! waits in the kernel), check the mark again on the frozen bytes ([`Pool::is_marked`]), release
//! the page if it is there and put it back otherwise, then [`Pool::finish`] the ticket (`-> 0`).
//! A program that unmarked before the freeze cleared the indicator, so its page is put back with
//! its contents; a write it makes during the freeze waits and lands on the page put back, or on a
//! fresh zero page once released. So no write after `unmark` returns is ever lost, by
//! construction, and no page is released without its mark on frozen bytes.
//!
//! The defects of the original design (see the design brief) are avoided: the indicator and tag
//! are random per pool (not a constant), the engine uses its own copy of the pool's bounds and
//! bounds-checks every slot and page it reads, no kernel pointer is written into pages, and no
//! side spins: the program does not wait for the engine at all.
//!
//! The slots live in this process; a pool shared with another process (a guest) would put the
//! same slot array in shared memory, with the engine still trusting only its own bounds.

mod primitive;

use primitive::{fence, AtomicU64, Ordering};

/// Page size the marks and page numbers assume.
pub const PAGE: usize = 4096;
/// Slot bit of a ticket the engine holds.
const CLAIMED: u64 = 1 << 63;
/// High half of a pool's tag ("PPR!"); the low half is the pool's random id.
const TAG_MAGIC: u64 = 0x5050_5221 << 32;
/// Tickets tried by one `mark` before giving up (slots still held by unreleased marks).
const MARK_TRIES: u64 = 4;
/// Slots per summary bit, and bits per summary word.
const GROUP: usize = 64;

/// Errors creating a pool.
#[derive(Debug, thiserror::Error)]
pub enum RecyclerError {
    #[error("a pool needs between 1 and 2^31 slots, not {0}")]
    Slots(usize),
    #[error("no random value for the pool's indicator")]
    Random(#[source] std::io::Error),
}

/// A ticket the engine holds: slot `slot` points at the page at `addr`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ticket {
    pub slot: u32,
    pub addr: usize,
}

/// Counters of one pool.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Pages marked.
    pub marked: u64,
    /// Marks not made because every tried slot was taken.
    pub full: u64,
    /// Pages released by the engine.
    pub recycled: u64,
    /// Tickets whose page had lost its mark by the freeze (unmarked meanwhile).
    pub canceled: u64,
}

/// A pool of marks (see the crate documentation).
pub struct Pool {
    slots: Box<[AtomicU64]>,
    /// One bit per group of [`GROUP`] slots: set by `mark` after the mark is complete, cleared
    /// by `claim` when it visits the group (and set again if marks stay there).
    summary: Box<[AtomicU64]>,
    /// Next ticket.
    alloc: AtomicU64,
    tag: u64,
    indicator: u64,
    marked: AtomicU64,
    full: AtomicU64,
    recycled: AtomicU64,
    canceled: AtomicU64,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool")
            .field("slots", &self.slots.len())
            .field("stats", &self.stats())
            .finish()
    }
}

impl Pool {
    /// A pool of `slots` slots (rounded up to a power of two): at most that many pages can be
    /// marked and not yet recycled at once. 8 bytes a slot.
    pub fn new(slots: usize) -> Result<Self, RecyclerError> {
        if slots == 0 || slots > 1 << 31 {
            return Err(RecyclerError::Slots(slots));
        }
        let r = pageone_sys::random_u64().map_err(RecyclerError::Random)?;
        let i = pageone_sys::random_u64().map_err(RecyclerError::Random)?;
        Ok(Self::with_values(slots, r as u32, i))
    }

    /// A pool with the given id and indicator (tests pick them; [`Pool::new`] draws them).
    #[doc(hidden)]
    pub fn with_values(slots: usize, id: u32, indicator: u64) -> Self {
        let n = slots.next_power_of_two();
        let words = n.div_ceil(GROUP * GROUP);
        Self {
            slots: (0..n).map(|_| AtomicU64::new(0)).collect(),
            summary: (0..words).map(|_| AtomicU64::new(0)).collect(),
            alloc: AtomicU64::new(0),
            tag: TAG_MAGIC | id as u64,
            // Never 0: a cleared indicator word must not read as a mark.
            indicator: indicator | 1,
            marked: AtomicU64::new(0),
            full: AtomicU64::new(0),
            recycled: AtomicU64::new(0),
            canceled: AtomicU64::new(0),
        }
    }

    /// Slots in the pool.
    pub fn slots(&self) -> usize {
        self.slots.len()
    }

    pub fn stats(&self) -> PoolStats {
        // Relaxed: counters.
        PoolStats {
            marked: self.marked.load(Ordering::Relaxed),
            full: self.full.load(Ordering::Relaxed),
            recycled: self.recycled.load(Ordering::Relaxed),
            canceled: self.canceled.load(Ordering::Relaxed),
        }
    }

    /// Marks the page at `page` free. Returns whether it was marked (false: the pool is full, the
    /// page is not recycled). Its first 24 bytes are overwritten.
    ///
    /// # Safety
    /// `page` is the start of a page of this process's memory that the caller owns, freed: the
    /// caller does not use it again before [`Pool::unmark`] returns for it, and its contents
    /// may be gone (zeros) by then.
    pub unsafe fn mark(&self, page: *mut u8) -> bool {
        let w = page.cast::<u64>();
        self.mark_with(page as usize, |k, v| {
            // SAFETY: the caller owns the page; k < 3 words are inside it.
            unsafe { std::ptr::write_volatile(w.add(k), v) }
        })
    }

    /// Takes the mark of the page at `page` back, before the caller reuses it. Afterwards the
    /// page holds either what it held (without the mark's three words) or zeros (it was
    /// recycled), and every write to it is kept.
    ///
    /// # Safety
    /// `page` was passed to [`Pool::mark`] of this pool (and not unmarked since), and is still
    /// mapped: its third word is read, and cleared if it holds this pool's indicator.
    pub unsafe fn unmark(&self, page: *mut u8) {
        let w = page.cast::<u64>();
        self.unmark_with(
            page as usize,
            // SAFETY: the caller's page; k < 3 words are inside it.
            |k| unsafe { std::ptr::read_volatile(w.add(k)) },
            // SAFETY: as above; the caller owns the page again.
            |k, v| unsafe { std::ptr::write_volatile(w.add(k), v) },
        )
    }

    /// [`Pool::mark`] with the page's words written by `write(word, value)`.
    #[doc(hidden)]
    pub fn mark_with(&self, addr: usize, mut write: impl FnMut(usize, u64)) -> bool {
        let page = (addr / PAGE) as u64;
        let mask = self.slots.len() as u64 - 1;
        for _ in 0..MARK_TRIES {
            // Relaxed: the ticket only picks a slot; the slot's CAS decides.
            let t = self.alloc.fetch_add(1, Ordering::Relaxed) & mask;
            // Relaxed: the slot is only a pointer; the engine trusts it only once the page's
            // words agree, and checks them again on frozen bytes.
            let taken = self.slots[t as usize]
                .compare_exchange(0, page, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok();
            if taken {
                write(0, self.tag);
                write(1, t);
                // Release: pairs with the acquire fence in `claim`: a reader that sees the
                // indicator sees the tag and slot.
                fence(Ordering::Release);
                write(2, self.indicator);
                let group = t as usize / GROUP;
                // Release: pairs with the acquire swap in `claim`: a claim that sees the bit sees
                // the slot and the page's words written above.
                self.summary[group / GROUP].fetch_or(1 << (group % GROUP), Ordering::Release);
                // Relaxed: a counter.
                self.marked.fetch_add(1, Ordering::Relaxed);
                return true;
            }
        }
        // Relaxed: a counter.
        self.full.fetch_add(1, Ordering::Relaxed);
        false
    }

    /// [`Pool::unmark`] with the page's words read by `read(word)` and written by `write`.
    #[doc(hidden)]
    pub fn unmark_with(
        &self,
        addr: usize,
        read: impl Fn(usize) -> u64,
        mut write: impl FnMut(usize, u64),
    ) {
        if read(2) != self.indicator {
            // Recycled (zeros) or not marked by this pool: nothing to take back.
            return;
        }
        let slot = read(1);
        // The indicator goes first: from here on a freeze finds no mark and puts the page back.
        write(2, 0);
        write(0, 0);
        write(1, 0);
        if let Some(s) = self.slots.get(slot as usize) {
            // Relaxed: the slot is a pointer (see `mark_with`); if the engine holds the ticket
            // (CLAIMED), this fails and the engine finishes it.
            let _ = s.compare_exchange(
                (addr / PAGE) as u64,
                0,
                Ordering::Relaxed,
                Ordering::Relaxed,
            );
        }
    }

    /// Takes the tickets of marked pages, at most `max`. `mark_of(addr)` reads the first three
    /// words of the page at `addr`, or answers `None` when that is not a page the engine may
    /// recycle (not registered, merged, ...). A slot whose page shows no mark is left alone
    /// (its program may be between the two steps of `mark`). Only groups whose summary bit is
    /// set are visited: a claim costs what was marked since the last one, not the pool's size.
    pub fn claim(
        &self,
        max: usize,
        mut mark_of: impl FnMut(usize) -> Option<[u64; 3]>,
    ) -> Vec<Ticket> {
        self.claim_batched(max, |addrs, marks| {
            for (m, &a) in marks.iter_mut().zip(addrs) {
                *m = mark_of(a);
            }
        })
    }

    /// [`Pool::claim`] reading the pages' words a group of slots at a time:
    /// `read_marks(addrs, marks)` sets `marks[k]` to the first three words of the page at
    /// `addrs[k]`, or leaves it `None` (not a page the engine may recycle, or unreadable); up to
    /// 64 pages a call, so that one system call can read them all.
    pub fn claim_batched(
        &self,
        max: usize,
        mut read_marks: impl FnMut(&[usize], &mut [Option<[u64; 3]>]),
    ) -> Vec<Ticket> {
        let mut out = Vec::new();
        for (w, word) in self.summary.iter().enumerate() {
            if out.len() >= max {
                break;
            }
            // Acquire: pairs with the release in `mark_with`: the marks of the groups whose bits
            // are read here are visible below.
            let mut bits = word.swap(0, Ordering::Acquire);
            while bits != 0 {
                let b = bits.trailing_zeros() as usize;
                bits &= bits - 1;
                let group = w * GROUP + b;
                if self.claim_group(group, max, &mut out, &mut read_marks) {
                    // Marks left in the group (not yet complete, not recyclable now, or beyond
                    // `max`): visited again next time. Relaxed: the bit only says where to look.
                    word.fetch_or(1 << b, Ordering::Relaxed);
                }
                if out.len() >= max {
                    // Groups not visited keep their bits.
                    word.fetch_or(bits, Ordering::Relaxed);
                    break;
                }
            }
        }
        out
    }

    /// Claims the marked pages of slots `group * GROUP..`; returns whether slots holding a page
    /// were left unclaimed there.
    fn claim_group(
        &self,
        group: usize,
        max: usize,
        out: &mut Vec<Ticket>,
        read_marks: &mut impl FnMut(&[usize], &mut [Option<[u64; 3]>]),
    ) -> bool {
        let first = group * GROUP;
        let end = (first + GROUP).min(self.slots.len());
        let mut left = false;
        // The slots holding a page: index, value and page address.
        let mut held = [(0usize, 0u64, 0usize); GROUP];
        let mut n = 0;
        for (i, s) in self.slots[first..end].iter().enumerate() {
            // Relaxed: a pointer, trusted only once the page agrees (see `mark_with`).
            let v = s.load(Ordering::Relaxed);
            if v == 0 || v & CLAIMED != 0 {
                continue;
            }
            if out.len() + n >= max {
                left = true;
                continue;
            }
            let Some(addr) = (v as usize).checked_mul(PAGE) else {
                continue;
            };
            held[n] = (first + i, v, addr);
            n += 1;
        }
        if n == 0 {
            return left;
        }
        let addrs: [usize; GROUP] = std::array::from_fn(|k| held[k].2);
        let mut marks = [None; GROUP];
        read_marks(&addrs[..n], &mut marks[..n]);
        // Acquire: pairs with the release fence in `mark_with` (the indicators, read by
        // `read_marks`, were written after the tags and slots).
        fence(Ordering::Acquire);
        for (&(i, v, addr), words) in held[..n].iter().zip(marks) {
            let named = words.is_some_and(|w| self.names(i as u32, w));
            // Relaxed: the ticket's effect is checked on frozen bytes, not ordered here.
            if named
                && self.slots[i]
                    .compare_exchange(v, v | CLAIMED, Ordering::Relaxed, Ordering::Relaxed)
                    .is_ok()
            {
                out.push(Ticket {
                    slot: i as u32,
                    addr,
                });
            } else {
                left = true;
            }
        }
        left
    }

    /// Whether `words`, the first three words of the ticket's page read while the page was
    /// frozen, still hold its mark: only then may the page be released.
    pub fn is_marked(&self, t: &Ticket, words: [u64; 3]) -> bool {
        self.names(t.slot, words)
    }

    /// Slots holding a page or a ticket (tests check that none leaks).
    #[doc(hidden)]
    pub fn busy_slots(&self) -> usize {
        // Relaxed: read after the threads that wrote the slots were joined.
        self.slots
            .iter()
            .filter(|s| s.load(Ordering::Relaxed) != 0)
            .count()
    }

    fn names(&self, slot: u32, words: [u64; 3]) -> bool {
        words[2] == self.indicator && words[0] == self.tag && words[1] == slot as u64
    }

    /// Ends a ticket: the slot is free again. `released`: the page was released (recycled);
    /// otherwise its mark was gone (unmarked) or it could not be frozen.
    pub fn finish(&self, t: Ticket, released: bool) {
        if let Some(s) = self.slots.get(t.slot as usize) {
            // Relaxed: no data is published through the slot.
            s.store(0, Ordering::Relaxed);
        }
        let c = if released {
            &self.recycled
        } else {
            &self.canceled
        };
        // Relaxed: a counter.
        c.fetch_add(1, Ordering::Relaxed);
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    /// A page as three words in memory the test owns.
    fn words() -> std::cell::RefCell<[u64; 3]> {
        std::cell::RefCell::new([0; 3])
    }

    #[test]
    fn a_mark_is_claimed_checked_and_finished() {
        let pool = Pool::with_values(8, 7, 99);
        let page = words();
        assert!(pool.mark_with(0x7000, |k, v| page.borrow_mut()[k] = v));
        let t = pool.claim(10, |a| (a == 0x7000).then(|| *page.borrow()));
        assert_eq!(t.len(), 1);
        assert_eq!(t[0].addr, 0x7000);
        assert!(pool.is_marked(&t[0], *page.borrow()));
        // Claimed tickets are not claimed twice.
        assert!(pool.claim(10, |_| Some(*page.borrow())).is_empty());
        pool.finish(t[0], true);
        assert_eq!(pool.stats().recycled, 1);
        assert!(pool.claim(10, |_| Some(*page.borrow())).is_empty());
    }

    #[test]
    fn an_unmarked_page_is_not_claimed_and_its_words_are_cleared() {
        let pool = Pool::with_values(8, 7, 99);
        let page = words();
        assert!(pool.mark_with(0x7000, |k, v| page.borrow_mut()[k] = v));
        pool.unmark_with(
            0x7000,
            |k| page.borrow()[k],
            |k, v| page.borrow_mut()[k] = v,
        );
        assert_eq!(*page.borrow(), [0; 3]);
        assert!(pool.claim(10, |_| Some(*page.borrow())).is_empty());
    }

    #[test]
    fn unmark_after_a_claim_cancels_the_release() {
        let pool = Pool::with_values(8, 7, 99);
        let page = words();
        assert!(pool.mark_with(0x7000, |k, v| page.borrow_mut()[k] = v));
        let t = pool.claim(10, |_| Some(*page.borrow()));
        pool.unmark_with(
            0x7000,
            |k| page.borrow()[k],
            |k, v| page.borrow_mut()[k] = v,
        );
        // The frozen bytes no longer hold the mark: the engine puts the page back.
        assert!(!pool.is_marked(&t[0], *page.borrow()));
        pool.finish(t[0], false);
        assert_eq!(pool.stats().canceled, 1);
    }

    #[test]
    fn forged_or_stale_marks_are_ignored() {
        let pool = Pool::with_values(8, 7, 99);
        let page = words();
        assert!(pool.mark_with(0x7000, |k, v| page.borrow_mut()[k] = v));
        let good = *page.borrow();
        // Another slot named, another pool's tag, a wrong indicator, another page's slot.
        let mut w = good;
        w[1] ^= 1;
        assert!(pool.claim(10, |_| Some(w)).is_empty());
        let mut w = good;
        w[0] ^= 1 << 40;
        assert!(pool.claim(10, |_| Some(w)).is_empty());
        let mut w = good;
        w[2] ^= 2;
        assert!(pool.claim(10, |_| Some(w)).is_empty());
        // Pages the engine may not touch are never claimed.
        assert!(pool.claim(10, |_| None).is_empty());
        assert_eq!(pool.claim(10, |_| Some(good)).len(), 1);
    }

    #[test]
    fn a_full_pool_marks_nothing_more() {
        let pool = Pool::with_values(2, 7, 99);
        let mut pages = [[0u64; 3]; 3];
        assert!(pool.mark_with(0x1000, |k, v| pages[0][k] = v));
        assert!(pool.mark_with(0x2000, |k, v| pages[1][k] = v));
        assert!(!pool.mark_with(0x3000, |k, v| pages[2][k] = v));
        assert_eq!(pages[2], [0; 3], "an unmarked page is left as it was");
        assert_eq!(pool.stats().full, 1);
    }

    #[test]
    fn claims_find_marks_in_every_summary_word() {
        // Marks in 3 * 4096 slots: three summary words' worth.
        let pool = Pool::with_values(3 * GROUP * GROUP, 7, 99);
        let mut pages = vec![[0u64; 3]; 3 * GROUP * GROUP];
        for (i, p) in pages.iter_mut().enumerate() {
            assert!(pool.mark_with((i + 1) * PAGE, |k, v| p[k] = v));
        }
        let mut seen = 0;
        loop {
            // Small claims: the groups beyond `max` keep their bits.
            let t = pool.claim(1000, |a| Some(pages[a / PAGE - 1]));
            if t.is_empty() {
                break;
            }
            seen += t.len();
            for t in t {
                pool.finish(t, true);
            }
        }
        assert_eq!(seen, pages.len());
        assert_eq!(pool.busy_slots(), 0);
    }

    #[test]
    fn batched_claims_read_a_group_at_a_time_and_leave_unreadable_pages() {
        let pool = Pool::with_values(256, 7, 99);
        let mut pages = vec![[0u64; 3]; 200];
        for (i, p) in pages.iter_mut().enumerate() {
            assert!(pool.mark_with((i + 1) * PAGE, |k, v| p[k] = v));
        }
        let unreadable = 77 * PAGE;
        let mut calls = Vec::new();
        let read = |addrs: &[usize], marks: &mut [Option<[u64; 3]>], calls: &mut Vec<usize>| {
            calls.push(addrs.len());
            for (m, &a) in marks.iter_mut().zip(addrs) {
                *m = (a != unreadable).then(|| pages[a / PAGE - 1]);
            }
        };
        let t = pool.claim_batched(usize::MAX, |a, m| read(a, m, &mut calls));
        assert_eq!(t.len(), 199);
        assert!(t.iter().all(|t| t.addr != unreadable));
        assert!(calls.iter().all(|&n| n <= GROUP), "{calls:?}");
        assert_eq!(calls.iter().sum::<usize>(), 200);
        for t in t {
            pool.finish(t, true);
        }
        // The page left unclaimed is visited again, and claimed once readable.
        let again = pool.claim(usize::MAX, |a| Some(pages[a / PAGE - 1]));
        assert_eq!(again.len(), 1);
        assert_eq!(again[0].addr, unreadable);
    }

    proptest::proptest! {
        /// Whatever happened before (marks, unmarks, claims cut short by `max`, pages the engine
        /// could not take, marks not yet checked), a claim with room takes every page still
        /// marked: the summary never hides a mark.
        #[test]
        fn the_summary_never_hides_a_mark(
            ops in proptest::collection::vec((0u8..3, 1usize..40, 0usize..4, proptest::prelude::any::<u64>()), 0..200)
        ) {
            let pool = Pool::with_values(128, 7, 99);
            let mut pages: std::collections::HashMap<usize, [u64; 3]> = Default::default();
            let mut marked = std::collections::BTreeSet::new();
            for (op, page, max, skip) in ops {
                let addr = page * PAGE;
                match op {
                    0 if !marked.contains(&page) => {
                        let w = pages.entry(addr).or_default();
                        if pool.mark_with(addr, |k, v| w[k] = v) {
                            marked.insert(page);
                        }
                    }
                    1 if marked.contains(&page) => {
                        let w = pages.entry(addr).or_default();
                        let r = *w;
                        pool.unmark_with(addr, |k| r[k], |k, v| w[k] = v);
                        marked.remove(&page);
                    }
                    _ => {
                        // Pages whose bit is set in `skip` cannot be taken this time.
                        let t = pool.claim(max, |a| {
                            (skip >> (a / PAGE % 64) & 1 == 0).then(|| pages.get(&a).copied().unwrap_or_default())
                        });
                        for t in t {
                            let w = pages.entry(t.addr).or_default();
                            let released = pool.is_marked(&t, *w);
                            if released {
                                *w = [0; 3];
                                marked.remove(&(t.addr / PAGE));
                            }
                            pool.finish(t, released);
                        }
                    }
                }
            }
            let t = pool.claim(usize::MAX, |a| Some(pages.get(&a).copied().unwrap_or_default()));
            let got: std::collections::BTreeSet<usize> = t.iter().map(|t| t.addr / PAGE).collect();
            proptest::prop_assert_eq!(got.len(), t.len());
            proptest::prop_assert_eq!(got, marked);
            for t in t {
                pool.finish(t, true);
            }
            proptest::prop_assert_eq!(pool.busy_slots(), 0);
        }
    }

    #[test]
    fn bad_sizes_are_refused() {
        assert!(matches!(Pool::new(0), Err(RecyclerError::Slots(0))));
        assert!(Pool::new(1000).is_ok_and(|p| p.slots() == 1024));
    }
}
