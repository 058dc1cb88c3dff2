//! The hidden `pageone scope-probe`: what a client can do to a daemon and its store, for the
//! tests that run it as another user (`nobody`) against a daemon of root's. Prints one JSON
//! object of what it tried and what happened.
//!
//! * `store`: joins, then tries every way to write the store it was handed.
//! * `hostile`: takes connections until refused, vacates slots it does not hold (and one of its
//!   own), holds zero holes and slots that are none, floods lookups, fills the store with copies until refused, lies about counts and
//!   reports, stalls in the middle of a frame, idles without a greeting, stops reading replies,
//!   and reopens its store for writing.
//! * `env`: the engine settings this process takes from its environment.

use std::io::{Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use pageone_engine::proto::{self, ProtoError, Reply, Request};
use pageone_sys as sys;
use serde_json::{json, Value};

const PAGE: usize = sys::PAGE_SIZE;

/// Options of `pageone scope-probe`.
#[derive(clap::Args)]
pub struct ProbeOptions {
    /// `store`, `hostile` or `env`.
    what: String,
    #[arg(long)]
    socket: Option<PathBuf>,
    /// Scope to join.
    #[arg(long, default_value = "probe")]
    scope: String,
    /// How long `hostile` floods.
    #[arg(long, default_value_t = 10)]
    seconds: u64,
}

pub fn run(o: ProbeOptions) -> Result<()> {
    let v = match o.what.as_str() {
        "env" => {
            let c = pageone_engine::Config::default();
            json!({ "secure": sys::secure_execution(), "daemon": c.daemon, "scope": c.scope })
        }
        "store" => store(&socket(&o)?, &o.scope)?,
        "hostile" => hostile(&socket(&o)?, &o.scope, Duration::from_secs(o.seconds))?,
        other => bail!("no probe {other:?}: store, hostile or env"),
    };
    println!("{v}");
    Ok(())
}

fn socket(o: &ProbeOptions) -> Result<PathBuf> {
    o.socket.clone().context("--socket is needed")
}

/// A client that joined `scope` the way an engine does (the store as handed over, and the
/// pipe's write end).
struct Joined {
    sock: UnixStream,
    store: OwnedFd,
    pipe: OwnedFd,
    capacity: u32,
}

impl Joined {
    /// The bytes of store slot `slot` as this client's mapping of the store reads them.
    fn read_slot(&self, slot: u32) -> Result<Vec<u8>> {
        let mut out = vec![0u8; PAGE];
        // SAFETY: `out` is this function's own buffer of PAGE bytes.
        unsafe {
            sys::pread_into(
                self.store.as_raw_fd(),
                out.as_mut_ptr(),
                PAGE,
                slot as u64 * PAGE as u64,
            )?
        };
        Ok(out)
    }
}

fn join(path: &Path, scope: &str) -> Result<Joined> {
    let sock = UnixStream::connect(path)?;
    sock.set_read_timeout(Some(Duration::from_secs(30)))?;
    let (pipe_r, pipe) = sys::pipe()?;
    let _ = sys::set_pipe_capacity(pipe.as_raw_fd(), 1 << 20);
    let hello = Request::Hello {
        version: proto::VERSION,
        scope: scope.into(),
    };
    let (reply, store) = proto::call(&sock, &hello, Some(&pipe_r))?;
    let (Reply::Welcome { capacity, .. }, Some(store)) = (reply, store) else {
        bail!("the daemon did not hand over a store");
    };
    Ok(Joined {
        sock,
        store,
        pipe,
        capacity,
    })
}

fn outcome<T>(r: std::io::Result<T>) -> Value {
    match r {
        Ok(_) => json!("allowed"),
        Err(e) => json!(format!("refused: {e}")),
    }
}

/// Every way to change the store through the descriptor a client holds.
fn store(path: &Path, scope: &str) -> Result<Value> {
    let j = join(path, scope)?;
    let fd = j.store.as_raw_fd();
    let daemon = proto::auth::check_daemon(&j.sock)?;
    let expected = proto::store::Expected {
        owner: daemon.uid,
        capacity: j.capacity,
    };
    let page = vec![0x77u8; PAGE];
    let proc_path = format!("/proc/self/fd/{fd}");
    let open = |write: bool, read: bool| {
        std::fs::OpenOptions::new()
            .read(read)
            .write(write)
            .open(&proc_path)
    };
    let mut v = json!({
        "client_check": match proto::store::check(fd, &expected) {
            Ok(()) => "ok".to_string(),
            Err(e) => e,
        },
        "reopen_read_write": outcome(open(true, true)),
        "reopen_write_only": outcome(open(true, false)),
        "fchmod": outcome(sys::fchmod(fd, 0o666)),
        "ftruncate": outcome(sys::ftruncate(fd, 0)),
        "fallocate_punch_hole": outcome(sys::punch_hole(fd, 0, PAGE as u64)),
        "pwrite": outcome(sys::pwrite_pages(fd, &[page.as_ptr() as usize], 0)),
        "mmap_shared_writable": outcome(sys::mmap_shared(fd, PAGE, 0)),
        "add_seal_write": outcome(sys::add_seals(fd, libc::F_SEAL_WRITE)),
    });
    // With a read-write descriptor (had the reopen worked), each route again.
    if let Ok(rw) = open(true, true) {
        let rw = rw.as_raw_fd();
        v["via_reopened_pwrite"] = outcome(sys::pwrite_pages(rw, &[page.as_ptr() as usize], 0));
        v["via_reopened_punch"] = outcome(sys::punch_hole(rw, 0, PAGE as u64));
    }
    Ok(v)
}

/// A small generator of page contents and hashes nobody else has.
struct Noise(u64);

impl Noise {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn page(&mut self, out: &mut [u8]) {
        for w in out.chunks_mut(8) {
            w.copy_from_slice(&self.next().to_ne_bytes());
        }
    }
}

/// What the hostile probe saw, by activity.
fn hostile(path: &Path, scope: &str, flood: Duration) -> Result<Value> {
    let mut v = json!({});
    v["connections"] = connections_until_refused(path).context("taking connections")?;
    v["vacates"] = vacate_lies(path, scope).context("vacating")?;
    v["holes"] = hole_lies(path, scope).context("holding holes")?;
    let until = Instant::now() + flood;
    let p = path.to_path_buf();
    let s = scope.to_string();
    let lookups = std::thread::spawn(move || flood_lookups(&p, &s, until));
    let p = path.to_path_buf();
    let s = scope.to_string();
    let copies = std::thread::spawn(move || fill_store(&p, &s, until));
    v["stall"] = closed_after(path, |s| {
        // Ten bytes of a frame that says it has a hundred.
        let mut f = 100u32.to_le_bytes().to_vec();
        f.extend_from_slice(&[0x02, 0, 0, 0, 9, 9]);
        s.write_all(&f)
    })
    .context("stalling")?;
    v["idle"] = closed_after(path, |_| Ok(())).context("idling")?;
    v["no_reading"] = closed_after_not_reading(path).context("not reading")?;
    v["lookups"] = lookups
        .join()
        .expect("lookup thread")
        .context("flooding lookups")?;
    v["copies"] = copies
        .join()
        .expect("copy thread")
        .context("filling the store")?;
    v["lies"] = lies(path, scope).context("lying")?;
    let j = join(path, scope)?;
    let reopen = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(format!("/proc/self/fd/{}", j.store.as_raw_fd()));
    v["reopen_read_write"] = outcome(reopen);
    Ok(v)
}

/// Opens connections (each asks for `status`) until the daemon refuses one.
fn connections_until_refused(path: &Path) -> Result<Value> {
    let mut held = Vec::new();
    for _ in 0..4096 {
        let s = UnixStream::connect(path)?;
        s.set_read_timeout(Some(Duration::from_secs(10)))?;
        let refused = match proto::call(&s, &Request::Status, None) {
            Ok(_) => {
                held.push(s);
                continue;
            }
            Err(ProtoError::Refused(why)) => why,
            // The daemon may have closed before the request went out: its refusal waits to be
            // read.
            Err(e) => match proto::read_frame(&s).map(|(b, _)| Reply::decode(&b)) {
                Ok(Ok(Reply::Error(why))) => why,
                _ => return Err(e.into()),
            },
        };
        let count = held.len();
        drop(held);
        // (The daemon counts the closed connections off as their threads see them end.)
        std::thread::sleep(Duration::from_millis(500));
        return Ok(json!({ "held": count, "refused": refused }));
    }
    Ok(json!({ "held": held.len(), "refused": null }))
}

/// Lookups of 64 Ki hashes nobody has, as fast as answered, until `until`.
fn flood_lookups(path: &Path, scope: &str, until: Instant) -> Result<Value> {
    let j = join(path, scope)?;
    let mut noise = Noise(sys::random_u64()? | 1);
    let (mut done, mut over_cap) = (0u64, 0u64);
    while Instant::now() < until {
        let hs: Vec<u128> = (0..proto::MAX_ITEMS)
            .map(|_| (noise.next() as u128) << 64 | noise.next() as u128)
            .collect();
        match proto::call(&j.sock, &Request::Lookup(hs), None) {
            Ok(_) => done += 1,
            Err(ProtoError::OverCap(_)) => over_cap += 1,
            Err(e) => return Err(e.into()),
        }
    }
    Ok(json!({ "answered": done, "over_cap": over_cap }))
}

/// Copies of 256 fresh pages at a time (plain and fresh ones), until refused often or `until`.
fn fill_store(path: &Path, scope: &str, until: Instant) -> Result<Value> {
    let j = join(path, scope)?;
    let mut noise = Noise(sys::random_u64()? | 1);
    let mut buf = vec![0u8; 256 * PAGE];
    let (mut pages, mut over_cap, mut reason) = (0u64, 0u64, None);
    let mut pipe = std::fs::File::from(j.pipe.try_clone()?);
    let mut fresh = false;
    while Instant::now() < until && over_cap < 50 {
        noise.page(&mut buf);
        pipe.write_all(&buf)?;
        let req = if fresh {
            Request::CopyFresh(256)
        } else {
            Request::Copy(256)
        };
        fresh = !fresh;
        match proto::call(&j.sock, &req, None) {
            Ok((Reply::Slots(s), _)) => {
                pages += s.iter().filter(|&&s| s != proto::FAILED).count() as u64;
            }
            Ok((r, _)) => bail!("a copy was answered {r:?}"),
            Err(ProtoError::OverCap(why)) => {
                over_cap += 1;
                reason = Some(why);
            }
            Err(e) => return Err(e.into()),
        }
    }
    Ok(json!({ "pages": pages, "over_cap": over_cap, "reason": reason }))
}

/// Counts that lie, reports too large or too big to add, releases of slots it never held; then
/// whether `status` still answers.
fn lies(path: &Path, scope: &str) -> Result<Value> {
    let j = join(path, scope).context("joining")?;
    let k = join(path, scope).context("joining again")?;
    let call = |j: &Joined, r: &Request| proto::call(&j.sock, r, None).map(|(r, _)| r);
    // Names 300 pages, holds 3.
    std::fs::File::from(j.pipe.try_clone()?).write_all(&vec![1u8; 3 * PAGE])?;
    let short_copy = call(&j, &Request::Copy(300)).context("naming 300 pages")?;
    let release = call(
        &j,
        &Request::Release((0..j.capacity.min(1 << 16)).collect()),
    )?;
    let huge = format!("{{\"pad\":\"{}\"}}", "x".repeat(10_000));
    let big_report = call(&j, &Request::Report(huge));
    let max = u64::MAX;
    let lie = json!({ "pages_shared": max, "pages_sharing": max, "zero_pages": max,
                      "worker_cpu_ns": max, "merges": max })
    .to_string();
    call(&j, &Request::Report(lie.clone()))?;
    call(&k, &Request::Report(lie))?;
    let status = call(&j, &Request::Status);
    Ok(json!({
        "short_copy_failed": short_copy == Reply::Slots(vec![proto::FAILED; 300]),
        "release": format!("{release:?}"),
        "big_report": match big_report { Err(ProtoError::OverCap(_)) => "over cap".to_string(),
                                         r => format!("{r:?}") },
        "status_after_lies": matches!(status, Ok(Reply::Text(_))),
    }))
}

/// Vacates of slots a client does not hold (every slot of the store, and one past its end) next
/// to a holder of two copies: the holder's copies keep their bytes. Then the holder vacates one
/// of its own: that one is emptied (it reads zeros), the other kept.
fn vacate_lies(path: &Path, scope: &str) -> Result<Value> {
    let holder = &join(path, scope)?;
    let other = &join(path, scope)?;
    let mut pages = vec![0u8; 2 * PAGE];
    Noise(sys::random_u64()? | 1).page(&mut pages);
    std::fs::File::from(holder.pipe.try_clone()?).write_all(&pages)?;
    let slots = match proto::call(&holder.sock, &Request::CopyFresh(2), None)? {
        (Reply::Slots(s), _) if s.len() == 2 && !s.contains(&proto::FAILED) => s,
        (r, _) => bail!("a copy of two pages was answered {r:?}"),
    };
    let all: Vec<u32> = (0..holder.capacity.min(1 << 16)).collect();
    let every = proto::call(&other.sock, &Request::Vacate(all), None).map(|(r, _)| r);
    let past = proto::call(&other.sock, &Request::Vacate(vec![u32::MAX]), None).map(|(r, _)| r);
    let kept = holder.read_slot(slots[0])? == pages[..PAGE]
        && holder.read_slot(slots[1])? == pages[PAGE..];
    let own = proto::call(&holder.sock, &Request::Vacate(vec![slots[0]]), None).map(|(r, _)| r);
    let emptied = holder.read_slot(slots[0])?.iter().all(|&b| b == 0);
    let other_kept = holder.read_slot(slots[1])? == pages[PAGE..];
    Ok(json!({
        "every_slot": format!("{every:?}"),
        "past_the_end": format!("{past:?}"),
        "holders_copies_kept": kept,
        "own": format!("{own:?}"),
        "own_emptied": emptied,
        "own_other_kept": other_kept,
    }))
}

/// Zero holes asked for by a client that did not make them: a maker copies two pages with a zero
/// page between them (a hole), another asks to hold the copies, the hole, slots past the store's
/// end and more slots than its cap. Then the maker releases all three and copies fresh pages
/// while the other still holds the hole: none of them lands in the hole, which reads zeros.
fn hole_lies(path: &Path, scope: &str) -> Result<Value> {
    let maker = &join(path, scope)?;
    let other = &join(path, scope)?;
    let mut pages = vec![0u8; 3 * PAGE];
    let mut noise = Noise(sys::random_u64()? | 1);
    noise.page(&mut pages[..PAGE]);
    noise.page(&mut pages[2 * PAGE..]);
    std::fs::File::from(maker.pipe.try_clone()?).write_all(&pages)?;
    let s = match proto::call(&maker.sock, &Request::CopyFresh(3), None)? {
        (Reply::Slots(s), _) if s.len() == 3 && !s.contains(&proto::FAILED) => s,
        (r, _) => bail!("a copy of three pages was answered {r:?}"),
    };
    let hold = |slots: Vec<u32>| proto::call(&other.sock, &Request::HoldHoles(slots), None);
    let asked = vec![s[0], s[1], s[2], s[1], maker.capacity, u32::MAX];
    let held = match hold(asked)? {
        (Reply::Slots(got), _) => got,
        (r, _) => bail!("holding holes was answered {r:?}"),
    };
    let over_cap = match hold(vec![s[1]; 1 << 16]) {
        Err(ProtoError::OverCap(_)) => "over cap".to_string(),
        r => format!("{:?}", r.map(|(r, _)| r)),
    };
    let copies_kept =
        other.read_slot(s[0])? == pages[..PAGE] && other.read_slot(s[2])? == pages[2 * PAGE..];
    proto::call(&maker.sock, &Request::Release(s.clone()), None)?;
    let mut fresh = vec![0u8; 64 * PAGE];
    noise.page(&mut fresh);
    std::fs::File::from(maker.pipe.try_clone()?).write_all(&fresh)?;
    let after = match proto::call(&maker.sock, &Request::Copy(64), None)? {
        (Reply::Slots(t), _) => t,
        (r, _) => bail!("a copy of 64 pages was answered {r:?}"),
    };
    Ok(json!({
        "asked": [s[0], s[1], s[2], s[1], maker.capacity, u32::MAX],
        "held": held,
        "over_cap": over_cap,
        "copies_kept": copies_kept,
        "hole_reused_while_held": after.contains(&s[1]),
        "hole_reads_zeros": other.read_slot(s[1])?.iter().all(|&b| b == 0),
    }))
}

/// Connects, does `start`, then waits for the daemon to close the connection: how long it took.
fn closed_after(
    path: &Path,
    start: impl FnOnce(&mut UnixStream) -> std::io::Result<()>,
) -> Result<Value> {
    let mut s = UnixStream::connect(path)?;
    start(&mut s)?;
    let t0 = Instant::now();
    s.set_read_timeout(Some(Duration::from_secs(120)))?;
    let mut buf = [0u8; 64];
    loop {
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(_) => {}
            Err(e) => return Ok(json!({ "error": e.to_string() })),
        }
    }
    Ok(json!({ "closed_after_ms": t0.elapsed().as_millis() as u64 }))
}

/// Sends lookups without reading the replies until its writes stall (the daemon stopped
/// reading: it is stuck writing a reply nobody takes), then reads: whether the daemon had given
/// up on the connection (its end closed: the replies end in end-of-file) and how long after the
/// stall that was seen.
fn closed_after_not_reading(path: &Path) -> Result<Value> {
    let j = join(path, "probe-no-reading")?;
    j.sock.set_write_timeout(Some(Duration::from_secs(5)))?;
    let frame = Request::Lookup((0..proto::MAX_ITEMS as u128).collect()).encode();
    let mut sent = 0;
    while sent < 1000 && (&j.sock).write_all(&frame).is_ok() {
        sent += 1;
    }
    let t0 = Instant::now();
    j.sock.set_read_timeout(Some(Duration::from_secs(30)))?;
    let mut buf = vec![0u8; 1 << 16];
    let closed = loop {
        match (&j.sock).read(&mut buf) {
            Ok(0) => break true,
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => break true,
            Err(_) => break false,
        }
    };
    Ok(json!({ "requests_sent": sent, "closed": closed,
               "closed_after_ms": t0.elapsed().as_millis() as u64 }))
}
