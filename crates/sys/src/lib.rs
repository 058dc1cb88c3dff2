//! Every Linux system call pageone makes, each with its contract stated once.
//!
//! Nothing else in the workspace calls `libc` for a system call: the engine, recycler and tools go
//! through this crate, so the kernel interfaces pageone depends on (and the uapi constants newer than
//! Debian's 6.1 headers) are all visible in one place. Each function returns `io::Result`; the raw
//! errno is kept so callers can tell "feature missing" (`EINVAL`, `ENOSYS`, `ENOTTY`) from "busy"
//! (`EBUSY`, `EEXIST`, `EAGAIN`) from "out of resources" (`ENOMEM`).
//!
//! Features are detected at run time (`Uffd::open`, [`pagemap_scan_supported`]); nothing here assumes
//! a kernel version.

use std::ffi::{CStr, CString};
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

mod access;
pub mod uapi;

pub use access::*;

use uapi::*;

/// Converts a `-1`-on-error return into `io::Result`.
fn cvt(ret: libc::c_long) -> io::Result<libc::c_long> {
    if ret == -1 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

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

// Memory-map calls are raw system calls: an `LD_PRELOAD` shim interposes the C library's
// `mmap`/`munmap`/`mremap` to see the program's own mappings, and the engine's calls must neither
// reach it nor be mistaken for the program's.

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

/// `prctl(2)` as a raw system call (for a shim that interposes the C library's `prctl`).
///
/// # Safety
/// As `prctl(2)`: options that take pointers need valid ones.
pub unsafe fn raw_prctl(
    option: libc::c_int,
    a2: libc::c_ulong,
    a3: libc::c_ulong,
    a4: libc::c_ulong,
    a5: libc::c_ulong,
) -> libc::c_int {
    // SAFETY: forwarded to the caller's contract.
    unsafe { libc::syscall(libc::SYS_prctl, option, a2, a3, a4, a5) as libc::c_int }
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

/// Maps `len` bytes of fresh private anonymous memory (read/write) anywhere.
pub fn mmap_anonymous(len: usize) -> io::Result<*mut u8> {
    // SAFETY: a non-fixed anonymous mapping cannot alias existing memory.
    let p = unsafe {
        raw_mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    Ok(p.cast())
}

/// Maps `len` bytes of `fd` at `offset` shared and read/write anywhere (the engine's view of its
/// stable store).
pub fn mmap_shared(fd: RawFd, len: usize, offset: u64) -> io::Result<*mut u8> {
    // SAFETY: a non-fixed mapping cannot alias existing memory.
    let p = unsafe {
        raw_mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | libc::MAP_NORESERVE,
            fd,
            offset as libc::off_t,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    Ok(p.cast())
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
    // SAFETY: the caller owns the range (see the function's contract).
    let p = unsafe {
        raw_mmap(
            addr.cast(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_FIXED,
            fd,
            offset as libc::off_t,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Moves the mapping `[old, old+len)` (one whole VMA) to `new`, replacing whatever was mapped
/// there, in one step: no other thread can observe `new` unmapped.
///
/// # Safety
/// Both ranges' contents change place: no reference into either may be live, and the caller must
/// own what was mapped at `new`.
pub unsafe fn mremap_fixed(old: *mut u8, len: usize, new: *mut u8) -> io::Result<()> {
    // SAFETY: forwarded to the caller's contract.
    let p = unsafe {
        raw_mremap(
            old.cast(),
            len,
            len,
            libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED,
            new.cast::<libc::c_void>(),
        )
    };
    if p == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    Ok(())
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

/// Creates a memfd (close-on-exec) named `name` for diagnostics in `/proc/PID/maps`.
pub fn memfd_create(name: &CStr) -> io::Result<OwnedFd> {
    // SAFETY: name is a valid NUL-terminated string.
    let fd = cvt(unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) } as libc::c_long)?;
    // SAFETY: fd was just returned by the kernel and is owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// A random 64-bit value from the kernel (`getrandom`, blocking only until the pool is seeded
/// at boot).
pub fn random_u64() -> io::Result<u64> {
    let mut v = [0u8; 8];
    // SAFETY: `v` is a live buffer of 8 bytes.
    let n = cvt(unsafe { libc::getrandom(v.as_mut_ptr().cast(), v.len(), 0) } as libc::c_long)?;
    if n != 8 {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "getrandom returned short",
        ));
    }
    Ok(u64::from_ne_bytes(v))
}

/// Sets the size of the file behind `fd`.
pub fn ftruncate(fd: RawFd, len: u64) -> io::Result<()> {
    // SAFETY: no memory is passed to the kernel.
    cvt(unsafe { libc::ftruncate(fd, len as libc::off_t) } as libc::c_long).map(drop)
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

/// Frees `[offset, offset+len)` of a file without changing its size (reads return zeros).
pub fn punch_hole(fd: RawFd, offset: u64, len: u64) -> io::Result<()> {
    // SAFETY: no memory is passed to the kernel.
    cvt(unsafe {
        libc::fallocate(
            fd,
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            offset as libc::off_t,
            len as libc::off_t,
        )
    } as libc::c_long)
    .map(drop)
}

/// Most iovecs one vectored call takes (`IOV_MAX`).
const IOV_MAX: usize = 1024;

/// One page-sized iovec per address.
fn page_iovecs(srcs: &[usize]) -> Vec<libc::iovec> {
    srcs.iter()
        .map(|&a| libc::iovec {
            iov_base: a as *mut libc::c_void,
            iov_len: PAGE_SIZE,
        })
        .collect()
}

/// Writes the pages at `srcs` (each `PAGE_SIZE` bytes of this process's memory) to `fd` at
/// consecutive offsets starting at `offset`, with as few `pwritev` calls as possible. The kernel
/// reads the sources, so they may be written concurrently (the file then holds some mix of old
/// and new bytes, which callers must verify).
pub fn pwrite_pages(fd: RawFd, srcs: &[usize], offset: u64) -> io::Result<()> {
    let mut done = 0usize;
    while done < srcs.len() {
        let batch = (srcs.len() - done).min(IOV_MAX);
        let iov = page_iovecs(&srcs[done..done + batch]);
        let off = offset + (done * PAGE_SIZE) as u64;
        // SAFETY: iov is a live array of `batch` iovecs; the kernel only reads the sources.
        let n =
            cvt(
                unsafe { libc::pwritev(fd, iov.as_ptr(), batch as libc::c_int, off as libc::off_t) }
                    as libc::c_long,
            )? as usize;
        if n < PAGE_SIZE {
            return Err(io::Error::new(
                io::ErrorKind::WriteZero,
                "pwritev wrote no whole page",
            ));
        }
        // A short write continues from the first page not fully written.
        done += n / PAGE_SIZE;
    }
    Ok(())
}

/// Creates an eventfd used to interrupt a blocking poll (non-blocking, close-on-exec).
pub fn eventfd() -> io::Result<OwnedFd> {
    // SAFETY: no memory is passed to the kernel.
    let fd =
        cvt(unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) } as libc::c_long)?;
    // SAFETY: fd was just returned by the kernel and is owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// Adds one to an eventfd's counter, waking its pollers.
pub fn eventfd_signal(fd: RawFd) -> io::Result<()> {
    let one: u64 = 1;
    // SAFETY: writes 8 bytes from a live local.
    cvt(unsafe { libc::write(fd, (&one as *const u64).cast(), 8) } as libc::c_long).map(drop)
}

/// Waits until one of `fds` is readable; returns which ones are.
pub fn poll_readable(fds: &[RawFd], timeout_ms: i32) -> io::Result<Vec<bool>> {
    let mut pfds: Vec<libc::pollfd> = fds
        .iter()
        .map(|&fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    loop {
        // SAFETY: pfds is a live array of pfds.len() pollfd structures.
        let r = unsafe { libc::poll(pfds.as_mut_ptr(), pfds.len() as libc::nfds_t, timeout_ms) };
        if r == -1 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        return Ok(pfds
            .iter()
            .map(|p| p.revents & (libc::POLLIN | libc::POLLERR) != 0)
            .collect());
    }
}

/// Puts the calling thread in the `SCHED_IDLE` class, so it only runs on otherwise idle CPUs.
pub fn set_thread_idle_priority() -> io::Result<()> {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: param is a live sched_param; pid 0 means the calling thread.
    cvt(unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) } as libc::c_long).map(drop)
}

/// The CPU-time clock of one thread, readable from any thread of the process while that thread
/// has not been joined (`pthread_getcpuclockid`).
#[derive(Clone, Copy, Debug)]
pub struct CpuClock(libc::clockid_t);

impl CpuClock {
    /// The calling thread's clock.
    pub fn current() -> io::Result<Self> {
        let mut id: libc::clockid_t = 0;
        // SAFETY: `id` is a live out-parameter; pthread_self() is the calling thread.
        let r = unsafe { libc::pthread_getcpuclockid(libc::pthread_self(), &mut id) };
        if r != 0 {
            return Err(io::Error::from_raw_os_error(r));
        }
        Ok(Self(id))
    }

    /// CPU time the thread used so far, in nanoseconds (0 if the clock cannot be read).
    pub fn ns(&self) -> u64 {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: ts is a live timespec.
        if unsafe { libc::clock_gettime(self.0, &mut ts) } != 0 {
            return 0;
        }
        ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
    }
}

/// The kernel's VMA limit per process (`vm.max_map_count`).
pub fn max_map_count() -> io::Result<usize> {
    let s = std::fs::read_to_string("/proc/sys/vm/max_map_count")?;
    s.trim()
        .parse()
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "bad max_map_count"))
}

/// Sets `vm.max_map_count` (root only; used by tests of the VMA-limit path).
pub fn set_max_map_count(n: usize) -> io::Result<()> {
    std::fs::write("/proc/sys/vm/max_map_count", format!("{n}\n"))
}

/// The number of VMAs of the calling process (lines of `/proc/self/maps`).
pub fn map_count() -> io::Result<usize> {
    let s = std::fs::read("/proc/self/maps")?;
    Ok(s.iter().filter(|&&b| b == b'\n').count())
}

/// One line of `/proc/self/maps`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mapping {
    pub start: usize,
    pub end: usize,
    pub perms: String,
    pub offset: u64,
    pub inode: u64,
    pub path: String,
}

impl Mapping {
    /// A private, read/write, anonymous mapping (including `[heap]` and `[stack]`): what the engine
    /// may register.
    pub fn is_private_anonymous_rw(&self) -> bool {
        self.perms.starts_with("rw") && self.perms.ends_with('p') && self.inode == 0 && {
            self.path.is_empty() || self.path == "[heap]" || self.path.starts_with("[anon:")
        }
    }
}

/// Parses `/proc/self/maps`.
pub fn self_mappings() -> io::Result<Vec<Mapping>> {
    let s = std::fs::read_to_string("/proc/self/maps")?;
    let mut out = Vec::new();
    for line in s.lines() {
        let mut it = line.split_ascii_whitespace();
        let (Some(range), Some(perms), Some(off), Some(_dev), Some(inode)) =
            (it.next(), it.next(), it.next(), it.next(), it.next())
        else {
            continue;
        };
        let path = it.collect::<Vec<_>>().join(" ");
        let Some((a, b)) = range.split_once('-') else {
            continue;
        };
        let (Ok(start), Ok(end)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16))
        else {
            continue;
        };
        out.push(Mapping {
            start,
            end,
            perms: perms.to_string(),
            offset: u64::from_str_radix(off, 16).unwrap_or(0),
            inode: inode.parse().unwrap_or(0),
            path,
        });
    }
    Ok(out)
}

/// A userfaultfd context.
///
/// Contract: the engine registers its watched ranges with `MISSING | WP` (async write-protection),
/// answers missing faults itself, and uses `UFFDIO_MOVE` to freeze a page: while a page is moved out,
/// any access to its address blocks in the kernel until the engine wakes it.
#[derive(Debug)]
pub struct Uffd {
    fd: OwnedFd,
    features: u64,
}

impl Uffd {
    /// Opens a userfaultfd (non-blocking, close-on-exec) and negotiates the `wanted` features,
    /// dropping those this kernel lacks. Returns the context and the features granted.
    ///
    /// Unprivileged processes on hosts with `vm.unprivileged_userfaultfd = 0` get a user-mode-only
    /// context, which is enough: pageone only handles faults from user space.
    pub fn open(wanted: u64) -> io::Result<Self> {
        let base = libc::O_CLOEXEC | libc::O_NONBLOCK;
        let fd = Self::raw_open(base).or_else(|_| Self::raw_open(base | UFFD_USER_MODE_ONLY))?;
        // First ask what exists (features = 0 returns the supported set), then request the
        // intersection on a fresh context: the API handshake can only be done once per context.
        let mut probe = UffdioApi {
            api: UFFD_API,
            features: 0,
            ioctls: 0,
        };
        // SAFETY: probe is a live uffdio_api the kernel fills in.
        cvt(unsafe { libc::ioctl(fd.as_raw_fd(), UFFDIO_API, &mut probe) } as libc::c_long)?;
        let grant = wanted & probe.features;
        drop(fd);
        let fd = Self::raw_open(base).or_else(|_| Self::raw_open(base | UFFD_USER_MODE_ONLY))?;
        let mut api = UffdioApi {
            api: UFFD_API,
            features: grant,
            ioctls: 0,
        };
        // SAFETY: as above.
        cvt(unsafe { libc::ioctl(fd.as_raw_fd(), UFFDIO_API, &mut api) } as libc::c_long)?;
        Ok(Self {
            fd,
            features: grant,
        })
    }

    fn raw_open(flags: libc::c_int) -> io::Result<OwnedFd> {
        // SAFETY: the userfaultfd syscall takes only flags.
        let fd = cvt(unsafe { libc::syscall(libc::SYS_userfaultfd, flags) })?;
        // SAFETY: fd was just returned by the kernel and is owned by nobody else.
        Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
    }

    /// The features this context was granted.
    pub fn features(&self) -> u64 {
        self.features
    }

    /// The raw descriptor (for polling).
    pub fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// Registers `[start, start+len)` with `mode` (`UFFDIO_REGISTER_MODE_*`).
    pub fn register(&self, start: usize, len: usize, mode: u64) -> io::Result<()> {
        let mut r = UffdioRegister {
            range: UffdioRange {
                start: start as u64,
                len: len as u64,
            },
            mode,
            ioctls: 0,
        };
        // SAFETY: r is a live uffdio_register.
        cvt(unsafe { libc::ioctl(self.as_raw_fd(), UFFDIO_REGISTER, &mut r) } as libc::c_long)
            .map(drop)
    }

    /// Unregisters `[start, start+len)`; blocked faulters in it are woken.
    pub fn unregister(&self, start: usize, len: usize) -> io::Result<()> {
        let mut r = UffdioRange {
            start: start as u64,
            len: len as u64,
        };
        // SAFETY: r is a live uffdio_range.
        cvt(unsafe { libc::ioctl(self.as_raw_fd(), UFFDIO_UNREGISTER, &mut r) } as libc::c_long)
            .map(drop)
    }

    /// Wakes threads blocked on faults in `[start, start+len)`.
    pub fn wake(&self, start: usize, len: usize) -> io::Result<()> {
        let mut r = UffdioRange {
            start: start as u64,
            len: len as u64,
        };
        // SAFETY: r is a live uffdio_range.
        cvt(unsafe { libc::ioctl(self.as_raw_fd(), UFFDIO_WAKE, &mut r) } as libc::c_long).map(drop)
    }

    /// Resolves a missing fault by mapping the shared zero page over `[start, start+len)` and
    /// waking the faulters. `EEXIST` means the page is present already.
    pub fn zeropage(&self, start: usize, len: usize) -> io::Result<()> {
        let mut z = UffdioZeropage {
            range: UffdioRange {
                start: start as u64,
                len: len as u64,
            },
            mode: 0,
            zeropage: 0,
        };
        // SAFETY: z is a live uffdio_zeropage.
        cvt(unsafe { libc::ioctl(self.as_raw_fd(), UFFDIO_ZEROPAGE, &mut z) } as libc::c_long)
            .map(drop)
    }

    /// Write-protects (`protect`) or un-protects `[start, start+len)`; un-protecting also clears
    /// the write-protect markers of unpopulated pages and wakes faulters.
    pub fn writeprotect(&self, start: usize, len: usize, protect: bool) -> io::Result<()> {
        let mut w = UffdioWriteprotect {
            range: UffdioRange {
                start: start as u64,
                len: len as u64,
            },
            mode: if protect {
                UFFDIO_WRITEPROTECT_MODE_WP
            } else {
                0
            },
        };
        // SAFETY: w is a live uffdio_writeprotect.
        cvt(unsafe { libc::ioctl(self.as_raw_fd(), UFFDIO_WRITEPROTECT, &mut w) } as libc::c_long)
            .map(drop)
    }

    /// Resolves a missing fault by copying `len` bytes from `src` into new pages at `dst` and waking
    /// the faulters. Unlike [`Uffd::zeropage`] this also fills a page whose entry holds only a
    /// write-protect marker (left by async write-protection of an unpopulated page).
    ///
    /// # Safety
    /// `src` must be readable for `len` bytes.
    pub unsafe fn copy(&self, dst: usize, src: *const u8, len: usize) -> io::Result<()> {
        let mut c = UffdioCopy {
            dst: dst as u64,
            src: src as u64,
            len: len as u64,
            mode: 0,
            copy: 0,
        };
        // SAFETY: c is a live uffdio_copy; the caller vouches for src.
        cvt(unsafe { libc::ioctl(self.as_raw_fd(), UFFDIO_COPY, &mut c) } as libc::c_long).map(drop)
    }

    /// Moves the pages of `[src, src+len)` to `[dst, dst+len)` without copying (`UFFDIO_MOVE`).
    /// `dst` must lie in a range registered with this context and be unpopulated; `src` must be
    /// private anonymous memory of this process. Returns the number of bytes moved, which may be
    /// less than `len` on error (the error is returned only when nothing moved).
    ///
    /// # Safety
    /// Both ranges' contents change place: no reference into either may be live.
    pub unsafe fn move_pages(
        &self,
        dst: usize,
        src: usize,
        len: usize,
        mode: u64,
    ) -> io::Result<usize> {
        let mut m = UffdioMove {
            dst: dst as u64,
            src: src as u64,
            len: len as u64,
            mode,
            moved: 0,
        };
        // SAFETY: m is a live uffdio_move; the caller vouches for the ranges.
        let r = unsafe { libc::ioctl(self.as_raw_fd(), UFFDIO_MOVE, &mut m) };
        if r == -1 {
            let e = io::Error::last_os_error();
            if m.moved > 0 {
                return Ok(m.moved as usize);
            }
            return Err(e);
        }
        Ok(m.moved as usize)
    }

    /// Reads one pending fault event without blocking; `Ok(None)` when none is pending.
    pub fn read_event(&self) -> io::Result<Option<UffdMsg>> {
        let mut msg = UffdMsg::default();
        let n = std::mem::size_of::<UffdMsg>();
        // SAFETY: reads at most n bytes into a live UffdMsg of n bytes.
        let r = unsafe { libc::read(self.as_raw_fd(), (&mut msg as *mut UffdMsg).cast(), n) };
        if r == -1 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::WouldBlock {
                return Ok(None);
            }
            return Err(e);
        }
        if r as usize != n {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "short userfaultfd read",
            ));
        }
        Ok(Some(msg))
    }
}

/// What a `PAGEMAP_SCAN` matches and reports (fields of `struct pm_scan_arg`): a page matches
/// when `(categories ^ category_inverted) & category_mask == category_mask` and, if
/// `category_anyof_mask` is set, `categories & category_anyof_mask != 0`.
#[derive(Clone, Copy, Debug, Default)]
pub struct ScanQuery {
    pub flags: u64,
    pub category_mask: u64,
    pub category_inverted: u64,
    pub category_anyof_mask: u64,
    pub return_mask: u64,
}

/// The process's `/proc/self/pagemap`, for the `PAGEMAP_SCAN` ioctl and classic entry reads.
#[derive(Debug)]
pub struct Pagemap {
    file: File,
}

impl Pagemap {
    /// Opens `/proc/self/pagemap`.
    pub fn open() -> io::Result<Self> {
        Ok(Self {
            file: File::open("/proc/self/pagemap")?,
        })
    }

    /// Runs `PAGEMAP_SCAN` over `[start, end)`, appending matching page ranges to `out` (the
    /// kernel merges adjacent pages with equal categories). With `PM_SCAN_WP_MATCHING`, pages
    /// reported are also write-protected again (async uffd-wp): "written since last scan" becomes
    /// "written since now". VMAs without async uffd-wp are skipped silently in that mode.
    pub fn scan(
        &self,
        start: usize,
        end: usize,
        q: &ScanQuery,
        out: &mut Vec<PageRegion>,
    ) -> io::Result<()> {
        self.walk(start, end, q, Some(out))
    }

    /// The `PAGEMAP_SCAN` loop of [`Pagemap::scan`] and [`Pagemap::write_protect`]: resumes at
    /// `walk_end` until `end`. Without `out` the kernel gets no output vector (then, with
    /// `PM_SCAN_WP_MATCHING`, it takes its exclusive write-protect path).
    fn walk(
        &self,
        start: usize,
        end: usize,
        q: &ScanQuery,
        mut out: Option<&mut Vec<PageRegion>>,
    ) -> io::Result<()> {
        let mut buf = match out {
            Some(_) => vec![PageRegion::default(); 1024],
            None => Vec::new(),
        };
        let mut cur = start as u64;
        while cur < end as u64 {
            let mut arg = PmScanArg {
                size: std::mem::size_of::<PmScanArg>() as u64,
                flags: q.flags,
                start: cur,
                end: end as u64,
                walk_end: 0,
                vec: if buf.is_empty() {
                    0
                } else {
                    buf.as_mut_ptr() as u64
                },
                vec_len: buf.len() as u64,
                max_pages: 0,
                category_inverted: q.category_inverted,
                category_mask: q.category_mask,
                category_anyof_mask: q.category_anyof_mask,
                return_mask: q.return_mask,
            };
            // SAFETY: arg is a live pm_scan_arg whose vec points to buf.len() live regions, or
            // has no vector at all (vec and vec_len 0).
            let n = cvt(
                unsafe { libc::ioctl(self.file.as_raw_fd(), PAGEMAP_SCAN, &mut arg) }
                    as libc::c_long,
            )? as usize;
            if let Some(out) = out.as_deref_mut() {
                out.extend_from_slice(&buf[..n]);
            }
            if arg.walk_end <= cur {
                break;
            }
            cur = arg.walk_end;
        }
        Ok(())
    }

    /// Whether each of the `n` pages from `start` has all the categories of `mask` (e.g.
    /// `PAGE_IS_PRESENT`).
    pub fn pages_with(&self, start: usize, n: usize, mask: u64) -> io::Result<Vec<bool>> {
        let q = ScanQuery {
            category_mask: mask,
            return_mask: mask,
            ..Default::default()
        };
        let mut found = Vec::new();
        self.scan(start, start + n * PAGE_SIZE, &q, &mut found)?;
        let mut out = vec![false; n];
        for r in &found {
            let lo = (r.start as usize - start) / PAGE_SIZE;
            let hi = ((r.end as usize - start) / PAGE_SIZE).min(n);
            out[lo..hi].fill(true);
        }
        Ok(out)
    }

    /// How many of the `n` pages from `start` have all the categories of `mask`.
    pub fn count_pages(&self, start: usize, n: usize, mask: u64) -> io::Result<usize> {
        Ok(self
            .pages_with(start, n, mask)?
            .iter()
            .filter(|&&b| b)
            .count())
    }

    /// Write-protects (async uffd-wp) every page of `[start, end)` not protected yet, reporting
    /// nothing: `PAGEMAP_SCAN` with `PM_SCAN_WP_MATCHING` and no output vector, which the kernel
    /// runs as its exclusive write-protect fast path. VMAs without async uffd-wp are skipped.
    pub fn write_protect(&self, start: usize, end: usize) -> io::Result<()> {
        let q = ScanQuery {
            flags: PM_SCAN_WP_MATCHING,
            category_mask: PAGE_IS_WRITTEN,
            return_mask: PAGE_IS_WRITTEN,
            ..Default::default()
        };
        self.walk(start, end, &q, None)
    }

    /// Reads classic pagemap entries for the pages of `[start, start + n*4096)`.
    pub fn entries(&self, start: usize, n: usize, out: &mut Vec<u64>) -> io::Result<()> {
        use std::os::unix::fs::FileExt;
        let mut bytes = vec![0u8; n * 8];
        self.file
            .read_exact_at(&mut bytes, (start / PAGE_SIZE * 8) as u64)?;
        out.extend(
            bytes
                .chunks_exact(8)
                .map(|c| u64::from_ne_bytes(c.try_into().unwrap())),
        );
        Ok(())
    }
}

/// Whether this kernel has the `PAGEMAP_SCAN` ioctl (6.7+).
pub fn pagemap_scan_supported() -> bool {
    let Ok(pm) = Pagemap::open() else {
        return false;
    };
    let mut v = Vec::new();
    // An empty-but-valid query: ENOTTY/EINVAL on kernels without the ioctl.
    let probe = [0u8; PAGE_SIZE];
    let a = probe.as_ptr() as usize & !(PAGE_SIZE - 1);
    let q = ScanQuery {
        category_anyof_mask: PAGE_IS_PRESENT,
        return_mask: PAGE_IS_PRESENT,
        ..ScanQuery::default()
    };
    pm.scan(a, a + PAGE_SIZE, &q, &mut v).is_ok()
}

/// Process-wide memory figures from `/proc/meminfo` and `/proc/self/smaps_rollup`, in KiB.
pub fn meminfo_kib(field: &str) -> io::Result<u64> {
    read_kib("/proc/meminfo", field)
}

/// A field (e.g. `Pss`, `Rss`, `Pss_Anon`) of `/proc/self/smaps_rollup`, in KiB.
pub fn self_smaps_rollup_kib(field: &str) -> io::Result<u64> {
    read_kib("/proc/self/smaps_rollup", field)
}

/// A field (e.g. `RssAnon`) of `/proc/self/status`, in KiB: the kernel's counters, read without
/// walking page tables as `smaps_rollup` does.
pub fn self_status_kib(field: &str) -> io::Result<u64> {
    read_kib("/proc/self/status", field)
}

fn read_kib(path: &str, field: &str) -> io::Result<u64> {
    let s = std::fs::read_to_string(path)?;
    for line in s.lines() {
        if let Some(rest) = line.strip_prefix(field) {
            if let Some(v) = rest.strip_prefix(':') {
                let num = v.trim().trim_end_matches("kB").trim();
                return num
                    .parse()
                    .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "bad number"));
            }
        }
    }
    Err(io::Error::new(
        io::ErrorKind::NotFound,
        format!("no field {field} in {path}"),
    ))
}

// ---- Cross-process sharing: sockets with descriptors, read-only views, sealed stores ----------

/// Maps `len` bytes of `fd` shared and read-only anywhere (a client's view of a daemon's store,
/// whose descriptor it holds read-only).
pub fn mmap_shared_readonly(fd: RawFd, len: usize) -> io::Result<*const u8> {
    // SAFETY: a non-fixed mapping cannot alias existing memory.
    let p = unsafe {
        raw_mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ,
            libc::MAP_SHARED | libc::MAP_NORESERVE,
            fd,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    Ok(p.cast_const().cast())
}

/// Creates a memfd that accepts seals (close-on-exec).
pub fn memfd_create_sealable(name: &CStr) -> io::Result<OwnedFd> {
    // SAFETY: name is a valid NUL-terminated string.
    let fd = cvt(unsafe {
        libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)
    } as libc::c_long)?;
    // SAFETY: fd was just returned by the kernel and is owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// Adds `seals` (`F_SEAL_*`) to a memfd.
pub fn add_seals(fd: RawFd, seals: libc::c_int) -> io::Result<()> {
    // SAFETY: no memory is passed to the kernel.
    cvt(unsafe { libc::fcntl(fd, libc::F_ADD_SEALS, seals) } as libc::c_long).map(drop)
}

/// Opens the file behind `fd` again, read-only (a new open file description: the holder of the
/// new descriptor cannot write, truncate or seal the file, or map it shared and writable).
pub fn reopen_readonly(fd: RawFd) -> io::Result<OwnedFd> {
    let path = CString::new(format!("/proc/self/fd/{fd}")).expect("no NUL in a path of digits");
    // SAFETY: path is a valid NUL-terminated string.
    let r = cvt(
        unsafe { libc::open(path.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) } as libc::c_long,
    )?;
    // SAFETY: r was just returned by the kernel and is owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(r as RawFd) })
}

/// `fstat` of `fd`.
fn fstat(fd: RawFd) -> io::Result<libc::stat> {
    // SAFETY: stat is plain data; all-zero is a valid value.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: st is a live, writable stat buffer.
    cvt(unsafe { libc::fstat(fd, &mut st) } as libc::c_long)?;
    Ok(st)
}

/// Size in bytes and allocated bytes (`st_blocks * 512`) of the file behind `fd`.
pub fn file_usage(fd: RawFd) -> io::Result<(u64, u64)> {
    let st = fstat(fd)?;
    Ok((st.st_size as u64, st.st_blocks as u64 * 512))
}

/// Reads up to `len` bytes of `fd` at `offset` into the memory at `dst`; returns the bytes read
/// (short at end of file: a file that shrank cannot fault the reader, as a mapping of it would).
///
/// # Safety
/// `[dst, dst+len)` must be writable memory of this process that nothing else reads or writes
/// meanwhile through Rust references.
pub unsafe fn pread_into(fd: RawFd, dst: *mut u8, len: usize, offset: u64) -> io::Result<usize> {
    let mut done = 0;
    while done < len {
        // SAFETY: dst+done..dst+len is writable per the caller's contract.
        let n = cvt(unsafe {
            libc::pread(
                fd,
                dst.add(done).cast(),
                len - done,
                (offset + done as u64) as libc::off_t,
            )
        } as libc::c_long)? as usize;
        if n == 0 {
            break;
        }
        done += n;
    }
    Ok(done)
}

/// A pipe, both ends close-on-exec: `(read end, write end)`.
pub fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0 as RawFd; 2];
    // SAFETY: `fds` is a live array of two descriptors for the kernel to fill.
    cvt(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } as libc::c_long)?;
    // SAFETY: both descriptors were just returned by the kernel and are owned by nobody else.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// Asks for a pipe capacity of `bytes` (`F_SETPIPE_SZ`) and returns the capacity the pipe has
/// afterwards. Unprivileged processes are held to `/proc/sys/fs/pipe-max-size` and to their
/// user's share of pipe pages; a refused request leaves the pipe as it was (its capacity is still
/// returned), so a caller sizes its writes by the answer, not by its wish.
pub fn set_pipe_capacity(fd: RawFd, bytes: usize) -> io::Result<usize> {
    // SAFETY: no memory is passed to the kernel.
    let set = unsafe { libc::fcntl(fd, libc::F_SETPIPE_SZ, bytes as libc::c_int) };
    if set > 0 {
        return Ok(set as usize);
    }
    // SAFETY: no memory is passed to the kernel.
    cvt(unsafe { libc::fcntl(fd, libc::F_GETPIPE_SZ) } as libc::c_long).map(|n| n as usize)
}

/// Bytes waiting to be read in a pipe (`FIONREAD`).
pub fn pipe_pending(fd: RawFd) -> io::Result<usize> {
    let mut n: libc::c_int = 0;
    // SAFETY: `n` is a live int the kernel writes.
    cvt(unsafe { libc::ioctl(fd, libc::FIONREAD, &mut n) } as libc::c_long)?;
    Ok(n.max(0) as usize)
}

/// Hands the pages at `srcs` (each `PAGE_SIZE` bytes of this process's memory, page-aligned) to
/// the pipe `fd` by reference (`vmsplice`, never blocking): no copy is made, the pipe holds the
/// pages until they are read. A write to a source after this call may or may not reach the
/// reader (a write that faults gets a page of its own), so callers verify what the reader made
/// of them. Returns how many whole pages the pipe took: fewer than asked when it filled up.
pub fn vmsplice_pages(fd: RawFd, srcs: &[usize]) -> io::Result<usize> {
    let mut done = 0usize;
    while done < srcs.len() {
        let batch = (srcs.len() - done).min(IOV_MAX);
        let iov = page_iovecs(&srcs[done..done + batch]);
        // SAFETY: iov is a live array of `batch` iovecs naming mapped pages of this process; the
        // kernel takes references to those pages and never writes them.
        let n = unsafe { libc::vmsplice(fd, iov.as_ptr(), batch, libc::SPLICE_F_NONBLOCK) };
        if n < 0 {
            let e = io::Error::last_os_error();
            return match e.raw_os_error() {
                Some(libc::EAGAIN) if done > 0 => Ok(done),
                _ => Err(e),
            };
        }
        // A page-aligned page fills one pipe buffer, so a short transfer ends on a page.
        done += n as usize / PAGE_SIZE;
        if (n as usize) < batch * PAGE_SIZE {
            break;
        }
    }
    Ok(done)
}

/// Moves up to `len` bytes from the pipe `pipe` into `fd` at `offset` (`splice`, never blocking:
/// an empty pipe ends the move). Returns the bytes moved.
pub fn splice_to_file(pipe: RawFd, fd: RawFd, offset: u64, len: usize) -> io::Result<usize> {
    let mut at = offset as libc::loff_t;
    splice_from_pipe(pipe, fd, Some(&mut at), len)
}

/// Discards up to `len` bytes waiting in the pipe `pipe` (spliced to `/dev/null`, never
/// blocking). Returns the bytes discarded.
pub fn drain_pipe(pipe: RawFd, len: usize) -> io::Result<usize> {
    let null = std::fs::OpenOptions::new().write(true).open("/dev/null")?;
    splice_from_pipe(pipe, null.as_raw_fd(), None, len)
}

/// `splice` from a pipe without blocking, until `len` bytes, an empty pipe, or an error.
fn splice_from_pipe(
    pipe: RawFd,
    out: RawFd,
    mut at: Option<&mut libc::loff_t>,
    len: usize,
) -> io::Result<usize> {
    let mut done = 0;
    while done < len {
        let off = at
            .as_deref_mut()
            .map_or(std::ptr::null_mut(), |a| a as *mut libc::loff_t);
        // SAFETY: `off` is null or a live local offset the kernel updates; no user memory is
        // passed.
        let n = unsafe {
            libc::splice(
                pipe,
                std::ptr::null_mut(),
                out,
                off,
                len - done,
                libc::SPLICE_F_NONBLOCK,
            )
        };
        match n {
            0 => break,
            n if n < 0 => {
                let e = io::Error::last_os_error();
                if e.raw_os_error() == Some(libc::EAGAIN) {
                    break;
                }
                return Err(e);
            }
            n => done += n as usize,
        }
    }
    Ok(done)
}

/// Gives `SIGPIPE` its default action (end the process) again. Rust's runtime starts programs
/// with it ignored, while C programs (and so most host programs of the shim and the C ABI) keep
/// the default; tools that stand in for such programs call this.
pub fn default_sigpipe() -> io::Result<()> {
    // SAFETY: SIG_DFL is a valid disposition for SIGPIPE; no memory is passed.
    if unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) } == libc::SIG_ERR {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Whether `fd` is a pipe (or FIFO).
pub fn is_pipe(fd: RawFd) -> io::Result<bool> {
    Ok(fstat(fd)?.st_mode & libc::S_IFMT == libc::S_IFIFO)
}

/// Credentials of the process at the other end of a Unix socket (`SO_PEERCRED`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeerCred {
    pub pid: i32,
    pub uid: u32,
    pub gid: u32,
}

/// The peer credentials of a connected Unix socket, as the kernel recorded them at `connect`.
pub fn peer_cred(sock: RawFd) -> io::Result<PeerCred> {
    // SAFETY: ucred is plain data; all-zero is a valid value.
    let mut c: libc::ucred = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: c and len are live and sized for SO_PEERCRED.
    cvt(unsafe {
        libc::getsockopt(
            sock,
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut c as *mut libc::ucred).cast(),
            &mut len,
        )
    } as libc::c_long)?;
    Ok(PeerCred {
        pid: c.pid,
        uid: c.uid,
        gid: c.gid,
    })
}

/// A pidfd of the process at the other end of a Unix socket: `SO_PEERPIDFD` (Linux 6.5), which
/// names the process that connected even if its pid was reused since; else `pidfd_open(pid)`
/// with the pid from [`peer_cred`] (`pid` 0, a peer in another pid namespace, has none).
pub fn peer_pidfd(sock: RawFd, pid: i32) -> io::Result<OwnedFd> {
    let mut fd: libc::c_int = -1;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: fd and len are live and sized for SO_PEERPIDFD (an int).
    let got = unsafe {
        libc::getsockopt(
            sock,
            libc::SOL_SOCKET,
            SO_PEERPIDFD,
            (&mut fd as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    if got == 0 && fd >= 0 {
        // SAFETY: the kernel just returned this descriptor and nobody else owns it.
        return Ok(unsafe { OwnedFd::from_raw_fd(fd) });
    }
    if pid <= 0 {
        return Err(io::Error::from_raw_os_error(libc::ESRCH));
    }
    // SAFETY: no memory is passed to the kernel.
    let fd = cvt(unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) })?;
    // SAFETY: the kernel just returned this descriptor and nobody else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// Whether the process behind `pidfd` has exited; with `wait`, waits until it has.
pub fn pidfd_exited(pidfd: RawFd, wait: bool) -> io::Result<bool> {
    let mut p = libc::pollfd {
        fd: pidfd,
        events: libc::POLLIN,
        revents: 0,
    };
    loop {
        // SAFETY: `p` is one live pollfd.
        let n = unsafe { libc::poll(&mut p, 1, if wait { -1 } else { 0 }) };
        if n >= 0 {
            return Ok(n > 0);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Sends all of `data` on a stream socket, with `fd` attached (`SCM_RIGHTS`) to the first byte.
pub fn send_with_fd(sock: RawFd, data: &[u8], fd: Option<RawFd>) -> io::Result<()> {
    let mut sent = 0;
    let mut fd = fd;
    while sent < data.len() {
        let mut iov = libc::iovec {
            iov_base: data[sent..].as_ptr() as *mut libc::c_void,
            iov_len: data.len() - sent,
        };
        // Room for one descriptor; u64 words keep the control buffer aligned for cmsghdr.
        let mut cbuf = [0u64; 4];
        // SAFETY: msghdr is plain data; all-zero is a valid value.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        if let Some(f) = fd {
            // SAFETY: CMSG_SPACE is a pure computation.
            let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32) } as usize;
            msg.msg_control = cbuf.as_mut_ptr().cast();
            msg.msg_controllen = space;
            // SAFETY: msg_control points to `space` writable, aligned bytes, enough for one
            // header carrying one descriptor.
            unsafe {
                let c = libc::CMSG_FIRSTHDR(&msg);
                (*c).cmsg_level = libc::SOL_SOCKET;
                (*c).cmsg_type = libc::SCM_RIGHTS;
                (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<RawFd>() as u32) as usize;
                std::ptr::write_unaligned(libc::CMSG_DATA(c).cast::<RawFd>(), f);
            }
        }
        // SAFETY: msg points to live buffers; MSG_NOSIGNAL turns a closed peer into EPIPE.
        let n = cvt(unsafe { libc::sendmsg(sock, &msg, libc::MSG_NOSIGNAL) } as libc::c_long)?;
        fd = None;
        sent += n as usize;
    }
    Ok(())
}

/// Receives up to `buf.len()` bytes (at least one unless the peer closed: then `Ok((0, None))`),
/// with a descriptor if one was attached. Extra attached descriptors are closed.
pub fn recv_with_fd(sock: RawFd, buf: &mut [u8]) -> io::Result<(usize, Option<OwnedFd>)> {
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    let mut cbuf = [0u64; 16];
    // SAFETY: msghdr is plain data; all-zero is a valid value.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = std::mem::size_of_val(&cbuf);
    // SAFETY: msg points to live buffers; MSG_CMSG_CLOEXEC keeps received descriptors from leaking
    // into children.
    let n = cvt(unsafe { libc::recvmsg(sock, &mut msg, libc::MSG_CMSG_CLOEXEC) } as libc::c_long)?;
    let mut got = None;
    // SAFETY: the kernel filled msg_control with msg_controllen bytes of well-formed headers;
    // CMSG_FIRSTHDR/NXTHDR stay inside them, and each received descriptor is new and ours alone.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(c).cast::<RawFd>();
                let count = ((*c).cmsg_len - libc::CMSG_LEN(0) as usize) / 4;
                for k in 0..count {
                    let f = OwnedFd::from_raw_fd(std::ptr::read_unaligned(data.add(k)));
                    if got.is_none() {
                        got = Some(f);
                    } // else dropped: closed
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    Ok((n as usize, got))
}

/// Runs `child` in the child after every `fork` of this process (`pthread_atfork`).
pub fn on_fork_child(child: extern "C" fn()) -> io::Result<()> {
    // SAFETY: `child` is a plain function valid for the life of the program.
    let r = unsafe { libc::pthread_atfork(None, None, Some(child)) };
    if r != 0 {
        return Err(io::Error::from_raw_os_error(r));
    }
    Ok(())
}

/// Shuts a socket down in both directions (a thread blocked in `accept` on it returns).
pub fn shutdown_socket(fd: RawFd) -> io::Result<()> {
    // SAFETY: no memory is passed to the kernel.
    cvt(unsafe { libc::shutdown(fd, libc::SHUT_RDWR) } as libc::c_long).map(drop)
}

/// Runs `prepare` in the forking thread before every `fork` of this process (`pthread_atfork`).
pub fn on_fork(prepare: extern "C" fn()) -> io::Result<()> {
    // SAFETY: `prepare` is a plain function valid for the life of the program.
    let r = unsafe { libc::pthread_atfork(Some(prepare), None, None) };
    if r != 0 {
        return Err(io::Error::from_raw_os_error(r));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The pipe path the daemon copies through: in order, bounded by the pipe's capacity, and
    /// never waiting.
    #[test]
    fn pages_pass_through_a_pipe_in_order_without_waiting() {
        let pages = 8;
        let src = mmap_anonymous(pages * PAGE_SIZE).unwrap();
        for i in 0..pages {
            // SAFETY: page i of the fresh private mapping above, owned by this test.
            unsafe { std::ptr::write_bytes(src.add(i * PAGE_SIZE), 1 + i as u8, PAGE_SIZE) };
        }
        let srcs: Vec<usize> = (0..pages).map(|i| src as usize + i * PAGE_SIZE).collect();
        let (r, w) = pipe().unwrap();
        // A pipe of 4 pages takes 4 of the 8 and does not wait for room.
        assert_eq!(
            set_pipe_capacity(w.as_raw_fd(), 4 * PAGE_SIZE).unwrap(),
            4 * PAGE_SIZE
        );
        assert_eq!(vmsplice_pages(w.as_raw_fd(), &srcs).unwrap(), 4);
        assert_eq!(pipe_pending(r.as_raw_fd()).unwrap(), 4 * PAGE_SIZE);
        let file = memfd_create(c"pipe-test").unwrap();
        ftruncate(file.as_raw_fd(), (pages * PAGE_SIZE) as u64).unwrap();
        let moved = splice_to_file(
            r.as_raw_fd(),
            file.as_raw_fd(),
            PAGE_SIZE as u64,
            3 * PAGE_SIZE,
        );
        assert_eq!(moved.unwrap(), 3 * PAGE_SIZE);
        let mut got = vec![0u8; PAGE_SIZE];
        for k in 0..3 {
            // SAFETY: `got` is a live local buffer of PAGE_SIZE bytes.
            let n = unsafe {
                pread_into(
                    file.as_raw_fd(),
                    got.as_mut_ptr(),
                    PAGE_SIZE,
                    ((1 + k) * PAGE_SIZE) as u64,
                )
            };
            assert_eq!(n.unwrap(), PAGE_SIZE);
            assert!(got.iter().all(|&b| b == 1 + k as u8), "page {k}");
        }
        // One page left: dropped; then an empty pipe answers at once.
        assert_eq!(drain_pipe(r.as_raw_fd(), 4 * PAGE_SIZE).unwrap(), PAGE_SIZE);
        assert_eq!(pipe_pending(r.as_raw_fd()).unwrap(), 0);
        assert_eq!(
            splice_to_file(r.as_raw_fd(), file.as_raw_fd(), 0, PAGE_SIZE).unwrap(),
            0
        );
        assert!(is_pipe(r.as_raw_fd()).unwrap() && !is_pipe(file.as_raw_fd()).unwrap());
        // SAFETY: mapped above; nothing refers to it any more.
        unsafe { munmap(src, pages * PAGE_SIZE) }.unwrap();
    }
}
