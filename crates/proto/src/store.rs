//! The store file both ends share: slot `n` is the page at byte offset `n * PAGE_SIZE`. A slot
//! holds one stable copy; a freed slot is a hole (punched), which reads as zeros and uses no
//! memory. The daemon's scope stores and an engine's own store share this layout and the way
//! they free slots.
//!
//! A scope's store is written only by the daemon. It is a memfd with mode [`MODE`] (readable by
//! the daemon's user alone: a client of another user cannot open it again for writing, through
//! `/proc/self/fd` or otherwise, nor change its mode), sealed with [`SEALS`] (its size never
//! changes, so a mapping of it never faults past its end, and no further seal is added), and
//! handed to clients opened read-only. A client [`check`]s all of that before it maps anything.

use std::ffi::CStr;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};

use pageone_sys as sys;

const PAGE: u64 = sys::PAGE_SIZE as u64;

/// The permission bits of a store: read by its owner (the daemon's user) only.
pub const MODE: u32 = 0o400;

/// The seals of a store: it neither shrinks nor grows, and takes no further seal.
/// (`F_SEAL_WRITE` would also stop the daemon freeing slots.)
pub const SEALS: libc::c_int = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;

/// The byte offset of `slot` in a store file.
pub fn offset(slot: u32) -> u64 {
    slot as u64 * PAGE
}

/// Creates a store of `capacity` slots: a memfd given [`MODE`] right after its creation (before
/// anyone else can see it), sized, and sealed with [`SEALS`]. The returned descriptor is the
/// daemon's, open for writing; clients get [`sys::reopen_readonly`] of it.
pub fn create(name: &CStr, capacity: u32) -> io::Result<OwnedFd> {
    let fd = sys::memfd_create_sealable(name)?;
    sys::fchmod(fd.as_raw_fd(), MODE)?;
    sys::ftruncate(fd.as_raw_fd(), offset(capacity))?;
    sys::add_seals(fd.as_raw_fd(), SEALS)?;
    Ok(fd)
}

/// What a client expects of the store its daemon hands it.
#[derive(Clone, Copy, Debug)]
pub struct Expected {
    /// The daemon's uid (from `SO_PEERCRED`): the store is its.
    pub owner: u32,
    /// Slots, as the daemon's greeting says.
    pub capacity: u32,
}

/// Checks a store descriptor a daemon handed out: a regular file of the daemon's user that no
/// group or other user may write, opened read-only, sealed with [`SEALS`] and of the announced
/// size. The error says which property is missing.
pub fn check(fd: RawFd, want: &Expected) -> Result<(), String> {
    let io = |e: io::Error| format!("the store cannot be examined: {e}");
    let info = sys::file_info(fd).map_err(io)?;
    if info.kind() != libc::S_IFREG {
        return Err("the store is not a regular file".into());
    }
    if info.uid != want.owner {
        return Err(format!(
            "the store belongs to uid {}, not to the daemon's uid {}",
            info.uid, want.owner
        ));
    }
    if info.permissions() & 0o022 != 0 {
        return Err(format!(
            "the store's mode {:o} lets others write it",
            info.permissions()
        ));
    }
    if sys::access_mode(fd).map_err(io)? != libc::O_RDONLY {
        return Err("the store was handed out open for writing".into());
    }
    let seals = sys::seals(fd).map_err(io)?;
    if seals & SEALS != SEALS {
        return Err(format!(
            "the store's seals {seals:#x} do not fix its size (want {SEALS:#x})"
        ));
    }
    if info.size != offset(want.capacity) {
        return Err(format!(
            "the store holds {} bytes, not the {} slots announced",
            info.size, want.capacity
        ));
    }
    Ok(())
}

/// Punches the slots `slots` (sorted) of the store file `fd`, one call per run of consecutive
/// slots; errors are ignored (a page left unpunched costs memory, not correctness).
pub fn punch_runs(fd: RawFd, slots: &[u32]) {
    for (k, m) in runs(slots) {
        let _ = sys::punch_hole(fd, offset(slots[k]), m as u64 * PAGE);
    }
}

/// The runs of consecutive slots in `slots`, as (index of the first, length): one file
/// operation each.
pub fn runs(slots: &[u32]) -> impl Iterator<Item = (usize, usize)> + '_ {
    let mut k = 0;
    std::iter::from_fn(move || {
        if k >= slots.len() {
            return None;
        }
        let mut m = 1;
        while k + m < slots.len() && slots[k].checked_add(m as u32) == Some(slots[k + m]) {
            m += 1;
        }
        let run = (k, m);
        k += m;
        Some(run)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_split_at_gaps() {
        let slots = [1, 2, 3, 7, 9, 10];
        assert_eq!(
            runs(&slots).collect::<Vec<_>>(),
            vec![(0, 3), (3, 1), (4, 2)]
        );
        assert_eq!(runs(&[]).count(), 0);
        // The top slot does not wrap into a run with slot 0.
        assert_eq!(runs(&[u32::MAX, 0]).count(), 2);
    }

    #[test]
    fn punched_runs_read_as_zeros_and_free_their_pages() {
        let fd = sys::memfd_create(c"punch-test").unwrap();
        let fd = fd.as_raw_fd();
        sys::ftruncate(fd, 8 * PAGE).unwrap();
        let page = vec![0xabu8; PAGE as usize];
        sys::pwrite_pages(fd, &[page.as_ptr() as usize], 0).unwrap();
        let full = sys::file_usage(fd).unwrap().1;
        assert!(full >= PAGE);
        punch_runs(fd, &[0]);
        assert_eq!(sys::file_usage(fd).unwrap().1, full - PAGE);
    }

    /// A store as the daemon makes it passes; each property a client relies on, missing, fails.
    #[test]
    fn a_client_accepts_only_a_protected_store() {
        let me = sys::euid();
        let want = Expected {
            owner: me,
            capacity: 16,
        };
        let store = create(c"check-test", 16).unwrap();
        let ro = sys::reopen_readonly(store.as_raw_fd()).unwrap();
        assert_eq!(check(ro.as_raw_fd(), &want), Ok(()));
        // Open for writing (the daemon's own descriptor).
        let e = check(store.as_raw_fd(), &want).unwrap_err();
        assert!(e.contains("open for writing"), "{e}");
        // The announced size differs.
        let e = check(
            ro.as_raw_fd(),
            &Expected {
                capacity: 8,
                ..want
            },
        )
        .unwrap_err();
        assert!(e.contains("slots announced"), "{e}");
        // Another owner than the daemon.
        let e = check(
            ro.as_raw_fd(),
            &Expected {
                owner: me + 1,
                ..want
            },
        )
        .unwrap_err();
        assert!(e.contains("belongs to uid"), "{e}");
        // Writable by others.
        let loose = create(c"check-test", 16).unwrap();
        sys::fchmod(loose.as_raw_fd(), 0o666).unwrap();
        let loose_ro = sys::reopen_readonly(loose.as_raw_fd()).unwrap();
        let e = check(loose_ro.as_raw_fd(), &want).unwrap_err();
        assert!(e.contains("lets others write"), "{e}");
        // Not sealed (a plain memfd, as the daemon made them before).
        let plain = sys::memfd_create(c"check-test").unwrap();
        sys::fchmod(plain.as_raw_fd(), MODE).unwrap();
        sys::ftruncate(plain.as_raw_fd(), offset(16)).unwrap();
        let plain_ro = sys::reopen_readonly(plain.as_raw_fd()).unwrap();
        let e = check(plain_ro.as_raw_fd(), &want).unwrap_err();
        assert!(e.contains("seals"), "{e}");
    }

    /// The store's mode is set when it is made: 0400, whatever the umask.
    #[test]
    fn a_new_store_is_readable_by_its_owner_only() {
        let store = create(c"mode-test", 4).unwrap();
        let info = sys::file_info(store.as_raw_fd()).unwrap();
        assert_eq!(info.permissions(), MODE);
        assert_eq!(info.size, offset(4));
        assert_eq!(sys::seals(store.as_raw_fd()).unwrap() & SEALS, SEALS);
    }
}
