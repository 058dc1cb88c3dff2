//! Which daemon a client trusts: one that runs as root, as the client's own user, or as the
//! system daemon's user ([`DAEMON_USER`], if that user exists), by the socket's `SO_PEERCRED`.
//! A client also checks the store it is handed (`store::check`): it must belong to that uid.

use std::ffi::CStr;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;

use pageone_sys as sys;

use crate::ProtoError;

/// The user the system daemon runs as (`contrib/pageone.service`).
pub const DAEMON_USER: &CStr = c"pageone";

/// Whether a daemon running as `uid` may serve this process.
pub fn trusted_daemon_uid(uid: u32) -> bool {
    uid == 0 || uid == sys::euid() || daemon_user_uid() == Some(uid)
}

/// The uid of [`DAEMON_USER`], if that user exists.
pub fn daemon_user_uid() -> Option<u32> {
    sys::user_id(DAEMON_USER).ok().flatten()
}

/// The credentials of the daemon at the other end of `sock`, if it is one this process trusts
/// (see [`trusted_daemon_uid`]).
pub fn check_daemon(sock: &UnixStream) -> Result<sys::PeerCred, ProtoError> {
    let cred = sys::peer_cred(sock.as_raw_fd())?;
    if trusted_daemon_uid(cred.uid) {
        return Ok(cred);
    }
    Err(ProtoError::Untrusted(format!(
        "the process answering (pid {}) runs as uid {}, not as root, as this process's uid {} \
         or as the user {}",
        cred.pid,
        cred.uid,
        sys::euid(),
        DAEMON_USER.to_string_lossy()
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn root_and_this_user_are_trusted_and_no_one_else() {
        assert!(trusted_daemon_uid(0));
        assert!(trusted_daemon_uid(sys::euid()));
        // Neither this user nor root nor the daemon's user (absent here, or another uid).
        let other = 4_000_000_000u32;
        assert_eq!(trusted_daemon_uid(other), daemon_user_uid() == Some(other));
    }

    #[test]
    fn a_daemon_of_this_user_passes() {
        let (a, _b) = UnixStream::pair().unwrap();
        let cred = check_daemon(&a).unwrap();
        assert_eq!(cred.uid, sys::euid());
    }
}
