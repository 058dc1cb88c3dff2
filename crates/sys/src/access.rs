//! Who may do what: credentials, owners and modes, seals, directories opened without following
//! symbolic links, and sockets created with their mode already set.

use std::ffi::{CStr, CString};
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::UnixListener;
use std::path::Path;

use super::cvt;

/// Owner, mode and size of a file (from `fstat`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FileInfo {
    pub uid: u32,
    pub gid: u32,
    /// `st_mode`: the file type (`S_IFMT` bits) and the permission bits.
    pub mode: u32,
    pub size: u64,
}

impl FileInfo {
    fn of(st: &libc::stat) -> Self {
        Self {
            uid: st.st_uid,
            gid: st.st_gid,
            mode: st.st_mode,
            size: st.st_size as u64,
        }
    }

    /// The file type bits (`S_IFDIR`, `S_IFSOCK`, `S_IFREG`, ...).
    pub fn kind(&self) -> u32 {
        self.mode & libc::S_IFMT
    }

    /// The permission bits (with set-id and sticky bits).
    pub fn permissions(&self) -> u32 {
        self.mode & 0o7777
    }
}

/// Owner, mode and size of the file behind `fd`.
pub fn file_info(fd: RawFd) -> io::Result<FileInfo> {
    super::fstat(fd).map(|st| FileInfo::of(&st))
}

/// Owner, mode and size of `name` in the directory `dir`, not following a symbolic link there.
pub fn file_info_at(dir: BorrowedFd<'_>, name: &CStr) -> io::Result<FileInfo> {
    // SAFETY: stat is plain data; all-zero is a valid value.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: name is NUL-terminated and st a live, writable stat buffer.
    cvt(unsafe {
        libc::fstatat(
            dir.as_raw_fd(),
            name.as_ptr(),
            &mut st,
            libc::AT_SYMLINK_NOFOLLOW,
        )
    } as libc::c_long)?;
    Ok(FileInfo::of(&st))
}

/// Sets the permission bits of the file behind `fd` (a socket's before `bind` become its
/// node's).
pub fn fchmod(fd: RawFd, mode: u32) -> io::Result<()> {
    // SAFETY: no memory is passed to the kernel.
    cvt(unsafe { libc::fchmod(fd, mode as libc::mode_t) } as libc::c_long).map(drop)
}

/// Gives the file behind `fd` to `uid` and `gid` (root only, or a no-op change).
pub fn fchown(fd: RawFd, uid: u32, gid: u32) -> io::Result<()> {
    // SAFETY: no memory is passed to the kernel.
    cvt(unsafe { libc::fchown(fd, uid, gid) } as libc::c_long).map(drop)
}

/// How `fd` was opened: `O_RDONLY`, `O_WRONLY` or `O_RDWR`.
pub fn access_mode(fd: RawFd) -> io::Result<libc::c_int> {
    // SAFETY: no memory is passed to the kernel.
    let flags = cvt(unsafe { libc::fcntl(fd, libc::F_GETFL) } as libc::c_long)?;
    Ok(flags as libc::c_int & libc::O_ACCMODE)
}

/// The seals (`F_SEAL_*`) of a memfd.
pub fn seals(fd: RawFd) -> io::Result<libc::c_int> {
    // SAFETY: no memory is passed to the kernel.
    cvt(unsafe { libc::fcntl(fd, libc::F_GET_SEALS) } as libc::c_long).map(|s| s as libc::c_int)
}

/// The effective uid of this process.
pub fn euid() -> u32 {
    // SAFETY: geteuid cannot fail and touches no memory.
    unsafe { libc::geteuid() }
}

/// The uid of the user `name` (`getpwnam_r`), or `None` if there is no such user.
pub fn user_id(name: &CStr) -> io::Result<Option<u32>> {
    let mut buf = vec![0 as libc::c_char; 1024];
    loop {
        // SAFETY: passwd is plain data; all-zero is a valid value.
        let mut pw: libc::passwd = unsafe { std::mem::zeroed() };
        let mut found: *mut libc::passwd = std::ptr::null_mut();
        // SAFETY: name is NUL-terminated; pw, buf (of buf.len() bytes) and found are live and
        // writable; the strings pw points to live in buf, which is read only through pw_uid here.
        let r = unsafe {
            libc::getpwnam_r(
                name.as_ptr(),
                &mut pw,
                buf.as_mut_ptr(),
                buf.len(),
                &mut found,
            )
        };
        match r {
            0 if found.is_null() => return Ok(None),
            0 => return Ok(Some(pw.pw_uid)),
            libc::ERANGE if buf.len() < 1 << 20 => buf.resize(buf.len() * 4, 0),
            // "Not found" comes back as one of these from some name services.
            libc::ENOENT | libc::ESRCH | libc::EBADF | libc::EPERM => return Ok(None),
            e => return Err(io::Error::from_raw_os_error(e)),
        }
    }
}

/// Whether this process runs in secure-execution mode (`getauxval(AT_SECURE)`: set-user-ID or
/// set-group-ID, or file capabilities): its environment is then its caller's to choose, and
/// settings must not be taken from it.
pub fn secure_execution() -> bool {
    // SAFETY: getauxval reads the auxiliary vector of this process; no memory is passed.
    unsafe { libc::getauxval(libc::AT_SECURE) != 0 }
}

/// Opens the directory `name` in `dir` (or the absolute or current-directory-relative `name`
/// when `dir` is `None`) as an `O_PATH` descriptor, failing with `ENOTDIR` if `name` is a
/// symbolic link (to a directory or not) or anything else but a directory. The descriptor names the directory itself
/// however the path changes later: use it with the `*_at` calls.
pub fn open_dir_at(dir: Option<BorrowedFd<'_>>, name: &CStr) -> io::Result<OwnedFd> {
    let at = dir.map_or(libc::AT_FDCWD, |d| d.as_raw_fd());
    let flags = libc::O_PATH | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC;
    // SAFETY: name is NUL-terminated.
    let fd = cvt(unsafe { libc::openat(at, name.as_ptr(), flags) } as libc::c_long)?;
    // SAFETY: the kernel just returned this descriptor and nobody else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// Creates the directory `name` in `dir` with `mode` (less the umask). Fails with `EEXIST` if
/// anything, a symbolic link included, is there already.
pub fn mkdir_at(dir: BorrowedFd<'_>, name: &CStr, mode: u32) -> io::Result<()> {
    // SAFETY: name is NUL-terminated.
    cvt(
        unsafe { libc::mkdirat(dir.as_raw_fd(), name.as_ptr(), mode as libc::mode_t) }
            as libc::c_long,
    )
    .map(drop)
}

/// Removes `name` from `dir` (a directory with `dir_entry`), never following a link.
pub fn unlink_at(dir: BorrowedFd<'_>, name: &CStr, dir_entry: bool) -> io::Result<()> {
    let flags = if dir_entry { libc::AT_REMOVEDIR } else { 0 };
    // SAFETY: name is NUL-terminated.
    cvt(unsafe { libc::unlinkat(dir.as_raw_fd(), name.as_ptr(), flags) } as libc::c_long).map(drop)
}

/// A path that reaches `name` inside the directory `dir` through `/proc/self/fd`: whatever
/// happens to the directory's own path meanwhile, it names that directory.
pub fn path_in(dir: BorrowedFd<'_>, name: &CStr) -> std::path::PathBuf {
    let name = std::ffi::OsStr::from_bytes(name.to_bytes());
    Path::new(&format!("/proc/self/fd/{}", dir.as_raw_fd())).join(name)
}

/// Creates a listening Unix stream socket at `path` whose node has exactly the permission bits
/// `mode`: they are set on the socket before `bind` (the node takes them from it, less the
/// umask, which is cleared meanwhile), never by path afterwards. `bind` does not follow a
/// symbolic link at `path` (it fails with `EADDRINUSE` if anything is there).
///
/// The umask is process-wide: call this before threads that create files start.
pub fn bind_unix(path: &Path, mode: u32, backlog: i32) -> io::Result<UnixListener> {
    // SAFETY: no memory is passed to the kernel.
    let fd = cvt(
        unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) }
            as libc::c_long,
    )?;
    // SAFETY: the kernel just returned this descriptor and nobody else owns it.
    let sock = unsafe { OwnedFd::from_raw_fd(fd as RawFd) };
    fchmod(sock.as_raw_fd(), mode)?;
    // SAFETY: sockaddr_un is plain data; all-zero is a valid value.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    let bytes = path.as_os_str().as_bytes();
    if bytes.is_empty() || bytes.len() >= addr.sun_path.len() || bytes.contains(&0) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "a socket path is 1 to 107 bytes without NUL",
        ));
    }
    for (d, &s) in addr.sun_path.iter_mut().zip(bytes) {
        *d = s as libc::c_char;
    }
    let len = std::mem::size_of::<libc::sa_family_t>() + bytes.len() + 1;
    // SAFETY: umask takes no memory; the old mask is restored right after bind.
    let old = unsafe { libc::umask(0o777 & !(mode as libc::mode_t)) };
    // SAFETY: addr is a live sockaddr_un of at least `len` bytes.
    let bound = cvt(unsafe {
        libc::bind(
            sock.as_raw_fd(),
            (&addr as *const libc::sockaddr_un).cast(),
            len as libc::socklen_t,
        )
    } as libc::c_long);
    // SAFETY: as above.
    unsafe { libc::umask(old) };
    bound?;
    // SAFETY: no memory is passed to the kernel.
    cvt(unsafe { libc::listen(sock.as_raw_fd(), backlog) } as libc::c_long)?;
    Ok(UnixListener::from(sock))
}

/// A C string of `s` (which must not contain NUL).
pub fn c_name(s: &std::ffi::OsStr) -> io::Result<CString> {
    CString::new(s.as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a name contains NUL"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    #[test]
    fn a_socket_node_takes_the_mode_set_before_bind() {
        let dir = std::env::temp_dir().join(format!("pageone-sys-bind-{}", std::process::id()));
        std::fs::create_dir(&dir).unwrap();
        let d = open_dir_at(None, &c_name(dir.as_os_str()).unwrap()).unwrap();
        for mode in [0o600, 0o666] {
            let name = CString::new(format!("s{mode:o}")).unwrap();
            let l = bind_unix(&path_in(d.as_fd(), &name), mode, 4).unwrap();
            let info = file_info_at(d.as_fd(), &name).unwrap();
            assert_eq!(info.kind(), libc::S_IFSOCK);
            assert_eq!(info.permissions(), mode);
            drop(l);
            unlink_at(d.as_fd(), &name, false).unwrap();
        }
        drop(d);
        std::fs::remove_dir(&dir).unwrap();
    }

    #[test]
    fn directories_are_opened_without_following_links() {
        let base = std::env::temp_dir().join(format!("pageone-sys-dirs-{}", std::process::id()));
        std::fs::create_dir(&base).unwrap();
        let d = open_dir_at(None, &c_name(base.as_os_str()).unwrap()).unwrap();
        mkdir_at(d.as_fd(), c"real", 0o700).unwrap();
        std::os::unix::fs::symlink(base.join("real"), base.join("link")).unwrap();
        assert!(open_dir_at(Some(d.as_fd()), c"real").is_ok());
        let e = open_dir_at(Some(d.as_fd()), c"link").unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ENOTDIR));
        // mkdir over a link fails instead of creating its target.
        assert!(mkdir_at(d.as_fd(), c"link", 0o700).is_err());
        assert_eq!(
            file_info_at(d.as_fd(), c"real").unwrap().kind(),
            libc::S_IFDIR
        );
        unlink_at(d.as_fd(), c"link", false).unwrap();
        unlink_at(d.as_fd(), c"real", true).unwrap();
        drop(d);
        std::fs::remove_dir(&base).unwrap();
    }

    #[test]
    fn root_exists_and_nobody_is_not_root() {
        assert_eq!(user_id(c"root").unwrap(), Some(0));
        assert_eq!(user_id(c"no-such-user-pageone-test").unwrap(), None);
        // The test runner is not set-user-ID.
        assert!(!secure_execution());
    }
}
