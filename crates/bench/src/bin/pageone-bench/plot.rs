//! `pageone-bench plot`: a PNG of one benchmark's JSON results, the kind told by the file's
//! shape: `sdtree --json` (an object with `results`), `ksm --json` (with `summary`), `ppr --json`
//! (an array of samples), `overhead --json` (with `overhead`), or a list of QEMU test runs (an
//! object with `qemu_runs`, see [`QemuRun`]). A figure is bars of the medians, with the saving
//! over time of `ksm` samples that recorded it; the QEMU runs are a series over runs.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use serde::Deserialize;

use crate::chart::{self, Body, Figure, Panel, Series};

#[derive(clap::Args)]
pub struct PlotArgs {
    /// A benchmark's JSON results (`--json FILE`).
    pub input: PathBuf,
    /// The PNG file to write.
    #[arg(short, long)]
    pub out: PathBuf,
    /// The plot's title instead of one made from the results.
    #[arg(long)]
    pub title: Option<String>,
}

pub fn run(a: &PlotArgs) -> Result<()> {
    let text = std::fs::read_to_string(&a.input)
        .with_context(|| format!("could not read {}", a.input.display()))?;
    let v: serde_json::Value = serde_json::from_str(&text)
        .with_context(|| format!("{} is not JSON", a.input.display()))?;
    let mut fig = figure(&v).with_context(|| format!("could not plot {}", a.input.display()))?;
    if let Some(t) = &a.title {
        fig.title = t.clone();
    }
    chart::draw(&fig, &a.out)?;
    println!("wrote {}", a.out.display());
    Ok(())
}

/// The figure for a benchmark's results, by their shape.
pub fn figure(v: &serde_json::Value) -> Result<Figure> {
    fn parse<T: serde::de::DeserializeOwned>(v: &serde_json::Value, what: &str) -> Result<T> {
        serde_json::from_value(v.clone()).with_context(|| format!("not {what}"))
    }
    if v.get("overhead").is_some() {
        crate::overhead_plot::overhead(parse(v, "overhead results: {params, overhead: [rows]}")?)
    } else if v.get("results").is_some() {
        sdtree(parse(v, "sdtree results: {keys, runs, results: [rows]}")?)
    } else if v.get("summary").is_some() {
        let mut f = ksm(parse(
            v,
            "ksm results: {params, samples, summary: [medians]}",
        )?)?;
        f.panels.extend(crate::overhead_plot::saving_panels(v)?);
        Ok(f)
    } else if v.get("qemu_runs").is_some() {
        qemu(parse(v, "QEMU runs: {qemu_runs: [runs]}")?)
    } else if v.get("density").is_some() {
        density(parse(v, "density results: {params, density: [modes]}")?)
    } else if v.get("marks").is_some() || v.get("allocators").is_some() {
        ppr_file(parse(
            v,
            "ppr results: {marks: [samples], allocators: {runs}}",
        )?)
    } else if v.is_array() {
        ppr(parse(v, "ppr results: [samples]")?)
    } else {
        bail!(
            "not the JSON of a benchmark: expected sdtree's (with `results`), ksm's (with \
             `summary`), ppr's (with `marks`/`allocators`, or an array of samples), density's \
             (with `density`) or QEMU runs (with `qemu_runs`)"
        )
    }
}

/// Values in first-seen order, once each.
fn distinct<T: PartialEq + Clone>(items: impl Iterator<Item = T>) -> Vec<T> {
    let mut out = Vec::new();
    for i in items {
        if !out.contains(&i) {
            out.push(i);
        }
    }
    out
}

#[derive(Deserialize)]
struct SdFile {
    keys: Option<u64>,
    runs: Option<u64>,
    results: Vec<SdRow>,
}

#[derive(Deserialize)]
struct SdRow {
    structure: String,
    data: String,
    threads: u64,
    insert_ops_per_s: f64,
    hit_ops_per_s: f64,
    miss_ops_per_s: f64,
}

fn sdtree(f: SdFile) -> Result<Figure> {
    if f.results.is_empty() {
        bail!("no rows in the sdtree results");
    }
    let groups = distinct(f.results.iter().map(|r| (r.data.clone(), r.threads)));
    let structures = distinct(f.results.iter().map(|r| r.structure.clone()));
    let panel = |title: &str, ops: fn(&SdRow) -> f64| Panel {
        title: title.into(),
        body: Body::Bars {
            groups: groups
                .iter()
                .map(|(d, t)| format!("{d}, {t} thr"))
                .collect(),
            series: structures
                .iter()
                .map(|s| Series {
                    name: s.clone(),
                    values: groups
                        .iter()
                        .map(|(d, t)| {
                            f.results
                                .iter()
                                .find(|r| &r.structure == s && &r.data == d && r.threads == *t)
                                .map(|r| ops(r) / 1e6)
                        })
                        .collect(),
                })
                .collect(),
        },
    };
    let mut title = "SD tree vs memcmp-ordered tree vs xxh3-128 hash index".to_string();
    if let (Some(k), Some(r)) = (f.keys, f.runs) {
        title += &format!(": {k} keys of 4 KiB, median of {r} runs");
    }
    Ok(Figure {
        title,
        panels: vec![
            panel("inserts, M/s", |r| r.insert_ops_per_s),
            panel("hits, M/s", |r| r.hit_ops_per_s),
            panel("misses, M/s", |r| r.miss_ops_per_s),
        ],
    })
}

#[derive(Deserialize)]
struct KsmFile {
    params: Option<KsmParams>,
    summary: Vec<KsmRow>,
}

#[derive(Deserialize)]
struct KsmParams {
    regions: u64,
    region_mib: u64,
    period_ms: u64,
    runs: u64,
    processes: bool,
    /// The regions were locked (`--locked`); absent in older files.
    #[serde(default)]
    locked: bool,
    /// One content in this many was all zero (`--zero-every`); absent in older files.
    #[serde(default)]
    zero_every: usize,
}

#[derive(Deserialize)]
struct KsmRow {
    side: String,
    data: String,
    median_seconds_to_99: Option<f64>,
    median_cpu_seconds: Option<f64>,
    median_memory_saved_kib: Option<f64>,
}

fn ksm(f: KsmFile) -> Result<Figure> {
    if f.summary.is_empty() {
        bail!("no rows in the ksm summary");
    }
    let data = distinct(f.summary.iter().map(|r| r.data.clone()));
    let sides = distinct(f.summary.iter().map(|r| r.side.clone()));
    let row = |side: &str, d: &str| f.summary.iter().find(|r| r.side == side && r.data == d);
    let panel = |title: &str, value: fn(&KsmRow) -> Option<f64>| Panel {
        title: title.into(),
        body: Body::Bars {
            groups: data.clone(),
            series: sides
                .iter()
                .map(|s| Series {
                    name: if s == "ksm" { "KSM".into() } else { s.clone() },
                    values: data.iter().map(|d| row(s, d).and_then(value)).collect(),
                })
                .collect(),
        },
    };
    let mut title = match &f.params {
        Some(p) => format!(
            "pageone vs KSM: {} x {} MiB{}{}, {}{} ms periods, medians of {} runs",
            p.regions,
            p.region_mib,
            if p.locked { " locked" } else { "" },
            match p.zero_every {
                0 => String::new(),
                n => format!(" (1 page in {n} zero)"),
            },
            if p.processes {
                "one process each through the daemon, "
            } else {
                "one process, "
            },
            p.period_ms,
            p.runs
        ),
        None => "pageone vs KSM".into(),
    };
    let speedups: Vec<String> = data
        .iter()
        .filter_map(|d| {
            let k = row("ksm", d)?.median_seconds_to_99?;
            let p = row("pageone", d)?.median_seconds_to_99?;
            Some(format!("{d} {:.1}x", k / p))
        })
        .collect();
    if !speedups.is_empty() {
        title += &format!("; faster to 99%: {}", speedups.join(", "));
    }
    Ok(Figure {
        title,
        panels: vec![
            panel("seconds to 99% of the saving", |r| r.median_seconds_to_99),
            panel("CPU-seconds", |r| r.median_cpu_seconds),
            panel("host memory saved, MiB", |r| {
                r.median_memory_saved_kib.map(|k| k / 1024.0)
            }),
        ],
    })
}

#[derive(Deserialize)]
struct PprSample {
    mark_ns: f64,
    mark_protected_ns: f64,
    unmark_ns: f64,
    dontneed_ns: f64,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn ppr(samples: Vec<PprSample>) -> Result<Figure> {
    if samples.is_empty() {
        bail!("no samples in the ppr results");
    }
    let m = |f: fn(&PprSample) -> f64| median(samples.iter().map(f).collect());
    let values = vec![
        Some(m(|s| s.mark_ns)),
        Some(m(|s| s.mark_protected_ns)),
        Some(m(|s| s.unmark_ns)),
        Some(m(|s| s.dontneed_ns)),
    ];
    Ok(Figure {
        title: format!(
            "PPR vs madvise(MADV_DONTNEED): a mark costs the program {:.0}x less, median of {} runs",
            m(|s| s.dontneed_ns) / m(|s| s.mark_ns).max(f64::MIN_POSITIVE),
            samples.len()
        ),
        panels: vec![Panel {
            title: "the program's cost per freed page, ns".into(),
            body: Body::Bars {
                groups: ["PPR mark", "PPR mark (write-protected)", "PPR unmark", "madvise (baseline)"]
                    .map(String::from)
                    .to_vec(),
                series: vec![Series {
                    name: "ns per page".into(),
                    values,
                }],
            },
        }],
    })
}

#[derive(Deserialize)]
struct PprFile {
    #[serde(default)]
    marks: Vec<PprSample>,
    allocators: Option<AllocFile>,
}

#[derive(Deserialize)]
struct AllocFile {
    runs: Vec<AllocRun>,
}

#[derive(Deserialize)]
struct AllocRun {
    heap: String,
    free_ns_mean: f64,
    excess_gib_s: f64,
    cpu_s: f64,
}

/// `ppr --json`: the allocator comparison when it was run, else the marks.
fn ppr_file(f: PprFile) -> Result<Figure> {
    let Some(a) = f.allocators.filter(|a| !a.runs.is_empty()) else {
        return ppr(f.marks);
    };
    let heaps = distinct(a.runs.iter().map(|r| r.heap.clone()));
    let m = |h: &str, v: fn(&AllocRun) -> f64| {
        median(a.runs.iter().filter(|r| r.heap == h).map(v).collect())
    };
    let panel = |title: &str, v: fn(&AllocRun) -> f64| Panel {
        title: title.into(),
        body: Body::Bars {
            groups: heaps.clone(),
            series: vec![Series {
                name: "median".into(),
                values: heaps.iter().map(|h| Some(m(h, v))).collect(),
            }],
        },
    };
    let mut title = format!(
        "One alloc/free trace: a PPR heap vs glibc, jemalloc, mimalloc (medians of {} runs)",
        a.runs.len() / heaps.len().max(1)
    );
    if heaps.iter().any(|h| h == "ppr") {
        for other in ["jemalloc", "mimalloc"] {
            if heaps.iter().any(|h| h == other) {
                title += &format!(
                    "; excess vs {other} {:.2}x",
                    m("ppr", |r| r.excess_gib_s) / m(other, |r| r.excess_gib_s)
                );
            }
        }
    }
    Ok(Figure {
        title,
        panels: vec![
            panel("excess resident memory x time, GiB*s", |r| r.excess_gib_s),
            panel("CPU-seconds", |r| r.cpu_s),
            panel("free(), mean ns", |r| r.free_ns_mean),
        ],
    })
}

#[derive(Deserialize)]
struct DensityFile {
    params: Option<DensityParams>,
    density: Vec<DensityMode>,
}

#[derive(Deserialize)]
struct DensityParams {
    budget_mib: u64,
    guest_mib: u64,
    seconds: u64,
}

#[derive(Deserialize)]
struct DensityMode {
    mode: String,
    /// The most guests that ran the fixed time (per run when there were several).
    guests: Vec<f64>,
    /// Host memory per guest at steady state in the passing trial with the most guests.
    per_guest_mib: Vec<f64>,
}

/// `density --json`: guests that fit, and host memory per guest, per mode (medians over runs).
fn density(f: DensityFile) -> Result<Figure> {
    if f.density.is_empty() {
        bail!("no modes in the density results");
    }
    let modes: Vec<String> = f.density.iter().map(|d| d.mode.clone()).collect();
    let med = |v: &[f64]| (!v.is_empty()).then(|| median(v.to_vec()));
    let panel = |title: &str, v: fn(&DensityMode) -> &Vec<f64>| Panel {
        title: title.into(),
        body: Body::Bars {
            groups: modes.clone(),
            series: vec![Series {
                name: "median".into(),
                values: f.density.iter().map(|d| med(v(d))).collect(),
            }],
        },
    };
    let of = |name: &str| {
        f.density
            .iter()
            .find(|d| d.mode == name)
            .and_then(|d| med(&d.guests))
    };
    let mut title = match &f.params {
        Some(p) => format!(
            "Guests of {} MiB in {} MiB, each {} s of churn without OOM or stall",
            p.guest_mib, p.budget_mib, p.seconds
        ),
        None => "Guests in one memory budget".into(),
    };
    let best_ksm = of("ksm-fast")
        .into_iter()
        .chain(of("ksm"))
        .fold(None, |a: Option<f64>, k| Some(a.map_or(k, |a| a.max(k))));
    let best_pageone = of("pageone-zero")
        .into_iter()
        .chain(of("pageone"))
        .fold(None, |a: Option<f64>, k| Some(a.map_or(k, |a| a.max(k))));
    if let (Some(k), Some(p)) = (best_ksm, best_pageone) {
        title += &format!("; pageone / KSM {:.2}x", p / k.max(f64::MIN_POSITIVE));
    }
    Ok(Figure {
        title,
        panels: vec![
            panel("guests that ran the fixed time", |d| &d.guests),
            panel("host memory per guest at steady state, MiB", |d| {
                &d.per_guest_mib
            }),
        ],
    })
}

/// One run of `tests/qemu/run.py` (two guests, pageone then KSM), as its output reports it.
#[derive(Deserialize)]
struct QemuRun {
    run: f64,
    pageone_pss_mib: f64,
    ksm_pss_mib: f64,
    pageone_cpu_s: Option<f64>,
    ksm_cpu_s: Option<f64>,
}

#[derive(Deserialize)]
struct QemuFile {
    qemu_runs: Vec<QemuRun>,
}

fn qemu(f: QemuFile) -> Result<Figure> {
    if f.qemu_runs.is_empty() {
        bail!("no runs in the QEMU results");
    }
    let line = |name: &str, y: fn(&QemuRun) -> Option<f64>| Series {
        name: name.into(),
        values: f
            .qemu_runs
            .iter()
            .filter_map(|r| Some((r.run, y(r)?)))
            .collect(),
    };
    Ok(Figure {
        title: "Two QEMU guests under pageone run vs KSM, by test run".into(),
        panels: vec![
            Panel {
                title: "QEMU processes' Pss saved, MiB".into(),
                body: Body::Lines {
                    x_desc: "test run".into(),
                    series: vec![
                        line("pageone", |r| Some(r.pageone_pss_mib)),
                        line("KSM", |r| Some(r.ksm_pss_mib)),
                    ],
                },
            },
            Panel {
                title: "CPU-seconds of merging".into(),
                body: Body::Lines {
                    x_desc: "test run".into(),
                    series: vec![
                        line("pageone", |r| r.pageone_cpu_s),
                        line("KSM", |r| r.ksm_cpu_s),
                    ],
                },
            },
        ],
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    fn bars(p: &Panel) -> (&[String], &[Series<Option<f64>>]) {
        match &p.body {
            Body::Bars { groups, series } => (groups, series),
            Body::Lines { .. } => panic!("{} is not a bar panel", p.title),
        }
    }

    #[test]
    fn ksm_summary_gives_bars_per_data_set_and_side() {
        let v = json!({"summary": [
            {"side": "pageone", "data": "easy", "median_seconds_to_99": 0.5,
             "median_cpu_seconds": 1.0, "median_memory_saved_kib": 2048},
            {"side": "ksm", "data": "easy", "median_seconds_to_99": 2.0,
             "median_cpu_seconds": 2.0, "median_memory_saved_kib": 1024},
            {"side": "pageone", "data": "hard", "median_seconds_to_99": null,
             "median_cpu_seconds": 1.5, "median_memory_saved_kib": null},
        ]});
        let f = figure(&v).unwrap();
        assert!(f.title.ends_with("faster to 99%: easy 4.0x"), "{}", f.title);
        let (groups, series) = bars(&f.panels[0]);
        assert_eq!(groups, ["easy", "hard"]);
        assert_eq!(series[0].name, "pageone");
        assert_eq!(series[0].values, [Some(0.5), None]);
        assert_eq!(series[1].name, "KSM");
        assert_eq!(series[1].values, [Some(2.0), None]);
        let (_, memory) = bars(&f.panels[2]);
        assert_eq!(memory[0].values, [Some(2.0), None]);
    }

    #[test]
    fn sdtree_rows_give_millions_per_second_by_data_and_threads() {
        let row = |s: &str, d: &str, t: u64, miss: f64| {
            json!({"structure": s, "data": d, "threads": t, "insert_ops_per_s": 1e6,
                   "hit_ops_per_s": 2e6, "miss_ops_per_s": miss, "bytes_examined_per_miss": 8.0})
        };
        let v = json!({"keys": 1024, "runs": 1, "results": [
            row("sdtree", "easy", 1, 3e6), row("memcmp_tree", "easy", 1, 1.5e6),
            row("sdtree", "hard", 2, 4e6),
        ]});
        let f = figure(&v).unwrap();
        assert!(f.title.ends_with("1024 keys of 4 KiB, median of 1 runs"));
        let (groups, series) = bars(&f.panels[2]);
        assert_eq!(groups, ["easy, 1 thr", "hard, 2 thr"]);
        assert_eq!(series[0].values, [Some(3.0), Some(4.0)]);
        assert_eq!(series[1].values, [Some(1.5), None]);
    }

    #[test]
    fn ppr_samples_give_medians_and_the_ratio() {
        let s = |mark: f64, dontneed: f64| {
            json!({"mark_ns": mark, "mark_protected_ns": 900.0, "unmark_ns": 20.0,
                   "dontneed_ns": dontneed})
        };
        let f = figure(&json!([s(20.0, 2000.0), s(25.0, 1500.0), s(100.0, 1000.0)])).unwrap();
        assert!(
            f.title.contains("60x less, median of 3 runs"),
            "{}",
            f.title
        );
        let (_, series) = bars(&f.panels[0]);
        assert_eq!(
            series[0].values,
            [Some(25.0), Some(900.0), Some(20.0), Some(1500.0)]
        );
    }

    #[test]
    fn other_json_is_refused_with_what_is_expected() {
        let e = figure(&json!({"samples": []})).unwrap_err().to_string();
        assert!(e.starts_with("not the JSON of a benchmark"), "{e}");
        let e = figure(&json!({"summary": []})).unwrap_err().to_string();
        assert_eq!(e, "no rows in the ksm summary");
        assert!(figure(&json!({"results": [{"structure": 1}]})).is_err());
    }

    #[test]
    fn ppr_allocator_runs_give_medians_per_heap() {
        let r = |h: &str, e: f64, c: f64| json!({"heap": h, "free_ns_mean": 100.0, "excess_gib_s": e, "cpu_s": c});
        let v = json!({"marks": [], "allocators": {"params": {}, "runs": [
            r("jemalloc", 2.0, 1.0), r("ppr", 0.5, 1.0), r("jemalloc", 4.0, 3.0), r("ppr", 0.7, 2.0),
            r("jemalloc", 3.0, 2.0), r("ppr", 0.6, 1.5)]}});
        let f = figure(&v).unwrap();
        assert!(f.title.contains("medians of 3 runs"), "{}", f.title);
        assert!(f.title.ends_with("excess vs jemalloc 0.20x"), "{}", f.title);
        let (groups, series) = bars(&f.panels[0]);
        assert_eq!(groups, ["jemalloc", "ppr"]);
        assert_eq!(series[0].values, [Some(3.0), Some(0.6)]);
        // Without allocator runs, the marks are drawn.
        let s = json!({"mark_ns": 20.0, "mark_protected_ns": 900.0, "unmark_ns": 20.0,
                       "dontneed_ns": 2000.0});
        let f = figure(&json!({"marks": [s], "allocators": null})).unwrap();
        assert!(f.title.contains("100x less"), "{}", f.title);
    }

    #[test]
    fn density_results_give_guests_and_memory_per_mode() {
        let m = |mode: &str, g: Vec<f64>, mib: Vec<f64>| json!({"mode": mode, "guests": g, "per_guest_mib": mib, "trials": []});
        let v = json!({"params": {"budget_mib": 2048, "guest_mib": 160, "seconds": 120},
            "density": [m("none", vec![8.0, 9.0, 8.0], vec![200.0]), m("ksm-fast", vec![10.0], vec![150.0]),
                        m("pageone-zero", vec![20.0, 19.0, 21.0], vec![90.0]), m("fpr", vec![], vec![])]});
        let f = figure(&v).unwrap();
        assert!(
            f.title.starts_with("Guests of 160 MiB in 2048 MiB"),
            "{}",
            f.title
        );
        assert!(f.title.ends_with("pageone / KSM 2.00x"), "{}", f.title);
        let (groups, series) = bars(&f.panels[0]);
        assert_eq!(groups, ["none", "ksm-fast", "pageone-zero", "fpr"]);
        assert_eq!(series[0].values, [Some(8.0), Some(10.0), Some(20.0), None]);
        let (_, memory) = bars(&f.panels[1]);
        assert_eq!(memory[0].values[2], Some(90.0));
        assert!(figure(&json!({"density": []})).is_err());
    }

    #[test]
    fn a_density_figure_draws_a_png() {
        let v = json!({"density": [{"mode": "none", "guests": [3.0], "per_guest_mib": [180.0]},
                                   {"mode": "pageone-zero", "guests": [7.0], "per_guest_mib": [70.0]}]});
        let fig = figure(&v).unwrap();
        let dir = std::env::temp_dir().join(format!("pageone-plot-density-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let out = dir.join("density.png");
        chart::draw(&fig, &out).unwrap();
        let (w, h, px) = decode(&out);
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!((w, h), (2 * 520, 440));
        assert!(px.iter().filter(|&&c| c == BLUE).count() > 1000);
    }

    /// The PNG's size and pixels (RGB), decoded.
    fn decode(path: &std::path::Path) -> (u32, u32, Vec<[u8; 3]>) {
        let mut r = png::Decoder::new(std::fs::File::open(path).unwrap())
            .read_info()
            .unwrap();
        let mut buf = vec![0; r.output_buffer_size()];
        let info = r.next_frame(&mut buf).unwrap();
        assert_eq!(info.color_type, png::ColorType::Rgb);
        let px = buf[..info.buffer_size()]
            .chunks(3)
            .map(|c| [c[0], c[1], c[2]])
            .collect();
        (info.width, info.height, px)
    }

    const BLUE: [u8; 3] = [31, 119, 180];
    const ORANGE: [u8; 3] = [255, 127, 14];

    fn value() -> impl Strategy<Value = Option<f64>> {
        proptest::option::weighted(0.85, 0.001f64..5000.0)
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(24))]

        /// Any ksm summary (values of any size, some not measured) draws a PNG of the figure's
        /// size, with each side's colour wherever one of its bars is tall enough to be seen.
        #[test]
        fn ksm_summaries_draw_valid_pngs(vals in proptest::collection::vec(value(), 12)) {
            let mut rows = Vec::new();
            for (k, (side, data)) in [("pageone", "easy"), ("ksm", "easy"), ("pageone", "hard"),
                                      ("ksm", "hard")].into_iter().enumerate() {
                rows.push(json!({"side": side, "data": data,
                    "median_seconds_to_99": vals[3 * k], "median_cpu_seconds": vals[3 * k + 1],
                    "median_memory_saved_kib": vals[3 * k + 2]}));
            }
            let fig = figure(&json!({"summary": rows})).unwrap();
            let dir = std::env::temp_dir().join(format!("pageone-plot-{}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap();
            let out = dir.join("ksm.png");
            chart::draw(&fig, &out).unwrap();
            let (w, h, px) = decode(&out);
            prop_assert_eq!((w, h), (3 * 520, 440));
            // Side s's values in panel p; a bar at least a twentieth of its panel's tallest is
            // over a thousand pixels, each legend's swatch 11 x 11.
            let of = |s: usize, p: usize| [vals[3 * s + p], vals[3 * (s + 2) + p]];
            let seen = |s: usize| (0..3).any(|p| {
                let top = of(0, p).into_iter().chain(of(1, p)).flatten().fold(0.0, f64::max);
                of(s, p).into_iter().flatten().any(|v| v >= top / 20.0)
            });
            let legends = 3 * 11 * 11;
            for (side, colour) in [(0, BLUE), (1, ORANGE)] {
                let n = px.iter().filter(|&&c| c == colour).count();
                if seen(side) {
                    prop_assert!(n > legends + 1000, "side {}: {} pixels", side, n);
                }
                if (0..3).all(|p| of(side, p).iter().all(Option::is_none)) {
                    prop_assert!(n <= legends, "side {} has no bars but {} pixels", side, n);
                }
            }
            prop_assert!(px.contains(&[255, 255, 255]));
        }
    }
}
