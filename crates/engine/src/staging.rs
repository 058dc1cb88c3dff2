//! Copies are mapped over a program's pages already registered with the store mappings'
//! userfaultfd: they are moved there with one `mremap` from a mapping the engine registered
//! beforehand, at an address only it knows.
//!
//! Mapped in place and registered after, a page the program dropped between the two calls (a raw
//! `madvise`, of which nothing is reported while the mapping is not registered) would read its
//! copy again once the engine maps the copies' page table entries. Moved into place registered,
//! every drop there is reported, and reads zeros (see the `unfilled` module).
//!
//! The copies come from the staging area: a private mapping of the whole store file,
//! registered once, which the copies leave without being unmapped (`MREMAP_DONTUNMAP`), so that
//! it maps every copy still for the next move. Where it cannot be made (read-only copies, a limit
//! on the address space), each move stages its copies in a mapping of their own, registered, then
//! unregistered and unmapped once they are moved.
//!
//! The kernel holds the `mremap` until the fault thread has read its report (the store mappings'
//! context asks for `UFFD_FEATURE_EVENT_REMAP`, without which a move unregisters the mapping):
//! one more round trip to that thread per mapping. The report is the engine's own, announced
//! beforehand like the unmapping of the pages it replaces.

use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use pageone_index::KeyId;
use pageone_sync::lock;
use pageone_sys as sys;

use crate::access::PAGE;
use crate::changes::Change;
use crate::freeze::STORE_MODE;
use crate::state::Shared;
use crate::store::StoreFile;

/// Copies `sid..sid + m` of the store `file`, to map privately with protection `prot`.
#[derive(Clone, Copy)]
pub(crate) struct Copies<'a> {
    pub(crate) file: &'a Arc<StoreFile>,
    pub(crate) sid: KeyId,
    pub(crate) m: usize,
    pub(crate) prot: libc::c_int,
}

impl Copies<'_> {
    fn len(&self) -> usize {
        self.m * PAGE
    }

    fn offset(&self) -> usize {
        self.sid as usize * PAGE
    }
}

/// Maps `copies` over the pages at `addr`, registered with the store mappings' userfaultfd from
/// the moment the program can see them (see the module documentation), where that context
/// exists. Returns whether the mapping is registered. On an error, the pages at `addr` are as
/// they were.
///
/// # Safety
/// The pages at `addr` are held still and equal their copies, so replacing the mapping discards
/// nothing; the unmapping of the pages there is announced (`ChangeLog::expect_merge`), and
/// `since` is that announcement's mark.
pub(crate) unsafe fn map_copies_registered(
    sh: &Shared,
    addr: usize,
    copies: Copies<'_>,
    since: u64,
) -> io::Result<bool> {
    let Some(u) = &sh.store_uffd else {
        // SAFETY: the caller's contract.
        unsafe { map_in_place(addr, copies) }?;
        return Ok(false);
    };
    let from_area = (copies.prot == libc::PROT_READ | libc::PROT_WRITE)
        .then(|| sh.staging.at(copies.file))
        .flatten();
    let staged = match from_area {
        Some((area, held)) => Staged::InArea {
            at: area + copies.offset(),
            _held: held,
        },
        None => Staged::map(sh, copies)?,
    };
    if let Staged::Own { addr: at, .. } = staged {
        if u.register(at, copies.len(), STORE_MODE).is_err() {
            drop(staged);
            // SAFETY: the caller's contract.
            unsafe { map_in_place(addr, copies) }?;
            return Ok(register_in_place(sh, addr, copies.len()));
        }
    }
    // SAFETY: the staged copies are the engine's, which nothing refers to; the destination is
    // the caller's to replace (this function's contract).
    let r = unsafe { move_into_place(sh, &staged, copies.len(), addr, since) };
    drop(staged);
    match r {
        Ok(()) => Ok(true),
        // SAFETY: the caller's contract.
        Err(e) => unsafe { map_after_failed_move(sh, addr, copies, e) },
    }
}

/// Whether the kernel moves a mapping of a file leaving its old place mapped
/// (`MREMAP_DONTUNMAP`), until it refuses once. (Relaxed: a hint, read and written alone; it
/// orders nothing else.)
static KEEPING_WORKS: AtomicBool = AtomicBool::new(true);

/// Moves the `len` bytes of `staged` copies over the pages at `addr`, announcing the move (see
/// [`map_copies_registered`] for `since`). The place they leave stays mapped, empty, where the
/// kernel allows: its unmapping is then not reported (one round trip to the fault thread fewer).
/// Where it does not, copies staged on their own are moved all the same, and copies in the area
/// are not (the area is then given up: see [`StagingArea::at`]).
///
/// # Safety
/// As [`map_copies_registered`], and the staged copies are the engine's, which nothing refers
/// to.
unsafe fn move_into_place(
    sh: &Shared,
    staged: &Staged<'_>,
    len: usize,
    addr: usize,
    since: u64,
) -> io::Result<()> {
    let from = staged.addr();
    let moved = Change::Remap {
        from,
        to: addr,
        len,
    };
    let left = Change::Unmap {
        start: from,
        end: from + len,
    };
    lock(&sh.changes).expect_merge(moved, since);
    let mut r = Err(io::Error::from_raw_os_error(libc::EINVAL));
    if KEEPING_WORKS.load(Ordering::Relaxed) {
        // SAFETY: the caller's contract.
        r = unsafe { sys::mremap_fixed_keeping(from as *mut u8, len, addr as *mut u8) };
        if matches!(&r, Err(e) if e.raw_os_error() == Some(libc::EINVAL)) {
            KEEPING_WORKS.store(false, Ordering::Relaxed);
            tracing::info!("the kernel does not keep a moved mapping of a file in place; copies are staged one mapping at a time");
        }
    }
    if !KEEPING_WORKS.load(Ordering::Relaxed) && matches!(staged, Staged::Own { .. }) {
        lock(&sh.changes).expect(left);
        // SAFETY: the caller's contract.
        r = unsafe { sys::mremap_fixed(from as *mut u8, len, addr as *mut u8) };
    }
    // The kernel waits for each report to be read before it returns, and the fault thread
    // records what it reads before it lets go of the log: an announcement still there had no
    // report.
    let mut log = lock(&sh.changes);
    log.unexpect(moved);
    log.unexpect(left);
    r
}

/// After a failed move: if the kernel unmapped the destination before it failed (it does that
/// first), the copies are mapped there directly, as the pages equal them; otherwise the pages
/// are as they were, and the error is returned.
///
/// # Safety
/// As [`map_copies_registered`].
unsafe fn map_after_failed_move(
    sh: &Shared,
    addr: usize,
    copies: Copies<'_>,
    e: io::Error,
) -> io::Result<bool> {
    let (len, fd, off) = (copies.len(), copies.file.fd(), copies.offset() as u64);
    match sys::mmap_private_where_free(addr, len, fd, off, copies.prot) {
        Ok(()) => {
            tracing::warn!(error = %e, "moving copies into place failed after their destination was unmapped; mapped them there directly");
            Ok(register_in_place(sh, addr, len))
        }
        Err(_) => {
            // Still mapped: the unmapping announced did not happen.
            lock(&sh.changes).unexpect(Change::Unmap {
                start: addr,
                end: addr + len,
            });
            Err(e)
        }
    }
}

/// Registers copies mapped in place at `addr` (the fallbacks: a drop before this is not
/// reported); returns whether they are.
fn register_in_place(sh: &Shared, addr: usize, len: usize) -> bool {
    sh.store_uffd
        .as_ref()
        .is_some_and(|u| u.register(addr, len, STORE_MODE).is_ok())
}

/// Maps `copies` over the pages at `addr` in one `mmap(MAP_FIXED)`.
///
/// # Safety
/// As [`map_copies_registered`].
unsafe fn map_in_place(addr: usize, copies: Copies<'_>) -> io::Result<()> {
    let (len, fd, off) = (copies.len(), copies.file.fd(), copies.offset() as u64);
    // SAFETY: the caller's contract.
    unsafe { sys::mmap_private_fixed_with(addr as *mut u8, len, fd, off, copies.prot) }
}

/// Copies staged to be moved into place.
enum Staged<'a> {
    /// In the staging area, at `at`; the area is not released meanwhile.
    InArea {
        at: usize,
        _held: MutexGuard<'a, Option<Area>>,
    },
    /// In a mapping of their own, unregistered and unmapped when dropped.
    Own {
        sh: &'a Shared,
        addr: usize,
        len: usize,
    },
}

impl<'a> Staged<'a> {
    fn map(sh: &'a Shared, copies: Copies<'_>) -> io::Result<Self> {
        let (len, fd, off) = (copies.len(), copies.file.fd(), copies.offset() as u64);
        let p = sys::mmap_private(fd, len, off, copies.prot)?;
        Ok(Staged::Own {
            sh,
            addr: p as usize,
            len,
        })
    }

    fn addr(&self) -> usize {
        match *self {
            Staged::InArea { at: a, .. } | Staged::Own { addr: a, .. } => a,
        }
    }
}

impl Drop for Staged<'_> {
    fn drop(&mut self) {
        if let Staged::Own { sh, addr, len } = *self {
            unmap_unreported(sh, addr, len);
        }
    }
}

/// Unmaps `[addr, addr+len)`, a mapping of the engine's that may be registered with the store
/// mappings' context: unregistered first, so that its unmapping is not reported (or announced,
/// if it cannot be).
fn unmap_unreported(sh: &Shared, addr: usize, len: usize) {
    let unregistered = sh
        .store_uffd
        .as_ref()
        .is_none_or(|u| u.unregister(addr, len).is_ok());
    let gone = Change::Unmap {
        start: addr,
        end: addr + len,
    };
    if !unregistered {
        lock(&sh.changes).expect(gone);
    }
    // SAFETY: the mapping is the engine's alone; nothing refers to it.
    let _ = unsafe { sys::munmap(addr as *mut u8, len) };
    if !unregistered {
        lock(&sh.changes).unexpect(gone);
    }
}

/// The staging area: a private read/write mapping of a whole store file, registered with the
/// store mappings' context. Used by the committer alone.
///
/// It is made inaccessible and unlocked before it is given read and write access: a process
/// that locks its future mappings (`mlockall(MCL_FUTURE)`) would otherwise have the whole store
/// copied into it privately, as large as the memory (found so: the program was killed for
/// memory).
///
/// A mapping moved out of it keeps its flags: so the area is inherited by children like any
/// mapping (merged pages must be), and it charges no commit (`MAP_NORESERVE`), nor then do merged
/// pages. That only matters under strict overcommit (`vm.overcommit_memory=2`), where the area
/// is not used.
#[derive(Default)]
pub(crate) struct StagingArea(Mutex<Option<Area>>);

struct Area {
    file: Arc<StoreFile>,
    /// 0: it could not be made.
    addr: usize,
}

impl StagingArea {
    /// Makes the staging area of `file` if there is none (one for another file goes). Called
    /// before a commit freezes anything: it maps, registers, and reads a setting.
    pub(crate) fn prepare(&self, sh: &Shared, file: &Arc<StoreFile>) {
        let mut area = lock(&self.0);
        if area.as_ref().is_some_and(|a| Arc::ptr_eq(&a.file, file)) {
            return;
        }
        if let Some(old) = area.take() {
            release_area(sh, old);
        }
        // (One that could not be made is not tried again for the same file.)
        *area = Some(Area {
            file: file.clone(),
            addr: make_area(sh, file).unwrap_or(0),
        });
    }

    /// The address of the staging area of `file`, if it has one (and the kernel keeps the place
    /// of a mapping moved out of it), and the area held until the copies are moved out of it.
    fn at(&self, file: &Arc<StoreFile>) -> Option<(usize, MutexGuard<'_, Option<Area>>)> {
        if !KEEPING_WORKS.load(Ordering::Relaxed) {
            return None;
        }
        let area = lock(&self.0);
        let a = area.as_ref().filter(|a| Arc::ptr_eq(&a.file, file))?;
        let addr = a.addr;
        (addr != 0).then_some((addr, area))
    }

    /// Unmaps the staging area, if any: when the engine stops, and when its store is replaced
    /// (the area would keep the old file mapped; the next commit makes one of the new). Waits
    /// for a move out of it under way.
    pub(crate) fn release(&self, sh: &Shared) {
        if let Some(old) = lock(&self.0).take() {
            release_area(sh, old);
        }
    }
}

/// Maps and registers the staging area of `file`; `None` if any step fails (then nothing is
/// left of it).
fn make_area(sh: &Shared, file: &Arc<StoreFile>) -> Option<usize> {
    let u = sh.store_uffd.as_ref()?;
    // Under strict overcommit, copies mapped from the area would charge nothing (see
    // [`StagingArea`]): each is staged on its own, charged as mapped.
    if sys::overcommit_is_strict() {
        return None;
    }
    let len = file.len();
    let p = sys::mmap_private_unreserved(file.fd(), len).ok()?;
    let addr = p as usize;
    if u.register(addr, len, STORE_MODE).is_err() {
        unmap_unreported(sh, addr, len);
        return None;
    }
    // Relaxed: see `Store::release_held`.
    file.staging_at.store(addr, Ordering::Relaxed);
    Some(addr)
}

fn release_area(sh: &Shared, area: Area) {
    if area.addr != 0 {
        area.file.staging_at.store(0, Ordering::Relaxed);
        unmap_unreported(sh, area.addr, area.file.len());
    }
}
