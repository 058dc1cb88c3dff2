//! Short end-to-end runs of the merging and overhead benchmarks (root, KSM; seconds each), and
//! plots of what they wrote. Release builds only (`cargo test -p pageone-bench --release`): a
//! debug build fills memory too slowly to stay short.
//!
//! The runs that need other executables of the workspace are ignored unless asked for:
//!
//! ```text
//! cargo build --release -p pageone -p pageone-preload
//! cargo test -p pageone-bench --release --test tools -- --ignored
//! ```

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;

/// KSM is one per machine: the runs that use it take turns.
static KSM: Mutex<()> = Mutex::new(());

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("pageone-bench-tools-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Runs `pageone-bench ARGS... --json DIR/out.json`, checks it succeeded and plots the JSON;
/// returns the JSON.
fn run_and_plot(dir: &Path, args: &[&str]) -> serde_json::Value {
    let _turn = KSM.lock().unwrap_or_else(|e| e.into_inner());
    let json = dir.join("out.json");
    let o = Command::new(env!("CARGO_BIN_EXE_pageone-bench"))
        .args(args)
        .arg("--json")
        .arg(&json)
        .env_remove("PAGEONE_SOCKET")
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    println!("{text}");
    assert!(o.status.success(), "{args:?} failed:\n{text}");
    let png = dir.join("out.png");
    let p = Command::new(env!("CARGO_BIN_EXE_pageone-bench"))
        .arg("plot")
        .arg(&json)
        .arg("-o")
        .arg(&png)
        .output()
        .unwrap();
    assert!(p.status.success(), "plot: {p:?}");
    assert!(std::fs::read(&png).unwrap().starts_with(b"\x89PNG"));
    serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap()
}

fn f(v: &serde_json::Value) -> f64 {
    v.as_f64().unwrap_or_else(|| panic!("not a number: {v}"))
}

/// Checks one side's sample of a merging run: every figure is there and consistent.
fn check_sample(s: &serde_json::Value, regions: u64, pages: u64) {
    let side = s["side"].as_str().unwrap();
    let possible = s["possible"].as_u64().unwrap();
    // Runs layout, writers on every 16th page: the written pages are not counted.
    assert!(possible < (regions - 1) * pages && possible > (regions - 1) * pages * 3 / 4);
    assert!(
        s["pages_saved"].as_u64().unwrap() > 0,
        "{side} saved nothing"
    );
    let t = s["series"]["t"].as_array().unwrap();
    assert!(!t.is_empty());
    assert_eq!(
        t.len(),
        s["series"]["saved_pages"].as_array().unwrap().len()
    );
    assert_eq!(
        t.len(),
        s["series"]["memavailable_saved_kib"]
            .as_array()
            .unwrap()
            .len()
    );
    for k in ["t50", "t90", "t99"] {
        if let Some(x) = s[k].as_f64() {
            assert!(x <= f(t.last().unwrap()), "{side} {k}");
        }
    }
    assert!(
        s["writes"].as_u64().unwrap() > 0,
        "{side}: the writers wrote nothing"
    );
    assert!(f(&s["settled"]["window_seconds"]) >= 0.5);
    assert!(f(&s["settled"]["cpu_seconds"]) >= 0.0);
    assert!(s["vmas_before"].as_u64().unwrap() > 0);
    let cost = &s["mapping_kernel"];
    assert!(
        cost["source"] == "slabinfo" || cost["source"].as_str().unwrap().starts_with("estimate")
    );
    let net = s["net_saved_kib"].as_i64().unwrap();
    let pss = s["saved_pss_kib"].as_i64().unwrap();
    assert_eq!(net, pss - cost["kib"].as_i64().unwrap());
}

#[test]
fn the_new_subcommands_and_flags_are_there() {
    let wanted: [(&str, &[&str]); 2] = [
        (
            "ksm",
            &[
                "--layout",
                "--writers",
                "--write-pause-us",
                "--data",
                "--seed",
                "--timeout-s",
                "--settle-s",
                "--sample-ms",
                "clustered",
                "scattered",
                "runs",
            ],
        ),
        (
            "overhead",
            &[
                "--quick",
                "--mib",
                "--reps",
                "--calls",
                "--call-pages",
                "--sides",
                "--ops",
                "--period-ms",
                "--merge-timeout-s",
                "--stall-writers",
                "--stall-seconds",
                "--stall-revisit-ms",
                "--busy-threads",
                "--preload",
                "--json",
            ],
        ),
    ];
    for (sub, flags) in wanted {
        let o = Command::new(env!("CARGO_BIN_EXE_pageone-bench"))
            .args([sub, "--help"])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&o.stdout);
        assert!(o.status.success(), "{sub} --help");
        for f in flags {
            assert!(text.contains(f), "{sub} has no {f}:\n{text}");
        }
    }
    let o = Command::new(env!("CARGO_BIN_EXE_pageone-bench"))
        .args(["overhead", "--sides", "plain,nothing"])
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("no side \"nothing\""));
}

#[test]
#[cfg_attr(debug_assertions, ignore = "release builds only")]
fn ksm_bench_runs_both_sides_with_a_layout_and_writers() {
    let d = scratch("ksm");
    let v = run_and_plot(
        &d,
        &[
            "ksm",
            "--quick",
            "--regions",
            "2",
            "--region-mib",
            "8",
            "--data",
            "easy",
            "--layout",
            "runs",
            "--writers",
            "1",
            "--settle-s",
            "0.5",
            "--timeout-s",
            "30",
        ],
    );
    assert_eq!(v["params"]["layout"], "runs");
    assert_eq!(v["params"]["writers"], 1);
    assert!(v["params"]["ksm_knobs_found"]["run"].is_string());
    let samples = v["samples"].as_array().unwrap();
    assert_eq!(samples.len(), 2);
    for s in samples {
        check_sample(s, 2, 2048);
    }
    let sides: Vec<_> = v["summary"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| &r["side"])
        .collect();
    assert_eq!(sides, ["pageone", "ksm"]);
    assert!(v["summary"][0]["median_net_saved_kib"].is_number());
    std::fs::remove_dir_all(d).unwrap();
}

#[test]
#[ignore = "needs target/release/pageone: cargo build --release -p pageone"]
fn ksm_bench_runs_one_process_per_region() {
    let d = scratch("ksm-processes");
    let v = run_and_plot(
        &d,
        &[
            "ksm",
            "--quick",
            "--processes",
            "--regions",
            "3",
            "--region-mib",
            "8",
            "--data",
            "hard",
            "--layout",
            "runs",
            "--writers",
            "1",
            "--settle-s",
            "0.5",
            "--timeout-s",
            "30",
        ],
    );
    assert_eq!(v["params"]["processes"], true);
    for s in v["samples"].as_array().unwrap() {
        check_sample(s, 3, 2048);
    }
    std::fs::remove_dir_all(d).unwrap();
}

/// Checks an overhead run's rows: each operation on each side, measured, no wrong page.
fn check_overhead(v: &serde_json::Value, sides: &[&str]) {
    let rows = v["overhead"].as_array().unwrap();
    assert_eq!(rows.len(), pageone_bench::ops::Op::ALL.len() * sides.len());
    for r in rows {
        let (op, side) = (r["op"].as_str().unwrap(), r["side"].as_str().unwrap());
        assert!(sides.contains(&side));
        assert_eq!(r["wrong_pages"], 0, "{op} on {side}");
        let p = &r["ns_per_page"];
        assert!(p["count"].as_u64().unwrap() > 0, "{op} on {side}");
        assert!(f(&p["p50"]) <= f(&p["p99"]) && f(&p["p99"]) <= f(&p["max"]));
        let calls = [
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
        assert_eq!(r["ns_per_call"].is_object(), calls.contains(&op), "{op}");
        assert_eq!(r["stalls_over"].is_array(), op == "write-stall", "{op}");
        assert_eq!(r["huge_fraction"].is_number(), op == "huge-read", "{op}");
        // First touches, the huge-page reads and the drops of unmerged pages are timed on memory
        // with nothing to merge.
        let unmerged = [
            "first-touch",
            "first-touch-busy",
            "huge-read",
            "dontneed-unmerged",
        ];
        let merging = side != "plain" && !unmerged.contains(&op);
        if merging {
            // Merged before the operation began: what it is timed on.
            assert!(f(&r["merged_fraction"]) > 0.9, "{op} on {side}: {r}");
        } else {
            assert_eq!(f(&r["merged_fraction"]), 0.0, "{op} on {side}");
        }
    }
}

#[test]
#[cfg_attr(debug_assertions, ignore = "release builds only")]
fn overhead_bench_times_every_operation_plain_and_under_ksm() {
    let d = scratch("overhead");
    let v = run_and_plot(
        &d,
        &[
            "overhead",
            "--quick",
            "--mib",
            "8",
            "--sides",
            "plain,ksm",
            "--stall-seconds",
            "1",
        ],
    );
    check_overhead(&v, &["plain", "ksm"]);
    std::fs::remove_dir_all(d).unwrap();
}

#[test]
#[ignore = "needs target/release/libpageone_preload.so: cargo build --release -p pageone-preload"]
fn overhead_bench_times_every_operation_under_pageone() {
    let d = scratch("overhead-pageone");
    let v = run_and_plot(
        &d,
        &[
            "overhead",
            "--quick",
            "--mib",
            "8",
            "--sides",
            "pageone",
            "--stall-seconds",
            "1",
        ],
    );
    check_overhead(&v, &["pageone"]);
    std::fs::remove_dir_all(d).unwrap();
}
