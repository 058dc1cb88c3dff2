//! The fault thread: reads everything the kernel reports on the userfaultfd of registered memory.
//! Changes the program made to registered memory (unmappings, moves, dropped pages) are recorded
//! in the change log, under its lock, as they are read (see the `changes` module). Missing faults
//! come from what is registered for them: a frozen run (left to the committer), parked pages (see
//! the `parking` module), registered memory throughout under checksum watching (first touches,
//! released zero pages: the shared zero page), and holes of the store's file in its mappings.
//! Minor faults come from store mappings whose page table entries are gone (see the `unfilled`
//! module).

use std::sync::atomic::Ordering;
use std::time::Duration;

use pageone_sync::lock;
use pageone_sys::{self as sys, uapi::*};

use crate::access::{PAGE, WORDS};
use crate::changes::{Change, ChangeLog};
use crate::state::Shared;

/// A page of zeros, copied where the zero page cannot go (over a write-protect marker).
static ZEROS: [u64; WORDS] = [0; WORDS];

/// Messages read in one go, under the change log's lock.
const READ_AT_ONCE: usize = 64;

/// Reads and answers the context's messages until the engine stops.
pub(crate) fn fault_loop(sh: &Shared) {
    sh.count_cpu_of_this_thread();
    // Relaxed: only an id, read by the committer when it next commits.
    sh.fault_thread_id
        .store(sys::thread_id(), Ordering::Relaxed);
    let waiter = Waiter::new(sh);
    loop {
        // Never the state lock here: its holder may be waiting in the kernel for this thread
        // to read an event (an unregistering making store mappings anonymous, say).
        // SeqCst: pairs with the store in `Engine::stop`, after every region was unregistered.
        if sh.faults_done.load(Ordering::SeqCst) {
            return;
        }
        // Each context is read only when the poll says it has something (an event arriving
        // after the poll makes the next one return at once): one read per wake, which with
        // scattered merges is one per merged page (the kernel holds the committer's mapping
        // until its report is read).
        // While pages are parked, they are tried again every 10 ms (see `read_some`).
        let timeout = if sh.parking.is_empty() { 100 } else { 10 };
        let ready = waiter.wait(timeout);
        if ready[0] || !sh.parking.is_empty() {
            while read_some(sh, &sh.uffd, true) == READ_AT_ONCE {}
        }
        if let (Some(u), true) = (&sh.store_uffd, ready[1]) {
            // Changes to the store mappings of merged pages, and reads of holes of the store's
            // file (its write-protect faults are the committer's to wake).
            while read_some(sh, u, false) == READ_AT_ONCE {}
        }
    }
}

/// Waits for the contexts (and the stop signal) to have something to read: through epoll, whose
/// wait costs less per wake than `poll`'s (which takes and drops a reference on each descriptor
/// at every call, and with scattered merges this thread wakes once per merged page); `poll`
/// where epoll cannot be had.
enum Waiter {
    Epoll(sys::Epoll),
    Poll(Vec<i32>),
}

/// The tokens of the descriptors (bits of `sys::Epoll::wait_readable`'s answer).
const MAIN: u32 = 0;
const STOP: u32 = 1;
const STORE: u32 = 2;

impl Waiter {
    fn new(sh: &Shared) -> Self {
        let stop = std::os::fd::AsRawFd::as_raw_fd(&sh.stop_fd);
        let store = sh.store_uffd.as_ref().map(|u| u.as_raw_fd());
        let epoll = sys::Epoll::new().and_then(|ep| {
            ep.add(sh.uffd.as_raw_fd(), MAIN)?;
            ep.add(stop, STOP)?;
            store.map_or(Ok(()), |fd| ep.add(fd, STORE))?;
            Ok(ep)
        });
        match epoll {
            Ok(ep) => Waiter::Epoll(ep),
            Err(_) => Waiter::Poll(
                [sh.uffd.as_raw_fd(), stop]
                    .into_iter()
                    .chain(store)
                    .collect(),
            ),
        }
    }

    /// Waits up to `timeout_ms`; returns whether the main context and the store mappings'
    /// context have something to read (both, after an error: a read finds out).
    fn wait(&self, timeout_ms: i32) -> [bool; 2] {
        let ready = match self {
            Waiter::Epoll(ep) => ep
                .wait_readable(timeout_ms)
                .map(|bits| [bits & 1 << MAIN != 0, bits & 1 << STORE != 0]),
            Waiter::Poll(fds) => sys::poll_readable(fds, timeout_ms)
                .map(|r| [r[0], r.get(2).copied().unwrap_or(false)]),
        };
        ready.unwrap_or_else(|_| {
            std::thread::sleep(Duration::from_millis(1));
            [true; 2]
        })
    }
}

/// Reads up to [`READ_AT_ONCE`] messages of `uffd` (in one call) under the change log's lock,
/// records the changes and (with `answer`) answers the faults; returns how many it read.
fn read_some(sh: &Shared, uffd: &sys::Uffd, answer: bool) -> usize {
    let mut log = lock(&sh.changes);
    // The changes read apply to the program's advice reported before now (see `advice`).
    log.reading(crate::advice::clock());
    let mut faults = [0usize; READ_AT_ONCE];
    let mut msgs = [UffdMsg::default(); READ_AT_ONCE];
    let read = uffd.read_events(&mut msgs).unwrap_or(0);
    let mut nfaults = 0;
    let mut minors = [0usize; READ_AT_ONCE];
    let mut nminors = 0;
    for msg in &msgs[..read] {
        match msg.event() {
            UffdEvent::PageFault { address, .. } if answer => {
                faults[nfaults] = address as usize & !(PAGE - 1);
                nfaults += 1;
            }
            // A store mapping's page whose entry is gone while the file has it (see the
            // `unfilled` module).
            UffdEvent::PageFault {
                address,
                minor: true,
                ..
            } => {
                minors[nminors] = address as usize & !(PAGE - 1);
                nminors += 1;
            }
            // A store mapping read where the store's file has a hole (a zero hole not filled
            // yet): the zero page, as the file would give.
            UffdEvent::PageFault {
                address, wp: false, ..
            } => {
                let addr = address as usize & !(PAGE - 1);
                if uffd.zeropage(addr, PAGE).is_err() {
                    let _ = uffd.wake(addr, PAGE);
                }
            }
            UffdEvent::PageFault { .. } => {}
            e => {
                if let Some(c) = Change::of(e) {
                    sh.parking.follow(&sh.uffd, &c);
                    follow_dropped_store_pages(sh, &mut log, c, answer);
                }
            }
        }
    }
    // Faults are answered after the changes read with them are recorded: one at an address an
    // `mremap` of the frozen run moved is a frozen page too.
    for &addr in &faults[..nfaults] {
        answer_fault(sh, &log, addr);
    }
    // (After the events read with them too: one waiting to be read makes every answer fail with
    // `EAGAIN`, and the kernel hands out faults before events, so a thread woken to fault again
    // at once could keep the event from ever being read.)
    for &addr in &minors[..nminors] {
        answer_minor(sh, uffd, &log, addr);
    }
    // Parked pages go back as soon as there is memory for them (see the `parking` module).
    if answer {
        sh.parking.put_back(uffd, 0..usize::MAX);
    }
    read
}

/// Records change `c` of the context read (`main`: registered memory's, else the store
/// mappings'), and keeps the store pages to read zeros up to date (see the `unfilled` module):
/// pages the program dropped in store mappings, and in the run being merged, which a mapping of
/// copies may replace before the kernel drops them (it drops whatever is mapped there when it
/// goes on).
fn follow_dropped_store_pages(sh: &Shared, log: &mut ChangeLog, c: Change, main: bool) {
    if let Change::Remove { start, end } = c {
        let dropped = if main {
            sh.frozen
                .published()
                .map(|run| start.max(run.start)..end.min(run.end))
        } else {
            Some(start..end)
        };
        if let Some(r) = dropped.filter(|r| !r.is_empty()) {
            log.unfilled.dropped(r);
        }
    }
    let own = log.record(c);
    if !main && own.is_none() && matches!(c, Change::Remap { .. }) {
        log.note_store_move();
    }
    log.unfilled.follow(&c, own);
}

/// Answers a minor fault of a store mapping at `addr`: the zero page where the program dropped
/// the page, else the file's page (the copy it maps). In a run held still by write-protection
/// the entry may hold a write-protect marker (the page was dropped while protected), which the
/// zero page cannot replace: a page of zeros goes there instead, write-protected like the page
/// it replaces (outside such a run, the kernel refuses to protect, and it is not). Errors only
/// need the wake (`EEXIST`: mapped meanwhile; `EAGAIN`: a change waits to be read, the thread
/// faults again).
fn answer_minor(sh: &Shared, uffd: &sys::Uffd, log: &ChangeLog, addr: usize) {
    let either = |f: &dyn Fn(bool) -> std::io::Result<()>| {
        f(true).or_else(|e| match e.raw_os_error() {
            Some(libc::EINVAL) => f(false),
            _ => Err(e),
        })
    };
    let zeros = |wp| {
        // SAFETY: ZEROS is a static page of zeros.
        unsafe { uffd.copy_with(addr, ZEROS.as_ptr().cast(), PAGE, wp) }
    };
    let r = if log.unfilled.holds(addr) {
        uffd.zeropage(addr, PAGE)
            .or_else(|e| match e.raw_os_error() {
                Some(libc::EEXIST) => either(&zeros),
                _ => Err(e),
            })
    } else {
        either(&|wp| uffd.continue_pages(addr, PAGE, wp))
    };
    if r.is_err() {
        let _ = uffd.wake(addr, PAGE);
    }
    // Relaxed: a counter.
    sh.counters.faults_answered.fetch_add(1, Ordering::Relaxed);
}

/// Answers a missing fault at `addr`: left to the committer if it is a frozen page (it wakes it
/// after the replacement), else the shared zero page.
fn answer_fault(sh: &Shared, log: &ChangeLog, addr: usize) {
    let gate = sh.frozen.gate();
    if gate.is_frozen(addr, log) {
        return;
    }
    // A parked page: its bytes go back (waking the waiters), or it waits for memory; never a
    // zero page.
    if sh.parking.holds(addr) {
        sh.parking.put_back(&sh.uffd, addr..addr + PAGE);
        return;
    }
    // A page of a run no longer frozen, or (checksum watching) a first touch or a released zero
    // page: map the shared zero page. A write-protect marker
    // (async watching of an unpopulated page) makes that fail with EEXIST: clear it and retry, or
    // as a last resort install a zeroed page. Other errors (EEXIST because the page came back,
    // ENOENT because the address is now a merged mapping, EAGAIN while a change's event waits to
    // be read: the faulting thread retries) only need the wake.
    let r = match sh.uffd.zeropage(addr, PAGE) {
        Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {
            let _ = sh.uffd.writeprotect(addr, PAGE, false);
            sh.uffd.zeropage(addr, PAGE).or_else(|_| {
                // SAFETY: ZEROS is a static page of zeros.
                unsafe { sh.uffd.copy(addr, ZEROS.as_ptr().cast(), PAGE) }
            })
        }
        r => r,
    };
    if r.is_err() {
        let _ = sh.uffd.wake(addr, PAGE);
    }
    // Relaxed: a counter.
    sh.counters.faults_answered.fetch_add(1, Ordering::Relaxed);
}
