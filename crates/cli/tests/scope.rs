//! Cross-process sharing through `pageone daemon`, with real processes: sharing within a scope,
//! none across scopes, `kill -9` of clients and of the daemon, and clients that lie.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_pageone");
const PAGE: u64 = 4096;

/// The tests start daemons and fill memory: one at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn sock_path(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("pageone-test-{}-{name}.sock", std::process::id()))
}

struct Daemon(Child);

impl Daemon {
    fn start(path: &Path) -> Self {
        let child = Command::new(BIN)
            .args(["daemon", "--socket"])
            .arg(path)
            .stderr(Stdio::null())
            .spawn()
            .expect("start the daemon");
        let t0 = Instant::now();
        while UnixStream::connect(path).is_err() {
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "daemon never listened"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        Daemon(child)
    }
    fn kill(&mut self) {
        let _ = self.0.kill(); // SIGKILL
        let _ = self.0.wait();
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.kill();
    }
}

struct Client {
    child: Child,
    stdin: Option<ChildStdin>,
    stdout: BufReader<ChildStdout>,
    pid: u32,
}

impl Client {
    fn start(path: &Path, scope: &str, mib: usize) -> Self {
        Self::start_with(path, scope, mib, false)
    }
    /// The command of a client of `mib` MiB in `scope` at the daemon on `path`, merging every
    /// `period_ms`.
    fn command(path: &Path, scope: &str, mib: usize, period_ms: u64) -> Command {
        let mut cmd = Command::new(BIN);
        cmd.args(["scope-client", "--period-ms", &period_ms.to_string()])
            .args(["--mib", &mib.to_string()])
            .env("PAGEONE_SOCKET", path)
            .env("PAGEONE_SCOPE", scope);
        cmd
    }
    /// A client whose pages hold only `distinct` contents (many pages per content).
    fn start_repetitive(path: &Path, scope: &str, mib: usize, distinct: usize) -> Self {
        Self::spawn(Self::command(path, scope, mib, 50).args(["--distinct", &distinct.to_string()]))
    }
    /// A client whose writer thread keeps writing every 8th page.
    fn start_writing(path: &Path, scope: &str, mib: usize) -> Self {
        Self::spawn(Self::command(path, scope, mib, 50).arg("--writer"))
    }
    /// A client whose merge period is `period_ms`.
    fn start_at_period(path: &Path, scope: &str, mib: usize, period_ms: u64) -> Self {
        Self::spawn(&mut Self::command(path, scope, mib, period_ms))
    }
    /// With `defer`, the client registers its memory only when told `GO`.
    fn start_with(path: &Path, scope: &str, mib: usize, defer: bool) -> Self {
        Self::spawn(Self::command(path, scope, mib, 50).args(if defer {
            &["--defer"][..]
        } else {
            &[]
        }))
    }
    fn spawn(cmd: &mut Command) -> Self {
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("start a client");
        let stdin = child.stdin.take();
        let mut stdout = BufReader::new(child.stdout.take().expect("stdout"));
        let mut line = String::new();
        stdout.read_line(&mut line).expect("READY line");
        assert!(line.starts_with("READY"), "client said {line:?}");
        let pid = child.id();
        Client {
            child,
            stdin,
            stdout,
            pid,
        }
    }
    fn ask(&mut self, cmd: &str) -> String {
        let stdin = self.stdin.as_mut().expect("client input open");
        writeln!(stdin, "{cmd}").expect("client alive");
        stdin.flush().expect("client alive");
        let mut line = String::new();
        self.stdout.read_line(&mut line).expect("client answers");
        line.trim().to_string()
    }
    fn stats(&mut self) -> serde_json::Value {
        serde_json::from_str(&self.ask("STATS")).expect("stats JSON")
    }
    fn verify(&mut self) {
        assert_eq!(self.ask("VERIFY"), "OK", "client {} lost data", self.pid);
    }
    fn pss_kib(&self) -> u64 {
        smaps_pss(self.pid)
    }
    fn finish(mut self) {
        drop(self.stdin.take());
        let st = self.child.wait().expect("client exit");
        assert!(st.success(), "client {} failed its final check", self.pid);
    }
    fn kill9(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn smaps_pss(pid: u32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).unwrap_or_default();
    s.lines()
        .find(|l| l.starts_with("Pss:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

fn status(path: &Path) -> serde_json::Value {
    let out = Command::new(BIN)
        .args(["status", "--json", "--socket"])
        .arg(path)
        .output()
        .expect("run pageone status");
    assert!(out.status.success(), "status failed: {out:?}");
    serde_json::from_slice(&out.stdout).expect("status JSON")
}

fn scope<'a>(st: &'a serde_json::Value, name: &str) -> Option<&'a serde_json::Value> {
    st["scopes"]
        .as_array()?
        .iter()
        .find(|s| s["scope"].as_str() == Some(name))
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

#[test]
fn four_processes_in_one_scope_keep_one_copy_per_distinct_page() {
    let _g = serial();
    let path = sock_path("four");
    let daemon = Daemon::start(&path);
    let mib = 32;
    let pages = (mib as u64) << 20 >> 12;
    let mut clients: Vec<Client> = (0..4)
        .map(|_| Client::start_with(&path, "vm", mib, true))
        .collect();
    let pss_before: u64 = clients.iter().map(|c| c.pss_kib()).sum();
    for c in &mut clients {
        assert_eq!(c.ask("GO"), "GOING");
    }
    wait_for("every page of every client merged", 60, || {
        clients
            .iter_mut()
            .all(|c| c.stats()["pages_shared"].as_u64() == Some(pages))
    });
    let st = status(&path);
    let sc = scope(&st, "vm").expect("scope vm");
    // One copy per distinct page in the store, as the kernel counts the memfd's blocks.
    assert_eq!(sc["pages_shared"].as_u64(), Some(pages), "{sc}");
    assert_eq!(sc["store_resident_bytes"].as_u64(), Some(pages * PAGE));
    let pss_after: u64 =
        clients.iter().map(|c| c.pss_kib()).sum::<u64>() + smaps_pss(daemon.0.id());
    // 4 x 32 MiB private became one 32 MiB copy mapped by 5 processes: at least 2.5 copies' worth
    // of Pss is gone (the kernel's accounting, not ours).
    let saved_kib = pss_before.saturating_sub(pss_after);
    assert!(
        saved_kib >= (mib as u64) * 1024 * 5 / 2,
        "Pss {pss_before} KiB -> {pss_after} KiB"
    );
    for c in &mut clients {
        c.verify();
    }
    for c in clients {
        c.finish();
    }
    // Everyone left: the scope is gone, store and all.
    wait_for("the scope closed", 10, || {
        scope(&status(&path), "vm").is_none()
    });
}

/// Content shared by more pages than one copy may serve (max_sharing, 256) across processes:
/// every page still merges, onto as many copies of that content as needed (the daemon makes a
/// fresh copy where a client's is full, instead of answering with the full one again).
#[test]
fn content_repeated_beyond_the_sharing_limit_merges_everywhere() {
    let _g = serial();
    let (_daemon, mut clients, pages) = repetitive_pair_merged("repeated", 2);
    for c in &mut clients {
        let s = c.stats();
        // 2048 pages of 2 contents, at most 256 per copy: at least 8 copies per client.
        assert!(s["pages_shared"].as_u64().unwrap() >= pages / 256, "{s}");
        c.verify();
    }
    for c in clients {
        c.finish();
    }
}

/// A daemon and two clients in scope `name`, each with 8 MiB whose page `i` holds content
/// `i % distinct`, once every page of both merged; and the pages of each client.
fn repetitive_pair_merged(name: &str, distinct: usize) -> (Daemon, Vec<Client>, u64) {
    let path = sock_path(name);
    let daemon = Daemon::start(&path);
    let mib = 8;
    let pages = (mib as u64) << 20 >> 12;
    let mut clients: Vec<Client> = (0..2)
        .map(|_| Client::start_repetitive(&path, name, mib, distinct))
        .collect();
    wait_for("every page of both clients merged", 60, || {
        clients.iter_mut().all(|c| {
            let s = c.stats();
            s["pages_shared"].as_u64().unwrap_or(0) + s["pages_sharing"].as_u64().unwrap_or(0)
                == pages
        })
    });
    (daemon, clients, pages)
}

/// Two processes' merged pages written with contents of their own: their copies are no longer
/// counted by anyone, but the pages keep their places in the store's mappings. Two more processes
/// then merge other contents, for which the daemon gives out free slots. The first processes
/// drop their pages with a `madvise` the engine cannot see first: each page reads zeros or the
/// bytes its copy held, never the other processes' (the copies stay held while mapped, emptied
/// meanwhile: their memory goes back to the host).
#[test]
fn a_page_dropped_unseen_never_reads_a_slot_given_to_other_contents() {
    let _g = serial();
    let path = sock_path("held");
    let _daemon = Daemon::start(&path);
    let mib = 8;
    let pages = (mib as u64) << 20 >> 12;
    let mut first: Vec<Client> = (0..2).map(|_| Client::start(&path, "held", mib)).collect();
    let merged = |c: &mut Client| c.stats()["pages_shared"].as_u64() == Some(pages);
    wait_for("the first pair merged", 60, || first.iter_mut().all(merged));
    for c in &mut first {
        assert_eq!(c.ask("SCRAMBLE"), "SCRAMBLED");
    }
    wait_for("the first pair's pages all written", 60, || {
        first
            .iter_mut()
            .all(|c| c.stats()["pages_shared"].as_u64() == Some(0))
    });
    for c in &mut first {
        // Releases go out once a period.
        assert_eq!(c.ask("KICK"), "KICKED");
        assert_eq!(c.ask("KICK"), "KICKED");
    }
    // Held (the written pages lie over them) and vacated by both: the daemon emptied them.
    wait_for("the first pair's copies emptied", 10, || {
        scope(&status(&path), "held").is_some_and(|s| s["store_resident_bytes"].as_u64() == Some(0))
    });
    let mut second: Vec<Client> = (0..2).map(|_| Client::start(&path, "held", mib)).collect();
    for c in &mut second {
        assert_eq!(c.ask("REWRITE"), "REWRITTEN");
    }
    wait_for("the second pair merged", 60, || {
        second.iter_mut().all(merged)
    });
    for c in &mut first {
        assert_eq!(c.ask("DROP"), "OK", "client {}", c.pid);
    }
    for c in &mut second {
        c.verify();
    }
    for c in first {
        c.kill9();
    }
    for c in second {
        c.finish();
    }
}

/// Mappings of a scope's store in the process `pid`.
/// Zero pages between merged pages, one page in eight, in two processes of a scope: the
/// daemon makes each zero page of the first a zero hole between the copies around it, and
/// holds those holes for the second too, so that each process's merged pages stay a few
/// mappings of the store (not one per stretch between zero pages); the holes take no memory,
/// and every page reads what was written.
#[test]
fn zero_pages_inside_merged_runs_keep_them_whole_across_processes() {
    let _g = serial();
    let path = sock_path("holes");
    let _daemon = Daemon::start(&path);
    let mib = 8;
    let pages = (mib as u64) << 20 >> 12;
    let zeros = pages / 8;
    let mut clients: Vec<Client> = (0..2)
        .map(|_| {
            Client::spawn(Client::command(&path, "holes", mib, 50).args(["--zero-every", "8"]))
        })
        .collect();
    wait_for("every page of both clients merged", 60, || {
        clients.iter_mut().all(|c| {
            let s = c.stats();
            let merged =
                s["pages_shared"].as_u64().unwrap_or(0) + s["pages_sharing"].as_u64().unwrap_or(0);
            merged == pages - zeros && s["zero_pages"].as_u64() == Some(zeros)
        })
    });
    for c in &mut clients {
        let maps = store_mappings(c.pid);
        eprintln!("client {}: {maps} mappings of the store", c.pid);
        assert!(
            maps <= 16,
            "{maps} mappings of the store for {pages} pages, {zeros} of them zero: {}",
            c.stats()
        );
        c.verify();
    }
    let st = status(&path);
    let sc = scope(&st, "holes").expect("scope holes");
    assert_eq!(sc["pages_shared"].as_u64(), Some(pages - zeros), "{sc}");
    assert!(sc["zero_holes"].as_u64() >= Some(zeros), "{sc}");
    assert_eq!(
        sc["store_resident_bytes"].as_u64(),
        Some((pages - zeros) * PAGE),
        "the holes take no memory: {sc}"
    );
    for c in clients {
        c.finish();
    }
}

fn store_mappings(pid: u32) -> usize {
    std::fs::read_to_string(format!("/proc/{pid}/maps"))
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains("pageone-scope"))
        .count()
}

/// A run of one content far longer than a copy may serve, in two processes of a scope: each
/// process's pages take their copies in turn, and the daemon gives a request's copies side by
/// side, so a mapping serves a stripe of pages instead of one page.
#[test]
fn a_run_of_one_content_maps_its_copies_a_stripe_at_a_time_across_processes() {
    let _g = serial();
    let (_daemon, mut clients, pages) = repetitive_pair_merged("stripes", 1);
    for c in &mut clients {
        // 2048 pages, 256 per copy: 8 copies or 9 (a copy adopted from the other process
        // serves its leader alone), two mappings per stripe at most (the group's own copy
        // apart from the fresh ones); 2048 when each copy served 256 pages in a row.
        let maps = store_mappings(c.pid);
        assert!(
            maps as u64 <= 2 * pages / 8 + 4,
            "{maps} mappings of the store for {pages} pages: {}",
            c.stats()
        );
        c.verify();
    }
    for c in clients {
        c.finish();
    }
}

#[test]
fn scopes_do_not_share() {
    let _g = serial();
    let path = sock_path("scopes");
    let _daemon = Daemon::start(&path);
    let mib = 16;
    let pages = (mib as u64) << 20 >> 12;
    // Two processes in scope a (they share), one with the same data in scope b (alone).
    let mut a1 = Client::start(&path, "a", mib);
    let mut a2 = Client::start(&path, "a", mib);
    let mut b = Client::start(&path, "b", mib);
    wait_for("scope a merged", 60, || {
        a1.stats()["pages_shared"].as_u64() == Some(pages)
            && a2.stats()["pages_shared"].as_u64() == Some(pages)
    });
    // Give b several more periods to (wrongly) find a's copies.
    b.ask("KICK");
    b.ask("KICK");
    b.ask("KICK");
    assert_eq!(b.stats()["pages_shared"].as_u64(), Some(0));
    let st = status(&path);
    assert_eq!(
        scope(&st, "a").unwrap()["pages_shared"].as_u64(),
        Some(pages)
    );
    assert_eq!(scope(&st, "b").unwrap()["pages_shared"].as_u64(), Some(0));
    assert_eq!(
        scope(&st, "b").unwrap()["store_resident_bytes"].as_u64(),
        Some(0)
    );
    for c in [&mut a1, &mut a2, &mut b] {
        c.verify();
    }
    a1.finish();
    a2.finish();
    b.finish();
}

/// A tiny deterministic generator, so a failing iteration can be replayed.
struct Rng(u64);
impl Rng {
    fn next(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

#[test]
fn kill_9_of_clients_and_daemon_leaves_every_survivor_correct() {
    let _g = serial();
    let iterations: u64 = std::env::var("PAGEONE_CRASH_ITERATIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20);
    let path = sock_path("crash");
    let mut daemon = Daemon::start(&path);
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut clients: Vec<Client> = Vec::new();
    // Clients that outlived a daemon: they run unshared, and must stay correct.
    let mut orphans: Vec<Client> = Vec::new();
    for it in 0..iterations {
        while clients.len() < 3 {
            // One of them writes all along.
            clients.push(if clients.is_empty() {
                Client::start_writing(&path, "crash", 8)
            } else {
                Client::start(&path, "crash", 8)
            });
        }
        // Let merging run for a random while, then kill someone at that moment.
        std::thread::sleep(Duration::from_millis(50 + rng.next(600)));
        if rng.next(4) == 0 {
            daemon.kill();
            orphans.append(&mut clients);
            daemon = Daemon::start(&path);
        } else {
            let k = rng.next(clients.len() as u64) as usize;
            clients.swap_remove(k).kill9();
        }
        for c in clients.iter_mut().chain(orphans.iter_mut()) {
            c.verify();
        }
        for c in orphans.iter_mut() {
            // It notices at its next period's call to the daemon, and joins the new one within
            // a second or so.
            c.ask("KICK");
            let s = c.stats();
            assert!(
                s["daemon"] == "lost" || s["daemon"] == "connected",
                "iteration {it}: {s}"
            );
        }
        // Survivors still merge, and the daemon's books match the memfd: once merging settled,
        // every live copy is resident and nothing else is.
        for c in clients.iter_mut() {
            c.ask("KICK");
        }
        // (Copies in flight are resident before they are live: retry until merging settles.)
        let t0 = Instant::now();
        loop {
            let st = status(&path);
            let Some(sc) = scope(&st, "crash") else { break };
            let live = sc["pages_shared"].as_u64().unwrap();
            if sc["store_resident_bytes"].as_u64() == Some(live * PAGE) {
                break;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "iteration {it}: the daemon's books do not match the store: {sc}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        if orphans.len() > 3 {
            for c in orphans.drain(..) {
                c.finish();
            }
        }
    }
    for c in clients.drain(..).chain(orphans.drain(..)) {
        c.finish();
    }
    wait_for("the dead clients' copies freed", 10, || {
        let st = status(&path);
        match scope(&st, "crash") {
            None => true,
            Some(sc) => {
                sc["pages_shared"].as_u64() == Some(0)
                    && sc["store_resident_bytes"].as_u64() == Some(0)
            }
        }
    });
}

/// Inodes of the store files (memfds named `pageone-scope`) process `pid` maps.
fn store_inodes(pid: u32) -> std::collections::HashSet<u64> {
    std::fs::read_to_string(format!("/proc/{pid}/maps"))
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains("memfd:pageone-scope"))
        .filter_map(|l| l.split_whitespace().nth(4)?.parse().ok())
        .collect()
}

/// The daemon dies and another starts on the same socket: its clients join it (within a second
/// or so), their merged pages move onto the new store, and none maps the dead daemon's store any
/// more (else all of it stays allocated). A client rewriting all its pages meanwhile, and one
/// writing every 8th page all along, keep every write.
#[test]
fn clients_join_a_new_daemon_and_leave_the_old_store() {
    let _g = serial();
    let path = sock_path("rejoin");
    let mut daemon = Daemon::start(&path);
    let mib = 16;
    let pages = (mib as u64) << 20 >> 12;
    let mut clients: Vec<Client> = (0..3)
        .map(|_| Client::start(&path, "rejoin", mib))
        .collect();
    clients.push(Client::start_writing(&path, "rejoin", mib));
    wait_for("every page of every client merged", 60, || {
        clients[..3]
            .iter_mut()
            .all(|c| c.stats()["pages_shared"].as_u64() == Some(pages))
    });
    wait_for("the writing client's other pages merged", 60, || {
        clients[3].stats()["pages_shared"].as_u64() >= Some(pages * 7 / 8)
    });
    clients[3].verify();
    let old: Vec<_> = clients.iter().map(|c| store_inodes(c.pid)).collect();
    assert!(old.iter().all(|s| s.len() == 1), "{old:?}");
    // The clients find out by themselves (an idle engine looks every second).
    daemon.kill();
    // (Clients 0 and 1 are not read here: their merged pages have no page table entries until
    // read, and must move all the same.)
    for c in &mut clients[2..] {
        c.verify();
    }
    let _daemon = Daemon::start(&path);
    // One client rewrites every page (new contents) while the others move theirs.
    assert_eq!(clients[2].ask("REWRITE"), "REWRITTEN");
    wait_for("every client joined the new daemon", 20, || {
        clients.iter_mut().all(|c| {
            let s = c.stats();
            s["daemon"] == "connected" && s["daemon_joins"] == 1
        })
    });
    wait_for(
        "the unchanged clients merged onto the new store",
        60,
        || {
            clients[..2]
                .iter_mut()
                .all(|c| c.stats()["pages_shared"].as_u64() == Some(pages))
        },
    );
    // They moved page by page (merged again while mapping the old copies), not by being made
    // private first.
    for c in &mut clients[..2] {
        assert_eq!(c.stats()["pages_left_private"], 0);
    }
    wait_for("no client maps the dead daemon's store", 60, || {
        clients
            .iter()
            .zip(&old)
            .all(|(c, o)| store_inodes(c.pid).is_disjoint(o))
    });
    // The rewriting client's pages were private already (written) when its old mappings went.
    assert!(clients[2].stats()["pages_left_private"].as_u64() > Some(0));
    let st = status(&path);
    let sc = scope(&st, "rejoin").expect("scope rejoin");
    // The new store holds the unchanged clients' contents once, and what the rewriting client
    // merged (its pages are alike, not unique: they may merge among themselves or not).
    assert!(sc["pages_shared"].as_u64() >= Some(pages), "{sc}");
    for c in &mut clients {
        c.verify();
    }
    for c in clients {
        c.finish();
    }
}

fn raw_frame(tag: u32, body: &[u8]) -> Vec<u8> {
    let mut f = ((body.len() + 4) as u32).to_le_bytes().to_vec();
    f.extend_from_slice(&tag.to_le_bytes());
    f.extend_from_slice(body);
    f
}

#[test]
fn lying_and_garbage_clients_cannot_affect_others() {
    let _g = serial();
    let path = sock_path("liars");
    let _daemon = Daemon::start(&path);
    let mib = 8;
    let pages = (mib as u64) << 20 >> 12;
    let mut c1 = Client::start(&path, "x", mib);
    let mut c2 = Client::start(&path, "x", mib);
    wait_for("honest clients merged", 60, || {
        c1.stats()["pages_shared"].as_u64() == Some(pages)
    });
    let garbage: Vec<Vec<u8>> = vec![
        b"\xff\xff\xff\xffhello".to_vec(),        // length beyond the limit
        raw_frame(77, b"what"),                   // unknown request
        raw_frame(2, &u32::MAX.to_le_bytes()),    // lookup claiming 4G hashes
        raw_frame(3, &5u32.to_le_bytes()),        // copy before hello
        raw_frame(4, &[1, 0, 0, 0, 0, 0, 0, 0]),  // release before hello
        raw_frame(10, &[1, 0, 0, 0, 0, 0, 0, 0]), // vacate before hello
        raw_frame(1, &[1, 0, 0, 0, 2, 0, 0, 0, b'x', b'x']), // hello without a pipe
    ];
    for g in garbage {
        let mut s = UnixStream::connect(&path).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let _ = s.write_all(&g);
        let mut buf = [0u8; 256];
        let n = std::io::Read::read(&mut s, &mut buf).unwrap_or(0);
        // An error reply (tag 199) or a closed connection; never a hang.
        assert!(n == 0 || (n >= 8 && buf[4] == 199), "reply {:?}", &buf[..n]);
    }
    // A client that joined properly and then releases and vacates every slot it does not hold,
    // and asks for copies of pages its pipe does not hold: the others keep their copies, and the
    // daemon never waits on the pipe.
    {
        use pageone_engine::proto::{self, Reply, Request};
        use std::os::fd::AsRawFd;
        let hello = Request::Hello {
            version: proto::VERSION,
            scope: "x".into(),
        };
        // A greeting with a file instead of a pipe is refused.
        let s = UnixStream::connect(&path).unwrap();
        let file = pageone_sys::memfd_create(c"liar").unwrap();
        let refused = proto::call(&s, &hello, Some(&file));
        assert!(
            matches!(&refused, Err(proto::ProtoError::Refused(m)) if m.contains("not a pipe")),
            "{refused:?}"
        );
        let s = UnixStream::connect(&path).unwrap();
        let (pipe_r, pipe_w) = pageone_sys::pipe().unwrap();
        let (r, fd) = proto::call(&s, &hello, Some(&pipe_r)).unwrap();
        assert!(matches!(r, Reply::Welcome { .. }) && fd.is_some());
        let (r, _) =
            proto::call(&s, &Request::Release((0..pages as u32 * 2).collect()), None).unwrap();
        assert_eq!(r, Reply::Ok);
        // Vacating them empties none: only a slot's own holders may give up its bytes.
        let (r, _) =
            proto::call(&s, &Request::Vacate((0..pages as u32 * 2).collect()), None).unwrap();
        assert_eq!(r, Reply::Ok);
        // An empty pipe: every copy fails, nothing is published.
        let (r, _) = proto::call(&s, &Request::Copy(8), None).unwrap();
        assert_eq!(r, Reply::Slots(vec![proto::FAILED; 8]));
        // Three pages and a half where eight are named: they fail, and the pipe is emptied.
        let junk = vec![0x5au8; 3 * PAGE as usize + 100];
        let mut w = std::fs::File::from(pipe_w.try_clone().unwrap());
        w.write_all(&junk).unwrap();
        let (r, _) = proto::call(&s, &Request::Copy(8), None).unwrap();
        assert_eq!(r, Reply::Slots(vec![proto::FAILED; 8]));
        assert_eq!(pageone_sys::pipe_pending(pipe_r.as_raw_fd()).unwrap(), 0);
        // Two whole pages of its own: copied (a client may publish any content of its own).
        w.write_all(&junk[..2 * PAGE as usize]).unwrap();
        let (r, _) = proto::call(&s, &Request::Copy(2), None).unwrap();
        let Reply::Slots(got) = r else {
            panic!("{r:?}")
        };
        assert!(got.iter().all(|&s| s != proto::FAILED), "{got:?}");
        let (r, _) = proto::call(&s, &Request::Release(got), None).unwrap();
        assert_eq!(r, Reply::Ok);
        assert!(proto::call(&s, &Request::Copy(1 << 20), None).is_err());
    }
    let st = status(&path);
    let sc = scope(&st, "x").unwrap();
    assert_eq!(sc["pages_shared"].as_u64(), Some(pages), "{sc}");
    assert_eq!(sc["store_resident_bytes"].as_u64(), Some(pages * PAGE));
    c1.verify();
    c2.verify();
    c1.finish();
    c2.finish();
}

/// A process that keeps rewriting its unique pages does not grow the daemon's memory: the
/// content it no longer has is forgotten (its engine sweeps stale first sightings and tells the
/// daemon), and everything it noted goes when it leaves.
#[test]
fn rewritten_unique_pages_are_forgotten_by_the_daemon() {
    let _g = serial();
    let path = sock_path("churn");
    let _daemon = Daemon::start(&path);
    let pages = 8192; // 32 MiB: more stale first sightings than the engine sweeps for
    let mut c = Client::start(&path, "churn", 32);
    let noted = |path: &Path| {
        scope(&status(path), "churn")
            .map_or(0, |s| s["noted_first_sightings"].as_u64().unwrap_or(0))
    };
    let settled = |c: &mut Client, path: &Path| {
        noted(path) == pages && c.stats()["pages_unshared"].as_u64() == Some(pages)
    };
    wait_for("every page noted", 60, || settled(&mut c, &path));
    for _ in 0..3 {
        assert_eq!(c.ask("REWRITE"), "REWRITTEN");
        // The engine has seen the writes once it completed a period after them.
        assert_eq!(c.ask("KICK"), "KICKED");
        assert_eq!(c.ask("KICK"), "KICKED");
        wait_for("only the new contents noted", 60, || settled(&mut c, &path));
    }
    c.verify();
    c.finish();
    wait_for("the leaving client's notes dropped", 10, || {
        noted(&path) == 0
    });
}

/// Memory a client unregisters (or hands to the kernel's KSM), while it stays joined, takes
/// nothing of the store with it: the daemon forgets the client's notes of its pages, and copies
/// another process made for them before that, offered to the client and held for it, are given
/// back although the client looks nothing up any more. (They stayed allocated for the client's
/// life: 9-18 MiB of store in the hybrid benchmark, every region handed to KSM.)
#[test]
fn unregistered_memory_leaves_no_note_and_no_copy_held_in_the_daemon() {
    let _g = serial();
    let path = sock_path("leave");
    let _daemon = Daemon::start(&path);
    let pages = 2048;
    let in_scope =
        |what: &str| scope(&status(&path), "leave").map_or(0, |s| s[what].as_u64().unwrap_or(0));
    // A's long period: it looks nothing up again (a relook is 16 periods away) before it
    // unregisters, so the copies B makes for A's notes wait at the daemon as offers.
    let mut a = Client::start_at_period(&path, "leave", 8, 2000);
    wait_for("A's pages noted", 30, || {
        in_scope("noted_first_sightings") == pages
    });
    let mut b = Client::start(&path, "leave", 8);
    wait_for("B's copies of A's noted pages", 30, || {
        in_scope("store_pages_in_use") >= pages
    });
    assert_eq!(a.ask("UNREGISTER"), "UNREGISTERED");
    assert_eq!(b.ask("UNREGISTER"), "UNREGISTERED");
    wait_for("no note and no copy left", 15, || {
        in_scope("noted_first_sightings") == 0 && in_scope("store_pages_in_use") == 0
    });
    a.verify();
    b.verify();
    a.finish();
    b.finish();
}

/// A scope goes with its last client: its store is closed and nothing of it stays in the
/// daemon, so a client cycling through scope names cannot run the daemon out of descriptors.
#[test]
fn a_scope_closes_when_its_last_client_leaves() {
    use pageone_engine::proto::{self, Reply, Request};
    let _g = serial();
    let path = sock_path("scopes");
    let daemon = Daemon::start(&path);
    let fds = || {
        std::fs::read_dir(format!("/proc/{}/fd", daemon.0.id()))
            .unwrap()
            .count()
    };
    let join = |name: &str| {
        let s = UnixStream::connect(&path).unwrap();
        let (pipe, _) = pageone_sys::pipe().unwrap();
        let hello = Request::Hello {
            version: proto::VERSION,
            scope: name.into(),
        };
        let (r, fd) = proto::call(&s, &hello, Some(&pipe)).unwrap();
        assert!(matches!(r, Reply::Welcome { .. }) && fd.is_some());
        s
    };
    let first = join("cycle-0");
    let before = fds();
    for i in 1..200 {
        drop(join(&format!("cycle-{i}")));
    }
    wait_for("only the first scope left", 10, || {
        status(&path)["scopes"].as_array().map(Vec::len) == Some(1)
    });
    assert!(scope(&status(&path), "cycle-0").is_some());
    assert!(
        fds() <= before + 2,
        "descriptors {} after, {before} before",
        fds()
    );
    drop(first);
    wait_for("no scope left", 10, || {
        status(&path)["scopes"].as_array().map(Vec::len) == Some(0)
    });
}

/// A daemon that dies between answering a lookup with `WANTED` and reading the pages: the
/// client's hand-over into the pipe then has no reader on the daemon's side. The client keeps
/// SIGPIPE's default action (as a C host program does) and must neither die nor lose data: it
/// runs unshared.
#[test]
fn a_daemon_that_dies_mid_copy_does_not_kill_the_client() {
    use pageone_engine::proto::{self, Reply, Request};
    use std::os::fd::AsRawFd;
    let _g = serial();
    let path = sock_path("dies");
    let _ = std::fs::remove_file(&path);
    let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
    let fake = std::thread::spawn(move || {
        let (s, _) = listener.accept().unwrap();
        // Nobody answers the client's attempts to join again.
        drop(listener);
        let (body, pipe) = proto::read_frame(&s).unwrap();
        assert!(matches!(Request::decode(&body), Ok(Request::Hello { .. })));
        let pipe = pipe.expect("the greeting carries the pipe");
        let capacity = 4096u32;
        // A store as a daemon makes them (the client checks), handed over read-only.
        let store = proto::store::create(c"fake-store", capacity).unwrap();
        let store = pageone_sys::reopen_readonly(store.as_raw_fd()).unwrap();
        let welcome = Reply::Welcome {
            capacity,
            client: 1,
            scope: "dies".into(),
        };
        proto::write_frame(&s, &welcome.encode(), Some(&store)).unwrap();
        loop {
            let (body, _) = proto::read_frame(&s).unwrap();
            let reply = match Request::decode(&body).unwrap() {
                Request::Lookup(hs) if !hs.is_empty() => {
                    // "Dies": the pipe's read end goes first, then the answer, then the socket.
                    drop(pipe);
                    let wanted = Reply::Answers {
                        answers: vec![proto::WANTED; hs.len()],
                        offers: Vec::new(),
                    };
                    proto::write_frame(&s, &wanted.encode(), None).unwrap();
                    return hs.len();
                }
                Request::Lookup(_) => Reply::Answers {
                    answers: Vec::new(),
                    offers: Vec::new(),
                },
                _ => Reply::Ok,
            };
            proto::write_frame(&s, &reply.encode(), None).unwrap();
        }
    });
    let mut c = Client::start(&path, "dies", 8);
    let wanted = fake.join().unwrap();
    assert!(wanted > 0);
    wait_for("the client running unshared", 10, || {
        c.stats()["daemon"] == "lost"
    });
    c.verify();
    c.finish();
    let _ = std::fs::remove_file(&path);
}

/// A client whose connection ends while its process lives may still map its copies: the daemon
/// keeps them until the process exits (freeing one would turn the page into a hole, which reads
/// as zeros). One that said goodbye first has its copies freed at once.
#[test]
fn a_connection_lost_while_the_process_lives_keeps_its_copies() {
    use pageone_engine::proto::{self, Reply, Request};
    use std::os::fd::AsRawFd;
    let _g = serial();
    let path = sock_path("linger");
    let _daemon = Daemon::start(&path);
    let page = PAGE as usize;
    // Joins, copies one page of `byte` through its pipe and returns the connection and the slot.
    let join_and_copy = |byte: u8| {
        let s = UnixStream::connect(&path).unwrap();
        let (pipe_r, pipe_w) = pageone_sys::pipe().unwrap();
        let hello = Request::Hello {
            version: proto::VERSION,
            scope: "linger".into(),
        };
        let (r, store) = proto::call(&s, &hello, Some(&pipe_r)).unwrap();
        assert!(matches!(r, Reply::Welcome { .. }));
        std::fs::File::from(pipe_w)
            .write_all(&vec![byte; page])
            .unwrap();
        let (r, _) = proto::call(&s, &Request::Copy(1), None).unwrap();
        let Reply::Slots(slots) = r else {
            panic!("{r:?}")
        };
        assert_ne!(slots[0], proto::FAILED);
        (s, store.unwrap(), slots[0])
    };
    let store_bytes = || scope(&status(&path), "linger").map(|s| s["store_resident_bytes"].clone());
    let (s, store, slot) = join_and_copy(0xa5);
    // Mapped the way a merge maps it: a private mapping of the store.
    let at = pageone_sys::mmap_anonymous(page).unwrap();
    // SAFETY: `at` is this test's own fresh page; nothing refers to it.
    unsafe { pageone_sys::mmap_private_fixed(at, page, store.as_raw_fd(), slot as u64 * PAGE) }
        .unwrap();
    // SAFETY: `at` is mapped (read here, written by nobody).
    let read = || (0..page).all(|i| unsafe { std::ptr::read_volatile(at.add(i)) } == 0xa5);
    assert!(read());
    drop(s);
    wait_for("the daemon to see the connection end", 10, || {
        scope(&status(&path), "linger").is_none_or(|sc| sc["clients"][0]["connected"] == false)
    });
    assert!(read(), "the copy was freed under a live process");
    assert_eq!(store_bytes(), Some(serde_json::json!(PAGE)));
    // Said goodbye: freed when the connection ends (the first one's copy stays).
    let (s, _, _) = join_and_copy(0x5a);
    assert_eq!(store_bytes(), Some(serde_json::json!(2 * PAGE)));
    assert_eq!(
        proto::call(&s, &Request::Goodbye, None).unwrap().0,
        Reply::Ok
    );
    drop(s);
    wait_for("the second copy freed", 10, || {
        store_bytes() == Some(serde_json::json!(PAGE))
    });
    assert!(read());
    // SAFETY: mapped above; nothing refers to it any more.
    unsafe { pageone_sys::munmap(at, page) }.unwrap();
}

/// An engine in a process that goes on living: when it stops, its merged pages become private
/// again and it says goodbye, so the daemon frees its copies at once.
#[test]
fn an_engine_that_stops_frees_its_copies_while_the_process_lives() {
    let _g = serial();
    let path = sock_path("goodbye");
    let _daemon = Daemon::start(&path);
    let engine = pageone_engine::Engine::builder()
        .daemon(Some(path.clone()))
        .scope("goodbye")
        .merge_period(Duration::from_millis(50))
        .build()
        .unwrap();
    let (page, pages) = (PAGE as usize, 64);
    let at = pageone_sys::mmap_anonymous(pages * page).unwrap();
    // SAFETY: `at` is this test's own fresh mapping; written before it is registered.
    unsafe { std::ptr::write_bytes(at, 0x33, pages * page) };
    engine.register(at, pages * page).unwrap();
    wait_for(
        "the pages merged onto a copy in the daemon's store",
        20,
        || {
            engine.stats().pages_sharing == pages as u64 - 1
                && scope(&status(&path), "goodbye").is_some_and(|s| s["pages_shared"] == 1)
        },
    );
    engine.shutdown();
    wait_for("the copy freed", 10, || {
        scope(&status(&path), "goodbye").is_none_or(|s| s["store_resident_bytes"] == 0)
    });
    // SAFETY: the mapping is ours and unregistered; nobody writes it.
    let intact = (0..pages * page).all(|i| unsafe { std::ptr::read_volatile(at.add(i)) } == 0x33);
    assert!(intact, "data changed");
    // SAFETY: mapped above; nothing refers to it any more.
    unsafe { pageone_sys::munmap(at, pages * page) }.unwrap();
}

/// Forwards every connection made to `front` to the daemon at `back`, frame by frame with its
/// descriptor; [`Proxy::cut`] ends the connections it carries so far (the daemon lives on).
struct Proxy {
    carried: std::sync::Arc<std::sync::Mutex<Vec<UnixStream>>>,
}

impl Proxy {
    fn start(front: &Path, back: &Path) -> Self {
        use pageone_engine::proto;
        let _ = std::fs::remove_file(front);
        let listener = std::os::unix::net::UnixListener::bind(front).unwrap();
        let carried = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let (list, back) = (carried.clone(), back.to_path_buf());
        std::thread::spawn(move || {
            for client in listener.incoming().map_while(Result::ok) {
                list.lock().unwrap().push(client.try_clone().unwrap());
                let daemon = UnixStream::connect(&back).unwrap();
                std::thread::spawn(move || {
                    // Strictly request then reply; either side closing ends both.
                    let forward = |from: &UnixStream, to: &UnixStream| -> Option<()> {
                        let (body, fd) = proto::read_frame(from).ok()?;
                        let mut frame = (body.len() as u32).to_le_bytes().to_vec();
                        frame.extend_from_slice(&body);
                        proto::write_frame(to, &frame, fd.as_ref()).ok()
                    };
                    while forward(&client, &daemon).is_some() && forward(&daemon, &client).is_some()
                    {
                    }
                });
            }
        });
        Proxy { carried }
    }

    fn cut(&self) {
        for s in self.carried.lock().unwrap().drain(..) {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }
}

/// A client whose connection drops while the daemon lives joins that same daemon again. Its
/// merged pages keep mapping the same store (the old holds stay while the process lives), are
/// held again by the new connection, and are not made private later: that store was not
/// replaced.
#[test]
fn a_client_that_loses_its_connection_joins_the_same_daemon_again() {
    let _g = serial();
    let path = sock_path("same");
    let front = sock_path("same-proxy");
    let _daemon = Daemon::start(&path);
    let proxy = Proxy::start(&front, &path);
    let mib = 8;
    let pages = (mib as u64) << 20 >> 12;
    let mut direct = Client::start(&path, "same", mib);
    let mut proxied = Client::start(&front, "same", mib);
    wait_for("both clients merged", 60, || {
        [&mut direct, &mut proxied]
            .iter_mut()
            .all(|c| c.stats()["pages_shared"].as_u64() == Some(pages))
    });
    proxy.cut();
    proxied.ask("KICK");
    wait_for("the client joined the same daemon again", 20, || {
        let s = proxied.stats();
        s["daemon"] == "connected" && s["daemon_joins"] == 1
    });
    // Well past the periods after which pages still on a replaced store are made private.
    std::thread::sleep(Duration::from_millis(3000));
    let s = proxied.stats();
    // (Made private, they would show as copy-on-write breaks, then merge again.)
    assert_eq!(s["cow_breaks"], 0, "{s}");
    assert_eq!(s["pages_left_private"], 0, "{s}");
    assert_eq!(s["pages_shared"].as_u64(), Some(pages), "{s}");
    assert_eq!(store_inodes(proxied.pid).len(), 1);
    proxied.verify();
    direct.verify();
    proxied.finish();
    direct.finish();
}
