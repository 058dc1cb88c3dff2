//! Small unmodified QEMU guests for the density benchmark: the distribution kernel booted (TCG)
//! with a busybox initramfs built here, as `tests/qemu/run.py` does, holding the churn workload
//! (`guest_churn.c`, compiled static with the host's C compiler) and, for free page reporting, the
//! virtio balloon's modules. Each guest's serial console is read line by line; every process
//! started for a guest is killed by pid when its [`Guest`] is dropped.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use pageone_sync::lock;

/// The churn program's source.
pub const CHURN_C: &str = include_str!("guest_churn.c");

/// One file of a newc cpio archive.
pub struct CpioEntry {
    pub name: String,
    /// The full mode (type bits and permissions), e.g. `0o100755` or `0o040755`.
    pub mode: u32,
    pub data: Vec<u8>,
}

/// A newc ("070701") cpio archive of `entries`, what the kernel unpacks as an initramfs.
pub fn cpio_newc(entries: &[CpioEntry]) -> Vec<u8> {
    fn pad(out: &mut Vec<u8>) {
        while out.len() % 4 != 0 {
            out.push(0);
        }
    }
    let mut out = Vec::new();
    let trailer = CpioEntry {
        name: "TRAILER!!!".into(),
        mode: 0,
        data: Vec::new(),
    };
    for (ino, e) in entries.iter().chain([&trailer]).enumerate() {
        let nlink = if e.mode & 0o170000 == 0o040000 { 2 } else { 1 };
        let fields = [
            ino as u32 + 1,
            e.mode,
            0,
            0,
            nlink,
            0,
            e.data.len() as u32,
            0,
            0,
            0,
            0,
            e.name.len() as u32 + 1,
            0,
        ];
        out.extend_from_slice(b"070701");
        for f in fields {
            out.extend_from_slice(format!("{f:08x}").as_bytes());
        }
        out.extend_from_slice(e.name.as_bytes());
        out.push(0);
        pad(&mut out);
        out.extend_from_slice(&e.data);
        pad(&mut out);
    }
    out
}

/// The `/init` script: mounts, loads the balloon modules if present, runs `churn ARGS` from the
/// kernel command line (after `--`), and reports how it ended.
const INIT: &str = r#"#!/bin/busybox sh
/bin/busybox --install -s /bin
mount -t proc proc /proc
mount -t sysfs sys /sys
for m in virtio_ring virtio virtio_pci_legacy_dev virtio_pci_modern_dev virtio_pci virtio_balloon; do
    [ -f /lib/$m.ko ] && insmod /lib/$m.ko
done
echo "GUEST-UP $(cat /proc/cmdline | tr ' ' '\n' | grep -c init_on_free=1) $(ls /sys/bus/virtio/drivers 2>/dev/null | tr '\n' ' ')"
/bin/churn "$@"
echo "CHURN-EXIT $?"
poweroff -f
"#;

/// What goes into a guest image.
#[derive(Clone, Debug)]
pub struct ImageSpec {
    /// The guest kernel (its modules are taken from `/lib/modules/<version>`).
    pub kernel: PathBuf,
    /// Put the virtio balloon's modules in (for free page reporting).
    pub balloon: bool,
}

/// The newest `/boot/vmlinuz-*`.
pub fn distribution_kernel() -> Result<PathBuf, String> {
    let mut ks: Vec<PathBuf> = std::fs::read_dir("/boot")
        .map_err(|e| format!("cannot read /boot: {e}"))?
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("vmlinuz-"))
        })
        .collect();
    ks.sort();
    ks.pop()
        .ok_or_else(|| "no /boot/vmlinuz-*: install linux-image-amd64".into())
}

fn modules_dir(kernel: &Path) -> Option<PathBuf> {
    let name = kernel.file_name()?.to_string_lossy();
    let version = name.strip_prefix("vmlinuz-")?;
    Some(
        Path::new("/lib/modules")
            .join(version)
            .join("kernel/drivers/virtio"),
    )
}

/// Compiles the churn program (static) in `work`; its path.
pub fn build_churn(work: &Path) -> Result<PathBuf, String> {
    let src = work.join("churn.c");
    let exe = work.join("churn");
    std::fs::write(&src, CHURN_C).map_err(|e| format!("cannot write {}: {e}", src.display()))?;
    let out = Command::new("cc")
        .args(["-O2", "-static", "-o"])
        .arg(&exe)
        .arg(&src)
        .output()
        .map_err(|e| format!("cannot run cc: {e} (install build-essential)"))?;
    if !out.status.success() {
        return Err(format!(
            "cc could not build the churn program: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(exe)
}

/// Writes the initramfs for `spec` into `work`; its path.
pub fn build_initramfs(work: &Path, spec: &ImageSpec) -> Result<PathBuf, String> {
    let read = |p: &Path| std::fs::read(p).map_err(|e| format!("cannot read {}: {e}", p.display()));
    let busybox =
        read(Path::new("/bin/busybox")).map_err(|e| format!("{e} (install busybox-static)"))?;
    let churn = read(&build_churn(work)?)?;
    let dir = |name: &str| CpioEntry {
        name: name.into(),
        mode: 0o040755,
        data: Vec::new(),
    };
    let file = |name: &str, data: Vec<u8>| CpioEntry {
        name: name.into(),
        mode: 0o100755,
        data,
    };
    let mut entries = vec![
        dir("bin"),
        dir("proc"),
        dir("sys"),
        dir("dev"),
        dir("lib"),
        file("init", INIT.as_bytes().to_vec()),
        file("bin/busybox", busybox),
        file("bin/churn", churn),
    ];
    if spec.balloon {
        let mods = modules_dir(&spec.kernel).ok_or("cannot tell the kernel's version")?;
        for m in [
            "virtio",
            "virtio_ring",
            "virtio_pci_legacy_dev",
            "virtio_pci_modern_dev",
            "virtio_pci",
            "virtio_balloon",
        ] {
            let p = mods.join(format!("{m}.ko"));
            if p.is_file() {
                entries.push(file(&format!("lib/{m}.ko"), read(&p)?));
            }
        }
        if !entries.iter().any(|e| e.name == "lib/virtio_balloon.ko") {
            return Err(format!(
                "no virtio_balloon.ko in {}: free page reporting needs it",
                mods.display()
            ));
        }
    }
    let img = work.join(if spec.balloon {
        "initramfs-balloon.cpio"
    } else {
        "initramfs.cpio"
    });
    std::fs::write(&img, cpio_newc(&entries))
        .map_err(|e| format!("cannot write {}: {e}", img.display()))?;
    Ok(img)
}

/// How one guest is started.
#[derive(Clone, Debug)]
pub struct GuestSpec {
    pub kernel: PathBuf,
    pub initrd: PathBuf,
    pub mib: usize,
    /// `-machine mem-merge=on`: QEMU asks for merging (KSM, or pageone through the shim).
    pub mem_merge: bool,
    /// `init_on_free=1` on the guest kernel's command line.
    pub init_on_free: bool,
    /// `-device virtio-balloon,free-page-reporting=on`.
    pub free_page_reporting: bool,
    /// The churn program's arguments.
    pub churn: Vec<String>,
}

/// The QEMU command line for `g`.
pub fn qemu_args(g: &GuestSpec) -> Vec<String> {
    let mut append = "console=ttyS0 quiet panic=-1 rdinit=/init rootfstype=ramfs".to_string();
    if g.init_on_free {
        append += " init_on_free=1";
    }
    append += " --";
    for a in &g.churn {
        append += " ";
        append += a;
    }
    let mut v: Vec<String> = [
        "qemu-system-x86_64",
        "-accel",
        // A 64 MiB translation cache instead of QEMU's default 1 GiB: the guests' code is small,
        // and the host memory measured should be the guests', not the cache's.
        "tcg,tb-size=64",
        "-machine",
        if g.mem_merge {
            "pc,mem-merge=on"
        } else {
            "pc,mem-merge=off"
        },
        "-m",
    ]
    .map(String::from)
    .to_vec();
    v.push(g.mib.to_string());
    v.extend(
        [
            "-smp",
            "1",
            "-nographic",
            "-no-reboot",
            "-nodefaults",
            "-serial",
            "stdio",
        ]
        .map(String::from),
    );
    if g.free_page_reporting {
        v.extend(["-device", "virtio-balloon,free-page-reporting=on"].map(String::from));
    }
    v.extend(["-kernel".into(), g.kernel.display().to_string()]);
    v.extend(["-initrd".into(), g.initrd.display().to_string()]);
    v.extend(["-append".into(), append]);
    v
}

/// A console line with the time it was read.
pub type Line = (Instant, String);

/// One running guest: its launcher process (QEMU itself, or `pageone run` whose child QEMU is),
/// and its console. Dropping it kills the launcher and every descendant by pid.
pub struct Guest {
    child: Child,
    lines: Arc<Mutex<Vec<Line>>>,
}

/// Strips terminal control sequences (SeaBIOS and the kernel reset the console).
pub fn clean_line(raw: &str) -> String {
    let mut out = String::new();
    let mut it = raw.chars().peekable();
    while let Some(c) = it.next() {
        if c == '\x1b' {
            if it.peek() == Some(&'[') {
                it.next();
                while let Some(&n) = it.peek() {
                    it.next();
                    if n.is_ascii_alphabetic() {
                        break;
                    }
                }
            } else {
                it.next();
            }
        } else if c != '\r' {
            out.push(c);
        }
    }
    out.trim().to_string()
}

impl Guest {
    /// Starts `launcher... qemu_args(spec)`; `prepare` adjusts the command (environment, the
    /// cgroup to start in).
    pub fn start(
        launcher: &[String],
        spec: &GuestSpec,
        prepare: impl FnOnce(&mut Command),
    ) -> Result<Self, String> {
        let mut argv: Vec<String> = launcher.to_vec();
        argv.extend(qemu_args(spec));
        let mut cmd = Command::new(&argv[0]);
        cmd.args(&argv[1..])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null());
        prepare(&mut cmd);
        let mut child = cmd
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", argv[0]))?;
        let lines = Arc::new(Mutex::new(Vec::new()));
        let out = child.stdout.take().ok_or("no console pipe")?;
        let l = lines.clone();
        std::thread::spawn(move || {
            for raw in BufReader::new(out).split(b'\n').map_while(Result::ok) {
                let line = clean_line(&String::from_utf8_lossy(&raw));
                if !line.is_empty() {
                    lock(&l).push((Instant::now(), line));
                }
            }
        });
        Ok(Self { child, lines })
    }

    /// The launcher's pid.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The QEMU process: the launcher itself or its descendant named `qemu-system-x86`.
    pub fn qemu_pid(&self) -> Option<u32> {
        std::iter::once(self.pid())
            .chain(descendants(self.pid()))
            .find(|&p| {
                std::fs::read_to_string(format!("/proc/{p}/comm"))
                    .is_ok_and(|c| c.trim() == "qemu-system-x86")
            })
    }

    /// Whether the launcher has exited (and how).
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// Console lines from index `from` on.
    pub fn lines_from(&self, from: usize) -> Vec<Line> {
        lock(&self.lines)
            .get(from..)
            .map_or(Vec::new(), <[Line]>::to_vec)
    }
}

impl Drop for Guest {
    fn drop(&mut self) {
        // Descendants first (QEMU under `pageone run`), then the launcher, each by pid.
        for p in descendants(self.pid()).into_iter().rev() {
            // SAFETY: kill has no memory effects; p is a descendant of our own child.
            unsafe { libc::kill(p as i32, libc::SIGKILL) };
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Every descendant of `pid` (children first), from `/proc/PID/task/*/children`.
pub fn descendants(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    let mut queue = vec![pid];
    while let Some(p) = queue.pop() {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{p}/task")) else {
            continue;
        };
        for t in tasks.flatten() {
            let kids = std::fs::read_to_string(t.path().join("children")).unwrap_or_default();
            for k in kids.split_whitespace().filter_map(|k| k.parse().ok()) {
                out.push(k);
                queue.push(k);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_newc_archive_has_headers_names_data_and_a_trailer_aligned_to_4() {
        let a = cpio_newc(&[
            CpioEntry {
                name: "bin".into(),
                mode: 0o040755,
                data: vec![],
            },
            CpioEntry {
                name: "init".into(),
                mode: 0o100755,
                data: b"#!/bin/sh\n".to_vec(),
            },
        ]);
        assert_eq!(a.len() % 4, 0);
        assert!(a.starts_with(b"070701"));
        // The second header: ino 2, the mode, nlink 1, 10 bytes of data, a 5-byte name.
        let second = 110 + 4; // header + "bin\0" (already 4-aligned: 114 -> 116)
        let h = &a[second + 2..second + 2 + 110];
        let field = |i: usize| {
            u32::from_str_radix(std::str::from_utf8(&h[6 + 8 * i..14 + 8 * i]).unwrap(), 16)
                .unwrap()
        };
        assert_eq!(&h[..6], b"070701");
        assert_eq!(field(0), 2);
        assert_eq!(field(1), 0o100755);
        assert_eq!(field(4), 1);
        assert_eq!(field(6), 10);
        assert_eq!(field(11), 5);
        assert!(a.windows(10).any(|w| w == b"TRAILER!!!"));
        let init = a.windows(10).position(|w| w == b"#!/bin/sh\n").unwrap();
        assert_eq!(init % 4, 0, "data starts 4-aligned");
    }

    #[test]
    fn the_cpio_tool_reads_the_archive_back() {
        if Command::new("cpio").arg("--version").output().is_err() {
            eprintln!("no cpio tool here: skipped");
            return;
        }
        let dir = std::env::temp_dir().join(format!("pageone-cpio-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let a = cpio_newc(&[CpioEntry {
            name: "f".into(),
            mode: 0o100644,
            data: b"hello".to_vec(),
        }]);
        std::fs::write(dir.join("a.cpio"), &a).unwrap();
        let out = Command::new("sh")
            .arg("-c")
            .arg("cpio -it < a.cpio")
            .current_dir(&dir)
            .output()
            .unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "f");
    }

    #[test]
    fn qemu_args_follow_the_spec() {
        let g = GuestSpec {
            kernel: "/boot/vmlinuz-x".into(),
            initrd: "/tmp/i.cpio".into(),
            mib: 160,
            mem_merge: true,
            init_on_free: true,
            free_page_reporting: true,
            churn: vec!["loop".into(), "1".into()],
        };
        let a = qemu_args(&g);
        let s = a.join(" ");
        assert!(s.contains("-machine pc,mem-merge=on -m 160"), "{s}");
        assert!(s.contains("-device virtio-balloon,free-page-reporting=on"));
        assert!(a.last().unwrap().ends_with("init_on_free=1 -- loop 1"));
        let a = qemu_args(&GuestSpec {
            mem_merge: false,
            init_on_free: false,
            free_page_reporting: false,
            ..g
        })
        .join(" ");
        assert!(
            a.contains("mem-merge=off") && !a.contains("balloon") && !a.contains("init_on_free")
        );
    }

    #[test]
    fn console_lines_lose_their_control_sequences() {
        assert_eq!(clean_line("\x1b[2J\x1b[01;01HHB 1 2 3\r"), "HB 1 2 3");
        assert_eq!(clean_line("\x1bcGUEST-UP 1"), "GUEST-UP 1");
    }

    #[test]
    fn the_churn_program_builds_and_runs_once() {
        if Command::new("cc").arg("--version").output().is_err() {
            eprintln!("no C compiler here: skipped");
            return;
        }
        let dir = std::env::temp_dir().join(format!("pageone-churn-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let exe = build_churn(&dir).unwrap();
        let out = Command::new(&exe)
            .args(["once", "2", "10", "10"])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(out.status.success());
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0], "FILLED");
        assert!(lines[1].starts_with("FREED "));
        assert_eq!(lines[2], "ONCE-DONE");
    }

    #[test]
    fn a_dropped_guest_kills_its_launcher_and_descendants() {
        // A stand-in launcher: a shell whose child sleeps (as `pageone run` has QEMU as child).
        let g = Guest::start(
            &[
                "sh".into(),
                "-c".into(),
                "sleep 600 & echo started; wait; : ".into(),
            ],
            &GuestSpec {
                kernel: "k".into(),
                initrd: "i".into(),
                mib: 1,
                mem_merge: false,
                init_on_free: false,
                free_page_reporting: false,
                churn: vec![],
            },
            |_| {},
        )
        .unwrap();
        let t = Instant::now();
        while g.lines_from(0).is_empty() {
            assert!(t.elapsed().as_secs() < 10);
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let kids = descendants(g.pid());
        assert_eq!(kids.len(), 1, "{kids:?}");
        drop(g);
        std::thread::sleep(std::time::Duration::from_millis(100));
        let state = std::fs::read_to_string(format!("/proc/{}/stat", kids[0])).unwrap_or_default();
        // Gone, or a zombie until init reaps it.
        assert!(state.is_empty() || state.contains(") Z"), "{state}");
    }
}
