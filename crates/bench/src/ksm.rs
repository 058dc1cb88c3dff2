//! The kernel's KSM as a baseline: its knobs (saved and restored), its counters, and its CPU time.

use std::io;
use std::path::Path;

const KSM: &str = "/sys/kernel/mm/ksm";

/// Reads a KSM counter or knob.
pub fn read(name: &str) -> io::Result<u64> {
    let s = std::fs::read_to_string(Path::new(KSM).join(name))?;
    s.trim()
        .parse()
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, format!("bad value in {name}")))
}

fn write(name: &str, v: u64) -> io::Result<()> {
    std::fs::write(Path::new(KSM).join(name), format!("{v}\n"))
}

/// Whether KSM exists and its knobs are writable (root).
pub fn available() -> bool {
    read("run").is_ok_and(|v| write("run", v).is_ok())
}

/// Sets KSM knobs for a benchmark and restores every one of them when dropped. `run` is left at 0
/// or 2 (never 1), after unmerging what the benchmark merged.
pub struct KsmSession {
    saved: Vec<(&'static str, u64)>,
}

impl KsmSession {
    /// Saves the knobs, then sets `sleep_millisecs` and `pages_to_scan` (run stays 0 until
    /// [`KsmSession::start`]).
    pub fn new(sleep_millisecs: u64, pages_to_scan: u64) -> io::Result<Self> {
        let mut saved = Vec::new();
        for k in ["run", "sleep_millisecs", "pages_to_scan"] {
            saved.push((k, read(k)?));
        }
        let s = Self { saved };
        // Start from a clean state: unmerge anything merged by others' earlier runs of ours.
        write("run", 2)?;
        write("run", 0)?;
        write("sleep_millisecs", sleep_millisecs)?;
        write("pages_to_scan", pages_to_scan)?;
        Ok(s)
    }

    pub fn start(&self) -> io::Result<()> {
        write("run", 1)
    }

    /// Stops KSM and unmerges every page it merged.
    pub fn stop_and_unmerge(&self) -> io::Result<()> {
        write("run", 2)
    }
}

impl Drop for KsmSession {
    fn drop(&mut self) {
        // Unmerge what the benchmark merged, restore the knobs, and leave run at 0 or 2.
        let _ = write("run", 2);
        for &(k, v) in &self.saved {
            if k != "run" {
                let _ = write(k, v);
            }
        }
        let run = self
            .saved
            .iter()
            .find(|(k, _)| *k == "run")
            .map_or(0, |&(_, v)| v);
        let _ = write("run", if run == 1 { 2 } else { run });
    }
}

/// CPU time of the `ksmd` kernel thread so far, in nanoseconds (0 if not found).
pub fn ksmd_cpu_ns() -> u64 {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return 0;
    };
    for e in dir.flatten() {
        let p = e.path();
        if std::fs::read_to_string(p.join("comm")).is_ok_and(|c| c.trim() == "ksmd") {
            let pid = p.file_name().and_then(|n| n.to_str()?.parse().ok());
            return pid.map_or(0, process_cpu_ns);
        }
    }
    0
}

/// CPU time (user + system) a process has used, in nanoseconds (0 if it is gone).
pub fn process_cpu_ns(pid: u32) -> u64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0;
    };
    // SAFETY: sysconf has no memory-safety preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    // Fields after the command name: state is field 3; utime and stime are 14 and 15.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = f.get(11).and_then(|s| s.parse::<u64>().ok()).unwrap_or(0)
        + f.get(12).and_then(|s| s.parse::<u64>().ok()).unwrap_or(0);
    ticks * 1_000_000_000 / hz
}
