//! `pageone daemon`, `pageone status`, and the hidden `pageone scope-client` used by the
//! cross-process tests and benchmark.

use std::io::{BufRead, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use pageone_bench::dedup::{fill_page, Data};
use pageone_daemon::{Daemon, DaemonConfig};
use pageone_engine::proto::{self, Reply, Request};
use pageone_engine::Engine;
use pageone_sys as sys;

const PAGE: usize = 4096;

pub fn socket_or_default(socket: Option<PathBuf>) -> PathBuf {
    socket
        .or_else(|| std::env::var_os("PAGEONE_SOCKET").map(Into::into))
        .unwrap_or_else(proto::default_socket)
}

pub fn daemon(socket: Option<PathBuf>, exit_when_idle: bool) -> Result<()> {
    let mut config = DaemonConfig::new(socket_or_default(socket));
    config.exit_when_idle = exit_when_idle;
    let d = Daemon::bind(config)?;
    eprintln!("pageone daemon listening on {}", d.socket().display());
    d.run().context("the daemon stopped serving")
}

pub fn status(socket: Option<PathBuf>, json: bool) -> Result<()> {
    let path = socket_or_default(socket);
    let sock = UnixStream::connect(&path)
        .with_context(|| format!("no pageone daemon answers at {}", path.display()))?;
    let (reply, _) = proto::call(&sock, &Request::Status, None)?;
    let Reply::Text(text) = reply else {
        bail!("the daemon answered out of protocol");
    };
    let v: serde_json::Value = serde_json::from_str(&text)?;
    if json {
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    println!(
        "pageone daemon pid {} on {} (up {} s)",
        v["pid"], v["socket"], v["uptime_secs"]
    );
    for s in v["scopes"].as_array().into_iter().flatten() {
        println!(
            "scope {}: {} clients, pages shared {}, sharing {}, zero {}, saved {:.1} MiB, \
             {:.0} merges/s, worker CPU {:.2} s, store resident {:.1} MiB",
            s["scope"],
            s["clients"].as_array().map_or(0, |c| c.len()),
            s["pages_shared"],
            s["pages_sharing"],
            s["zero_pages"],
            s["saved_bytes"].as_f64().unwrap_or(0.0) / 1048576.0,
            s["merges_per_sec"].as_f64().unwrap_or(0.0),
            s["worker_cpu_ns"].as_f64().unwrap_or(0.0) / 1e9,
            s["store_resident_bytes"].as_f64().unwrap_or(0.0) / 1048576.0,
        );
        for c in s["clients"].as_array().into_iter().flatten() {
            let st = &c["stats"];
            println!(
                "  client {} pid {}: shared {} sharing {} zero {} merges {} ({:.0}/s) \
                 CPU {:.2} s, watch {}, daemon {}",
                c["client"],
                c["pid"],
                st["pages_shared"],
                st["pages_sharing"],
                st["zero_pages"],
                st["merges"],
                c["merges_per_sec"].as_f64().unwrap_or(0.0),
                st["worker_cpu_ns"].as_f64().unwrap_or(0.0) / 1e9,
                st["watch_mode"],
                st["daemon"],
            );
        }
    }
    Ok(())
}

/// Fills `mib` MiB with seed data (identical across processes, unique within), registers it with
/// an engine that joins the daemon (`$PAGEONE_SOCKET`), prints `READY`, then serves stdin:
/// `STATS` prints the engine's counters as one JSON line, `VERIFY` checks every byte and prints
/// `OK` or `BAD <page>`. At end of input it verifies, unregisters and exits (1 if data was wrong).
pub fn client(mib: usize, hard: bool, period_ms: u64, workers: usize) -> Result<()> {
    let data = if hard { Data::Hard } else { Data::Easy };
    let len = mib << 20;
    let engine = Engine::builder()
        .workers(workers)
        .merge_period(Duration::from_millis(period_ms))
        .build()?;
    let r = sys::mmap_anonymous(len)?;
    for i in 0..len / PAGE {
        // SAFETY: page i of a fresh private mapping owned by this function.
        unsafe { fill_page(r.add(i * PAGE), data, i as u64) };
    }
    engine.register(r, len)?;
    let verify = || -> Option<usize> {
        let mut want = [0u8; PAGE];
        let mut got = [0u8; PAGE];
        for i in 0..len / PAGE {
            // SAFETY: `want` is a local page.
            unsafe { fill_page(want.as_mut_ptr(), data, i as u64) };
            // SAFETY: the page is mapped; only this thread writes the region (the engine never
            // changes contents), so a copy of it is what the program sees.
            unsafe { std::ptr::copy_nonoverlapping(r.add(i * PAGE), got.as_mut_ptr(), PAGE) };
            if got != want {
                return Some(i);
            }
        }
        None
    };
    let mut out = std::io::stdout().lock();
    writeln!(out, "READY {}", std::process::id())?;
    out.flush()?;
    for line in std::io::stdin().lock().lines() {
        match line?.trim() {
            "STATS" => writeln!(out, "{}", serde_json::to_string(&engine.stats())?)?,
            "VERIFY" => match verify() {
                None => writeln!(out, "OK")?,
                Some(i) => writeln!(out, "BAD {i}")?,
            },
            "KICK" => {
                engine.wait_periods(1, Duration::from_secs(10));
                writeln!(out, "KICKED")?
            }
            other => writeln!(out, "ERR unknown command {other:?}")?,
        }
        out.flush()?;
    }
    let bad = verify();
    engine.unregister(r, len)?;
    engine.shutdown();
    if let Some(i) = bad {
        bail!("page {i} does not hold what was written");
    }
    Ok(())
}
