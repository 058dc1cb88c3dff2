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
//!
//! # Layout
//!
//! One file per kernel object, as in mio's `sys/unix`; everything is re-exported here flat, so a
//! caller writes `pageone_sys::pipe`, never the module:
//!
//! * `mm.rs`: this process's mappings (`mmap`, `munmap`, `mremap`, `madvise`), the raw calls
//!   the `LD_PRELOAD` shim needs, the page size, and the C heap's trimming.
//! * `uffd.rs`: a userfaultfd context ([`Uffd`]) and its ioctls.
//! * `pagemap.rs`: `/proc/self/pagemap` ([`Pagemap`]) and its `PAGEMAP_SCAN` ioctl.
//! * `cgroup.rs`: the process's memory cgroup (how close its usage is to a limit).
//! * `procfs.rs`: the text files of `/proc`: `maps` ([`Mapping`]), `meminfo`, `smaps_rollup`,
//!   `status`, and `vm.max_map_count`.
//! * `memfd.rs`: files behind memory (memfds, seals, holes, vectored writes and reads at
//!   offsets).
//! * `pipe.rs`: pipes (capacity, `vmsplice` of pages, `splice` out of them).
//! * `uds.rs`: Unix sockets (descriptors passed with `SCM_RIGHTS`, the peer's credentials and
//!   pidfd, shutdown).
//! * `process.rs`: the process and its threads (eventfd, poll, CPU clocks, affinity, fork
//!   hooks, `SIGPIPE`, pidfds, randomness, `prctl`).
//! * `sched.rs`: the scheduler (a thread's class, its wait on run queues, and the background
//!   policy of engine and daemon threads: [`Background`]).
//! * `signal.rs`: signals a supervisor handles itself (blocked and waited for, passed on, sent
//!   to a child when its parent dies), and the process's CPU time.
//! * `uapi.rs`: kernel constants and structures newer than the build host's headers (public as
//!   [`uapi`]: callers name them `pageone_sys::uapi::...`).
//!
//! The few helpers several files share (errno conversion, `fstat`, page iovecs) live here.

use std::io;
use std::os::fd::RawFd;

mod access;
mod cgroup;
mod epoll;
mod memfd;
mod mm;
mod pagemap;
mod pipe;
mod process;
mod procfs;
mod sched;
mod signal;
pub mod uapi;
mod uds;
mod uffd;

pub use access::*;
pub use cgroup::*;
pub use epoll::*;
pub use memfd::*;
pub use mm::*;
pub use pagemap::*;
pub use pipe::*;
pub use process::*;
pub use procfs::*;
pub use sched::*;
pub use signal::*;
pub use uds::*;
pub use uffd::*;

/// `ioctl(2)` as a raw system call: the `LD_PRELOAD` shim interposes the C library's `ioctl`
/// (to see userfaultfd registrations of the program's), and the engine's own calls must not go
/// through it.
///
/// # Safety
/// `arg` must be what `req` expects of the caller.
unsafe fn raw_ioctl<T>(fd: RawFd, req: u64, arg: *mut T) -> libc::c_int {
    // SAFETY: forwarded to the caller's contract.
    unsafe { libc::syscall(libc::SYS_ioctl, fd, req, arg) as libc::c_int }
}

/// Converts a `-1`-on-error return into `io::Result`.
fn cvt(ret: libc::c_long) -> io::Result<libc::c_long> {
    if ret == -1 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

/// `fstat` of `fd`.
fn fstat(fd: RawFd) -> io::Result<libc::stat> {
    // SAFETY: stat is plain data; all-zero is a valid value.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: st is a live, writable stat buffer.
    cvt(unsafe { libc::fstat(fd, &mut st) } as libc::c_long)?;
    Ok(st)
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
