//! One client connection's requests, from its greeting to its leaving, without the socket: the
//! listener reads frames and writes replies, and the fuzz harness calls the same code directly.

use pageone_sync::lock;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use pageone_proto::{self as proto, Reply, Request};
use pageone_sys as sys;

use crate::limits::Connection;
use crate::scope::{self, Client, CopyRequest, Scope, ScopeKey, ScopeSpec};
use crate::{Inner, ScopeBy};

/// Offers whose memory a connection keeps for the next ones (512 KiB).
const KEPT_OFFERS: usize = 1 << 14;

/// The process at the other end of a connection.
pub(crate) struct Peer {
    /// From `SO_PEERCRED`, as the kernel recorded them at `connect`.
    pub(crate) uid: u32,
    pub(crate) pid: i32,
    /// The client's process (`SO_PEERPIDFD`, else `pidfd_open`): tells an exit from a
    /// connection lost while it lives, and that a pid read meanwhile still names it.
    pub(crate) pidfd: Option<OwnedFd>,
}

/// A reply and the descriptor sent with it.
pub(crate) struct Answer {
    pub(crate) reply: Reply,
    pub(crate) fd: Option<OwnedFd>,
}

impl From<Reply> for Answer {
    fn from(reply: Reply) -> Self {
        Self { reply, fd: None }
    }
}

struct Joined {
    scope: Arc<Scope>,
    id: u64,
    pipe: OwnedFd,
}

pub(crate) struct Session {
    inner: Arc<Inner>,
    peer: Peer,
    /// Counts this connection against the daemon's and the user's caps while it lives.
    connection: Connection,
    joined: Option<Joined>,
    /// Whether the client's copies stay held when the connection ends while its process lives
    /// (until it said `Goodbye`: its engine stopped and maps no copy any more).
    keep_while_alive: bool,
    /// The memory of the offers last sent, kept for the client's next ones.
    spare_offers: Vec<(u128, u32)>,
}

impl Session {
    pub(crate) fn new(inner: Arc<Inner>, peer: Peer, connection: Connection) -> Self {
        Self {
            inner,
            peer,
            connection,
            joined: None,
            keep_while_alive: true,
            spare_offers: Vec::new(),
        }
    }

    pub(crate) fn is_joined(&self) -> bool {
        self.joined.is_some()
    }

    /// Handles one request: within the user's requests in flight (waiting for room up to the
    /// frame timeout, then `OverCap`).
    pub(crate) fn handle(&mut self, req: Request, fd: Option<OwnedFd>) -> Answer {
        let limits = self.inner.limits.clone();
        let account = self.connection.account.clone();
        let Some(_flight) = account.enter(limits.in_flight_per_uid, limits.frame_timeout) else {
            return Reply::OverCap(format!(
                "uid {} has {} requests in flight, its cap",
                account.uid, limits.in_flight_per_uid
            ))
            .into();
        };
        let reply = match (&self.joined, req) {
            (_, Request::Status) => {
                Reply::Text(crate::status::json(&self.inner, self.peer.uid).to_string())
            }
            (None, Request::Hello { version, scope }) => return self.hello(version, &scope, fd),
            (None, _) => Reply::Error("say hello first".into()),
            (Some(_), Request::Hello { .. }) => Reply::Error("already joined".into()),
            (Some(j), Request::Lookup(hs)) => {
                scope::lookup(&j.scope, j.id, &hs, &mut self.spare_offers)
            }
            (Some(_), Request::Goodbye) => {
                // Its holds go when the connection ends, process alive or not.
                self.keep_while_alive = false;
                Reply::Ok
            }
            (Some(j), Request::Copy(n)) => copy(j, n, false),
            (Some(j), Request::CopyFresh(n)) => copy(j, n, true),
            (Some(j), Request::Release(slots)) => scope::release(&j.scope, j.id, &slots),
            (Some(j), Request::Vacate(slots)) => scope::vacate(&j.scope, j.id, &slots),
            (Some(j), Request::HoldHoles(slots)) => scope::hold_holes(&j.scope, j.id, &slots),
            (Some(j), Request::Forget(hashes)) => scope::forget(&j.scope, j.id, &hashes),
            (Some(j), Request::Report(json)) => scope::report(&j.scope, j.id, &json),
        };
        reply.into()
    }

    /// Takes the memory of offers just sent for the next ones (see `scope::lookup`), up to a
    /// bound.
    pub(crate) fn recycle(&mut self, answer: Answer) {
        if let Reply::Answers { mut offers, .. } = answer.reply {
            offers.clear();
            offers.shrink_to(KEPT_OFFERS);
            self.spare_offers = offers;
        }
    }

    fn hello(&mut self, version: u32, name: &str, pipe: Option<OwnedFd>) -> Answer {
        match self.join(version, name, pipe) {
            Ok((joined, store_ro)) => {
                let reply = Reply::Welcome {
                    capacity: joined.scope.capacity,
                    client: joined.id,
                    scope: joined.scope.name.clone(),
                };
                self.joined = Some(joined);
                Answer {
                    reply,
                    fd: Some(store_ro),
                }
            }
            Err(msg) => Reply::Error(msg).into(),
        }
    }

    /// Adds the client to its scope (made if it has no other client) and opens the store
    /// read-only for it.
    fn join(
        &self,
        version: u32,
        name: &str,
        pipe: Option<OwnedFd>,
    ) -> Result<(Joined, OwnedFd), String> {
        if version != proto::VERSION {
            return Err(format!(
                "protocol version {version} is not {}",
                proto::VERSION
            ));
        }
        if !valid_scope_name(name) {
            return Err("a scope name is 1 to 64 of [A-Za-z0-9._-]".into());
        }
        let pipe = pipe.ok_or("the greeting carries no pipe")?;
        if !sys::is_pipe(pipe.as_raw_fd()).unwrap_or(false) {
            return Err("the greeting's descriptor is not a pipe".into());
        }
        let key = scope_key(self.inner.config.scope_by, &self.peer, name)?;
        let inner = &self.inner;
        // The client is added under the scopes' lock, so that a scope whose last client is
        // leaving meanwhile is either kept for it or already gone (and made anew here).
        let mut scopes = lock(&inner.scopes);
        let sc = match scopes.get(&key) {
            Some(s) => s.clone(),
            None => {
                let spec = ScopeSpec {
                    key: key.clone(),
                    capacity: inner.config.capacity_pages,
                    account: self.connection.account.clone(),
                    accounts: inner.accounts.clone(),
                    limits: inner.limits.clone(),
                };
                let s = Arc::new(
                    Scope::new(spec)
                        .map_err(|e| format!("the scope's store could not be created: {e}"))?,
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
        lock(&sc.state)
            .clients
            .insert(id, Client::new(self.peer.pid));
        drop(scopes);
        let (pid, uid) = (self.peer.pid, self.peer.uid);
        tracing::info!(client = id, pid, uid, scope = %sc.name, "client joined");
        Ok((
            Joined {
                scope: sc,
                id,
                pipe,
            },
            store_ro,
        ))
    }

    /// The connection ended (or the harness let the client go): the client's holds and notes
    /// go, and its scope with it if it was the last client. A connection that ended while the
    /// client's process lives, without a goodbye (an error, not an exit), may leave it mapping
    /// its copies: freeing them would turn its pages into holes, which read as zeros. They stay
    /// held until the process exits (this waits for that; a process that forked keeps the
    /// socket open in its children, so an exit of all of them ends the connection).
    pub(crate) fn leave(self) {
        let Some(Joined { scope: sc, id, .. }) = self.joined else {
            return;
        };
        let holds = lock(&sc.state)
            .clients
            .get(&id)
            .is_some_and(|c| c.held.len() > 0);
        let lingering = self
            .peer
            .pidfd
            .as_ref()
            .filter(|_| holds && self.keep_while_alive);
        if let Some(p) = lingering {
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
                st.unhold(s, c.vacant.contains(s), &mut dead);
            }
            st.punch_emptied(&sc);
            st.forget_client(id);
            tracing::info!(client = id, pid = c.pid, scope = %sc.name, "client left");
        }
        drop(st);
        scope::free_slots(&sc, dead);
        // A scope without clients holds no copies: it goes, with its store's descriptor (else
        // every scope name ever used would keep one open).
        let mut scopes = lock(&self.inner.scopes);
        if lock(&sc.state).clients.is_empty() {
            scopes.retain(|_, s| !Arc::ptr_eq(s, &sc));
            tracing::info!(scope = %sc.name, "scope closed: its last client left");
        }
        drop(scopes);
        // Its thread's buffers and the tables' shrinking left free heap memory behind.
        sys::release_free_heap();
    }
}

fn copy(j: &Joined, n: u32, fresh: bool) -> Reply {
    let req = CopyRequest {
        id: j.id,
        pipe: &j.pipe,
        n,
        fresh,
    };
    scope::copy(&j.scope, req)
}

fn valid_scope_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 64
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
}

/// The scope a client asking for `name` joins: by its uid, and with `ScopeBy::Cgroup` its
/// cgroups too.
fn scope_key(by: ScopeBy, peer: &Peer, name: &str) -> Result<ScopeKey, String> {
    let cgroup = match by {
        ScopeBy::Uid => None,
        ScopeBy::Cgroup => Some(peer_cgroup(peer)?),
    };
    Ok(ScopeKey {
        uid: peer.uid,
        cgroup,
        name: name.to_string(),
    })
}

/// The cgroups of the client's process (`/proc/PID/cgroup`, its lines joined by spaces). The
/// pid comes from `SO_PEERCRED`; had that process exited and the pid been given to another
/// before the read, the pidfd taken at the connection says it exited, and the join fails.
fn peer_cgroup(peer: &Peer) -> Result<String, String> {
    let pidfd = peer
        .pidfd
        .as_ref()
        .ok_or("the client's process (so its cgroup) cannot be told: no pidfd")?;
    let text = std::fs::read_to_string(format!("/proc/{}/cgroup", peer.pid))
        .map_err(|e| format!("the client's cgroup cannot be read: {e}"))?;
    if !matches!(sys::pidfd_exited(pidfd.as_raw_fd(), false), Ok(false)) {
        return Err("the client's process exited while joining".into());
    }
    Ok(text.lines().collect::<Vec<_>>().join(" "))
}
