//! The scheduler: a thread's scheduling class, its time waiting on a run queue
//! (`/proc/thread-self/schedstat`), and the background policy of the engine's and the daemon's
//! threads built on both.
//!
//! Merging is background work: at `SCHED_IDLE` it takes only CPU nobody else wants. But on a
//! host whose CPUs busy threads keep full (guests booting or computing), an idle-class thread
//! gets almost nothing, and memory that would merge piles up instead, also when memory runs
//! short. [`Background`] keeps a thread idle while it gets the CPU it asks for or memory is
//! plentiful, and moves it to the normal class for a while once it spent more of its runnable
//! time waiting than running while memory is short (its memory cgroup three quarters full, or
//! the host's available memory under a quarter): the work then goes on, at the share of an
//! ordinary thread, as the kernel's `ksmd` does at nice 5. Where memory is plentiful, merging
//! sooner would only take CPU from the busy threads (and merge pages they still rewrite).

use std::cell::Cell;
use std::io;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::time::{Duration, Instant};

use crate::cvt;

/// Puts the calling thread in the `SCHED_IDLE` class, so it only runs on otherwise idle CPUs.
pub fn set_thread_idle_priority() -> io::Result<()> {
    set_class(libc::SCHED_IDLE)
}

/// Puts the calling thread back in the normal class (`SCHED_OTHER`) at its nice value, which an
/// unprivileged thread may do from `SCHED_IDLE`: for a thread that holds others up for a moment.
pub fn set_thread_normal_priority() -> io::Result<()> {
    set_class(libc::SCHED_OTHER)
}

fn set_class(policy: libc::c_int) -> io::Result<()> {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: param is a live sched_param; pid 0 means the calling thread.
    cvt(unsafe { libc::sched_setscheduler(0, policy, &param) } as libc::c_long).map(drop)
}

/// The calling thread's CPU time and time spent runnable but waiting on a run queue, from
/// `/proc/thread-self/schedstat` (kernels with `CONFIG_SCHED_INFO`). Allocates nothing.
pub fn thread_sched_times() -> io::Result<SchedTimes> {
    // SAFETY: a NUL-terminated path; the descriptor is closed below.
    let fd = unsafe {
        libc::open(
            c"/proc/thread-self/schedstat".as_ptr(),
            libc::O_RDONLY | libc::O_CLOEXEC,
        )
    };
    cvt(fd as libc::c_long)?;
    let mut buf = [0u8; 96];
    // SAFETY: buf is writable for its length; fd is the descriptor opened above.
    let n = unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) };
    // SAFETY: fd was opened above and is not used after.
    unsafe { libc::close(fd) };
    let n = cvt(n as libc::c_long)? as usize;
    parse_schedstat(&buf[..n]).ok_or_else(|| io::Error::from(io::ErrorKind::InvalidData))
}

/// What [`thread_sched_times`] reads: nanoseconds on a CPU, and waiting for one.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SchedTimes {
    pub on_cpu_ns: u64,
    pub waiting_ns: u64,
}

fn parse_schedstat(text: &[u8]) -> Option<SchedTimes> {
    let text = std::str::from_utf8(text).ok()?;
    let mut it = text.split_ascii_whitespace().map(|w| w.parse::<u64>().ok());
    Some(SchedTimes {
        on_cpu_ns: it.next()??,
        waiting_ns: it.next()??,
    })
}

/// How the engine's and the daemon's background threads are scheduled.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(u8)]
pub enum Priority {
    /// `SCHED_IDLE` while the thread gets the CPU it asks for or memory is plentiful; the normal
    /// class for a while ([`Background::NORMAL_FOR`]) once it waited on a run queue more than it
    /// ran while memory is short ([`memory_is_short`]).
    #[default]
    Auto = 0,
    /// `SCHED_IDLE` always: spare CPU only, whatever waits to merge meanwhile.
    Idle = 1,
    /// The normal class always, as the program's own threads.
    Normal = 2,
}

/// `auto`, `idle` or `normal` (flags, the configuration file, `PAGEONE_PRIORITY`).
impl std::str::FromStr for Priority {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "auto" => Ok(Priority::Auto),
            "idle" => Ok(Priority::Idle),
            "normal" => Ok(Priority::Normal),
            _ => Err(format!("a priority is auto, idle or normal, not {s:?}")),
        }
    }
}

impl Priority {
    fn from_u8(v: u8) -> Self {
        match v {
            1 => Priority::Idle,
            2 => Priority::Normal,
            _ => Priority::Auto,
        }
    }
}

impl std::fmt::Display for Priority {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Priority::Auto => "auto",
            Priority::Idle => "idle",
            Priority::Normal => "normal",
        })
    }
}

/// The process's [`Priority`] for its background threads, read by each at its next check.
static PRIORITY: AtomicU8 = AtomicU8::new(Priority::Auto as u8);

/// Sets the [`Priority`] of this process's background threads (each applies it at its next
/// [`Background::check`]).
pub fn set_background_priority(p: Priority) {
    // Relaxed: a setting read at the threads' next checks; nothing else is published with it.
    PRIORITY.store(p as u8, Ordering::Relaxed);
}

/// This process's [`Priority`] for its background threads.
pub fn background_priority() -> Priority {
    // Relaxed: see set_background_priority.
    Priority::from_u8(PRIORITY.load(Ordering::Relaxed))
}

thread_local! {
    /// Whether this thread's background class is the normal one now (what
    /// [`restore_background_class`] returns it to).
    static NORMAL_NOW: Cell<bool> = const { Cell::new(false) };
}

/// Puts the calling thread back in its background class (after a stretch in the normal class
/// that [`set_thread_normal_priority`] began).
pub fn restore_background_class() {
    let _ = if NORMAL_NOW.with(Cell::get) {
        set_thread_normal_priority()
    } else {
        set_thread_idle_priority()
    };
}

/// The background policy of one thread (see the module): created on the thread, checked at the
/// top of its loop.
#[derive(Debug)]
pub struct Background {
    last: SchedTimes,
    checked: Instant,
    normal_until: Option<Instant>,
    applied: Option<Priority>,
}

impl Background {
    /// Checks are at least this far apart.
    pub const CHECK_EVERY: Duration = Duration::from_millis(200);
    /// How long a starved thread stays in the normal class before it tries idle again.
    pub const NORMAL_FOR: Duration = Duration::from_secs(2);
    /// Less waiting than this in a check's stretch is noise, whatever the ratio.
    const WAITED_AT_LEAST: Duration = Duration::from_millis(10);
    /// A thread in the normal class that ran this long since its last check still has work.
    const WORKED_AT_LEAST_NS: u64 = 10_000_000;

    /// The policy of the calling thread, which it applies at once (`SCHED_IDLE` under `Auto`).
    pub fn start() -> Self {
        let mut b = Self {
            last: thread_sched_times().unwrap_or_default(),
            checked: Instant::now(),
            normal_until: None,
            applied: None,
        };
        b.apply(Instant::now());
        b
    }

    /// Applies the process's priority, and under `Auto` moves the thread to the normal class
    /// when it waited more than it ran since the last check while memory is short; it stays
    /// there while memory stays short and it keeps working (10 ms of CPU since the check
    /// before), and goes back to idle [`Background::NORMAL_FOR`] after the last such check.
    /// Cheap between checks (a clock read).
    pub fn check(&mut self) {
        self.check_with(memory_is_short)
    }

    /// [`Background::check`], with `short` saying whether memory is short (asked only of a
    /// starved thread).
    pub fn check_with(&mut self, short: impl FnOnce() -> bool) {
        let now = Instant::now();
        if now.duration_since(self.checked) < Self::CHECK_EVERY
            && self.applied == Some(background_priority())
        {
            return;
        }
        self.checked = now;
        if let Ok(t) = thread_sched_times() {
            let ran = t.on_cpu_ns.saturating_sub(self.last.on_cpu_ns);
            let waited = t.waiting_ns.saturating_sub(self.last.waiting_ns);
            self.last = t;
            // Starved at idle, or working in the normal class (where it no longer waits): the
            // work goes on in the normal class while memory stays short.
            let working = NORMAL_NOW.with(Cell::get) && ran >= Self::WORKED_AT_LEAST_NS;
            if (starved(ran, waited) || working) && short() {
                self.normal_until = Some(now + Self::NORMAL_FOR);
            }
        }
        self.apply(now);
    }

    fn apply(&mut self, now: Instant) {
        let p = background_priority();
        let normal = match p {
            Priority::Idle => false,
            Priority::Normal => true,
            Priority::Auto => self.normal_until.is_some_and(|t| now < t),
        };
        if self.applied != Some(p) || NORMAL_NOW.with(Cell::get) != normal {
            NORMAL_NOW.with(|c| c.set(normal));
            restore_background_class();
            self.applied = Some(p);
        }
    }
}

/// Whether memory is short for the calling process: its memory cgroup (or one above it with a
/// limit) is three quarters full or more, or the host's `MemAvailable` is under a quarter of
/// `MemTotal`. Read at most about every [`Background::CHECK_EVERY`] for the whole process: the
/// background threads that ask in one stretch share the answer.
pub fn memory_is_short() -> bool {
    // (When it was read, in milliseconds of CLOCK_MONOTONIC) << 1 | (the answer). An atomic, not
    // a lock: a forked child's engine must never find it held by a thread of the parent. Two
    // threads that read at once both read the files, and either answer stands.
    static LAST: AtomicU64 = AtomicU64::new(0);
    let now_ms = monotonic_ns() / 1_000_000;
    // Relaxed: the word carries its own time and answer; nothing else is published with it.
    let last = LAST.load(Ordering::Relaxed);
    if last != 0 && now_ms.saturating_sub(last >> 1) < Background::CHECK_EVERY.as_millis() as u64 {
        return last & 1 == 1;
    }
    let short = memory_is_short_now();
    LAST.store((now_ms.max(1) << 1) | short as u64, Ordering::Relaxed);
    short
}

/// Nanoseconds of `CLOCK_MONOTONIC`, comparable between processes of one boot (and, unlike
/// `Instant`, a plain number to keep in an atomic word).
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a live timespec for the kernel to fill.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

fn memory_is_short_now() -> bool {
    let host = || -> Option<bool> {
        let total = crate::meminfo_kib("MemTotal").ok()?;
        let available = crate::meminfo_kib("MemAvailable").ok()?;
        Some(available < total / 4)
    };
    crate::memory_cgroup_fill().is_some_and(|f| f >= 0.75) || host().unwrap_or(false)
}

/// Whether a thread that ran `ran_ns` and waited `waited_ns` on run queues since its last check
/// is starved: it waited more than it ran, and not just a moment.
fn starved(ran_ns: u64, waited_ns: u64) -> bool {
    waited_ns > ran_ns && waited_ns >= Background::WAITED_AT_LEAST.as_nanos() as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedstat_parses_and_grows_with_work() {
        assert_eq!(
            parse_schedstat(b"123 456 7\n"),
            Some(SchedTimes {
                on_cpu_ns: 123,
                waiting_ns: 456
            })
        );
        assert_eq!(parse_schedstat(b"12\n"), None);
        // The thread's time on a CPU grows as it works (within 10 s, however busy the host).
        let a = thread_sched_times().unwrap();
        let t = Instant::now();
        let mut b = a;
        while b.on_cpu_ns < a.on_cpu_ns + 10_000_000 && t.elapsed() < Duration::from_secs(10) {
            std::hint::black_box(0u64);
            b = thread_sched_times().unwrap();
        }
        assert!(b.on_cpu_ns >= a.on_cpu_ns + 10_000_000, "{a:?} {b:?}");
    }

    #[test]
    fn starved_means_waiting_more_than_running_and_long_enough() {
        assert!(starved(1_000_000, 50_000_000));
        assert!(!starved(60_000_000, 50_000_000));
        assert!(!starved(0, 5_000_000));
    }

    fn class() -> libc::c_int {
        // SAFETY: pid 0 is the calling thread.
        unsafe { libc::sched_getscheduler(0) }
    }

    /// The tests that set the process's priority, one at a time.
    fn serial() -> std::sync::MutexGuard<'static, ()> {
        static M: std::sync::Mutex<()> = std::sync::Mutex::new(());
        M.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A thread that wants its CPU all the time, sharing it with a busy thread of normal
    /// priority (both pinned to one CPU): under `Auto` it moves to the normal class at a check
    /// when memory is short, and stays idle when memory is plentiful; under `Idle` it stays
    /// idle, starved.
    #[test]
    fn a_starved_background_thread_moves_to_the_normal_class_when_memory_is_short() {
        use std::sync::atomic::AtomicBool;
        use std::sync::Arc;
        let _g = serial();
        let cpu = crate::current_cpu().unwrap_or(0);
        let only = || crate::Affinity::only(cpu).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let busy = {
            let (stop, only) = (stop.clone(), only());
            std::thread::spawn(move || {
                crate::set_thread_affinity(0, &only).unwrap();
                while !stop.load(Ordering::Relaxed) {
                    std::hint::spin_loop();
                }
            })
        };
        let moved = |p: Priority, short: bool, within: Duration| {
            let only = only();
            std::thread::spawn(move || {
                crate::set_thread_affinity(0, &only).unwrap();
                set_background_priority(p);
                let mut b = Background::start();
                let t = Instant::now();
                while t.elapsed() < within {
                    let s = Instant::now();
                    while s.elapsed() < Duration::from_millis(1) {
                        std::hint::spin_loop();
                    }
                    b.check_with(|| short);
                    if class() == libc::SCHED_OTHER {
                        return true;
                    }
                }
                false
            })
            .join()
            .unwrap()
        };
        let auto = moved(Priority::Auto, true, Duration::from_secs(20));
        let plenty = moved(Priority::Auto, false, Duration::from_secs(2));
        let idle = moved(Priority::Idle, true, Duration::from_secs(2));
        stop.store(true, Ordering::Relaxed);
        busy.join().unwrap();
        set_background_priority(Priority::Auto);
        assert!(
            auto,
            "a starved thread stayed idle under Auto with memory short"
        );
        assert!(!plenty, "a starved thread left idle with memory plentiful");
        assert!(!idle, "a thread moved to the normal class under Idle");
    }

    /// On a thread of its own: idle under `Auto` unless starved; `Normal` and `Idle` applied at
    /// the next check whatever its times; back in its class after a stretch in the normal one.
    #[test]
    fn a_background_thread_takes_the_class_its_priority_says() {
        let _g = serial();
        std::thread::spawn(|| {
            let mut b = Background::start();
            assert_eq!(class(), libc::SCHED_IDLE);
            set_background_priority(Priority::Normal);
            b.check();
            assert_eq!(class(), libc::SCHED_OTHER);
            set_background_priority(Priority::Idle);
            b.check();
            assert_eq!(class(), libc::SCHED_IDLE);
            set_thread_normal_priority().unwrap();
            restore_background_class();
            assert_eq!(class(), libc::SCHED_IDLE);
            set_background_priority(Priority::Auto);
            b.normal_until = Some(Instant::now() + Duration::from_secs(60));
            b.check();
            assert_eq!(class(), libc::SCHED_OTHER);
        })
        .join()
        .unwrap();
    }
}
