//! `pageone-bench sdtree`: runs [`pageone_bench::sdtree`] and prints its table and the targets
//! of issue #2.

use std::path::PathBuf;

use anyhow::Result;
use pageone_bench::{dedup, sdtree};

use crate::write_json;

pub fn run(quick: bool, runs: Option<usize>, json: Option<PathBuf>) -> Result<()> {
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
