//! Unix stream sockets between pageone's processes: data with a descriptor attached
//! (`SCM_RIGHTS`), the peer's credentials and a pidfd of it, and shutting a socket down.

use std::io;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};

use crate::cvt;
use crate::uapi::SO_PEERPIDFD;

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

/// Shuts a socket down in both directions (a thread blocked in `accept` on it returns).
pub fn shutdown_socket(fd: RawFd) -> io::Result<()> {
    // SAFETY: no memory is passed to the kernel.
    cvt(unsafe { libc::shutdown(fd, libc::SHUT_RDWR) } as libc::c_long).map(drop)
}

/// Whether the peer of a connected stream socket closed it (or it failed), asked without
/// waiting: what a reader would find is the end of the stream.
pub fn peer_closed(sock: RawFd) -> bool {
    let mut p = libc::pollfd {
        fd: sock,
        events: libc::POLLRDHUP,
        revents: 0,
    };
    // SAFETY: `p` is one live pollfd; a timeout of 0 never blocks.
    let r = unsafe { libc::poll(&mut p, 1, 0) };
    r == 1 && p.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;
    use std::os::unix::net::UnixStream;

    /// Open, a socket's peer is not closed, with or without data waiting; closed, it is.
    #[test]
    fn a_closed_peer_is_seen_without_waiting() {
        let (a, b) = UnixStream::pair().unwrap();
        assert!(!peer_closed(a.as_raw_fd()));
        std::io::Write::write_all(&mut &b, b"x").unwrap();
        assert!(!peer_closed(a.as_raw_fd()), "data waiting is not a close");
        drop(b);
        assert!(peer_closed(a.as_raw_fd()));
    }
}
