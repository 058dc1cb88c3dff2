//! The client side of `pageone daemon`: a scope's store shared by several processes.
//!
//! The daemon writes stable copies; this process only reads the store (its descriptor is
//! read-only, and a private mapping of it still copies on write). To add content it hands the
//! pages to a pipe whose read end the daemon holds (`vmsplice`: by reference, so the only copy
//! is the one the daemon makes into the store) and asks the daemon to copy them; lookups of content other
//! processes may have are by xxh3-128 hash, answered with a slot that the daemon then *holds* for
//! this process (never freed or reused while held). Every merge is still verified byte for byte
//! on frozen bytes, so a wrong answer costs a merge, never a write.
//!
//! The daemon is authenticated before anything is sent to it beyond the greeting: it must run
//! as root, as this process's user or as the system daemon's user (`SO_PEERCRED`), and the store
//! it hands over must be that user's, writable by nobody else, open read-only, sealed and of the
//! size announced (`proto::store::check`). Anything else is no daemon: the engine runs alone.
//!
//! Over a cap of the daemon (`OverCap`: its store pages, its report's size, its user's requests
//! in flight), this process merges less: copies are not asked for during [`OVER_CAP_PAUSE`],
//! lookups and adoptions of existing copies go on; nothing is lost or unmerged.
//!
//! If the daemon goes away, the process keeps its merged pages (its mappings keep the store
//! alive) and runs unshared: no new copies, releases are dropped, [`Remote::is_lost`] says so.
//! The engine asks for a daemon again every second and, when one answers, moves to its store
//! with a new `Remote` (see `join_again` in the engine).
//!
//! A `Remote` is shared by the classifier (lookups and copies, made without the engine's state
//! lock) and the holders of that lock (releases); one request is on the socket at a time.

use pageone_sync::lock;
use std::collections::HashSet;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use pageone_sys as sys;

use crate::proto::{self, ProtoError, Reply, Request};
use crate::{DaemonError, EngineError};

const PAGE: usize = sys::PAGE_SIZE;
/// How long the daemon may take to answer the greeting.
const HELLO_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);
/// How long copies are not asked for after the daemon said a copy would pass a cap.
pub(crate) const OVER_CAP_PAUSE: Duration = Duration::from_secs(5);
/// The pipe capacity asked for: `/proc/sys/fs/pipe-max-size`'s default, which any user may have.
const PIPE_BYTES: usize = 1 << 20;

/// Copies made for content this process noted: `(hash, slot)`, each held for it.
pub(crate) type Offers = Vec<(u128, u32)>;

pub(crate) struct Remote {
    /// The connection; locked for each request and its reply (and the pipe with it).
    sock: Mutex<UnixStream>,
    /// Its descriptor, for [`Remote::peer_closed`] (valid as long as `sock`).
    sock_fd: std::os::fd::RawFd,
    /// The write end of the pipe the daemon copies from.
    pipe: OwnedFd,
    /// Its read end, kept so the pipe always has a reader (writing to a pipe nobody reads raises
    /// `SIGPIPE`, which would kill a host program that keeps the default action when the daemon
    /// dies) and to drop what a daemon left in it.
    pipe_reader: OwnedFd,
    /// Pages the pipe holds: the most handed over per copy request.
    pipe_pages: usize,
    client: u64,
    pub(crate) scope: String,
    lost: AtomicBool,
    /// Slots to release at the next flush (a set, so that a slot granted again before the flush
    /// is simply kept: the daemon's holds are a set per client, not a count).
    releases: Mutex<HashSet<u32>>,
    /// Slots to vacate at the next flush (see [`Remote::vacate`]).
    vacates: Mutex<HashSet<u32>>,
    /// Slots vacated and not granted again since: a grant the daemon made before it took the
    /// vacate is not usable (see [`Remote::is_vacated`]).
    vacated: Mutex<HashSet<u32>>,
    /// Looked-up hashes whose page is gone, to send at the next flush.
    forgets: Mutex<Vec<u128>>,
    capacity: u32,
    /// Until when copies are not asked for (the daemon said this process is over a cap).
    copies_paused: Mutex<Option<Instant>>,
    /// Whether an `OverCap` was logged already (once per connection at `warn`).
    over_cap_seen: AtomicBool,
    /// Hashes were forgotten since the last lookup: copies the daemon made for them before it
    /// took the forget may wait there as offers, each a slot held for this process, until a
    /// lookup fetches them (see [`Remote::offers_may_wait`]).
    forgot_since_lookup: AtomicBool,
}

impl Remote {
    /// Joins the daemon at `path` asking for `scope`. Returns the connection, the store's
    /// read-only descriptor and its size in pages.
    pub(crate) fn connect(path: &Path, scope: &str) -> Result<(Self, OwnedFd, u32), EngineError> {
        let refused = |e: ProtoError| EngineError::Daemon(DaemonError::Greeting(e));
        let sock =
            UnixStream::connect(path).map_err(|e| EngineError::Daemon(DaemonError::Connect(e)))?;
        // Who answers, before anything goes to it.
        let daemon = proto::auth::check_daemon(&sock).map_err(refused)?;
        let (pipe_r, pipe) = sys::pipe().map_err(EngineError::Store)?;
        let pipe_pages = sys::set_pipe_capacity(pipe.as_raw_fd(), PIPE_BYTES)
            .map_err(EngineError::Store)?
            / PAGE;
        let pipe_pages = pipe_pages.clamp(1, proto::COPY_PAGES);
        let hello = Request::Hello {
            version: proto::VERSION,
            scope: scope.to_string(),
        };
        // A daemon that accepts but never answers must not hold the engine: the greeting has a
        // deadline (later calls have none; a daemon that hangs mid-call costs merges only).
        let set_timeout = |t| {
            sock.set_read_timeout(t)
                .and_then(|()| sock.set_write_timeout(t))
                .map_err(|e| EngineError::Daemon(DaemonError::Timeout(e)))
        };
        set_timeout(Some(HELLO_TIMEOUT))?;
        let (reply, fd) = proto::call(&sock, &hello, Some(&pipe_r)).map_err(refused)?;
        set_timeout(None)?;
        let (
            Reply::Welcome {
                capacity,
                client,
                scope,
            },
            Some(store),
        ) = (reply, fd)
        else {
            return Err(EngineError::Daemon(DaemonError::NoStore));
        };
        if capacity == 0 || capacity > proto::MAX_SLOT {
            return Err(EngineError::Daemon(DaemonError::UnusableStore));
        }
        let expected = proto::store::Expected {
            owner: daemon.uid,
            capacity,
        };
        proto::store::check(store.as_raw_fd(), &expected)
            .map_err(|e| EngineError::Daemon(DaemonError::StoreRefused(e)))?;
        tracing::info!(client, %scope, capacity, "joined the pageone daemon");
        Ok((
            Self {
                sock_fd: sock.as_raw_fd(),
                sock: Mutex::new(sock),
                pipe,
                pipe_reader: pipe_r,
                pipe_pages,
                client,
                scope,
                lost: AtomicBool::new(false),
                releases: Mutex::new(HashSet::new()),
                vacates: Mutex::new(HashSet::new()),
                vacated: Mutex::new(HashSet::new()),
                forgets: Mutex::new(Vec::new()),
                capacity,
                copies_paused: Mutex::new(None),
                over_cap_seen: AtomicBool::new(false),
                forgot_since_lookup: AtomicBool::new(false),
            },
            store,
            capacity,
        ))
    }

    /// Whether the daemon closed the connection (it died or was stopped), asked without waiting
    /// and without the socket's lock (a request under way finds out itself): then the link is
    /// lost, as a failed call finds it. For an idle engine, which calls the daemon only when it
    /// wakes.
    pub(crate) fn peer_closed(&self) -> bool {
        if !self.is_lost() && sys::peer_closed(self.sock_fd) {
            self.mark_lost(&"the daemon closed the connection");
        }
        self.is_lost()
    }

    /// The link is lost (`why`): every later call fails at once, and the engine joins a daemon
    /// again when it can.
    fn mark_lost(&self, why: &dyn std::fmt::Display) {
        tracing::warn!(error = %why, client = self.client, "lost the pageone daemon; running unshared (merged pages stay merged)");
        // Relaxed: see is_lost.
        self.lost.store(true, Ordering::Relaxed);
    }

    pub(crate) fn is_lost(&self) -> bool {
        // Relaxed: a flag that only ever goes from false to true; a stale read costs one more
        // failing call.
        self.lost.load(Ordering::Relaxed)
    }

    fn call(&self, sock: &UnixStream, req: &Request) -> Option<Reply> {
        if self.is_lost() {
            return None;
        }
        match proto::call(sock, req, None) {
            Ok((r, _)) => Some(r),
            Err(ProtoError::OverCap(why)) => {
                self.over_cap(req, &why);
                None
            }
            Err(e) => {
                self.mark_lost(&e);
                None
            }
        }
    }

    /// The daemon refused `req` at a cap: this process merges less for a while (no copies),
    /// and stays joined.
    fn over_cap(&self, req: &Request, why: &str) {
        if matches!(req, Request::Copy(_) | Request::CopyFresh(_)) {
            *lock(&self.copies_paused) = Some(Instant::now() + OVER_CAP_PAUSE);
        }
        // Relaxed: only decides the log level of the message.
        if !self.over_cap_seen.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                client = self.client,
                why,
                "over a cap of the pageone daemon; merging less"
            );
        } else {
            tracing::debug!(
                client = self.client,
                why,
                "over a cap of the pageone daemon"
            );
        }
    }

    /// Whether copies are paused (see [`Remote::over_cap`]).
    fn copies_paused(&self) -> bool {
        let mut until = lock(&self.copies_paused);
        match *until {
            Some(t) if Instant::now() < t => true,
            Some(_) => {
                *until = None;
                false
            }
            None => false,
        }
    }

    fn valid(&self, slot: u32) -> bool {
        slot < self.capacity
    }

    /// Answers per hash (a held slot, [`proto::NOTED`] or [`proto::WANTED`]) and offers. `None`
    /// when the daemon is gone.
    pub(crate) fn lookup(&self, hashes: &[u128]) -> Option<(Vec<u32>, Offers)> {
        let sock = lock(&self.sock);
        // Relaxed: set and cleared with the socket held (see `flush`), which orders them.
        self.forgot_since_lookup.store(false, Ordering::Relaxed);
        let mut answers = Vec::with_capacity(hashes.len());
        let mut offers = Vec::new();
        // Even with nothing to look up, one call fetches the offers.
        let mut chunks: Vec<&[u128]> = hashes.chunks(proto::MAX_ITEMS).collect();
        if chunks.is_empty() {
            chunks.push(&[]);
        }
        for chunk in chunks {
            match self.call(&sock, &Request::Lookup(chunk.to_vec()))? {
                Reply::Answers {
                    answers: a,
                    offers: o,
                } if a.len() == chunk.len() => {
                    answers.extend(a.into_iter().map(|s| {
                        if s == proto::NOTED || s == proto::WANTED || self.valid(s) {
                            s
                        } else {
                            proto::NOTED
                        }
                    }));
                    self.granted(&answers[answers.len() - chunk.len()..]);
                    offers.extend(o.into_iter().filter(|&(_, s)| self.valid(s)));
                }
                _ => return self.protocol_error(),
            }
        }
        Some((answers, offers))
    }

    /// Copies the pages at `srcs` into the store; per page its held slot or `None`. With `fresh`,
    /// every page gets a new slot even where the store holds its content already.
    pub(crate) fn copy(&self, srcs: &[usize], fresh: bool) -> Vec<Option<u32>> {
        let sock = lock(&self.sock);
        let mut out = Vec::with_capacity(srcs.len());
        if self.is_lost() || self.copies_paused() {
            out.resize(srcs.len(), None);
            return out;
        }
        let mut rest = srcs;
        while !rest.is_empty() {
            let chunk = &rest[..rest.len().min(self.pipe_pages)];
            // The request's pages must be all the pipe holds: drop anything a daemon left.
            let reader = self.pipe_reader.as_raw_fd();
            if let Ok(left @ 1..) = sys::pipe_pending(reader) {
                let _ = sys::drain_pipe(reader, left);
            }
            // The daemon copies what the pages hold when it reads the pipe (they may be
            // changing: it hashes what it copied, and merges are verified on frozen bytes).
            let taken = match sys::vmsplice_pages(self.pipe.as_raw_fd(), chunk) {
                Ok(n) => n,
                Err(e) => {
                    tracing::warn!(error = %e, "pages could not be handed to the daemon");
                    0
                }
            };
            if taken == 0 {
                // The chunk's first page is unreadable: these copies fail.
                out.extend(chunk.iter().map(|_| None));
                rest = &rest[chunk.len()..];
                continue;
            }
            let n = taken as u32;
            let req = if fresh {
                Request::CopyFresh(n)
            } else {
                Request::Copy(n)
            };
            match self.call(&sock, &req) {
                Some(Reply::Slots(s)) if s.len() == taken => {
                    self.granted(&s);
                    out.extend(s.into_iter().map(|s| self.valid(s).then_some(s)));
                }
                reply => {
                    if reply.is_some() {
                        self.protocol_error::<()>();
                    }
                    out.extend(rest.iter().map(|_| None));
                    break;
                }
            }
            rest = &rest[taken..];
        }
        out
    }

    /// Has the daemon hold zero holes `slots` (made for another process) for this process
    /// too: per slot, `Some` where it did (the slot is a zero hole).
    pub(crate) fn hold_holes(&self, slots: &[u32]) -> Vec<Option<u32>> {
        let sock = lock(&self.sock);
        let mut out = Vec::with_capacity(slots.len());
        for chunk in slots.chunks(proto::MAX_ITEMS) {
            match self.call(&sock, &Request::HoldHoles(chunk.to_vec())) {
                Some(Reply::Slots(s)) if s.len() == chunk.len() => {
                    self.granted(&s);
                    out.extend(
                        chunk
                            .iter()
                            .zip(s)
                            .map(|(&want, got)| (got == want).then_some(got)),
                    );
                }
                reply => {
                    if reply.is_some() {
                        self.protocol_error::<()>();
                    }
                    break;
                }
            }
        }
        out.resize(slots.len(), None);
        out
    }

    /// A slot granted again before its release (or vacate) was sent stays held.
    pub(crate) fn keep(&self, slot: u32) {
        lock(&self.releases).remove(&slot);
        lock(&self.vacates).remove(&slot);
    }

    pub(crate) fn release(&self, slot: u32) {
        lock(&self.vacates).remove(&slot);
        lock(&self.vacated).remove(&slot);
        if !self.is_lost() {
            lock(&self.releases).insert(slot);
        }
    }

    /// Tells the daemon at the next flush that this process still holds `slot` but needs its
    /// bytes no more (no page counts it; one may still lie in a mapping of it).
    pub(crate) fn vacate(&self, slot: u32) {
        if !self.is_lost() {
            lock(&self.vacates).insert(slot);
        }
    }

    /// Whether `slot` was vacated and not granted again since: an answer naming it that came
    /// before the vacate went out is stale (the daemon may empty the slot), so the slot is not
    /// merged onto. (A grant after the vacate makes the hold whole again at the daemon.)
    pub(crate) fn is_vacated(&self, slot: u32) -> bool {
        lock(&self.vacated).contains(&slot)
    }

    /// Slots in a reply the daemon just sent (held whole for this process again). Called with
    /// the socket held, so no vacate goes out meanwhile.
    fn granted(&self, slots: &[u32]) {
        let mut vacated = lock(&self.vacated);
        if !vacated.is_empty() {
            for s in slots {
                vacated.remove(s);
            }
        }
    }

    /// Tells the daemon at the next flush that this process no longer has pages of these hashes.
    pub(crate) fn forget(&self, hashes: Vec<u128>) {
        if !self.is_lost() && !hashes.is_empty() {
            lock(&self.forgets).extend(hashes);
        }
    }

    /// Sends the pending releases and forgotten hashes. Those the daemon did not take (its
    /// user's requests in flight were at their cap) wait for the next flush.
    pub(crate) fn flush(&self) {
        let vacates: Vec<u32> = lock(&self.vacates).drain().collect();
        let all: Vec<u32> = lock(&self.releases).drain().collect();
        let forgets = std::mem::take(&mut *lock(&self.forgets));
        if vacates.is_empty() && all.is_empty() && forgets.is_empty() {
            return;
        }
        let sock = lock(&self.sock);
        let requests = vacates
            .chunks(proto::MAX_ITEMS)
            .map(|c| Request::Vacate(c.to_vec()))
            .chain(
                all.chunks(proto::MAX_ITEMS)
                    .map(|c| Request::Release(c.to_vec())),
            )
            .chain(
                forgets
                    .chunks(proto::MAX_ITEMS)
                    .map(|c| Request::Forget(c.to_vec())),
            );
        let mut failed = false;
        for req in requests {
            failed = failed || !matches!(self.call(&sock, &req), Some(Reply::Ok));
            if !failed {
                match &req {
                    Request::Vacate(slots) => lock(&self.vacated).extend(slots),
                    // Relaxed: see `lookup`.
                    Request::Forget(_) => self.forgot_since_lookup.store(true, Ordering::Relaxed),
                    _ => {}
                }
            } else if !self.is_lost() {
                match req {
                    Request::Vacate(slots) => lock(&self.vacates).extend(slots),
                    Request::Release(slots) => lock(&self.releases).extend(slots),
                    Request::Forget(hashes) => lock(&self.forgets).extend(hashes),
                    _ => {}
                }
            }
        }
    }

    /// Whether offers may wait at the daemon for hashes this process forgot: its pages of them
    /// went (unregistered, handed to the kernel's KSM, rewritten) after the daemon noted them,
    /// and a copy another process made meanwhile was offered here. An engine that looks nothing
    /// up any more (all its memory gone or idle) would leave those slots held, and their pages
    /// allocated in the store, for as long as it lives: it fetches them with an empty lookup
    /// (see `period::fetch_offers_for_forgotten`).
    pub(crate) fn offers_may_wait(&self) -> bool {
        // Relaxed: a hint; the lookup that acts on it takes the socket.
        self.forgot_since_lookup.load(Ordering::Relaxed) && !self.is_lost()
    }

    /// Tells the daemon that this process maps none of its copies any more, so that it frees
    /// them when the connection ends (else it keeps them until the process exits).
    pub(crate) fn goodbye(&self) {
        let sock = lock(&self.sock);
        let _ = self.call(&sock, &Request::Goodbye);
    }

    /// Hands the daemon this process's counters (JSON) for `pageone status`.
    pub(crate) fn report(&self, json: String) {
        let sock = lock(&self.sock);
        let _ = self.call(&sock, &Request::Report(json));
    }

    fn protocol_error<T>(&self) -> Option<T> {
        tracing::warn!("the pageone daemon answered out of protocol; running unshared");
        // Relaxed: see is_lost.
        self.lost.store(true, Ordering::Relaxed);
        None
    }
}
