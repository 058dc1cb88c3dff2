//! The `pageone-bench` command as a user runs it: its subcommands and flags (the benchmarks
//! themselves need root and minutes; not run here).

use std::process::{Command, Output};

fn bench(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_pageone-bench"));
    c.args(args);
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().expect("pageone-bench runs")
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

#[test]
fn every_bench_subcommand_and_flag_is_there() {
    let o = bench(&["--help"], &[]);
    assert!(o.status.success());
    for sub in ["sdtree", "ppr", "ksm"] {
        assert!(text(&o).contains(sub), "no {sub} in:\n{}", text(&o));
    }
    let wanted: [(&str, &[&str]); 3] = [
        ("sdtree", &["--quick", "--runs", "--json"]),
        ("ppr", &["--mib", "--runs", "--period-ms", "--json"]),
        (
            "ksm",
            &[
                "--quick",
                "--runs",
                "--regions",
                "--region-mib",
                "--workers",
                "--period-ms",
                "--processes",
                "--pageone-only",
                "--json",
            ],
        ),
    ];
    for (sub, flags) in wanted {
        let o = bench(&[sub, "--help"], &[]);
        assert!(o.status.success(), "{sub} --help: {}", text(&o));
        for f in flags {
            assert!(text(&o).contains(f), "{sub} has no {f}:\n{}", text(&o));
        }
    }
}
