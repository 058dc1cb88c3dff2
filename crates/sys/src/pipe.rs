//! Pipes: creation and capacity, handing pages over by reference (`vmsplice`), and moving or
//! discarding what waits in them (`splice`).

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use crate::{cvt, fstat, page_iovecs, IOV_MAX, PAGE_SIZE};

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
    cvt(unsafe { crate::raw_ioctl(fd, libc::FIONREAD, &mut n) } as libc::c_long)?;
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

/// Whether `fd` is a pipe (or FIFO).
pub fn is_pipe(fd: RawFd) -> io::Result<bool> {
    Ok(fstat(fd)?.st_mode & libc::S_IFMT == libc::S_IFIFO)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ftruncate, memfd_create, mmap_anonymous, munmap, pread_into};

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
