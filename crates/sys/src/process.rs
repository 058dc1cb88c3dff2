//! The process and its threads: eventfd wake-ups and polling, CPU clocks and affinity,
//! fork hooks, `SIGPIPE`'s disposition, pidfds, kernel randomness, and `prctl`.

use std::io;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};

use crate::cvt;

/// Creates an eventfd used to interrupt a blocking poll (non-blocking, close-on-exec).
pub fn eventfd() -> io::Result<OwnedFd> {
    // SAFETY: no memory is passed to the kernel.
    let fd =
        cvt(unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) } as libc::c_long)?;
    // SAFETY: fd was just returned by the kernel and is owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// Adds one to an eventfd's counter, waking its pollers.
pub fn eventfd_signal(fd: RawFd) -> io::Result<()> {
    let one: u64 = 1;
    // SAFETY: writes 8 bytes from a live local.
    cvt(unsafe { libc::write(fd, (&one as *const u64).cast(), 8) } as libc::c_long).map(drop)
}

/// Waits until one of `fds` is readable; returns which ones are.
pub fn poll_readable(fds: &[RawFd], timeout_ms: i32) -> io::Result<Vec<bool>> {
    let mut pfds: Vec<libc::pollfd> = fds
        .iter()
        .map(|&fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    loop {
        // SAFETY: pfds is a live array of pfds.len() pollfd structures.
        let r = unsafe { libc::poll(pfds.as_mut_ptr(), pfds.len() as libc::nfds_t, timeout_ms) };
        if r == -1 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        return Ok(pfds
            .iter()
            .map(|p| p.revents & (libc::POLLIN | libc::POLLERR) != 0)
            .collect());
    }
}

/// The id of the calling thread (`gettid`), for [`thread_affinity`] and [`set_thread_affinity`].
pub fn thread_id() -> i32 {
    // SAFETY: no memory is passed to the kernel.
    unsafe { libc::gettid() }
}

/// The CPU the calling thread runs on (`sched_getcpu`), if the kernel says.
pub fn current_cpu() -> Option<usize> {
    // SAFETY: no memory is passed.
    let c = unsafe { libc::sched_getcpu() };
    usize::try_from(c).ok()
}

/// The CPUs a thread may run on.
#[derive(Clone, Copy)]
pub struct Affinity(libc::cpu_set_t);

impl Affinity {
    /// CPU `cpu` alone (`None` beyond what a set holds).
    pub fn only(cpu: usize) -> Option<Self> {
        if cpu >= libc::CPU_SETSIZE as usize {
            return None;
        }
        // SAFETY: an all-zero cpu_set_t is the empty set.
        let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        // SAFETY: `cpu` is inside the set (checked above); `set` is a live cpu_set_t.
        unsafe { libc::CPU_SET(cpu, &mut set) };
        Some(Affinity(set))
    }

    /// How many CPUs it holds.
    pub fn count(&self) -> usize {
        // SAFETY: reads the live cpu_set_t only.
        unsafe { libc::CPU_COUNT(&self.0) as usize }
    }
}

/// The CPUs thread `tid` (0: the calling thread) may run on.
pub fn thread_affinity(tid: i32) -> io::Result<Affinity> {
    // SAFETY: an all-zero cpu_set_t is a valid value for the kernel to fill.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    let size = std::mem::size_of::<libc::cpu_set_t>();
    // SAFETY: `set` is a live cpu_set_t of `size` bytes.
    cvt(unsafe { libc::sched_getaffinity(tid, size, &mut set) } as libc::c_long)?;
    Ok(Affinity(set))
}

/// Lets thread `tid` (0: the calling thread) run on the CPUs of `a` only.
pub fn set_thread_affinity(tid: i32, a: &Affinity) -> io::Result<()> {
    let size = std::mem::size_of::<libc::cpu_set_t>();
    // SAFETY: `a.0` is a live cpu_set_t of `size` bytes, only read.
    cvt(unsafe { libc::sched_setaffinity(tid, size, &a.0) } as libc::c_long).map(drop)
}

/// Blocks every signal in the calling thread until the guard is dropped (the previous mask is
/// restored then). Threads it creates meanwhile start with every signal blocked: signal
/// handlers of the program never run on them.
pub fn block_all_signals() -> io::Result<SignalMask> {
    let mut all = std::mem::MaybeUninit::<libc::sigset_t>::uninit();
    let mut old = std::mem::MaybeUninit::<libc::sigset_t>::uninit();
    // SAFETY: sigfillset initialises `all`; pthread_sigmask reads it and fills `old`.
    let r = unsafe {
        libc::sigfillset(all.as_mut_ptr());
        libc::pthread_sigmask(libc::SIG_BLOCK, all.as_ptr(), old.as_mut_ptr())
    };
    if r != 0 {
        return Err(io::Error::from_raw_os_error(r));
    }
    // SAFETY: initialised by the successful call above.
    Ok(SignalMask(unsafe { old.assume_init() }))
}

/// The signal mask a thread had before [`block_all_signals`]; restored on drop.
pub struct SignalMask(libc::sigset_t);

impl SignalMask {
    /// Keeps every signal blocked in this thread for good.
    pub fn keep(self) {
        std::mem::forget(self);
    }
}

impl Drop for SignalMask {
    fn drop(&mut self) {
        // SAFETY: restores a mask read by pthread_sigmask.
        unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &self.0, std::ptr::null_mut()) };
    }
}

/// The CPU-time clock of one thread, readable from any thread of the process while that thread
/// has not been joined (`pthread_getcpuclockid`).
#[derive(Clone, Copy, Debug)]
pub struct CpuClock(libc::clockid_t);

impl CpuClock {
    /// The calling thread's clock.
    pub fn current() -> io::Result<Self> {
        let mut id: libc::clockid_t = 0;
        // SAFETY: `id` is a live out-parameter; pthread_self() is the calling thread.
        let r = unsafe { libc::pthread_getcpuclockid(libc::pthread_self(), &mut id) };
        if r != 0 {
            return Err(io::Error::from_raw_os_error(r));
        }
        Ok(Self(id))
    }

    /// CPU time the thread used so far, in nanoseconds (0 if the clock cannot be read).
    pub fn ns(&self) -> u64 {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: ts is a live timespec.
        if unsafe { libc::clock_gettime(self.0, &mut ts) } != 0 {
            return 0;
        }
        ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
    }
}

/// Whether the process behind `pidfd` has exited; with `wait`, waits until it has.
pub fn pidfd_exited(pidfd: RawFd, wait: bool) -> io::Result<bool> {
    let mut p = libc::pollfd {
        fd: pidfd,
        events: libc::POLLIN,
        revents: 0,
    };
    loop {
        // SAFETY: `p` is one live pollfd.
        let n = unsafe { libc::poll(&mut p, 1, if wait { -1 } else { 0 }) };
        if n >= 0 {
            return Ok(n > 0);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Runs `prepare` in the forking thread before every `fork` of this process (`pthread_atfork`).
pub fn on_fork(prepare: extern "C" fn()) -> io::Result<()> {
    // SAFETY: `prepare` is a plain function valid for the life of the program.
    let r = unsafe { libc::pthread_atfork(Some(prepare), None, None) };
    if r != 0 {
        return Err(io::Error::from_raw_os_error(r));
    }
    Ok(())
}

/// Runs `prepare` before every `fork` of this process (in the forking thread), then `parent` in
/// the parent and `child` in the child after it (`pthread_atfork`).
pub fn at_fork(
    prepare: extern "C" fn(),
    parent: extern "C" fn(),
    child: extern "C" fn(),
) -> io::Result<()> {
    // SAFETY: plain functions valid for the life of the program.
    let r = unsafe { libc::pthread_atfork(Some(prepare), Some(parent), Some(child)) };
    if r != 0 {
        return Err(io::Error::from_raw_os_error(r));
    }
    Ok(())
}

/// Runs `child` in the child after every `fork` of this process (`pthread_atfork`).
pub fn on_fork_child(child: extern "C" fn()) -> io::Result<()> {
    // SAFETY: `child` is a plain function valid for the life of the program.
    let r = unsafe { libc::pthread_atfork(None, None, Some(child)) };
    if r != 0 {
        return Err(io::Error::from_raw_os_error(r));
    }
    Ok(())
}

/// Gives `SIGPIPE` its default action (end the process) again. Rust's runtime starts programs
/// with it ignored, while C programs (and so most host programs of the shim and the C ABI) keep
/// the default; tools that stand in for such programs call this.
pub fn default_sigpipe() -> io::Result<()> {
    // SAFETY: SIG_DFL is a valid disposition for SIGPIPE; no memory is passed.
    if unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) } == libc::SIG_ERR {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// A random 64-bit value from the kernel (`getrandom`, blocking only until the pool is seeded
/// at boot).
pub fn random_u64() -> io::Result<u64> {
    let mut v = [0u8; 8];
    // SAFETY: `v` is a live buffer of 8 bytes.
    let n = cvt(unsafe { libc::getrandom(v.as_mut_ptr().cast(), v.len(), 0) } as libc::c_long)?;
    if n != 8 {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "getrandom returned short",
        ));
    }
    Ok(u64::from_ne_bytes(v))
}

/// `prctl(2)` as a raw system call (for a shim that interposes the C library's `prctl`).
///
/// # Safety
/// As `prctl(2)`: options that take pointers need valid ones.
pub unsafe fn raw_prctl(
    option: libc::c_int,
    a2: libc::c_ulong,
    a3: libc::c_ulong,
    a4: libc::c_ulong,
    a5: libc::c_ulong,
) -> libc::c_int {
    // SAFETY: forwarded to the caller's contract.
    unsafe { libc::syscall(libc::SYS_prctl, option, a2, a3, a4, a5) as libc::c_int }
}

/// Page faults this process (every thread) took that needed no I/O (`ru_minflt`). A write to
/// memory watched with asynchronous userfaultfd write-protection is one such fault, the first
/// after each protection.
pub fn minor_faults() -> io::Result<u64> {
    // SAFETY: an all-zero rusage is a valid value of the plain C struct.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `ru` is a live rusage the call fills.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(ru.ru_minflt as u64)
}

/// The memory of a running thread's stack (guard included, and whatever the C library keeps
/// there: the thread's descriptor and its static TLS), as `start..end`.
pub fn thread_stack(thread: libc::pthread_t) -> io::Result<std::ops::Range<usize>> {
    // SAFETY: a zeroed pthread_attr_t that pthread_getattr_np initialises (it is destroyed after
    // use); `thread` is a live thread of this process (the caller holds its handle).
    unsafe {
        let mut attr: libc::pthread_attr_t = std::mem::zeroed();
        let r = libc::pthread_getattr_np(thread, &mut attr);
        if r != 0 {
            return Err(io::Error::from_raw_os_error(r));
        }
        let mut addr: *mut libc::c_void = std::ptr::null_mut();
        let mut size: libc::size_t = 0;
        let r = libc::pthread_attr_getstack(&attr, &mut addr, &mut size);
        libc::pthread_attr_destroy(&mut attr);
        if r != 0 {
            return Err(io::Error::from_raw_os_error(r));
        }
        Ok(addr as usize..addr as usize + size)
    }
}

/// Whether this process may lock memory without a limit: `RLIMIT_MEMLOCK` is unlimited, or it
/// has `CAP_IPC_LOCK` (which bypasses the limit), by `/proc/self/status`.
pub fn may_lock_without_limit() -> bool {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `lim` is a valid rlimit for the kernel to fill.
    if unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut lim) } == 0
        && lim.rlim_cur == libc::RLIM_INFINITY
    {
        return true;
    }
    const CAP_IPC_LOCK: u32 = 14;
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            let hex = s
                .lines()
                .find_map(|l| l.strip_prefix("CapEff:"))?
                .trim()
                .to_owned();
            u64::from_str_radix(&hex, 16).ok()
        })
        .is_some_and(|caps| caps & 1 << CAP_IPC_LOCK != 0)
}

#[cfg(test)]
mod lock_limit_tests {
    use std::os::unix::process::CommandExt;

    /// Set in the test binary run again as another user (see below).
    const AS_NOBODY: &str = "PAGEONE_TEST_AS_NOBODY";

    /// A process with a limit on locked memory and no `CAP_IPC_LOCK` may not lock without one;
    /// root may. Run again as `nobody` with an 8 MiB limit (root only).
    #[test]
    fn a_limited_unprivileged_process_may_not_lock_without_limit() {
        if std::env::var_os(AS_NOBODY).is_some() {
            assert!(!super::may_lock_without_limit());
            return;
        }
        // SAFETY: getuid has no preconditions.
        if unsafe { libc::getuid() } != 0 {
            eprintln!("skipped: needs root to run as another user");
            return;
        }
        assert!(super::may_lock_without_limit(), "root has CAP_IPC_LOCK");
        let mut c = std::process::Command::new(std::env::current_exe().unwrap());
        c.args([
            "--exact",
            "process::lock_limit_tests::a_limited_unprivileged_process_may_not_lock_without_limit",
        ]);
        c.env(AS_NOBODY, "1");
        // SAFETY: only system calls between fork and exec.
        unsafe {
            c.pre_exec(|| {
                let lim = libc::rlimit {
                    rlim_cur: 8 << 20,
                    rlim_max: 8 << 20,
                };
                if libc::setrlimit(libc::RLIMIT_MEMLOCK, &lim) != 0
                    || libc::setgid(65534) != 0
                    || libc::setuid(65534) != 0
                {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let out = c.output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && text.contains("1 passed"),
            "{text}{out:?}"
        );
    }
}

#[cfg(test)]
mod fault_tests {
    #[test]
    fn touching_fresh_memory_counts_minor_faults() {
        let before = super::minor_faults().unwrap();
        let pages = 64;
        let p = crate::mmap_anonymous(pages * crate::PAGE_SIZE).unwrap();
        for i in 0..pages {
            // SAFETY: inside the fresh mapping made above, which nothing else uses.
            unsafe { std::ptr::write_volatile(p.add(i * crate::PAGE_SIZE), 1u8) };
        }
        let after = super::minor_faults().unwrap();
        // SAFETY: the mapping made above; not used after this.
        unsafe { crate::munmap(p, pages * crate::PAGE_SIZE).unwrap() };
        assert!(after - before >= pages as u64, "{before} -> {after}");
    }
}
