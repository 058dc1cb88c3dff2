//! `pageone-bench`: pageone's benchmarks, each next to its baseline in the same run, and the plots
//! of their results. `pageone bench ARGS...` runs this command with the same arguments.

mod chart;
mod density;
mod ksm;
mod overhead;
mod overhead_plot;
mod plot;
mod ppr;
mod sdtree;

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "pageone-bench",
    version,
    about = "pageone's benchmarks, each next to its baseline in the same run"
)]
struct Cli {
    /// Also draw the results as a PNG to this file (the plot `pageone-bench plot` draws from
    /// `--json`): for sdtree, ksm, ppr and overhead.
    #[arg(long, global = true, value_name = "FILE.png")]
    plot: Option<PathBuf>,
    #[command(subcommand)]
    which: Bench,
}

/// Where `--plot` asked for the results' PNG.
static PLOT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();

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
        json: Option<PathBuf>,
    },
    /// PPR (marking freed pages, the engine releasing them) vs `madvise(MADV_DONTNEED)` per page,
    /// and a PPR heap vs glibc, jemalloc and mimalloc on one alloc/free trace.
    Ppr(ppr::PprArgs),
    /// One replay of the allocator trace in this process (run by `ppr`; prints JSON).
    #[command(hide = true)]
    PprTrace(ppr::TraceArgs),
    /// The engine vs the kernel's KSM: time to 99% of the possible saving and CPU-seconds.
    Ksm(KsmArgs),
    /// How many small QEMU guests with an allocate/free churn fit in one memory budget, per way
    /// of merging or returning memory, and how fast freed guest memory comes back (root).
    Density(density::DensityArgs),
    /// What memory operations cost the program (ns per page), plain vs KSM vs pageone, and the
    /// longest writer stalls while pageone merges.
    Overhead(overhead::OverheadArgs),
    /// A process of the ksm benchmark (run by it).
    #[command(hide = true)]
    Workload(ksm::ChildArgs),
    /// A process of the overhead benchmark (run by it).
    #[command(hide = true)]
    OverheadChild(overhead::ChildArgs),
    /// Draws a PNG plot of a benchmark's JSON results (`--json FILE` of sdtree, ksm,
    /// ppr, density or overhead).
    Plot(plot::PlotArgs),
}

#[derive(clap::Args)]
struct KsmArgs {
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
    /// Also run a third side: pageone with the kernel's KSM running at its fastest too, taking
    /// the pages pageone's mapping budget cannot afford (`Config::ksm_when_limited`).
    #[arg(long)]
    hybrid: bool,
    /// Also write the results as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    #[command(flatten)]
    more: ksm::MoreArgs,
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("PAGEONE_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    if let Some(p) = cli.plot {
        let _ = PLOT.set(p);
    }
    match cli.which {
        Bench::Sdtree { quick, runs, json } => sdtree::run(quick, runs, json),
        Bench::Ppr(a) => ppr::run(&a),
        Bench::PprTrace(a) => ppr::trace(&a),
        Bench::Ksm(a) => {
            let params = pageone_bench::dedup::Params {
                regions: a.regions,
                region_mib: a.region_mib.unwrap_or(if a.quick { 64 } else { 512 }),
                workers: a.workers,
                merge_period: Duration::from_millis(a.period_ms),
                timeout: Duration::from_secs(a.more.timeout_s(a.quick)),
            };
            ksm::run(&ksm::Options {
                params,
                runs: a.runs.unwrap_or(if a.quick { 1 } else { 3 }),
                processes: a.processes,
                pageone_only: a.pageone_only,
                hybrid: a.hybrid,
                json: a.json,
                quick: a.quick,
                more: a.more,
            })
        }
        Bench::Density(a) => density::run(&a),
        Bench::Overhead(a) => overhead::run(&a),
        Bench::Workload(a) => ksm::workload(&a),
        Bench::OverheadChild(a) => overhead::child(&a),
        Bench::Plot(a) => plot::run(&a),
    }
}

/// Writes `value` as pretty JSON to `path`, if one was given, and draws it where `--plot` asked.
fn write_json(path: &Option<PathBuf>, value: &serde_json::Value) -> Result<()> {
    if let Some(p) = path {
        std::fs::write(p, serde_json::to_string_pretty(value)?)
            .with_context(|| format!("could not write {}", p.display()))?;
        println!("wrote {}", p.display());
    }
    if let Some(png) = PLOT.get() {
        let fig = plot::figure(value).context("could not plot these results")?;
        chart::draw(&fig, png)?;
        println!("wrote {}", png.display());
    }
    Ok(())
}
