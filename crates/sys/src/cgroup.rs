//! The calling process's memory cgroup (v1 or v2): how close its usage is to the tightest
//! limit on the way to the root, the one whose reclaim and OOM kills the process meets first.

use std::io;
use std::path::{Path, PathBuf};

/// The highest usage / limit (0.0–1.0 and above) among the calling process's memory cgroup and
/// its ancestors that have a limit; `None` where none has one, or the hierarchy is not
/// mounted or readable here.
pub fn memory_cgroup_fill() -> Option<f64> {
    let h = Hierarchy::of_this_process()?;
    let mut dir = h.cgroup;
    let mut fill: Option<f64> = None;
    loop {
        if let Ok(Some(f)) = level_fill(&dir, h.version) {
            fill = Some(fill.map_or(f, |g: f64| g.max(f)));
        }
        if dir == h.mount || !dir.pop() || !dir.starts_with(&h.mount) {
            break;
        }
    }
    fill
}

/// The hierarchy holding the calling process's memory controller: its version, where it is
/// mounted, and the process's cgroup directory in it.
struct Hierarchy {
    version: Version,
    mount: PathBuf,
    cgroup: PathBuf,
}

impl Hierarchy {
    fn of_this_process() -> Option<Self> {
        let cgroups = std::fs::read_to_string("/proc/self/cgroup").ok()?;
        let mounts = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
        let (version, path) = memory_cgroup_path(&cgroups)?;
        let (mount, root) = memory_mount(&mounts, version)?;
        let rel = path.strip_prefix(root.as_str()).unwrap_or(&path);
        let mount = PathBuf::from(mount);
        let cgroup = mount.join(rel.trim_start_matches('/'));
        Some(Self {
            version,
            mount,
            cgroup,
        })
    }
}

/// Makes `cmd`'s child move itself into the cgroup whose `cgroup.procs` file is `procs` before
/// it execs, so that nothing it allocates or forks is charged elsewhere.
pub fn start_in_cgroup(cmd: &mut std::process::Command, procs: std::ffi::CString) {
    use std::os::unix::process::CommandExt;
    // SAFETY: the closure runs in the child between fork and exec and only makes
    // async-signal-safe calls (open, write, close) on memory allocated before the fork.
    unsafe {
        cmd.pre_exec(move || {
            let fd = libc::open(procs.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
            if fd < 0 {
                return Err(io::Error::last_os_error());
            }
            // "0": the writing process itself.
            let r = libc::write(fd, b"0".as_ptr().cast(), 1);
            libc::close(fd);
            if r != 1 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// Which hierarchy holds the memory controller.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Version {
    V1,
    V2,
}

impl Version {
    /// A cgroup's memory usage file and its limit file.
    fn files(self) -> (&'static str, &'static str) {
        match self {
            Version::V1 => ("memory.usage_in_bytes", "memory.limit_in_bytes"),
            Version::V2 => ("memory.current", "memory.max"),
        }
    }
}

/// The memory cgroup's path from `/proc/self/cgroup`: the v1 line naming `memory`, else the v2
/// line (`0::/path`).
fn memory_cgroup_path(text: &str) -> Option<(Version, String)> {
    let mut v2 = None;
    for line in text.lines() {
        let mut f = line.splitn(3, ':');
        let (Some(id), Some(controllers), Some(path)) = (f.next(), f.next(), f.next()) else {
            continue;
        };
        if controllers.split(',').any(|c| c == "memory") {
            return Some((Version::V1, path.to_string()));
        }
        if id == "0" && controllers.is_empty() {
            v2 = Some((Version::V2, path.to_string()));
        }
    }
    v2
}

/// Where the hierarchy of `version` is mounted, and the cgroup path its mount shows as its root
/// (not `/` inside a cgroup namespace), from `/proc/self/mountinfo`.
fn memory_mount(text: &str, version: Version) -> Option<(String, String)> {
    for line in text.lines() {
        let Some((before, after)) = line.split_once(" - ") else {
            continue;
        };
        let fields: Vec<&str> = before.split(' ').collect();
        let mut tail = after.split(' ');
        let (Some(fstype), _, Some(options)) = (tail.next(), tail.next(), tail.next()) else {
            continue;
        };
        let (Some(root), Some(mount)) = (fields.get(3), fields.get(4)) else {
            continue;
        };
        let found = match version {
            Version::V1 => fstype == "cgroup" && options.split(',').any(|o| o == "memory"),
            Version::V2 => fstype == "cgroup2",
        };
        if found {
            return Some((unescape(mount), unescape(root)));
        }
    }
    None
}

/// A mountinfo field with its octal escapes (`\040` for a space) undone.
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let octal = b
            .get(i + 1..i + 4)
            .filter(|d| d.iter().all(|c| (b'0'..=b'7').contains(c)));
        match (b[i], octal) {
            (b'\\', Some(d)) => {
                out.push((d[0] - b'0') * 64 + (d[1] - b'0') * 8 + (d[2] - b'0'));
                i += 4;
            }
            (c, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Usage / limit of one cgroup directory; `None` without a limit.
fn level_fill(dir: &Path, version: Version) -> io::Result<Option<f64>> {
    let (usage, limit) = version.files();
    let limit = std::fs::read_to_string(dir.join(limit))?;
    let Some(limit) = parse_limit(&limit) else {
        return Ok(None);
    };
    let usage: u64 = std::fs::read_to_string(dir.join(usage))?
        .trim()
        .parse()
        .map_err(|_| io::Error::from(io::ErrorKind::InvalidData))?;
    Ok(Some(usage as f64 / limit.max(1) as f64))
}

/// A limit as the kernel writes it: `max` (v2) or a page-rounded `LLONG_MAX` (v1) mean none.
fn parse_limit(text: &str) -> Option<u64> {
    let v: u64 = text.trim().parse().ok()?;
    (v < 1 << 60).then_some(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_memory_cgroup_is_found_in_either_hierarchy() {
        let v1 = "9:name=systemd:/\n4:memory:/a/b\n1:cpu,cpuacct:/\n0::/\n";
        assert_eq!(memory_cgroup_path(v1), Some((Version::V1, "/a/b".into())));
        let v2 = "0::/user.slice/x.scope\n";
        assert_eq!(
            memory_cgroup_path(v2),
            Some((Version::V2, "/user.slice/x.scope".into()))
        );
        assert_eq!(memory_cgroup_path("garbage\n"), None);
        let mounts = "\
a line without its separator
30 25 0:26 / /sys/fs/cgroup/unified rw,relatime shared:5 - cgroup2 cgroup2 rw
35 25 0:31 /ns /sys/fs/cgroup/memory rw,relatime shared:15 - cgroup cgroup rw,memory
36 25 0:32 / /sys/fs/cgroup/cpu\\040x rw,relatime shared:16 - cgroup cgroup rw,cpu
";
        assert_eq!(
            memory_mount(mounts, Version::V1),
            Some(("/sys/fs/cgroup/memory".into(), "/ns".into()))
        );
        assert_eq!(
            memory_mount(mounts, Version::V2),
            Some(("/sys/fs/cgroup/unified".into(), "/".into()))
        );
        assert_eq!(unescape("/a\\040b\\"), "/a b\\");
    }

    #[test]
    fn unlimited_is_no_limit() {
        assert_eq!(parse_limit("max\n"), None);
        assert_eq!(parse_limit("9223372036854771712\n"), None);
        assert_eq!(parse_limit("1073741824\n"), Some(1 << 30));
    }

    /// Run by the test below inside a cgroup it made: touches 48 MiB (of 64) and prints the
    /// fill; passes at once anywhere else.
    #[test]
    fn child_in_a_limited_cgroup() {
        if std::env::var_os("PAGEONE_CGROUP_CHILD").is_none() {
            return;
        }
        let v = vec![1u8; 48 << 20];
        std::hint::black_box(&v);
        println!("FILL {:?}", memory_cgroup_fill());
    }

    /// A process in a memory cgroup limited to 64 MiB that holds 48 MiB sees it three quarters
    /// full or more (root: the test makes the cgroup, in whichever hierarchy holds the memory
    /// controller here).
    #[test]
    fn a_process_in_a_limited_memory_cgroup_sees_how_full_it_is() {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("skipped: making a cgroup takes root");
            return;
        }
        let h = Hierarchy::of_this_process().expect("a memory cgroup, its hierarchy mounted");
        let dir = h.mount.join(format!("pageone-test-{}", std::process::id()));
        if let Err(e) = std::fs::create_dir(&dir) {
            // A container's read-only cgroup file system, say: nothing to make it in.
            eprintln!("skipped: could not make {}: {e}", dir.display());
            return;
        }
        let (_, limit) = h.version.files();
        if h.version == Version::V2 {
            // The controller must be on for children of the mount's root.
            let _ = std::fs::write(
                dir.parent().unwrap().join("cgroup.subtree_control"),
                "+memory",
            );
        }
        std::fs::write(dir.join(limit), (64u64 << 20).to_string()).unwrap();
        let procs = dir.join("cgroup.procs");
        let mut c = std::process::Command::new(std::env::current_exe().unwrap());
        c.args([
            "--exact",
            "cgroup::tests::child_in_a_limited_cgroup",
            "--nocapture",
        ])
        .env("PAGEONE_CGROUP_CHILD", "1");
        start_in_cgroup(
            &mut c,
            std::ffi::CString::new(procs.as_os_str().as_encoded_bytes()).unwrap(),
        );
        let out = c.output().unwrap();
        let _ = std::fs::remove_dir(&dir);
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{out:?}");
        let fill: f64 = text
            .lines()
            .find_map(|l| {
                l.strip_prefix("FILL Some(")?
                    .strip_suffix(')')?
                    .parse()
                    .ok()
            })
            .unwrap_or_else(|| panic!("no fill printed: {text}"));
        assert!((0.75..=1.0).contains(&fill), "{fill}");
    }
}
