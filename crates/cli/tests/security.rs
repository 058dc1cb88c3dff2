//! A daemon tenants can share: clients of other users cannot write the store, both ends are
//! authenticated, every tenant is bounded, nothing leaks, and scopes can be kept apart by cgroup.
//! Unprivileged clients run as `nobody` (these tests run as root, like the kernel tests).

use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use pageone_engine::proto::{self, Reply, Request};

const BIN: &str = env!("CARGO_BIN_EXE_pageone");
const NOBODY: u32 = 65534;

/// The tests start daemons and fill memory: one at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn is_root() -> bool {
    pageone_sys::euid() == 0
}

/// A scratch directory of root's (removed when dropped).
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Self {
        let p = std::env::temp_dir().join(format!("pageone-sec-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir(&p).unwrap();
        Scratch(p)
    }
    /// Given to `nobody`, mode 0700.
    fn nobodys(name: &str) -> Self {
        let s = Self::new(name);
        std::os::unix::fs::chown(&s.0, Some(NOBODY), Some(NOBODY)).unwrap();
        std::fs::set_permissions(&s.0, std::fs::Permissions::from_mode(0o700)).unwrap();
        s
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn sock_path(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("pageone-sec-{}-{name}.sock", std::process::id()))
}

/// A `pageone` command run as `nobody` (no supplementary groups).
fn as_nobody(cmd: &mut Command) -> &mut Command {
    cmd.uid(NOBODY).gid(NOBODY).env_remove("XDG_RUNTIME_DIR")
}

/// A daemon, killed and its socket removed when dropped.
struct Daemon(Child, PathBuf);

impl Daemon {
    fn start_with(path: &Path, args: &[&str], nobody: bool) -> Self {
        let mut c = Command::new(BIN);
        c.args(["daemon", "--socket"]).arg(path).args(args);
        if nobody {
            as_nobody(&mut c);
        }
        let child = c.stderr(Stdio::null()).spawn().expect("start the daemon");
        let t0 = Instant::now();
        while UnixStream::connect(path).is_err() {
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "daemon never listened"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        Daemon(child, path.to_path_buf())
    }
    fn start(path: &Path, args: &[&str]) -> Self {
        Self::start_with(path, args, false)
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
        let _ = std::fs::remove_file(&self.1);
    }
}

struct Client {
    child: Child,
    stdin: Option<ChildStdin>,
    stdout: BufReader<ChildStdout>,
}

impl Client {
    /// `mib` MiB of seed data (identical across clients, unique within), in `scope`.
    fn start(cmd: &mut Command, path: &Path, scope: &str, mib: usize) -> Self {
        let mut child = cmd
            .args(["scope-client", "--period-ms", "50", "--mib"])
            .arg(mib.to_string())
            .env("PAGEONE_SOCKET", path)
            .env("PAGEONE_SCOPE", scope)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("start a client");
        let stdin = child.stdin.take();
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        stdout.read_line(&mut line).unwrap();
        assert!(line.starts_with("READY"), "client said {line:?}");
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
    fn finish(mut self) {
        assert_eq!(self.ask("VERIFY"), "OK", "a client lost data");
        drop(self.stdin.take());
        assert!(self.child.wait().unwrap().success());
    }
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

fn status_as(path: &Path, nobody: bool) -> serde_json::Value {
    let mut c = Command::new(BIN);
    c.args(["status", "--json", "--socket"]).arg(path);
    if nobody {
        as_nobody(&mut c);
    }
    let out = c.output().unwrap();
    assert!(out.status.success(), "status failed: {out:?}");
    serde_json::from_slice(&out.stdout).unwrap()
}

fn scope<'a>(st: &'a serde_json::Value, name: &str) -> Option<&'a serde_json::Value> {
    st["scopes"]
        .as_array()?
        .iter()
        .find(|s| s["scope"].as_str() == Some(name))
}

/// Runs `pageone scope-probe WHAT` as `nobody` and returns what it printed.
fn probe(what: &str, path: &Path, extra: &[&str]) -> serde_json::Value {
    let out = as_nobody(Command::new(BIN).args(["scope-probe", what, "--socket"]))
        .arg(path)
        .args(extra)
        .output()
        .unwrap();
    assert!(out.status.success(), "probe {what} failed: {out:?}");
    serde_json::from_slice(&out.stdout).unwrap()
}

/// Item 1: a client of another user, holding the store a root daemon handed it, cannot change
/// it by any route: reopening it writable, changing its mode, truncating, punching, writing, a
/// writable shared mapping, a write seal.
#[test]
fn a_client_of_another_user_cannot_write_the_store() {
    assert!(
        is_root(),
        "these tests run as root (they start clients as nobody)"
    );
    let _g = serial();
    let path = sock_path("store");
    let _d = Daemon::start(&path, &[]);
    let v = probe("store", &path, &[]);
    println!("{v:#}");
    assert_eq!(v["client_check"], "ok", "{v}");
    for route in [
        "reopen_read_write",
        "reopen_write_only",
        "fchmod",
        "ftruncate",
        "fallocate_punch_hole",
        "pwrite",
        "mmap_shared_writable",
        "add_seal_write",
    ] {
        let got = v[route].as_str().unwrap_or("missing");
        assert!(got.starts_with("refused"), "{route}: {got}");
    }
}

/// Item 2: a daemon of another user is no daemon to an engine, nor is one that hands out a
/// store others could write; the engine runs alone.
#[test]
fn an_engine_joins_only_a_daemon_it_trusts_with_a_store_nobody_else_writes() {
    let _g = serial();
    // `pageone daemon` run by nobody, in nobody's directory.
    let dir = Scratch::nobodys("untrusted");
    let path = dir.0.join("pageone.sock");
    let _d = Daemon::start_with(&path, &[], true);
    let alone = |path: &Path| {
        let e = pageone_engine::Engine::builder()
            .daemon(Some(path.to_path_buf()))
            .build()
            .unwrap();
        let s = e.stats().daemon;
        e.shutdown();
        s
    };
    assert_eq!(alone(&path), pageone_engine::DaemonLink::Unreachable);
    // A daemon of root's (trusted) that hands out a writable, unsealed store.
    let fake = sock_path("writable-store");
    let _ = std::fs::remove_file(&fake);
    let listener = std::os::unix::net::UnixListener::bind(&fake).unwrap();
    let server = std::thread::spawn(move || {
        let (s, _) = listener.accept().unwrap();
        let (_, pipe) = proto::read_frame(&s).unwrap();
        assert!(pipe.is_some());
        let store = pageone_sys::memfd_create(c"writable").unwrap();
        use std::os::fd::AsRawFd;
        pageone_sys::ftruncate(store.as_raw_fd(), 16 * 4096).unwrap();
        let welcome = Reply::Welcome {
            capacity: 16,
            client: 1,
            scope: "x".into(),
        };
        proto::write_frame(&s, &welcome.encode(), Some(&store)).unwrap();
        // The client hangs up instead of asking anything.
        proto::read_frame(&s).is_err()
    });
    assert_eq!(alone(&fake), pageone_engine::DaemonLink::Unreachable);
    assert!(server.join().unwrap(), "the client went on with the store");
    let _ = std::fs::remove_file(&fake);
}

/// Item 2: without `$XDG_RUNTIME_DIR` a user other than root has no default socket (formerly
/// `/tmp/pageone-UID.sock`, which anyone could bind first): status and daemon say so.
#[test]
fn without_a_runtime_directory_there_is_no_default_socket() {
    for args in [&["status"][..], &["daemon"][..]] {
        let out = as_nobody(&mut Command::new(BIN))
            .args(args)
            .env_remove("PAGEONE_SOCKET")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(err.contains("XDG_RUNTIME_DIR"), "{args:?}: {err}");
    }
}

/// Item 2: `pageone run`'s private daemon listens in a fresh directory of mode 0700 (formerly
/// `$TMPDIR/pageone-run-PID.sock`, a predictable name in a shared directory), gone afterwards.
#[test]
fn pageone_run_keeps_its_private_daemon_in_a_fresh_0700_directory() {
    let _g = serial();
    let dir = PathBuf::from(BIN).parent().unwrap().to_path_buf();
    let mut c = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    c.args(["build", "-p", "pageone-preload"]);
    if dir.ends_with("release") {
        c.arg("--release");
    }
    assert!(c.status().unwrap().success(), "building the shim failed");
    let out = Command::new(BIN)
        .args(["run", "--", "sh", "-c"])
        .arg(r#"d=$(dirname "$PAGEONE_SOCKET"); echo "$PAGEONE_SOCKET"; stat -c '%a %u' "$d""#)
        .env_remove("PAGEONE_SOCKET")
        .env_remove("XDG_RUNTIME_DIR")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    let mut lines = text.lines();
    let socket = PathBuf::from(lines.next().unwrap());
    assert_eq!(lines.next(), Some("700 0"), "{text}");
    let parent = socket.parent().unwrap();
    assert_ne!(parent, std::env::temp_dir(), "{text}");
    assert!(!parent.exists(), "the private directory stayed");
}

/// Item 4: `status` shows a user only its own scopes (root sees all); a per-user daemon's
/// socket is 0600, a root daemon's 0666.
#[test]
fn status_shows_a_user_only_their_own_scopes() {
    let _g = serial();
    let path = sock_path("status");
    let _d = Daemon::start(&path, &[]);
    assert_eq!(std::fs::metadata(&path).unwrap().mode() & 0o777, 0o666);
    // A client of root's in scope "mine".
    let s = UnixStream::connect(&path).unwrap();
    let (pipe, _w) = pageone_sys::pipe().unwrap();
    let hello = Request::Hello {
        version: proto::VERSION,
        scope: "mine".into(),
    };
    assert!(matches!(
        proto::call(&s, &hello, Some(&pipe)).unwrap().0,
        Reply::Welcome { .. }
    ));
    let root_view = status_as(&path, false);
    assert!(scope(&root_view, "mine").is_some(), "{root_view}");
    let nobodys_view = status_as(&path, true);
    assert_eq!(
        nobodys_view["scopes"],
        serde_json::json!([]),
        "{nobodys_view}"
    );
    let users = nobodys_view["users"].as_array().unwrap();
    assert!(users.iter().all(|u| u["uid"] == NOBODY), "{nobodys_view}");
    assert!(nobodys_view.get("anonymous_bytes").is_none());
    drop(s);
    // A daemon of nobody's own: its socket is nobody's alone.
    let dir = Scratch::nobodys("own");
    let own = dir.0.join("pageone.sock");
    let _n = Daemon::start_with(&own, &[], true);
    let meta = std::fs::metadata(&own).unwrap();
    assert_eq!((meta.mode() & 0o777, meta.uid()), (0o600, NOBODY));
}

/// Item 4: a daemon binds only in a directory reached without symbolic links and not another
/// user's, and replaces nothing but a stale socket of its own.
#[test]
fn the_socket_is_never_made_through_a_link_or_in_anothers_directory() {
    let _g = serial();
    let base = Scratch::new("places");
    std::fs::create_dir(base.0.join("real")).unwrap();
    std::os::unix::fs::symlink(base.0.join("real"), base.0.join("link")).unwrap();
    let fails = |socket: &Path, what: &str| {
        let out = Command::new(BIN)
            .args(["daemon", "--socket"])
            .arg(socket)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "bound {}", socket.display());
        assert!(err.contains(what), "{}: {err}", socket.display());
    };
    fails(&base.0.join("link/pageone.sock"), "symbolic link");
    assert!(!base.0.join("real/pageone.sock").exists());
    // A link where the socket goes: left alone, its target not made.
    std::os::unix::fs::symlink(base.0.join("elsewhere"), base.0.join("real/pageone.sock")).unwrap();
    fails(
        &base.0.join("real/pageone.sock"),
        "something else than a socket",
    );
    assert!(!base.0.join("elsewhere").exists());
    // Another user's directory.
    let theirs = Scratch::nobodys("theirs");
    fails(&theirs.0.join("pageone.sock"), "belongs to uid 65534");
    // Writable by all, not sticky.
    std::fs::create_dir(base.0.join("open")).unwrap();
    std::fs::set_permissions(base.0.join("open"), std::fs::Permissions::from_mode(0o777)).unwrap();
    fails(&base.0.join("open/pageone.sock"), "written by others");
}

/// Item 4: a set-user-ID program takes no `PAGEONE_*` setting from its caller's environment.
#[test]
fn a_set_user_id_program_ignores_pageone_variables() {
    let _g = serial();
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("setuid");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    let exe = dir.join("pageone");
    std::fs::copy(BIN, &exe).unwrap();
    let env_seen = |setuid: bool| {
        let mode = if setuid { 0o4755 } else { 0o755 };
        std::fs::set_permissions(&exe, std::fs::Permissions::from_mode(mode)).unwrap();
        let out = as_nobody(&mut Command::new(&exe))
            .args(["scope-probe", "env"])
            .env("PAGEONE_SOCKET", "/somewhere/chosen.sock")
            .env("PAGEONE_SCOPE", "chosen")
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()
    };
    let plain = env_seen(false);
    assert_eq!(plain["secure"], false);
    assert_eq!(plain["daemon"], "/somewhere/chosen.sock");
    let setuid = env_seen(true);
    assert_eq!(setuid["secure"], true, "{setuid}");
    assert_eq!(setuid["daemon"], serde_json::Value::Null, "{setuid}");
    assert_eq!(setuid["scope"], "default", "{setuid}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Item 3: an engine over its user's store-page cap merges what fits, stays joined and keeps
/// every byte; the store holds no more than the cap.
#[test]
fn an_engine_over_its_page_cap_merges_less_and_stays_correct() {
    let _g = serial();
    let path = sock_path("capped");
    let cap = 1024u64;
    let limit = format!("pages-per-uid={cap}");
    let _d = Daemon::start(&path, &["--limit", &limit]);
    let pages = 2048u64; // 8 MiB each, identical across the two clients
    let mut a = Client::start(&mut Command::new(BIN), &path, "capped", 8);
    let mut b = Client::start(&mut Command::new(BIN), &path, "capped", 8);
    wait_for("merging reached the cap", 60, || {
        let st = status_as(&path, false);
        scope(&st, "capped").is_some_and(|s| s["pages_shared"].as_u64() >= Some(cap * 3 / 4))
    });
    // Several periods more: copies stay refused, nothing else changes.
    for c in [&mut a, &mut b] {
        c.ask("KICK");
        c.ask("KICK");
    }
    let st = status_as(&path, false);
    let sc = scope(&st, "capped").unwrap();
    assert!(sc["store_pages_in_use"].as_u64().unwrap() <= cap, "{sc}");
    assert!(sc["pages_shared"].as_u64().unwrap() < pages, "{sc}");
    for c in [&mut a, &mut b] {
        let s = c.stats();
        assert_eq!(s["daemon"], "connected", "{s}");
        assert!(s["pages_shared"].as_u64().unwrap() <= cap, "{s}");
    }
    a.finish();
    b.finish();
}

/// Item 3 (and the saturating sums of item 4): a client of another user that takes every
/// connection it may, vacates every slot of its scope next to a holder, floods lookups, fills
/// the store with copies, lies about counts and reports, stalls in the middle of a frame, idles, stops reading and reopens its store, next
/// to two honest engines: each of the hostile's moves meets a cap or a timeout, and the honest
/// ones still merge everything, with their lookups answered within a bound.
#[test]
fn a_hostile_client_is_bounded_and_honest_ones_keep_merging() {
    let _g = serial();
    let path = sock_path("hostile");
    let limits = [
        "connections-per-uid=8",
        "pages-per-uid=4096",
        "pages-per-client=3000",
        "notes-per-uid=100000",
        "notes-per-client=60000",
        "report-bytes=4096",
        "in-flight-per-uid=2",
        "frame-timeout-ms=3000",
        "hello-timeout-ms=3000",
    ];
    let args: Vec<&str> = limits.iter().flat_map(|l| ["--limit", *l]).collect();
    let _d = Daemon::start(&path, &args);
    let hostile = as_nobody(Command::new(BIN).args(["scope-probe", "hostile", "--socket"]))
        .arg(&path)
        .args(["--seconds", "15"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_secs(1));
    // Root's lookups and nobody's usage, watched meanwhile.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watcher = {
        let (path, stop) = (path.clone(), stop.clone());
        std::thread::spawn(move || watch(&path, &stop))
    };
    let pages = 2048u64;
    let mut honest: Vec<Client> = (0..2)
        .map(|_| Client::start(&mut Command::new(BIN), &path, "honest", 8))
        .collect();
    wait_for("both honest clients merged every page", 90, || {
        honest
            .iter_mut()
            .all(|c| c.stats()["pages_shared"].as_u64() == Some(pages))
    });
    let st = status_as(&path, false);
    let sc = scope(&st, "honest").unwrap();
    assert_eq!(sc["pages_shared"].as_u64(), Some(pages), "{sc}");
    let out = hostile.wait_with_output().unwrap();
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let (worst_lookup, most_pages, most_notes) = watcher.join().unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    println!("{v:#}\nworst root lookup {worst_lookup:?}, nobody's most {most_pages} pages, {most_notes} notes");
    assert!(out.status.success());
    assert!(worst_lookup < Duration::from_secs(2), "{worst_lookup:?}");
    assert!(most_pages <= 4096 && most_notes <= 100000);
    hostile_was_bounded(&v);
    for c in honest {
        c.finish();
    }
}

/// What the hostile probe met: each move bounded.
fn hostile_was_bounded(v: &serde_json::Value) {
    assert_eq!(v["connections"]["held"], 8, "{v}");
    assert!(v["connections"]["refused"].is_string(), "{v}");
    assert!(v["copies"]["over_cap"].as_u64() > Some(0), "{v}");
    assert!(v["copies"]["pages"].as_u64() <= Some(4096), "{v}");
    assert!(v["lookups"]["answered"].as_u64() > Some(0), "{v}");
    for (what, bound) in [("stall", 3000), ("idle", 3000)] {
        let ms = v[what]["closed_after_ms"].as_u64().unwrap_or(u64::MAX);
        assert!(ms < bound + 3000, "{what}: {v}");
    }
    assert_eq!(v["no_reading"]["closed"], true, "{v}");
    assert_eq!(v["lies"]["short_copy_failed"], true, "{v}");
    assert_eq!(v["lies"]["big_report"], "over cap", "{v}");
    assert_eq!(v["lies"]["status_after_lies"], true, "{v}");
    let vac = &v["vacates"];
    assert_eq!(vac["every_slot"], "Ok(Ok)", "{v}");
    assert_eq!(vac["holders_copies_kept"], true, "{v}");
    assert_eq!(vac["own"], "Ok(Ok)", "{v}");
    assert_eq!(vac["own_emptied"], true, "{v}");
    assert_eq!(vac["own_other_kept"], true, "{v}");
    // Only the hole is held (twice asked, held once); copies and slots out of the store are not.
    let holes = &v["holes"];
    let (asked, held) = (&holes["asked"], &holes["held"]);
    let failed = serde_json::json!(pageone_engine::proto::FAILED);
    let want = serde_json::json!([failed, asked[1], failed, asked[1], failed, failed]);
    assert_eq!(held, &want, "{v}");
    assert_eq!(holes["over_cap"], "over cap", "{v}");
    assert_eq!(holes["copies_kept"], true, "{v}");
    assert_eq!(holes["hole_reused_while_held"], false, "{v}");
    assert_eq!(holes["hole_reads_zeros"], true, "{v}");
    assert!(
        v["reopen_read_write"]
            .as_str()
            .unwrap()
            .starts_with("refused"),
        "{v}"
    );
}

/// Until `stop`: root's lookups in a scope of its own, timed, and nobody's usage by `status`.
/// Returns the slowest lookup and nobody's most store pages and notes seen.
fn watch(path: &Path, stop: &std::sync::atomic::AtomicBool) -> (Duration, u64, u64) {
    let s = UnixStream::connect(path).unwrap();
    let (pipe, _w) = pageone_sys::pipe().unwrap();
    let hello = Request::Hello {
        version: proto::VERSION,
        scope: "latency".into(),
    };
    proto::call(&s, &hello, Some(&pipe)).unwrap();
    let (mut worst, mut pages, mut notes) = (Duration::ZERO, 0, 0);
    let mut k = 0u128;
    while !stop.load(std::sync::atomic::Ordering::SeqCst) {
        let hs: Vec<u128> = (0..1024).map(|i| k << 32 | i).collect();
        k += 1;
        let t0 = Instant::now();
        proto::call(&s, &Request::Lookup(hs), None).unwrap();
        worst = worst.max(t0.elapsed());
        let st = status_as(path, false);
        for u in st["users"].as_array().unwrap() {
            if u["uid"] == NOBODY {
                pages = pages.max(u["store_pages"].as_u64().unwrap());
                notes = notes.max(u["notes"].as_u64().unwrap());
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    (worst, pages, notes)
}

/// The cgroup v2 hierarchy's mount point, if this machine has one this test may change.
fn cgroup2_root() -> Option<PathBuf> {
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    let line = mounts.lines().find(|l| l.contains(" - cgroup2 "))?;
    let p = PathBuf::from(line.split(' ').nth(4)?);
    std::fs::metadata(p.join("cgroup.procs")).ok()?;
    Some(p)
}

/// Item 5: with `--scope-by cgroup`, same-user processes of different cgroups asking for the
/// same scope do not share; processes of one cgroup do.
#[test]
fn scopes_can_be_kept_apart_by_cgroup() {
    let _g = serial();
    let root = cgroup2_root().expect("a cgroup v2 hierarchy (this test moves clients into two)");
    let groups: Vec<PathBuf> = ["a", "b"]
        .iter()
        .map(|g| root.join(format!("pageone-test-{}-{g}", std::process::id())))
        .collect();
    for g in &groups {
        std::fs::create_dir(g).unwrap();
    }
    let path = sock_path("cgroup");
    let _d = Daemon::start(&path, &["--scope-by", "cgroup"]);
    // Each client moves itself into its cgroup before it starts (so before it connects).
    let in_group = |g: &Path| {
        let mut c = Command::new("sh");
        c.arg("-c")
            .arg(format!(
                "echo $$ > {}/cgroup.procs && exec \"$0\" \"$@\"",
                g.display()
            ))
            .arg(BIN);
        c
    };
    let pages = 1024u64;
    let mut a1 = Client::start(&mut in_group(&groups[0]), &path, "vms", 4);
    let mut a2 = Client::start(&mut in_group(&groups[0]), &path, "vms", 4);
    let mut b = Client::start(&mut in_group(&groups[1]), &path, "vms", 4);
    wait_for("the clients of cgroup a merged", 60, || {
        a1.stats()["pages_shared"].as_u64() == Some(pages)
            && a2.stats()["pages_shared"].as_u64() == Some(pages)
    });
    for _ in 0..3 {
        b.ask("KICK");
    }
    assert_eq!(b.stats()["pages_shared"].as_u64(), Some(0));
    let st = status_as(&path, false);
    let vms: Vec<&serde_json::Value> = st["scopes"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["scope"] == "vms")
        .collect();
    assert_eq!(vms.len(), 2, "{st}");
    assert!(vms.iter().all(|s| s["cgroup"].is_string()), "{st}");
    a1.finish();
    a2.finish();
    b.finish();
    for g in &groups {
        let _ = std::fs::remove_dir(g);
    }
}
