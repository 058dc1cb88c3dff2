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

pub(crate) fn write(name: &str, v: u64) -> io::Result<()> {
    std::fs::write(Path::new(KSM).join(name), format!("{v}\n"))
}

/// Whether KSM exists and its knobs are writable (root).
pub fn available() -> bool {
    read("run").is_ok_and(|v| write("run", v).is_ok())
}

/// Every writable knob of `/sys/kernel/mm/ksm` and its value, as the kernel shows it (a choice
/// like `advisor_mode`'s `[none] scan-time` as its chosen word).
pub fn knobs() -> Vec<(String, String)> {
    let Ok(dir) = std::fs::read_dir(KSM) else {
        return Vec::new();
    };
    let mut out: Vec<(String, String)> = dir
        .flatten()
        .filter(|e| {
            use std::os::unix::fs::PermissionsExt;
            e.metadata()
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o200 != 0)
        })
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let text = std::fs::read_to_string(e.path()).ok()?;
            Some((name, knob_value(&text)))
        })
        .collect();
    out.sort();
    out
}

/// A knob's value as written back: the bracketed choice of a list, else the trimmed text.
fn knob_value(text: &str) -> String {
    let t = text.trim();
    match (t.find('['), t.find(']')) {
        (Some(a), Some(b)) if a < b => t[a + 1..b].to_string(),
        _ => t.to_string(),
    }
}

fn write_text(name: &str, v: &str) -> io::Result<()> {
    std::fs::write(Path::new(KSM).join(name), format!("{v}\n"))
}

/// Sets KSM knobs for a benchmark and restores every writable knob of `/sys/kernel/mm/ksm` when
/// dropped. `run` is left at 0 or 2 (never 1), after unmerging what the benchmark merged.
pub struct KsmSession {
    saved: Vec<(String, String)>,
}

impl KsmSession {
    /// Saves every knob, then sets `sleep_millisecs` and `pages_to_scan` (run stays 0 until
    /// [`KsmSession::start`]).
    pub fn new(sleep_millisecs: u64, pages_to_scan: u64) -> io::Result<Self> {
        let saved = knobs();
        if !saved.iter().any(|(k, _)| k == "run") {
            return Err(io::Error::new(
                io::ErrorKind::NotFound,
                "KSM's run knob is not there or not writable",
            ));
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
        // Unmerge what the benchmark merged, restore the knobs that changed (some refuse a
        // write while pages are merged, even of their own value), and leave run at 0 or 2.
        let _ = write("run", 2);
        let now = knobs();
        for (k, v) in &self.saved {
            let changed = now.iter().any(|(n, w)| n == k && w != v);
            if k != "run" && changed {
                let _ = write_text(k, v);
            }
        }
        let run = self
            .saved
            .iter()
            .find(|(k, _)| k == "run")
            .map_or("0", |(_, v)| v.as_str());
        let _ = write_text("run", if run == "1" { "2" } else { run });
    }
}

/// CPU time of the `ksmd` kernel thread so far, in nanoseconds (0 if not found).
pub fn ksmd_cpu_ns() -> u64 {
    crate::procfs::pid_of("ksmd")
        .and_then(|pid| crate::procfs::thread_cpu_ns(pid, pid))
        .unwrap_or(0)
}

/// CPU time (user + system) a process has used, in nanoseconds (0 if it is gone).
pub fn process_cpu_ns(pid: u32) -> u64 {
    crate::procfs::process_cpu_ns(pid)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_choice_is_written_back_as_its_word() {
        assert_eq!(knob_value("[none] scan-time\n"), "none");
        assert_eq!(knob_value("none [scan-time]\n"), "scan-time");
        assert_eq!(knob_value("100\n"), "100");
    }
}
