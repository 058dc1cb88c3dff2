//! Host state the density benchmark changes, each undone when its guard is dropped: a memory
//! cgroup holding the guests (cgroup v2 `memory.max`, or v1 `memory.limit_in_bytes` where the
//! memory controller is on a v1 hierarchy), every KSM knob, and the SIGINT/SIGTERM handlers that
//! turn Ctrl-C into an orderly stop (so the other guards run).

use std::ffi::CString;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

/// Which cgroup interface the memory controller has here.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CgroupVersion {
    V2,
    V1,
}

/// Where a memory cgroup can be made: the v2 mount whose root offers `memory`, else the v1
/// memory hierarchy's mount.
pub fn memory_hierarchy() -> io::Result<(CgroupVersion, PathBuf)> {
    let mounts = std::fs::read_to_string("/proc/self/mounts")?;
    let mut v1 = None;
    for l in mounts.lines() {
        let f: Vec<&str> = l.split_whitespace().collect();
        if f.len() < 4 {
            continue;
        }
        let dir = PathBuf::from(f[1]);
        if f[2] == "cgroup2" {
            let c = std::fs::read_to_string(dir.join("cgroup.controllers")).unwrap_or_default();
            if c.split_whitespace().any(|x| x == "memory") {
                return Ok((CgroupVersion::V2, dir));
            }
        } else if f[2] == "cgroup" && f[3].split(',').any(|o| o == "memory") {
            v1 = Some(dir);
        }
    }
    v1.map(|d| (CgroupVersion::V1, d)).ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::NotFound,
            "no memory cgroup controller is mounted (cgroup v2 or v1)",
        )
    })
}

/// A memory cgroup with a limit, removed when dropped (after killing, by pid, whatever is still
/// in it: only processes this benchmark put there).
pub struct MemoryCgroup {
    pub version: CgroupVersion,
    pub dir: PathBuf,
    procs: CString,
}

impl MemoryCgroup {
    /// Creates `name` under the memory hierarchy with a limit of `limit` bytes (no swap here: a
    /// v1 `memsw` limit is set too where it exists).
    pub fn create(name: &str, limit: u64) -> io::Result<Self> {
        let (version, root) = memory_hierarchy()?;
        if version == CgroupVersion::V2 {
            // The controller must be enabled for the root's children (it usually is).
            let _ = std::fs::write(root.join("cgroup.subtree_control"), "+memory");
        }
        let dir = root.join(name);
        std::fs::create_dir(&dir)?;
        let procs = CString::new(dir.join("cgroup.procs").as_os_str().as_encoded_bytes())
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a NUL in the path"))?;
        let cg = Self {
            version,
            dir,
            procs,
        };
        match version {
            CgroupVersion::V2 => {
                cg.write("memory.max", &limit.to_string())?;
                let _ = cg.write("memory.swap.max", "0");
            }
            CgroupVersion::V1 => {
                cg.write("memory.limit_in_bytes", &limit.to_string())?;
                let _ = cg.write("memory.memsw.limit_in_bytes", &limit.to_string());
            }
        }
        Ok(cg)
    }

    fn write(&self, file: &str, v: &str) -> io::Result<()> {
        std::fs::write(self.dir.join(file), v)
    }

    fn read(&self, file: &str) -> io::Result<String> {
        std::fs::read_to_string(self.dir.join(file))
    }

    /// The limit in bytes, as the kernel holds it.
    pub fn limit(&self) -> io::Result<u64> {
        let f = match self.version {
            CgroupVersion::V2 => "memory.max",
            CgroupVersion::V1 => "memory.limit_in_bytes",
        };
        parse_u64(&self.read(f)?)
    }

    /// Memory charged to the cgroup now, in bytes.
    pub fn usage(&self) -> io::Result<u64> {
        let f = match self.version {
            CgroupVersion::V2 => "memory.current",
            CgroupVersion::V1 => "memory.usage_in_bytes",
        };
        parse_u64(&self.read(f)?)
    }

    /// Processes the kernel's OOM killer killed in the cgroup so far.
    pub fn oom_kills(&self) -> u64 {
        let (file, key) = match self.version {
            CgroupVersion::V2 => ("memory.events", "oom_kill"),
            CgroupVersion::V1 => ("memory.oom_control", "oom_kill"),
        };
        self.read(file)
            .unwrap_or_default()
            .lines()
            .find_map(|l| l.strip_prefix(key)?.trim().parse().ok())
            .unwrap_or(0)
    }

    /// Moves process `pid` into the cgroup.
    pub fn add(&self, pid: u32) -> io::Result<()> {
        self.write("cgroup.procs", &pid.to_string())
    }

    /// Pids in the cgroup.
    pub fn pids(&self) -> Vec<u32> {
        self.read("cgroup.procs")
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect()
    }

    /// Makes `cmd` start inside the cgroup: the child moves itself before it execs, so nothing it
    /// allocates or forks is charged elsewhere.
    pub fn spawn_inside(&self, cmd: &mut std::process::Command) {
        pageone_sys::start_in_cgroup(cmd, self.procs.clone());
    }
}

impl Drop for MemoryCgroup {
    fn drop(&mut self) {
        for _ in 0..50 {
            let pids = self.pids();
            if pids.is_empty() && std::fs::remove_dir(&self.dir).is_ok() {
                return;
            }
            for p in pids {
                // SAFETY: kill has no memory effects; only this benchmark's processes are here.
                unsafe { libc::kill(p as i32, libc::SIGKILL) };
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        eprintln!("could not remove the cgroup {}", self.dir.display());
    }
}

fn parse_u64(s: &str) -> io::Result<u64> {
    let s = s.trim();
    if s == "max" {
        return Ok(u64::MAX);
    }
    s.parse()
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, format!("not a number: {s}")))
}

const KSM: &str = "/sys/kernel/mm/ksm";

/// Every writable KSM knob saved, set as asked, and restored when dropped; `run` ends at 0
/// (after `run=2` unmerged what was merged meanwhile).
pub struct KsmKnobs {
    saved: Vec<(String, String)>,
}

impl KsmKnobs {
    /// Saves the knobs, unmerges (run=2), and sets `knobs` (leaving run at 0 until
    /// [`KsmKnobs::start`]).
    pub fn new(knobs: &[(&str, &str)]) -> io::Result<Self> {
        let mut saved = Vec::new();
        for e in std::fs::read_dir(KSM)?.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let writable = e.metadata().is_ok_and(|m| {
                use std::os::unix::fs::PermissionsExt;
                m.permissions().mode() & 0o200 != 0
            });
            if writable {
                saved.push((name, std::fs::read_to_string(e.path())?.trim().to_string()));
            }
        }
        saved.sort();
        let k = Self { saved };
        write_knob("run", "2")?;
        for (n, v) in knobs {
            write_knob(n, v)?;
        }
        Ok(k)
    }

    pub fn start(&self) -> io::Result<()> {
        write_knob("run", "1")
    }

    /// The knobs saved, by name.
    pub fn saved(&self) -> &[(String, String)] {
        &self.saved
    }
}

fn write_knob(name: &str, v: &str) -> io::Result<()> {
    std::fs::write(Path::new(KSM).join(name), v)
        .map_err(|e| io::Error::new(e.kind(), format!("cannot set KSM's {name} to {v}: {e}")))
}

impl Drop for KsmKnobs {
    fn drop(&mut self) {
        let _ = write_knob("run", "2");
        for (n, v) in &self.saved {
            if n != "run" {
                // Some knobs refuse a write while pages are merged or while they hold their
                // value already; run=2 above unmerged.
                let cur = std::fs::read_to_string(Path::new(KSM).join(n)).unwrap_or_default();
                if cur.trim() != v {
                    let _ = write_knob(n, v);
                }
            }
        }
        let _ = write_knob("run", "0");
    }
}

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    // Relaxed: a flag polled by the benchmark's loops.
    INTERRUPTED.store(true, Ordering::Relaxed);
}

/// Turns SIGINT and SIGTERM into [`interrupted`] returning true (the benchmark then stops and
/// its guards kill the guests, restore KSM and remove the cgroup). Restored when dropped.
pub struct InterruptGuard {
    old: [libc::sighandler_t; 2],
}

impl InterruptGuard {
    pub fn install() -> Self {
        let h = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
        // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
        let old = unsafe {
            [
                libc::signal(libc::SIGINT, h),
                libc::signal(libc::SIGTERM, h),
            ]
        };
        Self { old }
    }
}

impl Drop for InterruptGuard {
    fn drop(&mut self) {
        // SAFETY: restores the dispositions saved by `install`.
        unsafe {
            libc::signal(libc::SIGINT, self.old[0]);
            libc::signal(libc::SIGTERM, self.old[1]);
        }
    }
}

/// Whether SIGINT or SIGTERM arrived since the guard was installed.
pub fn interrupted() -> bool {
    // Relaxed: see `on_signal`.
    INTERRUPTED.load(Ordering::Relaxed)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn root() -> bool {
        // SAFETY: geteuid has no preconditions.
        unsafe { libc::geteuid() == 0 }
    }

    /// On the real kernel: a cgroup is made with the limit, a process started inside is
    /// charged to it and killed by the OOM killer when it allocates past the limit, and the
    /// cgroup is gone after the guard.
    #[test]
    fn a_cgroup_limits_a_process_started_inside_and_is_removed() {
        if !root() || memory_hierarchy().is_err() {
            eprintln!("needs root and a memory cgroup controller: skipped");
            return;
        }
        let name = format!("pageone-test-{}", std::process::id());
        let cg = MemoryCgroup::create(&name, 64 << 20).unwrap();
        assert_eq!(cg.limit().unwrap(), 64 << 20);
        let dir = cg.dir.clone();
        // A process that holds 16 MiB: charged, not killed.
        let mut cmd = std::process::Command::new("sh");
        cmd.arg("-c")
            .arg("head -c 16777216 /dev/zero | tail -c 16777216 > /dev/null; sleep 30");
        cg.spawn_inside(&mut cmd);
        let mut small = cmd.spawn().unwrap();
        let t = std::time::Instant::now();
        while cg.pids().len() < 2 {
            assert!(t.elapsed().as_secs() < 10, "{:?}", cg.pids());
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert!(cg.pids().contains(&small.id()));
        assert!(cg.usage().unwrap() > 0);
        // One that allocates 256 MiB (tail keeps it all): the OOM killer ends it.
        let mut cmd = std::process::Command::new("sh");
        cmd.arg("-c")
            .arg("head -c 268435456 /dev/zero | tail -c 268435456 > /dev/null");
        cg.spawn_inside(&mut cmd);
        let status = cmd.status().unwrap();
        assert!(!status.success());
        assert!(cg.oom_kills() >= 1, "no OOM kill counted");
        assert!(
            small.try_wait().unwrap().is_none(),
            "the small one still runs"
        );
        drop(cg);
        assert!(!dir.exists(), "the cgroup is removed");
        // The guard killed what was left inside.
        assert!(small.wait().is_ok());
    }

    #[test]
    fn ksm_knobs_are_restored_and_run_left_at_0() {
        if !root() || !Path::new(KSM).join("run").exists() {
            eprintln!("needs root and KSM: skipped");
            return;
        }
        let read = |n: &str| std::fs::read_to_string(Path::new(KSM).join(n)).unwrap();
        let before = (read("sleep_millisecs"), read("pages_to_scan"));
        {
            let k = KsmKnobs::new(&[("sleep_millisecs", "7"), ("pages_to_scan", "1234")]).unwrap();
            assert!(k.saved().iter().any(|(n, _)| n == "pages_to_scan"));
            assert_eq!(read("sleep_millisecs").trim(), "7");
            assert_eq!(read("pages_to_scan").trim(), "1234");
            assert_eq!(read("run").trim(), "2");
        }
        assert_eq!((read("sleep_millisecs"), read("pages_to_scan")), before);
        assert_eq!(read("run").trim(), "0");
    }

    #[test]
    fn numbers_and_max_parse() {
        assert_eq!(parse_u64("123\n").unwrap(), 123);
        assert_eq!(parse_u64("max\n").unwrap(), u64::MAX);
        assert!(parse_u64("x").is_err());
    }
}
