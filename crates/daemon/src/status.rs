//! `pageone status`: the daemon's view, per scope and per client, as JSON. A caller sees the
//! scopes and the account of its own user only (root sees all), and the text stays within a
//! frame whatever the clients reported: beyond a budget, clients are counted, not listed.

use pageone_sync::lock;
use serde_json::{json, Value};
use std::os::fd::AsRawFd;
use std::sync::Arc;

use pageone_proto as proto;
use pageone_sys as sys;

use crate::scope::{Scope, ScopeState};
use crate::Inner;

const PAGE: u64 = sys::PAGE_SIZE as u64;
/// Most bytes of client entries in one status text (a frame holds twice that).
const BUDGET: usize = proto::MAX_FRAME / 2;

/// What a caller running as `viewer` sees.
pub(crate) fn json(inner: &Inner, viewer: u32) -> Value {
    let all = viewer == 0;
    let mut scopes: Vec<Arc<Scope>> = lock(&inner.scopes)
        .values()
        .filter(|s| all || s.key.uid == viewer)
        .cloned()
        .collect();
    scopes.sort_by(|a, b| a.name.cmp(&b.name));
    let mut budget = BUDGET;
    let out: Vec<Value> = scopes.iter().map(|s| scope(s, &mut budget)).collect();
    let users: Vec<Value> = inner
        .accounts
        .users()
        .into_iter()
        .filter(|(_, a)| all || a.uid == viewer)
        .map(|(connections, a)| {
            json!({
                "uid": a.uid,
                "connections": connections,
                "store_pages": a.pages(),
                "notes": a.notes(),
                "requests_in_flight": a.in_flight(),
            })
        })
        .collect();
    let mut v = json!({
        "pid": std::process::id(),
        "socket": inner.config.socket,
        "uptime_secs": inner.started.elapsed().as_secs(),
        // When this was taken (milliseconds since the Unix epoch): a series of status texts
        // plots against it.
        "time_unix_ms": unix_ms(),
        "scope_by": inner.config.scope_by.to_string(),
        "scopes": out,
        "users": users,
    });
    if all {
        // The daemon's own memory (its tables, for every user), which counts against what its
        // scopes save. (From the kernel's counters: status is polled, and a page table walk
        // would cost a poll more than the answer is worth.)
        v["anonymous_bytes"] = json!(sys::self_status_kib("RssAnon").unwrap_or(0) * 1024);
        v["notes"] = json!(inner.accounts.notes());
        v["connections"] = json!(inner.accounts.connections());
    }
    v
}

fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// A number a client reported (its word: sums of them saturate).
pub(crate) fn reported(r: &serde_json::Map<String, Value>, key: &str) -> u64 {
    r.get(key).and_then(Value::as_u64).unwrap_or(0)
}

/// A scope's sums over its clients' reports.
pub(crate) struct Totals {
    /// Pages of the clients mapping the store (beyond the copies themselves: `sharing`).
    pub(crate) sharing: u64,
    pub(crate) zero: u64,
    pub(crate) cpu_ns: u64,
    pub(crate) merges_per_sec: f64,
}

impl Totals {
    pub(crate) fn of(st: &ScopeState) -> Self {
        let (mut mapped, mut zero, mut cpu_ns, mut merges_per_sec) = (0u64, 0u64, 0u64, 0.0);
        for c in st.clients.values() {
            if let Some(r) = &c.report {
                let pages =
                    reported(r, "pages_shared").saturating_add(reported(r, "pages_sharing"));
                mapped = mapped.saturating_add(pages);
                zero = zero.saturating_add(reported(r, "zero_pages"));
                cpu_ns = cpu_ns.saturating_add(reported(r, "worker_cpu_ns"));
            }
            merges_per_sec += c.merges_per_sec;
        }
        Self {
            sharing: mapped.saturating_sub(st.live),
            zero,
            cpu_ns,
            merges_per_sec,
        }
    }

    /// Memory saved: pages mapping a copy beyond the copy, and zero pages released.
    pub(crate) fn saved_bytes(&self) -> u64 {
        self.sharing.saturating_add(self.zero).saturating_mul(PAGE)
    }
}

fn scope(sc: &Scope, budget: &mut usize) -> Value {
    let resident = sys::file_usage(sc.fd.as_raw_fd()).map_or(0, |u| u.1);
    let st = lock(&sc.state);
    let totals = Totals::of(&st);
    let mut clients = Vec::new();
    let mut omitted = 0usize;
    let mut ids: Vec<&u64> = st.clients.keys().collect();
    ids.sort();
    for id in ids {
        let c = &st.clients[id];
        let entry = json!({
            "client": id,
            "pid": c.pid,
            "connected": c.connected,
            "held": c.held.len(),
            "noted": c.notes,
            "merges_per_sec": c.merges_per_sec,
            "stats": c.report,
        });
        let size = entry.to_string().len();
        if size > *budget {
            omitted += 1;
            continue;
        }
        *budget -= size;
        clients.push(entry);
    }
    json!({
        "scope": sc.name,
        "uid": sc.key.uid,
        "cgroup": sc.key.cgroup,
        "clients": clients,
        "clients_not_listed": omitted,
        "pages_shared": st.live,
        "pages_sharing": totals.sharing,
        "zero_pages": totals.zero,
        "saved_bytes": totals.saved_bytes(),
        "copies_made": st.copies_made,
        "zero_holes": st.holes,
        "noted_first_sightings": st.noted_entries,
        "store_pages_in_use": st.pages_in_use(),
        "store_resident_bytes": resident,
        "merges_per_sec": totals.merges_per_sec,
        "worker_cpu_ns": totals.cpu_ns,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DaemonConfig;

    /// A status text is a point of a time series (what a plot of saving over time reads): it
    /// says when it was taken.
    #[test]
    fn status_says_when_it_was_taken() {
        let inner = Inner::new(DaemonConfig::new("/nonexistent.sock".into()), None);
        let before = unix_ms();
        let v = json(&inner, 0);
        let at = v["time_unix_ms"].as_u64().unwrap();
        assert!(at >= before && at <= unix_ms(), "{v}");
        assert!(v["uptime_secs"].is_u64() && v["scopes"].is_array(), "{v}");
    }
}
