//! Operating the daemon, with real processes: the metrics endpoint scraped over HTTP, `pageone
//! top` (plain and on a terminal), the configuration file and `--check-config`, and
//! `--max-map-count` with an engine that notices the raised limit without a restart.

use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_pageone");

/// The tests start daemons and fill memory: one at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn sock_path(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("pageone-ops-{}-{name}.sock", std::process::id()))
}

/// `pageone` without the machine's configuration file.
fn pageone() -> Command {
    let mut c = Command::new(BIN);
    c.env("PAGEONE_CONFIG", "/dev/null");
    c
}

fn wait_for(what: &str, secs: u64, mut f: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !f() {
        assert!(
            t0.elapsed() < Duration::from_secs(secs),
            "timed out: {what}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A daemon, with what it printed at start (its socket, and its metrics address if any).
struct Daemon {
    child: Child,
    lines: Vec<String>,
}

impl Daemon {
    fn start(socket: &Path, args: &[&str]) -> Self {
        let mut child = pageone()
            .args(["daemon", "--socket"])
            .arg(socket)
            .args(args)
            .stderr(Stdio::piped())
            .spawn()
            .expect("start the daemon");
        let mut err = BufReader::new(child.stderr.take().unwrap());
        let mut lines = Vec::new();
        loop {
            let mut l = String::new();
            assert!(
                err.read_line(&mut l).unwrap() > 0,
                "the daemon ended: {lines:?}"
            );
            let listening = l.contains("listening on");
            lines.push(l.trim().to_string());
            if listening {
                break;
            }
        }
        if args.contains(&"--metrics") {
            let mut l = String::new();
            err.read_line(&mut l).unwrap();
            lines.push(l.trim().to_string());
        }
        // (Whatever it logs later goes nowhere.)
        std::thread::spawn(move || std::io::copy(&mut err, &mut std::io::sink()));
        Daemon { child, lines }
    }

    /// The address in "metrics on http://ADDR/metrics".
    fn metrics_addr(&self) -> String {
        let l = self
            .lines
            .iter()
            .find(|l| l.contains("metrics on"))
            .unwrap();
        let url = l.split("http://").nth(1).unwrap();
        url.trim_end_matches("/metrics").to_string()
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A `pageone scope-client`: seed data under an engine joining the daemon at `socket` (none:
/// alone).
struct Client {
    child: Child,
    stdin: Option<ChildStdin>,
    stdout: BufReader<ChildStdout>,
}

impl Client {
    fn start(socket: Option<&Path>, scope: &str, mib: usize) -> Self {
        let mut c = pageone();
        c.args([
            "scope-client",
            "--period-ms",
            "50",
            "--mib",
            &mib.to_string(),
        ])
        .env("PAGEONE_SCOPE", scope)
        .env_remove("PAGEONE_SOCKET");
        if let Some(s) = socket {
            c.env("PAGEONE_SOCKET", s);
        }
        let mut child = c
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take();
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        stdout.read_line(&mut line).unwrap();
        assert!(line.starts_with("READY"), "{line}");
        Client {
            child,
            stdin,
            stdout,
        }
    }

    fn ask(&mut self, cmd: &str) -> String {
        let stdin = self.stdin.as_mut().unwrap();
        writeln!(stdin, "{cmd}").unwrap();
        stdin.flush().unwrap();
        let mut line = String::new();
        self.stdout.read_line(&mut line).unwrap();
        line.trim().to_string()
    }

    fn stats(&mut self) -> serde_json::Value {
        serde_json::from_str(&self.ask("STATS")).unwrap()
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn finish(mut self) {
        drop(self.stdin.take());
        assert!(self.child.wait().unwrap().success());
    }
}

fn scope_sharing(socket: &Path, scope: &str) -> u64 {
    let out = pageone()
        .args(["status", "--json", "--socket"])
        .arg(socket)
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
    v["scopes"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|s| s["scope"] == scope)
        .map_or(0, |s| s["pages_sharing"].as_u64().unwrap_or(0))
}

/// `GET path` over HTTP/1.1; the whole answer.
fn http_get(addr: &str, path: &str) -> String {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nAccept: */*\r\n\r\n"
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

/// The value of the sample whose name and labels start with `prefix` and that has `label`
/// among its labels.
fn sample(text: &str, prefix: &str, label: &str) -> Option<f64> {
    text.lines()
        .filter(|l| l.starts_with(prefix) && l.contains(label))
        .find_map(|l| l.rsplit(' ').next()?.parse().ok())
}

/// Two processes of one scope share through a daemon serving metrics: a scrape over HTTP has
/// KSM's counters per scope and per client, and pageone's own (merges, mappings, CPU).
#[test]
fn the_metrics_endpoint_is_scraped_over_http() {
    let _g = serial();
    let socket = sock_path("metrics");
    let daemon = Daemon::start(&socket, &["--metrics", "127.0.0.1:0"]);
    let addr = daemon.metrics_addr();
    assert!(addr.starts_with("127.0.0.1:"), "{addr}");
    let mut clients: Vec<Client> = (0..2)
        .map(|_| Client::start(Some(&socket), "metrics", 16))
        .collect();
    wait_for("the two clients share", 60, || {
        scope_sharing(&socket, "metrics") >= 4096
    });
    // Reports come every few periods: wait for one with the merges in it.
    std::thread::sleep(Duration::from_secs(2));
    let answer = http_get(&addr, "/metrics");
    let (head, text) = answer.split_once("\r\n\r\n").unwrap();
    assert!(head.starts_with("HTTP/1.1 200 OK"), "{head}");
    assert!(head.contains("application/openmetrics-text"), "{head}");
    let scope = "scope=\"metrics\"";
    let shared = sample(text, "pageone_scope_pages_shared{", scope).unwrap();
    let sharing = sample(text, "pageone_scope_pages_sharing{", scope).unwrap();
    assert!(shared >= 4096.0 && sharing >= 4096.0, "{text}");
    assert_eq!(sample(text, "pageone_scope_clients{", scope), Some(2.0));
    assert!(sample(text, "pageone_scope_saved_bytes{", scope).unwrap() >= 16.0 * 1048576.0);
    for c in &mut clients {
        let pid = format!("pid=\"{}\"", c.pid());
        let s = c.stats();
        let merges = sample(text, "pageone_client_merges_total{", &pid).unwrap();
        assert!(
            merges > 0.0 && merges <= s["merges"].as_f64().unwrap(),
            "{text}"
        );
        // (One client's pages are the copies, the other's share them.)
        let mapped = sample(text, "pageone_client_pages_shared{", &pid).unwrap()
            + sample(text, "pageone_client_pages_sharing{", &pid).unwrap();
        assert!(mapped >= 4096.0, "{text}");
        for gauge in ["vmas_used", "vma_limit", "registered_bytes"] {
            let v = sample(text, &format!("pageone_client_{gauge}{{"), &pid);
            assert!(v.is_some_and(|v| v > 0.0), "{gauge}: {text}");
        }
        for family in [
            "pageone_client_general_profit{",
            "pageone_client_cow_breaks_total{",
            "pageone_client_vma_limited_merges_total{",
            "pageone_client_pages_recycled_total{",
            "pageone_client_huge_pages_restored_total{",
            "pageone_client_worker_cpu_seconds_total{",
        ] {
            assert!(sample(text, family, &pid).is_some(), "{family}: {text}");
        }
    }
    assert!(sample(text, "pageone_daemon_cpu_seconds_total", "").unwrap() > 0.0);
    assert_eq!(sample(text, "pageone_daemon_connections", ""), Some(2.0));
    assert!(http_get(&addr, "/").starts_with("HTTP/1.1 404"));
    for c in clients {
        c.finish();
    }
}

/// Without `--metrics` nothing listens: the daemon opens no network socket at all.
#[test]
fn metrics_are_off_by_default() {
    let _g = serial();
    let socket = sock_path("nometrics");
    let daemon = Daemon::start(&socket, &[]);
    let fds = std::fs::read_dir(format!("/proc/{}/fd", daemon.child.id())).unwrap();
    let inodes: Vec<String> = fds
        .flatten()
        .filter_map(|e| std::fs::read_link(e.path()).ok())
        .map(|p| p.to_string_lossy().into_owned())
        .filter_map(|l| {
            l.strip_prefix("socket:[")?
                .strip_suffix(']')
                .map(String::from)
        })
        .collect();
    let tcp = std::fs::read_to_string("/proc/net/tcp").unwrap()
        + &std::fs::read_to_string("/proc/net/tcp6").unwrap_or_default();
    for inode in &inodes {
        assert!(
            !tcp.lines()
                .any(|l| l.split_whitespace().nth(9) == Some(inode)),
            "the daemon has a TCP socket"
        );
    }
    assert!(!inodes.is_empty(), "the daemon's Unix socket is listed");
}

/// `pageone top` on a pipe prints the table as lines at each refresh: the scope, its client
/// with its pid and mapping budget.
#[test]
fn top_prints_plain_lines_when_not_on_a_terminal() {
    let _g = serial();
    let socket = sock_path("top");
    let _daemon = Daemon::start(&socket, &[]);
    let mut client = Client::start(Some(&socket), "topscope", 8);
    let other = Client::start(Some(&socket), "topscope", 8);
    wait_for("pages shared", 60, || {
        scope_sharing(&socket, "topscope") > 0
    });
    let out = pageone()
        .args(["top", "--iterations", "2", "--interval", "0.3", "--socket"])
        .arg(&socket)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(text.matches("SCOPE / CLIENT").count(), 2, "{text}");
    assert!(text.contains("topscope"), "{text}");
    let pid = client.pid().to_string();
    let row = text
        .lines()
        .rev()
        .find(|l| l.trim_start().starts_with("client") && l.contains(&pid))
        .unwrap_or_else(|| panic!("no client row: {text}"));
    let limit = client.stats()["vma_limit"].as_u64().unwrap();
    assert!(row.contains(&format!("/{limit} (")), "{row}");
    assert!(
        !text.contains('\x1b'),
        "escape sequences on a pipe: {text:?}"
    );
    client.finish();
    other.finish();
}

/// On a terminal (`script` gives it one), `pageone top` draws on the alternate screen, and
/// `q` quits it, leaving the terminal as it was.
#[test]
fn top_on_a_terminal_quits_on_q() {
    let _g = serial();
    if Command::new("script").arg("--version").output().is_err() {
        eprintln!("skipped: no `script` command (util-linux) to give top a terminal");
        return;
    }
    let socket = sock_path("toptty");
    let _daemon = Daemon::start(&socket, &[]);
    let cmd = format!(
        "PAGEONE_CONFIG=/dev/null {BIN} top --interval 0.2 --socket {}",
        socket.display()
    );
    let mut script = Command::new("script")
        .args(["-q", "-e", "-c", &cmd, "/dev/null"])
        .env("TERM", "xterm")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    let mut stdin = script.stdin.take().unwrap();
    stdin.write_all(b"q").unwrap();
    stdin.flush().unwrap();
    let t0 = Instant::now();
    let status = loop {
        if let Some(s) = script.try_wait().unwrap() {
            break s;
        }
        if t0.elapsed() > Duration::from_secs(5) {
            let _ = script.kill();
            panic!("top did not quit on q");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    drop(stdin);
    let mut screen = String::new();
    script
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut screen)
        .unwrap();
    assert!(status.success(), "{status}: {screen:?}");
    assert!(screen.contains("SCOPE / CLIENT"), "{screen:?}");
    // The alternate screen, entered and left.
    assert!(
        screen.contains("\x1b[?1049h") && screen.contains("\x1b[?1049l"),
        "{screen:?}"
    );
}

/// `--check-config` prints the settings in force (flags over the file), and names what is
/// wrong in a bad file.
#[test]
fn check_config_reads_the_file_and_the_flags() {
    let dir = std::env::temp_dir().join(format!("pageone-ops-config-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("pageone.toml");
    std::fs::write(
        &file,
        "socket = \"/run/x/pageone.sock\"\n[daemon]\nscope-by = \"cgroup\"\nmetrics = \
         \"127.0.0.1:9464\"\npriority = \"idle\"\n[daemon.limits]\nnotes = 99\n[run]\nscope = \
         \"vms\"\npriority = \"normal\"\n",
    )
    .unwrap();
    let out = Command::new(BIN)
        .args([
            "daemon",
            "--check-config",
            "--limit",
            "connections=5",
            "--config",
        ])
        .arg(&file)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    for want in [
        "socket = \"/run/x/pageone.sock\"",
        "scope-by = \"cgroup\"",
        "metrics = \"127.0.0.1:9464\"",
        "notes = 99",
        "connections = 5",
        "scope = \"vms\"",
        "priority = \"idle\"",
        "priority = \"normal\"",
    ] {
        assert!(text.contains(want), "{want}: {text}");
    }
    std::fs::write(&file, "[run]\npriority = \"fast\"\n").unwrap();
    let out = Command::new(BIN)
        .args(["daemon", "--check-config", "--config"])
        .arg(&file)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("auto, idle or normal") && err.contains("fast"),
        "{err}"
    );
    std::fs::write(
        &file,
        "[daemon]\nmetrics = \"127.0.0.1:9464\"\nworkerz = 2\n",
    )
    .unwrap();
    let out = Command::new(BIN)
        .env("PAGEONE_CONFIG", &file)
        .args(["daemon", "--check-config"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains(&file.display().to_string()), "{err}");
    assert!(err.contains("workerz") && err.contains("line 3"), "{err}");
    let missing = Command::new(BIN)
        .args([
            "daemon",
            "--check-config",
            "--config",
            "/nonexistent/pageone.toml",
        ])
        .output()
        .unwrap();
    assert!(!missing.status.success());
    assert!(String::from_utf8_lossy(&missing.stderr).contains("could not read"));
    let _ = std::fs::remove_dir_all(&dir);
}

/// Restores `vm.max_map_count` when dropped.
struct MapCount(u64);

impl Drop for MapCount {
    fn drop(&mut self) {
        let _ = std::fs::write("/proc/sys/vm/max_map_count", format!("{}\n", self.0));
    }
}

fn max_map_count() -> u64 {
    let s = std::fs::read_to_string("/proc/sys/vm/max_map_count").unwrap();
    s.trim().parse().unwrap()
}

/// `pageone daemon --max-map-count N` raises the limit when it is lower (never lowers it), and
/// a running engine uses the raised limit from its next period, without a restart.
#[test]
fn a_raised_map_count_reaches_running_engines() {
    let _g = serial();
    let old = max_map_count();
    if std::fs::write("/proc/sys/vm/max_map_count", format!("{old}\n")).is_err() {
        eprintln!("skipped: vm.max_map_count is not writable (needs root)");
        return;
    }
    let _restore = MapCount(old);
    let mut engine = Client::start(None, "alone", 4);
    assert_eq!(engine.ask("KICK"), "KICKED");
    assert_eq!(engine.stats()["vma_limit"].as_u64(), Some(old));
    // Lower than now: left as it is.
    let socket = sock_path("mapcount");
    let lower = Daemon::start(&socket, &["--max-map-count", &(old - 1).to_string()]);
    assert_eq!(max_map_count(), old, "{:?}", lower.lines);
    drop(lower);
    let raised = old + 4096;
    let daemon = Daemon::start(&socket, &["--max-map-count", &raised.to_string()]);
    assert_eq!(max_map_count(), raised);
    assert!(
        daemon
            .lines
            .iter()
            .any(|l| l.contains(&format!("from {old} to {raised}"))),
        "{:?}",
        daemon.lines
    );
    // (The first period waited for may have begun before the limit was raised.)
    assert_eq!(engine.ask("KICK"), "KICKED");
    assert_eq!(engine.ask("KICK"), "KICKED");
    assert_eq!(engine.stats()["vma_limit"].as_u64(), Some(raised));
    engine.finish();
}
