//! Figures of `overhead --json` (bars per operation, as multiples of plain's cost) and the
//! saving-over-time panels of `ksm --json` samples that carry a series.

use anyhow::{bail, Result};
use serde::Deserialize;

use crate::chart::{Body, Figure, Panel, Series};

#[derive(Deserialize)]
pub struct OverheadFile {
    params: Option<OverheadParams>,
    overhead: Vec<OverheadRow>,
}

#[derive(Deserialize)]
struct OverheadParams {
    mib: u64,
    reps: u64,
    period_ms: u64,
}

#[derive(Deserialize)]
struct OverheadRow {
    op: String,
    side: String,
    ns_per_page: Percentiles,
}

#[derive(Deserialize)]
struct Percentiles {
    p50: f64,
    p99: f64,
    max: f64,
}

/// pageone first (blue), then KSM (orange), then plain (grey), as the chart's colours go.
const SIDES: [(&str, &str); 3] = [("pageone", "pageone"), ("ksm", "KSM"), ("plain", "plain")];
/// The sides of the merging benchmark, in the order (and so the colours) of its bar panels.
const MERGING_SIDES: [(&str, &str); 3] =
    [("pageone", "pageone"), ("hybrid", "hybrid"), ("ksm", "KSM")];
const TOUCHES: [&str; 6] = [
    "first-touch",
    "first-touch-busy",
    "read-merged",
    "write-merged",
    "write-merged-busy",
    "huge-read",
];
const CALLS: [&str; 9] = [
    "munmap",
    "unmerge",
    "unmerge-scattered",
    "dontneed",
    "dontneed-unmerged",
    "free",
    "mprotect",
    "fork",
    "exit",
];

fn label(op: &str) -> String {
    match op {
        "first-touch" => "first touch".into(),
        "first-touch-busy" => "first touch, a thread busy".into(),
        "read-merged" => "read".into(),
        "write-merged" => "write (CoW)".into(),
        "write-merged-busy" => "write (CoW), a thread busy".into(),
        "huge-read" => "random read (THP)".into(),
        o => o.into(),
    }
}

pub fn overhead(f: OverheadFile) -> Result<Figure> {
    if f.overhead.is_empty() {
        bail!("no rows in the overhead results");
    }
    let find = |op: &str, side: &str| f.overhead.iter().find(|r| r.op == op && r.side == side);
    let sides: Vec<_> = SIDES
        .iter()
        .filter(|(s, _)| f.overhead.iter().any(|r| r.side == *s))
        .collect();
    let has_plain = sides.iter().any(|(s, _)| *s == "plain");
    let unit = if has_plain { "x plain" } else { "ns" };
    // A side's value for an operation: as a multiple of plain's when plain ran.
    let value = |op: &str, side: &str, q: fn(&Percentiles) -> f64| {
        let v = q(&find(op, side)?.ns_per_page);
        if !has_plain {
            return Some(v);
        }
        let base = q(&find(op, "plain")?.ns_per_page);
        Some(v / base.max(1.0))
    };
    let panel = |title: String, ops: &[&str], q: fn(&Percentiles) -> f64| {
        let ops: Vec<&str> = ops
            .iter()
            .copied()
            .filter(|o| f.overhead.iter().any(|r| r.op == *o))
            .collect();
        Panel {
            title,
            body: Body::Bars {
                groups: ops.iter().map(|o| label(o)).collect(),
                series: sides
                    .iter()
                    .map(|(s, name)| Series {
                        name: (*name).into(),
                        values: ops.iter().map(|o| value(o, s, q)).collect(),
                    })
                    .collect(),
            },
        }
    };
    let mut panels = vec![
        panel(format!("per page touched, p50 ({unit})"), &TOUCHES, |p| {
            p.p50
        }),
        panel(format!("per page touched, p99 ({unit})"), &TOUCHES, |p| {
            p.p99
        }),
        panel(
            format!("calls on a merged region, p50 per page ({unit})"),
            &CALLS,
            |p| p.p50,
        ),
    ];
    panels.retain(|p| matches!(&p.body, Body::Bars { groups, .. } if !groups.is_empty()));
    if f.overhead.iter().any(|r| r.op == "write-stall") {
        // p50 and p99 in microseconds, the longest in milliseconds: a panel each, to be seen.
        let stall =
            |title: &str, groups: &[&str], qs: &[fn(&Percentiles) -> f64], unit: f64| Panel {
                title: title.into(),
                body: Body::Bars {
                    groups: groups.iter().map(|g| g.to_string()).collect(),
                    series: sides
                        .iter()
                        .map(|(s, name)| Series {
                            name: (*name).into(),
                            values: qs
                                .iter()
                                .map(|q| find("write-stall", s).map(|r| q(&r.ns_per_page) / unit))
                                .collect(),
                        })
                        .collect(),
                },
            };
        panels.push(stall(
            "a write while pages merge, every CPU busy (us)",
            &["p50", "p99"],
            &[|p| p.p50, |p| p.p99],
            1e3,
        ));
        panels.push(stall(
            "the longest such write (ms)",
            &["max"],
            &[|p| p.max],
            1e6,
        ));
    }
    let title = match &f.params {
        Some(p) => format!(
            "What operations cost the program: {} MiB regions, {} process(es) each, pageone at {} ms periods",
            p.mib, p.reps, p.period_ms
        ),
        None => "What operations cost the program".into(),
    };
    Ok(Figure { title, panels })
}

#[derive(Deserialize)]
struct KsmSample {
    side: String,
    data: String,
    series: Option<SavingSeries>,
}

#[derive(Deserialize)]
struct SavingSeries {
    t: Vec<f64>,
    saved_pages: Vec<f64>,
}

/// Panels of the saving over time (MiB), one per data set, a line per side (each side's first
/// run that recorded a series); none when no sample has one.
pub fn saving_panels(v: &serde_json::Value) -> Result<Vec<Panel>> {
    let samples: Vec<KsmSample> = match v.get("samples") {
        Some(s) => serde_json::from_value(s.clone())?,
        None => return Ok(Vec::new()),
    };
    let mut data: Vec<&str> = Vec::new();
    for s in samples.iter().filter(|s| s.series.is_some()) {
        if !data.contains(&s.data.as_str()) {
            data.push(&s.data);
        }
    }
    // The chart labels x with whole numbers: short runs are drawn in milliseconds.
    let last = samples
        .iter()
        .filter_map(|s| s.series.as_ref()?.t.last().copied())
        .fold(0.0, f64::max);
    let (x_desc, x_scale) = if last < 10.0 {
        ("milliseconds from registration", 1000.0)
    } else {
        ("seconds from registration", 1.0)
    };
    Ok(data
        .into_iter()
        .map(|d| Panel {
            title: format!("saved over time, {d} data (MiB)"),
            body: Body::Lines {
                x_desc: x_desc.into(),
                series: MERGING_SIDES
                    .iter()
                    .filter_map(|(side, name)| {
                        let s = samples
                            .iter()
                            .find(|s| s.data == d && s.side == *side && s.series.is_some())?;
                        let series = s.series.as_ref()?;
                        Some(Series {
                            name: (*name).into(),
                            values: series
                                .t
                                .iter()
                                .zip(&series.saved_pages)
                                .map(|(&t, &p)| (t * x_scale, p * 4096.0 / 1048576.0))
                                .collect(),
                        })
                    })
                    .filter(|s| !s.values.is_empty())
                    .collect(),
            },
        })
        .filter(|p| matches!(&p.body, Body::Lines { series, .. } if !series.is_empty()))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn bars(p: &Panel) -> (&[String], &[Series<Option<f64>>]) {
        match &p.body {
            Body::Bars { groups, series } => (groups, series),
            Body::Lines { .. } => panic!("{} is not a bar panel", p.title),
        }
    }

    fn row(op: &str, side: &str, p50: f64) -> serde_json::Value {
        json!({"op": op, "side": side,
               "ns_per_page": {"p50": p50, "p99": p50 * 2.0, "max": p50 * 10.0}})
    }

    #[test]
    fn overhead_bars_are_multiples_of_plain() {
        let v = json!({"params": {"mib": 16, "reps": 1, "period_ms": 20}, "overhead": [
            row("first-touch", "plain", 2000.0), row("first-touch", "pageone", 60000.0),
            row("first-touch", "ksm", 2000.0), row("munmap", "plain", 100.0),
            row("munmap", "pageone", 1500.0), row("write-stall", "pageone", 500.0),
            row("write-stall", "plain", 100.0),
        ]});
        let f = overhead(serde_json::from_value(v).unwrap()).unwrap();
        assert_eq!(f.panels.len(), 5);
        let (groups, series) = bars(&f.panels[0]);
        assert_eq!(groups, ["first touch"]);
        assert_eq!(series[0].name, "pageone");
        assert_eq!(series[0].values, [Some(30.0)]);
        assert_eq!(series[1].values, [Some(1.0)]);
        assert_eq!(series[2].values, [Some(1.0)]);
        let (groups, series) = bars(&f.panels[2]);
        assert_eq!(groups, ["munmap"]);
        assert_eq!(series[0].values, [Some(15.0)]);
        assert_eq!(series[1].values, [None], "KSM's munmap did not run");
        let (_, stall) = bars(&f.panels[3]);
        assert_eq!(stall[0].values, [Some(0.5), Some(1.0)]);
        let (_, longest) = bars(&f.panels[4]);
        assert_eq!(longest[0].values, [Some(0.005)]);
        assert!(overhead(serde_json::from_value(json!({"overhead": []})).unwrap()).is_err());
    }

    #[test]
    fn saving_over_time_is_a_line_per_side_and_data_set() {
        let s = |side: &str, data: &str, pages: Vec<f64>| {
            json!({"side": side, "data": data,
                   "series": {"t": [0.1, 0.2, 0.3], "saved_pages": pages}})
        };
        let v = json!({"samples": [
            s("pageone", "easy", vec![0.0, 256.0, 512.0]), s("ksm", "easy", vec![0.0, 0.0, 256.0]),
            s("ksm", "hard", vec![1.0, 2.0, 3.0]), {"side": "pageone", "data": "hard"},
        ]});
        let panels = saving_panels(&v).unwrap();
        assert_eq!(panels.len(), 2);
        let Body::Lines { series, .. } = &panels[0].body else {
            panic!("not lines")
        };
        assert_eq!(series[0].name, "pageone");
        assert_eq!(
            series[0].values[2],
            (300.0, 2.0),
            "in milliseconds: a short run"
        );
        assert_eq!(series[1].name, "KSM");
        let Body::Lines { series, .. } = &panels[1].body else {
            panic!("not lines")
        };
        assert_eq!(series.len(), 1, "only KSM recorded hard data");
        assert!(saving_panels(&json!({"summary": []})).unwrap().is_empty());
    }
}
