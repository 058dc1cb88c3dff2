//! `pageone daemon`, `pageone status`, and the hidden `pageone scope-client` used by the
//! cross-process tests and benchmark.

use std::io::{BufRead, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use pageone_bench::dedup::{fill_page, Data};
use pageone_daemon::{Daemon, DaemonConfig};
use pageone_engine::proto::{self, Reply, Request};
use pageone_engine::Engine;
use pageone_sys as sys;

const PAGE: usize = 4096;

/// The socket given, else `$PAGEONE_SOCKET`, else the default one (none without
/// `$XDG_RUNTIME_DIR` unless root: never a directory others share).
pub fn socket_or_default(socket: Option<PathBuf>) -> Result<PathBuf> {
    if let Some(s) = socket.or_else(|| proto::setting("PAGEONE_SOCKET").map(Into::into)) {
        return Ok(s);
    }
    Ok(proto::socket::default_socket()?)
}

/// Options of `pageone daemon`.
#[derive(clap::Args)]
pub struct DaemonOptions {
    /// Socket path [default: $PAGEONE_SOCKET, else $XDG_RUNTIME_DIR/pageone.sock, else
    /// /run/pageone/pageone.sock for root]. Its directory must be reachable without symbolic
    /// links and writable only by root or this user (or sticky); the socket is 0666 for root
    /// and the `pageone` user (every local user may connect; scopes and caps are per user),
    /// 0600 otherwise.
    #[arg(long)]
    pub socket: Option<PathBuf>,
    /// Exit when the last client has left (a private daemon of one process tree).
    #[arg(long)]
    pub exit_when_idle: bool,
    /// What keeps scopes apart besides their names: `uid`, or `cgroup` (uid and cgroups, so
    /// that same-user processes of different cgroups, e.g. guests of different tenants under
    /// one libvirt user, never share).
    #[arg(long, default_value = "uid")]
    pub scope_by: pageone_daemon::ScopeBy,
    /// A cap, as NAME=VALUE (repeatable). Names: connections, connections-per-uid,
    /// pages-per-uid, pages-per-client, notes, notes-per-uid, notes-per-client, report-bytes,
    /// in-flight-per-uid, hello-timeout-ms, idle-timeout-ms, frame-timeout-ms.
    #[arg(long = "limit", value_name = "NAME=VALUE")]
    pub limits: Vec<String>,
}

pub fn daemon(o: DaemonOptions) -> Result<()> {
    let mut config = DaemonConfig::new(socket_or_default(o.socket)?);
    config.exit_when_idle = o.exit_when_idle;
    config.scope_by = o.scope_by;
    for l in &o.limits {
        let Some((name, value)) = l.split_once('=') else {
            bail!("a limit is NAME=VALUE, not {l:?}");
        };
        config.limits.set(name, value).map_err(anyhow::Error::msg)?;
    }
    // The daemon's tables grow and shrink with what its clients note and share: big ones get
    // their own mappings so that shrinking them gives the memory back.
    pageone_sys::set_heap_mmap_threshold(128 << 10);
    let d = Daemon::bind(config)?;
    eprintln!("pageone daemon listening on {}", d.socket().display());
    d.run().context("the daemon stopped serving")
}

/// Connects to the daemon at `path`, if it is one this process trusts (root, this user, or the
/// system daemon's user).
pub fn connect_trusted(path: &std::path::Path) -> Result<UnixStream> {
    let sock = UnixStream::connect(path)
        .with_context(|| format!("no pageone daemon answers at {}", path.display()))?;
    proto::auth::check_daemon(&sock)
        .with_context(|| format!("refusing the daemon at {}", path.display()))?;
    Ok(sock)
}

pub fn status(socket: Option<PathBuf>, json: bool) -> Result<()> {
    let path = socket_or_default(socket)?;
    let sock = connect_trusted(&path)?;
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

/// Options of [`client`] (`pageone scope-client`).
#[derive(clap::Args)]
pub struct ClientOptions {
    #[arg(long, default_value_t = 64)]
    pub mib: usize,
    #[arg(long)]
    pub hard: bool,
    #[arg(long, default_value_t = 100)]
    pub period_ms: u64,
    #[arg(long, default_value_t = 1)]
    pub workers: usize,
    /// Register only when told `GO` on standard input.
    #[arg(long)]
    pub defer: bool,
    /// Page i holds content i % N (default: every page distinct).
    #[arg(long)]
    pub distinct: Option<usize>,
    /// A thread keeps writing one word of every 8th page meanwhile (checked by VERIFY).
    #[arg(long)]
    pub writer: bool,
}

/// Pages the writer thread of a scope client writes: every 8th, at this word.
const WRITER_STRIDE: usize = 8;
const WRITER_WORD: usize = 256;

/// A thread that keeps writing word [`WRITER_WORD`] of every [`WRITER_STRIDE`]th page of the
/// region and records each value; paused while the region is checked or rewritten.
struct Writer {
    shadow: std::sync::Arc<Vec<std::sync::atomic::AtomicU64>>,
    pause: std::sync::Arc<std::sync::atomic::AtomicBool>,
    paused: std::sync::Arc<std::sync::atomic::AtomicBool>,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Writer {
    fn start(region: usize, pages: usize) -> Self {
        use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
        use std::sync::Arc;
        let shadow: Arc<Vec<AtomicU64>> = Arc::new((0..pages).map(|_| AtomicU64::new(0)).collect());
        let pause = Arc::new(AtomicBool::new(false));
        let paused = Arc::new(AtomicBool::new(false));
        let stop = Arc::new(AtomicBool::new(false));
        let (sh, pa, pd, st) = (shadow.clone(), pause.clone(), paused.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            let mut round = 1u64;
            // SeqCst throughout: a test helper, where plain reasoning beats speed.
            while !st.load(Ordering::SeqCst) {
                if pa.load(Ordering::SeqCst) {
                    pd.store(true, Ordering::SeqCst);
                    while pa.load(Ordering::SeqCst) && !st.load(Ordering::SeqCst) {
                        std::thread::sleep(Duration::from_micros(100));
                    }
                    pd.store(false, Ordering::SeqCst);
                    continue;
                }
                // A seventh of the written pages per round, a round every 20 ms: each page is
                // written every 140 ms, so with the tests' 50 ms periods it keeps becoming a
                // candidate and being written around its merge.
                let first = 3 + (round % 7) as usize * WRITER_STRIDE;
                for i in (first..pages).step_by(WRITER_STRIDE * 7) {
                    let v = round << 32 | i as u64;
                    // SAFETY: page i of the client's region, which stays mapped while the writer
                    // runs (it is stopped before the region goes); only this thread writes this
                    // word, and the engine keeps every write (that is what is tested).
                    unsafe {
                        std::ptr::write_volatile(
                            (region + i * PAGE + WRITER_WORD * 8) as *mut u64,
                            v,
                        )
                    };
                    sh[i].store(v, Ordering::SeqCst);
                }
                round += 1;
                std::thread::sleep(Duration::from_millis(20));
            }
        });
        Self {
            shadow,
            pause,
            paused,
            stop,
            thread: Some(thread),
        }
    }

    /// Runs `f` with the writer held still.
    fn paused<T>(&self, f: impl FnOnce() -> T) -> T {
        use std::sync::atomic::Ordering;
        self.pause.store(true, Ordering::SeqCst);
        while !self.paused.load(Ordering::SeqCst) {
            std::thread::sleep(Duration::from_micros(100));
        }
        let r = f();
        self.pause.store(false, Ordering::SeqCst);
        r
    }

    /// The value last written to page `i` (0: never written, as the fresh page holds).
    fn value(&self, i: usize) -> Option<u64> {
        (i % WRITER_STRIDE == 3).then(|| self.shadow[i].load(std::sync::atomic::Ordering::SeqCst))
    }

    fn stop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Fills `mib` MiB with seed data (identical across processes, unique within), registers it with
/// an engine that joins the daemon (`$PAGEONE_SOCKET`), prints `READY`, then serves stdin:
/// `STATS` prints the engine's counters as one JSON line, `VERIFY` checks every byte and prints
/// `OK` or `BAD <page>`. At end of input it verifies, unregisters and exits (1 if data was wrong).
/// With `defer`, registration waits for a `GO` line (so a benchmark times merging, not filling).
/// With `distinct` (at least 1), page i holds content `i % distinct` (many pages per content).
/// `REWRITE` gives every page new content, unlike any before (the next generation), and prints
/// `REWRITTEN`. With `writer`, a thread keeps writing one word of every 8th page all along, and
/// every check expects its last value there.
pub fn client(o: ClientOptions) -> Result<()> {
    let ClientOptions {
        mib,
        hard,
        period_ms,
        workers,
        defer,
        distinct,
        writer,
    } = o;
    // Like a C host program: a write to a pipe nobody reads ends the process, so the tests see
    // whether the engine ever makes one (e.g. to a daemon that died).
    sys::default_sigpipe()?;
    let len = mib << 20;
    let generation = std::cell::Cell::new(0u64);
    let content = |i: usize| {
        distinct.map_or(i, |d| i % d.max(1)) as u64 + generation.get() * (len / PAGE) as u64
    };
    let data = if hard { Data::Hard } else { Data::Easy };
    let engine = Engine::builder()
        .workers(workers)
        .merge_period(Duration::from_millis(period_ms))
        .build()?;
    let r = sys::mmap_anonymous(len)?;
    for i in 0..len / PAGE {
        // SAFETY: page i of a fresh private mapping owned by this function.
        unsafe { fill_page(r.add(i * PAGE), data, content(i)) };
    }
    if !defer {
        engine.register(r, len)?;
    }
    let mut writer = writer.then(|| Writer::start(r as usize, len / PAGE));
    let expected = |i: usize, want: &mut [u8; PAGE]| {
        // (Hard pages set a few words: the rest must be zero as in the fresh mapping.)
        want.fill(0);
        // SAFETY: `want` is a local page.
        unsafe { fill_page(want.as_mut_ptr(), data, content(i)) };
        if let Some(v) = writer.as_ref().and_then(|w| w.value(i)) {
            want[WRITER_WORD * 8..WRITER_WORD * 8 + 8].copy_from_slice(&v.to_ne_bytes());
        }
    };
    let check = || -> Option<usize> {
        let mut want = [0u8; PAGE];
        let mut got = [0u8; PAGE];
        for i in 0..len / PAGE {
            expected(i, &mut want);
            // SAFETY: the page is mapped; only this thread writes the region while the writer
            // is paused (the engine never changes contents), so a copy of it is what the
            // program sees.
            unsafe { std::ptr::copy_nonoverlapping(r.add(i * PAGE), got.as_mut_ptr(), PAGE) };
            if got != want {
                return Some(i);
            }
        }
        None
    };
    let verify = || match &writer {
        Some(w) => w.paused(check),
        None => check(),
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
            "GO" if defer => {
                engine.register(r, len)?;
                writeln!(out, "GOING")?
            }
            "REWRITE" => {
                generation.set(generation.get() + 1);
                let rewrite = || {
                    let mut want = [0u8; PAGE];
                    for i in 0..len / PAGE {
                        expected(i, &mut want);
                        // SAFETY: page i of the mapping owned by this function (the writer is
                        // paused); the engine keeps writes to it (a merged page is copied on
                        // write).
                        unsafe {
                            std::ptr::copy_nonoverlapping(want.as_ptr(), r.add(i * PAGE), PAGE)
                        };
                    }
                };
                match &writer {
                    Some(w) => w.paused(rewrite),
                    None => rewrite(),
                }
                writeln!(out, "REWRITTEN")?
            }
            "KICK" => {
                engine.wait_periods(1, Duration::from_secs(10));
                writeln!(out, "KICKED")?
            }
            other => writeln!(out, "ERR unknown command {other:?}")?,
        }
        out.flush()?;
    }
    let bad = verify();
    if let Some(w) = &mut writer {
        w.stop();
    }
    engine.unregister(r, len)?;
    engine.shutdown();
    if let Some(i) = bad {
        bail!("page {i} does not hold what was written");
    }
    Ok(())
}

/// Starts `pageone daemon` on `socket` and waits until it listens there.
pub fn spawn_daemon(socket: &std::path::Path) -> Result<std::process::Child> {
    let mut child = std::process::Command::new(std::env::current_exe()?)
        .args(["daemon", "--socket"])
        .arg(socket)
        .stderr(std::process::Stdio::null())
        .spawn()
        .context("could not start the daemon")?;
    if let Err(e) = wait_for_own_daemon(socket, &mut child) {
        let _ = child.kill();
        let _ = child.wait();
        return Err(e);
    }
    Ok(child)
}

/// Waits until `child` listens at `socket`. Whoever answers there must be that process (its
/// pid, by `SO_PEERCRED`): anything else is an error, not a daemon to use.
pub fn wait_for_own_daemon(
    socket: &std::path::Path,
    child: &mut std::process::Child,
) -> Result<()> {
    let t0 = Instant::now();
    loop {
        if let Ok(s) = UnixStream::connect(socket) {
            return check_peer_pid(&s, child.id(), socket);
        }
        if let Some(st) = child.try_wait()? {
            bail!(
                "the daemon exited ({st}) before listening on {}",
                socket.display()
            );
        }
        if t0.elapsed() > Duration::from_secs(10) {
            bail!("the daemon did not listen on {}", socket.display());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Checks that the process answering on `sock` is `pid`.
pub fn check_peer_pid(sock: &UnixStream, pid: u32, path: &std::path::Path) -> Result<()> {
    use std::os::fd::AsRawFd;
    let cred = sys::peer_cred(sock.as_raw_fd())?;
    if cred.pid < 0 || cred.pid as u32 != pid {
        bail!(
            "{} is answered by pid {}, not by the daemon started for this command (pid {pid})",
            path.display(),
            cred.pid
        );
    }
    Ok(())
}

/// A daemon started for one benchmark run: stopped, and its socket file removed (a killed daemon
/// cannot), however the run ends.
struct BenchDaemon {
    child: std::process::Child,
    socket: std::path::PathBuf,
}

impl Drop for BenchDaemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.socket);
    }
}

fn process_cpu_seconds(pid: u32) -> f64 {
    pageone_bench::ksm::process_cpu_ns(pid) as f64 / 1e9
}

/// One pageone measurement across processes: a daemon and `procs` clients of `mib` MiB of seed
/// data (identical across processes, unique within). Time from registration to 99% of the
/// possible saving, and CPU of the clients' engines plus the daemon.
pub fn bench_side(
    procs: usize,
    mib: usize,
    data: Data,
    period_ms: u64,
    workers: usize,
) -> Result<pageone_bench::dedup::Sample> {
    use std::process::{Command, Stdio};
    let socket = std::env::temp_dir().join(format!("pageone-bench-{}.sock", std::process::id()));
    let daemon = BenchDaemon {
        child: spawn_daemon(&socket)?,
        socket: socket.clone(),
    };
    let mut clients = Vec::new();
    for _ in 0..procs {
        let mut c = Command::new(std::env::current_exe()?)
            .args(["scope-client", "--defer", "--mib"])
            .arg(mib.to_string())
            .args(["--period-ms", &period_ms.to_string()])
            .args(["--workers", &workers.to_string()])
            .args(if data == Data::Hard {
                &["--hard"][..]
            } else {
                &[]
            })
            .env("PAGEONE_SOCKET", &socket)
            .env("PAGEONE_SCOPE", "bench")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .context("could not start a client")?;
        let stdin = c.stdin.take().context("client stdin")?;
        let mut out = std::io::BufReader::new(c.stdout.take().context("client stdout")?);
        let mut line = String::new();
        out.read_line(&mut line)?;
        if !line.starts_with("READY") {
            bail!("a client failed to start: {line:?}");
        }
        clients.push((c, stdin, out));
    }
    // A command to every client, then their answers: they carry it out at once, in parallel.
    let mut ask_all = |cmd: &str| -> Result<Vec<String>> {
        for (_, i, _) in &mut clients {
            writeln!(i, "{cmd}")?;
            i.flush()?;
        }
        let mut answers = Vec::new();
        for (_, _, o) in &mut clients {
            let mut line = String::new();
            o.read_line(&mut line)?;
            answers.push(line.trim().to_string());
        }
        Ok(answers)
    };
    let pages = (mib << 20) / PAGE;
    let possible = ((procs - 1) * pages) as u64;
    let target = possible * 99 / 100;
    let mut clients_cpu0 = 0.0;
    for line in ask_all("STATS")? {
        let st: serde_json::Value = serde_json::from_str(&line)?;
        clients_cpu0 += st["worker_cpu_ns"].as_f64().unwrap_or(0.0) / 1e9;
    }
    let mem0 = pageone_bench::dedup::HostMemory::now();
    let cpu0 = process_cpu_seconds(daemon.child.id());
    let t0 = Instant::now();
    // All clients register at once, as independent processes would (asked one after the other,
    // the last registered a few registrations late).
    for line in ask_all("GO")? {
        if line != "GOING" {
            bail!("a client failed to register: {line:?}");
        }
    }
    let sock = UnixStream::connect(&socket)?;
    // Live figures: every client's own counters (merges show as they happen, not at its next
    // report) against the daemon's count of copies in the store.
    let mut measure = |sock: &UnixStream| -> Result<(u64, f64)> {
        let (Reply::Text(t), _) = proto::call(sock, &Request::Status, None)? else {
            bail!("the daemon answered out of protocol");
        };
        let v: serde_json::Value = serde_json::from_str(&t)?;
        let copies = v["scopes"]
            .as_array()
            .and_then(|a| a.iter().find(|s| s["scope"] == "bench"))
            .map_or(0, |s| s["pages_shared"].as_u64().unwrap_or(0));
        let (mut mapped, mut cpu) = (0u64, 0.0);
        for line in ask_all("STATS")? {
            let st: serde_json::Value = serde_json::from_str(&line)?;
            mapped += st["pages_shared"].as_u64().unwrap_or(0)
                + st["pages_sharing"].as_u64().unwrap_or(0);
            cpu += st["worker_cpu_ns"].as_f64().unwrap_or(0.0) / 1e9;
        }
        Ok((mapped.saturating_sub(copies), cpu))
    };
    let mut reached = None;
    let mut last = (0, 0.0);
    while t0.elapsed() < Duration::from_secs(300) {
        last = measure(&sock)?;
        if last.0 >= target {
            reached = Some(t0.elapsed().as_secs_f64());
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let clients_cpu = last.1 - clients_cpu0;
    let daemon_cpu = process_cpu_seconds(daemon.child.id()) - cpu0;
    eprintln!("    (clients' engines {clients_cpu:.2} CPU-s, daemon {daemon_cpu:.2} CPU-s)");
    let cpu = clients_cpu + daemon_cpu;
    let memory_saved_kib = pageone_bench::dedup::settle_memory(
        mem0,
        || measure(&sock).map_or(0, |m| m.0),
        possible,
        pageone_bench::dedup::SETTLE_GRACE,
        Duration::from_millis(2 * period_ms),
    );
    for (k, v) in ask_all("VERIFY")?.into_iter().enumerate() {
        if v != "OK" {
            bail!("client {k} lost data ({v}): this is a bug, please report it");
        }
    }
    for (mut c, i, _) in clients {
        drop(i);
        c.wait()?;
    }
    drop(daemon);
    Ok(pageone_bench::dedup::Sample {
        side: "pageone",
        data,
        seconds_to_99: reached,
        cpu_seconds: cpu,
        pages_saved: last.0,
        possible,
        memory_saved_kib,
    })
}
