//! `pageone-bench density`: how many small QEMU guests with an allocate/free churn run a fixed
//! time in one memory budget, per way of merging or returning memory, and how fast freed guest
//! memory comes back ([`pageone_bench::density`]). Needs root, qemu-system-x86,
//! linux-image-amd64, busybox-static and a C compiler (`scripts/test.sh` installs them).

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use pageone_bench::density::{measure_return, search, Mode, Params, Return, Setup, Trial};
use pageone_bench::guest::{build_initramfs, distribution_kernel, ImageSpec};
use pageone_bench::host::InterruptGuard;

use crate::write_json;

#[derive(clap::Args)]
pub struct DensityArgs {
    /// The memory budget of all guests together (a cgroup's limit), MiB.
    #[arg(long, default_value_t = 2048)]
    budget: u64,
    /// Each guest's RAM, MiB.
    #[arg(long, default_value_t = 192)]
    guest_mib: usize,
    /// Seconds every guest must run once all are up.
    #[arg(long, default_value_t = 120)]
    seconds: u64,
    /// The most guests tried.
    #[arg(long, default_value_t = 16)]
    max_guests: usize,
    /// The first number of guests tried (then doubled until a failure, then bisected).
    #[arg(long, default_value_t = 2)]
    start: usize,
    /// Modes: none, ksm, ksm-fast, pageone, pageone-zero, fpr.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "none,ksm,ksm-fast,pageone,pageone-zero,fpr"
    )]
    modes: Vec<String>,
    /// The churn's largest phase, MiB (most phases allocate a sixteenth to a quarter of it).
    #[arg(long, default_value_t = 96)]
    peak_mib: usize,
    /// Percent of the churn's pages that every guest has.
    #[arg(long, default_value_t = 50)]
    shared_pct: u32,
    /// Each phase holds its memory this long, then idles this long (plus up to a quarter).
    #[arg(long, default_value_t = 2000)]
    hold_ms: u64,
    #[arg(long, default_value_t = 3000)]
    idle_ms: u64,
    /// A guest that finishes no phase for this long has stalled.
    #[arg(long, default_value_t = 90)]
    stall_secs: u64,
    /// Seconds between one guest's start and the next's (0: all at once).
    #[arg(long, default_value_t = 0)]
    stagger_secs: u64,
    /// Whole searches per mode (the median is reported).
    #[arg(long, default_value_t = 1)]
    runs: usize,
    /// Modes whose freed memory's return is timed (empty: none).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "pageone-zero,fpr,pageone"
    )]
    return_modes: Vec<String>,
    /// Memory the guest frees in the return measurement, MiB.
    #[arg(long, default_value_t = 64)]
    return_mib: usize,
    /// Seconds the return measurement waits after the free.
    #[arg(long, default_value_t = 30)]
    return_wait: u64,
    /// Only the return measurement.
    #[arg(long)]
    return_only: bool,
    /// Also write the results as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
}

/// A temporary directory removed when dropped.
struct WorkDir(PathBuf);

impl Drop for WorkDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn setup(work: &std::path::Path) -> Result<Setup> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        bail!("the density benchmark needs root (a memory cgroup, KSM's knobs)");
    }
    if std::process::Command::new("qemu-system-x86_64")
        .arg("--version")
        .output()
        .is_err()
    {
        bail!("qemu-system-x86_64 is missing: apt-get install qemu-system-x86");
    }
    if std::fs::read_to_string("/sys/kernel/mm/ksm/run").is_ok_and(|r| r.trim() == "1") {
        bail!("KSM is running: it would merge every mode's guests; stop it (echo 2 > /sys/kernel/mm/ksm/run) first");
    }
    let kernel = distribution_kernel().map_err(anyhow::Error::msg)?;
    let image = |balloon| {
        build_initramfs(
            work,
            &ImageSpec {
                kernel: kernel.clone(),
                balloon,
            },
        )
        .map_err(anyhow::Error::msg)
    };
    let exe = std::env::current_exe().context("cannot find pageone-bench itself")?;
    Ok(Setup {
        pageone: exe.with_file_name("pageone"),
        initrd: image(false)?,
        initrd_balloon: image(true)?,
        kernel,
        work: work.to_path_buf(),
    })
}

/// One mode's searches.
#[derive(serde::Serialize)]
struct ModeResult {
    mode: String,
    /// The most guests that passed, per run.
    guests: Vec<f64>,
    /// Host memory per guest at steady state in each run's largest passing trial.
    per_guest_mib: Vec<f64>,
    trials: Vec<Trial>,
}

fn print_trial(t: &Trial) {
    let status = match &t.failure {
        None => "ran".to_string(),
        Some(f) => format!("FAILED: {f}"),
    };
    eprintln!(
        "  {} x{}: {status}; boot {:.0} s, cgroup {:.0} MiB steady ({:.0} peak, {:.0} per guest), \
         QEMU Pss {:.0} MiB, {} phases, fill {:.0} ms, free {:.1} ms",
        t.mode,
        t.guests,
        t.boot_secs,
        t.usage_mib,
        t.usage_peak_mib,
        t.per_guest_mib,
        t.pss_mib,
        t.phases,
        t.fill_ms_median,
        t.free_ms_median
    );
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

fn densities(modes: &[Mode], p: &Params, s: &Setup, runs: usize) -> Result<Vec<ModeResult>> {
    let mut out: Vec<ModeResult> = modes
        .iter()
        .map(|m| ModeResult {
            mode: m.name().into(),
            guests: vec![],
            per_guest_mib: vec![],
            trials: vec![],
        })
        .collect();
    for run in 0..runs {
        for (m, r) in modes.iter().zip(out.iter_mut()) {
            eprintln!("{} (run {}):", m.name(), run + 1);
            let (n, trials) = search(*m, p, s, print_trial).map_err(anyhow::Error::msg)?;
            let best = trials.iter().rfind(|t| t.ok && t.guests == n);
            r.guests.push(n as f64);
            if let Some(b) = best {
                r.per_guest_mib.push(b.per_guest_mib);
            }
            r.trials.extend(trials);
        }
    }
    Ok(out)
}

fn print_table(p: &Params, results: &[ModeResult], runs: usize) {
    println!(
        "\nGuests of {} MiB (TCG) in {} MiB, churn peak {} MiB ({}% shared), {} s each, median of {runs} run(s):",
        p.guest_mib, p.budget_mib, p.peak_mib, p.shared_pct, p.seconds
    );
    println!(
        "{:<14} {:>7} {:>15} {:>10} {:>14} {:>12}",
        "mode", "guests", "MiB per guest", "vs none", "guest free ms", "fill ms"
    );
    let none = results
        .iter()
        .find(|r| r.mode == "none")
        .map(|r| median(&r.guests));
    for r in results {
        let g = median(&r.guests);
        let best: Vec<&Trial> = r.trials.iter().filter(|t| t.ok).collect();
        let free = median(&best.iter().map(|t| t.free_ms_median).collect::<Vec<_>>());
        let fill = median(&best.iter().map(|t| t.fill_ms_median).collect::<Vec<_>>());
        println!(
            "{:<14} {:>7.0} {:>15.0} {:>10} {:>14.1} {:>12.0}",
            r.mode,
            g,
            median(&r.per_guest_mib),
            none.filter(|&n| n > 0.0)
                .map_or("-".into(), |n| format!("{:.2}x", g / n)),
            free,
            fill
        );
    }
    let best = |names: &[&str]| {
        results
            .iter()
            .filter(|r| names.contains(&r.mode.as_str()))
            .map(|r| median(&r.guests))
            .fold(f64::NAN, f64::max)
    };
    let (k, po) = (
        best(&["ksm", "ksm-fast"]),
        best(&["pageone", "pageone-zero"]),
    );
    if k.is_finite() && po.is_finite() && k > 0.0 {
        println!(
            "pageone / KSM (the better of each): {:.2}x the guests",
            po / k
        );
    }
}

fn returns(a: &DensityArgs, p: &Params, s: &Setup) -> Result<Vec<Return>> {
    let modes: Vec<Mode> = a
        .return_modes
        .iter()
        .filter(|m| !m.is_empty())
        .map(|m| Mode::parse(m))
        .collect::<Result<_, _>>()
        .map_err(anyhow::Error::msg)?;
    let mut out = Vec::new();
    for run in 0..a.runs {
        for &m in &modes {
            let r =
                measure_return(m, a.return_mib, a.return_wait, p, s).map_err(anyhow::Error::msg)?;
            eprintln!(
                "  return {} (run {}): {} MiB freed, half back after {}, 90% after {}, {:.0} MiB back by {} s; the guest's munmap {:.1} ms",
                r.mode,
                run + 1,
                r.mib,
                r.seconds_to_50.map_or("never".into(), |s| format!("{s:.2} s")),
                r.seconds_to_90.map_or("never".into(), |s| format!("{s:.2} s")),
                r.back_mib,
                a.return_wait,
                r.guest_free_ms
            );
            out.push(r);
        }
    }
    println!(
        "\nFreed guest memory back ({} MiB freed by one guest), median of {} run(s):",
        a.return_mib, a.runs
    );
    println!(
        "{:<14} {:>14} {:>14} {:>14} {:>16}",
        "mode", "s to 50% back", "s to 90% back", "MiB back", "guest munmap ms"
    );
    let secs = |v: Vec<f64>| {
        let s = median(&v);
        if s.is_finite() {
            format!("{s:.2}")
        } else {
            format!("> {}", a.return_wait)
        }
    };
    for &m in &modes {
        let of: Vec<&Return> = out.iter().filter(|r| r.mode == m.name()).collect();
        let inf = f64::INFINITY;
        println!(
            "{:<14} {:>14} {:>14} {:>14.0} {:>16.1}",
            m.name(),
            secs(of.iter().map(|r| r.seconds_to_50.unwrap_or(inf)).collect()),
            secs(of.iter().map(|r| r.seconds_to_90.unwrap_or(inf)).collect()),
            median(&of.iter().map(|r| r.back_mib).collect::<Vec<_>>()),
            median(&of.iter().map(|r| r.guest_free_ms).collect::<Vec<_>>())
        );
    }
    Ok(out)
}

pub fn run(a: &DensityArgs) -> Result<()> {
    let modes: Vec<Mode> = a
        .modes
        .iter()
        .map(|m| Mode::parse(m))
        .collect::<Result<_, _>>()
        .map_err(anyhow::Error::msg)?;
    if a.runs == 0 || a.guest_mib < 64 || a.peak_mib >= a.guest_mib {
        bail!("--runs must be at least 1, --guest-mib at least 64 and above --peak-mib");
    }
    let p = Params {
        budget_mib: a.budget,
        guest_mib: a.guest_mib,
        seconds: a.seconds,
        max_guests: a.max_guests,
        start: a.start,
        peak_mib: a.peak_mib,
        shared_pct: a.shared_pct.min(100),
        hold_ms: a.hold_ms,
        idle_ms: a.idle_ms,
        stall_secs: a.stall_secs,
        stagger_secs: a.stagger_secs,
    };
    let work =
        WorkDir(std::env::temp_dir().join(format!("pageone-density-{}", std::process::id())));
    std::fs::create_dir_all(&work.0)?;
    let s = setup(&work.0)?;
    if modes
        .iter()
        .any(|m| matches!(m, Mode::Pageone | Mode::PageoneZero))
        && !s.pageone.is_file()
    {
        bail!(
            "{} is missing: cargo build --release -p pageone -p pageone-preload",
            s.pageone.display()
        );
    }
    let _signals = InterruptGuard::install();
    let density = if a.return_only {
        Vec::new()
    } else {
        let d = densities(&modes, &p, &s, a.runs)?;
        print_table(&p, &d, a.runs);
        d
    };
    let ret = returns(a, &p, &s)?;
    write_json(
        &a.json,
        &serde_json::json!({ "params": p, "density": density, "returns": ret }),
    )
}
