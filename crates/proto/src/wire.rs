//! Frames, requests and replies.

use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use pageone_sys as sys;

/// 5: `OverCap` replies; `Status` shows a caller only its own user's scopes. 6: `Vacate`.
/// 7: zero holes (a zero page copied makes one; `HoldHoles`).
pub const VERSION: u32 = 7;
/// Most records in one request.
pub const MAX_ITEMS: usize = 1 << 16;
/// Largest frame either side accepts.
pub const MAX_FRAME: usize = 16 + MAX_ITEMS * 20 + (1 << 20);
/// Most pages one copy request names.
pub const COPY_PAGES: usize = 1024;

/// Lookup answers other than a slot number.
pub const NOTED: u32 = u32::MAX;
/// Another client of the scope has this content and no copy exists yet: send the bytes.
pub const WANTED: u32 = u32::MAX - 1;
/// A copy could not be made (store full, or the pipe did not hold the page).
pub const FAILED: u32 = u32::MAX - 2;
/// Slot numbers are below this.
pub const MAX_SLOT: u32 = u32::MAX - 16;

const T_HELLO: u32 = 1;
const T_LOOKUP: u32 = 2;
const T_COPY: u32 = 3;
const T_RELEASE: u32 = 4;
const T_REPORT: u32 = 5;
const T_STATUS: u32 = 6;
const T_COPY_FRESH: u32 = 7;
const T_FORGET: u32 = 8;
const T_GOODBYE: u32 = 9;
const T_VACATE: u32 = 10;
const T_HOLD_HOLES: u32 = 11;
const T_WELCOME: u32 = 101;
const T_ANSWERS: u32 = 102;
const T_SLOTS: u32 = 103;
const T_OK: u32 = 104;
const T_TEXT: u32 = 105;
const T_OVER_CAP: u32 = 106;
const T_ERROR: u32 = 199;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    /// First message of a client (with its pipe's read end attached): the scope it asks to join.
    Hello { version: u32, scope: String },
    /// Contents hashes (xxh3-128) of first sightings: which have a copy, which are wanted.
    Lookup(Vec<u128>),
    /// Copy the `n` pages waiting in the client's pipe into the store. A page all zero gets a
    /// zero hole of its own, held for this client: a slot never written (it reads zeros and
    /// takes no memory) and never answered for its content.
    Copy(u32),
    /// Copy the `n` pages waiting in the pipe into new slots even where the store holds their content
    /// already: the client's pages of that content exceed its sharing limit per copy.
    CopyFresh(u32),
    /// Slots this client no longer indexes or maps.
    Release(Vec<u32>),
    /// Slots this client still holds but whose bytes it needs no more: no page of it counts
    /// them, but one may still lie in a mapping of them (written after its merge), so they must
    /// not take other contents until it releases them. A slot every holder vacated is emptied
    /// (punched, out of the index); a later `Release` frees it.
    Vacate(Vec<u32>),
    /// Zero holes (slots a zero page was copied into: they read zeros, take no memory and are
    /// never answered for their content) that this client maps too, between copies it maps
    /// around them: each is held for it as well.
    HoldHoles(Vec<u32>),
    /// Hashes this client looked up earlier whose page it no longer has (written or released):
    /// it wants no copy of them offered, and the daemon stops remembering its note.
    Forget(Vec<u128>),
    /// The client's counters as JSON, for `pageone status`.
    Report(String),
    /// `pageone status`: the daemon's view as JSON (no `Hello` needed): the scopes of the
    /// caller's user (every scope for root).
    Status,
    /// The client maps no copy of the store any more (its engine stopped and made every merged
    /// page private): when the connection ends, its holds go at once, even while its process
    /// lives.
    Goodbye,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// Joined (store descriptor attached): store size in pages, client id, scope name.
    Welcome {
        capacity: u32,
        client: u64,
        scope: String,
    },
    /// Per hash: a slot (held for the client now), [`NOTED`] or [`WANTED`]; and copies made for
    /// content this client noted earlier (already held for it): `(hash, slot)`.
    Answers {
        answers: Vec<u32>,
        offers: Vec<(u128, u32)>,
    },
    /// Per copied page: its slot (held for the client) or [`FAILED`].
    Slots(Vec<u32>),
    Ok,
    Text(String),
    /// The request would take the client or its user over a cap of the daemon (the reason
    /// says which): nothing was done, and the connection goes on.
    OverCap(String),
    Error(String),
}

#[derive(Debug, thiserror::Error)]
pub enum ProtoError {
    #[error("the connection failed")]
    Io(#[from] io::Error),
    #[error("malformed frame: {0}")]
    Malformed(&'static str),
    #[error("the peer closed the connection")]
    Closed,
    #[error("the daemon refused: {0}")]
    Refused(String),
    #[error("over a cap of the daemon: {0}")]
    OverCap(String),
    #[error("the peer took too long")]
    TimedOut,
    #[error("the daemon is not trusted: {0}")]
    Untrusted(String),
    #[error(
        "no default daemon socket: XDG_RUNTIME_DIR is not set (or not absolute) and this is not \
         root; give the socket's path (--socket, or PAGEONE_SOCKET) in a directory of your own"
    )]
    NoDefaultSocket,
    #[error("{path} cannot hold a daemon's socket: it {why}")]
    UnsafePath { path: PathBuf, why: String },
}

struct Enc(Vec<u8>);

impl Enc {
    fn new(tag: u32) -> Self {
        Self::with_room(tag, 56)
    }
    /// With room for `body` bytes after the tag: a frame of tens of thousands of records is
    /// written once into memory made for it, not copied doubling after doubling.
    fn with_room(tag: u32, body: usize) -> Self {
        let mut v = Vec::with_capacity(8 + body);
        v.extend_from_slice(&0u32.to_le_bytes());
        v.extend_from_slice(&tag.to_le_bytes());
        Enc(v)
    }
    fn u32(&mut self, x: u32) -> &mut Self {
        self.0.extend_from_slice(&x.to_le_bytes());
        self
    }
    fn u64(&mut self, x: u64) -> &mut Self {
        self.0.extend_from_slice(&x.to_le_bytes());
        self
    }
    fn u128(&mut self, x: u128) -> &mut Self {
        self.0.extend_from_slice(&x.to_le_bytes());
        self
    }
    /// A count, then the hashes.
    fn hashes(&mut self, hs: &[u128]) -> &mut Self {
        self.u32(hs.len() as u32);
        for &h in hs {
            self.u128(h);
        }
        self
    }
    /// A count, then the slots (what `Dec::slots` reads).
    fn slots(&mut self, ids: &[u32]) -> &mut Self {
        self.u32(ids.len() as u32);
        for &i in ids {
            self.u32(i);
        }
        self
    }
    fn bytes(&mut self, b: &[u8]) -> &mut Self {
        self.u32(b.len() as u32);
        self.0.extend_from_slice(b);
        self
    }
    fn finish(mut self) -> Vec<u8> {
        let n = (self.0.len() - 4) as u32;
        self.0[..4].copy_from_slice(&n.to_le_bytes());
        self.0
    }
}

struct Dec<'a>(&'a [u8]);

impl Dec<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], ProtoError> {
        if self.0.len() < n {
            return Err(ProtoError::Malformed("frame shorter than its contents"));
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    fn u32(&mut self) -> Result<u32, ProtoError> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }
    fn u64(&mut self) -> Result<u64, ProtoError> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
    }
    fn u128(&mut self) -> Result<u128, ProtoError> {
        Ok(u128::from_le_bytes(
            self.take(16)?.try_into().expect("16 bytes"),
        ))
    }
    fn count(&mut self, record: usize) -> Result<usize, ProtoError> {
        let n = self.u32()? as usize;
        if n > MAX_ITEMS || n * record > self.0.len() {
            return Err(ProtoError::Malformed("count beyond the frame or the limit"));
        }
        Ok(n)
    }
    fn hashes(&mut self) -> Result<Vec<u128>, ProtoError> {
        let n = self.count(16)?;
        (0..n).map(|_| self.u128()).collect()
    }
    fn slots(&mut self) -> Result<Vec<u32>, ProtoError> {
        let n = self.count(4)?;
        (0..n).map(|_| self.u32()).collect()
    }
    fn string(&mut self) -> Result<String, ProtoError> {
        let n = self.count(1)?;
        String::from_utf8(self.take(n)?.to_vec()).map_err(|_| ProtoError::Malformed("not UTF-8"))
    }
    fn end(&self) -> Result<(), ProtoError> {
        if self.0.is_empty() {
            Ok(())
        } else {
            Err(ProtoError::Malformed("trailing bytes"))
        }
    }
}

impl Request {
    pub fn encode(&self) -> Vec<u8> {
        match self {
            Request::Hello { version, scope } => {
                let mut e = Enc::new(T_HELLO);
                e.u32(*version).bytes(scope.as_bytes());
                e.finish()
            }
            Request::Lookup(hs) => {
                let mut e = Enc::with_room(T_LOOKUP, 4 + 16 * hs.len());
                e.hashes(hs);
                e.finish()
            }
            Request::Copy(n) => {
                let mut e = Enc::new(T_COPY);
                e.u32(*n);
                e.finish()
            }
            Request::CopyFresh(n) => {
                let mut e = Enc::new(T_COPY_FRESH);
                e.u32(*n);
                e.finish()
            }
            Request::Release(ids) => {
                let mut e = Enc::with_room(T_RELEASE, 4 + 4 * ids.len());
                e.slots(ids);
                e.finish()
            }
            Request::Vacate(ids) => {
                let mut e = Enc::with_room(T_VACATE, 4 + 4 * ids.len());
                e.slots(ids);
                e.finish()
            }
            Request::HoldHoles(ids) => {
                let mut e = Enc::with_room(T_HOLD_HOLES, 4 + 4 * ids.len());
                e.slots(ids);
                e.finish()
            }
            Request::Forget(hs) => {
                let mut e = Enc::with_room(T_FORGET, 4 + 16 * hs.len());
                e.hashes(hs);
                e.finish()
            }
            Request::Report(s) => {
                let mut e = Enc::new(T_REPORT);
                e.bytes(s.as_bytes());
                e.finish()
            }
            Request::Status => Enc::new(T_STATUS).finish(),
            Request::Goodbye => Enc::new(T_GOODBYE).finish(),
        }
    }

    /// Decodes a frame body (after the length word).
    pub fn decode(frame: &[u8]) -> Result<Self, ProtoError> {
        let mut d = Dec(frame);
        let r = match d.u32()? {
            T_HELLO => Request::Hello {
                version: d.u32()?,
                scope: d.string()?,
            },
            T_LOOKUP => Request::Lookup(d.hashes()?),
            T_COPY => Request::Copy(d.u32()?),
            T_COPY_FRESH => Request::CopyFresh(d.u32()?),
            T_RELEASE => Request::Release(d.slots()?),
            T_VACATE => Request::Vacate(d.slots()?),
            T_HOLD_HOLES => Request::HoldHoles(d.slots()?),
            T_FORGET => Request::Forget(d.hashes()?),
            T_REPORT => Request::Report(d.string()?),
            T_STATUS => Request::Status,
            T_GOODBYE => Request::Goodbye,
            _ => return Err(ProtoError::Malformed("unknown request")),
        };
        d.end()?;
        Ok(r)
    }
}

impl Reply {
    pub fn encode(&self) -> Vec<u8> {
        match self {
            Reply::Welcome {
                capacity,
                client,
                scope,
            } => {
                let mut e = Enc::new(T_WELCOME);
                e.u32(*capacity).u64(*client).bytes(scope.as_bytes());
                e.finish()
            }
            Reply::Answers { answers, offers } => {
                let mut e = Enc::with_room(T_ANSWERS, 8 + 4 * answers.len() + 20 * offers.len());
                e.u32(answers.len() as u32);
                for &a in answers {
                    e.u32(a);
                }
                e.u32(offers.len() as u32);
                for &(h, s) in offers {
                    e.u128(h).u32(s);
                }
                e.finish()
            }
            Reply::Slots(s) => {
                let mut e = Enc::with_room(T_SLOTS, 4 + 4 * s.len());
                e.u32(s.len() as u32);
                for &x in s {
                    e.u32(x);
                }
                e.finish()
            }
            Reply::Ok => Enc::new(T_OK).finish(),
            Reply::Text(s) => {
                let mut e = Enc::new(T_TEXT);
                e.bytes(s.as_bytes());
                e.finish()
            }
            Reply::OverCap(s) => {
                let mut e = Enc::new(T_OVER_CAP);
                e.bytes(s.as_bytes());
                e.finish()
            }
            Reply::Error(s) => {
                let mut e = Enc::new(T_ERROR);
                e.bytes(s.as_bytes());
                e.finish()
            }
        }
    }

    pub fn decode(frame: &[u8]) -> Result<Self, ProtoError> {
        let mut d = Dec(frame);
        let r = match d.u32()? {
            T_WELCOME => Reply::Welcome {
                capacity: d.u32()?,
                client: d.u64()?,
                scope: d.string()?,
            },
            T_ANSWERS => {
                let n = d.count(4)?;
                let answers = (0..n).map(|_| d.u32()).collect::<Result<_, _>>()?;
                let m = d.count(20)?;
                let offers = (0..m)
                    .map(|_| Ok((d.u128()?, d.u32()?)))
                    .collect::<Result<_, ProtoError>>()?;
                Reply::Answers { answers, offers }
            }
            T_SLOTS => {
                let n = d.count(4)?;
                Reply::Slots((0..n).map(|_| d.u32()).collect::<Result<_, _>>()?)
            }
            T_OK => Reply::Ok,
            T_TEXT => Reply::Text(d.string()?),
            T_OVER_CAP => Reply::OverCap(d.string()?),
            T_ERROR => Reply::Error(d.string()?),
            _ => return Err(ProtoError::Malformed("unknown reply")),
        };
        d.end()?;
        Ok(r)
    }
}

/// How long a peer may take over one frame (`None`: no limit).
#[derive(Clone, Copy, Debug, Default)]
pub struct Deadlines {
    /// Until the first byte of the next frame arrives.
    pub idle: Option<Duration>,
    /// From a frame's first byte to its last, reading; from its first to its last, writing.
    pub frame: Option<Duration>,
}

/// Writes one encoded frame, with `fd` attached when given.
pub fn write_frame(
    sock: &UnixStream,
    frame: &[u8],
    fd: Option<&OwnedFd>,
) -> Result<(), ProtoError> {
    match fd {
        Some(f) => sys::send_with_fd(sock.as_raw_fd(), frame, Some(f.as_raw_fd()))?,
        None => (&*sock).write_all(frame)?,
    }
    Ok(())
}

/// Bytes of a frame sent with its descriptor (the rest follows under the deadline).
const FIRST_BYTES: usize = 64;

/// [`write_frame`] within `limit`, however slowly the peer reads: a peer that stops reading
/// costs the writer that long, not forever. (Sets the socket's write timeout.)
pub fn write_frame_within(
    sock: &UnixStream,
    frame: &[u8],
    fd: Option<&OwnedFd>,
    limit: Option<Duration>,
) -> Result<(), ProtoError> {
    let Some(limit) = limit else {
        return write_frame(sock, frame, fd);
    };
    let deadline = Instant::now() + limit;
    sock.set_write_timeout(Some(limit))?;
    let first = frame.len().min(FIRST_BYTES);
    sys::send_with_fd(sock.as_raw_fd(), &frame[..first], fd.map(|f| f.as_raw_fd()))
        .map_err(timed_out)?;
    let mut done = first;
    while done < frame.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(ProtoError::TimedOut);
        }
        sock.set_write_timeout(Some(left))?;
        match (&*sock).write(&frame[done..]) {
            Ok(0) => return Err(ProtoError::Closed),
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(timed_out(e)),
        }
    }
    Ok(())
}

/// Reads one frame body (tag and contents) and the descriptor attached to it, if any.
pub fn read_frame(sock: &UnixStream) -> Result<(Vec<u8>, Option<OwnedFd>), ProtoError> {
    read_frame_within(sock, &Deadlines::default())
}

/// Bytes a frame's buffer grows by as they arrive: a peer that announces a large frame and
/// sends nothing costs no memory.
const READ_STEP: usize = 64 << 10;

/// [`read_frame`] within `deadlines`: a peer that sends nothing for `idle`, or stops in the
/// middle of a frame (or trickles it) for longer than `frame`, ends in [`ProtoError::TimedOut`].
/// (Sets the socket's read timeout when a deadline is given.)
pub fn read_frame_within(
    sock: &UnixStream,
    deadlines: &Deadlines,
) -> Result<(Vec<u8>, Option<OwnedFd>), ProtoError> {
    if deadlines.idle.is_some() || deadlines.frame.is_some() {
        sock.set_read_timeout(deadlines.idle)?;
    }
    let mut len = [0u8; 4];
    let (n, fd) = sys::recv_with_fd(sock.as_raw_fd(), &mut len).map_err(timed_out)?;
    if n == 0 {
        return Err(ProtoError::Closed);
    }
    let deadline = deadlines.frame.map(|t| Instant::now() + t);
    if deadline.is_none() && deadlines.idle.is_some() {
        sock.set_read_timeout(None)?;
    }
    read_within(sock, &mut len[n..], deadline)?;
    let len = u32::from_le_bytes(len) as usize;
    if !(4..=MAX_FRAME).contains(&len) {
        return Err(ProtoError::Malformed("frame length out of bounds"));
    }
    let mut body = Vec::new();
    while body.len() < len {
        let at = body.len();
        body.resize(at + (len - at).min(READ_STEP), 0);
        read_within(sock, &mut body[at..], deadline)?;
    }
    Ok((body, fd))
}

/// Fills `buf` from `sock` before `deadline`.
fn read_within(
    sock: &UnixStream,
    buf: &mut [u8],
    deadline: Option<Instant>,
) -> Result<(), ProtoError> {
    let mut done = 0;
    while done < buf.len() {
        if let Some(d) = deadline {
            let left = d.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(ProtoError::TimedOut);
            }
            sock.set_read_timeout(Some(left))?;
        }
        match (&*sock).read(&mut buf[done..]) {
            Ok(0) => return Err(ProtoError::Closed),
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(timed_out(e)),
        }
    }
    Ok(())
}

/// A socket timeout's error as [`ProtoError::TimedOut`].
fn timed_out(e: io::Error) -> ProtoError {
    match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => ProtoError::TimedOut,
        _ => ProtoError::Io(e),
    }
}

/// Sends a request and reads its reply (an `Error` reply becomes [`ProtoError::Refused`]).
pub fn call(
    sock: &UnixStream,
    req: &Request,
    fd: Option<&OwnedFd>,
) -> Result<(Reply, Option<OwnedFd>), ProtoError> {
    write_frame(sock, &req.encode(), fd)?;
    let (body, fd) = read_frame(sock)?;
    match Reply::decode(&body)? {
        Reply::Error(s) => Err(ProtoError::Refused(s)),
        Reply::OverCap(s) => Err(ProtoError::OverCap(s)),
        r => Ok((r, fd)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_and_replies_round_trip() {
        let reqs = [
            Request::Hello {
                version: VERSION,
                scope: "vm".into(),
            },
            Request::Lookup(vec![1, u128::MAX, 7]),
            Request::Copy(12),
            Request::CopyFresh(3),
            Request::Release(vec![3, 4]),
            Request::Vacate(vec![5, 6, 7]),
            Request::HoldHoles(vec![8, 9]),
            Request::Forget(vec![5, u128::MAX]),
            Request::Report("{}".into()),
            Request::Status,
            Request::Goodbye,
        ];
        for r in reqs {
            let f = r.encode();
            assert_eq!(
                u32::from_le_bytes(f[..4].try_into().unwrap()) as usize,
                f.len() - 4
            );
            assert_eq!(Request::decode(&f[4..]).unwrap(), r);
        }
        let reps = [
            Reply::Welcome {
                capacity: 9,
                client: 3,
                scope: "s".into(),
            },
            Reply::Answers {
                answers: vec![NOTED, 5, WANTED],
                offers: vec![(9, 1)],
            },
            Reply::Slots(vec![1, FAILED]),
            Reply::Ok,
            Reply::Text("x".into()),
            Reply::OverCap("cap".into()),
            Reply::Error("no".into()),
        ];
        for r in reps {
            let f = r.encode();
            assert_eq!(Reply::decode(&f[4..]).unwrap(), r);
        }
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::SmallRng::seed_from_u64(1);
        for _ in 0..20000 {
            let n = rng.gen_range(0..64);
            let mut f: Vec<u8> = (0..n).map(|_| rng.gen()).collect();
            if n >= 4 && rng.gen_bool(0.5) {
                f[..4].copy_from_slice(&rng.gen_range(1u32..9).to_le_bytes());
            }
            let _ = Request::decode(&f);
            let _ = Reply::decode(&f);
        }
        // A count claiming more records than the frame holds is refused before allocating.
        let mut f = T_LOOKUP.to_le_bytes().to_vec();
        f.extend_from_slice(&u32::MAX.to_le_bytes());
        assert!(Request::decode(&f).is_err());
    }

    /// A peer that stops in the middle of a frame, or trickles it, or sends nothing, costs the
    /// reader its deadline, not forever.
    #[test]
    fn a_stalled_or_trickling_frame_times_out() {
        let d = Deadlines {
            idle: Some(Duration::from_millis(300)),
            frame: Some(Duration::from_millis(300)),
        };
        let (a, b) = UnixStream::pair().unwrap();
        let t0 = Instant::now();
        assert!(matches!(
            read_frame_within(&a, &d),
            Err(ProtoError::TimedOut)
        ));
        assert!(t0.elapsed() < Duration::from_secs(2));
        // Half a frame, then nothing.
        let frame = Request::Lookup(vec![1, 2, 3]).encode();
        (&b).write_all(&frame[..10]).unwrap();
        let t0 = Instant::now();
        assert!(matches!(
            read_frame_within(&a, &d),
            Err(ProtoError::TimedOut)
        ));
        assert!(t0.elapsed() < Duration::from_secs(2));
        // A byte every 100 ms: each read is quick, the frame is not.
        let (a, b) = UnixStream::pair().unwrap();
        let trickle = std::thread::spawn(move || {
            for &byte in &frame {
                if (&b).write_all(&[byte]).is_err() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        });
        let t0 = Instant::now();
        assert!(matches!(
            read_frame_within(&a, &d),
            Err(ProtoError::TimedOut)
        ));
        assert!(t0.elapsed() < Duration::from_secs(2));
        drop(a);
        trickle.join().unwrap();
    }

    /// Within its deadlines a frame arrives whole, with its descriptor.
    #[test]
    fn frames_within_deadlines_arrive() {
        let d = Deadlines {
            idle: Some(Duration::from_secs(5)),
            frame: Some(Duration::from_secs(5)),
        };
        let (a, b) = UnixStream::pair().unwrap();
        let (r, _w) = sys::pipe().unwrap();
        let req = Request::Lookup((0..40000).collect());
        let sender = std::thread::spawn(move || {
            write_frame_within(&b, &req.encode(), Some(&r), Some(Duration::from_secs(5))).unwrap();
            req
        });
        let (body, fd) = read_frame_within(&a, &d).unwrap();
        let req = sender.join().unwrap();
        assert_eq!(Request::decode(&body).unwrap(), req);
        assert!(fd.is_some());
    }

    /// A peer that never reads costs the writer its deadline.
    #[test]
    fn a_peer_that_stops_reading_times_the_writer_out() {
        let (a, _b) = UnixStream::pair().unwrap();
        let big = Reply::Slots(vec![7; MAX_ITEMS]).encode();
        let t0 = Instant::now();
        let mut r = Ok(());
        for _ in 0..64 {
            r = write_frame_within(&a, &big, None, Some(Duration::from_millis(300)));
            if r.is_err() {
                break;
            }
        }
        assert!(matches!(r, Err(ProtoError::TimedOut)), "{r:?}");
        assert!(t0.elapsed() < Duration::from_secs(3));
    }
}
