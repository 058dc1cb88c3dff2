//! Files behind memory, memfds above all (the engine's stable store): creation, seals, a read-only
//! reopening, size, hole punching, and vectored page writes and reads at offsets.

use std::ffi::{CStr, CString};
use std::io;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};

use crate::{cvt, fstat, page_iovecs, IOV_MAX, PAGE_SIZE};

/// Creates a memfd (close-on-exec) named `name` for diagnostics in `/proc/PID/maps`.
pub fn memfd_create(name: &CStr) -> io::Result<OwnedFd> {
    // SAFETY: name is a valid NUL-terminated string.
    let fd = cvt(unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) } as libc::c_long)?;
    // SAFETY: fd was just returned by the kernel and is owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
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

/// Sets the size of the file behind `fd`.
pub fn ftruncate(fd: RawFd, len: u64) -> io::Result<()> {
    // SAFETY: no memory is passed to the kernel.
    cvt(unsafe { libc::ftruncate(fd, len as libc::off_t) } as libc::c_long).map(drop)
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
