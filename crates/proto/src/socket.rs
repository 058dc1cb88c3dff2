//! Where a daemon's socket lives: the default paths, and the directories that may hold one.
//!
//! The default socket is `$XDG_RUNTIME_DIR/pageone.sock` (a directory of the user's own, 0700 by
//! the login manager), else for root [`SYSTEM_SOCKET`]; there is no fallback into a directory
//! others can write (a socket in `/tmp` could be bound first by anyone).
//!
//! A daemon binds only in a [`TrustedDir`]: reached from `/` without following a symbolic link,
//! every directory on the way owned by root or by the daemon's user and writable by nobody else
//! (or sticky, like `/tmp`, where only an entry's owner may remove or rename it). `pageone run`
//! gives its private daemon a [`PrivateDir`]: a fresh 0700 directory of a random name.

use std::ffi::{CStr, CString, OsStr};
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Component, Path, PathBuf};

use pageone_sys as sys;

use crate::ProtoError;

/// The name of a daemon's socket in its directory.
pub const SOCKET_NAME: &str = "pageone.sock";
/// The system daemon's socket (`contrib/pageone.service`).
pub const SYSTEM_SOCKET: &str = "/run/pageone/pageone.sock";

/// The default socket of a process running as `euid` whose `$XDG_RUNTIME_DIR` is
/// `runtime_dir`: `$XDG_RUNTIME_DIR/pageone.sock`, else [`SYSTEM_SOCKET`] for root, else none.
pub fn default_socket_for(euid: u32, runtime_dir: Option<&OsStr>) -> Result<PathBuf, ProtoError> {
    match runtime_dir.map(Path::new) {
        Some(d) if d.is_absolute() => Ok(d.join(SOCKET_NAME)),
        _ if euid == 0 => Ok(SYSTEM_SOCKET.into()),
        _ => Err(ProtoError::NoDefaultSocket),
    }
}

/// This process's default socket (see [`default_socket_for`]).
pub fn default_socket() -> Result<PathBuf, ProtoError> {
    default_socket_for(sys::euid(), crate::setting("XDG_RUNTIME_DIR").as_deref())
}

/// A directory that may hold a daemon's socket (see the module's description), open by
/// descriptor: entries are made and removed through it, so a rename of a directory on its
/// path afterwards changes nothing.
pub struct TrustedDir {
    fd: OwnedFd,
    path: PathBuf,
}

/// Why `info`, a directory on a socket's path, cannot be trusted by a process running as
/// `euid`.
fn untrusted(info: &sys::FileInfo, euid: u32) -> Option<String> {
    if info.kind() != libc::S_IFDIR {
        return Some("is not a directory".into());
    }
    if info.uid != 0 && info.uid != euid {
        return Some(format!("belongs to uid {}", info.uid));
    }
    let p = info.permissions();
    if p & 0o022 != 0 && p & libc::S_ISVTX == 0 {
        return Some(format!("may be written by others (mode {p:o})"));
    }
    None
}

fn unsafe_path(path: &Path, why: impl Into<String>) -> ProtoError {
    ProtoError::UnsafePath {
        path: path.to_path_buf(),
        why: why.into(),
    }
}

impl TrustedDir {
    /// Opens the directory `path` (relative: to the current directory), checking every
    /// directory from `/` on. With `create`, a missing last directory is made with that mode.
    pub fn open(path: &Path, create: Option<u32>) -> Result<Self, ProtoError> {
        let abs = if path.is_absolute() {
            path.to_path_buf()
        } else {
            std::env::current_dir()?.join(path)
        };
        let euid = sys::euid();
        let mut fd = sys::open_dir_at(None, c"/")?;
        let mut at = PathBuf::from("/");
        let parts: Vec<Component> = abs.components().skip(1).collect();
        for (i, part) in parts.iter().enumerate() {
            let Component::Normal(name) = part else {
                return Err(unsafe_path(&abs, "has `.` or `..` in it"));
            };
            let c = sys::c_name(name)?;
            at.push(name);
            let next = match sys::open_dir_at(Some(fd.as_fd()), &c) {
                Err(e) if e.kind() == io::ErrorKind::NotFound && i + 1 == parts.len() => {
                    let Some(mode) = create else {
                        return Err(unsafe_path(&at, "does not exist"));
                    };
                    sys::mkdir_at(fd.as_fd(), &c, mode)
                        .map_err(|e| unsafe_path(&at, format!("cannot be created: {e}")))?;
                    sys::open_dir_at(Some(fd.as_fd()), &c)?
                }
                Err(e) if e.raw_os_error() == Some(libc::ENOTDIR) => {
                    return Err(unsafe_path(&at, "is a symbolic link or not a directory"))
                }
                Err(e) => return Err(unsafe_path(&at, e.to_string())),
                Ok(next) => next,
            };
            if let Some(why) = untrusted(&sys::file_info(fd_raw(&next))?, euid) {
                return Err(unsafe_path(&at, why));
            }
            fd = next;
        }
        Ok(Self { fd, path: abs })
    }

    /// Opens the directory a socket at `socket` goes in (see [`TrustedDir::open`]), and the
    /// socket's name in it.
    pub fn of_socket(socket: &Path, create: Option<u32>) -> Result<(Self, CString), ProtoError> {
        let (Some(dir), Some(name)) = (socket.parent(), socket.file_name()) else {
            return Err(unsafe_path(socket, "names no file in a directory"));
        };
        let dir = if dir.as_os_str().is_empty() {
            Path::new(".")
        } else {
            dir
        };
        Ok((Self::open(dir, create)?, sys::c_name(name)?))
    }

    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// A path reaching `name` in this directory through its descriptor (for `bind` and
    /// `connect`, which take paths).
    pub fn entry(&self, name: &CStr) -> PathBuf {
        sys::path_in(self.fd(), name)
    }
}

fn fd_raw(fd: &OwnedFd) -> std::os::fd::RawFd {
    use std::os::fd::AsRawFd;
    fd.as_raw_fd()
}

/// A fresh directory of this process's user, mode 0700, with a random name (as `mkdtemp`
/// makes them, through the parent's descriptor: `mkdir` never follows a link, and fails if
/// anything is there). Removed, with the socket in it, when dropped.
pub struct PrivateDir {
    parent: TrustedDir,
    name: CString,
    dir: TrustedDir,
}

impl PrivateDir {
    /// Makes one in `parent` (a [`TrustedDir`]), named `prefix` and 16 random hex digits.
    pub fn new(parent: &Path, prefix: &str) -> Result<Self, ProtoError> {
        let parent = TrustedDir::open(parent, None)?;
        for _ in 0..16 {
            let name = CString::new(format!("{prefix}{:016x}", sys::random_u64()?))
                .map_err(|_| unsafe_path(parent.path(), "prefix contains NUL"))?;
            match sys::mkdir_at(parent.fd(), &name, 0o700) {
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(unsafe_path(parent.path(), e.to_string())),
                Ok(()) => {}
            }
            let path = parent.path().join(OsStr::new(&*name.to_string_lossy()));
            let fd = sys::open_dir_at(Some(parent.fd()), &name)?;
            let info = sys::file_info(fd_raw(&fd))?;
            if info.uid != sys::euid() || info.permissions() & 0o077 != 0 {
                return Err(unsafe_path(&path, "was not made private"));
            }
            return Ok(Self {
                parent,
                name,
                dir: TrustedDir { fd, path },
            });
        }
        Err(unsafe_path(parent.path(), "no fresh name was free"))
    }

    pub fn dir(&self) -> &TrustedDir {
        &self.dir
    }

    /// Where this directory's daemon listens: `SOCKET_NAME` in it.
    pub fn socket(&self) -> PathBuf {
        self.dir.path().join(SOCKET_NAME)
    }
}

impl Drop for PrivateDir {
    fn drop(&mut self) {
        let socket = CString::new(SOCKET_NAME).expect("no NUL in the socket's name");
        let _ = sys::unlink_at(self.dir.fd(), &socket, false);
        let _ = sys::unlink_at(self.parent.fd(), &self.name, true);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_default_socket_in_a_directory_others_share() {
        let rt = Some(OsStr::new("/run/user/1000"));
        assert_eq!(
            default_socket_for(1000, rt).unwrap(),
            PathBuf::from("/run/user/1000/pageone.sock")
        );
        assert_eq!(
            default_socket_for(0, None).unwrap(),
            PathBuf::from(SYSTEM_SOCKET)
        );
        // Formerly /tmp/pageone-1000.sock, which any user could bind first.
        assert!(matches!(
            default_socket_for(1000, None),
            Err(ProtoError::NoDefaultSocket)
        ));
        assert!(matches!(
            default_socket_for(1000, Some(OsStr::new("relative"))),
            Err(ProtoError::NoDefaultSocket)
        ));
    }

    fn scratch(name: &str) -> PathBuf {
        let p = std::env::temp_dir().join(format!("pageone-proto-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir(&p).unwrap();
        p
    }

    #[test]
    fn a_path_through_a_link_or_a_loose_directory_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let base = scratch("trust");
        std::fs::create_dir(base.join("real")).unwrap();
        std::os::unix::fs::symlink(base.join("real"), base.join("link")).unwrap();
        assert!(TrustedDir::open(&base.join("real"), None).is_ok());
        let e = TrustedDir::open(&base.join("link"), None).err().unwrap();
        assert!(e.to_string().contains("symbolic link"), "{e}");
        let e = TrustedDir::open(&base.join("link/sub"), Some(0o700))
            .err()
            .unwrap();
        assert!(e.to_string().contains("symbolic link"), "{e}");
        assert!(!base.join("real/sub").exists());
        // Writable by others, not sticky.
        std::fs::set_permissions(base.join("real"), std::fs::Permissions::from_mode(0o777))
            .unwrap();
        let e = TrustedDir::open(&base.join("real"), None).err().unwrap();
        assert!(e.to_string().contains("written by others"), "{e}");
        // Sticky, like /tmp: trusted.
        std::fs::set_permissions(base.join("real"), std::fs::Permissions::from_mode(0o1777))
            .unwrap();
        assert!(TrustedDir::open(&base.join("real"), None).is_ok());
        // Made when missing (the last component only).
        let made = TrustedDir::open(&base.join("real/new"), Some(0o700)).unwrap();
        assert!(made.path().ends_with("real/new"));
        assert!(TrustedDir::open(&base.join("real/a/b"), Some(0o700)).is_err());
        std::fs::remove_dir_all(&base).unwrap();
    }

    #[test]
    fn a_directory_of_another_user_is_refused() {
        if sys::euid() != 0 {
            return; // (only root can give a directory away)
        }
        use std::os::unix::fs::PermissionsExt;
        let base = scratch("owner");
        let theirs = base.join("theirs");
        std::fs::create_dir(&theirs).unwrap();
        std::fs::set_permissions(&theirs, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::os::unix::fs::chown(&theirs, Some(65534), Some(65534)).unwrap();
        let e = TrustedDir::open(&theirs, None).err().unwrap();
        assert!(e.to_string().contains("belongs to uid 65534"), "{e}");
        std::fs::remove_dir_all(&base).unwrap();
    }

    #[test]
    fn a_private_directory_is_fresh_0700_and_goes_when_dropped() {
        use std::os::unix::fs::PermissionsExt;
        let base = scratch("private");
        let a = PrivateDir::new(&base, "run-").unwrap();
        let b = PrivateDir::new(&base, "run-").unwrap();
        assert_ne!(a.dir().path(), b.dir().path());
        let meta = std::fs::metadata(a.dir().path()).unwrap();
        assert_eq!(meta.permissions().mode() & 0o777, 0o700);
        assert_eq!(a.socket(), a.dir().path().join(SOCKET_NAME));
        std::fs::write(a.socket(), b"").unwrap();
        let path = a.dir().path().to_path_buf();
        drop(a);
        assert!(!path.exists());
        drop(b);
        assert_eq!(std::fs::read_dir(&base).unwrap().count(), 0);
        std::fs::remove_dir(&base).unwrap();
    }
}
