//! `pageone-bench ksm`: the engine (in one process, or one process per region through the daemon)
//! against the kernel's KSM, interleaved, and the targets of issues #3 and #4.

use std::path::PathBuf;

use anyhow::{bail, Result};
use pageone_bench::dedup::{self, Data, Params, Sample};
use pageone_bench::{ksm, processes};

use crate::write_json;

/// What `pageone-bench ksm` was asked for.
pub struct Options {
    pub params: Params,
    /// Runs per side and data set.
    pub runs: usize,
    /// pageone as one process per region through a daemon.
    pub processes: bool,
    /// pageone's side only.
    pub pageone_only: bool,
    pub json: Option<PathBuf>,
}

/// One side of the benchmark.
type Side<'a> = &'a dyn Fn(&Params, Data) -> Result<Sample, String>;

fn mib_text(kib: Option<i64>) -> String {
    kib.map_or("unknown".into(), |k| {
        format!("{:.1} MiB", k as f64 / 1024.0)
    })
}

pub fn run(o: &Options) -> Result<()> {
    let p = &o.params;
    let pageone = if o.processes {
        Some(processes::find_pageone()?)
    } else {
        None
    };
    let pageone_side = |p: &Params, data: Data| match &pageone {
        Some(exe) => processes::run_pageone(exe, p, data).map_err(|e| e.to_string()),
        None => dedup::run_pageone(p, data),
    };
    if !ksm::available() {
        bail!("KSM is not available or not writable here (needs root and /sys/kernel/mm/ksm)");
    }
    println!(
        "engine vs KSM: {} regions x {} MiB, identical across regions, unique within; \
         pageone {}{} workers, {} ms periods; KSM sleep_millisecs=0 pages_to_scan=100000; \
         {} runs",
        p.regions,
        p.region_mib,
        if o.processes {
            "one process per region through the daemon, "
        } else {
            ""
        },
        p.workers,
        p.merge_period.as_millis(),
        o.runs
    );
    let mut samples = Vec::new();
    for data in [Data::Easy, Data::Hard] {
        for run in 0..o.runs {
            // Alternate which side goes first, so neither always gets the warmer machine.
            let order: &[Side] = if o.pageone_only {
                &[&pageone_side]
            } else if run % 2 == 0 {
                &[&pageone_side, &dedup::run_ksm]
            } else {
                &[&dedup::run_ksm, &pageone_side]
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
    let summary = report(&samples);
    write_json(
        &o.json,
        &serde_json::json!({
            "params": {
                "regions": p.regions, "region_mib": p.region_mib, "workers": p.workers,
                "period_ms": p.merge_period.as_millis() as u64, "runs": o.runs,
                "processes": o.processes,
            },
            "samples": samples,
            "summary": summary,
        }),
    )
}

fn of<'a>(samples: &'a [Sample], side: &str, data: Data) -> Vec<&'a Sample> {
    samples
        .iter()
        .filter(|s| s.side == side && s.data == data)
        .collect()
}

/// Prints the medians and the targets' ratios, and returns the medians as JSON rows.
fn report(samples: &[Sample]) -> Vec<serde_json::Value> {
    println!(
        "{:<8} {:<5} {:>14} {:>12} {:>20}",
        "side", "data", "s to 99%", "CPU-s", "memory saved"
    );
    let mut summary = Vec::new();
    for data in [Data::Easy, Data::Hard] {
        for side in ["pageone", "ksm"] {
            let v = of(samples, side, data);
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
    let med = |side: &str, data: Data| dedup::median_time(&of(samples, side, data));
    for data in [Data::Easy, Data::Hard] {
        if let (Some(k), Some(p1)) = (med("ksm", data), med("pageone", data)) {
            println!(
                "{data}: pageone is {:.1}x faster than KSM to 99% (target >= 4x)",
                k / p1
            );
        }
    }
    for data in [Data::Easy, Data::Hard] {
        let mem = |side: &str| dedup::median_memory_saved(&of(samples, side, data));
        if let (Some(k), Some(p1)) = (mem("ksm"), mem("pageone")) {
            println!(
                "{data}: host memory saved, pageone {} vs KSM {} (target: at least KSM's)",
                mib_text(Some(p1)),
                mib_text(Some(k))
            );
        }
    }
    if let (Some(h), Some(e)) = (med("pageone", Data::Hard), med("pageone", Data::Easy)) {
        println!("pageone hard/easy time ratio: {:.2} (target < 1.1)", h / e);
    }
    summary
}
