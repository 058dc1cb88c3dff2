//! `pageone-bench ppr`: runs [`pageone_bench::ppr`] and prints the program's cost per freed page
//! next to `madvise(MADV_DONTNEED)`; then replays one alloc/free trace ([`pageone_bench::alloc_trace`])
//! against glibc's malloc, jemalloc and mimalloc (their Debian libraries preloaded, default decay)
//! and the PPR heap, each in a child process of its own (`pageone-bench ppr-trace`).

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use pageone_bench::alloc_trace::{TraceParams, TraceResult};

use crate::write_json;

#[derive(clap::Args)]
pub struct PprArgs {
    /// Memory marked free per run of the mark measurement, in MiB.
    #[arg(long, default_value_t = 256)]
    mib: usize,
    /// Runs (the median is reported).
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// The PPR heap's engine period in milliseconds (the mark measurement runs its engine's
    /// periods only when it asks, so that no period falls between the marks it times).
    #[arg(long, default_value_t = 100)]
    period_ms: u64,
    /// Which parts to run: marks (PPR vs madvise per page), allocators (the trace), or both.
    #[arg(long, value_enum, default_value_t = Part::Both)]
    part: Part,
    /// Heaps the trace is replayed against.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "glibc,jemalloc,mimalloc,ppr"
    )]
    heaps: Vec<String>,
    /// The trace's largest phase, in MiB.
    #[arg(long, default_value_t = 256)]
    peak_mib: usize,
    /// Phases of one second in the trace.
    #[arg(long, default_value_t = 12)]
    phases: usize,
    /// Also write the results as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Part {
    Marks,
    Allocators,
    Both,
}

/// The hidden child side: replays the trace against one heap and prints its result as JSON.
#[derive(clap::Args)]
pub struct TraceArgs {
    #[arg(long)]
    heap: String,
    /// The trace's parameters as JSON.
    #[arg(long)]
    params: String,
    #[arg(long, default_value_t = 100)]
    period_ms: u64,
}

pub fn run(a: &PprArgs) -> Result<()> {
    if a.mib == 0 || a.runs == 0 {
        bail!("--mib and --runs must be at least 1");
    }
    let marks = if a.part != Part::Allocators {
        marks(a.mib, a.runs)?
    } else {
        Vec::new()
    };
    let allocators = if a.part != Part::Marks {
        let params = TraceParams {
            peak_mib: a.peak_mib,
            phases: a.phases,
            ..Default::default()
        };
        Some(serde_json::json!({
            "params": params,
            "period_ms": a.period_ms,
            "runs": allocators(a, &params)?,
        }))
    } else {
        None
    };
    write_json(
        &a.json,
        &serde_json::json!({ "marks": marks, "allocators": allocators }),
    )
}

fn marks(mib: usize, runs: usize) -> Result<Vec<pageone_bench::ppr::PprSample>> {
    use pageone_bench::ppr::{median, run_once};
    println!(
        "PPR vs madvise(MADV_DONTNEED): {mib} MiB freed per run, engine periods when asked, 2 workers, median of {runs} runs"
    );
    let mut samples = Vec::new();
    for k in 0..runs {
        let s = run_once(mib).map_err(|e| anyhow::anyhow!(e))?;
        eprintln!(
            "  run {}: mark {:.1} ns ({:.0} cycles), write-protected {:.1} ns, unmark {:.1} ns, madvise {:.1} ns ({:.0} cycles); released in {:.3} s, {:.3} CPU-s, {} pages still holding memory",
            k + 1,
            s.mark_ns,
            s.mark_cycles,
            s.mark_protected_ns,
            s.unmark_ns,
            s.dontneed_ns,
            s.dontneed_cycles,
            s.recycle_seconds,
            s.recycle_cpu_seconds,
            s.present_after
        );
        samples.push(s);
    }
    let m = |f: fn(&pageone_bench::ppr::PprSample) -> f64| median(&samples, f);
    println!("{:<34} {:>12} {:>12}", "per freed page", "ns", "cycles");
    let rows: [(&str, f64, Option<f64>); 4] = [
        ("PPR mark", m(|s| s.mark_ns), Some(m(|s| s.mark_cycles))),
        (
            "PPR mark, page write-protected",
            m(|s| s.mark_protected_ns),
            Some(m(|s| s.mark_protected_cycles)),
        ),
        ("PPR unmark (reuse)", m(|s| s.unmark_ns), None),
        (
            "madvise(MADV_DONTNEED), one a page",
            m(|s| s.dontneed_ns),
            Some(m(|s| s.dontneed_cycles)),
        ),
    ];
    for (name, ns, cycles) in rows {
        let cycles = cycles.map_or(String::new(), |c| format!("{c:.0}"));
        println!("{name:<34} {ns:>12.1} {cycles:>12}");
    }
    println!(
        "the program's cost per freed page: PPR {:.1}x cheaper than madvise",
        m(|s| s.dontneed_ns) / m(|s| s.mark_ns).max(f64::MIN_POSITIVE)
    );
    println!(
        "memory back: all {} pages released {:.3} s after marking ({:.3} CPU-s of the engine), {:.0} pages still holding memory (present, not the zero page)",
        samples[0].pages,
        m(|s| s.recycle_seconds),
        m(|s| s.recycle_cpu_seconds),
        m(|s| s.present_after as f64)
    );
    println!(
        "engine's claim with nothing marked: {:.1} us per period for a pool of {} slots",
        m(|s| s.idle_claim_us),
        pageone_bench::ppr::IDLE_POOL_SLOTS
    );
    Ok(samples)
}

/// The shared library preloaded for `heap` (`None`: glibc's malloc or the PPR heap).
fn preload(heap: &str) -> Result<Option<PathBuf>> {
    let (var, file, package) = match heap {
        "glibc" | "ppr" => return Ok(None),
        "jemalloc" => ("PAGEONE_BENCH_JEMALLOC", "libjemalloc.so.2", "libjemalloc2"),
        "mimalloc" => (
            "PAGEONE_BENCH_MIMALLOC",
            "libmimalloc.so.2",
            "libmimalloc2.0",
        ),
        other => bail!("unknown heap {other}: glibc, jemalloc, mimalloc or ppr"),
    };
    if let Some(p) = std::env::var_os(var) {
        return Ok(Some(p.into()));
    }
    [
        "/usr/lib/x86_64-linux-gnu",
        "/usr/lib64",
        "/usr/lib",
        "/usr/local/lib",
    ]
    .iter()
    .map(|d| PathBuf::from(d).join(file))
    .find(|p| p.is_file())
    .map(Some)
    .with_context(|| format!("{file} not found: apt-get install {package} (or set {var})"))
}

fn allocators(a: &PprArgs, params: &TraceParams) -> Result<Vec<TraceResult>> {
    println!(
        "\nOne alloc/free trace ({} phases of 1 s, peak {} MiB, seed {}) against each heap in a \
         process of its own, {} runs interleaved; PPR heap: engine period {} ms, 1 worker",
        params.phases, params.peak_mib, params.seed, a.runs, a.period_ms
    );
    let libs: Vec<(String, Option<PathBuf>)> = a
        .heaps
        .iter()
        .map(|h| Ok((h.clone(), preload(h)?)))
        .collect::<Result<_>>()?;
    let exe = std::env::current_exe().context("could not find pageone-bench itself")?;
    let mut out = Vec::new();
    for k in 0..a.runs {
        for (heap, lib) in &libs {
            let mut cmd = Command::new(&exe);
            cmd.args(["ppr-trace", "--heap", heap, "--params"])
                .arg(serde_json::to_string(params)?)
                .args(["--period-ms", &a.period_ms.to_string()])
                .env_remove("LD_PRELOAD");
            if let Some(lib) = lib {
                cmd.env("LD_PRELOAD", lib);
            }
            let o = cmd.output().context("could not start a trace process")?;
            if !o.status.success() {
                bail!(
                    "the {heap} trace process failed ({}): {}",
                    o.status,
                    String::from_utf8_lossy(&o.stderr).trim()
                );
            }
            let r: TraceResult = serde_json::from_slice(&o.stdout)
                .with_context(|| format!("the {heap} trace process printed no result"))?;
            eprintln!(
                "  run {} {heap}: free {:.0} ns mean ({:.0} p50, {:.0} p99), excess {:.3} GiB·s (peak {:.0} MiB), CPU {:.2} s, wall {:.1} s",
                k + 1,
                r.free_ns_mean,
                r.free_ns_p50,
                r.free_ns_p99,
                r.excess_gib_s,
                r.excess_peak_mib,
                r.cpu_s,
                r.wall_s
            );
            if heap == "ppr" {
                let top: Vec<String> = r
                    .thread_cpu_s
                    .iter()
                    .take(4)
                    .map(|(n, s)| format!("{n} {s:.2} s"))
                    .collect();
                eprintln!("    CPU by thread: {}", top.join(", "));
            }
            out.push(r);
        }
    }
    print_allocators(&a.heaps, &out);
    Ok(out)
}

fn median_of(runs: &[TraceResult], heap: &str, f: fn(&TraceResult) -> f64) -> f64 {
    let mut v: Vec<f64> = runs.iter().filter(|r| r.heap == heap).map(f).collect();
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

fn print_allocators(heaps: &[String], runs: &[TraceResult]) {
    println!(
        "{:<10} {:>10} {:>10} {:>10} {:>12} {:>12} {:>8}",
        "heap", "free ns", "p50 ns", "p99 ns", "excess GiB·s", "peak excess", "CPU s"
    );
    for h in heaps {
        let m = |f: fn(&TraceResult) -> f64| median_of(runs, h, f);
        println!(
            "{h:<10} {:>10.0} {:>10.0} {:>10.0} {:>12.3} {:>8.0} MiB {:>8.2}",
            m(|r| r.free_ns_mean),
            m(|r| r.free_ns_p50),
            m(|r| r.free_ns_p99),
            m(|r| r.excess_gib_s),
            m(|r| r.excess_peak_mib),
            m(|r| r.cpu_s)
        );
    }
    let ppr = median_of(runs, "ppr", |r| r.excess_gib_s);
    let ppr_cpu = median_of(runs, "ppr", |r| r.cpu_s);
    for other in ["jemalloc", "mimalloc"] {
        let e = median_of(runs, other, |r| r.excess_gib_s);
        let c = median_of(runs, other, |r| r.cpu_s);
        if e.is_finite() && ppr.is_finite() {
            println!(
                "PPR heap / {other}: excess GiB·s {:.2}x (target <= 0.5), CPU {:.2}x (target <= 1)",
                ppr / e,
                ppr_cpu / c
            );
        }
    }
}

/// The child: one replay, its result on stdout.
pub fn trace(a: &TraceArgs) -> Result<()> {
    use pageone_bench::alloc_trace::{generate, replay, Malloc};
    let params: TraceParams = serde_json::from_str(&a.params).context("bad --params")?;
    let ops = generate(&params);
    let result = match a.heap.as_str() {
        "ppr" => {
            let heap =
                pageone_bench::ppr_heap::PprHeap::new(pageone_bench::ppr_heap::PprHeapConfig {
                    arena_bytes: (params.peak_mib << 21).max(1 << 30),
                    period: Duration::from_millis(a.period_ms),
                    workers: 1,
                })
                .map_err(|e| anyhow::anyhow!(e))?;
            replay("ppr", &ops, &heap)
        }
        heap => {
            // The preloaded library must really be the allocator measured.
            let maps = std::fs::read_to_string("/proc/self/maps")?;
            let want = match heap {
                "jemalloc" => Some("libjemalloc"),
                "mimalloc" => Some("libmimalloc"),
                _ => None,
            };
            if let Some(w) = want {
                if !maps.contains(w) {
                    bail!("{w} is not loaded in the {heap} trace process (LD_PRELOAD ignored?)");
                }
            }
            replay(heap, &ops, &Malloc)
        }
    }
    .map_err(|e| anyhow::anyhow!(e))?;
    println!("{}", serde_json::to_string(&result)?);
    Ok(())
}
