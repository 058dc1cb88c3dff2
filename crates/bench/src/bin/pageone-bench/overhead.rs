//! `pageone-bench overhead`: what each memory operation costs the program, plain vs KSM vs
//! pageone (under its `LD_PRELOAD` shim), and the longest writer stalls while pages merge with
//! every CPU busy (issue #24 item 4, issue #27 items 1 and 5). See [`pageone_bench::overhead`].

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use pageone_bench::latency::Summary;
use pageone_bench::ops::{self, Op, Side, Stall};
use pageone_bench::overhead::{self, OpResult, Setup};
use pageone_bench::processes;

use crate::write_json;

#[derive(clap::Args)]
pub struct OverheadArgs {
    /// 16 MiB regions, one process per operation and side, 8 calls, 2-second stalls.
    #[arg(long)]
    quick: bool,
    /// Size of each region in MiB [default: 128, 16 with --quick].
    #[arg(long)]
    mib: Option<usize>,
    /// Processes per operation and side, whose samples are pooled [default: 3, 1 with --quick].
    #[arg(long)]
    reps: Option<usize>,
    /// Calls of the partial operations (DONTNEED, FREE, mprotect) and forks per process
    /// [default: 64, 8 with --quick].
    #[arg(long)]
    calls: Option<usize>,
    /// Pages per partial call.
    #[arg(long, default_value_t = 1)]
    call_pages: usize,
    /// The sides to run, comma-separated: plain, ksm, pageone.
    #[arg(long, value_delimiter = ',', default_value = "plain,ksm,pageone")]
    sides: Vec<String>,
    /// The operations to run, comma-separated [default: all]: first-touch, first-touch-busy,
    /// read-merged, write-merged, write-merged-busy, munmap, unmerge, unmerge-scattered, dontneed, dontneed-unmerged, free, mprotect,
    /// fork, exit, write-stall, huge-read.
    #[arg(long, value_delimiter = ',')]
    ops: Vec<String>,
    /// pageone's merge period (PAGEONE_MERGE_PERIOD_MS) in milliseconds.
    #[arg(long, default_value_t = 20)]
    period_ms: u64,
    /// The longest wait for a region to merge, in seconds.
    #[arg(long, default_value_t = 60)]
    merge_timeout_s: u64,
    /// Writer threads of the write stall.
    #[arg(long, default_value_t = 2)]
    stall_writers: usize,
    /// How long the writers write, in seconds [default: 10, 2 with --quick].
    #[arg(long)]
    stall_seconds: Option<f64>,
    /// How often each page is written during the stall, on average, in milliseconds: the
    /// writers' pace (long enough for pages to merge again between writes) [default: 10
    /// periods].
    #[arg(long)]
    stall_revisit_ms: Option<f64>,
    /// Busy normal-priority threads during the stall [default: one per CPU].
    #[arg(long)]
    busy_threads: Option<usize>,
    /// libpageone_preload.so [default: $PAGEONE_PRELOAD, else next to this executable].
    #[arg(long)]
    preload: Option<PathBuf>,
    /// Run pageone's side with a `pageone daemon` started for the run holding the store (as
    /// `pageone run` runs a program), instead of a store of the process's own.
    #[arg(long)]
    daemon: bool,
    /// Also write the results as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
}

/// `pageone-bench overhead-child --spec JSON` (hidden): one timed operation.
#[derive(clap::Args)]
pub struct ChildArgs {
    #[arg(long)]
    spec: String,
}

pub fn child(a: &ChildArgs) -> Result<()> {
    let spec: ops::OpSpec = serde_json::from_str(&a.spec).context("a bad --spec")?;
    ops::child(&spec).context("the operation failed")
}

fn side(name: &str) -> Result<Side> {
    Ok(match name {
        "plain" => Side::Plain,
        "ksm" => Side::Ksm,
        "pageone" => Side::Pageone,
        _ => bail!("no side {name:?}: plain, ksm or pageone"),
    })
}

fn op(name: &str) -> Result<Op> {
    Op::ALL
        .into_iter()
        .find(|o| o.name() == name)
        .with_context(|| format!("no operation {name:?}"))
}

fn setup(a: &OverheadArgs) -> Result<Setup> {
    let sides = a
        .sides
        .iter()
        .map(|s| side(s))
        .collect::<Result<Vec<_>>>()?;
    let ops = if a.ops.is_empty() {
        Op::ALL.to_vec()
    } else {
        a.ops.iter().map(|o| op(o)).collect::<Result<Vec<_>>>()?
    };
    let preload = match &a.preload {
        Some(p) => Some(p.clone()),
        None if sides.contains(&Side::Pageone) => Some(processes::find_beside(
            "PAGEONE_PRELOAD",
            "libpageone_preload.so",
            "build it with `cargo build --release -p pageone-preload`, or give --preload",
        )?),
        None => None,
    };
    let pages = (a.mib.unwrap_or(if a.quick { 16 } else { 128 }) << 20) / 4096;
    if pages < 2 {
        bail!("--mib must be at least 1");
    }
    let writers = a.stall_writers.max(1);
    let revisit_ms = a.stall_revisit_ms.unwrap_or(10.0 * a.period_ms as f64);
    // Each writer covers pages / writers pages per revisit.
    let pause_us = revisit_ms * 1e3 / (pages as f64 / writers as f64);
    Ok(Setup {
        sides,
        ops,
        pages,
        reps: a.reps.unwrap_or(if a.quick { 1 } else { 3 }).max(1),
        calls: a.calls.unwrap_or(if a.quick { 8 } else { 64 }).max(1),
        call_pages: a.call_pages.max(1),
        period_ms: a.period_ms.max(1),
        merge_timeout: Duration::from_secs(a.merge_timeout_s),
        stall: Stall {
            writers,
            seconds: a.stall_seconds.unwrap_or(if a.quick { 2.0 } else { 10.0 }),
            pause_us,
        },
        busy_threads: a
            .busy_threads
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get())),
        bench_exe: std::env::current_exe().context("this executable's path")?,
        preload,
        daemon_socket: None,
    })
}

fn ns(v: u64) -> String {
    match v {
        v if v >= 10_000_000 => format!("{:.0} ms", v as f64 / 1e6),
        v if v >= 10_000 => format!("{:.0} us", v as f64 / 1e3),
        v => format!("{v} ns"),
    }
}

fn row(r: &OpResult) {
    let call =
        |s: &Option<Summary>| s.map_or("-".into(), |s| format!("{} / {}", ns(s.p50), ns(s.max)));
    let stalls = r.stalls_over.map_or(String::new(), |[a, b, c]| {
        format!("  ({a} writes >= 100 us, {b} >= 1 ms, {c} >= 10 ms)")
    });
    let stalls = match r.huge_fraction {
        Some(f) => format!("{stalls}  ({:.0}% mapped by huge pages)", 100.0 * f),
        None => stalls,
    };
    println!(
        "{:<17} {:<8} {:>10} {:>10} {:>10} {:>21} {:>7.1}% {:>6}{stalls}",
        r.op.name(),
        r.side.name(),
        ns(r.ns_per_page.p50),
        ns(r.ns_per_page.p99),
        ns(r.ns_per_page.max),
        call(&r.ns_per_call),
        100.0 * r.merged_fraction_after.unwrap_or(r.merged_fraction),
        r.wrong_pages,
    );
    if r.wrong_pages > 0 {
        eprintln!(
            "  {} on {}: {} pages did not hold what the program expected afterwards",
            r.op.name(),
            r.side.name(),
            r.wrong_pages
        );
    }
}

pub fn run(a: &OverheadArgs) -> Result<()> {
    let mut s = setup(a)?;
    // Kept until the run ends (stopped when dropped).
    let daemon = if a.daemon && s.sides.contains(&Side::Pageone) {
        let socket = std::env::temp_dir().join(format!(
            "pageone-bench-overhead-{}.sock",
            std::process::id()
        ));
        let d = processes::BenchDaemon::start(&processes::find_pageone()?, &socket)?;
        s.daemon_socket = Some(d.socket().to_owned());
        Some(d)
    } else {
        None
    };
    println!(
        "what each operation costs the program: {} MiB regions, {} process(es) per operation and \
         side, {} calls of {} page(s); pageone under LD_PRELOAD with {} ms periods; KSM \
         sleep_millisecs=0 pages_to_scan=100000; stall: {} writers for {} s, a write every {:.1} us \
         each, with {} busy threads",
        s.pages * 4096 / 1048576,
        s.reps,
        s.calls,
        s.call_pages,
        s.period_ms,
        s.stall.writers,
        s.stall.seconds,
        s.stall.pause_us,
        s.busy_threads
    );
    println!(
        "{:<17} {:<8} {:>10} {:>10} {:>10} {:>21} {:>8} {:>6}",
        "operation",
        "side",
        "p50/page",
        "p99/page",
        "max/page",
        "per call p50 / max",
        "merged",
        "wrong"
    );
    let results = overhead::run(&s, row)?;
    let wrong: u64 = results.iter().map(|r| r.wrong_pages).sum();
    write_json(
        &a.json,
        &serde_json::json!({
            "params": {
                "mib": s.pages * 4096 / 1048576, "reps": s.reps, "calls": s.calls,
                "call_pages": s.call_pages, "period_ms": s.period_ms,
                "stall_writers": s.stall.writers, "stall_seconds": s.stall.seconds,
                "stall_pause_us": s.stall.pause_us, "busy_threads": s.busy_threads,
                "pageone_via": if daemon.is_some() {
                    "LD_PRELOAD of libpageone_preload.so, a daemon holding the store"
                } else {
                    "LD_PRELOAD of libpageone_preload.so, no daemon"
                },
            },
            "overhead": results,
        }),
    )?;
    if wrong > 0 {
        bail!("{wrong} pages did not hold what the program expected (see above)");
    }
    Ok(())
}
