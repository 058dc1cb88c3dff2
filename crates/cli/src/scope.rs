//! `pageone daemon`, `pageone status`, and the hidden `pageone scope-client` used by the
//! cross-process tests and benchmark.

use std::io::{BufRead, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::config::Loaded;
use pageone_engine::proto;
use pageone_engine::Engine;
use pageone_seed::{fill_page, Data};
use pageone_sys as sys;

const PAGE: usize = 4096;

/// The socket given, else `$PAGEONE_SOCKET`, else the configuration's `socket`, else the
/// default one: `$XDG_RUNTIME_DIR/pageone.sock`, else the system socket for root and the
/// `pageone` user (none otherwise: never a directory others share).
pub fn socket_or_default(socket: Option<PathBuf>, loaded: &Loaded) -> Result<PathBuf> {
    if let Some(s) = socket
        .or_else(|| proto::setting("PAGEONE_SOCKET").map(Into::into))
        .or_else(|| loaded.file.socket.clone())
    {
        return Ok(s);
    }
    match proto::socket::default_socket() {
        Ok(s) => Ok(s),
        Err(_) if proto::auth::daemon_user_uid() == Some(sys::euid()) => {
            Ok(proto::socket::SYSTEM_SOCKET.into())
        }
        Err(e) => Err(e.into()),
    }
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
    /// Page i is all zero where i % N is N / 2 (one page in N, never a first or last).
    #[arg(long)]
    pub zero_every: Option<usize>,
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
/// With `zero_every` N, page i is all zero where `i % N` is `N / 2`.
/// `REWRITE` gives every page new content, unlike any before (the next generation), and prints
/// `REWRITTEN`. With `writer`, a thread keeps writing one word of every 8th page all along, and
/// every check expects its last value there. `SCRAMBLE` gives every page content of this process
/// alone (never merged again) and prints `SCRAMBLED`. `DROP` drops every page with
/// `MADV_DONTNEED` straight from the program (not through the engine) and prints `OK` if each
/// reads zeros or the first content it held (a page written after its merge reads its copy
/// again), else `BAD <page>`; the client's contents are unknown afterwards, so it is ended by
/// a signal. `UNREGISTER` unregisters the memory (the engine stays, joined) and prints
/// `UNREGISTERED`.
pub fn client(o: ClientOptions) -> Result<()> {
    let ClientOptions {
        mib,
        hard,
        period_ms,
        workers,
        defer,
        distinct,
        writer,
        zero_every,
    } = o;
    // Like a C host program: a write to a pipe nobody reads ends the process, so the tests see
    // whether the engine ever makes one (e.g. to a daemon that died).
    sys::default_sigpipe()?;
    let len = mib << 20;
    let generation = std::cell::Cell::new(0u64);
    let own = std::cell::Cell::new(false);
    let first_content = |i: usize| distinct.map_or(i, |d| i % d.max(1)) as u64;
    let content = |i: usize| {
        if own.get() {
            return 1 << 48 | u64::from(std::process::id()) << 24 | i as u64;
        }
        first_content(i) + generation.get() * (len / PAGE) as u64
    };
    let data = if hard { Data::Hard } else { Data::Easy };
    let engine = Engine::builder()
        .workers(workers)
        .merge_period(Duration::from_millis(period_ms))
        .build()?;
    let zero = |i: usize| zero_every.is_some_and(|n| n > 1 && i % n == n / 2);
    let r = sys::mmap_anonymous(len)?;
    for i in 0..len / PAGE {
        if zero(i) {
            // Written all zero (present, as a program's zeroed page is).
            // SAFETY: page i of a fresh private mapping owned by this function.
            unsafe { r.add(i * PAGE).write_bytes(0, PAGE) };
            continue;
        }
        // SAFETY: page i of a fresh private mapping owned by this function.
        unsafe { fill_page(r.add(i * PAGE), data, content(i)) };
    }
    let registered = std::cell::Cell::new(!defer);
    if !defer {
        engine.register(r, len)?;
    }
    let mut writer = writer.then(|| Writer::start(r as usize, len / PAGE));
    let expected = |i: usize, want: &mut [u8; PAGE]| {
        // (Hard pages set a few words: the rest must be zero as in the fresh mapping.)
        want.fill(0);
        if !zero(i) {
            // SAFETY: `want` is a local page.
            unsafe { fill_page(want.as_mut_ptr(), data, content(i)) };
        }
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
    let rewrite_all = || {
        let rewrite = || {
            let mut want = [0u8; PAGE];
            for i in 0..len / PAGE {
                expected(i, &mut want);
                // SAFETY: page i of the mapping owned by this function (the writer is paused);
                // the engine keeps writes to it (a merged page is copied on write).
                unsafe { std::ptr::copy_nonoverlapping(want.as_ptr(), r.add(i * PAGE), PAGE) };
            }
        };
        match &writer {
            Some(w) => w.paused(rewrite),
            None => rewrite(),
        }
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
                registered.set(true);
                writeln!(out, "GOING")?
            }
            "UNREGISTER" if registered.get() => {
                engine.unregister(r, len)?;
                registered.set(false);
                writeln!(out, "UNREGISTERED")?
            }
            "REWRITE" => {
                generation.set(generation.get() + 1);
                rewrite_all();
                writeln!(out, "REWRITTEN")?
            }
            "SCRAMBLE" => {
                own.set(true);
                rewrite_all();
                writeln!(out, "SCRAMBLED")?
            }
            "DROP" if writer.is_none() => {
                match drop_unseen(r, len, |i, want| {
                    // SAFETY: `want` is a local page.
                    unsafe { fill_page(want.as_mut_ptr(), data, first_content(i)) }
                }) {
                    None => writeln!(out, "OK")?,
                    Some(i) => writeln!(out, "BAD {i}")?,
                }
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
    if registered.get() {
        engine.unregister(r, len)?;
    }
    engine.shutdown();
    if let Some(i) = bad {
        bail!("page {i} does not hold what was written");
    }
    Ok(())
}

/// Drops the `len` bytes at `r` with `MADV_DONTNEED` where the engine cannot see it first, then
/// returns the first page that reads neither zeros nor the content `first` fills in (the bytes
/// its copy held, if it was merged and written since), if any.
fn drop_unseen(r: *mut u8, len: usize, first: impl Fn(usize, &mut [u8; PAGE])) -> Option<usize> {
    // SAFETY: the mapping is the client's own; the caller gives its contents up.
    if unsafe { libc::madvise(r.cast(), len, libc::MADV_DONTNEED) } != 0 {
        return Some(0);
    }
    let (mut want, mut got) = ([0u8; PAGE], [0u8; PAGE]);
    (0..len / PAGE).find(|&i| {
        want.fill(0);
        first(i, &mut want);
        // SAFETY: page i of the client's mapping; no other thread writes it.
        unsafe { std::ptr::copy_nonoverlapping(r.add(i * PAGE), got.as_mut_ptr(), PAGE) };
        got.iter().any(|&b| b != 0) && got != want
    })
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
