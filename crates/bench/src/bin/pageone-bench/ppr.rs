//! `pageone-bench ppr`: runs [`pageone_bench::ppr`] and prints the program's cost per freed page
//! next to `madvise(MADV_DONTNEED)`.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Result};

use crate::write_json;

pub fn run(mib: usize, runs: usize, period: Duration, json: Option<PathBuf>) -> Result<()> {
    use pageone_bench::ppr::{median, run_once};
    if mib == 0 || runs == 0 {
        bail!("--mib and --runs must be at least 1");
    }
    println!(
        "PPR vs madvise(MADV_DONTNEED): {mib} MiB freed per run, engine period {} ms, 2 workers, median of {runs} runs",
        period.as_millis()
    );
    let mut samples = Vec::new();
    for k in 0..runs {
        let s = run_once(mib, period).map_err(|e| anyhow::anyhow!(e))?;
        eprintln!(
            "  run {}: mark {:.1} ns ({:.0} cycles), write-protected {:.1} ns, unmark {:.1} ns, madvise {:.1} ns ({:.0} cycles); released in {:.3} s, {:.3} CPU-s, {} pages still present",
            k + 1,
            s.mark_ns,
            s.mark_cycles,
            s.mark_protected_ns,
            s.unmark_ns,
            s.dontneed_ns,
            s.dontneed_cycles,
            s.recycle_seconds,
            s.recycle_cpu_seconds,
            s.present_after
        );
        samples.push(s);
    }
    let m = |f: fn(&pageone_bench::ppr::PprSample) -> f64| median(&samples, f);
    println!("{:<34} {:>12} {:>12}", "per freed page", "ns", "cycles");
    let rows: [(&str, f64, Option<f64>); 4] = [
        ("PPR mark", m(|s| s.mark_ns), Some(m(|s| s.mark_cycles))),
        (
            "PPR mark, page write-protected",
            m(|s| s.mark_protected_ns),
            Some(m(|s| s.mark_protected_cycles)),
        ),
        ("PPR unmark (reuse)", m(|s| s.unmark_ns), None),
        (
            "madvise(MADV_DONTNEED), one a page",
            m(|s| s.dontneed_ns),
            Some(m(|s| s.dontneed_cycles)),
        ),
    ];
    for (name, ns, cycles) in rows {
        let cycles = cycles.map_or(String::new(), |c| format!("{c:.0}"));
        println!("{name:<34} {ns:>12.1} {cycles:>12}");
    }
    println!(
        "the program's cost per freed page: PPR {:.1}x cheaper than madvise",
        m(|s| s.dontneed_ns) / m(|s| s.mark_ns).max(f64::MIN_POSITIVE)
    );
    println!(
        "memory back: all {} pages released {:.3} s after marking ({:.3} CPU-s of the engine), {:.0} pages still present",
        samples[0].pages,
        m(|s| s.recycle_seconds),
        m(|s| s.recycle_cpu_seconds),
        m(|s| s.present_after as f64)
    );
    println!(
        "engine's claim with nothing marked: {:.1} us per period for a pool of {} slots",
        m(|s| s.idle_claim_us),
        pageone_bench::ppr::IDLE_POOL_SLOTS
    );
    write_json(&json, &serde_json::to_value(&samples)?)
}
