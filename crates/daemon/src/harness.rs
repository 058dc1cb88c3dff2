//! The daemon's request handling without a socket, for fuzzing (`fuzz/`): clients of chosen
//! uids send frames one at a time to an in-process daemon, and [`Harness::check`] says whether
//! every count and cap still holds.

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::Arc;

use pageone_proto::{ProtoError, Reply, Request};

use crate::session::{Peer, Session};
use crate::{DaemonConfig, Inner, Limits, ScopeBy};

/// An in-process daemon.
pub struct Harness {
    inner: Arc<Inner>,
}

/// A client connected to a [`Harness`].
pub struct Client {
    session: Session,
}

impl Harness {
    /// A daemon with `limits` whose scopes have `capacity` slots.
    pub fn new(limits: Limits, capacity: u32) -> Self {
        let mut config = DaemonConfig::new("/nonexistent/pageone-harness.sock".into());
        config.capacity_pages = capacity;
        config.limits = limits;
        config.scope_by = ScopeBy::Uid;
        Self {
            inner: Arc::new(Inner::new(config, None)),
        }
    }

    /// Connects a client of `uid` (this process, as far as scopes and pids go); an error if a
    /// connection cap refuses it.
    pub fn connect(&self, uid: u32) -> Result<Client, String> {
        let connection = self.inner.accounts.connect(uid, &self.inner.limits)?;
        let peer = Peer {
            uid,
            pid: std::process::id() as i32,
            pidfd: None,
        };
        Ok(Client {
            session: Session::new(self.inner.clone(), peer, connection),
        })
    }

    /// Checks the daemon's books: every user's store pages and notes are what its scopes hold,
    /// within their caps, and so are each client's notes and the daemon's total; every held
    /// slot is counted once per holder.
    pub fn check(&self) -> Result<(), String> {
        let limits = &self.inner.limits;
        let mut pages: HashMap<u32, u64> = HashMap::new();
        let mut notes: HashMap<u32, usize> = HashMap::new();
        for sc in self.inner.all_scopes() {
            let st = pageone_sync::lock(&sc.state);
            *pages.entry(sc.key.uid).or_default() += st.pages_in_use();
            *notes.entry(sc.key.uid).or_default() += st.noted_entries;
            let client_notes: usize = st.clients.values().map(|c| c.notes).sum();
            if client_notes != st.noted_entries {
                return Err(format!(
                    "scope {}: clients' notes {client_notes} != the scope's {}",
                    sc.name, st.noted_entries
                ));
            }
            if let Some(c) = st
                .clients
                .values()
                .find(|c| c.notes > limits.notes_per_client)
            {
                return Err(format!("a client has {} notes, over its cap", c.notes));
            }
            st.check_holds()
                .map_err(|e| format!("scope {}: {e}", sc.name))?;
            if st.live > st.pages_in_use() {
                return Err(format!("scope {}: more live copies than pages", sc.name));
            }
        }
        let mut total_notes = 0;
        for (_, account) in self.inner.accounts.users() {
            let (p, n) = (
                pages.remove(&account.uid).unwrap_or(0),
                notes.remove(&account.uid).unwrap_or(0),
            );
            if account.pages() != p || account.notes() != n {
                return Err(format!(
                    "uid {}: charged {} pages and {} notes, its scopes hold {p} and {n}",
                    account.uid,
                    account.pages(),
                    account.notes()
                ));
            }
            if p > limits.pages_per_uid || n > limits.notes_per_uid {
                return Err(format!(
                    "uid {}: over its caps ({p} pages, {n} notes)",
                    account.uid
                ));
            }
            total_notes += n;
        }
        if !pages.is_empty() {
            return Err("a scope's user has no account".into());
        }
        if self.inner.accounts.notes() != total_notes || total_notes > limits.notes {
            return Err(format!(
                "the daemon counts {} notes, its users {total_notes}",
                self.inner.accounts.notes()
            ));
        }
        Ok(())
    }
}

impl Harness {
    /// Whether nothing is left: no connection, no scope (after every client left).
    pub fn is_empty(&self) -> bool {
        self.inner.all_scopes().is_empty() && self.inner.accounts.connections() == 0
    }
}

impl Client {
    /// Hands the daemon one frame body (after the length word) with `fd` attached; its reply
    /// and descriptor, or the decoding error that would end the connection.
    pub fn frame(
        &mut self,
        body: &[u8],
        fd: Option<OwnedFd>,
    ) -> Result<(Reply, Option<OwnedFd>), ProtoError> {
        let req = Request::decode(body)?;
        let answer = self.session.handle(req, fd);
        Ok((answer.reply, answer.fd))
    }

    /// The connection ends.
    pub fn leave(self) {
        self.session.leave();
    }
}
