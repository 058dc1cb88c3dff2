//! `pageone-bench ksm`: the engine (in one process, or one process per region through the daemon)
//! against the kernel's KSM on the same workload processes, interleaved, with the layouts and
//! writers of issue #26 and the targets of issues #3, #4 and #26.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use pageone_bench::dedup::{self, Data, Params, Sample};
use pageone_bench::layout::Layout;
use pageone_bench::merging::{self, Setup};
use pageone_bench::workload::{self, Merger};
use pageone_bench::{ksm, processes};

use crate::write_json;

/// The data sets to run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum DataSets {
    Easy,
    Hard,
    Both,
}

/// `pageone-bench ksm`'s layout, writers and timing options.
#[derive(clap::Args)]
pub struct MoreArgs {
    /// Where the shared contents lie: `clustered` (the same order in every process), `scattered`
    /// (each process's, or region's, pages in its own random order), `runs` (runs of 1 to 64
    /// pages at different places in each process), `mixed` (the first half of each region
    /// scattered, the second clustered).
    #[arg(long, value_enum, default_value_t = Layout::Clustered)]
    pub layout: Layout,
    /// Writer threads per process, each writing random pages among every 16th page.
    #[arg(long, default_value_t = 0)]
    pub writers: usize,
    /// With `--hybrid`: leave out pageone's side alone (the hybrid against KSM).
    #[arg(long, requires = "hybrid")]
    pub without_pageone: bool,
    /// Each writer's pause between two writes, in microseconds.
    #[arg(long, default_value_t = 100)]
    pub write_pause_us: u64,
    /// Lock the regions (`mlock`) before they are merged, on both sides, as a program locking
    /// its memory (QEMU's `mem-lock=on`) does.
    #[arg(long)]
    pub locked: bool,
    /// One content in N is all zero (a page that a program zeroed, in every process): N / 2
    /// past a multiple of N, so that in the clustered layout each lies alone between others.
    #[arg(long, value_name = "N")]
    pub zero_every: Option<usize>,
    /// The data sets to run.
    #[arg(long, value_enum, default_value_t = DataSets::Both)]
    pub data: DataSets,
    /// The seed of the random layouts.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// The longest wait for 99% of the saving, in seconds [default: 300, 60 with --quick].
    #[arg(long)]
    pub timeout_s: Option<u64>,
    /// The window over which the CPU once settled is measured, in seconds [default: 10, 2 with
    /// --quick].
    #[arg(long)]
    pub settle_s: Option<f64>,
    /// How often the saving is sampled, in milliseconds.
    #[arg(long, default_value_t = 100)]
    pub sample_ms: u64,
}

impl MoreArgs {
    pub fn timeout_s(&self, quick: bool) -> u64 {
        self.timeout_s.unwrap_or(if quick { 60 } else { 300 })
    }

    fn data_sets(&self) -> &'static [Data] {
        match self.data {
            DataSets::Easy => &[Data::Easy],
            DataSets::Hard => &[Data::Hard],
            DataSets::Both => &[Data::Easy, Data::Hard],
        }
    }
}

/// What `pageone-bench ksm` was asked for.
pub struct Options {
    pub params: Params,
    /// Runs per side and data set.
    pub runs: usize,
    /// pageone as one process per region through a daemon.
    pub processes: bool,
    /// pageone's side only.
    pub pageone_only: bool,
    /// A third side: pageone with the kernel's KSM for what its mapping budget cannot afford.
    pub hybrid: bool,
    pub json: Option<PathBuf>,
    pub quick: bool,
    pub more: MoreArgs,
}

/// `pageone-bench workload --spec JSON` (hidden): one process of the benchmark.
#[derive(clap::Args)]
pub struct ChildArgs {
    #[arg(long)]
    spec: String,
}

pub fn workload(a: &ChildArgs) -> Result<()> {
    let spec: workload::Spec = serde_json::from_str(&a.spec).context("a bad --spec")?;
    workload::serve(&spec)?;
    Ok(())
}

fn mib_text(kib: Option<i64>) -> String {
    kib.map_or("unknown".into(), |k| {
        format!("{:.1} MiB", k as f64 / 1024.0)
    })
}

fn secs(t: Option<f64>) -> String {
    t.map_or("never".into(), |t| format!("{t:.2}"))
}

fn setup(o: &Options) -> Result<Setup> {
    let m = &o.more;
    if o.params.regions < 2 && o.processes {
        bail!("one process per region needs at least 2 regions");
    }
    Ok(Setup {
        params: o.params.clone(),
        layout: m.layout,
        writers: m.writers,
        write_pause_us: m.write_pause_us,
        locked: m.locked,
        zero_every: m.zero_every.unwrap_or(0),
        seed: m.seed,
        processes: o.processes,
        settle_window: Duration::from_secs_f64(m.settle_s.unwrap_or(if o.quick {
            2.0
        } else {
            10.0
        })),
        sample_every: Duration::from_millis(m.sample_ms.max(1)),
        bench_exe: std::env::current_exe().context("this executable's path")?,
        pageone_exe: if o.processes {
            Some(processes::find_pageone()?)
        } else {
            None
        },
    })
}

fn print_sample(s: &Sample, run: usize) {
    eprintln!(
        "  {} {} run {}: t50/t90/t99 {}/{}/{} s, {:.2} CPU-s, saved {}/{} pages; by Pss {}, by \
         MemAvailable {}, host memory {}; VMAs {} -> {}, their kernel memory {} ({}), net {}; \
         settled {:.3} CPU-s/s/GiB ({:.2}% of a core per process); {} writes",
        s.side,
        s.data,
        run + 1,
        secs(s.t50),
        secs(s.t90),
        secs(s.t99),
        s.cpu_seconds,
        s.pages_saved,
        s.possible,
        mib_text(s.saved_pss_kib),
        mib_text(s.saved_memavailable_kib),
        mib_text(s.memory_saved_kib),
        s.vmas_before,
        s.vmas_after,
        mib_text(Some(s.mapping_kernel.kib)),
        s.mapping_kernel.source,
        mib_text(s.net_saved_kib),
        s.settled.cpu_per_second_per_gib,
        s.settled.core_percent_per_process,
        s.writes,
    );
    if s.layout == Layout::Mixed && s.side != "ksm" {
        eprintln!(
            "    pages mapping the store, summed over the regions: {} in their scattered halves, \
             {} in their clustered halves",
            s.merged_halves[0], s.merged_halves[1],
        );
    }
}

pub fn run(o: &Options) -> Result<()> {
    let p = &o.params;
    let setup = setup(o)?;
    if !ksm::available() {
        bail!("KSM is not available or not writable here (needs root and /sys/kernel/mm/ksm)");
    }
    println!(
        "engine vs KSM: {} regions x {} MiB, {} layout, identical across regions, unique within{}; \
         {}{} writers per process; pageone {}{} workers, {} ms periods; KSM sleep_millisecs=0 \
         pages_to_scan=100000; {} runs; vm.max_map_count {}",
        p.regions,
        p.region_mib,
        setup.layout,
        match setup.zero_every {
            0 => String::new(),
            n => format!(", 1 content in {n} all zero"),
        },
        if setup.locked { "locked; " } else { "" },
        setup.writers,
        if o.processes {
            "one process per region through the daemon, "
        } else {
            "one process, "
        },
        p.workers,
        p.merge_period.as_millis(),
        o.runs,
        pageone_sys::max_map_count().map_or("unknown".into(), |n| n.to_string()),
    );
    let knobs = ksm::knobs();
    let mut samples = Vec::new();
    for &data in o.more.data_sets() {
        for run in 0..o.runs {
            // Alternate which side goes first, so neither always gets the warmer machine.
            let mut order = if o.pageone_only {
                vec![Merger::Pageone]
            } else if run % 2 == 0 {
                vec![Merger::Pageone, Merger::Ksm]
            } else {
                vec![Merger::Ksm, Merger::Pageone]
            };
            if o.hybrid {
                order.insert(run % (order.len() + 1), Merger::Hybrid);
            }
            if o.more.without_pageone {
                order.retain(|&m| m != Merger::Pageone);
            }
            for side in order {
                let s = merging::run(&setup, side, data)?;
                print_sample(&s, run);
                samples.push(s);
            }
        }
    }
    let summary = report(&samples, o.more.data_sets());
    write_json(
        &o.json,
        &serde_json::json!({
            "params": {
                "regions": p.regions, "region_mib": p.region_mib, "workers": p.workers,
                "period_ms": p.merge_period.as_millis() as u64, "runs": o.runs,
                "processes": o.processes, "layout": setup.layout, "writers": setup.writers,
                "write_pause_us": setup.write_pause_us, "locked": setup.locked, "seed": setup.seed,
                "zero_every": setup.zero_every,
                "settle_seconds": setup.settle_window.as_secs_f64(),
                "timeout_seconds": p.timeout.as_secs(),
                "max_map_count": pageone_sys::max_map_count().ok(),
                "ksm_knobs_found": knobs.into_iter().collect::<std::collections::BTreeMap<_, _>>(),
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

fn kib(v: Option<i64>) -> Option<f64> {
    v.map(|k| k as f64)
}

/// Prints the medians and the targets' ratios, and returns the medians as JSON rows.
fn report(samples: &[Sample], data_sets: &[Data]) -> Vec<serde_json::Value> {
    println!(
        "{:<8} {:<5} {:>7} {:>7} {:>7} {:>7} {:>11} {:>11} {:>8} {:>9} {:>11} {:>9}",
        "side",
        "data",
        "t50 s",
        "t90 s",
        "t99 s",
        "CPU-s",
        "Pss saved",
        "MemAvail",
        "VMAs+",
        "VMA kern",
        "net saved",
        "settled%"
    );
    let mut summary = Vec::new();
    for &data in data_sets {
        for side in ["pageone", "hybrid", "ksm"] {
            let v = of(samples, side, data);
            if v.is_empty() {
                continue;
            }
            let all = |f: fn(&Sample) -> Option<f64>| dedup::median_all(&v, f);
            let some = |f: fn(&Sample) -> Option<f64>| dedup::median_some(&v, f);
            let (t50, t90, t99) = (all(|s| s.t50), all(|s| s.t90), all(|s| s.t99));
            let c = dedup::median_cpu(&v);
            let pss = some(|s| kib(s.saved_pss_kib));
            let avail = some(|s| kib(s.saved_memavailable_kib));
            let vmas = some(|s| Some(s.vmas_after as f64 - s.vmas_before as f64));
            let kern = some(|s| Some(s.mapping_kernel.kib as f64));
            let net = some(|s| kib(s.net_saved_kib));
            let settled = some(|s| Some(s.settled.core_percent_per_process));
            let per_gib = some(|s| Some(s.settled.cpu_per_second_per_gib));
            let mib = |k: Option<f64>| mib_text(k.map(|k| k as i64));
            println!(
                "{side:<8} {data:<5} {:>7} {:>7} {:>7} {c:>7.2} {:>11} {:>11} {:>8.0} {:>9} {:>11} {:>9.2}",
                secs(t50), secs(t90), secs(t99), mib(pss), mib(avail), vmas.unwrap_or(0.0),
                mib(kern), mib(net), settled.unwrap_or(0.0)
            );
            summary.push(serde_json::json!({
                "side": side, "data": data,
                "median_seconds_to_99": dedup::median_time(&v), "median_cpu_seconds": c,
                "median_memory_saved_kib": dedup::median_memory_saved(&v),
                "median_t50": t50, "median_t90": t90, "median_t99": t99,
                "median_saved_pss_kib": pss, "median_saved_memavailable_kib": avail,
                "median_vmas_added": vmas, "median_mapping_kernel_kib": kern,
                "median_net_saved_kib": net,
                "median_settled_cpu_per_second_per_gib": per_gib,
                "median_settled_core_percent_per_process": settled,
            }));
        }
    }
    targets(samples, data_sets);
    summary
}

/// The issues' targets, as ratios.
fn targets(samples: &[Sample], data_sets: &[Data]) {
    let med = |side: &str, data: Data, f: fn(&Sample) -> Option<f64>| {
        dedup::median_all(&of(samples, side, data), f)
    };
    for &data in data_sets {
        if let (Some(k), Some(p1)) = (med("ksm", data, |s| s.t99), med("pageone", data, |s| s.t99))
        {
            println!(
                "{data}: to 99%, pageone {p1:.2} s, KSM {k:.2} s: pageone is {:.1}x faster",
                k / p1
            );
        }
        let host = |s: &Sample| s.memory_saved_kib.map(|k| k as f64);
        if let (Some(k), Some(p1)) = (med("ksm", data, host), med("pageone", data, host)) {
            println!(
                "{data}: host memory saved, pageone {} vs KSM {} (target: at least KSM's)",
                mib_text(Some(p1 as i64)),
                mib_text(Some(k as i64))
            );
        }
        let pss = |s: &Sample| s.saved_pss_kib.map(|k| k as f64);
        if let (Some(k), Some(p1)) = (med("ksm", data, pss), med("pageone", data, pss)) {
            println!(
                "{data}: pageone saves {:.1}% of KSM's saving by Pss (target >= 99%)",
                100.0 * p1 / k
            );
        }
        let per_gib = |s: &Sample| Some(s.settled.cpu_per_second_per_gib);
        let core = |s: &Sample| Some(s.settled.core_percent_per_process);
        if let (Some(g), Some(c)) = (med("pageone", data, per_gib), med("pageone", data, core)) {
            println!(
                "{data}: pageone once settled: {g:.4} CPU-s per s per GiB (target <= 0.01), \
                 {c:.2}% of a core per process (target <= 1%)"
            );
        }
    }
    let t99 = |data| med("pageone", data, |s| s.t99);
    if let (Some(h), Some(e)) = (t99(Data::Hard), t99(Data::Easy)) {
        println!("pageone hard/easy time ratio: {:.2} (target < 1.1)", h / e);
    }
}
