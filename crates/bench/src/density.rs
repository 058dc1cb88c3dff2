//! How many guests fit in one memory budget (issue #29, the seed's density experiment scaled
//! down), and how fast freed guest memory comes back to the host.
//!
//! [`run_trial`] boots N small TCG guests ([`crate::guest`]) inside one memory cgroup
//! ([`crate::host::MemoryCgroup`]) and lets their churn run a fixed time; the trial fails when a
//! guest is OOM-killed (by the host's cgroup or its own kernel), exits, fails its data check,
//! or stalls (no phase finished for `stall_secs`). [`search`] finds the largest N that passes:
//! doubling until a failure, then bisecting. Each [`Mode`] is one way of running the guests:
//! no merging, KSM (kernel defaults, or at its fastest), pageone (`pageone run` under one shared
//! daemon, as `tests/qemu/run.py` runs it), pageone with guests that zero what they free
//! (`init_on_free=1`: the engine releases zero pages), and virtio-balloon free page reporting.
//!
//! [`measure_return`] boots one guest that fills memory, frees it and waits: the time from the
//! guest's `munmap` to the QEMU process's anonymous RSS falling by 90% of it, and what the
//! `munmap` cost the guest (with `init_on_free=1` it zeroes every page).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::guest::{Guest, GuestSpec};
use crate::host::{interrupted, KsmKnobs, MemoryCgroup};

/// A way of running the guests.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Mode {
    /// No merging, no free page reporting.
    None,
    /// KSM at the kernel's defaults (`sleep_millisecs=20`, `pages_to_scan=100`).
    Ksm,
    /// KSM at its fastest (`sleep_millisecs=0`, `pages_to_scan=100000`).
    KsmFast,
    /// `pageone run` under one shared daemon.
    Pageone,
    /// The same, the guests booted with `init_on_free=1`.
    PageoneZero,
    /// `-device virtio-balloon,free-page-reporting=on`, no merging.
    Fpr,
}

impl Mode {
    pub const ALL: [Mode; 6] = [
        Mode::None,
        Mode::Ksm,
        Mode::KsmFast,
        Mode::Pageone,
        Mode::PageoneZero,
        Mode::Fpr,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Mode::None => "none",
            Mode::Ksm => "ksm",
            Mode::KsmFast => "ksm-fast",
            Mode::Pageone => "pageone",
            Mode::PageoneZero => "pageone-zero",
            Mode::Fpr => "fpr",
        }
    }

    pub fn parse(s: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|m| m.name() == s)
            .ok_or_else(|| {
                let names: Vec<&str> = Self::ALL.iter().map(|m| m.name()).collect();
                format!("unknown mode {s}: one of {}", names.join(", "))
            })
    }

    fn ksm_knobs(self) -> Option<[(&'static str, &'static str); 2]> {
        match self {
            Mode::Ksm => Some([("sleep_millisecs", "20"), ("pages_to_scan", "100")]),
            Mode::KsmFast => Some([("sleep_millisecs", "0"), ("pages_to_scan", "100000")]),
            _ => None,
        }
    }

    fn pageone(self) -> bool {
        matches!(self, Mode::Pageone | Mode::PageoneZero)
    }

    fn mem_merge(self) -> bool {
        !matches!(self, Mode::None | Mode::Fpr)
    }

    fn init_on_free(self) -> bool {
        self == Mode::PageoneZero
    }
}

/// The benchmark's parameters.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct Params {
    pub budget_mib: u64,
    pub guest_mib: usize,
    /// How long every guest must run once all are up.
    pub seconds: u64,
    pub max_guests: usize,
    /// The first N tried.
    pub start: usize,
    /// The churn: its largest phase (MiB), the share of pages every guest has, hold and idle.
    pub peak_mib: usize,
    pub shared_pct: u32,
    pub hold_ms: u64,
    pub idle_ms: u64,
    /// A guest that finishes no phase for this long has stalled.
    pub stall_secs: u64,
    /// Seconds between one guest's start and the next's (0: all at once). Booting together
    /// measures the boot's transient peak more than the steady state.
    #[serde(default)]
    pub stagger_secs: u64,
}

/// What the trials need from the host: the binaries and the guest images.
#[derive(Clone, Debug)]
pub struct Setup {
    /// The `pageone` binary (for the pageone modes).
    pub pageone: PathBuf,
    pub kernel: PathBuf,
    pub initrd: PathBuf,
    /// The image with the virtio balloon's modules.
    pub initrd_balloon: PathBuf,
    /// Where sockets go.
    pub work: PathBuf,
}

/// One trial: N guests for the fixed time.
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct Trial {
    pub mode: String,
    pub guests: usize,
    pub ok: bool,
    /// Why it failed.
    pub failure: Option<String>,
    /// Seconds from the last guest's start to every guest's first phase.
    pub boot_secs: f64,
    /// The cgroup's usage at steady state (mean over the second half of the run) and its peak.
    pub usage_mib: f64,
    pub usage_peak_mib: f64,
    pub per_guest_mib: f64,
    /// The QEMU processes' summed Pss at the end of the run.
    pub pss_mib: f64,
    /// Churn phases finished, and the medians of the guests' fill and free (munmap) times.
    pub phases: u64,
    pub fill_ms_median: f64,
    pub free_ms_median: f64,
    pub oom_kills: u64,
}

/// A process killed by pid when dropped (the daemon).
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The `HB phase mib fill_ms free_ms ok` line of a churn phase: (fill_ms, free_ms, ok).
pub fn parse_heartbeat(line: &str) -> Option<(f64, f64, bool)> {
    let f: Vec<&str> = line.strip_prefix("HB ")?.split_whitespace().collect();
    if f.len() != 5 {
        return None;
    }
    Some((f[2].parse().ok()?, f[3].parse().ok()?, f[4] == "1"))
}

/// Whether a console line says the guest failed (its own OOM killer, a panic, the churn gone).
pub fn failure_line(line: &str) -> bool {
    [
        "Out of memory",
        "Kernel panic",
        "CHURN-EXIT",
        "CHURN-FAIL",
        "oom-kill",
        "insmod: can't",
    ]
    .iter()
    .any(|s| line.contains(s))
}

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn pss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| {
            l.strip_prefix("Pss:")?
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
        .unwrap_or(0)
}

/// The daemon for the pageone modes, started inside the cgroup (its store is guest memory).
fn start_daemon(s: &Setup, cg: &MemoryCgroup, socket: &Path) -> Result<Killed, String> {
    let _ = std::fs::remove_file(socket);
    let mut cmd = Command::new(&s.pageone);
    cmd.args(["daemon", "--socket"])
        .arg(socket)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    cg.spawn_inside(&mut cmd);
    let d = Killed(
        cmd.spawn()
            .map_err(|e| format!("cannot start {} daemon: {e}", s.pageone.display()))?,
    );
    let t = Instant::now();
    while !socket.exists() {
        if t.elapsed() > Duration::from_secs(10) {
            return Err("the pageone daemon did not open its socket in 10 s".into());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(d)
}

/// The guest's churn arguments.
fn churn_args(p: &Params, guest: usize) -> Vec<String> {
    [
        "loop".to_string(),
        "29".into(),
        guest.to_string(),
        p.peak_mib.to_string(),
        p.shared_pct.to_string(),
        p.hold_ms.to_string(),
        p.idle_ms.to_string(),
    ]
    .to_vec()
}

/// Where guests start: the host's setup, the cgroup, the daemon's socket.
struct Place<'a> {
    s: &'a Setup,
    cg: &'a MemoryCgroup,
    socket: &'a Path,
}

/// Starts `n` guests of `mode` of `guest_mib` inside the cgroup, guest g running
/// `churn(g)`, `stagger` apart.
fn start_guests(
    mode: Mode,
    n: usize,
    guest_mib: usize,
    at: &Place,
    stagger: Duration,
    churn: impl Fn(usize) -> Vec<String>,
) -> Result<Vec<Guest>, String> {
    let Place { s, cg, socket } = *at;
    let launcher: Vec<String> = if mode.pageone() {
        let mut l: Vec<String> = vec![s.pageone.display().to_string(), "run".into()];
        l.extend(["--scope", "density", "--daemon"].map(String::from));
        l.push(socket.display().to_string());
        l.push("--".into());
        l
    } else {
        Vec::new()
    };
    (0..n)
        .map(|g| {
            if g > 0 && !stagger.is_zero() {
                std::thread::sleep(stagger);
            }
            if interrupted() {
                return Err("interrupted".to_string());
            }
            let spec = GuestSpec {
                kernel: s.kernel.clone(),
                initrd: if mode == Mode::Fpr {
                    s.initrd_balloon.clone()
                } else {
                    s.initrd.clone()
                },
                mib: guest_mib,
                mem_merge: mode.mem_merge(),
                init_on_free: mode.init_on_free(),
                free_page_reporting: mode == Mode::Fpr,
                churn: churn(g),
            };
            Guest::start(&launcher, &spec, |cmd| {
                cmd.env_remove("LD_PRELOAD");
                cg.spawn_inside(cmd);
            })
        })
        .collect()
}

/// What the monitor has seen of one guest.
#[derive(Default)]
struct Seen {
    read: usize,
    last_phase: Option<Instant>,
    phases: u64,
    fill_ms: Vec<f64>,
    free_ms: Vec<f64>,
}

/// Reads the guests' new console lines; an error names the first failure.
fn poll_guests(guests: &mut [Guest], seen: &mut [Seen]) -> Result<(), String> {
    for (g, (guest, s)) in guests.iter_mut().zip(seen.iter_mut()).enumerate() {
        let lines = guest.lines_from(s.read);
        s.read += lines.len();
        for (at, l) in lines {
            if let Some((fill, free, ok)) = parse_heartbeat(&l) {
                if !ok {
                    return Err(format!("guest {g}: its data changed under it"));
                }
                s.last_phase = Some(at);
                s.phases += 1;
                s.fill_ms.push(fill);
                s.free_ms.push(free);
            } else if failure_line(&l) {
                return Err(format!("guest {g}: {l}"));
            }
        }
        if let Some(st) = guest.exited() {
            return Err(format!("guest {g}: QEMU exited ({st})"));
        }
    }
    Ok(())
}

/// Runs one trial (see the module documentation). Every process it starts is killed and the
/// cgroup removed (and KSM's knobs restored) before it returns, whatever happens.
pub fn run_trial(mode: Mode, n: usize, p: &Params, s: &Setup) -> Result<Trial, String> {
    let name = format!("pageone-density-{}", std::process::id());
    let cg = MemoryCgroup::create(&name, p.budget_mib << 20)
        .map_err(|e| format!("cannot create the cgroup {name}: {e}"))?;
    let ksm = match mode.ksm_knobs() {
        Some(k) => {
            let k = KsmKnobs::new(&k).map_err(|e| e.to_string())?;
            k.start().map_err(|e| e.to_string())?;
            Some(k)
        }
        None => None,
    };
    let socket = s.work.join("density.sock");
    let daemon = if mode.pageone() {
        Some(start_daemon(s, &cg, &socket)?)
    } else {
        None
    };
    let mut trial = Trial {
        mode: mode.name().into(),
        guests: n,
        ..Default::default()
    };
    let at = Place {
        s,
        cg: &cg,
        socket: &socket,
    };
    let stagger = Duration::from_secs(p.stagger_secs);
    let result = start_guests(mode, n, p.guest_mib, &at, stagger, |g| churn_args(p, g))
        .and_then(|mut guests| monitor(&mut guests, p, &cg, &mut trial));
    trial.oom_kills = cg.oom_kills();
    match result {
        Ok(()) => trial.ok = true,
        Err(e) if e == "interrupted" => return Err(e),
        Err(e) => trial.failure = Some(e),
    }
    // The guests were dropped (killed) with `result`'s closure; now the daemon, KSM and the
    // cgroup, in that order.
    drop(daemon);
    drop(ksm);
    drop(cg);
    Ok(trial)
}

/// Watches the guests: boot, then `p.seconds` of churn; fills in `t`'s figures.
fn monitor(
    guests: &mut [Guest],
    p: &Params,
    cg: &MemoryCgroup,
    t: &mut Trial,
) -> Result<(), String> {
    let n = guests.len();
    let mut seen: Vec<Seen> = (0..n).map(|_| Seen::default()).collect();
    let t0 = Instant::now();
    let boot_limit = Duration::from_secs(90 + 20 * n as u64);
    let mut usage: Vec<(Instant, u64)> = Vec::new();
    let mut up: Option<Instant> = None;
    // The cgroup is new: every OOM kill in it, also during a staggered start, counts.
    let mut oom0 = 0;
    loop {
        std::thread::sleep(Duration::from_millis(500));
        if interrupted() {
            return Err("interrupted".into());
        }
        let now = Instant::now();
        usage.push((now, cg.usage().unwrap_or(0)));
        let r = poll_guests(guests, &mut seen);
        let kills = cg.oom_kills();
        if kills > oom0 {
            return Err(format!(
                "the host's OOM killer killed {} process(es)",
                kills - oom0
            ));
        }
        oom0 = kills;
        r?;
        match up {
            None if seen.iter().all(|s| s.phases > 0) => {
                up = Some(now);
                t.boot_secs = (now - t0).as_secs_f64();
            }
            None if now - t0 > boot_limit => {
                let g = seen.iter().position(|s| s.phases == 0).unwrap_or(0);
                return Err(format!(
                    "guest {g} finished no phase in {} s",
                    boot_limit.as_secs()
                ));
            }
            None => {}
            Some(u) => {
                let stall = Duration::from_secs(p.stall_secs);
                if let Some(g) = seen
                    .iter()
                    .position(|s| s.last_phase.is_some_and(|l| now - l > stall))
                {
                    return Err(format!(
                        "guest {g} stalled: no phase for {} s",
                        p.stall_secs
                    ));
                }
                if now - u >= Duration::from_secs(p.seconds) {
                    let half = u + Duration::from_secs(p.seconds / 2);
                    let steady: Vec<f64> = usage
                        .iter()
                        .filter(|(at, _)| *at >= half)
                        .map(|&(_, b)| b as f64)
                        .collect();
                    t.usage_mib =
                        steady.iter().sum::<f64>() / steady.len().max(1) as f64 / 1048576.0;
                    t.usage_peak_mib =
                        usage.iter().map(|&(_, b)| b).max().unwrap_or(0) as f64 / 1048576.0;
                    t.per_guest_mib = t.usage_mib / n as f64;
                    t.pss_mib = guests
                        .iter()
                        .filter_map(Guest::qemu_pid)
                        .map(pss_kib)
                        .sum::<u64>() as f64
                        / 1024.0;
                    break;
                }
            }
        }
    }
    t.phases = seen.iter().map(|s| s.phases).sum();
    t.fill_ms_median = median(seen.iter().flat_map(|s| s.fill_ms.clone()).collect());
    t.free_ms_median = median(seen.iter().flat_map(|s| s.free_ms.clone()).collect());
    Ok(())
}

/// The largest N that passes for `mode`, with every trial run: N doubles from `p.start` until a
/// trial fails or `p.max_guests` passes, then bisects between the last pass and the first
/// failure. `report` sees each trial as it ends.
pub fn search(
    mode: Mode,
    p: &Params,
    s: &Setup,
    mut report: impl FnMut(&Trial),
) -> Result<(usize, Vec<Trial>), String> {
    let max = p.max_guests.max(1);
    let (mut lo, mut hi) = (0, max + 1);
    let mut n = p.start.clamp(1, max);
    let mut trials = Vec::new();
    loop {
        let t = run_trial(mode, n, p, s)?;
        report(&t);
        if t.ok {
            lo = n;
        } else {
            hi = n;
        }
        trials.push(t);
        if hi - lo <= 1 {
            return Ok((lo, trials));
        }
        n = if hi == max + 1 {
            (n * 2).min(max)
        } else {
            (lo + hi) / 2
        };
    }
}

/// One measurement of freed guest memory coming back.
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct Return {
    pub mode: String,
    pub mib: usize,
    /// Seconds from the guest's free (its console line) to the QEMU process's anonymous RSS
    /// half, and 90%, of the freed memory lower; `None`: not within the wait.
    pub seconds_to_50: Option<f64>,
    pub seconds_to_90: Option<f64>,
    /// Anonymous RSS back by the end of the wait, MiB.
    pub back_mib: f64,
    /// The guest's `munmap` of the memory, ms (zeroing included with `init_on_free=1`).
    pub guest_free_ms: f64,
}

fn rss_anon_kib(pid: u32) -> Option<u64> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()?
        .lines()
        .find_map(|l| {
            l.strip_prefix("RssAnon:")?
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
}

/// Boots one guest of `mode` that fills `mib` MiB, frees it and waits `wait_secs`; measures
/// how fast the host gets the memory back (see [`Return`]). The guest (and the pageone daemon)
/// run inside a cgroup of `budget_mib`.
pub fn measure_return(
    mode: Mode,
    mib: usize,
    wait_secs: u64,
    p: &Params,
    s: &Setup,
) -> Result<Return, String> {
    let name = format!("pageone-density-return-{}", std::process::id());
    let cg = MemoryCgroup::create(&name, p.budget_mib << 20).map_err(|e| e.to_string())?;
    let socket = s.work.join("return.sock");
    let _daemon = if mode.pageone() {
        Some(start_daemon(s, &cg, &socket)?)
    } else {
        None
    };
    let at = Place {
        s,
        cg: &cg,
        socket: &socket,
    };
    let churn = |_| {
        [
            "once".to_string(),
            mib.to_string(),
            "3000".into(),
            (wait_secs * 1000).to_string(),
        ]
        .to_vec()
    };
    let guests = start_guests(mode, 1, p.guest_mib, &at, Duration::ZERO, churn)?;
    watch_return(mode, mib, wait_secs, &guests[0])
}

/// Follows the guest's console and its QEMU process's anonymous RSS (every 50 ms) from boot to
/// `ONCE-DONE`.
fn watch_return(mode: Mode, mib: usize, wait_secs: u64, g: &Guest) -> Result<Return, String> {
    let mut r = Return {
        mode: mode.name().into(),
        mib,
        ..Default::default()
    };
    let t0 = Instant::now();
    let limit = Duration::from_secs(240 + wait_secs);
    let mut read = 0;
    // (time, KiB) samples; the RSS at the free and the time of the free line.
    let mut samples: Vec<(Instant, u64)> = Vec::new();
    let mut freed: Option<(Instant, u64)> = None;
    loop {
        std::thread::sleep(Duration::from_millis(50));
        if interrupted() {
            return Err("interrupted".into());
        }
        if t0.elapsed() > limit {
            return Err(format!(
                "{}: the guest did not finish in {} s",
                mode.name(),
                limit.as_secs()
            ));
        }
        if let Some(kib) = g.qemu_pid().and_then(rss_anon_kib) {
            samples.push((Instant::now(), kib));
        }
        let lines = g.lines_from(read);
        read += lines.len();
        for (at, l) in lines {
            if let Some(ms) = l.strip_prefix("FREED ") {
                r.guest_free_ms = ms.trim().parse().unwrap_or(0.0);
                // The RSS just before the line was read.
                let before = samples
                    .iter()
                    .rev()
                    .find(|(t, _)| *t <= at)
                    .or(samples.last());
                freed = Some((at, before.map_or(0, |&(_, k)| k)));
            } else if l == "ONCE-DONE" {
                let (at, kib0) = freed.ok_or("the guest printed no FREED line")?;
                let back = |tenths: u64| {
                    let want = kib0.saturating_sub(mib as u64 * 1024 * tenths / 10);
                    samples
                        .iter()
                        .find(|&&(t, k)| t >= at && k <= want)
                        .map(|&(t, _)| (t - at).as_secs_f64())
                };
                r.seconds_to_50 = back(5);
                r.seconds_to_90 = back(9);
                let last = samples.last().map_or(kib0, |&(_, k)| k);
                r.back_mib = kib0.saturating_sub(last) as f64 / 1024.0;
                return Ok(r);
            } else if failure_line(&l) {
                return Err(format!("{}: the guest failed: {l}", mode.name()));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heartbeats_and_failures_parse() {
        assert_eq!(
            parse_heartbeat("HB 3 16 812.5 4.25 1"),
            Some((812.5, 4.25, true))
        );
        assert_eq!(
            parse_heartbeat("HB 3 16 812.5 4.25 0"),
            Some((812.5, 4.25, false))
        );
        assert_eq!(parse_heartbeat("HB 3 16"), None);
        assert_eq!(parse_heartbeat("GUEST-UP 1"), None);
        assert!(failure_line(
            "[ 12.3] Out of memory: Killed process 71 (churn)"
        ));
        assert!(failure_line("CHURN-EXIT 137"));
        assert!(failure_line(
            "insmod: can't insert '/lib/virtio.ko': unknown symbol in module"
        ));
        assert!(!failure_line("HB 1 2 3 4 1"));
    }

    #[test]
    fn modes_parse_by_name() {
        for m in Mode::ALL {
            assert_eq!(Mode::parse(m.name()), Ok(m));
            let json = serde_json::to_string(&m).unwrap();
            assert_eq!(json, format!("\"{}\"", m.name()));
        }
        assert!(Mode::parse("kvm").unwrap_err().contains("pageone-zero"));
        assert!(Mode::PageoneZero.init_on_free() && Mode::PageoneZero.pageone());
        assert!(!Mode::Fpr.mem_merge() && Mode::KsmFast.mem_merge());
    }
}
