//! The daemon's request handling: the input is a script of moves by up to four clients (two
//! users and root) of an in-process daemon with small caps: connect, greet, send structured or
//! raw frames, put pages into their pipes, leave. After every move the daemon's books must
//! balance and every cap hold (`Harness::check`); a panic or a cap exceeded is a failure.

#![no_main]

use std::io::Write;
use std::os::fd::{AsRawFd, OwnedFd};

use libfuzzer_sys::fuzz_target;
use pageone_daemon::harness::{Client, Harness};
use pageone_daemon::Limits;
use pageone_proto::{Request, VERSION};
use pageone_sys as sys;

const PAGE: usize = sys::PAGE_SIZE;
/// Slots per scope: small, so that stores fill.
const CAPACITY: u32 = 32;

fn limits() -> Limits {
    let mut l = Limits::for_ram(1 << 20);
    l.connections = 4;
    l.connections_per_uid = 3;
    l.pages_per_uid = 24;
    l.pages_per_client = 16;
    l.notes = 64;
    l.notes_per_uid = 48;
    l.notes_per_client = 32;
    l.report_bytes = 256;
    l.in_flight_per_uid = 1;
    l.frame_timeout = std::time::Duration::ZERO;
    l
}

/// Reads the script.
struct Script<'a>(&'a [u8]);

impl Script<'_> {
    fn byte(&mut self) -> Option<u8> {
        let (&b, rest) = self.0.split_first()?;
        self.0 = rest;
        Some(b)
    }
    fn u32(&mut self) -> u32 {
        u32::from(self.byte().unwrap_or(0)) | u32::from(self.byte().unwrap_or(0)) << 8
    }
    fn bytes(&mut self, n: usize) -> &[u8] {
        let n = n.min(self.0.len());
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        a
    }
    /// A hash from a small set, so that clients' contents meet.
    fn hash(&mut self) -> u128 {
        u128::from(self.byte().unwrap_or(0) % 24)
    }
}

struct Conn {
    client: Client,
    /// The write end of the pipe it greeted with, and its read end (kept, as an engine keeps
    /// it: a pipe without readers would raise SIGPIPE when written).
    pipe: Option<(OwnedFd, OwnedFd)>,
}

fn request(s: &mut Script<'_>) -> Request {
    let n = usize::from(s.byte().unwrap_or(0) % 40);
    match s.byte().unwrap_or(0) % 11 {
        0 => Request::Lookup((0..n).map(|_| s.hash()).collect()),
        1 => Request::Copy(s.u32() % 40),
        2 => Request::CopyFresh(s.u32() % 40),
        3 => Request::Release((0..n).map(|_| s.u32() % (CAPACITY + 4)).collect()),
        4 => Request::Forget((0..n).map(|_| s.hash()).collect()),
        5 => Request::Report(format!(
            "{{\"merges\":{},\"pages_shared\":{}}}",
            u64::MAX,
            s.u32()
        )),
        6 => Request::Report("x".repeat(n * 10)),
        7 => Request::Status,
        8 => Request::Vacate((0..n).map(|_| s.u32() % (CAPACITY + 4)).collect()),
        9 => Request::HoldHoles((0..n).map(|_| s.u32() % (CAPACITY + 4)).collect()),
        _ => Request::Goodbye,
    }
}

/// Puts pages into the pipe (each of one byte value, so that contents repeat), as far as it has
/// room; then, mostly, asks for a copy of what the pipe holds.
fn fill_pipe(conn: &mut Conn, s: &mut Script<'_>) {
    let Some((pipe, _)) = &conn.pipe else { return };
    let n = usize::from(s.byte().unwrap_or(0) % 17);
    for _ in 0..n {
        let room = 16 * PAGE - sys::pipe_pending(pipe.as_raw_fd()).unwrap_or(16 * PAGE);
        if room < PAGE {
            break;
        }
        let page = vec![s.byte().unwrap_or(0); PAGE];
        let mut f = std::fs::File::from(pipe.try_clone().expect("dup"));
        f.write_all(&page).expect("room in the pipe");
    }
    let pages = (sys::pipe_pending(pipe.as_raw_fd()).unwrap_or(0) / PAGE) as u32;
    let req = match s.byte().unwrap_or(0) % 3 {
        0 => Request::Copy(pages),
        1 => Request::CopyFresh(pages),
        _ => return,
    };
    let _ = conn.client.frame(&req.encode()[4..], None);
}

fn step(h: &Harness, conns: &mut Vec<Conn>, s: &mut Script<'_>) -> Option<()> {
    let op = s.byte()?;
    let k = usize::from(s.byte().unwrap_or(0)) % conns.len().max(1);
    match op % 7 {
        0 => {
            let uid = [0, 1000, 1001][usize::from(s.byte().unwrap_or(0) % 3)];
            if let Ok(client) = h.connect(uid) {
                conns.push(Conn { client, pipe: None });
            }
        }
        1 if k < conns.len() => {
            let (r, w) = sys::pipe().expect("a pipe");
            let scope = ["a", "b", ""][usize::from(s.byte().unwrap_or(0) % 3)].to_string();
            let hello = Request::Hello {
                version: VERSION,
                scope,
            };
            let reader = r.try_clone().expect("dup");
            let _ = conns[k].client.frame(&hello.encode()[4..], Some(r));
            conns[k].pipe = Some((w, reader));
        }
        2 if k < conns.len() => {
            let req = request(s);
            let _ = conns[k].client.frame(&req.encode()[4..], None);
        }
        3 if k < conns.len() => {
            let n = usize::from(s.byte().unwrap_or(0));
            let body = s.bytes(n).to_vec();
            let _ = conns[k].client.frame(&body, None);
        }
        4 if k < conns.len() => fill_pipe(&mut conns[k], s),
        5 if k < conns.len() => conns.swap_remove(k).client.leave(),
        _ => {}
    }
    Some(())
}

fuzz_target!(|data: &[u8]| {
    let h = Harness::new(limits(), CAPACITY);
    let mut conns = Vec::new();
    let mut s = Script(data);
    while step(&h, &mut conns, &mut s).is_some() {
        if let Err(e) = h.check() {
            panic!("{e}");
        }
    }
    for c in conns {
        c.client.leave();
    }
    if let Err(e) = h.check() {
        panic!("{e}");
    }
    assert!(h.is_empty(), "scopes or connections outlived their clients");
});
