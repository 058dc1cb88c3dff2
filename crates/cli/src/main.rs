//! The `pageone` command: a thin binary over the engine and benchmark libraries.

mod demo;
mod probe;
mod run;
mod scope;

use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use pageone_bench::{dedup, ksm, sdtree};

#[derive(Parser)]
#[command(
    name = "pageone",
    version,
    about = "Userspace memory deduplication (PageONE)"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Fill memory with duplicate data, merge it in this process, and print what was saved.
    Demo {
        /// Total memory to fill, in MiB, split over the copies.
        #[arg(long, default_value_t = 512)]
        mib: usize,
        /// Identical regions (copies of the same data).
        #[arg(long, default_value_t = 4)]
        copies: usize,
        /// Worker threads.
        #[arg(long, default_value_t = 2)]
        workers: usize,
        /// Use the seed's "hard" data (values at random offsets) instead of "easy".
        #[arg(long)]
        hard: bool,
    },
    /// Share stable copies between the processes of each scope (foreground).
    Daemon(scope::DaemonOptions),
    /// Run a command with pageone answering its madvise(MADV_MERGEABLE) / PR_SET_MEMORY_MERGE.
    Run {
        /// Scope (tenant) for the command's processes [default: $PAGEONE_SCOPE or "default"].
        #[arg(long)]
        scope: Option<String>,
        /// Daemon socket to join [default: the default socket if a daemon serves it, else a
        /// private daemon for this process tree].
        #[arg(long)]
        daemon: Option<std::path::PathBuf>,
        /// The command and its arguments (after `--`).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true, required = true)]
        cmd: Vec<std::ffi::OsString>,
    },
    /// Per scope and client: pages shared, memory saved, merges per second, worker CPU.
    Status {
        #[arg(long)]
        socket: Option<std::path::PathBuf>,
        /// Print the daemon's JSON instead of a summary.
        #[arg(long)]
        json: bool,
    },
    /// (Tests and benchmarks) one process of seed data under an engine that joins the daemon.
    #[command(hide = true)]
    ScopeClient(scope::ClientOptions),
    /// (Tests) what a client of another user, or a hostile one, can do to a daemon.
    #[command(hide = true)]
    ScopeProbe(probe::ProbeOptions),
    /// Benchmarks, each next to its baseline in the same run.
    Bench {
        #[command(subcommand)]
        which: Bench,
    },
}

#[derive(Subcommand)]
enum Bench {
    /// The SD tree vs a memcmp-ordered tree (KSM's) and an xxh3-128 hash index.
    Sdtree {
        /// 32 Ki keys and one run instead of 256 Ki keys and five runs.
        #[arg(long)]
        quick: bool,
        /// Runs per measurement (the median is reported).
        #[arg(long)]
        runs: Option<usize>,
        /// Also write the results as JSON to this file.
        #[arg(long)]
        json: Option<std::path::PathBuf>,
    },
    /// PPR (marking freed pages, the engine releasing them) vs `madvise(MADV_DONTNEED)` per page.
    Ppr {
        /// Memory marked free per run, in MiB.
        #[arg(long, default_value_t = 256)]
        mib: usize,
        /// Runs (the median is reported).
        #[arg(long, default_value_t = 5)]
        runs: usize,
        /// The engine's period in milliseconds.
        #[arg(long, default_value_t = 100)]
        period_ms: u64,
        /// Also write the samples as JSON to this file.
        #[arg(long)]
        json: Option<std::path::PathBuf>,
    },
    /// The engine vs the kernel's KSM: time to 99% of the possible saving and CPU-seconds.
    Ksm {
        /// 4 x 64 MiB and one run instead of 4 x 512 MiB and three runs.
        #[arg(long)]
        quick: bool,
        /// Runs per side and data set (the median is reported).
        #[arg(long)]
        runs: Option<usize>,
        /// Regions (one process each with --processes).
        #[arg(long, default_value_t = 4)]
        regions: usize,
        /// Size of each region in MiB (default 512, 64 with --quick).
        #[arg(long)]
        region_mib: Option<usize>,
        /// PageONE worker threads.
        #[arg(long, default_value_t = 2)]
        workers: usize,
        /// PageONE merge period in milliseconds.
        #[arg(long, default_value_t = 100)]
        period_ms: u64,
        /// Run pageone as one process per region sharing through `pageone daemon` (issue #4's
        /// measurement) instead of one process with all regions.
        #[arg(long)]
        processes: bool,
        /// Run only pageone's side (for profiling it; no ratio is reported).
        #[arg(long)]
        pageone_only: bool,
        /// Also write the results as JSON to this file.
        #[arg(long)]
        json: Option<std::path::PathBuf>,
    },
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("PAGEONE_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    match Cli::parse().command {
        Command::Demo {
            mib,
            copies,
            workers,
            hard,
        } => demo::run(mib, copies, workers, hard),
        Command::Daemon(options) => scope::daemon(options),
        Command::Status { socket, json } => scope::status(socket, json),
        Command::Run { scope, daemon, cmd } => {
            let code = run::run(scope, daemon, cmd)?;
            std::process::exit(code);
        }
        Command::ScopeClient(options) => scope::client(options),
        Command::ScopeProbe(options) => probe::run(options),
        Command::Bench {
            which: Bench::Sdtree { quick, runs, json },
        } => bench_sdtree(quick, runs, json),
        Command::Bench {
            which:
                Bench::Ppr {
                    mib,
                    runs,
                    period_ms,
                    json,
                },
        } => bench_ppr(mib, runs, Duration::from_millis(period_ms), json),
        Command::Bench {
            which:
                Bench::Ksm {
                    quick,
                    runs,
                    regions,
                    region_mib,
                    workers,
                    period_ms,
                    processes,
                    pageone_only,
                    json,
                },
        } => {
            let p = dedup::Params {
                regions,
                region_mib: region_mib.unwrap_or(if quick { 64 } else { 512 }),
                workers,
                merge_period: Duration::from_millis(period_ms),
                timeout: Duration::from_secs(300),
            };
            bench_ksm(
                &p,
                runs.unwrap_or(if quick { 1 } else { 3 }),
                processes,
                pageone_only,
                json,
            )
        }
    }
}

fn write_json(path: &Option<std::path::PathBuf>, value: &serde_json::Value) -> Result<()> {
    if let Some(p) = path {
        std::fs::write(p, serde_json::to_string_pretty(value)?)
            .with_context(|| format!("could not write {}", p.display()))?;
        println!("wrote {}", p.display());
    }
    Ok(())
}

fn bench_ppr(
    mib: usize,
    runs: usize,
    period: Duration,
    json: Option<std::path::PathBuf>,
) -> Result<()> {
    use pageone_bench::ppr::{median, run_once};
    if mib == 0 || runs == 0 {
        bail!("--mib and --runs must be at least 1");
    }
    println!(
        "PPR vs madvise(MADV_DONTNEED): {mib} MiB freed per run, engine period {} ms, 2 workers, median of {runs} runs",
        period.as_millis()
    );
    let mut samples = Vec::new();
    for k in 0..runs {
        let s = run_once(mib, period).map_err(|e| anyhow::anyhow!(e))?;
        eprintln!(
            "  run {}: mark {:.1} ns ({:.0} cycles), write-protected {:.1} ns, unmark {:.1} ns, madvise {:.1} ns ({:.0} cycles); released in {:.3} s, {:.3} CPU-s, {} pages still present",
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
        "memory back: all {} pages released {:.3} s after marking ({:.3} CPU-s of the engine), {:.0} pages still present",
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
    write_json(&json, &serde_json::to_value(&samples)?)
}

fn bench_sdtree(quick: bool, runs: Option<usize>, json: Option<std::path::PathBuf>) -> Result<()> {
    let keys = if quick { 32 << 10 } else { 256 << 10 };
    let runs = runs.unwrap_or(if quick { 1 } else { 5 }).max(1);
    println!("SD tree benchmark: {keys} keys of 4 KiB per data set, median of {runs} runs");
    let rows = sdtree::run(keys, runs, &mut |m| eprintln!("{m}"));
    println!(
        "{:<12} {:<5} {:>3} {:>14} {:>14} {:>14} {:>12}",
        "structure", "data", "thr", "insert/s", "hit/s", "miss/s", "bytes/miss"
    );
    for r in &rows {
        println!(
            "{:<12} {:<5} {:>3} {:>14.0} {:>14.0} {:>14.0} {:>12.1}",
            r.structure,
            r.data,
            r.threads,
            r.insert_ops_per_s,
            r.hit_ops_per_s,
            r.miss_ops_per_s,
            r.bytes_examined_per_miss
        );
    }
    let get = |s: &str, d: dedup::Data, t: usize| {
        rows.iter()
            .find(|r| r.structure == s && r.data == d && r.threads == t)
            .expect("row")
    };
    use dedup::Data::{Easy, Hard};
    // (what, numerator row, denominator row, which throughput, target)
    type Row = (&'static str, dedup::Data, usize);
    let table: [(&str, Row, Row, &str, f64); 7] = [
        (
            "sdtree hard/easy miss throughput (1 thread), target >= 0.9",
            ("sdtree", Hard, 1),
            ("sdtree", Easy, 1),
            "miss",
            0.9,
        ),
        (
            "sdtree / memcmp_tree hard-key misses (1 thread), target > 1",
            ("sdtree", Hard, 1),
            ("memcmp_tree", Hard, 1),
            "miss",
            1.0,
        ),
        (
            "sdtree / memcmp_tree hard-key misses (2 threads), target > 1",
            ("sdtree", Hard, 2),
            ("memcmp_tree", Hard, 2),
            "miss",
            1.0,
        ),
        (
            "sdtree 2/1-thread hits, easy, target >= 1.8",
            ("sdtree", Easy, 2),
            ("sdtree", Easy, 1),
            "hit",
            1.8,
        ),
        (
            "sdtree 2/1-thread hits, hard, target >= 1.8",
            ("sdtree", Hard, 2),
            ("sdtree", Hard, 1),
            "hit",
            1.8,
        ),
        (
            "sdtree 2/1-thread misses, easy, target >= 1.8",
            ("sdtree", Easy, 2),
            ("sdtree", Easy, 1),
            "miss",
            1.8,
        ),
        (
            "sdtree 2/1-thread misses, hard, target >= 1.8",
            ("sdtree", Hard, 2),
            ("sdtree", Hard, 1),
            "miss",
            1.8,
        ),
    ];
    let ops = |r: Row, which: &str| {
        let row = get(r.0, r.1, r.2);
        if which == "hit" {
            row.hit_ops_per_s
        } else {
            row.miss_ops_per_s
        }
    };
    let checks: Vec<(&str, f64, f64)> = table
        .iter()
        .map(|&(name, num, den, which, target)| (name, ops(num, which) / ops(den, which), target))
        .collect();
    println!();
    let mut out = serde_json::Map::new();
    for (name, v, target) in &checks {
        let met = v >= target && (*target != 1.0 || *v > 1.0);
        println!("{name}: {v:.2} ({})", if met { "met" } else { "NOT met" });
        out.insert(
            name.to_string(),
            serde_json::json!({ "value": v, "met": met }),
        );
    }
    write_json(
        &json,
        &serde_json::json!({ "keys": keys, "runs": runs, "results": rows, "checks": out }),
    )
}

/// One side of the engine-vs-KSM benchmark.
type Side = fn(&dedup::Params, dedup::Data) -> Result<dedup::Sample, String>;

fn mib_text(kib: Option<i64>) -> String {
    kib.map_or("unknown".into(), |k| {
        format!("{:.1} MiB", k as f64 / 1024.0)
    })
}

/// The pageone side with one process per region, sharing through a daemon.
fn run_pageone_processes(p: &dedup::Params, data: dedup::Data) -> Result<dedup::Sample, String> {
    scope::bench_side(
        p.regions,
        p.region_mib,
        data,
        p.merge_period.as_millis() as u64,
        p.workers,
    )
    .map_err(|e| format!("{e:#}"))
}

fn bench_ksm(
    p: &dedup::Params,
    runs: usize,
    processes: bool,
    pageone_only: bool,
    json: Option<std::path::PathBuf>,
) -> Result<()> {
    let pageone_side: Side = if processes {
        run_pageone_processes
    } else {
        dedup::run_pageone
    };
    if !ksm::available() {
        bail!("KSM is not available or not writable here (needs root and /sys/kernel/mm/ksm)");
    }
    println!(
        "engine vs KSM: {} regions x {} MiB, identical across regions, unique within; \
         pageone {}{} workers, {} ms periods; KSM sleep_millisecs=0 pages_to_scan=100000; \
         {runs} runs",
        p.regions,
        p.region_mib,
        if processes {
            "one process per region through the daemon, "
        } else {
            ""
        },
        p.workers,
        p.merge_period.as_millis()
    );
    let mut samples = Vec::new();
    for data in [dedup::Data::Easy, dedup::Data::Hard] {
        for run in 0..runs {
            // Alternate which side goes first, so neither always gets the warmer machine.
            let order: &[Side] = if pageone_only {
                &[pageone_side]
            } else if run % 2 == 0 {
                &[pageone_side, dedup::run_ksm]
            } else {
                &[dedup::run_ksm, pageone_side]
            };
            for f in order {
                let s = f(p, data).map_err(anyhow::Error::msg)?;
                eprintln!(
                    "  {} {} run {}: {} s to 99%, {:.2} CPU-s, saved {}/{} pages, host memory saved {}",
                    s.side,
                    s.data,
                    run + 1,
                    s.seconds_to_99
                        .map_or("not reached".into(), |t| format!("{t:.2}")),
                    s.cpu_seconds,
                    s.pages_saved,
                    s.possible,
                    mib_text(s.memory_saved_kib)
                );
                samples.push(s);
            }
        }
    }
    println!(
        "{:<8} {:<5} {:>14} {:>12} {:>20}",
        "side", "data", "s to 99%", "CPU-s", "memory saved"
    );
    let mut summary = Vec::new();
    for data in [dedup::Data::Easy, dedup::Data::Hard] {
        for side in ["pageone", "ksm"] {
            let v: Vec<&dedup::Sample> = samples
                .iter()
                .filter(|s| s.side == side && s.data == data)
                .collect();
            let t = dedup::median_time(&v);
            let c = dedup::median_cpu(&v);
            let m = dedup::median_memory_saved(&v);
            println!(
                "{side:<8} {data:<5} {:>14} {c:>12.2} {:>20}",
                t.map_or("not reached".into(), |t| format!("{t:.2}")),
                mib_text(m)
            );
            summary.push(serde_json::json!({
                "side": side, "data": data, "median_seconds_to_99": t, "median_cpu_seconds": c,
                "median_memory_saved_kib": m
            }));
        }
    }
    let med = |side: &str, data: dedup::Data| {
        let v: Vec<&dedup::Sample> = samples
            .iter()
            .filter(|s| s.side == side && s.data == data)
            .collect();
        dedup::median_time(&v)
    };
    for data in [dedup::Data::Easy, dedup::Data::Hard] {
        if let (Some(k), Some(p1)) = (med("ksm", data), med("pageone", data)) {
            println!(
                "{data}: pageone is {:.1}x faster than KSM to 99% (target >= 4x)",
                k / p1
            );
        }
    }
    for data in [dedup::Data::Easy, dedup::Data::Hard] {
        let mem = |side: &str| {
            let v: Vec<&dedup::Sample> = samples
                .iter()
                .filter(|s| s.side == side && s.data == data)
                .collect();
            dedup::median_memory_saved(&v)
        };
        if let (Some(k), Some(p1)) = (mem("ksm"), mem("pageone")) {
            println!(
                "{data}: host memory saved, pageone {} vs KSM {} (target: at least KSM's)",
                mib_text(Some(p1)),
                mib_text(Some(k))
            );
        }
    }
    if let (Some(h), Some(e)) = (
        med("pageone", dedup::Data::Hard),
        med("pageone", dedup::Data::Easy),
    ) {
        println!("pageone hard/easy time ratio: {:.2} (target < 1.1)", h / e);
    }
    write_json(
        &json,
        &serde_json::json!({ "samples": samples, "summary": summary }),
    )
}
