//! Signals a supervising process handles itself (`pageone run`): a set of them blocked and
//! waited for synchronously (`sigtimedwait`), passed on with `kill`, and the signal a child gets
//! when its parent dies (`PR_SET_PDEATHSIG`).

use std::io;
use std::time::Duration;

use crate::cvt;

/// A set of signals, blocked in the calling thread while the guard lives (the previous mask is
/// restored on drop) and taken one at a time with [`BlockedSignals::wait`].
pub struct BlockedSignals {
    set: libc::sigset_t,
    old: libc::sigset_t,
}

/// One signal taken by [`BlockedSignals::wait`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Received {
    pub signal: i32,
    /// Sent by a process (`kill`, `sigqueue`, `tgkill`: `si_code <= 0`), not by the kernel (a
    /// terminal's keys, a child's exit).
    pub from_process: bool,
    /// The sender's pid, when sent by a process.
    pub pid: i32,
}

impl BlockedSignals {
    /// Blocks `signals` in the calling thread. Threads it creates afterwards inherit the mask,
    /// and so do children (Rust's `Command` keeps it): a child's start calls
    /// [`clear_signal_mask`].
    pub fn block(signals: &[i32]) -> io::Result<Self> {
        // SAFETY: sigset_t is plain data; sigemptyset initialises it.
        let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        let mut old: libc::sigset_t = unsafe { std::mem::zeroed() };
        // SAFETY: `set` is a live sigset_t.
        unsafe { libc::sigemptyset(&mut set) };
        for &s in signals {
            // SAFETY: `set` is a live, initialised sigset_t.
            cvt(unsafe { libc::sigaddset(&mut set, s) } as libc::c_long)?;
        }
        // SAFETY: both sets are live; the call reads `set` and fills `old`.
        let r = unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, &mut old) };
        if r != 0 {
            return Err(io::Error::from_raw_os_error(r));
        }
        Ok(Self { set, old })
    }

    /// Takes one pending signal of the set, waiting at most `timeout`; `None` when none came.
    pub fn wait(&self, timeout: Duration) -> io::Result<Option<Received>> {
        let ts = libc::timespec {
            tv_sec: timeout.as_secs() as libc::time_t,
            tv_nsec: timeout.subsec_nanos() as libc::c_long,
        };
        // SAFETY: siginfo_t is plain data; the kernel fills it.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: the set, the info buffer and the timeout are live for the call.
        let r = unsafe { libc::sigtimedwait(&self.set, &mut info, &ts) };
        if r < 0 {
            let e = io::Error::last_os_error();
            return match e.raw_os_error() {
                Some(libc::EAGAIN) | Some(libc::EINTR) => Ok(None),
                _ => Err(e),
            };
        }
        let from_process = info.si_code <= 0;
        let pid = if from_process {
            // SAFETY: for a signal sent by a process the kernel filled si_pid.
            unsafe { info.si_pid() }
        } else {
            0
        };
        Ok(Some(Received {
            signal: r,
            from_process,
            pid,
        }))
    }
}

impl Drop for BlockedSignals {
    fn drop(&mut self) {
        // SAFETY: restores a mask read by pthread_sigmask.
        unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &self.old, std::ptr::null_mut()) };
    }
}

/// Unblocks every signal in the calling thread. Async-signal-safe: for a child between `fork`
/// and `exec`, which would otherwise keep its parent's mask (a program started with signals
/// blocked never gets them).
pub fn clear_signal_mask() -> io::Result<()> {
    // SAFETY: sigset_t is plain data; sigemptyset initialises it.
    let mut none: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: `none` is a live sigset_t; pthread_sigmask only reads it.
    let r = unsafe {
        libc::sigemptyset(&mut none);
        libc::pthread_sigmask(libc::SIG_SETMASK, &none, std::ptr::null_mut())
    };
    if r != 0 {
        return Err(io::Error::from_raw_os_error(r));
    }
    Ok(())
}

/// Sends `signal` to the process `pid`.
pub fn kill(pid: i32, signal: i32) -> io::Result<()> {
    // SAFETY: kill takes no memory.
    cvt(unsafe { libc::kill(pid, signal) } as libc::c_long).map(drop)
}

/// Asks the kernel to send `signal` to the calling process when the thread that created it
/// exits (`PR_SET_PDEATHSIG`), then checks that this parent, `parent`, is still there: if it
/// already died, the signal would never come, so `Err(ESRCH)` is returned. Async-signal-safe:
/// for a child between `fork` and `exec` (the setting survives `exec`, except of set-user-ID
/// programs).
pub fn die_with_parent(signal: i32, parent: i32) -> io::Result<()> {
    // SAFETY: prctl with integer arguments only.
    let r = unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, signal as libc::c_ulong, 0, 0, 0) };
    cvt(r as libc::c_long)?;
    // SAFETY: getppid takes nothing and cannot fail.
    if unsafe { libc::getppid() } != parent {
        return Err(io::Error::from_raw_os_error(libc::ESRCH));
    }
    Ok(())
}

/// Makes the calling process the leader of a process group of its own (`setpgid(0, 0)`): a
/// terminal's keys (Ctrl-C, Ctrl-\) no longer reach it. Async-signal-safe.
pub fn own_process_group() -> io::Result<()> {
    // SAFETY: setpgid takes no memory.
    cvt(unsafe { libc::setpgid(0, 0) } as libc::c_long).map(drop)
}

/// CPU time (user and system) of this whole process so far, in nanoseconds.
pub fn process_cpu_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: ts is a live timespec.
    if unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) } != 0 {
        return 0;
    }
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// The name of signal `signal` without its `SIG` prefix ("TERM"), or its number.
pub fn signal_name(signal: i32) -> String {
    let known = [
        (libc::SIGHUP, "HUP"),
        (libc::SIGINT, "INT"),
        (libc::SIGQUIT, "QUIT"),
        (libc::SIGKILL, "KILL"),
        (libc::SIGUSR1, "USR1"),
        (libc::SIGUSR2, "USR2"),
        (libc::SIGTERM, "TERM"),
        (libc::SIGCHLD, "CHLD"),
    ];
    known
        .iter()
        .find(|k| k.0 == signal)
        .map_or_else(|| signal.to_string(), |k| k.1.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A blocked signal sent by this process waits for `wait`, which says who sent it.
    #[test]
    fn a_blocked_signal_is_taken_with_its_sender() {
        // (SIGUSR2 in this thread only: the test harness's other threads keep theirs, so the
        // signal is sent to this thread.)
        let blocked = BlockedSignals::block(&[libc::SIGUSR2]).unwrap();
        assert_eq!(blocked.wait(Duration::from_millis(10)).unwrap(), None);
        // SAFETY: tgkill takes no memory; the target is this thread.
        let r = unsafe {
            libc::syscall(
                libc::SYS_tgkill,
                libc::getpid(),
                libc::gettid(),
                libc::SIGUSR2,
            )
        };
        assert_eq!(r, 0);
        let got = blocked.wait(Duration::from_secs(5)).unwrap().unwrap();
        assert_eq!(got.signal, libc::SIGUSR2);
        assert!(got.from_process);
        assert_eq!(got.pid, std::process::id() as i32);
        assert_eq!(signal_name(got.signal), "USR2");
    }

    #[test]
    fn process_cpu_time_grows() {
        let a = process_cpu_ns();
        let mut x = 0u64;
        for i in 0..10_000_000u64 {
            x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(i));
        }
        assert!(process_cpu_ns() > a, "{x}");
    }
}
