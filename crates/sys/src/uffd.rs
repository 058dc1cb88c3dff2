//! userfaultfd: the [`Uffd`] context and its ioctls (register, wake, zero page, copy,
//! write-protect, move) and fault events.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use crate::cvt;
use crate::uapi::*;

/// A userfaultfd context.
///
/// Contract: the engine registers its watched ranges with `MISSING | WP` (async write-protection),
/// answers missing faults itself, and uses `UFFDIO_MOVE` to freeze a page: while a page is moved out,
/// any access to its address blocks in the kernel until the engine wakes it.
#[derive(Debug)]
pub struct Uffd {
    fd: OwnedFd,
    features: u64,
}

impl Uffd {
    /// Opens a userfaultfd (non-blocking, close-on-exec) and negotiates the `wanted` features,
    /// dropping those this kernel lacks. Returns the context and the features granted.
    ///
    /// Unprivileged processes on hosts with `vm.unprivileged_userfaultfd = 0` get a user-mode-only
    /// context, which is enough: pageone only handles faults from user space.
    pub fn open(wanted: u64) -> io::Result<Self> {
        let base = libc::O_CLOEXEC | libc::O_NONBLOCK;
        let fd = Self::raw_open(base).or_else(|_| Self::raw_open(base | UFFD_USER_MODE_ONLY))?;
        // First ask what exists (features = 0 returns the supported set), then request the
        // intersection on a fresh context: the API handshake can only be done once per context.
        let mut probe = UffdioApi {
            api: UFFD_API,
            features: 0,
            ioctls: 0,
        };
        // SAFETY: probe is a live uffdio_api the kernel fills in.
        cvt(unsafe { crate::raw_ioctl(fd.as_raw_fd(), UFFDIO_API, &mut probe) } as libc::c_long)?;
        let grant = wanted & probe.features;
        drop(fd);
        let fd = Self::raw_open(base).or_else(|_| Self::raw_open(base | UFFD_USER_MODE_ONLY))?;
        let mut api = UffdioApi {
            api: UFFD_API,
            features: grant,
            ioctls: 0,
        };
        // SAFETY: as above.
        cvt(unsafe { crate::raw_ioctl(fd.as_raw_fd(), UFFDIO_API, &mut api) } as libc::c_long)?;
        Ok(Self {
            fd,
            features: grant,
        })
    }

    fn raw_open(flags: libc::c_int) -> io::Result<OwnedFd> {
        // SAFETY: the userfaultfd syscall takes only flags.
        let fd = cvt(unsafe { libc::syscall(libc::SYS_userfaultfd, flags) })?;
        // SAFETY: fd was just returned by the kernel and is owned by nobody else.
        Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
    }

    /// The features this context was granted.
    pub fn features(&self) -> u64 {
        self.features
    }

    /// The raw descriptor (for polling).
    pub fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// Registers `[start, start+len)` with `mode` (`UFFDIO_REGISTER_MODE_*`).
    pub fn register(&self, start: usize, len: usize, mode: u64) -> io::Result<()> {
        let mut r = UffdioRegister {
            range: UffdioRange {
                start: start as u64,
                len: len as u64,
            },
            mode,
            ioctls: 0,
        };
        // SAFETY: r is a live uffdio_register.
        cvt(unsafe { crate::raw_ioctl(self.as_raw_fd(), UFFDIO_REGISTER, &mut r) } as libc::c_long)
            .map(drop)
    }

    /// Unregisters `[start, start+len)`; blocked faulters in it are woken.
    pub fn unregister(&self, start: usize, len: usize) -> io::Result<()> {
        let mut r = UffdioRange {
            start: start as u64,
            len: len as u64,
        };
        // SAFETY: r is a live uffdio_range.
        cvt(
            unsafe { crate::raw_ioctl(self.as_raw_fd(), UFFDIO_UNREGISTER, &mut r) }
                as libc::c_long,
        )
        .map(drop)
    }

    /// Wakes threads blocked on faults in `[start, start+len)`.
    pub fn wake(&self, start: usize, len: usize) -> io::Result<()> {
        let mut r = UffdioRange {
            start: start as u64,
            len: len as u64,
        };
        // SAFETY: r is a live uffdio_range.
        cvt(unsafe { crate::raw_ioctl(self.as_raw_fd(), UFFDIO_WAKE, &mut r) } as libc::c_long)
            .map(drop)
    }

    /// Resolves a missing fault by mapping the shared zero page over `[start, start+len)` and
    /// waking the faulters. `EEXIST` means the page is present already.
    pub fn zeropage(&self, start: usize, len: usize) -> io::Result<()> {
        let mut z = UffdioZeropage {
            range: UffdioRange {
                start: start as u64,
                len: len as u64,
            },
            mode: 0,
            zeropage: 0,
        };
        // SAFETY: z is a live uffdio_zeropage.
        cvt(unsafe { crate::raw_ioctl(self.as_raw_fd(), UFFDIO_ZEROPAGE, &mut z) } as libc::c_long)
            .map(drop)
    }

    /// Maps the shared zero page over every empty page of `[start, start+len)` without waking
    /// anyone (the caller wakes): pages present already are skipped (the kernel stops at each
    /// with `EEXIST`). Returns the pages filled; an error other than `EEXIST` ends it.
    pub fn fill_zero_pages(&self, start: usize, len: usize) -> io::Result<usize> {
        fill_skipping(start, len, &[libc::EEXIST], |at, len| {
            let mut z = UffdioZeropage {
                range: UffdioRange {
                    start: at as u64,
                    len: len as u64,
                },
                mode: UFFDIO_ZEROPAGE_MODE_DONTWAKE,
                zeropage: 0,
            };
            // SAFETY: z is a live uffdio_zeropage.
            let r = unsafe { crate::raw_ioctl(self.as_raw_fd(), UFFDIO_ZEROPAGE, &mut z) };
            (r, z.zeropage)
        })
    }

    /// Maps the pages of the file's cache behind `[start, start+len)`, a shmem mapping registered
    /// for minor faults, where the page tables have none yet (`UFFDIO_CONTINUE`), without waking
    /// anyone: pages mapped already (`EEXIST`) and holes of the file (`EFAULT`) are skipped.
    /// Returns the pages mapped; an error other than those ends it.
    pub fn map_cached_pages(&self, start: usize, len: usize) -> io::Result<usize> {
        fill_skipping(start, len, &[libc::EEXIST, libc::EFAULT], |at, len| {
            self.continue_ioctl(at, len, UFFDIO_CONTINUE_MODE_DONTWAKE)
        })
    }

    /// `UFFDIO_CONTINUE` over `[start, start+len)` with `mode`: its result and the bytes mapped.
    fn continue_ioctl(&self, start: usize, len: usize, mode: u64) -> (libc::c_int, i64) {
        let mut c = UffdioContinue {
            range: UffdioRange {
                start: start as u64,
                len: len as u64,
            },
            mode,
            mapped: 0,
        };
        // SAFETY: c is a live uffdio_continue.
        let r = unsafe { crate::raw_ioctl(self.as_raw_fd(), UFFDIO_CONTINUE, &mut c) };
        (r, c.mapped)
    }

    /// Resolves a minor fault at `[start, start+len)` by mapping the file's cached pages there
    /// (`UFFDIO_CONTINUE`), write-protected if `wp` (the range must be registered for it), and
    /// waking the faulters. Unlike [`Uffd::zeropage`], this also fills an entry holding only a
    /// write-protect marker.
    pub fn continue_pages(&self, start: usize, len: usize, wp: bool) -> io::Result<()> {
        let mode = if wp { UFFDIO_CONTINUE_MODE_WP } else { 0 };
        cvt(self.continue_ioctl(start, len, mode).0 as libc::c_long).map(drop)
    }

    /// Write-protects (`protect`) or un-protects `[start, start+len)`; un-protecting also clears
    /// the write-protect markers of unpopulated pages and wakes faulters.
    pub fn writeprotect(&self, start: usize, len: usize, protect: bool) -> io::Result<()> {
        let mut w = UffdioWriteprotect {
            range: UffdioRange {
                start: start as u64,
                len: len as u64,
            },
            mode: if protect {
                UFFDIO_WRITEPROTECT_MODE_WP
            } else {
                0
            },
        };
        // SAFETY: w is a live uffdio_writeprotect.
        cvt(
            unsafe { crate::raw_ioctl(self.as_raw_fd(), UFFDIO_WRITEPROTECT, &mut w) }
                as libc::c_long,
        )
        .map(drop)
    }

    /// Resolves a missing fault by copying `len` bytes from `src` into new pages at `dst` and waking
    /// the faulters. Unlike [`Uffd::zeropage`] this also fills a page whose entry holds only a
    /// write-protect marker (left by async write-protection of an unpopulated page).
    ///
    /// # Safety
    /// `src` must be readable for `len` bytes.
    pub unsafe fn copy(&self, dst: usize, src: *const u8, len: usize) -> io::Result<()> {
        // SAFETY: by the caller's contract.
        unsafe { self.copy_with(dst, src, len, false) }
    }

    /// [`Uffd::copy`], write-protecting the new pages if `wp` (the range must be registered for
    /// write-protection).
    ///
    /// # Safety
    /// `src` must be readable for `len` bytes.
    pub unsafe fn copy_with(
        &self,
        dst: usize,
        src: *const u8,
        len: usize,
        wp: bool,
    ) -> io::Result<()> {
        let mut c = UffdioCopy {
            dst: dst as u64,
            src: src as u64,
            len: len as u64,
            mode: if wp { UFFDIO_COPY_MODE_WP } else { 0 },
            copy: 0,
        };
        // SAFETY: c is a live uffdio_copy; the caller vouches for src.
        cvt(unsafe { crate::raw_ioctl(self.as_raw_fd(), UFFDIO_COPY, &mut c) } as libc::c_long)
            .map(drop)
    }

    /// Moves the pages of `[src, src+len)` to `[dst, dst+len)` without copying (`UFFDIO_MOVE`).
    /// `dst` must lie in a range registered with this context and be unpopulated; `src` must be
    /// private anonymous memory of this process. Returns the number of bytes moved, which may be
    /// less than `len` on error (the error is returned only when nothing moved).
    ///
    /// # Safety
    /// Both ranges' contents change place: no reference into either may be live.
    pub unsafe fn move_pages(
        &self,
        dst: usize,
        src: usize,
        len: usize,
        mode: u64,
    ) -> io::Result<usize> {
        let mut m = UffdioMove {
            dst: dst as u64,
            src: src as u64,
            len: len as u64,
            mode,
            moved: 0,
        };
        // SAFETY: m is a live uffdio_move; the caller vouches for the ranges.
        let r = unsafe { crate::raw_ioctl(self.as_raw_fd(), UFFDIO_MOVE, &mut m) };
        if r == -1 {
            let e = io::Error::last_os_error();
            if m.moved > 0 {
                return Ok(m.moved as usize);
            }
            return Err(e);
        }
        Ok(m.moved as usize)
    }

    /// Reads the pending events, as many as `buf` holds, in one call without blocking; returns how
    /// many (0 when none is pending).
    pub fn read_events(&self, buf: &mut [UffdMsg]) -> io::Result<usize> {
        let n = std::mem::size_of::<UffdMsg>();
        let len = std::mem::size_of_val(buf);
        // SAFETY: reads at most `len` bytes into buf, live UffdMsgs of n bytes each.
        let r = unsafe { libc::read(self.as_raw_fd(), buf.as_mut_ptr().cast(), len) };
        if r == -1 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::WouldBlock {
                return Ok(0);
            }
            return Err(e);
        }
        // The kernel copies whole messages only.
        Ok(r as usize / n)
    }

    /// Reads one pending fault event without blocking; `Ok(None)` when none is pending.
    pub fn read_event(&self) -> io::Result<Option<UffdMsg>> {
        let mut msg = UffdMsg::default();
        let n = std::mem::size_of::<UffdMsg>();
        // SAFETY: reads at most n bytes into a live UffdMsg of n bytes.
        let r = unsafe { libc::read(self.as_raw_fd(), (&mut msg as *mut UffdMsg).cast(), n) };
        if r == -1 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::WouldBlock {
                return Ok(None);
            }
            return Err(e);
        }
        if r as usize != n {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "short userfaultfd read",
            ));
        }
        Ok(Some(msg))
    }
}

/// Fills `[start, start+len)` with `fill(at, len)`, a userfaultfd ioctl returning its result and
/// the bytes it filled (negative: none), going on past each page whose error is one of `skip`
/// (the kernel stops there). Returns the pages filled; another error ends it (an error only if
/// nothing was filled).
fn fill_skipping(
    start: usize,
    len: usize,
    skip: &[i32],
    mut fill: impl FnMut(usize, usize) -> (libc::c_int, i64),
) -> io::Result<usize> {
    let (mut at, end, mut filled) = (start, start + len, 0);
    while at < end {
        let (r, done) = fill(at, end - at);
        let done = usize::try_from(done).unwrap_or(0);
        filled += done / crate::PAGE_SIZE;
        at += done;
        if r == 0 {
            break;
        }
        let e = io::Error::last_os_error();
        if !e.raw_os_error().is_some_and(|c| skip.contains(&c)) {
            return if filled > 0 { Ok(filled) } else { Err(e) };
        }
        // The page at `at` is one to skip.
        at += crate::PAGE_SIZE;
    }
    Ok(filled)
}
