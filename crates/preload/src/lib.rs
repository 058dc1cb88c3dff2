//! `libpageone_preload.so`: an `LD_PRELOAD` shim that answers `madvise(MADV_MERGEABLE)` and
//! `prctl(PR_SET_MEMORY_MERGE)` with pageone instead of KSM, so unmodified programs (QEMU with
//! `-machine mem-merge=on`) get it.
//!
//! # Design
//!
//! * **Interposed calls.** `madvise`, `prctl`, and the calls that change registered memory behind
//!   the engine's back: `mmap` (`MAP_FIXED` over it), `munmap`, `mremap`, `mprotect`. Every other
//!   advice or option goes straight to the kernel through a raw system call, with no lock and no
//!   allocation, so the pass-through path is safe during early start-up and in any thread.
//! * **Merge.** `MADV_MERGEABLE` starts one engine per process on first use (joining
//!   `$PAGEONE_SOCKET`'s daemon when set) and registers the range; `MADV_UNMERGEABLE` unregisters
//!   it. If the engine cannot start or refuses the range, the call goes to the kernel (KSM
//!   semantics), once logged with the reason: the program's behaviour never depends on pageone.
//! * **Memory the engine must know about.** Merged pages are private mappings of a store file, so
//!   `MADV_DONTNEED`/`FREE`/`REMOVE` on them would read back the copy, not zeros; and a range
//!   unmapped, moved, re-protected or replaced while registered would be frozen and merged without
//!   the engine's write tracking. For all of these the shim unregisters the overlapping regions
//!   first (their pages become ordinary anonymous memory with the same contents), lets the kernel
//!   act, then registers again what is still private anonymous read/write memory.
//! * **`PR_SET_MEMORY_MERGE`** registers the process's private anonymous read/write mappings
//!   larger than 64 MiB other than `[heap]` and `[stack]`, now and as the program maps more (through
//!   the interposed `mmap`). The size bound keeps glibc's malloc arenas (at most 64 MiB each) and the
//!   engine's own memory out: the engine must never freeze memory it uses itself.
//! * **Re-entrancy and fork.** A thread-local flag passes through calls made while the shim is
//!   working (the engine reaches the kernel with raw system calls anyway). After `fork`, the child
//!   has no engine threads: it passes everything to the kernel.

use pageone_sync::lock;
use std::cell::Cell;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};

use libc::{c_int, c_ulong, c_void, size_t};
use pageone_engine::Engine;
use pageone_sys as sys;

const PR_SET_MEMORY_MERGE: c_int = 67;
const PR_GET_MEMORY_MERGE: c_int = 68;
const MADV_DONTNEED_LOCKED: c_int = 24;
/// `PR_SET_MEMORY_MERGE` registers mappings larger than this (see the crate doc).
const MERGE_ALL_MIN: usize = 64 << 20;

thread_local! {
    static INSIDE: Cell<bool> = const { Cell::new(false) };
}

struct Shim {
    engine: Engine,
    /// Registered regions: start -> end.
    regions: Mutex<BTreeMap<usize, usize>>,
}

/// `None` once the engine failed to start (then every call goes to the kernel).
static SHIM: OnceLock<Option<Shim>> = OnceLock::new();
/// Registered regions exist (checked without a lock on the hot paths).
static ACTIVE: AtomicUsize = AtomicUsize::new(0);
/// `PR_SET_MEMORY_MERGE` is on.
static MERGE_ALL: AtomicBool = AtomicBool::new(false);
/// Set in a child after `fork`: no engine runs there.
static CHILD: AtomicBool = AtomicBool::new(false);

extern "C" fn in_child() {
    // Relaxed: the child is single-threaded at this point.
    CHILD.store(true, Ordering::Relaxed);
}

fn log(msg: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "pageone: {msg}");
}

fn shim() -> Option<&'static Shim> {
    SHIM.get_or_init(|| {
        if sys::on_fork_child(in_child).is_err() {
            log("cannot watch fork(); not starting (the kernel's KSM answers instead)");
            return None;
        }
        match builder().build() {
            Ok(engine) => Some(Shim {
                engine,
                regions: Mutex::new(BTreeMap::new()),
            }),
            Err(e) => {
                log(&format!(
                    "the engine could not start ({e}); the kernel's KSM answers instead"
                ));
                None
            }
        }
    })
    .as_ref()
}

/// The engine's settings: the defaults, with the merge period from `PAGEONE_MERGE_PERIOD_MS`
/// (ignored, like every `PAGEONE_*` variable, in set-user-ID and similar secure-execution
/// programs).
fn builder() -> pageone_engine::Builder {
    let b = Engine::builder();
    // SAFETY: getauxval only reads the auxiliary vector.
    if unsafe { libc::getauxval(libc::AT_SECURE) } != 0 {
        return b;
    }
    let Ok(text) = std::env::var("PAGEONE_MERGE_PERIOD_MS") else {
        return b;
    };
    match text.trim().parse::<u64>() {
        Ok(ms) if ms > 0 => b.merge_period(std::time::Duration::from_millis(ms)),
        _ => {
            log(&format!(
                "PAGEONE_MERGE_PERIOD_MS={text} is not a positive number of milliseconds; \
                 using the default"
            ));
            b
        }
    }
}

/// Runs `f` with the re-entrancy flag set and panics contained; `None` if the shim must not act
/// (re-entered, in a forked child, or `f` panicked).
fn guarded<T>(f: impl FnOnce() -> T) -> Option<T> {
    // Relaxed: see in_child.
    if INSIDE.get() || CHILD.load(Ordering::Relaxed) {
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

/// Unregisters every region overlapping `[start, end)`; returns them.
fn take_overlapping(s: &Shim, start: usize, end: usize) -> Vec<(usize, usize)> {
    let mut regions = lock(&s.regions);
    let hit: Vec<(usize, usize)> = regions
        .range(..end)
        .filter(|(_, &e)| e > start)
        .map(|(&a, &e)| (a, e))
        .collect();
    for &(a, e) in &hit {
        regions.remove(&a);
        if let Err(err) = s.engine.unregister(a as *mut u8, e - a) {
            log(&format!("could not unregister {a:#x}+{:#x}: {err}", e - a));
        }
    }
    ACTIVE.store(regions.len(), Ordering::Relaxed);
    hit
}

/// Registers `[start, end)` if it is private anonymous read/write memory now.
fn register(s: &Shim, start: usize, end: usize) -> bool {
    if end <= start {
        return false;
    }
    match s.engine.register(start as *mut u8, end - start) {
        Ok(()) => {
            // Merging works on 4 KiB pages: a huge page that is partly merged or released keeps
            // all its memory until the kernel splits it under memory pressure, so registered
            // memory gets no new huge pages (KSM splits them too).
            // SAFETY: MADV_NOHUGEPAGE changes no contents.
            let _ = unsafe { sys::madvise(start as *mut u8, end - start, libc::MADV_NOHUGEPAGE) };
            let mut regions = lock(&s.regions);
            regions.insert(start, end);
            ACTIVE.store(regions.len(), Ordering::Relaxed);
            true
        }
        Err(_) => false,
    }
}

/// Registers the parts of `taken` outside `[start, end)` again.
fn register_rest(s: &Shim, taken: &[(usize, usize)], start: usize, end: usize) {
    for &(a, e) in taken {
        register(s, a, e.min(start));
        register(s, a.max(end), e);
    }
}

/// Around a call that changes `[start, end)`: unregister what overlaps, call, register what is
/// left outside the range (and, with `again`, inside it too).
fn around<T>(start: usize, end: usize, again: bool, call: impl FnOnce() -> T) -> T {
    // Relaxed: a hint; the map under its lock is the truth.
    if ACTIVE.load(Ordering::Relaxed) == 0 {
        return call();
    }
    let Some(Some(s)) = guarded(|| SHIM.get().and_then(|o| o.as_ref())) else {
        return call();
    };
    let taken = guarded(|| take_overlapping(s, start, end)).unwrap_or_default();
    let r = call();
    guarded(|| {
        if again {
            for &(a, e) in &taken {
                register(s, a, e);
            }
        } else {
            register_rest(s, &taken, start, end);
        }
    });
    r
}

/// `madvise(2)`, answering `MADV_MERGEABLE`/`MADV_UNMERGEABLE` with pageone.
///
/// # Safety
/// As `madvise(2)`.
#[no_mangle]
pub unsafe extern "C" fn madvise(addr: *mut c_void, len: size_t, advice: c_int) -> c_int {
    match advice {
        libc::MADV_MERGEABLE | libc::MADV_UNMERGEABLE => {}
        libc::MADV_DONTNEED | libc::MADV_FREE | libc::MADV_REMOVE | MADV_DONTNEED_LOCKED => {
            let Some((a, e)) = page_range(addr, len) else {
                return raw_madvise(addr, len, advice);
            };
            return around(a, e, true, || raw_madvise(addr, len, advice));
        }
        libc::MADV_HUGEPAGE => {
            // Registered memory stays on small pages (see register); elsewhere, as asked.
            if let Some((a, e)) = page_range(addr, len) {
                // Relaxed: a hint; the map under its lock is the truth.
                let covered = ACTIVE.load(Ordering::Relaxed) > 0
                    && guarded(|| {
                        SHIM.get()
                            .and_then(|o| o.as_ref())
                            .is_some_and(|s| lock(&s.regions).range(..e).any(|(_, &re)| re > a))
                    })
                    .unwrap_or(false);
                if covered {
                    return 0;
                }
            }
            return raw_madvise(addr, len, advice);
        }
        _ => return raw_madvise(addr, len, advice),
    }
    let Some((a, e)) = page_range(addr, len) else {
        return raw_madvise(addr, len, advice);
    };
    let done = guarded(|| {
        let s = shim()?;
        if advice == libc::MADV_UNMERGEABLE {
            let taken = take_overlapping(s, a, e);
            register_rest(s, &taken, a, e);
            // The kernel's flag may be set too (an earlier fallback): clear it as well. Its answer
            // is the kernel's verdict on the range (ENOMEM where part of it is not mapped).
            return Some(raw_madvise(addr, len, advice));
        }
        if lock(&s.regions).get(&a) == Some(&e) {
            return Some(0);
        }
        // Merge with the regions it overlaps into one.
        let taken = take_overlapping(s, a, e);
        let lo = taken.iter().map(|t| t.0).fold(a, usize::min);
        let hi = taken.iter().map(|t| t.1).fold(e, usize::max);
        if register(s, lo, hi) {
            return Some(0);
        }
        for &(ta, te) in &taken {
            register(s, ta, te);
        }
        None
    });
    match done {
        Some(Some(r)) => r,
        // Not ours to answer (no engine, not anonymous memory, re-entered): the kernel's KSM.
        _ => raw_madvise(addr, len, advice),
    }
}

/// Registers the eligible mappings (see the crate doc) that are not registered yet.
fn merge_all(s: &Shim) {
    let Ok(maps) = sys::self_mappings() else {
        return;
    };
    for m in maps {
        let eligible = m.is_private_anonymous_rw()
            && m.path.is_empty()
            && m.end - m.start > MERGE_ALL_MIN
            && !lock(&s.regions).contains_key(&m.start);
        if eligible {
            let taken = take_overlapping(s, m.start, m.end);
            if !register(s, m.start, m.end) {
                for (a, e) in taken {
                    register(s, a, e);
                }
            }
        }
    }
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
                let s = shim()?;
                // Relaxed: a mode flag read by later mmap calls; no data is published with it.
                MERGE_ALL.store(on, Ordering::Relaxed);
                if on {
                    merge_all(s);
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

/// `mmap(2)`: a fixed mapping over registered memory unregisters it first; with
/// `PR_SET_MEMORY_MERGE`, large private anonymous mappings are registered.
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
    let p = match page_range(addr, len) {
        Some((a, e)) if flags & (libc::MAP_FIXED | libc::MAP_FIXED_NOREPLACE) != 0 => {
            around(a, e, false, || raw_mmap(addr, len, prot, flags, fd, off))
        }
        _ => raw_mmap(addr, len, prot, flags, fd, off),
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
            if let Some(s) = shim() {
                let a = p as usize;
                register(s, a, a + len.div_ceil(sys::PAGE_SIZE) * sys::PAGE_SIZE);
            }
        });
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

/// `munmap(2)`: registered memory is unregistered first.
///
/// # Safety
/// As `munmap(2)`.
#[no_mangle]
pub unsafe extern "C" fn munmap(addr: *mut c_void, len: size_t) -> c_int {
    // SAFETY: the program asked for exactly this call.
    let raw = || unsafe { sys::raw_munmap(addr, len) };
    match page_range(addr, len) {
        Some((a, e)) => around(a, e, false, raw),
        None => raw(),
    }
}

/// `mprotect(2)`: registered memory is unregistered first (merged pages are mappings the engine
/// made, with the protections it gave them).
///
/// # Safety
/// As `mprotect(2)`.
#[no_mangle]
pub unsafe extern "C" fn mprotect(addr: *mut c_void, len: size_t, prot: c_int) -> c_int {
    // SAFETY: the program asked for exactly this call.
    let raw = || unsafe { sys::raw_mprotect(addr, len, prot) };
    match page_range(addr, len) {
        Some((a, e)) => around(a, e, true, raw),
        None => raw(),
    }
}

/// `mremap(2)`: registered memory is unregistered first. (Variadic in C; the optional fifth
/// argument is read as passed, which the x86-64 convention allows.)
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
    // SAFETY: the program asked for exactly this call.
    let raw = || unsafe { sys::raw_mremap(old, old_len, new_len, flags, new) };
    let Some((a, e)) = page_range(old, old_len) else {
        return raw();
    };
    // Also a fixed destination that overlaps registered memory.
    let dest = (flags & libc::MREMAP_FIXED != 0)
        .then(|| page_range(new, new_len))
        .flatten();
    match dest {
        Some((da, de)) => around(da, de, false, || around(a, e, false, raw)),
        None => around(a, e, false, raw),
    }
}
