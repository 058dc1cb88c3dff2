//! `libpageone_preload.so`: an `LD_PRELOAD` shim that answers `madvise(MADV_MERGEABLE)` and
//! `prctl(PR_SET_MEMORY_MERGE)` with pageone instead of KSM, so unmodified programs (QEMU with
//! `-machine mem-merge=on`) get it.
//!
//! # Design
//!
//! * **Merge.** `MADV_MERGEABLE` starts one engine per process on first use (joining
//!   `$PAGEONE_SOCKET`'s daemon when set) and registers the parts of the range not registered yet;
//!   `MADV_UNMERGEABLE` unregisters just the range (its merged pages are copied back). If the
//!   engine cannot start or refuses the range, the call goes to the kernel (KSM semantics), once
//!   logged with the reason: the program's behaviour never depends on pageone. Results and
//!   `errno` are the kernel's wherever the kernel would refuse the call.
//! * **Changes of registered memory.** `munmap`, `mremap`, `mmap(MAP_FIXED)`, `mprotect`,
//!   `mlock`/`munlock` and `madvise` go to the kernel as asked, covered by
//!   [`pageone_engine::changing_mappings`]: a change waits for the run of pages the engine holds
//!   still at that moment, if any, and no run starts while it is under way. The engine learns what
//!   changed from the kernel itself (userfaultfd events), so only the pages changed are touched and
//!   nothing is copied back: unmapping merged memory costs what it costs the kernel. After a
//!   successful `mlock`, `mlock2`, `mlockall(MCL_CURRENT)`, `munlock` or `munlockall`, the engine
//!   is told, so that what it maps over registered pages there is locked or not alike.
//! * **Dropped pages.** Merged pages are private mappings of a store file, which
//!   `MADV_DONTNEED` would read back as their copy: after the kernel dropped a range, the engine
//!   makes the merged pages in it empty anonymous memory ([`Engine::discard`]), so they read
//!   zeros. `MADV_FREE` of merged pages (which the kernel refuses on file mappings) is answered
//!   the same way, which `MADV_FREE` allows.
//! * **Memory that is not read/write.** The engine registers read/write memory only; the kernel
//!   marks a `PROT_NONE` or read-only mapping mergeable all the same and merges it once the
//!   program makes it read/write. Of a range the engine refuses as a whole, the shim registers
//!   the read/write private parts now and remembers the others ([`pending`]) until an `mprotect`
//!   (or `pkey_mprotect`) makes them read/write, when they are registered. Meanwhile they carry
//!   the kernel's flag too, so where the kernel's KSM runs it merges the pages they hold, as it
//!   would without the shim; made read/write, they are unmerged there before they are
//!   registered. `MADV_UNMERGEABLE`, `munmap`, `mmap` over them and `mremap` (which moves them
//!   with the memory) forget them first, so nothing mapped there later is registered. The
//!   answer is the kernel's (0).
//! * **`userfaultfd` on mergeable memory.** A program that registers mergeable memory with a
//!   userfaultfd of its own (QEMU's postcopy migration) gets it: the engine unregisters that
//!   range first (as KSM has no such conflict).
//! * **`MADV_WIPEONFORK`**: a child must find such memory empty, which a mapping of the store
//!   cannot give (the kernel refuses the advice on it, and a child inherits it). The range is
//!   kept out of what the engine registers for good and made private again where it was
//!   registered, then advised. (A raw `madvise` the shim does not see gets the kernel's
//!   `EINVAL` where pages are merged.)
//! * **`MADV_DONTDUMP`, `MADV_DONTFORK` and `MADV_HUGEPAGE`** (QEMU gives guest RAM the last
//!   two, and the first with `dump-guest-core=off`) live in the flags of a mapping, which the
//!   engine's own mappings (merged pages, released ones, memory given back) would not have:
//!   after the kernel accepted such advice, or `MADV_DODUMP`/`MADV_DOFORK`/`MADV_NOHUGEPAGE`, the
//!   engine is told ([`pageone_engine::advised`]), and what it maps there later carries the
//!   advice (huge pages: anonymous memory only). `munmap`, `mmap(MAP_FIXED)` and `mremap`
//!   forget it ([`pageone_engine::mapping_gone`]).
//!   (Advice given with a raw system call is not carried.)
//! * **`PR_SET_MEMORY_MERGE`** registers the process's private anonymous read/write mappings, as
//!   KSM marks every anonymous mapping: `[heap]`, small mappings and named ones too, but not the
//!   main thread's `[stack]` (it grows down past what was registered), the zero-filled tails of
//!   loaded objects' data (`.bss`: the C library's and the shim's own state, which the engine's
//!   threads use) or the engine's own memory. Mappings the program makes later are registered as
//!   they appear when mapped through the interposed `mmap` and larger than 64 MiB, and the rest
//!   (glibc maps memory for `malloc` with calls the shim does not see) by a thread of the shim:
//!   within a merge period when the heap grew or the program mapped or unprotected memory
//!   through the shim, else within up to 32 periods (a look reads all the process's mappings). If the engine's memory cannot be kept apart (below), only unnamed
//!   mappings over 64 MiB are registered: glibc's arenas (at most 64 MiB) then hold the
//!   engine's memory, which it must never freeze.
//! * **The engine's memory** comes from an allocator of the shim's own over address space
//!   reserved for it ([`alloc`]), never from the program's `malloc`: the engine never freezes or
//!   drops memory it uses, and never trims the program's heap.
//! * **Re-entrancy and fork.** A thread-local flag passes through calls made while the shim is
//!   working. The engine makes `fork` wait for a run it holds still. A forked child keeps merging,
//!   as under KSM (which keeps `VM_MERGEABLE` across `fork`, and the `PR_SET_MEMORY_MERGE` flag):
//!   the parent's engine, whose threads do not exist there, is forgotten (leaked), and the child
//!   starts an engine of its own (joining the daemon as a new client) at its first call that needs
//!   one, or a merge period after the fork from a small thread that an `exec` ends first (see
//!   [`fork`]). It registers the private anonymous read/write parts of the ranges registered in
//!   the parent at the fork (recorded by a `fork` hook in a fixed buffer) and, with
//!   `PR_SET_MEMORY_MERGE` inherited, the large mappings. Pages the parent merged are mappings of
//!   the parent's store in the child: left alone (shared already); `MADV_DONTNEED`/`MADV_FREE` of
//!   them makes them empty anonymous memory, as above. If the child's engine cannot start, the
//!   child passes everything to the kernel (logged once).

mod alloc;
mod fork;
mod pending;

use std::cell::Cell;
use std::ffi::CStr;
use std::sync::atomic::{AtomicBool, AtomicPtr, Ordering};
use std::sync::Mutex;

use libc::{c_int, c_ulong, c_void, size_t};
use pageone_engine::{changing_mappings, is_store_mapping, DropAdvice, Engine, EngineError};
use pageone_sync::lock;
use pageone_sys as sys;

use pending::{Pending, Span};

const PR_SET_MEMORY_MERGE: c_int = 67;
const PR_GET_MEMORY_MERGE: c_int = 68;
/// Without the engine's memory apart, `PR_SET_MEMORY_MERGE` registers mappings larger than this
/// only (see the crate doc).
const MERGE_ALL_MIN: usize = 64 << 20;
/// `_IOWR(0xAA, 0x00, struct uffdio_register)`: a userfaultfd registration.
const UFFDIO_REGISTER: c_ulong = pageone_sys::uapi::UFFDIO_REGISTER as c_ulong;

/// Every allocation of the shim and the engine comes from memory the engine never registers.
#[global_allocator]
static GLOBAL: alloc::EngineAlloc = alloc::EngineAlloc;

thread_local! {
    static INSIDE: Cell<bool> = const { Cell::new(false) };
}

/// This process's engine, leaked (never dropped): null until one starts. In a forked child, null
/// until the child's own starts (the parent's, whose threads do not exist there, is forgotten).
static ENGINE: AtomicPtr<Engine> = AtomicPtr::new(std::ptr::null_mut());
/// Starting an engine failed (then every call goes to the kernel).
static FAILED: AtomicBool = AtomicBool::new(false);
/// An engine runs (checked without a lock on the hot paths).
static ACTIVE: AtomicBool = AtomicBool::new(false);
/// `PR_SET_MEMORY_MERGE` is on.
static MERGE_ALL: AtomicBool = AtomicBool::new(false);
/// Set in a child after `fork`: it may map pages merged by another process (its parent's store).
static CHILD: AtomicBool = AtomicBool::new(false);
/// Ranges the program asked to merge that wait to be made read/write (see [`pending`]).
static PENDING: Mutex<Pending> = Mutex::new(Pending::new());
/// `PENDING` holds a range: read without the lock, so the hot paths take it only then.
static ANY_PENDING: AtomicBool = AtomicBool::new(false);
/// Read and write: what the engine registers.
const RW: c_int = libc::PROT_READ | libc::PROT_WRITE;

/// Writes `msg` to standard error with one `write` (no lock: in a forked child, std's lock of
/// stderr may have been held by a thread of the parent).
fn log(msg: &str) {
    let line = format!("pageone: {msg}\n");
    // SAFETY: writes the bytes of `line`, which outlives the call.
    let _ = unsafe { libc::write(2, line.as_ptr().cast(), line.len()) };
}

/// The engine's settings: the defaults, with the merge period from `PAGEONE_MERGE_PERIOD_MS`,
/// the worker threads from `PAGEONE_WORKERS`, the most copies of a store of its own from
/// `PAGEONE_STORE_PAGES`, `PAGEONE_POPULATE_MERGED=1`, `PAGEONE_RESTORE_HUGE_PAGES=0`,
/// `PAGEONE_KSM_WHEN_LIMITED=0` and the threads' priority from `PAGEONE_PRIORITY` (ignored, like
/// every `PAGEONE_*` variable, in set-user-ID and similar secure-execution programs).
fn builder() -> pageone_engine::Builder {
    // The engine's memory is the shim's allocator's: the program's heap is not the engine's to
    // trim (see `alloc`).
    let b = Engine::builder().trim_c_heap(!alloc::apart());
    let b = match setting(c"PAGEONE_MERGE_PERIOD_MS", "milliseconds") {
        Some(ms) => b.merge_period(std::time::Duration::from_millis(ms)),
        None => b,
    };
    let b = match setting(c"PAGEONE_WORKERS", "worker threads") {
        Some(n) => b.workers(n as usize),
        None => b,
    };
    let b = match setting(c"PAGEONE_STORE_PAGES", "pages") {
        Some(n) => b.store_pages(n.clamp(1, u64::from(u32::MAX - 1)) as u32),
        None => b,
    };
    let b = match setting(
        c"PAGEONE_POPULATE_MERGED",
        "(1 to map merged pages as they merge)",
    ) {
        Some(_) => b.populate_merged(true),
        None => b,
    };
    let b = match env_text(c"PAGEONE_RESTORE_HUGE_PAGES")
        .as_deref()
        .map(str::trim)
    {
        Some("0") => b.restore_huge_pages(false),
        _ => b,
    };
    let b = match env_text(c"PAGEONE_KSM_WHEN_LIMITED")
        .as_deref()
        .map(str::trim)
    {
        Some("0") => b.ksm_when_limited(false),
        _ => b,
    };
    match env_text(c"PAGEONE_PRIORITY").map(|v| (v.parse(), v)) {
        Some((Ok(p), _)) => b.priority(p),
        Some((Err(_), v)) => {
            log(&format!(
                "PAGEONE_PRIORITY={v} is not auto, idle or normal; using the default"
            ));
            b
        }
        None => b,
    }
}

/// The value of the environment variable `name`, if set and the program is not a set-user-ID or
/// similar secure-execution one. Read with `getenv` (std's lock of the environment may have been
/// held by a thread of the parent in a forked child).
fn env_text(name: &CStr) -> Option<String> {
    // SAFETY: getauxval only reads the auxiliary vector.
    if unsafe { libc::getauxval(libc::AT_SECURE) } != 0 {
        return None;
    }
    // SAFETY: a NUL-terminated name; the value is copied at once (as with `getenv` in general, a
    // thread changing the environment concurrently is the program's race).
    let v = unsafe { libc::getenv(name.as_ptr()) };
    // SAFETY: a NUL-terminated value of the environment.
    (!v.is_null()).then(|| unsafe { CStr::from_ptr(v) }.to_string_lossy().into_owned())
}

/// A positive number from the environment variable `name` (see [`env_text`]), if set.
fn env_number(name: &CStr) -> Option<u64> {
    env_text(name)?
        .trim()
        .parse::<u64>()
        .ok()
        .filter(|&v| v > 0)
}

/// A positive number from the environment variable `name`, if set (a bad value is logged and
/// ignored).
fn setting(name: &CStr, what: &str) -> Option<u64> {
    let text = env_text(name)?;
    let v = env_number(name);
    if v.is_none() {
        log(&format!(
            "{}={text} is not a positive number of {what}; using the default",
            name.to_string_lossy()
        ));
    }
    v
}

/// This process's engine, if one started (never starts one).
fn current() -> Option<&'static Engine> {
    // Acquire: pairs with the Release in `start` (the engine is built before it is seen).
    let p = ENGINE.load(Ordering::Acquire);
    // SAFETY: a leaked engine, never freed.
    (!p.is_null()).then(|| unsafe { &*p })
}

/// This process's engine, started on first use (see [`start`]); `None` if it cannot start.
fn engine() -> Option<&'static Engine> {
    if let Some(eng) = current() {
        return Some(eng);
    }
    // Relaxed: set under fork::START, which `start` takes before reading it again.
    if FAILED.load(Ordering::Relaxed) {
        return None;
    }
    start()
}

/// `e` and its causes, each after a colon (the kernel's reason last).
fn with_causes(e: &dyn std::error::Error) -> String {
    let mut why = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        why.push_str(": ");
        why.push_str(&c.to_string());
        cause = c.source();
    }
    why
}

/// Starts this process's engine (joining `$PAGEONE_SOCKET`'s daemon when set) under
/// [`fork::START`]; in a forked child, it then registers what the child inherited (see
/// [`inherit`]) and, with `PR_SET_MEMORY_MERGE` on, the large mappings. A failure is logged once;
/// every call goes to the kernel from then on.
fn start() -> Option<&'static Engine> {
    let mut start = lock(&fork::START);
    if let Some(eng) = current() {
        return Some(eng);
    }
    // Relaxed: see `engine`.
    if FAILED.load(Ordering::Relaxed) {
        return None;
    }
    let eng: &'static Engine = match builder().build() {
        Ok(eng) => Box::leak(Box::new(eng)),
        Err(e) => {
            FAILED.store(true, Ordering::Relaxed);
            log(&format!(
                "the engine could not start ({}); the kernel's KSM answers instead",
                with_causes(&e)
            ));
            return None;
        }
    };
    // Release: pairs with the Acquire in `current`.
    ENGINE.store(eng as *const Engine as *mut Engine, Ordering::Release);
    // Relaxed: a hint for the hot paths; the engine is published by ENGINE.
    ACTIVE.store(true, Ordering::Relaxed);
    fork::watch_forks_late();
    let owed = fork::owed();
    fork::paid();
    let n = std::mem::take(&mut start.len);
    if n > fork::MAX_INHERITED {
        log(&format!(
            "this forked child inherited {n} registered ranges; the first {} merge here",
            fork::MAX_INHERITED
        ));
    }
    // START stays held: a fork meanwhile waits, so a grandchild inherits all of it.
    inherit(eng, &start.ranges[..n.min(fork::MAX_INHERITED)]);
    // Relaxed: see prctl.
    if owed && MERGE_ALL.load(Ordering::Relaxed) {
        merge_all(eng);
    }
    Some(eng)
}

/// Registers, in a forked child, the ranges registered in its parent at the fork: their private
/// anonymous read/write parts, and the pages the parent had merged, which are mappings of the
/// parent's store here. Those stay shared with the parent while the child leaves them alone; a
/// page the child writes becomes a private copy in that mapping, which the child's engine merges
/// again as it would a copy-on-write break of its own.
fn inherit(eng: &Engine, ranges: &[(usize, usize)]) {
    if ranges.is_empty() {
        return;
    }
    let Ok(maps) = sys::self_mappings() else {
        return;
    };
    let eligible =
        |m: &&sys::Mapping| m.is_private_anonymous_rw() || pageone_engine::is_merged_mapping(m);
    for &(a, e) in ranges {
        // Neighbouring eligible mappings are registered in one call (merged pages the parent
        // could not join are a mapping each: one call per mapping would read the process's
        // mappings as many times).
        let mut run: Option<(usize, usize)> = None;
        let pieces = maps
            .iter()
            .filter(|m| m.end > a && m.start < e)
            .filter(eligible);
        for (s, t) in pieces
            .map(|m| (m.start.max(a), m.end.min(e)))
            .chain([(usize::MAX, 0)])
        {
            match &mut run {
                Some(r) if r.1 == s => r.1 = t,
                _ => {
                    if let Some((rs, rt)) = run.take() {
                        // Refused (e.g. changed meanwhile): left to the kernel, as inherited.
                        let _ = eng.merge(rs as *mut u8, rt - rs);
                    }
                    run = Some((s, t));
                }
            }
        }
    }
}

/// The running engine, if one was started (never starts one).
fn running() -> Option<&'static Engine> {
    // Relaxed: see `start`.
    if !ACTIVE.load(Ordering::Relaxed) {
        return None;
    }
    current()
}

/// Runs `f` with the re-entrancy flag set and panics contained; `None` if the shim must not act
/// (re-entered, or `f` panicked).
fn guarded<T>(f: impl FnOnce() -> T) -> Option<T> {
    if INSIDE.get() {
        return None;
    }
    INSIDE.set(true);
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).ok();
    INSIDE.set(false);
    r
}

fn set_errno(e: &std::io::Error) -> c_int {
    // SAFETY: errno is this thread's.
    unsafe { *libc::__errno_location() = e.raw_os_error().unwrap_or(libc::EINVAL) };
    -1
}

fn raw_madvise(addr: *mut c_void, len: size_t, advice: c_int) -> c_int {
    // SAFETY: the program asked for exactly this call.
    match unsafe { sys::madvise(addr.cast(), len, advice) } {
        Ok(()) => 0,
        Err(e) => set_errno(&e),
    }
}

fn page_range(addr: *mut c_void, len: size_t) -> Option<(usize, usize)> {
    let a = addr as usize;
    let end = a.checked_add(len.checked_add(sys::PAGE_SIZE - 1)? & !(sys::PAGE_SIZE - 1))?;
    (a % sys::PAGE_SIZE == 0 && len > 0).then_some((a, end))
}

/// Runs `call`, a change of mappings the program asked for, covered while an engine runs (see the
/// crate documentation). `errno` is the call's own.
fn covered<T>(call: impl FnOnce() -> T) -> T {
    // Relaxed: see `running`.
    if !ACTIVE.load(Ordering::Relaxed) || INSIDE.get() {
        return call();
    }
    let _change = changing_mappings();
    call()
}

/// `madvise(2)`, answering `MADV_MERGEABLE`/`MADV_UNMERGEABLE` with pageone.
///
/// # Safety
/// As `madvise(2)`.
#[no_mangle]
pub unsafe extern "C" fn madvise(addr: *mut c_void, len: size_t, advice: c_int) -> c_int {
    match advice {
        libc::MADV_MERGEABLE | libc::MADV_UNMERGEABLE => merge_advice(addr, len, advice),
        libc::MADV_DONTNEED | libc::MADV_FREE | sys::uapi::MADV_DONTNEED_LOCKED => {
            drop_pages(addr, len, advice)
        }
        libc::MADV_WIPEONFORK => wipe_on_fork(addr, len),
        libc::MADV_DONTDUMP
        | libc::MADV_DODUMP
        | libc::MADV_DONTFORK
        | libc::MADV_DOFORK
        | libc::MADV_NOHUGEPAGE => told(
            covered(|| raw_madvise(addr, len, advice)),
            addr,
            len,
            advice,
        ),
        libc::MADV_HUGEPAGE => {
            // Registered memory keeps huge pages as the kernel's KSM does (the engine splits one
            // only where a page of it merges), but the mappings of pageone's store in it are
            // left as they are: files, whose holes a huge page would fill.
            let registered = page_range(addr, len).filter(|&(a, e)| {
                guarded(|| running().is_some_and(|eng| eng.is_registered(a as *mut u8, e - a)))
                    .unwrap_or(false)
            });
            let r = match registered {
                Some((a, e)) => covered(|| huge_pages_but_on_the_store(a, e)),
                None => covered(|| raw_madvise(addr, len, advice)),
            };
            told(r, addr, len, advice)
        }
        _ => covered(|| raw_madvise(addr, len, advice)),
    }
}

/// After `madvise(addr, len, advice)` answered `r`: advice kept in the mapping's flags, which the
/// engine's mappings carry over, is told to the engine if the kernel took it (see
/// `pageone_engine::advised`). Returns `r`.
fn told(r: c_int, addr: *mut c_void, len: size_t, advice: c_int) -> c_int {
    if let (0, Some((a, e))) = (r, page_range(addr, len)) {
        pageone_engine::advised(a..e, advice);
    }
    r
}

/// `MADV_MERGEABLE` and `MADV_UNMERGEABLE` (see the crate documentation). `errno` is the
/// kernel's: left as it was where the call succeeds.
fn merge_advice(addr: *mut c_void, len: size_t, advice: c_int) -> c_int {
    let Some((a, e)) = page_range(addr, len) else {
        return raw_madvise(addr, len, advice);
    };
    let saved = errno();
    if advice == libc::MADV_UNMERGEABLE {
        forget(a, e);
    }
    let done = guarded(|| {
        if advice == libc::MADV_UNMERGEABLE {
            if let Some(eng) = running() {
                // Only what is registered (NotRegistered otherwise: nothing to do here).
                let _ = eng.unregister(a as *mut u8, e - a);
            }
            // The kernel's flag may be set too (an earlier fallback): clear it as well. Its
            // answer is the kernel's verdict on the range (ENOMEM where part of it is not mapped).
            return Some(raw_madvise(addr, len, advice));
        }
        let eng = engine()?;
        match eng.merge(a as *mut u8, e - a) {
            Ok(()) => Some(0),
            // Refused as a whole: perhaps for the protection of part of it.
            Err(_) => merge_by_protection(eng, a, e),
        }
    });
    let r = match done {
        Some(Some(r)) => r,
        // Not ours to answer (no engine, not anonymous memory, re-entered): the kernel's KSM.
        _ => raw_madvise(addr, len, advice),
    };
    if r == 0 {
        set_errno_raw(saved);
    }
    r
}

/// `MADV_WIPEONFORK`: a child must find the range empty, which only private anonymous memory
/// gives (the kernel refuses the advice on file mappings, which merged pages are, and a child
/// inherits them). So the range is kept out of what the engine registers from now on (for good,
/// `PR_SET_MEMORY_MERGE` included: a range a crypto library watches to detect a fork must never
/// be a mapping of the store), made private again where it was registered (as
/// `MADV_UNMERGEABLE` does), and then given the kernel's advice.
fn wipe_on_fork(addr: *mut c_void, len: size_t) -> c_int {
    let Some((a, e)) = page_range(addr, len) else {
        return raw_madvise(addr, len, libc::MADV_WIPEONFORK);
    };
    forget(a, e);
    guarded(|| {
        match pageone_engine::keep_apart(a..e) {
            // Kept apart for the life of the process.
            Some(guard) => std::mem::forget(guard),
            None => {
                log("memory advised MADV_WIPEONFORK could not be kept apart: the table is full")
            }
        }
        if let Some(eng) = running() {
            // Only what is registered (NotRegistered otherwise: nothing to do here).
            let _ = eng.unregister(a as *mut u8, e - a);
        }
    });
    raw_madvise(addr, len, libc::MADV_WIPEONFORK)
}

/// `MADV_HUGEPAGE` for the mappings of `[a, e)` that are not mappings of pageone's store; the
/// kernel's answer for the first that fails (and `ENOMEM` where part of the range is not mapped,
/// as the kernel answers).
fn huge_pages_but_on_the_store(a: usize, e: usize) -> c_int {
    let Ok(maps) = sys::self_mappings_in(a, e) else {
        return raw_madvise(a as *mut c_void, e - a, libc::MADV_HUGEPAGE);
    };
    let mut cur = a;
    let mut r = 0;
    for m in maps.iter().filter(|m| m.end > a && m.start < e) {
        let (s, t) = (m.start.max(a), m.end.min(e));
        if s > cur && r == 0 {
            r = set_errno(&std::io::Error::from_raw_os_error(libc::ENOMEM));
        }
        if !is_store_mapping(m)
            && raw_madvise(s as *mut c_void, t - s, libc::MADV_HUGEPAGE) != 0
            && r == 0
        {
            r = -1;
        }
        cur = t;
    }
    if cur < e && r == 0 {
        r = set_errno(&std::io::Error::from_raw_os_error(libc::ENOMEM));
    }
    r
}

/// What `MADV_MERGEABLE` does with a mapping of its range: private memory is registered now if it
/// is read/write, else later (see [`pending`]); `None` for any other mapping.
fn registers_now(m: &sys::Mapping) -> Option<bool> {
    let anonymous =
        m.inode == 0 && (m.path.is_empty() || m.path == "[heap]" || m.path.starts_with("[anon:"));
    let private = m.perms.ends_with('p') && (anonymous || is_store_mapping(m));
    private.then(|| m.prot() & RW == RW)
}

/// `MADV_MERGEABLE` of `[a, e)`, which the engine refused as a whole, when part of it is private
/// memory that is not read/write (a `PROT_NONE` reservation or guard page, read-only memory):
/// the read/write runs are registered now (what the engine refuses of them goes to the kernel's
/// flag), the others remembered until the program makes them read/write (see [`pending`]).
/// `None` (the kernel answers, as before) when no part is of that kind, or part of the range is
/// unmapped or not private memory. Otherwise the kernel's answer, 0 unless it refuses a part.
fn merge_by_protection(eng: &Engine, a: usize, e: usize) -> Option<c_int> {
    let maps = sys::self_mappings_in(a, e).ok()?;
    // (start, end, registered now)
    let mut runs: Vec<(usize, usize, bool)> = Vec::new();
    let mut cur = a;
    for m in maps.iter().filter(|m| m.end > a && m.start < e) {
        if m.start > cur {
            return None;
        }
        let now = registers_now(m)?;
        let (s, t) = (m.start.max(a), m.end.min(e));
        match runs.last_mut() {
            Some(r) if r.2 == now => r.1 = t,
            _ => runs.push((s, t, now)),
        }
        cur = m.end;
    }
    if cur < e || runs.iter().all(|r| r.2) {
        return None;
    }
    let mut refused = None;
    for &(s, t, now) in &runs {
        if !now {
            pending_locked(|p| remember(p, (s, t)));
            // The kernel's flag too: where its KSM runs, it merges the pages the memory holds
            // meanwhile, as it would without the shim (`made_writable` takes them back).
            if raw_madvise(s as *mut c_void, t - s, libc::MADV_MERGEABLE) != 0 {
                refused = refused.or(Some(errno()));
            }
            continue;
        }
        if eng.merge(s as *mut u8, t - s).is_err()
            && raw_madvise(s as *mut c_void, t - s, libc::MADV_MERGEABLE) != 0
        {
            refused = refused.or(Some(errno()));
        }
    }
    Some(match refused {
        Some(err) => {
            set_errno_raw(err);
            -1
        }
        None => 0,
    })
}

/// Runs `f` on the remembered ranges (the caller does not hold the lock). `errno` is kept (a
/// contended lock may set it).
fn pending_locked<T>(f: impl FnOnce(&mut Pending) -> T) -> T {
    let saved = errno();
    let mut p = lock(&PENDING);
    let r = f(&mut p);
    // Relaxed: a hint for `with_pending`; the ranges themselves are read under the lock.
    ANY_PENDING.store(!p.is_empty(), Ordering::Relaxed);
    drop(p);
    set_errno_raw(saved);
    r
}

/// Runs `f` on the remembered ranges if there are any and the shim may act: not re-entered (this
/// thread may hold the lock). (A forked child finds the lock free: the fork hooks hold it across
/// the fork, see [`fork`].)
fn with_pending<T>(f: impl FnOnce(&mut Pending) -> T) -> Option<T> {
    // Relaxed: a range added by a call that happens before this one (in the program's order of
    // its calls) is seen, as a load reads the value of a store that happens before it or a later
    // one. A range added concurrently with a call on the same memory is the program's race.
    if !ANY_PENDING.load(Ordering::Relaxed) || INSIDE.get() {
        return None;
    }
    Some(pending_locked(f))
}

/// Remembers `span`; when every slot is in use, it goes to the kernel's flag instead (as before
/// ranges were remembered).
fn remember(p: &mut Pending, span: Span) {
    if p.add(span.0, span.1).is_err() {
        to_kernel(span);
    }
}

/// Gives `span`, which the program asked to merge, to the kernel's flag (logged once). `errno`
/// is kept.
fn to_kernel((s, t): Span) {
    static LOGGED: AtomicBool = AtomicBool::new(false);
    // Relaxed: a flag for the log alone.
    if !LOGGED.swap(true, Ordering::Relaxed) {
        log("too many mergeable ranges wait to be made read/write; the kernel's KSM has the rest");
    }
    let saved = errno();
    raw_madvise(s as *mut c_void, t - s, libc::MADV_MERGEABLE);
    set_errno_raw(saved);
}

/// Forgets the remembered ranges in `[a, e)`: the memory there is unmapped, replaced or no longer
/// to be merged (before the call that changes it: nothing mapped there afterwards is registered).
fn forget(a: usize, e: usize) {
    if let Some(Some(d)) = with_pending(|p| p.cut(a, e).dropped) {
        to_kernel(d);
    }
}

/// [`forget`] for a call's own arguments (nothing if they are not a page range).
fn forget_call(addr: *mut c_void, len: size_t) {
    if let Some((a, e)) = page_range(addr, len) {
        forget(a, e);
    }
}

/// After an `mprotect` of `[addr, addr+len)` to `prot` that answered `r`: see [`made_writable`].
/// A refused call may have changed the mappings before the one it refused (the kernel stops
/// there, `ENOMEM` at a hole): the remembered parts of those that are now read/write are
/// registered all the same.
fn protected(addr: *mut c_void, len: size_t, prot: c_int, r: c_int) {
    if r == 0 {
        // Relaxed: see prctl; a hint for the thread that looks for new mappings (memory made
        // read/write may be newly eligible).
        if prot & RW == RW && MERGE_ALL.load(Ordering::Relaxed) {
            MAPPED.store(true, Ordering::Relaxed);
        }
        return made_writable(addr, len, prot);
    }
    // Relaxed: see `with_pending`.
    let Some((a, e)) = page_range(addr, len).filter(|_| ANY_PENDING.load(Ordering::Relaxed)) else {
        return;
    };
    if prot & RW != RW {
        return;
    }
    let saved = errno();
    for m in sys::self_mappings_in(a, e).unwrap_or_default() {
        if m.prot() & RW == RW {
            let (s, t) = (m.start.max(a), m.end.min(e));
            made_writable(s as *mut c_void, t - s, prot);
        }
    }
    set_errno_raw(saved);
}

/// After a successful `mprotect` of `[addr, addr+len)` to `prot`: the remembered parts of the
/// range (see [`pending`]) are registered if they are now read/write, as KSM merges them from now
/// on. `errno` is kept.
fn made_writable(addr: *mut c_void, len: size_t, prot: c_int) {
    if prot & RW != RW {
        return;
    }
    let Some((a, e)) = page_range(addr, len) else {
        return;
    };
    let saved = errno();
    // Relaxed: see `with_pending`. A forked child may not have started its engine yet: started
    // here, before the lock (a start takes `fork::START`, which a fork takes before this lock).
    if ANY_PENDING.load(Ordering::Relaxed) {
        guarded(engine);
    }
    // The lock is held while registering: an `munmap` of the range waits to forget it before it
    // unmaps, so nothing mapped there after it is registered.
    with_pending(|p| {
        let cut = p.cut(a, e);
        if let Some(d) = cut.dropped {
            to_kernel(d);
        }
        guarded(|| {
            let Some(eng) = running() else { return };
            for &(s, t) in cut.spans() {
                // Marked for the kernel's KSM while it was not read/write (see
                // `merge_by_protection`): the pages it merged become private again first.
                raw_madvise(s as *mut c_void, t - s, libc::MADV_UNMERGEABLE);
                if let Err(err) = eng.merge(s as *mut u8, t - s) {
                    log(&format!(
                        "mergeable memory made read/write could not be registered ({err}); \
                         it is not merged"
                    ));
                }
            }
        });
    });
    set_errno_raw(saved);
}

/// `MADV_DONTNEED`, `MADV_DONTNEED_LOCKED` and `MADV_FREE`: the kernel drops the pages; merged
/// pages among them are made empty anonymous memory (see the crate documentation).
fn drop_pages(addr: *mut c_void, len: size_t, advice: c_int) -> c_int {
    let Some((a, e)) = page_range(addr, len) else {
        return raw_madvise(addr, len, advice);
    };
    // Relaxed: set by the child's fork hook, before any other thread of the child exists.
    if CHILD.load(Ordering::Relaxed) {
        return child_drop_pages(a, e, advice);
    }
    let Some(eng) = guarded(running).flatten() else {
        return raw_madvise(addr, len, advice);
    };
    let _change = changing_mappings();
    engine_drop(eng, a, e, advice)
}

/// `[a, e)` dropped by the engine (`Engine::drop_pages`): the kernel's result and `errno`, with
/// merged pages made empty anonymous memory.
fn engine_drop(eng: &Engine, a: usize, e: usize, advice: c_int) -> c_int {
    let Some(how) = DropAdvice::from_madvise(advice) else {
        return raw_madvise(a as *mut c_void, e - a, advice);
    };
    match guarded(|| eng.drop_pages(a as *mut u8, e - a, how)) {
        Some(Ok(())) => 0,
        Some(Err(EngineError::Refused(err))) => set_errno(&err),
        Some(Err(err)) => {
            // The kernel dropped the pages; merged ones may read their copy.
            log(&format!("dropped merged pages could not be emptied: {err}"));
            0
        }
        None => raw_madvise(a as *mut c_void, e - a, advice),
    }
}

/// `drop_pages` in a forked child: pages merged by another process (the parent) are mappings of
/// a store here that are not registered with the child's engine; they become empty anonymous
/// memory. The child's own engine, if it runs, empties the pages it merged (as in
/// [`drop_pages`]).
fn child_drop_pages(a: usize, e: usize, advice: c_int) -> c_int {
    let eng = guarded(running).flatten();
    let _change = eng.map(|_| changing_mappings());
    let r = raw_madvise(a as *mut c_void, e - a, advice);
    let refused = r != 0 && advice == libc::MADV_FREE && errno() == libc::EINVAL;
    if r != 0 && !refused {
        return r;
    }
    let Ok(maps) = sys::self_mappings_in(a, e) else {
        return r;
    };
    // Not the child's engine's: not registered with it (with a daemon, the parent's copies and
    // the child's may be in the same file).
    let foreign = |s: usize, t: usize| !eng.is_some_and(|g| g.is_registered(s as *mut u8, t - s));
    for m in maps
        .iter()
        .filter(|m| m.end > a && m.start < e && is_store_mapping(m))
    {
        let (s, t) = (m.start.max(a), m.end.min(e));
        if !foreign(s, t) {
            continue;
        }
        // SAFETY: pages the program asked to drop, replaced by an empty private mapping with the
        // same protection, or (no mapping to spare to split the store's) zeros written over them.
        let emptied = unsafe { sys::mmap_anonymous_fixed(s as *mut u8, t - s, m.prot()) }
            .or_else(|_| unsafe { sys::zero_own_memory(s, t - s) });
        if emptied.is_err() {
            // (errno is the kernel's.)
            return -1;
        }
    }
    match (eng, refused) {
        (Some(eng), false) => {
            if let Some(Err(err)) = guarded(|| eng.discard(a as *mut u8, e - a)) {
                log(&format!("dropped merged pages could not be emptied: {err}"));
            }
            0
        }
        (Some(eng), true) => engine_drop(eng, a, e, advice),
        (None, true) => raw_madvise(a as *mut c_void, e - a, advice),
        (None, false) => 0,
    }
}

fn errno() -> c_int {
    // SAFETY: errno is this thread's.
    unsafe { *libc::__errno_location() }
}

fn set_errno_raw(value: c_int) {
    // SAFETY: errno is this thread's.
    unsafe { *libc::__errno_location() = value };
}

/// The name under which `PR_SET_MEMORY_MERGE` is kept across `execve` (in the environment, which
/// the new program inherits, as the kernel keeps its flag across `execve`).
const MERGE_ALL_ENV: &std::ffi::CStr = c"PAGEONE_MEMORY_MERGE";

fn remember_merge_all(on: bool) {
    // SAFETY: NUL-terminated strings; the program asked for the process-wide setting (as with
    // `setenv` in general, a thread reading the environment concurrently is the program's race).
    unsafe {
        if on {
            libc::setenv(MERGE_ALL_ENV.as_ptr(), c"1".as_ptr(), 1);
        } else {
            libc::unsetenv(MERGE_ALL_ENV.as_ptr());
        }
    }
}

/// Run when the shim is loaded: a program started (by `execve`) from one that had
/// `PR_SET_MEMORY_MERGE` on has it on too.
extern "C" fn on_load() {
    // SAFETY: a NUL-terminated name; read before the program's threads start.
    let set = unsafe { libc::getenv(MERGE_ALL_ENV.as_ptr()) };
    // SAFETY: getauxval only reads the auxiliary vector.
    let secure = unsafe { libc::getauxval(libc::AT_SECURE) } != 0;
    // SAFETY: a NUL-terminated value of the environment.
    if !set.is_null() && !secure && unsafe { std::ffi::CStr::from_ptr(set) } == c"1" {
        // Relaxed: see prctl; nothing else runs yet.
        MERGE_ALL.store(true, Ordering::Relaxed);
    }
    if let Err(e) = fork::watch_forks() {
        // Relaxed: nothing else runs yet.
        FAILED.store(true, Ordering::Relaxed);
        log(&format!(
            "cannot watch fork() ({e}); not starting (the kernel's KSM answers instead)"
        ));
    }
}

#[used]
#[link_section = ".init_array"]
static ON_LOAD: extern "C" fn() = on_load;

/// With `PR_SET_MEMORY_MERGE` on, registers the eligible mappings now and, every merge period
/// from a thread of the shim, those mapped since: glibc maps memory for `malloc` (a grown
/// `[heap]`, arenas, large blocks) with calls the shim does not see.
fn merge_all(eng: &'static Engine) {
    let _ = register_eligible(eng);
    if alloc::apart() {
        watch_new_mappings(eng);
    }
}

/// A thread of this process registers new eligible mappings (see [`merge_all`]).
static WATCHING: AtomicBool = AtomicBool::new(false);

/// Starts the thread that registers new eligible mappings every merge period while
/// `PR_SET_MEMORY_MERGE` is on, once per process (a forked child starts its own), with every
/// signal blocked and its stack kept out of what it registers.
fn watch_new_mappings(eng: &'static Engine) {
    // Relaxed: a start flag, set once; cleared in a forked child before it has other threads.
    if WATCHING.swap(true, Ordering::Relaxed) {
        return;
    }
    let Ok(_mask) = sys::block_all_signals() else {
        return;
    };
    let period =
        std::time::Duration::from_millis(env_number(c"PAGEONE_MERGE_PERIOD_MS").unwrap_or(200));
    // Its stack is kept apart like an engine thread's; it runs for the life of the process.
    match pageone_engine::spawn_apart("pageone-mappings".into(), move || {
        look_for_new_mappings(eng, period)
    }) {
        Ok(t) => std::mem::forget(t),
        Err(e) => log(&format!(
            "cannot start a thread to register new mappings ({e}); only mappings made through \
             mmap are registered as they appear"
        )),
    }
}

/// A look at the process's mappings costs a read of all of them (merged memory is many): after a
/// look that found nothing, the next waits twice as many merge periods, up to this many, unless
/// the heap grew or the program mapped memory through the shim meanwhile.
const MAX_LOOK_PERIODS: u32 = 32;

/// Set by the interposed `mmap` when the program mapped private anonymous memory it did not
/// register at once (see [`look_for_new_mappings`]).
static MAPPED: AtomicBool = AtomicBool::new(false);

/// The loop of the thread started by [`watch_new_mappings`]: every merge period, registers new
/// eligible mappings if the heap grew (the program break moved) or the program mapped memory
/// through the shim; else only every few periods (see [`MAX_LOOK_PERIODS`]), for arenas and large
/// blocks glibc mapped behind the shim's back.
fn look_for_new_mappings(eng: &'static Engine, period: std::time::Duration) {
    // SAFETY: brk(0) only reads the program break.
    let program_break = || unsafe { libc::syscall(libc::SYS_brk, 0) };
    let mut brk = program_break();
    let (mut wait, mut waited) = (1, 0);
    loop {
        std::thread::sleep(period);
        // Relaxed: see prctl.
        if !MERGE_ALL.load(Ordering::Relaxed) {
            continue;
        }
        waited += 1;
        let now = program_break();
        // Relaxed: a hint; the look reads the mappings themselves.
        let hinted = MAPPED.swap(false, Ordering::Relaxed) || now != brk;
        if !hinted && waited < wait {
            continue;
        }
        (brk, waited) = (now, 0);
        let found = guarded(|| register_eligible(eng)).unwrap_or(0);
        wait = if found > 0 || hinted {
            1
        } else {
            (wait * 2).min(MAX_LOOK_PERIODS)
        };
    }
}

/// Registers the eligible mappings (see the crate doc) that are not registered yet; returns how
/// many were.
fn register_eligible(eng: &Engine) -> usize {
    let Ok(maps) = sys::self_mappings() else {
        return 0;
    };
    // The end of the last file mapping: an anonymous mapping starting there is a `.bss`.
    let mut file_end = 0;
    let mut registered = 0;
    for m in maps {
        let (p, len) = (m.start as *mut u8, m.end - m.start);
        let bss = m.start == file_end && m.path.is_empty();
        if merges_all(&m)
            && !bss
            && !pageone_engine::is_kept_apart(&(m.start..m.end))
            && !eng.is_registered(p, len)
            && eng.merge(p, len).is_ok()
        {
            registered += 1;
        }
        if m.inode != 0 {
            file_end = m.end;
        }
    }
    registered
}

/// Whether `PR_SET_MEMORY_MERGE` registers mapping `m`: when the engine's memory is apart, every
/// private anonymous read/write mapping (`[heap]` and named ones too) but the main thread's
/// `[stack]` and the zero-filled tails of loaded objects' data (their `.bss`, which holds the C
/// library's and the shim's own state; skipped by the caller); else only unnamed ones larger
/// than [`MERGE_ALL_MIN`].
fn merges_all(m: &sys::Mapping) -> bool {
    m.is_private_anonymous_rw()
        && (alloc::apart() || (m.path.is_empty() && m.end - m.start > MERGE_ALL_MIN))
}

/// `prctl(2)`, answering `PR_SET_MEMORY_MERGE`/`PR_GET_MEMORY_MERGE` with pageone. (Declared with
/// five integer arguments: the C prototype is variadic, the x86-64 calling convention the same.)
///
/// # Safety
/// As `prctl(2)`.
#[no_mangle]
pub unsafe extern "C" fn prctl(
    option: c_int,
    a2: c_ulong,
    a3: c_ulong,
    a4: c_ulong,
    a5: c_ulong,
) -> c_int {
    // SAFETY: the program asked for exactly this call.
    let raw = || unsafe { sys::raw_prctl(option, a2, a3, a4, a5) };
    match option {
        PR_SET_MEMORY_MERGE => {
            // The kernel's own checks of the arguments, without turning its merging on: switching
            // it off is a no-op unless an earlier fallback switched it on.
            // SAFETY: a valid prctl call with the program's own extra arguments.
            if unsafe { sys::raw_prctl(PR_SET_MEMORY_MERGE, 0, a3, a4, a5) } != 0 {
                return -1;
            }
            let on = a2 != 0;
            let done = guarded(|| {
                let eng = engine()?;
                // Relaxed: a mode flag read by later mmap calls; no data is published with it.
                MERGE_ALL.store(on, Ordering::Relaxed);
                remember_merge_all(on);
                if on {
                    merge_all(eng);
                }
                Some(0)
            });
            match done {
                Some(Some(r)) => r,
                _ => raw(),
            }
        }
        // Relaxed: as above.
        PR_GET_MEMORY_MERGE
            if (a2, a3, a4, a5) == (0, 0, 0, 0) && MERGE_ALL.load(Ordering::Relaxed) =>
        {
            1
        }
        _ => raw(),
    }
}

fn raw_mmap(
    addr: *mut c_void,
    len: size_t,
    prot: c_int,
    flags: c_int,
    fd: c_int,
    off: libc::off_t,
) -> *mut c_void {
    // SAFETY: the program asked for exactly this call.
    unsafe { sys::raw_mmap(addr, len, prot, flags, fd, off) }
}

/// `mmap(2)`: a fixed mapping is a change of mappings (see the crate doc); with
/// `PR_SET_MEMORY_MERGE`, large private anonymous mappings are registered. Mergeable ranges
/// waiting to be made read/write are forgotten where the new mapping is (before a fixed one: an
/// address given back by a call the shim did not see may be handed out again too).
///
/// # Safety
/// As `mmap(2)`.
#[no_mangle]
pub unsafe extern "C" fn mmap(
    addr: *mut c_void,
    len: size_t,
    prot: c_int,
    flags: c_int,
    fd: c_int,
    off: libc::off_t,
) -> *mut c_void {
    let p = if flags & libc::MAP_FIXED != 0 {
        forget_call(addr, len);
        let p = covered(|| raw_mmap(addr, len, prot, flags, fd, off));
        if p != libc::MAP_FAILED {
            mapping_gone(p as usize, len);
        }
        p
    } else {
        let p = raw_mmap(addr, len, prot, flags, fd, off);
        if p != libc::MAP_FAILED {
            forget_call(p, len);
        }
        p
    };
    // Relaxed: see prctl.
    let wanted = MERGE_ALL.load(Ordering::Relaxed)
        && p != libc::MAP_FAILED
        && len > MERGE_ALL_MIN
        && flags & libc::MAP_ANONYMOUS != 0
        && flags & libc::MAP_PRIVATE != 0
        && prot == libc::PROT_READ | libc::PROT_WRITE;
    if wanted {
        guarded(|| {
            if let Some(eng) = engine() {
                let _ = eng.merge(p.cast(), len.div_ceil(sys::PAGE_SIZE) * sys::PAGE_SIZE);
            }
        });
    } else if p != libc::MAP_FAILED
        && flags & libc::MAP_ANONYMOUS != 0
        && flags & libc::MAP_PRIVATE != 0
        // Relaxed: see prctl.
        && MERGE_ALL.load(Ordering::Relaxed)
    {
        // Relaxed: a hint for the thread that looks for new mappings.
        MAPPED.store(true, Ordering::Relaxed);
    }
    p
}

/// `mmap64(2)`: the same as [`mmap`] on 64-bit.
///
/// # Safety
/// As `mmap(2)`.
#[no_mangle]
pub unsafe extern "C" fn mmap64(
    addr: *mut c_void,
    len: size_t,
    prot: c_int,
    flags: c_int,
    fd: c_int,
    off: libc::off_t,
) -> *mut c_void {
    // SAFETY: forwarded.
    unsafe { mmap(addr, len, prot, flags, fd, off) }
}

/// `munmap(2)`: a change of mappings (see the crate doc); mergeable ranges waiting to be made
/// read/write there are forgotten first.
///
/// # Safety
/// As `munmap(2)`.
#[no_mangle]
pub unsafe extern "C" fn munmap(addr: *mut c_void, len: size_t) -> c_int {
    forget_call(addr, len);
    // SAFETY: the program asked for exactly this call.
    let r = covered(|| unsafe { sys::raw_munmap(addr, len) });
    if r == 0 {
        mapping_gone(addr as usize, len);
    }
    r
}

/// The program's advice over `[addr, addr + len)` went with its mappings (see
/// `pageone_engine::advised`).
fn mapping_gone(addr: usize, len: usize) {
    if let Some((a, e)) = page_range(addr as *mut c_void, len) {
        pageone_engine::mapping_gone(a..e);
    }
}

/// `mprotect(2)`: a change of mappings (see the crate doc); mergeable memory it makes read/write
/// is registered (see [`protected`]).
///
/// # Safety
/// As `mprotect(2)`.
#[no_mangle]
pub unsafe extern "C" fn mprotect(addr: *mut c_void, len: size_t, prot: c_int) -> c_int {
    // SAFETY: the program asked for exactly this call.
    let r = covered(|| unsafe { sys::raw_mprotect(addr, len, prot) });
    protected(addr, len, prot, r);
    r
}

/// `pkey_mprotect(2)`: as [`mprotect`] (and as glibc, `mprotect` itself for key -1).
///
/// # Safety
/// As `pkey_mprotect(2)`.
#[no_mangle]
pub unsafe extern "C" fn pkey_mprotect(
    addr: *mut c_void,
    len: size_t,
    prot: c_int,
    pkey: c_int,
) -> c_int {
    let r = covered(|| {
        if pkey == -1 {
            // SAFETY: the program asked for this call, which is mprotect's for key -1.
            unsafe { sys::raw_mprotect(addr, len, prot) }
        } else {
            // SAFETY: the program asked for exactly this call.
            unsafe { libc::syscall(libc::SYS_pkey_mprotect, addr, len, prot, pkey) as c_int }
        }
    });
    protected(addr, len, prot, r);
    r
}

/// `mremap(2)`: a change of mappings (see the crate doc); mergeable ranges waiting to be made
/// read/write move with the memory (see [`Remap`]). (Variadic in C; the optional fifth argument
/// is read as passed, which the x86-64 convention allows.)
///
/// # Safety
/// As `mremap(2)`.
#[no_mangle]
pub unsafe extern "C" fn mremap(
    old: *mut c_void,
    old_len: size_t,
    new_len: size_t,
    flags: c_int,
    new: *mut c_void,
) -> *mut c_void {
    let call = Remap {
        old: old as usize,
        old_len,
        new_len,
        flags,
        new: new as usize,
    };
    let moving = call.before();
    let p = remap(&call);
    if p != libc::MAP_FAILED {
        call.move_advice(p as usize);
    }
    if let Some(cut) = moving {
        call.after(&cut, p);
    }
    p
}

/// The arguments of an `mremap` call.
struct Remap {
    old: usize,
    old_len: usize,
    new_len: usize,
    flags: c_int,
    new: usize,
}

impl Remap {
    /// After the call, the memory now at `to`: the program's advice goes with it (see
    /// `pageone_engine::advised`); with `MREMAP_DONTUNMAP`, or a copy of a shared mapping
    /// (`old_len` 0), the old place keeps its own, and only what was at `to` goes.
    fn move_advice(&self, to: usize) {
        let Some((a, e)) = page_range(to as *mut c_void, self.new_len) else {
            return;
        };
        match page_range(self.old as *mut c_void, self.old_len) {
            Some((fa, fe)) if self.flags & libc::MREMAP_DONTUNMAP == 0 => {
                pageone_engine::mapping_moved(fa..fe, a..e);
            }
            _ => pageone_engine::mapping_gone(a..e),
        }
    }

    /// Before the call: the mergeable ranges waiting to be made read/write in the old range are
    /// taken out (to move with it), and those where a fixed new range goes are forgotten.
    fn before(&self) -> Option<pending::Cut> {
        if self.flags & libc::MREMAP_FIXED != 0 {
            forget_call(self.new as *mut c_void, self.new_len);
        }
        let (a, e) = page_range(self.old as *mut c_void, self.old_len)?;
        let cut = with_pending(|p| p.cut(a, e))?;
        if let Some(d) = cut.dropped {
            to_kernel(d);
        }
        Some(cut)
    }

    /// After the call, which answered `to` (`errno` is kept): the ranges taken out go back where
    /// the memory is now (also at the old place with `MREMAP_DONTUNMAP`, which keeps that
    /// mapping), a range that reached the old end growing with it (the kernel's mapping grows,
    /// flag and all); where the call failed, back where they were. What the new range replaced
    /// is forgotten first.
    fn after(&self, cut: &pending::Cut, to: *mut c_void) {
        if to == libc::MAP_FAILED {
            pending_locked(|p| cut.spans().iter().for_each(|&s| remember(p, s)));
            return;
        }
        let round = |n: usize| n.div_ceil(sys::PAGE_SIZE) * sys::PAGE_SIZE;
        let (to, old_end) = (to as usize, self.old + round(self.old_len));
        let (keep, new_len) = (
            round(self.old_len).min(round(self.new_len)),
            round(self.new_len),
        );
        forget(to, to + new_len);
        pending_locked(|p| {
            for &(s, t) in cut.spans() {
                if self.flags & libc::MREMAP_DONTUNMAP != 0 {
                    remember(p, (s, t));
                }
                let (s2, t2) = (s.min(self.old + keep), t.min(self.old + keep));
                if s2 < t2 {
                    let grown = t == old_end && new_len > keep;
                    let end = if grown {
                        to + new_len
                    } else {
                        to + (t2 - self.old)
                    };
                    remember(p, (to + (s2 - self.old), end));
                }
            }
        });
    }
}

/// `mremap` as asked, covered (see [`mremap`]).
fn remap(call: &Remap) -> *mut c_void {
    let &Remap {
        old,
        old_len,
        new_len,
        flags,
        new,
    } = call;
    let (old, new) = (old as *mut c_void, new as *mut c_void);
    // SAFETY: the program asked for exactly this call.
    let raw = || unsafe { sys::raw_mremap(old, old_len, new_len, flags, new) };
    covered(|| {
        // Merged pages are mappings of a store file of their own. Grown, such a mapping would
        // map the file's next pages (not zeros), and the kernel moves or grows one mapping at a
        // time (EFAULT across several), where KSM's merged memory stays one anonymous mapping:
        // registered memory is grown and moved here instead.
        let ours = new_len > old_len
            && flags & libc::MREMAP_DONTUNMAP == 0
            && old as usize % sys::PAGE_SIZE == 0
            && guarded(|| running().is_some_and(|e| e.is_registered(old.cast(), old_len)))
                .unwrap_or(false);
        let p = if ours {
            grow(old as usize, old_len, new_len, flags, new as usize)
        } else {
            raw()
        };
        let spans = p == libc::MAP_FAILED
            && errno() == libc::EFAULT
            && flags & libc::MREMAP_MAYMOVE != 0
            && flags & libc::MREMAP_DONTUNMAP == 0
            && guarded(|| running().is_some_and(|e| e.is_registered(old.cast(), old_len)))
                .unwrap_or(false);
        if !spans {
            return p;
        }
        match remap_pieces(old as usize, old_len, new_len, flags, new as usize) {
            Ok(to) => to as *mut c_void,
            Err(e) => {
                set_errno(&e);
                libc::MAP_FAILED
            }
        }
    })
}

/// Grows registered memory (see [`mremap`]): in place when the addresses after it are free (an
/// anonymous mapping is added there, registered like the rest), else moved piece by piece when
/// the program allows a move. `MAP_FAILED` with the kernel's `errno` otherwise.
fn grow(old: usize, old_len: usize, new_len: usize, flags: c_int, new: usize) -> *mut c_void {
    let old_len = old_len.div_ceil(sys::PAGE_SIZE) * sys::PAGE_SIZE;
    let new_len = new_len.div_ceil(sys::PAGE_SIZE) * sys::PAGE_SIZE;
    if flags & libc::MREMAP_FIXED == 0 {
        let prot = sys::self_mappings()
            .ok()
            .and_then(|m| {
                m.iter()
                    .find(|m| m.start < old + old_len && m.end >= old + old_len)
                    .map(sys::Mapping::prot)
            })
            .unwrap_or(libc::PROT_READ | libc::PROT_WRITE);
        let tail = (old + old_len) as *mut c_void;
        // SAFETY: a new private mapping right after the program's, only where nothing is mapped.
        let p = unsafe {
            sys::raw_mmap(
                tail,
                new_len - old_len,
                prot,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED_NOREPLACE,
                -1,
                0,
            )
        };
        if p == tail {
            guarded(|| {
                if let Some(eng) = running() {
                    let _ = eng.merge(tail.cast(), new_len - old_len);
                }
            });
            return old as *mut c_void;
        }
        if p != libc::MAP_FAILED {
            // An older kernel placed it elsewhere (MAP_FIXED_NOREPLACE unknown): not usable.
            // SAFETY: the mapping just made, nobody else's.
            unsafe { sys::raw_munmap(p, new_len - old_len) };
        }
        if flags & libc::MREMAP_MAYMOVE == 0 {
            // SAFETY: errno is this thread's.
            unsafe { *libc::__errno_location() = libc::ENOMEM };
            return libc::MAP_FAILED;
        }
    }
    match remap_pieces(old, old_len, new_len, flags, new) {
        Ok(to) => to as *mut c_void,
        Err(e) => {
            set_errno(&e);
            libc::MAP_FAILED
        }
    }
}

/// `mremap` of a range that is several mappings (see [`mremap`]): a new range is reserved (at
/// `new` with `MREMAP_FIXED`) with the protection of the last piece, each mapping of the old range
/// is moved onto its place in it (keeping its pages and the engine's registration), and a grown
/// part is registered like the rest. Returns the new address.
fn remap_pieces(
    old: usize,
    old_len: usize,
    new_len: usize,
    flags: c_int,
    new: usize,
) -> std::io::Result<usize> {
    let maps = sys::self_mappings()?;
    let end = old + old_len;
    let pieces: Vec<&sys::Mapping> = maps
        .iter()
        .filter(|m| m.end > old && m.start < end)
        .collect();
    let Some(last) = pieces.last() else {
        return Err(std::io::Error::from_raw_os_error(libc::EFAULT));
    };
    let keep = old_len.min(new_len);
    let fixed = if flags & libc::MREMAP_FIXED != 0 {
        libc::MAP_FIXED
    } else {
        0
    };
    // SAFETY: a new private mapping (at `new` only if the program asked for that address).
    let to = unsafe {
        sys::raw_mmap(
            (if fixed != 0 { new } else { 0 }) as *mut c_void,
            new_len,
            last.prot(),
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | fixed,
            -1,
            0,
        )
    };
    if to == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error());
    }
    let to = to as usize;
    for m in pieces {
        let (s, e) = (m.start.max(old), m.end.min(old + keep));
        if s >= e {
            continue;
        }
        // SAFETY: a whole piece of the program's range moves onto its place in the new one.
        let r = unsafe {
            sys::raw_mremap(
                s as *mut c_void,
                e - s,
                e - s,
                libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED,
                (to + (s - old)) as *mut c_void,
            )
        };
        if r == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
    }
    if new_len < old_len {
        // SAFETY: the rest of the old range, given up by the program.
        unsafe { sys::raw_munmap((old + keep) as *mut c_void, old_len - keep) };
    } else if new_len > old_len {
        guarded(|| {
            if let Some(eng) = running() {
                let _ = eng.merge((to + old_len) as *mut u8, new_len - old_len);
            }
        });
    }
    Ok(to)
}

/// Forwards a system call that changes the locking of mappings, covered (see the crate doc).
fn covered_syscall(nr: libc::c_long, a: usize, b: usize, c: usize) -> c_int {
    // SAFETY: the program asked for exactly this call (its arguments are passed on unchanged).
    covered(|| unsafe { libc::syscall(nr, a, b, c) as c_int })
}

/// `mlock(2)`: a change of mappings (see the crate doc).
///
/// # Safety
/// As `mlock(2)`.
#[no_mangle]
pub unsafe extern "C" fn mlock(addr: *const c_void, len: size_t) -> c_int {
    locking_done(
        covered_syscall(libc::SYS_mlock, addr as usize, len, 0),
        addr,
        len,
        true,
    )
}

/// `mlock2(2)`: a change of mappings (see the crate doc).
///
/// # Safety
/// As `mlock2(2)`.
#[no_mangle]
pub unsafe extern "C" fn mlock2(addr: *const c_void, len: size_t, flags: libc::c_uint) -> c_int {
    let r = covered_syscall(libc::SYS_mlock2, addr as usize, len, flags as usize);
    locking_done(r, addr, len, true)
}

/// `munlock(2)`: a change of mappings (see the crate doc).
///
/// # Safety
/// As `munlock(2)`.
#[no_mangle]
pub unsafe extern "C" fn munlock(addr: *const c_void, len: size_t) -> c_int {
    locking_done(
        covered_syscall(libc::SYS_munlock, addr as usize, len, 0),
        addr,
        len,
        false,
    )
}

/// After `mlock`/`munlock` returned `r`: if it succeeded, the engine locks what it maps over
/// registered pages there from now on, or not (see `Engine::locking_changed`). Returns `r`.
fn locking_done(r: c_int, addr: *const c_void, len: size_t, locked: bool) -> c_int {
    if r == 0 {
        guarded(|| running().map(|eng| eng.locking_changed(addr as *mut u8, len, locked)));
    }
    r
}

/// `mlockall(2)`: a change of mappings (see the crate doc).
///
/// # Safety
/// As `mlockall(2)`.
#[no_mangle]
pub unsafe extern "C" fn mlockall(flags: c_int) -> c_int {
    let valid = flags & !(libc::MCL_CURRENT | libc::MCL_FUTURE | libc::MCL_ONFAULT) == 0
        && flags & (libc::MCL_CURRENT | libc::MCL_FUTURE) != 0;
    if valid && flags & libc::MCL_CURRENT != 0 {
        // The kernel's `MCL_CURRENT` would fill the engine's views of its store (as large as the
        // memory) and undo every merge: the engine locks the mappings one by one instead (see
        // `Engine::lock_current`). Under a limit on locked memory the kernel refuses before
        // filling anything, and answers as before.
        let by_engine = covered(|| {
            guarded(|| {
                running()
                    .filter(|_| sys::may_lock_without_limit())
                    .map(|eng| lock_all_but_the_engine(eng, flags))
            })
            .flatten()
        });
        if let Some(r) = by_engine {
            return r;
        }
    }
    let r = covered_syscall(libc::SYS_mlockall, flags as usize, 0, 0);
    if flags & libc::MCL_CURRENT != 0 {
        locking_done(r, std::ptr::null(), usize::MAX, true);
    }
    r
}

/// `mlockall(flags)` (with `MCL_CURRENT`) with the engine's memory left out: the kernel sets
/// what future mappings get (`MCL_FUTURE`, or nothing: `MCL_CURRENT` alone clears it, as
/// `munlockall` does), the engine locks the current mappings. Returns what `mlockall` returns.
fn lock_all_but_the_engine(eng: &Engine, flags: c_int) -> c_int {
    // SAFETY: the calls the program asked for, in part: they change no contents.
    let r = unsafe {
        if flags & libc::MCL_FUTURE != 0 {
            libc::syscall(libc::SYS_mlockall, flags & !libc::MCL_CURRENT)
        } else {
            libc::syscall(libc::SYS_munlockall)
        }
    };
    if r != 0 {
        return -1;
    }
    if flags & libc::MCL_FUTURE == 0 {
        eng.unlocked_all();
    }
    match eng.lock_current(flags & libc::MCL_ONFAULT != 0) {
        Ok(()) => 0,
        Err(_) => set_errno(&std::io::Error::from_raw_os_error(libc::ENOMEM)),
    }
}

/// `munlockall(2)`: a change of mappings (see the crate doc).
///
/// # Safety
/// As `munlockall(2)`.
#[no_mangle]
pub unsafe extern "C" fn munlockall() -> c_int {
    let r = covered_syscall(libc::SYS_munlockall, 0, 0, 0);
    if r == 0 {
        // The engine's locked area was unlocked with the rest: it is locked again.
        guarded(|| running().map(Engine::unlocked_all));
    }
    r
}

/// `ioctl(2)`: a userfaultfd registration of mergeable memory by the program takes that range
/// from the engine first (see the crate doc); everything else goes straight to the kernel.
/// (Variadic in C: the third argument is read as one word, which the x86-64 convention allows.)
///
/// # Safety
/// As `ioctl(2)`.
#[no_mangle]
pub unsafe extern "C" fn ioctl(fd: c_int, request: c_ulong, arg: usize) -> c_int {
    if request == UFFDIO_REGISTER && arg != 0 {
        guarded(|| {
            let Some(eng) = running() else { return };
            // SAFETY: the program passes a `struct uffdio_register`, whose range comes first.
            let range = unsafe { std::ptr::read_unaligned(arg as *const [u64; 2]) };
            let _ = eng.unregister(range[0] as *mut u8, range[1] as usize);
        });
    }
    // SAFETY: the program asked for exactly this call.
    unsafe { libc::syscall(libc::SYS_ioctl, fd, request, arg) as c_int }
}
