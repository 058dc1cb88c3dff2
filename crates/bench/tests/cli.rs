//! The `pageone-bench` command as a user runs it: its subcommands and flags, and `plot` writing
//! PNG files from benchmark JSON (the benchmarks themselves need root and minutes; not run here).

use std::path::{Path, PathBuf};
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

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("pageone-bench-cli-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Width and height from a PNG's header, after checking its signature and that it decodes.
fn png_size(path: &Path) -> (u32, u32) {
    let bytes = std::fs::read(path).unwrap();
    assert_eq!(
        &bytes[..8],
        b"\x89PNG\r\n\x1a\n",
        "{} is not a PNG",
        path.display()
    );
    let mut r = png::Decoder::new(std::io::Cursor::new(bytes))
        .read_info()
        .unwrap();
    let mut buf = vec![0; r.output_buffer_size()];
    let info = r.next_frame(&mut buf).unwrap();
    // Not one flat colour: something was drawn.
    let first = &buf[..3];
    assert!(
        buf[..info.buffer_size()].chunks(3).any(|p| p != first),
        "{} is blank",
        path.display()
    );
    (info.width, info.height)
}

#[test]
fn every_bench_subcommand_and_flag_is_there() {
    let o = bench(&["--help"], &[]);
    assert!(o.status.success());
    for sub in ["sdtree", "ppr", "ksm", "plot"] {
        assert!(text(&o).contains(sub), "no {sub} in:\n{}", text(&o));
    }
    let wanted: [(&str, &[&str]); 4] = [
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
                "--plot",
            ],
        ),
        ("plot", &["--out", "--title"]),
    ];
    for (sub, flags) in wanted {
        let o = bench(&[sub, "--help"], &[]);
        assert!(o.status.success(), "{sub} --help: {}", text(&o));
        for f in flags {
            assert!(text(&o).contains(f), "{sub} has no {f}:\n{}", text(&o));
        }
    }
}

/// `--plot` draws a run's results as it ends, as `plot` would from its `--json`.
#[test]
fn a_run_draws_its_plot_when_asked() {
    let d = scratch("run-plot");
    let out = d.join("sdtree.png");
    let o = bench(&["sdtree", "--quick", "--plot", out.to_str().unwrap()], &[]);
    assert!(o.status.success(), "{}", text(&o));
    let (w, h) = png_size(&out);
    assert!(w > 0 && h > 0);
}

#[test]
fn plot_writes_a_png_per_kind_of_results() {
    let d = scratch("kinds");
    let ppr = r#"[{"pages": 65536, "mark_ns": 25.1, "mark_cycles": 65, "mark_protected_ns": 1032.8,
        "mark_protected_cycles": 2681, "unmark_ns": 24.3, "dontneed_ns": 1989.5,
        "dontneed_cycles": 5165, "recycle_seconds": 0.053, "recycle_cpu_seconds": 0.053,
        "present_after": 0, "idle_claim_us": 2.2}]"#;
    let ksm = r#"{"params": {"regions": 4, "region_mib": 64, "workers": 2, "period_ms": 100,
        "runs": 1, "processes": true}, "samples": [], "summary": [
        {"side": "pageone", "data": "easy", "median_seconds_to_99": 0.2,
         "median_cpu_seconds": 0.3, "median_memory_saved_kib": 190000},
        {"side": "ksm", "data": "easy", "median_seconds_to_99": 0.9,
         "median_cpu_seconds": 0.9, "median_memory_saved_kib": 186000}]}"#;
    let sdtree = r#"{"keys": 32768, "runs": 1, "results": [
        {"structure": "sdtree", "data": "hard", "threads": 1, "insert_ops_per_s": 2.5e6,
         "hit_ops_per_s": 5.5e5, "miss_ops_per_s": 2.4e6, "bytes_examined_per_miss": 131.1}]}"#;
    let qemu = r#"{"qemu_runs": [
        {"run": 61, "pageone_pss_mib": 404, "ksm_pss_mib": 405, "pageone_cpu_s": 3.8, "ksm_cpu_s": 5.6},
        {"run": 62, "pageone_pss_mib": 409, "ksm_pss_mib": 411, "pageone_cpu_s": 3.2, "ksm_cpu_s": 5.6}]}"#;
    for (name, json, size) in [
        ("ppr", ppr, (960, 440)),
        ("ksm", ksm, (1560, 440)),
        ("sdtree", sdtree, (1560, 440)),
        ("qemu", qemu, (1040, 440)),
    ] {
        let input = d.join(format!("{name}.json"));
        let out = d.join(format!("{name}.png"));
        std::fs::write(&input, json).unwrap();
        let o = bench(
            &["plot", input.to_str().unwrap(), "-o", out.to_str().unwrap()],
            &[],
        );
        assert!(o.status.success(), "{name}: {}", text(&o));
        assert!(text(&o).contains(&format!("wrote {}", out.display())));
        assert_eq!(png_size(&out), size, "{name}");
    }
    std::fs::remove_dir_all(d).unwrap();
}

#[test]
fn plot_says_what_is_wrong() {
    let d = scratch("wrong");
    let input = d.join("other.json");
    std::fs::write(&input, r#"{"hello": 1}"#).unwrap();
    let out = d.join("out.png");
    let args = ["plot", input.to_str().unwrap(), "-o", out.to_str().unwrap()];
    let o = bench(&args, &[]);
    assert!(!o.status.success());
    assert!(
        text(&o).contains("not the JSON of a benchmark"),
        "{}",
        text(&o)
    );
    assert!(!out.exists());

    std::fs::write(
        &input,
        r#"[{"mark_ns": 1, "mark_protected_ns": 2, "unmark_ns": 1, "dontneed_ns": 9}]"#,
    )
    .unwrap();
    let o = bench(&args, &[("PAGEONE_BENCH_FONT", "/nonexistent/font.ttf")]);
    assert!(!o.status.success());
    assert!(
        text(&o)
            .contains("the font file /nonexistent/font.ttf (PAGEONE_BENCH_FONT) does not exist"),
        "{}",
        text(&o)
    );
    let o = bench(&args, &[]);
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(png_size(&out), (960, 440));
    std::fs::remove_dir_all(d).unwrap();
}
