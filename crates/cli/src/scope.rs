//! `pageone daemon`, `pageone status`, and the hidden `pageone scope-client` used by the
//! cross-process tests and benchmark.

use std::io::{BufRead, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use pageone_daemon::{Daemon, DaemonConfig};
use pageone_engine::proto::{self, Reply, Request};
use pageone_engine::Engine;
use pageone_seed::{fill_page, Data};
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
