//! `pageone daemon`: its options (flags over the configuration file), `--check-config`, and
//! raising `vm.max_map_count` before serving.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use pageone_daemon::{Daemon, DaemonConfig, Limits, ScopeBy};
use pageone_engine::proto;
use pageone_sys as sys;

use crate::config::Loaded;
use crate::scope::socket_or_default;

/// Options of `pageone daemon`. Each has a key in the configuration file; a flag wins over it.
#[derive(clap::Args)]
pub struct DaemonOptions {
    /// Socket path [config: socket; default: $PAGEONE_SOCKET, else $XDG_RUNTIME_DIR/pageone.sock,
    /// else /run/pageone/pageone.sock for root and the `pageone` user]. Its directory must be
    /// reachable without symbolic links and writable only by root or this user (or sticky); the
    /// socket is 0666 for root and the `pageone` user (every local user may connect; scopes and
    /// caps are per user), 0600 otherwise.
    #[arg(long)]
    pub socket: Option<PathBuf>,
    /// Exit when the last client has left (a private daemon of one process tree).
    #[arg(long)]
    pub exit_when_idle: bool,
    /// What keeps scopes apart besides their names [config: daemon.scope-by; default: uid]:
    /// `uid`, or `cgroup` (uid and cgroups, so that same-user processes of different cgroups,
    /// e.g. guests of different tenants under one libvirt user, never share).
    #[arg(long)]
    pub scope_by: Option<ScopeBy>,
    /// A cap, as NAME=VALUE (repeatable) [config: [daemon.limits] NAME = VALUE]. Names:
    /// connections, connections-per-uid, pages-per-uid, pages-per-client, notes, notes-per-uid,
    /// notes-per-client, report-bytes, in-flight-per-uid, hello-timeout-ms, idle-timeout-ms,
    /// frame-timeout-ms.
    #[arg(long = "limit", value_name = "NAME=VALUE")]
    pub limits: Vec<String>,
    /// Serve metrics over HTTP at ADDR (`GET /metrics`, Prometheus text format) [config:
    /// daemon.metrics; default: off]. They show every user's scopes, client pids and counters
    /// to whoever reaches ADDR: use a loopback address (127.0.0.1:9464) or a network only the
    /// monitoring reaches. Port 0 picks a free port (printed at start).
    #[arg(long, value_name = "ADDR")]
    pub metrics: Option<SocketAddr>,
    /// Raise vm.max_map_count to N first if it is lower (root) [config: daemon.max-map-count].
    /// The engine reads the limit every period, so running processes merge more at once.
    #[arg(long, value_name = "N")]
    pub max_map_count: Option<u64>,
    /// How the threads serving clients are scheduled: `auto` (idle priority, but normal for a
    /// while when busy threads starve them while memory is short), `idle` (spare CPU only) or
    /// `normal` [config: daemon.priority; default: $PAGEONE_PRIORITY, else auto].
    #[arg(long)]
    pub priority: Option<pageone_engine::Priority>,
    /// Check the configuration (the file and these flags), print the settings in force, and
    /// exit.
    #[arg(long)]
    pub check_config: bool,
}

/// What the daemon runs with, from the defaults, the file, then the flags.
struct Settings {
    config: DaemonConfig,
    max_map_count: Option<u64>,
}

fn settings(o: &DaemonOptions, loaded: &Loaded) -> Result<Settings> {
    let file = &loaded.file;
    let socket = socket_or_default(o.socket.clone(), loaded)?;
    let mut config = DaemonConfig::new(socket);
    config.exit_when_idle = o.exit_when_idle;
    config.scope_by = o
        .scope_by
        .or(file.daemon.scope_by.map(|s| s.0))
        .unwrap_or_default();
    for (name, value) in &file.daemon.limits {
        config
            .limits
            .set(name, &value.to_string())
            .map_err(|e| anyhow::anyhow!("{}: [daemon.limits] {e}", loaded.origin()))?;
    }
    for l in &o.limits {
        let Some((name, value)) = l.split_once('=') else {
            bail!("a limit is NAME=VALUE, not {l:?}");
        };
        config.limits.set(name, value).map_err(anyhow::Error::msg)?;
    }
    config.metrics = o.metrics.or(file.daemon.metrics);
    config.priority = match o.priority.or(file.daemon.priority.map(|p| p.0)) {
        Some(p) => p,
        None => match proto::setting("PAGEONE_PRIORITY") {
            Some(v) => v
                .to_string_lossy()
                .parse()
                .map_err(|e| anyhow::anyhow!("PAGEONE_PRIORITY: {e}"))?,
            None => pageone_engine::Priority::default(),
        },
    };
    Ok(Settings {
        config,
        max_map_count: o.max_map_count.or(file.daemon.max_map_count),
    })
}

pub fn run(o: DaemonOptions, loaded: &Loaded) -> Result<()> {
    let s = settings(&o, loaded)?;
    if o.check_config {
        // (Printed for a reader, who may leave early: see `main`.)
        sys::default_sigpipe()?;
        print_settings(&s, loaded);
        return Ok(());
    }
    if let Some(n) = s.max_map_count {
        raise_max_map_count(n)?;
    }
    // The daemon's tables grow and shrink with what its clients note and share: big ones get
    // their own mappings so that shrinking them gives the memory back.
    pageone_sys::set_heap_mmap_threshold(128 << 10);
    let d = Daemon::bind(s.config)?;
    eprintln!("pageone daemon listening on {}", d.socket().display());
    if let Some(addr) = d.metrics_addr() {
        eprintln!("pageone daemon metrics on http://{addr}/metrics");
    }
    d.run().context("the daemon stopped serving")
}

/// Raises `vm.max_map_count` to `n` when it is lower (never lowers it).
fn raise_max_map_count(n: u64) -> Result<()> {
    let now = sys::max_map_count().context("could not read vm.max_map_count")? as u64;
    if now >= n {
        eprintln!("pageone daemon: vm.max_map_count is {now}, at least {n} already");
        return Ok(());
    }
    sys::set_max_map_count(n as usize).with_context(|| {
        format!(
            "could not raise vm.max_map_count from {now} to {n} (it takes root; or install \
             contrib/60-pageone.conf in /etc/sysctl.d and run `sysctl --system`)"
        )
    })?;
    eprintln!("pageone daemon raised vm.max_map_count from {now} to {n}");
    Ok(())
}

/// `--check-config`: the settings in force, in the file's terms.
fn print_settings(s: &Settings, loaded: &Loaded) {
    let c = &s.config;
    println!("# configuration OK: {}", loaded.origin());
    println!("socket = {:?}", c.socket.display().to_string());
    println!("[daemon]");
    println!("scope-by = \"{}\"", c.scope_by);
    match c.metrics {
        Some(a) => println!("metrics = \"{a}\""),
        None => println!("# metrics: off"),
    }
    match s.max_map_count {
        Some(n) => println!("max-map-count = {n}"),
        None => println!("# max-map-count: left as it is"),
    }
    println!("priority = \"{}\"", c.priority);
    println!("[daemon.limits]");
    for (name, value) in limit_values(&c.limits) {
        println!("{name} = {value}");
    }
    let run = &loaded.file.run;
    println!("[run]");
    match &run.scope {
        Some(scope) => println!("scope = {scope:?}"),
        None => println!("# scope: $PAGEONE_SCOPE, else \"default\""),
    }
    match run.period_ms {
        Some(p) => println!("period-ms = {}", p.0),
        None => println!("# period-ms: the engine's default"),
    }
    match run.priority {
        Some(p) => println!("priority = \"{}\"", p.0),
        None => println!("# priority: $PAGEONE_PRIORITY, else auto"),
    }
}

/// Each cap by its name in [`Limits::NAMES`].
fn limit_values(l: &Limits) -> Vec<(&'static str, u128)> {
    let ms = |d: std::time::Duration| d.as_millis();
    Limits::NAMES
        .iter()
        .map(|(name, _)| {
            let v: u128 = match *name {
                "connections" => l.connections as u128,
                "connections-per-uid" => l.connections_per_uid as u128,
                "pages-per-uid" => l.pages_per_uid as u128,
                "pages-per-client" => l.pages_per_client as u128,
                "notes" => l.notes as u128,
                "notes-per-uid" => l.notes_per_uid as u128,
                "notes-per-client" => l.notes_per_client as u128,
                "report-bytes" => l.report_bytes as u128,
                "in-flight-per-uid" => l.in_flight_per_uid as u128,
                "hello-timeout-ms" => ms(l.hello_timeout),
                "idle-timeout-ms" => ms(l.idle_timeout),
                "frame-timeout-ms" => ms(l.frame_timeout),
                _ => 0,
            };
            (*name, v)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cmd {
        #[command(flatten)]
        o: DaemonOptions,
    }

    fn loaded(text: &str) -> Loaded {
        Loaded {
            path: Some("test.toml".into()),
            file: crate::config::parse(text).unwrap(),
        }
    }

    /// The file's values apply, and a flag wins over the file's key.
    #[test]
    fn flags_win_over_the_file() {
        let file = loaded(
            "socket = \"/tmp/a.sock\"\n[daemon]\nscope-by = \"cgroup\"\nmetrics = \
             \"127.0.0.1:9464\"\n[daemon.limits]\nnotes = 7\nconnections = 9\n",
        );
        let o = Cmd::parse_from(["d", "--limit", "notes=8"]).o;
        let s = settings(&o, &file).unwrap();
        assert_eq!(s.config.socket, PathBuf::from("/tmp/a.sock"));
        assert_eq!(s.config.scope_by, ScopeBy::Cgroup);
        assert_eq!(s.config.metrics.unwrap().port(), 9464);
        assert_eq!((s.config.limits.notes, s.config.limits.connections), (8, 9));
        let o = Cmd::parse_from([
            "d",
            "--socket",
            "/tmp/b.sock",
            "--scope-by",
            "uid",
            "--metrics",
            "127.0.0.1:1",
        ])
        .o;
        let s = settings(&o, &file).unwrap();
        assert_eq!(s.config.socket, PathBuf::from("/tmp/b.sock"));
        assert_eq!(s.config.scope_by, ScopeBy::Uid);
        assert_eq!(s.config.metrics.unwrap().port(), 1);
    }

    /// A limit the daemon does not have is an error naming the file, the table and the key.
    #[test]
    fn an_unknown_limit_in_the_file_names_it() {
        let file = loaded("socket = \"/tmp/a.sock\"\n[daemon.limits]\npages-per-user = 1\n");
        let o = Cmd::parse_from(["d"]).o;
        let e = settings(&o, &file).err().unwrap().to_string();
        assert!(e.contains("test.toml: [daemon.limits]"), "{e}");
        assert!(e.contains("pages-per-user"), "{e}");
    }
}
