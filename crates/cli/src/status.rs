//! `pageone status`: the daemon's view per scope and client, as a summary or as its JSON.
//!
//! The JSON (`--json`) is what a plot or a monitor reads: `time_unix_ms` (when it was taken),
//! per scope `saved_bytes`, `pages_shared`, `pages_sharing`, `zero_pages`, `merges_per_sec`,
//! `worker_cpu_ns`, `store_resident_bytes`, and per client its engine's counters (`stats`: KSM's
//! names, `merges`, `cow_breaks`, `vmas_used`, `vma_limit`, `vma_limited_merges`,
//! `worker_cpu_ns`, ...). Polled every second, it draws saving over time.

use std::path::{Path, PathBuf};

use anyhow::{bail, Result};
use pageone_engine::proto::{self, Reply, Request};
use serde_json::Value;

use crate::config::Loaded;
use crate::scope::{connect_trusted, socket_or_default};

/// Options of `pageone status`.
#[derive(clap::Args)]
pub struct StatusOptions {
    /// The daemon's socket [default: $PAGEONE_SOCKET, else the configuration's, else the
    /// default one].
    #[arg(long)]
    pub socket: Option<PathBuf>,
    /// Print the daemon's JSON instead of a summary.
    #[arg(long)]
    pub json: bool,
}

/// The daemon's status JSON (as the caller's user sees it).
pub fn fetch(path: &Path) -> Result<Value> {
    let sock = connect_trusted(path)?;
    let (reply, _) = proto::call(&sock, &Request::Status, None)?;
    let Reply::Text(text) = reply else {
        bail!("the daemon answered out of protocol");
    };
    Ok(serde_json::from_str(&text)?)
}

pub fn run(o: StatusOptions, loaded: &Loaded) -> Result<()> {
    let path = socket_or_default(o.socket, loaded)?;
    let v = fetch(&path)?;
    if o.json {
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    print_text(&v);
    Ok(())
}

/// The summary `pageone status` prints.
fn print_text(v: &Value) {
    println!(
        "pageone daemon pid {} on {} (up {} s), scopes by {}{}",
        v["pid"],
        v["socket"],
        v["uptime_secs"],
        v["scope_by"],
        v["anonymous_bytes"]
            .as_f64()
            .map_or(String::new(), |b| format!(
                ", its own memory {:.1} MiB",
                b / 1048576.0
            )),
    );
    for u in v["users"].as_array().into_iter().flatten() {
        println!(
            "uid {}: {} connections, {} store pages, {} notes, {} requests in flight",
            u["uid"], u["connections"], u["store_pages"], u["notes"], u["requests_in_flight"]
        );
    }
    for s in v["scopes"].as_array().into_iter().flatten() {
        println!(
            "scope {}: {} clients, pages shared {}, sharing {}, zero {}, saved {:.1} MiB, \
             {:.0} merges/s, worker CPU {:.2} s, store resident {:.1} MiB, noted {}",
            s["scope"],
            s["clients"].as_array().map_or(0, |c| c.len()),
            s["pages_shared"],
            s["pages_sharing"],
            s["zero_pages"],
            s["saved_bytes"].as_f64().unwrap_or(0.0) / 1048576.0,
            s["merges_per_sec"].as_f64().unwrap_or(0.0),
            s["worker_cpu_ns"].as_f64().unwrap_or(0.0) / 1e9,
            s["store_resident_bytes"].as_f64().unwrap_or(0.0) / 1048576.0,
            s["noted_first_sightings"],
        );
        if let Some(cg) = s["cgroup"].as_str() {
            println!("  cgroup {cg}");
        }
        if s["clients_not_listed"].as_u64() > Some(0) {
            println!("  ({} more clients not listed)", s["clients_not_listed"]);
        }
        for c in s["clients"].as_array().into_iter().flatten() {
            if c["connected"] == false {
                println!(
                    "  client {} pid {}: disconnected; its {} copies stay held until it exits",
                    c["client"], c["pid"], c["held"]
                );
                continue;
            }
            let st = &c["stats"];
            println!(
                "  client {} pid {}: shared {} sharing {} zero {} merges {} ({:.0}/s) \
                 CPU {:.2} s, mappings {}/{} ({} merges held back), watch {}, daemon {}",
                c["client"],
                c["pid"],
                st["pages_shared"],
                st["pages_sharing"],
                st["zero_pages"],
                st["merges"],
                c["merges_per_sec"].as_f64().unwrap_or(0.0),
                st["worker_cpu_ns"].as_f64().unwrap_or(0.0) / 1e9,
                st["vmas_used"],
                st["vma_limit"],
                st["vma_limited_merges"],
                st["watch_mode"],
                st["daemon"],
            );
            if let Some(line) = limit_advice(st) {
                println!("    {line}");
            }
            if let Some(line) = ksm_note(st) {
                println!("    {line}");
            }
            if let Some(line) = refused_note(st) {
                println!("    {line}");
            }
        }
    }
}

/// What a client's report says about its mapping limit when pages wait on it: how many, and
/// the setting that would let them merge.
fn limit_advice(st: &Value) -> Option<String> {
    let n = |k: &str| st[k].as_u64().unwrap_or(0);
    let stats = pageone_engine::Stats {
        vmas_used: n("vmas_used"),
        vma_limit: n("vma_limit"),
        pages_waiting_on_limit: n("pages_waiting_on_limit"),
        ..Default::default()
    };
    let to = stats.max_map_count_to_merge()?;
    Some(format!(
        "the mapping limit binds: {} pages wait to merge; vm.max_map_count={to} \
         (pageone daemon --max-map-count {to}) would let them",
        stats.pages_waiting_on_limit
    ))
}

/// What a client's report says about regions handed to the kernel's KSM, if any.
fn ksm_note(st: &Value) -> Option<String> {
    let k = st["regions_to_ksm"].as_u64().filter(|&k| k > 0)?;
    Some(format!(
        "{k} regions whose merges cost a mapping per page, or whose pages are not read/write, are \
         merged by the kernel's KSM (see /sys/kernel/mm/ksm)"
    ))
}

/// What a client's report says about pages the kernel would not freeze, if any.
fn refused_note(st: &Value) -> Option<String> {
    let n = st["pages_refused"].as_u64().filter(|&n| n > 0)?;
    Some(format!(
        "{n} pages are not merged: they are not read/write (or locked, where the engine could not \
         lock memory of its own)"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_client_at_its_limit_is_told_the_setting_that_lets_its_pages_merge() {
        let st = serde_json::json!({
            "vmas_used": 65_000, "vma_limit": 65_530, "pages_waiting_on_limit": 1000
        });
        let line = limit_advice(&st).unwrap();
        assert!(line.contains("1000 pages wait"), "{line}");
        assert!(line.contains("vm.max_map_count=131072"), "{line}");
        let free = serde_json::json!({"vmas_used": 100, "vma_limit": 65_530});
        assert_eq!(limit_advice(&free), None);
    }

    #[test]
    fn regions_handed_to_the_kernels_ksm_are_named() {
        let st = serde_json::json!({"regions_to_ksm": 2});
        assert!(ksm_note(&st).unwrap().starts_with("2 regions"));
        assert_eq!(ksm_note(&serde_json::json!({"regions_to_ksm": 0})), None);
        assert_eq!(ksm_note(&serde_json::json!({})), None);
    }

    #[test]
    fn pages_the_kernel_would_not_freeze_are_named() {
        let st = serde_json::json!({"pages_refused": 512});
        assert!(refused_note(&st)
            .unwrap()
            .starts_with("512 pages are not merged"));
        assert_eq!(refused_note(&serde_json::json!({"pages_refused": 0})), None);
    }
}
