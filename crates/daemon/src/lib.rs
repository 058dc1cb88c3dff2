//! `pageone daemon`: shares stable copies between the processes of one scope.
//!
//! # Design
//!
//! A process can only remap its own memory, so every process runs its own engine; what the
//! daemon owns is what is shared. Per scope it keeps one store (a sealed memfd that only the daemon
//! writes; clients get it re-opened read-only) and an index of the copies in it by xxh3-128 hash
//! of the bytes *the daemon copied*. Clients ask in batches (one round trip per up to 64 Ki
//! hashes or 1 Ki copied pages, never one per page):
//!
//! * `Lookup(hashes)`: per hash, a slot with that content (now *held* for the client), `WANTED`
//!   (another client noted this content and no copy exists: send the bytes) or `NOTED`;
//! * `Copy(n)`: copy the `n` pages waiting in the client's pipe into new slots. The client
//!   `vmsplice`s its pages into the pipe (by reference) and the daemon `splice`s them into the
//!   store, so the one copy is the store's and no bytes pass through the daemon's memory. The
//!   pipe must hold exactly `n` pages, else the request's copies fail and the pipe is emptied;
//!   the daemon never waits on it. The daemon hashes what the store then holds, and identical
//!   content already stored is answered with the existing slot. Clients that noted the content
//!   get it *offered*.
//! * `CopyFresh(n)`: the same without the deduplication, for a copy that must be another one:
//!   the client already maps `max_sharing` pages onto the existing copy of that content.
//! * `Release(slots)`: the client neither maps nor indexes them any more.
//! * `Forget(hashes)`: the client's pages of these contents are gone (written or released): its
//!   notes of them are dropped, so notes stay as many as the clients' live first sightings.
//!
//! A slot is freed (hole punched, index entry removed) when no client holds it. Holds are a set
//! per client, so a client can only drop its own; when a client's socket closes (exit or
//! `kill -9`) its holds are dropped. The daemon checks that the client's process is gone (a
//! pidfd). A connection lost while the process lives keeps its holds until the process exits,
//! unless the client said `Goodbye` (its engine stopped and made its pages private). If the
//! daemon dies, clients keep their merged pages (their mappings keep the memfd alive) and run
//! unshared.
//!
//! # Scopes and trust
//!
//! The scope a client joins is `(peer uid, requested name)` from `SO_PEERCRED`: clients of
//! different users never share a copy, whatever name they ask for. Within a scope clients do not
//! trust each other: a copy cannot be changed once stored (read-only descriptor; private mappings
//! copy on write), every merge is verified by the merging client on frozen bytes, every count and
//! slot a client sends is bounds-checked, and a malformed frame ends only that client's
//! connection.

mod contents;

use pageone_sync::lock;
use std::collections::HashMap;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use pageone_proto::{self as proto, ProtoError, Reply, Request};
use pageone_sys as sys;

use contents::{Contents, Found, Seeded, SlotSet, NOTE};

const PAGE: usize = sys::PAGE_SIZE;
/// First sightings remembered by the daemon, all scopes together (beyond this, new ones are not
/// noted: fewer merges; about 1 GiB of notes).
const MAX_NOTED: usize = 1 << 24;
/// Offers waiting for one client.
const MAX_OFFERS: usize = 1 << 20;
/// Offers whose memory a connection keeps for the next ones (512 KiB).
const KEPT_OFFERS: usize = 1 << 14;
/// How long a client asked for a copy has to make it before another client is asked.
const WANTED_GRACE: std::time::Duration = std::time::Duration::from_secs(3);
/// Connections served at once (each has a thread); more wait in the listen backlog.
const MAX_CONNECTIONS: usize = 1024;

#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error("the socket {path} could not be bound")]
    Bind {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("another daemon is serving {0}")]
    InUse(PathBuf),
    #[error("the scope's store could not be created")]
    Store(#[source] io::Error),
}

/// Daemon settings.
#[derive(Clone, Debug)]
pub struct DaemonConfig {
    pub socket: PathBuf,
    /// Store size per scope, in pages (virtual: only live copies use memory). Default: RAM.
    pub capacity_pages: u32,
    /// Exit once the last client has left (for a private daemon of one process tree).
    pub exit_when_idle: bool,
}

impl DaemonConfig {
    pub fn new(socket: PathBuf) -> Self {
        let ram = sys::meminfo_kib("MemTotal").unwrap_or(16 << 20) * 1024;
        Self {
            socket,
            capacity_pages: (ram / PAGE as u64).min(proto::MAX_SLOT as u64) as u32,
            exit_when_idle: false,
        }
    }
}

struct Client {
    pid: i32,
    /// False once its connection ended while its process lives (see `serve`).
    connected: bool,
    held: SlotSet,
    offers: Vec<(u128, u32)>,
    report: Option<serde_json::Value>,
    /// (when, merges) of the previous report, and the merge rate it gave.
    last: Option<(Instant, u64)>,
    merges_per_sec: f64,
}

struct ScopeState {
    contents: Contents,
    holders: Vec<u32>,
    free: Vec<u32>,
    bump: u32,
    live: u64,
    noted_entries: usize,
    /// Notes of every scope of the daemon (for [`MAX_NOTED`]).
    noted_total: Arc<AtomicUsize>,
    clients: HashMap<u64, Client, Seeded>,
    copies_made: u64,
    born: Instant,
}

struct Scope {
    name: String,
    uid: u32,
    fd: OwnedFd,
    capacity: u32,
    state: Mutex<ScopeState>,
    /// Held while copying into the store. The kernel serializes writes to one file on its inode
    /// lock, and a writer that finds it taken spins while the holder runs: with this lock the
    /// daemon's other client threads sleep instead and leave the CPU to the clients.
    writing: Mutex<()>,
}

/// Pages copied into the store, then read back and hashed, per step (64 KiB: the read-back
/// finds them in the cache).
const HASH_CHUNK: usize = 16;

impl Scope {
    fn new(
        name: String,
        uid: u32,
        capacity: u32,
        noted_total: Arc<AtomicUsize>,
    ) -> Result<Self, DaemonError> {
        // Slot numbers leave the top bit to the index's notes.
        let capacity = capacity.min(NOTE);
        let fd = sys::memfd_create_sealable(c"pageone-scope").map_err(DaemonError::Store)?;
        let bytes = capacity as u64 * PAGE as u64;
        sys::ftruncate(fd.as_raw_fd(), bytes).map_err(DaemonError::Store)?;
        // The size never changes again, and nobody may add seals (F_SEAL_WRITE would stop punching).
        sys::add_seals(
            fd.as_raw_fd(),
            libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL,
        )
        .map_err(DaemonError::Store)?;
        Ok(Self {
            name,
            uid,
            fd,
            capacity,
            writing: Mutex::new(()),
            state: Mutex::new(ScopeState {
                contents: Contents::new(),
                holders: Vec::new(),
                free: Vec::new(),
                bump: 0,
                live: 0,
                noted_entries: 0,
                noted_total,
                clients: HashMap::default(),
                copies_made: 0,
                born: Instant::now(),
            }),
        })
    }
}

impl ScopeState {
    fn alloc(&mut self, capacity: u32) -> Option<u32> {
        if let Some(s) = self.free.pop() {
            return Some(s);
        }
        if self.bump >= capacity {
            return None;
        }
        self.bump += 1;
        self.contents.hash_of.push(0);
        self.holders.push(0);
        Some(self.bump - 1)
    }

    fn hold(&mut self, client: u64, slot: u32) {
        if let Some(c) = self.clients.get_mut(&client) {
            if c.held.insert(slot) {
                self.holders[slot as usize] += 1;
            }
        }
    }

    /// Drops one holder of `slot`. When none is left the slot leaves the index and is pushed to
    /// `dead`: the caller punches it, then gives it to [`ScopeState::reuse`] (not before, or a new
    /// copy written there could be punched).
    fn unhold(&mut self, slot: u32, dead: &mut Vec<u32>) {
        let h = &mut self.holders[slot as usize];
        *h -= 1;
        if *h == 0 {
            self.contents.remove_copy(slot);
            self.live -= 1;
            dead.push(slot);
        }
    }

    /// Milliseconds since the scope began (for `Noted::wanted_at`).
    fn now_ms(&self) -> u32 {
        self.born.elapsed().as_millis().min(u32::MAX as u128) as u32
    }

    /// Drops client `id`'s notes of `hashes` (its pages of that content are gone).
    fn forget(&mut self, id: u64, hashes: &[u128]) {
        let mut dropped = 0;
        for &h in hashes {
            if let Some(n) = self.contents.note_mut(h) {
                dropped += n.remove(id) as usize;
                if n.is_empty() {
                    self.contents.remove_note(h);
                }
            }
        }
        self.uncount_notes(dropped);
        self.compact();
    }

    fn count_notes(&mut self, n: usize) {
        self.noted_entries += n;
        // Relaxed: a count compared against a soft limit.
        self.noted_total.fetch_add(n, Ordering::Relaxed);
    }

    fn uncount_notes(&mut self, n: usize) {
        self.noted_entries -= n;
        // Relaxed: see count_notes.
        self.noted_total.fetch_sub(n, Ordering::Relaxed);
    }

    /// Drops every note of a client that left.
    fn forget_client(&mut self, id: u64) {
        let mut dropped = 0;
        self.contents.retain_notes(|n| {
            dropped += n.remove(id) as usize;
            !n.is_empty()
        });
        self.uncount_notes(dropped);
        self.compact();
    }

    /// Gives the tables' memory back once most of their entries are gone (copies made for
    /// noted content, copies freed).
    fn compact(&mut self) {
        self.contents.compact();
    }

    /// Makes punched slots allocatable again.
    fn reuse(&mut self, punched: Vec<u32>) {
        self.free.extend(punched);
    }
}

/// Punches the slots nobody holds any more, one call per run of consecutive slots, without the
/// scope's lock (a client leaving with a hundred thousand slots would otherwise hold every
/// other client's lookups up meanwhile), then makes them reusable.
fn free_slots(sc: &Scope, mut dead: Vec<u32>) {
    if dead.is_empty() {
        return;
    }
    dead.sort_unstable();
    proto::store::punch_runs(sc.fd.as_raw_fd(), &dead);
    // Reused from the end: lowest first, so new copies come in runs.
    dead.reverse();
    lock(&sc.state).reuse(dead);
}

struct Inner {
    config: DaemonConfig,
    /// Scopes with clients (a scope goes, store and all, when its last client leaves). Lock
    /// order: `scopes`, then a scope's `state`.
    scopes: Mutex<HashMap<(u32, String), Arc<Scope>>>,
    noted_total: Arc<AtomicUsize>,
    next_client: AtomicU64,
    connections: AtomicUsize,
    started: Instant,
}

/// A bound daemon; [`Daemon::run`] serves it.
pub struct Daemon {
    listener: UnixListener,
    inner: Arc<Inner>,
}

impl Daemon {
    /// Binds the socket (creating its directory; a stale socket of a dead daemon is replaced, a
    /// live daemon's is not).
    pub fn bind(config: DaemonConfig) -> Result<Self, DaemonError> {
        let path = config.socket.clone();
        let bind_err = |source| DaemonError::Bind {
            path: path.clone(),
            source,
        };
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(bind_err)?;
        }
        if path.exists() {
            if UnixStream::connect(&path).is_ok() {
                return Err(DaemonError::InUse(path));
            }
            std::fs::remove_file(&path).map_err(bind_err)?;
        }
        let listener = UnixListener::bind(&path).map_err(bind_err)?;
        // Any user may connect: the scope is decided from the peer's uid.
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666))
            .map_err(bind_err)?;
        tracing::info!(socket = %path.display(), "pageone daemon listening");
        Ok(Self {
            listener,
            inner: Arc::new(Inner {
                config,
                scopes: Mutex::new(HashMap::new()),
                noted_total: Arc::new(AtomicUsize::new(0)),
                next_client: AtomicU64::new(1),
                connections: AtomicUsize::new(0),
                started: Instant::now(),
            }),
        })
    }

    pub fn socket(&self) -> &Path {
        &self.inner.config.socket
    }

    /// Serves clients until the process ends (or, with `exit_when_idle`, until the last client
    /// left).
    pub fn run(self) -> io::Result<()> {
        let served = Arc::new(AtomicU64::new(0));
        for conn in self.listener.incoming() {
            let sock = match conn {
                Ok(s) => s,
                Err(e) => {
                    // Out of descriptors or memory: serve the others, retry shortly.
                    tracing::warn!(error = %e, "could not accept a client");
                    std::thread::sleep(std::time::Duration::from_millis(50));
                    continue;
                }
            };
            // Relaxed: a count compared against a soft limit.
            if self.inner.connections.load(Ordering::Relaxed) >= MAX_CONNECTIONS {
                let _ = proto::write_frame(
                    &sock,
                    &Reply::Error("the daemon serves too many clients".into()).encode(),
                    None,
                );
                continue;
            }
            self.inner.connections.fetch_add(1, Ordering::Relaxed);
            let inner = self.inner.clone();
            let served = served.clone();
            let listener_fd = self.listener.as_raw_fd();
            let spawned = std::thread::Builder::new()
                .name("pageone-client".into())
                .spawn(move || {
                    // Copies and lookups are done for clients' engines, which run at idle
                    // priority: so does this work (spare CPU only).
                    let _ = sys::set_thread_idle_priority();
                    let joined = serve(&inner, sock);
                    let left = inner.connections.fetch_sub(1, Ordering::AcqRel) - 1;
                    if joined {
                        served.fetch_add(1, Ordering::Relaxed);
                    }
                    if inner.config.exit_when_idle
                        && left == 0
                        && served.load(Ordering::Relaxed) > 0
                    {
                        tracing::info!("last client left; exiting");
                        let _ = std::fs::remove_file(&inner.config.socket);
                        let _ = sys::shutdown_socket(listener_fd);
                        std::process::exit(0);
                    }
                });
            if let Err(e) = spawned {
                tracing::warn!(error = %e, "could not start a client thread");
                self.inner.connections.fetch_sub(1, Ordering::Relaxed);
            }
        }
        Ok(())
    }
}

/// Serves one connection; returns whether a client joined a scope on it.
fn serve(inner: &Inner, sock: UnixStream) -> bool {
    let mut joined: Option<(Arc<Scope>, u64, OwnedFd)> = None;
    // The client's process, to tell an exit from a connection lost while it lives.
    let mut process: Option<OwnedFd> = None;
    // The memory of the offers last sent, kept for the client's next ones (see `lookup`).
    let mut spare_offers: Vec<(u128, u32)> = Vec::new();
    let result = (|| -> Result<(), ProtoError> {
        loop {
            let (body, fd) = proto::read_frame(&sock)?;
            let req = match Request::decode(&body) {
                Ok(r) => r,
                Err(e) => {
                    let _ = reply(&sock, &Reply::Error(e.to_string()), None);
                    return Err(e);
                }
            };
            let answer = match (&joined, req) {
                (_, Request::Status) => Reply::Text(status_json(inner).to_string()),
                (None, Request::Hello { version, scope }) => {
                    match join(inner, &sock, version, &scope, fd) {
                        Ok((sc, id, pipe, store_ro, pidfd)) => {
                            let r = Reply::Welcome {
                                capacity: sc.capacity,
                                client: id,
                                scope: sc.name.clone(),
                            };
                            joined = Some((sc, id, pipe));
                            process = pidfd;
                            reply(&sock, &r, Some(&store_ro))?;
                            continue;
                        }
                        Err(msg) => Reply::Error(msg),
                    }
                }
                (None, _) => Reply::Error("say hello first".into()),
                (Some(_), Request::Hello { .. }) => Reply::Error("already joined".into()),
                (Some((sc, id, _)), Request::Lookup(hs)) => lookup(sc, *id, &hs, &mut spare_offers),
                (Some(_), Request::Goodbye) => {
                    // Its holds go when the connection ends, process alive or not.
                    process = None;
                    Reply::Ok
                }
                (Some((sc, id, pipe)), Request::Copy(n)) => copy(sc, *id, pipe, n, false),
                (Some((sc, id, pipe)), Request::CopyFresh(n)) => copy(sc, *id, pipe, n, true),
                (Some((sc, id, _)), Request::Release(slots)) => {
                    let mut dead = Vec::new();
                    let mut st = lock(&sc.state);
                    for s in slots {
                        let held = st.clients.get_mut(id).is_some_and(|c| c.held.remove(s));
                        if held {
                            st.unhold(s, &mut dead);
                        }
                    }
                    st.compact();
                    drop(st);
                    free_slots(sc, dead);
                    Reply::Ok
                }
                (Some((sc, id, _)), Request::Forget(hashes)) => {
                    lock(&sc.state).forget(*id, &hashes);
                    Reply::Ok
                }
                (Some((sc, id, _)), Request::Report(json)) => {
                    let mut st = lock(&sc.state);
                    if let (Some(c), Ok(v)) = (
                        st.clients.get_mut(id),
                        serde_json::from_str::<serde_json::Value>(&json),
                    ) {
                        let merges = v["merges"].as_u64().unwrap_or(0);
                        let now = Instant::now();
                        if let Some((t, m)) = c.last {
                            let dt = (now - t).as_secs_f64();
                            if dt > 0.0 {
                                c.merges_per_sec = merges.saturating_sub(m) as f64 / dt;
                            }
                        }
                        c.last = Some((now, merges));
                        c.report = Some(v);
                    }
                    Reply::Ok
                }
            };
            reply(&sock, &answer, None)?;
            if let Reply::Answers { mut offers, .. } = answer {
                // Its memory takes the next offers (see `lookup`), up to a bound.
                offers.clear();
                offers.shrink_to(KEPT_OFFERS);
                spare_offers = offers;
            }
        }
    })();
    if let Err(e) = &result {
        if !matches!(e, ProtoError::Closed) {
            tracing::info!(error = %e, "client connection ended");
        }
    }
    let was_joined = joined.is_some();
    if let Some((sc, id, _)) = joined {
        // A connection that ended while the client's process lives, without a goodbye (an
        // error, not an exit), may leave it mapping its copies: freeing them would turn its
        // pages into holes, which read as zeros. They stay held until the process exits. (A
        // process that forked keeps the socket open in its children, so an exit of all of them
        // ends the connection.)
        let holds = lock(&sc.state)
            .clients
            .get(&id)
            .is_some_and(|c| c.held.len() > 0);
        if let Some(p) = process.as_ref().filter(|_| holds) {
            if matches!(sys::pidfd_exited(p.as_raw_fd(), false), Ok(false)) {
                {
                    let mut st = lock(&sc.state);
                    st.forget_client(id);
                    if let Some(c) = st.clients.get_mut(&id) {
                        c.connected = false;
                        // Its pages are counted by its new connection, if it makes one.
                        c.report = None;
                        c.merges_per_sec = 0.0;
                    }
                }
                tracing::info!(
                    client = id,
                    scope = %sc.name,
                    "client disconnected while its process lives; its copies stay until it exits"
                );
                let _ = sys::pidfd_exited(p.as_raw_fd(), true);
            }
        }
        // Exit, crash or protocol error: the client's holds go (its mappings went with it).
        let mut dead = Vec::new();
        let mut st = lock(&sc.state);
        if let Some(c) = st.clients.remove(&id) {
            for s in c.held.into_slots() {
                st.unhold(s, &mut dead);
            }
            st.forget_client(id);
            tracing::info!(client = id, pid = c.pid, scope = %sc.name, "client left");
        }
        drop(st);
        free_slots(&sc, dead);
        // A scope without clients holds no copies: it goes, with its store's descriptor (else
        // every scope name ever used would keep one open).
        let mut scopes = lock(&inner.scopes);
        if lock(&sc.state).clients.is_empty() {
            scopes.retain(|_, s| !Arc::ptr_eq(s, &sc));
            tracing::info!(scope = %sc.name, "scope closed: its last client left");
        }
        drop(scopes);
        // Its thread's buffers and the tables' shrinking left free heap memory behind.
        sys::release_free_heap();
    }
    was_joined
}

fn reply(sock: &UnixStream, r: &Reply, fd: Option<&OwnedFd>) -> Result<(), ProtoError> {
    proto::write_frame(sock, &r.encode(), fd)
}

fn valid_scope_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 64
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
}

type Joined = (Arc<Scope>, u64, OwnedFd, OwnedFd, Option<OwnedFd>);

fn join(
    inner: &Inner,
    sock: &UnixStream,
    version: u32,
    scope: &str,
    pipe: Option<OwnedFd>,
) -> Result<Joined, String> {
    if version != proto::VERSION {
        return Err(format!(
            "protocol version {version} is not {}",
            proto::VERSION
        ));
    }
    if !valid_scope_name(scope) {
        return Err("a scope name is 1 to 64 of [A-Za-z0-9._-]".into());
    }
    let pipe = pipe.ok_or("the greeting carries no pipe")?;
    if !sys::is_pipe(pipe.as_raw_fd()).unwrap_or(false) {
        return Err("the greeting's descriptor is not a pipe".into());
    }
    let cred = sys::peer_cred(sock.as_raw_fd()).map_err(|e| format!("no peer credentials: {e}"))?;
    // The client is added under the scopes' lock, so that a scope whose last client is leaving
    // meanwhile is either kept for it or already gone (and made anew here).
    let mut scopes = lock(&inner.scopes);
    let key = (cred.uid, scope.to_string());
    let sc = match scopes.get(&key) {
        Some(s) => s.clone(),
        None => {
            let name = if cred.uid == 0 {
                scope.to_string()
            } else {
                format!("{}@uid{}", scope, cred.uid)
            };
            let s = Arc::new(
                Scope::new(
                    name,
                    cred.uid,
                    inner.config.capacity_pages,
                    inner.noted_total.clone(),
                )
                .map_err(|e| format!("{e}"))?,
            );
            scopes.insert(key.clone(), s.clone());
            s
        }
    };
    let store_ro = match sys::reopen_readonly(sc.fd.as_raw_fd()) {
        Ok(fd) => fd,
        Err(e) => {
            if lock(&sc.state).clients.is_empty() {
                scopes.remove(&key);
            }
            return Err(format!("store not shareable: {e}"));
        }
    };
    // Relaxed: a unique counter.
    let id = inner.next_client.fetch_add(1, Ordering::Relaxed);
    lock(&sc.state).clients.insert(
        id,
        Client {
            pid: cred.pid,
            connected: true,
            held: SlotSet::default(),
            offers: Vec::new(),
            report: None,
            last: None,
            merges_per_sec: 0.0,
        },
    );
    drop(scopes);
    tracing::info!(client = id, pid = cred.pid, uid = cred.uid, scope = %sc.name, "client joined");
    let pidfd = sys::peer_pidfd(sock.as_raw_fd(), cred.pid).ok();
    Ok((sc, id, pipe, store_ro, pidfd))
}

fn lookup(sc: &Scope, id: u64, hashes: &[u128], spare_offers: &mut Vec<(u128, u32)>) -> Reply {
    let mut st = lock(&sc.state);
    let mut answers = vec![proto::NOTED; hashes.len()];
    let now = st.now_ms();
    let grace = WANTED_GRACE.as_millis() as u32;
    let mut added = 0;
    for i in st.contents.table_order(hashes) {
        let (h, answer) = (hashes[i], &mut answers[i]);
        // Relaxed: see count_notes.
        let full = st.noted_total.load(Ordering::Relaxed) + added >= MAX_NOTED;
        let ScopeState {
            contents, clients, ..
        } = &mut *st;
        let entry = match contents.lookup(h, !full) {
            Found::Copy(slot) => {
                st.hold(id, slot);
                *answer = slot;
                continue;
            }
            Found::Note(e) => e,
            Found::Nothing => continue,
        };
        let (w, t) = (entry.wanted_by, entry.wanted_at);
        let copy_pending =
            w != 0 && w != id && clients.contains_key(&w) && now.saturating_sub(t) < grace;
        let others = entry.clients().any(|c| c != id && clients.contains_key(&c));
        if !copy_pending && others {
            (entry.wanted_by, entry.wanted_at) = (id, now);
            *answer = proto::WANTED;
            continue;
        }
        if !entry.contains(id) {
            entry.add(id);
            added += 1;
        }
    }
    st.count_notes(added);
    // The client's offers go out; the memory of the ones sent last time takes the next ones (a
    // client waiting for tens of thousands of copies gets them over many lookups, and new
    // memory costs a page fault per 4 KiB).
    let offers = match st.clients.get_mut(&id) {
        Some(c) => std::mem::replace(&mut c.offers, std::mem::take(spare_offers)),
        None => Vec::new(),
    };
    Reply::Answers { answers, offers }
}

/// Copies the pages waiting in the client's pipe into slots. Content already stored is answered
/// with its slot, unless `fresh`: then every page gets a new slot, which becomes the one the
/// index answers with.
fn copy(sc: &Scope, id: u64, pipe: &OwnedFd, n: u32, fresh: bool) -> Reply {
    let n = n as usize;
    if n > proto::COPY_PAGES {
        return Reply::Error(format!("at most {} pages per copy", proto::COPY_PAGES));
    }
    let pipe = pipe.as_raw_fd();
    // The pipe must hold exactly this request's pages, in order. Anything else is a confused or
    // lying client: its copies fail and what the pipe holds is dropped.
    let pending = sys::pipe_pending(pipe).unwrap_or(0);
    if pending != n * PAGE {
        let _ = sys::drain_pipe(pipe, pending);
        return Reply::Slots(vec![proto::FAILED; n]);
    }
    // A slot for every page first (consecutive where the store allows), then one `splice` per
    // run (of at most HASH_CHUNK pages) from the pipe into the store: the bytes never pass
    // through the daemon's memory.
    // Clients ask only for content the index lacked at lookup, so a copy that turns out to be
    // stored already (found by its hash below) is rare; it is given back.
    let slots: Vec<Option<u32>> = {
        let mut st = lock(&sc.state);
        (0..n).map(|_| st.alloc(sc.capacity)).collect()
    };
    let fd = sc.fd.as_raw_fd();
    // The client may write its pages meanwhile: what is hashed is what the store holds (a
    // slot's bytes never change once written), read back with `pread` right after each step's
    // `splice`, while the bytes are still in the cache. The daemon does not map the store: a
    // mapping would take a share of every copy's Pss from the clients that map it
    // (understating their memory) and cost page tables and faults.
    let mut hashes: Vec<Option<u128>> = vec![None; n];
    let mut buf = vec![0u8; HASH_CHUNK * PAGE];
    let mut in_step = true;
    let mut k = 0;
    while k < n && in_step {
        let mut m = 1;
        while k + m < n
            && match (slots[k], slots[k + m]) {
                (Some(first), Some(s)) => m < HASH_CHUNK && s == first + m as u32,
                (None, None) => true,
                _ => false,
            }
        {
            m += 1;
        }
        // Pages without a slot (the store is full) are read past.
        let moved = match slots[k] {
            Some(first) => {
                let _writing = lock(&sc.writing);
                sys::splice_to_file(pipe, fd, first as u64 * PAGE as u64, m * PAGE)
            }
            None => sys::drain_pipe(pipe, m * PAGE),
        };
        in_step = moved.is_ok_and(|got| got == m * PAGE);
        if let Some(first) = slots[k].filter(|_| in_step) {
            // SAFETY: `buf` is this function's own buffer of HASH_CHUNK >= m pages, not
            // borrowed during the call.
            let got = unsafe {
                sys::pread_into(fd, buf.as_mut_ptr(), m * PAGE, first as u64 * PAGE as u64)
            };
            if got.is_ok_and(|g| g == m * PAGE) {
                for (j, page) in buf[..m * PAGE].chunks(PAGE).enumerate() {
                    hashes[k + j] = Some(twox_hash::XxHash3_128::oneshot(page));
                }
            }
        }
        k += m;
    }
    if !in_step {
        // The client took pages back out of its pipe meanwhile: the rest of the request fails.
        if let Ok(left @ 1..) = sys::pipe_pending(pipe) {
            let _ = sys::drain_pipe(pipe, left);
        }
    }
    let mut out = vec![proto::FAILED; n];
    let new: Vec<(usize, u32)> = (0..n).filter_map(|k| Some((k, slots[k]?))).collect();
    let written: Vec<bool> = new.iter().map(|&(k, _)| hashes[k].is_some()).collect();
    let mut st = lock(&sc.state);
    for (&(k, slot), ok) in new.iter().zip(written) {
        let h = hashes[k].unwrap_or_default();
        let set = if ok {
            st.contents.set_copy(h, slot, fresh)
        } else {
            Err(proto::FAILED)
        };
        let note = match set {
            Ok(note) => note,
            Err(existing) => {
                // Failed, or another client published the same content meanwhile.
                let _ = sys::punch_hole(fd, slot as u64 * PAGE as u64, PAGE as u64);
                st.free.push(slot);
                if existing != proto::FAILED {
                    st.hold(id, existing);
                    out[k] = existing;
                }
                continue;
            }
        };
        st.live += 1;
        st.copies_made += 1;
        st.hold(id, slot);
        out[k] = slot;
        if let Some(n) = note {
            st.uncount_notes(n.clients().count());
            for c in n.clients() {
                if c == id {
                    continue;
                }
                let take = st
                    .clients
                    .get(&c)
                    .is_some_and(|cl| cl.offers.len() < MAX_OFFERS);
                if take {
                    st.hold(c, slot);
                    if let Some(cl) = st.clients.get_mut(&c) {
                        cl.offers.push((h, slot));
                    }
                }
            }
        }
    }
    // Pages of this request with the same content as an earlier one get its slot.
    for (k, h) in hashes.iter().enumerate().filter(|_| !fresh) {
        if out[k] == proto::FAILED {
            if let Some(s) = h.and_then(|h| st.contents.copy_of(h)) {
                st.hold(id, s);
                out[k] = s;
            }
        }
    }
    st.compact();
    Reply::Slots(out)
}

/// The daemon's view, per scope and per client, as JSON (for `pageone status`).
fn status_json(inner: &Inner) -> serde_json::Value {
    let scopes: Vec<Arc<Scope>> = lock(&inner.scopes).values().cloned().collect();
    let mut out = Vec::new();
    for sc in scopes {
        let resident = sys::file_usage(sc.fd.as_raw_fd()).map(|u| u.1).unwrap_or(0);
        let st = lock(&sc.state);
        let mut mapped = 0u64;
        let mut zero = 0u64;
        let mut rate = 0.0;
        let mut cpu = 0u64;
        let mut clients = Vec::new();
        let mut ids: Vec<&u64> = st.clients.keys().collect();
        ids.sort();
        for id in ids {
            let c = &st.clients[id];
            if let Some(r) = &c.report {
                mapped += r["pages_shared"].as_u64().unwrap_or(0)
                    + r["pages_sharing"].as_u64().unwrap_or(0);
                zero += r["zero_pages"].as_u64().unwrap_or(0);
                cpu += r["worker_cpu_ns"].as_u64().unwrap_or(0);
            }
            rate += c.merges_per_sec;
            clients.push(serde_json::json!({
                "client": id,
                "pid": c.pid,
                "connected": c.connected,
                "held": c.held.len(),
                "merges_per_sec": c.merges_per_sec,
                "stats": c.report,
            }));
        }
        let sharing = mapped.saturating_sub(st.live);
        out.push(serde_json::json!({
            "scope": sc.name,
            "uid": sc.uid,
            "clients": clients,
            "pages_shared": st.live,
            "pages_sharing": sharing,
            "zero_pages": zero,
            "saved_bytes": (sharing + zero) * PAGE as u64,
            "copies_made": st.copies_made,
            "noted_first_sightings": st.noted_entries,
            "store_resident_bytes": resident,
            "merges_per_sec": rate,
            "worker_cpu_ns": cpu,
        }));
    }
    serde_json::json!({
        "pid": std::process::id(),
        "socket": inner.config.socket,
        "uptime_secs": inner.started.elapsed().as_secs(),
        // The daemon's own memory (its tables), which counts against what its scopes save.
        // (From the kernel's counters: status is polled, and a page table walk would cost a
        // poll more than the answer is worth.)
        "anonymous_bytes": sys::self_status_kib("RssAnon").unwrap_or(0) * 1024,
        "scopes": out,
    })
}
