//! The listening socket and the connections: where the socket is made (a trusted directory,
//! never through a symbolic link, its mode set before `bind`), who is let in (the daemon's and
//! each user's connection caps), and how long a connection may idle or stall.

use std::ffi::CString;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use pageone_proto::socket::TrustedDir;
use pageone_proto::{self as proto, Deadlines, ProtoError, Reply, Request};
use pageone_sys as sys;

use crate::session::{Peer, Session};
use crate::{DaemonConfig, DaemonError, Inner};

/// Whether a daemon running as `uid` is a system daemon (root, or the `pageone` user): its
/// socket is for every local user. Any other daemon serves its own user only.
fn system_daemon(uid: u32) -> bool {
    uid == 0 || proto::auth::daemon_user_uid() == Some(uid)
}

/// The socket's mode: 0666 for a system daemon (any local user may connect: the scope is
/// decided from the peer's uid, and every cap is per user), 0600 for a per-user daemon.
fn socket_mode(uid: u32) -> u32 {
    if system_daemon(uid) {
        0o666
    } else {
        0o600
    }
}

/// Where the socket is: its trusted directory and its name in it.
pub(crate) struct SocketPlace {
    dir: TrustedDir,
    name: CString,
}

impl SocketPlace {
    /// Removes the socket (through the directory's descriptor).
    pub(crate) fn remove(&self) {
        let _ = sys::unlink_at(self.dir.fd(), &self.name, false);
    }
}

/// A bound daemon; [`Daemon::run`] serves it.
pub struct Daemon {
    listener: UnixListener,
    /// The metrics' listener, when asked for.
    metrics: Option<std::net::TcpListener>,
    inner: Arc<Inner>,
}

impl Daemon {
    /// Binds the socket in a [`TrustedDir`] (its last directory is made if missing: 0755 for a
    /// system daemon, 0700 otherwise). A stale socket of this user's dead daemon is replaced; a
    /// live daemon's, another user's, or anything but a socket is not.
    pub fn bind(config: DaemonConfig) -> Result<Self, DaemonError> {
        let path = config.socket.clone();
        let euid = sys::euid();
        let dir_mode = if system_daemon(euid) { 0o755 } else { 0o700 };
        let (dir, name) = TrustedDir::of_socket(&path, Some(dir_mode))?;
        clear_stale(&dir, &name, &path)?;
        let bind_err = |source| DaemonError::Bind {
            path: path.clone(),
            source,
        };
        let listener = sys::bind_unix(&dir.entry(&name), socket_mode(euid), libc::SOMAXCONN)
            .map_err(bind_err)?;
        tracing::info!(socket = %path.display(), "pageone daemon listening");
        let place = SocketPlace { dir, name };
        let metrics = match config.metrics {
            Some(addr) => Some(
                std::net::TcpListener::bind(addr)
                    .map_err(|source| DaemonError::Metrics { addr, source })?,
            ),
            None => None,
        };
        Ok(Self {
            listener,
            metrics,
            inner: Arc::new(Inner::new(config, Some(place))),
        })
    }

    pub fn socket(&self) -> &Path {
        &self.inner.config.socket
    }

    /// The address metrics are served at (with the port the system chose for port 0).
    pub fn metrics_addr(&self) -> Option<std::net::SocketAddr> {
        self.metrics.as_ref().and_then(|l| l.local_addr().ok())
    }

    /// Serves clients until the process ends (or, with `exit_when_idle`, until the last client
    /// left).
    pub fn run(self) -> io::Result<()> {
        sys::set_background_priority(self.inner.config.priority);
        if let Some(listener) = self.metrics {
            let inner = self.inner.clone();
            std::thread::Builder::new()
                .name("pageone-metrics".into())
                .spawn(move || crate::metrics::serve(listener, inner))?;
        }
        let served = Arc::new(AtomicU64::new(0));
        for conn in self.listener.incoming() {
            let sock = match conn {
                Ok(s) => s,
                Err(e) => {
                    // Out of descriptors or memory: serve the others, retry shortly.
                    tracing::warn!(error = %e, "could not accept a client");
                    std::thread::sleep(Duration::from_millis(50));
                    continue;
                }
            };
            let Ok(cred) = sys::peer_cred(sock.as_raw_fd()) else {
                continue;
            };
            let connection = match self.inner.accounts.connect(cred.uid, &self.inner.limits) {
                Ok(c) => c,
                Err(why) => {
                    // (A fresh connection's buffer takes this small frame without waiting.)
                    let refusal = Reply::Error(why).encode();
                    let short = Some(Duration::from_millis(100));
                    let _ = proto::write_frame_within(&sock, &refusal, None, short);
                    continue;
                }
            };
            let inner = self.inner.clone();
            let served = served.clone();
            let listener_fd = self.listener.as_raw_fd();
            let spawned = std::thread::Builder::new()
                .name("pageone-client".into())
                .spawn(move || {
                    // Copies and lookups are done for clients' engines, which run in the
                    // background: so does this work (see `sys::Background`).
                    let mut background = sys::Background::start();
                    let peer = Peer {
                        uid: cred.uid,
                        pid: cred.pid,
                        pidfd: sys::peer_pidfd(sock.as_raw_fd(), cred.pid).ok(),
                    };
                    let session = Session::new(inner.clone(), peer, connection);
                    if serve(&inner, sock, session, &mut background) {
                        // Relaxed: a flag-like count read by the threads of later exits.
                        served.fetch_add(1, Ordering::Relaxed);
                    }
                    // Relaxed: see above; the connection count is read under its lock.
                    let served = served.load(Ordering::Relaxed) > 0;
                    if inner.config.exit_when_idle && served && inner.accounts.connections() == 0 {
                        tracing::info!("last client left; exiting");
                        if let Some(place) = &inner.socket {
                            place.remove();
                        }
                        let _ = sys::shutdown_socket(listener_fd);
                        std::process::exit(0);
                    }
                });
            if let Err(e) = spawned {
                tracing::warn!(error = %e, "could not start a client thread");
            }
        }
        Ok(())
    }
}

/// Makes room for the socket: nothing there, or a stale socket of this user (nobody answers on
/// it), which goes. Never follows a link (`fstatat` without following, `unlinkat`).
fn clear_stale(dir: &TrustedDir, name: &CString, path: &Path) -> Result<(), DaemonError> {
    let occupied = |why: String| DaemonError::Occupied {
        path: path.to_path_buf(),
        why,
    };
    let info = match sys::file_info_at(dir.fd(), name) {
        Ok(info) => info,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(occupied(e.to_string())),
    };
    if info.kind() != libc::S_IFSOCK {
        return Err(occupied("is something else than a socket".into()));
    }
    if UnixStream::connect(dir.entry(name)).is_ok() {
        return Err(DaemonError::InUse(path.to_path_buf()));
    }
    if info.uid != sys::euid() {
        return Err(occupied(format!("is a socket of uid {}", info.uid)));
    }
    sys::unlink_at(dir.fd(), name, false).map_err(|e| occupied(e.to_string()))
}

/// Serves one connection until it ends; returns whether a client joined a scope on it.
fn serve(inner: &Inner, sock: UnixStream, mut session: Session, bg: &mut sys::Background) -> bool {
    let limits = &inner.limits;
    let frame = Some(limits.frame_timeout);
    let ended = loop {
        let idle = if session.is_joined() {
            limits.idle_timeout
        } else {
            limits.hello_timeout
        };
        let deadlines = Deadlines {
            idle: Some(idle),
            frame,
        };
        let (body, fd) = match proto::read_frame_within(&sock, &deadlines) {
            Ok(f) => f,
            Err(e) => break e,
        };
        let req = match Request::decode(&body) {
            Ok(r) => r,
            Err(e) => {
                let refusal = Reply::Error(e.to_string()).encode();
                let _ = proto::write_frame_within(&sock, &refusal, None, frame);
                break e;
            }
        };
        bg.check();
        let answer = session.handle(req, fd);
        let sent =
            proto::write_frame_within(&sock, &answer.reply.encode(), answer.fd.as_ref(), frame);
        if let Err(e) = sent {
            break e;
        }
        session.recycle(answer);
    };
    if !matches!(ended, ProtoError::Closed) {
        tracing::info!(error = %ended, "client connection ended");
    }
    let joined = session.is_joined();
    session.leave();
    joined
}
