//! epoll: waiting for several descriptors to become readable, registered once rather than handed
//! to the kernel at every wait (as `poll` does: a reference taken and dropped on each descriptor,
//! each time).

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use crate::cvt;

/// An epoll instance watching descriptors for reading.
#[derive(Debug)]
pub struct Epoll {
    fd: OwnedFd,
}

impl Epoll {
    /// A new instance, watching nothing (closed on `exec`).
    pub fn new() -> io::Result<Self> {
        // SAFETY: creates a new descriptor, owned below.
        let fd = cvt(unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) } as libc::c_long)?;
        // SAFETY: a fresh descriptor nobody else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd as RawFd) };
        Ok(Epoll { fd })
    }

    /// Watches `fd` for reading; `token` (below 64) names it in [`wait_readable`]'s answer.
    ///
    /// [`wait_readable`]: Self::wait_readable
    pub fn add(&self, fd: RawFd, token: u32) -> io::Result<()> {
        assert!(token < 64, "token {token} does not fit the answer's bits");
        let mut ev = libc::epoll_event {
            events: libc::EPOLLIN as u32,
            u64: u64::from(token),
        };
        // SAFETY: ev is a live epoll_event; the kernel copies it.
        cvt(
            unsafe { libc::epoll_ctl(self.fd.as_raw_fd(), libc::EPOLL_CTL_ADD, fd, &mut ev) }
                as libc::c_long,
        )
        .map(drop)
    }

    /// Waits up to `timeout_ms` (-1: no limit) until a watched descriptor is readable (or in
    /// error); returns the ready ones' tokens as bits (0 on a timeout). Allocates nothing.
    pub fn wait_readable(&self, timeout_ms: i32) -> io::Result<u64> {
        let mut evs = [libc::epoll_event { events: 0, u64: 0 }; 8];
        loop {
            // SAFETY: evs is a live array of evs.len() epoll_event structures.
            let n = unsafe {
                libc::epoll_wait(
                    self.fd.as_raw_fd(),
                    evs.as_mut_ptr(),
                    evs.len() as i32,
                    timeout_ms,
                )
            };
            match cvt(n as libc::c_long) {
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
                Ok(n) => {
                    let ready = libc::EPOLLIN as u32 | libc::EPOLLERR as u32;
                    return Ok(evs[..n as usize]
                        .iter()
                        .filter(|e| e.events & ready != 0)
                        .fold(0, |bits, e| bits | 1 << e.u64));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_readable_descriptor_is_named_by_its_token() {
        let ep = Epoll::new().unwrap();
        let (a, b) = (crate::eventfd().unwrap(), crate::eventfd().unwrap());
        ep.add(a.as_raw_fd(), 0).unwrap();
        ep.add(b.as_raw_fd(), 5).unwrap();
        assert_eq!(ep.wait_readable(0).unwrap(), 0, "nothing is readable yet");
        crate::eventfd_signal(b.as_raw_fd()).unwrap();
        assert_eq!(ep.wait_readable(1000).unwrap(), 1 << 5);
        crate::eventfd_signal(a.as_raw_fd()).unwrap();
        assert_eq!(ep.wait_readable(1000).unwrap(), 1 << 5 | 1);
    }
}
