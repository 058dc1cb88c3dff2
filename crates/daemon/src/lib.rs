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
//! * `Vacate(slots)`: the client still holds them but needs their bytes no more (a page written
//!   after its merge may still lie in a mapping of one): a slot all its holders vacated is
//!   emptied (out of the index, punched) and freed once they release it.
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
//! The scope a client joins is `(peer uid, requested name)` from `SO_PEERCRED`, and with
//! `--scope-by cgroup` the client's cgroups too: clients of different users (or cgroups) never
//! share a copy, whatever name they ask for. Within a scope clients do not trust each other: a
//! copy cannot be changed once stored (the store is 0400 and the daemon's user's, sealed, and
//! clients hold it read-only; private mappings copy on write), every merge is verified by the
//! merging client on frozen bytes, every count and slot a client sends is bounds-checked, and a
//! malformed frame ends only that client's connection. What one client or user can make the
//! daemon hold or do is capped ([`Limits`]); `status` shows a user only its own scopes.
//!
//! Modules: [`limits`](Limits) (caps and per-user accounts), `listen` (the socket and
//! connections), `session` (one connection's requests), `scope` (a scope's store and
//! requests), `contents` (its index of contents and notes), `status`, `metrics` (the same
//! numbers for Prometheus, over HTTP, when asked for).

mod contents;
#[cfg(any(test, feature = "harness"))]
pub mod harness;
mod limits;
mod listen;
mod metrics;
mod scope;
mod session;
mod status;

use std::collections::HashMap;
use std::io;
use std::path::PathBuf;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use pageone_proto::{self as proto, ProtoError};
use pageone_sys as sys;

pub use limits::Limits;
pub use listen::Daemon;

use limits::Accounts;
use listen::SocketPlace;
use scope::{Scope, ScopeKey};

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
    #[error("{path} is in the way: it {why}")]
    Occupied { path: PathBuf, why: String },
    #[error("the socket's directory is not safe")]
    Place(#[from] ProtoError),
    #[error("the metrics address {addr} could not be bound")]
    Metrics {
        addr: std::net::SocketAddr,
        #[source]
        source: io::Error,
    },
}

/// What sets scopes apart besides the name a client asks for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ScopeBy {
    /// The client's uid: a user's processes share when they ask for the same scope.
    #[default]
    Uid,
    /// The client's uid and cgroups: same-uid processes of different cgroups (QEMU guests of
    /// different tenants under one libvirt user, containers) never share.
    Cgroup,
}

impl std::fmt::Display for ScopeBy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ScopeBy::Uid => "uid",
            ScopeBy::Cgroup => "cgroup",
        })
    }
}

impl std::str::FromStr for ScopeBy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "uid" => Ok(ScopeBy::Uid),
            "cgroup" => Ok(ScopeBy::Cgroup),
            _ => Err(format!("scopes are kept apart by uid or cgroup, not {s:?}")),
        }
    }
}

/// Daemon settings.
#[derive(Clone, Debug)]
pub struct DaemonConfig {
    pub socket: PathBuf,
    /// Store size per scope, in pages (virtual: only live copies use memory, as many as
    /// `limits.pages_per_uid` for all of a user's scopes). Default: RAM.
    pub capacity_pages: u32,
    /// Exit once the last client has left (for a private daemon of one process tree).
    pub exit_when_idle: bool,
    pub limits: Limits,
    pub scope_by: ScopeBy,
    /// Where to serve metrics over HTTP (`GET /metrics`, Prometheus text format); `None`: not
    /// at all. Whoever reaches the address reads every scope's numbers (see `metrics`).
    pub metrics: Option<std::net::SocketAddr>,
    /// How the threads serving clients are scheduled (see [`sys::Priority`]).
    pub priority: sys::Priority,
}

impl DaemonConfig {
    pub fn new(socket: PathBuf) -> Self {
        let ram = sys::meminfo_kib("MemTotal").unwrap_or(16 << 20) * 1024;
        let pages = ram / sys::PAGE_SIZE as u64;
        Self {
            socket,
            capacity_pages: pages.min(proto::MAX_SLOT as u64) as u32,
            exit_when_idle: false,
            limits: Limits::for_ram(pages),
            scope_by: ScopeBy::Uid,
            metrics: None,
            priority: sys::Priority::default(),
        }
    }
}

/// What every connection of the daemon shares.
struct Inner {
    config: DaemonConfig,
    limits: Arc<Limits>,
    /// Scopes with clients (a scope goes, store and all, when its last client leaves). Lock
    /// order: `scopes`, then a scope's `state`.
    scopes: Mutex<HashMap<ScopeKey, Arc<Scope>>>,
    accounts: Arc<Accounts>,
    next_client: AtomicU64,
    started: Instant,
    /// The listening socket (none for the fuzz harness).
    socket: Option<SocketPlace>,
}

impl Inner {
    fn new(config: DaemonConfig, socket: Option<SocketPlace>) -> Self {
        Self {
            limits: Arc::new(config.limits.clone()),
            config,
            scopes: Mutex::new(HashMap::new()),
            accounts: Arc::new(Accounts::new()),
            next_client: AtomicU64::new(1),
            started: Instant::now(),
            socket,
        }
    }

    /// Every scope, for checks (the fuzz harness).
    #[cfg(any(test, feature = "harness"))]
    fn all_scopes(&self) -> Vec<Arc<Scope>> {
        pageone_sync::lock(&self.scopes).values().cloned().collect()
    }
}
