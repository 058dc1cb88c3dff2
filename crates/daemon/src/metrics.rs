//! The daemon's metrics over HTTP (`--metrics ADDR`, off by default), in the Prometheus
//! (OpenMetrics) text format: per scope and per client, KSM's counter names where they exist
//! (`pages_shared`, `pages_sharing`, `general_profit`, ...) and pageone's own (merges, CoW
//! breaks, mappings used and their limit, merges held back by that limit, recycled pages, CPU).
//!
//! What it shows is root's view of `status`: every user's scopes, their names, client pids and
//! counters. Whoever can connect to the address reads it, so it is off unless asked for, and
//! meant for a loopback address or a network only the monitoring reaches.
//!
//! Each scrape builds a fresh registry from the daemon's tables (a few lookups per client,
//! under each scope's lock in turn). The HTTP side is the least a scraper needs: `GET /metrics`
//! on a connection of its own, answered and closed, one at a time, each bounded in time and
//! size.

use std::io::{self, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use pageone_sync::lock;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use serde_json::{Map, Value};

use pageone_sys as sys;

use crate::status::{reported, Totals};
use crate::Inner;

/// How long a scraper may take to send its request or take the answer.
const IO_TIMEOUT: Duration = Duration::from_secs(5);
/// Most bytes of a request's head.
const MAX_REQUEST: usize = 8 << 10;
const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ScopeLabels {
    /// The scope's name as `status` shows it (`NAME@uidUID` for users other than root).
    scope: String,
    uid: u32,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ClientLabels {
    scope: String,
    uid: u32,
    client: u64,
    pid: i32,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct UserLabels {
    uid: u32,
}

type U64Gauge = Gauge<u64, std::sync::atomic::AtomicU64>;
type F64Counter = Counter<f64, std::sync::atomic::AtomicU64>;

/// A client's reported gauges: the report's key, which is the metric's name (KSM's names where
/// KSM has the counter), and its help.
const CLIENT_GAUGES: &[(&str, &str)] = &[
    (
        "pages_shared",
        "Stable copies this client maps (KSM's pages_shared)",
    ),
    (
        "pages_sharing",
        "Pages mapping a stable copy beyond one per copy: pages saved (KSM's pages_sharing)",
    ),
    (
        "pages_unshared",
        "Candidates that matched nothing in the last period (KSM's pages_unshared)",
    ),
    (
        "pages_volatile",
        "Present pages still changing (KSM's pages_volatile)",
    ),
    (
        "zero_pages",
        "Zero pages released (KSM's ksm_zero_pages), recycled pages included",
    ),
    ("vmas_used", "Mappings (VMAs) of the client's process"),
    (
        "vma_limit",
        "The mapping limit the engine respects (vm.max_map_count, read every period)",
    ),
    ("registered_bytes", "Memory registered with the engine"),
    (
        "pages_waiting_on_limit",
        "Pages that would merge but wait for room under the mapping limit (vm.max_map_count)",
    ),
    (
        "pages_refused",
        "Unchanged pages the kernel would not freeze (not read/write): not merged",
    ),
    (
        "regions_to_ksm",
        "Regions handed to the kernel's KSM, their pages locked or their merges costing a mapping \
         per page beyond the mapping limit",
    ),
];

/// A client's reported counters (the metric's name gets `_total`).
const CLIENT_COUNTERS: &[(&str, &str)] = &[
    ("full_scans", "Periods completed (KSM's full_scans)"),
    ("pages_scanned", "Pages examined (KSM's pages_scanned)"),
    ("merges", "Pages merged"),
    ("cow_breaks", "Merged pages later written (copy on write)"),
    (
        "compare_mismatches",
        "Frozen pages that differed from their copy at compare time",
    ),
    (
        "vma_limited_merges",
        "Merges held back because they would have passed the mapping limit: pages waiting on \
         vm.max_map_count",
    ),
    (
        "pages_recycled",
        "Pages the program marked free (PPR) that the engine released",
    ),
    ("daemon_joins", "Times the client joined a daemon again"),
    (
        "pages_left_private",
        "Pages made private after a join because they had not moved to the new store",
    ),
    (
        "huge_pages_restored",
        "Huge pages collapsed back where the watch had split them and nothing merged",
    ),
];

/// Serves scrapes on `listener` until the process ends.
pub(crate) fn serve(listener: TcpListener, inner: Arc<Inner>) {
    for conn in listener.incoming() {
        let stream = match conn {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "could not accept a metrics scrape");
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
        };
        if let Err(e) = answer(stream, &inner) {
            tracing::debug!(error = %e, "a metrics scrape failed");
        }
    }
}

/// Reads one request and answers it: the metrics for `GET /metrics`, an error otherwise.
fn answer(mut stream: TcpStream, inner: &Inner) -> io::Result<()> {
    stream.set_read_timeout(Some(IO_TIMEOUT))?;
    stream.set_write_timeout(Some(IO_TIMEOUT))?;
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") && !head.windows(2).any(|w| w == b"\n\n") {
        let n = stream.read(&mut buf)?;
        if n == 0 {
            break;
        }
        head.extend_from_slice(&buf[..n]);
        if head.len() > MAX_REQUEST {
            return respond(
                &mut stream,
                "431 Request Header Fields Too Large",
                "text/plain",
                "",
            );
        }
    }
    let line = String::from_utf8_lossy(&head);
    let mut words = line.lines().next().unwrap_or("").split_whitespace();
    let (method, target) = (words.next().unwrap_or(""), words.next().unwrap_or(""));
    let path = target.split('?').next().unwrap_or("");
    match (method, path) {
        ("GET", "/metrics") => respond(&mut stream, "200 OK", CONTENT_TYPE, &render(inner)),
        ("GET", _) => respond(
            &mut stream,
            "404 Not Found",
            "text/plain",
            "pageone daemon: the metrics are at /metrics\n",
        ),
        _ => respond(&mut stream, "405 Method Not Allowed", "text/plain", ""),
    }
}

fn respond(stream: &mut TcpStream, status: &str, content_type: &str, body: &str) -> io::Result<()> {
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes())?;
    stream.write_all(body.as_bytes())?;
    stream.flush()
}

/// The metrics families of one scrape, registered in `registry`.
struct Families {
    scope_gauges: Vec<(&'static str, Family<ScopeLabels, U64Gauge>)>,
    scope_copies: Family<ScopeLabels, Counter>,
    scope_cpu: Family<ScopeLabels, F64Counter>,
    client_gauges: Vec<Family<ClientLabels, U64Gauge>>,
    client_counters: Vec<Family<ClientLabels, Counter>>,
    client_profit: Family<ClientLabels, Gauge>,
    client_cpu: Family<ClientLabels, F64Counter>,
    client_held: Family<ClientLabels, U64Gauge>,
    client_connected: Family<ClientLabels, U64Gauge>,
}

impl Families {
    fn register(r: &mut Registry) -> Self {
        let scope_gauges: Vec<_> = [
            ("clients", "Clients of the scope"),
            (
                "pages_shared",
                "Copies in the scope's store (KSM's pages_shared)",
            ),
            (
                "pages_sharing",
                "Pages of the scope's clients mapping a copy beyond the copy itself (KSM's \
                 pages_sharing)",
            ),
            ("zero_pages", "Zero pages the scope's clients released"),
            (
                "saved_bytes",
                "Memory saved: pages sharing a copy and zero pages released",
            ),
            ("store_resident_bytes", "Memory the scope's store takes"),
            (
                "noted_first_sightings",
                "Contents seen by one client, waiting for a second",
            ),
            (
                "zero_holes",
                "Slots of the scope's store left as holes (zeros, no memory) for zero pages \
                 that its clients map between copies",
            ),
        ]
        .into_iter()
        .map(|(name, help)| {
            let f = Family::<ScopeLabels, U64Gauge>::default();
            r.register(format!("scope_{name}"), help, f.clone());
            (name, f)
        })
        .collect();
        let scope_copies = Family::default();
        r.register(
            "scope_copies_made",
            "Copies made in the scope's store",
            scope_copies.clone(),
        );
        let scope_cpu = Family::default();
        r.register(
            "scope_worker_cpu_seconds",
            "CPU time of the scope's clients' engine threads",
            scope_cpu.clone(),
        );
        let client_gauges = CLIENT_GAUGES
            .iter()
            .map(|(name, help)| {
                let f = Family::<ClientLabels, U64Gauge>::default();
                r.register(format!("client_{name}"), *help, f.clone());
                f
            })
            .collect();
        let client_counters = CLIENT_COUNTERS
            .iter()
            .map(|(name, help)| {
                let f = Family::<ClientLabels, Counter>::default();
                r.register(format!("client_{name}"), *help, f.clone());
                f
            })
            .collect();
        Self {
            scope_gauges,
            scope_copies,
            scope_cpu,
            client_gauges,
            client_counters,
            client_profit: registered(
                r,
                "client_general_profit",
                "Bytes saved minus the engine's own metadata and mappings (KSM's general_profit)",
            ),
            client_cpu: registered(
                r,
                "client_worker_cpu_seconds",
                "CPU time of the client's engine threads",
            ),
            client_held: registered(
                r,
                "client_held_copies",
                "Copies of the store the client holds",
            ),
            client_connected: registered(
                r,
                "client_connected",
                "1 while the client's connection is open; 0 once it ended while its process \
                 lives (it keeps its copies until it exits)",
            ),
        }
    }

    fn scope_gauge(&self, name: &str, labels: &ScopeLabels, v: u64) {
        if let Some((_, f)) = self.scope_gauges.iter().find(|(n, _)| *n == name) {
            f.get_or_create(labels).set(v);
        }
    }

    /// Sets the metrics of one client from what the daemon knows and what it reported.
    fn client(&self, labels: &ClientLabels, c: &crate::scope::Client) {
        self.client_held
            .get_or_create(labels)
            .set(c.held.len() as u64);
        self.client_connected
            .get_or_create(labels)
            .set(u64::from(c.connected));
        let Some(r) = &c.report else {
            return;
        };
        for ((name, _), f) in CLIENT_GAUGES.iter().zip(&self.client_gauges) {
            f.get_or_create(labels).set(reported(r, name));
        }
        for ((name, _), f) in CLIENT_COUNTERS.iter().zip(&self.client_counters) {
            f.get_or_create(labels).inc_by(reported(r, name));
        }
        self.client_profit
            .get_or_create(labels)
            .set(reported_i64(r, "general_profit"));
        self.client_cpu
            .get_or_create(labels)
            .inc_by(reported(r, "worker_cpu_ns") as f64 / 1e9);
    }
}

fn registered<M>(r: &mut Registry, name: &str, help: &str) -> Family<ClientLabels, M>
where
    M: Default + prometheus_client::metrics::TypedMetric + Send + Sync + std::fmt::Debug,
    M: prometheus_client::encoding::EncodeMetric + 'static,
{
    let f = Family::<ClientLabels, M>::default();
    r.register(name, help, f.clone());
    f
}

/// A signed number a client reported (0 if it is not one).
fn reported_i64(r: &Map<String, Value>, key: &str) -> i64 {
    r.get(key).and_then(Value::as_i64).unwrap_or(0)
}

/// The daemon-wide metrics: connections, notes, its own memory and CPU, and each user's
/// account.
fn daemon_metrics(r: &mut Registry, inner: &Inner) {
    let gauge = |r: &mut Registry, name: &str, help: &str, v: u64| {
        let g = U64Gauge::default();
        g.set(v);
        r.register(name, help, g);
    };
    gauge(
        r,
        "daemon_connections",
        "Client connections open",
        inner.accounts.connections() as u64,
    );
    gauge(
        r,
        "daemon_notes",
        "Notes of first sightings, all users together",
        inner.accounts.notes() as u64,
    );
    gauge(
        r,
        "daemon_anonymous_bytes",
        "The daemon's own memory (its tables), which counts against what its scopes save",
        sys::self_status_kib("RssAnon").unwrap_or(0) * 1024,
    );
    gauge(
        r,
        "daemon_uptime_seconds",
        "Time since the daemon started",
        inner.started.elapsed().as_secs(),
    );
    let cpu = F64Counter::default();
    cpu.inc_by(sys::process_cpu_ns() as f64 / 1e9);
    r.register("daemon_cpu_seconds", "CPU time of the daemon", cpu);
    let pages = Family::<UserLabels, U64Gauge>::default();
    let conns = Family::<UserLabels, U64Gauge>::default();
    r.register(
        "user_store_pages",
        "Store pages of one user's scopes",
        pages.clone(),
    );
    r.register("user_connections", "Connections of one user", conns.clone());
    for (connections, a) in inner.accounts.users() {
        let l = UserLabels { uid: a.uid };
        pages.get_or_create(&l).set(a.pages());
        conns.get_or_create(&l).set(connections as u64);
    }
}

/// The text of one scrape.
pub(crate) fn render(inner: &Inner) -> String {
    let mut r = Registry::with_prefix("pageone");
    daemon_metrics(&mut r, inner);
    let f = Families::register(&mut r);
    let scopes: Vec<_> = lock(&inner.scopes).values().cloned().collect();
    for sc in scopes {
        let resident = sys::file_usage(std::os::fd::AsRawFd::as_raw_fd(&sc.fd)).map_or(0, |u| u.1);
        let st = lock(&sc.state);
        let t = Totals::of(&st);
        let labels = ScopeLabels {
            scope: sc.name.clone(),
            uid: sc.key.uid,
        };
        for (name, v) in [
            ("clients", st.clients.len() as u64),
            ("pages_shared", st.live),
            ("pages_sharing", t.sharing),
            ("zero_pages", t.zero),
            ("saved_bytes", t.saved_bytes()),
            ("store_resident_bytes", resident),
            ("noted_first_sightings", st.noted_entries as u64),
            ("zero_holes", st.holes),
        ] {
            f.scope_gauge(name, &labels, v);
        }
        f.scope_copies.get_or_create(&labels).inc_by(st.copies_made);
        f.scope_cpu
            .get_or_create(&labels)
            .inc_by(t.cpu_ns as f64 / 1e9);
        for (&id, c) in &st.clients {
            let l = ClientLabels {
                scope: sc.name.clone(),
                uid: sc.key.uid,
                client: id,
                pid: c.pid,
            };
            f.client(&l, c);
        }
    }
    let mut out = String::new();
    // (Writing to a String cannot fail.)
    let _ = prometheus_client::encoding::text::encode(&mut out, &r);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DaemonConfig;

    /// A daemon without clients still answers with its own metrics, in the text format (each
    /// family described, the end marked).
    #[test]
    fn a_scrape_of_an_idle_daemon_has_the_daemons_metrics() {
        let inner = Inner::new(DaemonConfig::new("/nonexistent.sock".into()), None);
        let text = render(&inner);
        assert!(
            text.contains("# TYPE pageone_daemon_connections gauge"),
            "{text}"
        );
        assert!(text.contains("pageone_daemon_connections 0"), "{text}");
        assert!(
            text.contains("# TYPE pageone_daemon_cpu_seconds counter"),
            "{text}"
        );
        // (Families without members are left out.)
        assert!(!text.contains("pageone_client_"), "{text}");
        assert!(text.trim_end().ends_with("# EOF"), "{text}");
    }

    /// Over a real socket: `/metrics` answers 200 with the text, anything else 404 or 405.
    #[test]
    fn scrapes_are_answered_over_http() {
        let inner = Arc::new(Inner::new(
            DaemonConfig::new("/nonexistent.sock".into()),
            None,
        ));
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        std::thread::spawn(move || serve(listener, inner));
        let get = |req: &str| {
            let mut s = TcpStream::connect(addr).unwrap();
            s.write_all(req.as_bytes()).unwrap();
            let mut out = String::new();
            s.read_to_string(&mut out).unwrap();
            out
        };
        let ok = get("GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
        assert!(ok.starts_with("HTTP/1.1 200 OK\r\n"), "{ok}");
        assert!(ok.contains(CONTENT_TYPE), "{ok}");
        assert!(ok.contains("pageone_daemon_uptime_seconds"), "{ok}");
        let missing = get("GET / HTTP/1.1\r\n\r\n");
        assert!(missing.starts_with("HTTP/1.1 404"), "{missing}");
        let post = get("POST /metrics HTTP/1.1\r\n\r\n");
        assert!(post.starts_with("HTTP/1.1 405"), "{post}");
    }
}
