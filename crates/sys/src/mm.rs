//! Memory mappings of this process: `mmap`, `munmap`, `mremap`, `mprotect` and `madvise`, the
//! page size, and the C heap's own trimming.
//!
//! Memory-map calls are raw system calls: an `LD_PRELOAD` shim interposes the C library's
//! `mmap`/`munmap`/`mremap` to see the program's own mappings, and the engine's calls must neither
//! reach it nor be mistaken for the program's.

use std::io;
use std::os::fd::RawFd;

use crate::cvt;

/// The base page size, 4096 on every platform pageone supports (checked in [`page_size`]).
pub const PAGE_SIZE: usize = 4096;

/// Returns the kernel's base page size.
pub fn page_size() -> usize {
    // SAFETY: sysconf has no memory-safety preconditions.
    let v = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if v <= 0 {
        PAGE_SIZE
    } else {
        v as usize
    }
}

/// `mmap(2)` as a raw system call; returns `MAP_FAILED` with `errno` set on error.
///
/// # Safety
/// As `mmap(2)`: a fixed mapping replaces whatever was mapped there.
pub unsafe fn raw_mmap(
    addr: *mut libc::c_void,
    len: usize,
    prot: libc::c_int,
    flags: libc::c_int,
    fd: RawFd,
    off: libc::off_t,
) -> *mut libc::c_void {
    // SAFETY: forwarded to the caller's contract.
    let r = unsafe { libc::syscall(libc::SYS_mmap, addr, len, prot, flags, fd, off) };
    if r == -1 {
        libc::MAP_FAILED
    } else {
        r as *mut libc::c_void
    }
}

/// `munmap(2)` as a raw system call.
///
/// # Safety
/// As `munmap(2)`.
pub unsafe fn raw_munmap(addr: *mut libc::c_void, len: usize) -> libc::c_int {
    // SAFETY: forwarded to the caller's contract.
    unsafe { libc::syscall(libc::SYS_munmap, addr, len) as libc::c_int }
}

/// `mprotect(2)` as a raw system call.
///
/// # Safety
/// As `mprotect(2)`: no live Rust reference may rely on the old protections.
pub unsafe fn raw_mprotect(addr: *mut libc::c_void, len: usize, prot: libc::c_int) -> libc::c_int {
    // SAFETY: forwarded to the caller's contract.
    unsafe { libc::syscall(libc::SYS_mprotect, addr, len, prot) as libc::c_int }
}

/// `mremap(2)` as a raw system call; returns `MAP_FAILED` with `errno` set on error.
///
/// # Safety
/// As `mremap(2)`.
pub unsafe fn raw_mremap(
    old: *mut libc::c_void,
    old_len: usize,
    new_len: usize,
    flags: libc::c_int,
    new: *mut libc::c_void,
) -> *mut libc::c_void {
    // SAFETY: forwarded to the caller's contract.
    let r = unsafe { libc::syscall(libc::SYS_mremap, old, old_len, new_len, flags, new) };
    if r == -1 {
        libc::MAP_FAILED
    } else {
        r as *mut libc::c_void
    }
}

/// `mmap(2)` at `addr` (as `flags` say: a hint, fixed, or fixed unless taken), or the error.
///
/// # Safety
/// As `mmap(2)`: a fixed mapping replaces whatever was mapped there.
unsafe fn mmap_at(
    addr: *mut u8,
    len: usize,
    prot: libc::c_int,
    flags: libc::c_int,
    fd: RawFd,
    offset: u64,
) -> io::Result<*mut u8> {
    // SAFETY: forwarded to the caller's contract.
    let p = unsafe { raw_mmap(addr.cast(), len, prot, flags, fd, offset as libc::off_t) };
    if p == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    Ok(p.cast())
}

/// A mapping of `len` bytes (`mmap(2)`'s other arguments) at an address the kernel picks.
fn mmap_anywhere(
    len: usize,
    prot: libc::c_int,
    flags: libc::c_int,
    fd: RawFd,
    offset: u64,
) -> io::Result<*mut u8> {
    // SAFETY: a non-fixed mapping cannot alias existing memory.
    unsafe { mmap_at(std::ptr::null_mut(), len, prot, flags, fd, offset) }
}

/// [`mmap_anywhere`] with nothing populated, whatever the process asked for its future mappings:
/// mapped inaccessible, unlocked, then given `prot`. (After `mlockall(MCL_FUTURE)`, a mapping
/// is locked as it is made, which fills it in full: for the engine's views of a store, as large
/// as the memory, every page of the file, or a private copy of each.)
fn mmap_anywhere_unpopulated(
    len: usize,
    prot: libc::c_int,
    flags: libc::c_int,
    fd: RawFd,
    offset: u64,
) -> io::Result<*mut u8> {
    let p = mmap_anywhere(len, libc::PROT_NONE, flags, fd, offset)?;
    // SAFETY: the fresh mapping is the caller's alone; unlocking and protecting it change no
    // contents (it holds none yet).
    let ready = unsafe {
        libc::syscall(libc::SYS_munlock, p, len) == 0 && raw_mprotect(p.cast(), len, prot) == 0
    };
    if !ready {
        let e = io::Error::last_os_error();
        // SAFETY: as above; nothing refers to it.
        unsafe { raw_munmap(p.cast(), len) };
        return Err(e);
    }
    Ok(p)
}

const RW: libc::c_int = libc::PROT_READ | libc::PROT_WRITE;

/// Maps `len` bytes of fresh private anonymous memory (read/write) anywhere.
pub fn mmap_anonymous(len: usize) -> io::Result<*mut u8> {
    let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE;
    mmap_anywhere(len, RW, flags, -1, 0)
}

/// [`mmap_anonymous`], never populated nor locked whatever the process asked for its future
/// mappings (the engine's scratch memory: `UFFDIO_MOVE` moves pages only into empty places).
pub fn mmap_anonymous_unlocked(len: usize) -> io::Result<*mut u8> {
    let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE;
    mmap_anywhere_unpopulated(len, RW, flags, -1, 0)
}

/// Maps `len` bytes of `fd` at `offset` shared and read/write anywhere (the engine's view of its
/// stable store), never populated nor locked.
pub fn mmap_shared(fd: RawFd, len: usize, offset: u64) -> io::Result<*mut u8> {
    mmap_anywhere_unpopulated(len, RW, libc::MAP_SHARED | libc::MAP_NORESERVE, fd, offset)
}

/// Maps `len` bytes of `fd` shared and read-only anywhere (a client's view of a daemon's store,
/// whose descriptor it holds read-only), never populated nor locked.
pub fn mmap_shared_readonly(fd: RawFd, len: usize) -> io::Result<*const u8> {
    let flags = libc::MAP_SHARED | libc::MAP_NORESERVE;
    mmap_anywhere_unpopulated(len, libc::PROT_READ, flags, fd, 0).map(<*mut u8>::cast_const)
}

/// Maps `len` bytes of `fd` at `offset` privately (copy-on-write) with protection `prot`, at an
/// address the kernel picks.
pub fn mmap_private(fd: RawFd, len: usize, offset: u64, prot: libc::c_int) -> io::Result<*mut u8> {
    mmap_anywhere(len, prot, libc::MAP_PRIVATE, fd, offset)
}

/// Maps the first `len` bytes of `fd` privately (copy-on-write) and read/write at an address
/// the kernel picks, reserving no commit charge (`MAP_NORESERVE`) for pages never written,
/// never populated nor locked.
pub fn mmap_private_unreserved(fd: RawFd, len: usize) -> io::Result<*mut u8> {
    mmap_anywhere_unpopulated(len, RW, libc::MAP_PRIVATE | libc::MAP_NORESERVE, fd, 0)
}

/// Maps `len` bytes of `fd` at `offset` privately with protection `prot` at `addr`, only if
/// nothing is mapped anywhere in `[addr, addr+len)` (`EEXIST` otherwise).
pub fn mmap_private_where_free(
    addr: usize,
    len: usize,
    fd: RawFd,
    offset: u64,
    prot: libc::c_int,
) -> io::Result<()> {
    mmap_where_free(addr, len, prot, libc::MAP_PRIVATE, fd, offset)
}

/// Maps `len` bytes of fresh private anonymous memory with protection `prot` at `addr`, only if
/// nothing is mapped anywhere in `[addr, addr+len)` (`EEXIST` otherwise).
pub fn mmap_anonymous_where_free(addr: usize, len: usize, prot: libc::c_int) -> io::Result<()> {
    let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE;
    mmap_where_free(addr, len, prot, flags, -1, 0)
}

/// A mapping at `addr` (`mmap(2)`'s other arguments, `MAP_FIXED_NOREPLACE` added), only if
/// nothing is mapped anywhere in `[addr, addr+len)` (`EEXIST` otherwise).
fn mmap_where_free(
    addr: usize,
    len: usize,
    prot: libc::c_int,
    flags: libc::c_int,
    fd: RawFd,
    offset: u64,
) -> io::Result<()> {
    let flags = flags | libc::MAP_FIXED_NOREPLACE;
    // SAFETY: `MAP_FIXED_NOREPLACE` never replaces a mapping.
    let p = unsafe { mmap_at(addr as *mut u8, len, prot, flags, fd, offset) }?;
    if p as usize != addr {
        // A kernel before 4.17 takes the flag for a hint and maps elsewhere.
        // SAFETY: the mapping just made, which nothing refers to.
        unsafe { raw_munmap(p.cast(), len) };
        return Err(io::Error::from_raw_os_error(libc::EEXIST));
    }
    Ok(())
}

/// Replaces `[addr, addr+len)` by a private (copy-on-write) read/write mapping of `fd` at `offset`.
///
/// # Safety
/// The range must belong to the caller (no live Rust references into it), and its previous contents
/// are discarded: the caller must have moved out anything it still needs.
pub unsafe fn mmap_private_fixed(
    addr: *mut u8,
    len: usize,
    fd: RawFd,
    offset: u64,
) -> io::Result<()> {
    // SAFETY: the caller's contract, which is this one's.
    unsafe { mmap_private_fixed_with(addr, len, fd, offset, libc::PROT_READ | libc::PROT_WRITE) }
}

/// [`mmap_private_fixed`] with protection `prot`.
///
/// # Safety
/// As [`mmap_private_fixed`].
pub unsafe fn mmap_private_fixed_with(
    addr: *mut u8,
    len: usize,
    fd: RawFd,
    offset: u64,
    prot: libc::c_int,
) -> io::Result<()> {
    let flags = libc::MAP_PRIVATE | libc::MAP_FIXED;
    // SAFETY: the caller owns the range (see the function's contract).
    unsafe { mmap_at(addr, len, prot, flags, fd, offset) }.map(drop)
}

/// Replaces `[addr, addr+len)` by a fresh private anonymous mapping with protection `prot`,
/// holding nothing (it reads zeros).
///
/// # Safety
/// The range must belong to the caller (no live Rust references into it), and its previous contents
/// are discarded: the caller must have moved out anything it still needs.
pub unsafe fn mmap_anonymous_fixed(addr: *mut u8, len: usize, prot: libc::c_int) -> io::Result<()> {
    let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED;
    // SAFETY: the caller owns the range (see the function's contract).
    unsafe { mmap_at(addr, len, prot, flags, -1, 0) }.map(drop)
}

/// Moves the mapping `[old, old+len)` (one whole VMA) to `new`, replacing whatever was mapped
/// there, in one step: no other thread can observe `new` unmapped. (Except where it fails on
/// Linux 6.8 to 6.16, which can refuse after unmapping `new`, when the mapping count reached the
/// limit meanwhile: see [`is_unmapped`].)
///
/// # Safety
/// Both ranges' contents change place: no reference into either may be live, and the caller must
/// own what was mapped at `new`.
pub unsafe fn mremap_fixed(old: *mut u8, len: usize, new: *mut u8) -> io::Result<()> {
    // SAFETY: forwarded to the caller's contract.
    unsafe { mremap_fixed_with(old, len, new, 0) }
}

/// [`mremap_fixed`] that leaves the old range mapped, empty (`MREMAP_DONTUNMAP`, Linux 5.7; for
/// mappings of files since 5.13): nothing is unmapped there, so nothing is reported unmapped.
///
/// # Safety
/// As [`mremap_fixed`].
pub unsafe fn mremap_fixed_keeping(old: *mut u8, len: usize, new: *mut u8) -> io::Result<()> {
    // SAFETY: forwarded to the caller's contract.
    unsafe { mremap_fixed_with(old, len, new, libc::MREMAP_DONTUNMAP) }
}

/// # Safety
/// As [`mremap_fixed`].
unsafe fn mremap_fixed_with(
    old: *mut u8,
    len: usize,
    new: *mut u8,
    flags: libc::c_int,
) -> io::Result<()> {
    // SAFETY: forwarded to the caller's contract.
    let p = unsafe {
        raw_mremap(
            old.cast(),
            len,
            len,
            libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED | flags,
            new.cast::<libc::c_void>(),
        )
    };
    if p == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The page size the engine works in.
const PAGE: usize = 4096;

/// Whether nothing is mapped at the page of `addr` (`mincore` refuses an unmapped page with
/// `ENOMEM`). Allocates nothing.
pub fn is_unmapped(addr: usize) -> bool {
    let mut resident = 0u8;
    let page = addr & !(PAGE - 1);
    // SAFETY: `mincore` only reads the page tables and writes one byte into `resident`.
    let r = unsafe { libc::mincore(page as *mut libc::c_void, PAGE, &mut resident) };
    r != 0 && io::Error::last_os_error().raw_os_error() == Some(libc::ENOMEM)
}

/// Unmaps `[addr, addr+len)`.
///
/// # Safety
/// No reference into the range may outlive the call.
pub unsafe fn munmap(addr: *mut u8, len: usize) -> io::Result<()> {
    // SAFETY: the caller guarantees nothing refers to the range any more.
    cvt(unsafe { raw_munmap(addr.cast(), len) } as libc::c_long).map(drop)
}

/// `madvise(addr, len, advice)`, issued as a raw system call: the `LD_PRELOAD` shim interposes
/// the C library's `madvise`, and the engine inside it must reach the kernel, not the shim.
///
/// # Safety
/// Advice that discards contents (`MADV_DONTNEED`, `MADV_REMOVE`, ...) must only be given for memory
/// whose contents the caller owns and no longer needs.
pub unsafe fn madvise(addr: *mut u8, len: usize, advice: libc::c_int) -> io::Result<()> {
    // SAFETY: forwarded to the caller's contract; the arguments are madvise(2)'s.
    cvt(unsafe { libc::syscall(libc::SYS_madvise, addr, len, advice) }).map(drop)
}

/// Returns the free memory of the C heap (every malloc arena) to the kernel, after a burst of
/// large transient allocations; the allocator otherwise keeps it when later chunks pin the top
/// of a heap. Not an error when there is nothing to return. Does nothing on other C libraries.
pub fn release_free_heap() {
    #[cfg(target_env = "gnu")]
    // SAFETY: malloc_trim only walks and trims the allocator's own free lists.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Makes the C heap give every allocation of at least `bytes` its own mapping, returned to the
/// kernel when freed. glibc's default raises that threshold after each large free (up to 32 MiB),
/// after which a process that once had large tables keeps their memory in its heaps. For a
/// long-running program that owns its allocator settings (the daemon), not for a library inside
/// a host program. Does nothing on other C libraries.
pub fn set_heap_mmap_threshold(bytes: usize) {
    #[cfg(target_env = "gnu")]
    // SAFETY: mallopt only changes the allocator's tuning parameters.
    unsafe {
        libc::mallopt(
            libc::M_MMAP_THRESHOLD,
            bytes.min(i32::MAX as usize) as libc::c_int,
        );
    }
}

/// Writes zeros over `[addr, addr+len)` of this process's own memory through the kernel
/// (`/proc/self/mem`), which writes read-only private mappings too (a private copy of each page,
/// as a debugger's write makes): no reference to memory another thread may use is formed, and a
/// piece unmapped meanwhile is an error, not a fault. Kernels built to refuse such writes
/// (`proc_mem.force_override=never`) refuse them to read-only mappings.
///
/// # Safety
/// The caller owns the contents of the range: whatever it held is lost.
pub unsafe fn zero_own_memory(addr: usize, len: usize) -> io::Result<()> {
    static ZEROS: [u8; 1 << 16] = [0; 1 << 16];
    let mem = std::fs::OpenOptions::new()
        .write(true)
        .open("/proc/self/mem")?;
    let mut done = 0;
    while done < len {
        let n = (len - done).min(ZEROS.len());
        let at = (addr + done) as u64;
        match std::os::unix::fs::FileExt::write_at(&mem, &ZEROS[..n], at)? {
            0 => return Err(io::ErrorKind::WriteZero.into()),
            k => done += k,
        }
    }
    Ok(())
}

/// Copies the pieces `srcs` (address, length) of this process's own memory, one after another,
/// into `dst` with `process_vm_readv`: the kernel reads them, so memory another thread writes
/// meanwhile is never read by this thread, and a piece unmapped meanwhile is an error, not a
/// fault. Returns the bytes copied: the whole pieces read before the first that could not be.
///
/// # Safety
/// `dst` must be writable for the sum of the pieces' lengths.
pub unsafe fn read_own_memory(dst: *mut u8, srcs: &[(usize, usize)]) -> io::Result<usize> {
    let total: usize = srcs.iter().map(|&(_, len)| len).sum();
    let mut done = 0;
    for chunk in srcs.chunks(crate::IOV_MAX) {
        let remote: Vec<libc::iovec> = chunk
            .iter()
            .map(|&(addr, len)| libc::iovec {
                iov_base: addr as *mut libc::c_void,
                iov_len: len,
            })
            .collect();
        let want: usize = chunk.iter().map(|&(_, len)| len).sum();
        let local = libc::iovec {
            // SAFETY: within `dst`, by the caller's contract (done < total).
            iov_base: unsafe { dst.add(done) }.cast(),
            iov_len: want,
        };
        // SAFETY: `local` is writable (caller's contract); the remote pieces are only read by the
        // kernel, which reports an unmapped one as an error.
        let r = unsafe {
            libc::process_vm_readv(
                libc::getpid(),
                &local,
                1,
                remote.as_ptr(),
                remote.len() as libc::c_ulong,
                0,
            )
        };
        if r < 0 {
            if done > 0 {
                return Ok(done);
            }
            return Err(io::Error::last_os_error());
        }
        done += r as usize;
        if r as usize != want {
            break;
        }
    }
    debug_assert!(done <= total);
    Ok(done)
}
