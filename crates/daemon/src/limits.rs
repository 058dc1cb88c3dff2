//! What one user (uid), one client and all of them together may make the daemon hold or do.
//!
//! Local users share one daemon, so every resource a client can make it spend is capped per
//! client and per user, and the daemon's totals too: store pages, notes of first sightings,
//! connections, requests in flight, report sizes, and how long a connection may idle or take
//! over a frame. Over a cap, a copy, report or request gets `Reply::OverCap` (the client merges
//! less), a lookup notes less, a connection is refused; nobody else is affected.

use pageone_sync::lock;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

/// The caps (see the module's description). `Limits::for_ram` gives the defaults.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Connections served at once, all users together (each has a thread).
    pub connections: usize,
    /// Connections one user may have (a connection whose process lives on after it ended,
    /// holding copies, still counts).
    pub connections_per_uid: usize,
    /// Store pages (copies, and slots being copied or freed) in all of one user's scopes.
    pub pages_per_uid: u64,
    /// Store pages one client may hold when it asks for copies (a copy request that would go
    /// beyond is refused whole).
    pub pages_per_client: u64,
    /// Notes of first sightings, all users together (about 64 bytes each).
    pub notes: usize,
    pub notes_per_uid: usize,
    pub notes_per_client: usize,
    /// Largest counters report a client may send, in bytes.
    pub report_bytes: usize,
    /// Requests of one user handled at once; more wait (up to `frame_timeout`, then get
    /// `OverCap`). A client has one request in flight at most: the protocol is one reply per
    /// request, and the daemon reads a connection's next request after answering the last.
    pub in_flight_per_uid: usize,
    /// How long a connection may stay without a request before it joins a scope.
    pub hello_timeout: Duration,
    /// How long a joined connection may stay without a request (its engine reports every few
    /// periods; a connection that ends this way while its process lives keeps its copies).
    pub idle_timeout: Duration,
    /// How long one frame may take to arrive once begun, or to be taken by the client.
    pub frame_timeout: Duration,
}

impl Limits {
    /// The defaults for a machine of `ram_pages` pages of memory.
    pub fn for_ram(ram_pages: u64) -> Self {
        let cpus = std::thread::available_parallelism().map_or(2, |n| n.get());
        Self {
            connections: 1024,
            connections_per_uid: 256,
            pages_per_uid: ram_pages / 2,
            pages_per_client: ram_pages / 4,
            notes: 1 << 24,
            notes_per_uid: 1 << 23,
            notes_per_client: 1 << 22,
            report_bytes: 16 << 10,
            in_flight_per_uid: cpus.max(4),
            hello_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(300),
            frame_timeout: Duration::from_secs(10),
        }
    }

    /// The names [`Limits::set`] takes, with what they set.
    pub const NAMES: &'static [(&'static str, &'static str)] = &[
        ("connections", "connections, all users together"),
        ("connections-per-uid", "connections of one user"),
        ("pages-per-uid", "store pages of one user's scopes"),
        (
            "pages-per-client",
            "store pages one client may hold to get copies",
        ),
        ("notes", "notes of first sightings, all users together"),
        ("notes-per-uid", "notes of one user"),
        ("notes-per-client", "notes of one client"),
        ("report-bytes", "size of a client's counters report"),
        ("in-flight-per-uid", "requests of one user handled at once"),
        (
            "hello-timeout-ms",
            "idle time of a connection before it joins",
        ),
        ("idle-timeout-ms", "idle time of a joined connection"),
        (
            "frame-timeout-ms",
            "time one frame may take to arrive or leave",
        ),
    ];

    /// Sets the cap `name` (one of [`Limits::NAMES`]) to `value`.
    pub fn set(&mut self, name: &str, value: &str) -> Result<(), String> {
        let n: u64 = value
            .parse()
            .map_err(|_| format!("the limit {name} takes a whole number, not {value:?}"))?;
        let count = usize::try_from(n).unwrap_or(usize::MAX);
        let ms = Duration::from_millis(n);
        match name {
            "connections" => self.connections = count,
            "connections-per-uid" => self.connections_per_uid = count,
            "pages-per-uid" => self.pages_per_uid = n,
            "pages-per-client" => self.pages_per_client = n,
            "notes" => self.notes = count,
            "notes-per-uid" => self.notes_per_uid = count,
            "notes-per-client" => self.notes_per_client = count,
            "report-bytes" => self.report_bytes = count,
            "in-flight-per-uid" => self.in_flight_per_uid = count.max(1),
            "hello-timeout-ms" => self.hello_timeout = ms,
            "idle-timeout-ms" => self.idle_timeout = ms,
            "frame-timeout-ms" => self.frame_timeout = ms,
            _ => {
                let names: Vec<&str> = Self::NAMES.iter().map(|n| n.0).collect();
                return Err(format!(
                    "there is no limit {name:?}; the limits are {}",
                    names.join(", ")
                ));
            }
        }
        Ok(())
    }
}

/// What one user holds at the daemon, across its connections and scopes.
pub(crate) struct Account {
    pub(crate) uid: u32,
    /// Store pages allocated in the user's scopes (not yet back on a free list).
    pages: AtomicU64,
    /// Notes (a client's sighting of a content) of the user's clients.
    notes: AtomicUsize,
    in_flight: Mutex<usize>,
    left_flight: Condvar,
}

/// Adds `n` to `count` unless the sum passes `cap` (or overflows); returns whether it did.
fn take<A>(count: &A, n: A::Value, cap: A::Value) -> bool
where
    A: Counter,
{
    count.update(|c| A::add(c, n).filter(|&s| s <= cap))
}

/// Adds as much of `n` to `count` as fits under `cap`; returns how much it added.
fn take_up_to<A>(count: &A, n: A::Value, cap: A::Value) -> A::Value
where
    A: Counter,
{
    let mut got = None;
    count.update(|c| {
        let room = A::sub(cap, c);
        let k = if n < room { n } else { room };
        got = Some(k);
        A::add(c, k)
    });
    got.unwrap_or(A::ZERO)
}

/// The atomic counts [`take`] works on.
trait Counter {
    const ZERO: Self::Value;
    /// `a - b`, or zero below it.
    fn sub(a: Self::Value, b: Self::Value) -> Self::Value;
    type Value: Copy + Ord;
    fn add(a: Self::Value, b: Self::Value) -> Option<Self::Value>;
    fn update(&self, f: impl FnMut(Self::Value) -> Option<Self::Value>) -> bool;
}

impl Counter for AtomicU64 {
    const ZERO: u64 = 0;
    fn sub(a: u64, b: u64) -> u64 {
        a.saturating_sub(b)
    }
    type Value = u64;
    fn add(a: u64, b: u64) -> Option<u64> {
        a.checked_add(b)
    }
    fn update(&self, f: impl FnMut(u64) -> Option<u64>) -> bool {
        // Relaxed: a count checked against a cap; the read-modify-write alone keeps it exact.
        self.fetch_update(Ordering::Relaxed, Ordering::Relaxed, f)
            .is_ok()
    }
}

impl Counter for AtomicUsize {
    const ZERO: usize = 0;
    fn sub(a: usize, b: usize) -> usize {
        a.saturating_sub(b)
    }
    type Value = usize;
    fn add(a: usize, b: usize) -> Option<usize> {
        a.checked_add(b)
    }
    fn update(&self, f: impl FnMut(usize) -> Option<usize>) -> bool {
        // Relaxed: see AtomicU64's.
        self.fetch_update(Ordering::Relaxed, Ordering::Relaxed, f)
            .is_ok()
    }
}

impl Account {
    fn new(uid: u32) -> Self {
        Self {
            uid,
            pages: AtomicU64::new(0),
            notes: AtomicUsize::new(0),
            in_flight: Mutex::new(0),
            left_flight: Condvar::new(),
        }
    }

    pub(crate) fn pages(&self) -> u64 {
        // Relaxed: a count read for a report (caps are checked by `take`).
        self.pages.load(Ordering::Relaxed)
    }

    pub(crate) fn notes(&self) -> usize {
        // Relaxed: see pages.
        self.notes.load(Ordering::Relaxed)
    }

    /// Takes `n` more store pages unless that passes `cap`; returns whether it did.
    pub(crate) fn try_pages(&self, n: u64, cap: u64) -> bool {
        take(&self.pages, n, cap)
    }

    pub(crate) fn return_pages(&self, n: u64) {
        // Relaxed: see Counter for AtomicU64.
        self.pages.fetch_sub(n, Ordering::Relaxed);
    }

    /// Takes up to `n` more notes, as many as `cap` leaves room for; returns how many.
    pub(crate) fn notes_up_to(&self, n: usize, cap: usize) -> usize {
        take_up_to(&self.notes, n, cap)
    }

    pub(crate) fn return_notes(&self, n: usize) {
        // Relaxed: see Counter for AtomicU64.
        self.notes.fetch_sub(n, Ordering::Relaxed);
    }

    /// Waits (at most `wait`) until fewer than `cap` requests of this user are in flight, and
    /// counts one more until the guard is dropped; `None` if the wait ran out.
    pub(crate) fn enter(&self, cap: usize, wait: Duration) -> Option<InFlight<'_>> {
        let n = lock(&self.in_flight);
        let (mut n, timeout) = self
            .left_flight
            .wait_timeout_while(n, wait, |n| *n >= cap)
            .unwrap_or_else(|e| e.into_inner());
        if timeout.timed_out() && *n >= cap {
            return None;
        }
        *n += 1;
        Some(InFlight(self))
    }

    pub(crate) fn in_flight(&self) -> usize {
        *lock(&self.in_flight)
    }
}

/// One request of a user in flight (see [`Account::enter`]).
pub(crate) struct InFlight<'a>(&'a Account);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        *lock(&self.0.in_flight) -= 1;
        self.0.left_flight.notify_one();
    }
}

/// The accounts of the users with connections, and the daemon's totals.
pub(crate) struct Accounts {
    users: Mutex<Users>,
    /// Notes of every scope (for [`Limits::notes`]).
    notes: AtomicUsize,
}

#[derive(Default)]
struct Users {
    connections: usize,
    by_uid: HashMap<u32, (usize, Arc<Account>)>,
}

impl Accounts {
    pub(crate) fn new() -> Self {
        Self {
            users: Mutex::new(Users::default()),
            notes: AtomicUsize::new(0),
        }
    }

    /// Counts a connection of `uid` unless the daemon or that user is at its cap (the error
    /// says which).
    pub(crate) fn connect(
        self: &Arc<Self>,
        uid: u32,
        limits: &Limits,
    ) -> Result<Connection, String> {
        let mut users = lock(&self.users);
        if users.connections >= limits.connections {
            return Err(format!(
                "the daemon serves {} connections, its cap",
                limits.connections
            ));
        }
        let entry = users
            .by_uid
            .entry(uid)
            .or_insert_with(|| (0, Arc::new(Account::new(uid))));
        if entry.0 >= limits.connections_per_uid {
            return Err(format!(
                "uid {uid} has {} connections, its cap",
                limits.connections_per_uid
            ));
        }
        entry.0 += 1;
        let account = entry.1.clone();
        users.connections += 1;
        Ok(Connection {
            accounts: self.clone(),
            account,
        })
    }

    /// Connections, all users together.
    pub(crate) fn connections(&self) -> usize {
        lock(&self.users).connections
    }

    /// Every user's account with its connections (for `status`).
    pub(crate) fn users(&self) -> Vec<(usize, Arc<Account>)> {
        lock(&self.users).by_uid.values().cloned().collect()
    }

    /// Takes up to `n` more notes of the daemon's total, as many as `cap` leaves room for;
    /// returns how many.
    pub(crate) fn notes_up_to(&self, n: usize, cap: usize) -> usize {
        take_up_to(&self.notes, n, cap)
    }

    pub(crate) fn notes(&self) -> usize {
        // Relaxed: a count read for a report.
        self.notes.load(Ordering::Relaxed)
    }

    pub(crate) fn return_notes(&self, n: usize) {
        // Relaxed: see Counter for AtomicU64.
        self.notes.fetch_sub(n, Ordering::Relaxed);
    }
}

/// A connection counted against the daemon's and its user's caps until dropped.
pub(crate) struct Connection {
    accounts: Arc<Accounts>,
    pub(crate) account: Arc<Account>,
}

impl Drop for Connection {
    fn drop(&mut self) {
        let mut users = lock(&self.accounts.users);
        users.connections -= 1;
        let uid = self.account.uid;
        if let Some(e) = users.by_uid.get_mut(&uid) {
            e.0 -= 1;
            // A user without connections has no scopes left (a scope goes with its last
            // client, whose connection this was or came before): its account goes too.
            if e.0 == 0 {
                users.by_uid.remove(&uid);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connections_are_capped_per_user_and_in_all() {
        let mut limits = Limits::for_ram(1 << 20);
        limits.connections = 3;
        limits.connections_per_uid = 2;
        let accounts = Arc::new(Accounts::new());
        let a1 = accounts.connect(1000, &limits).unwrap();
        let a2 = accounts.connect(1000, &limits).unwrap();
        let e = accounts.connect(1000, &limits).err().unwrap();
        assert!(e.contains("uid 1000"), "{e}");
        // Another user is not affected by the first one's cap...
        let b = accounts.connect(1001, &limits).unwrap();
        // ... but by the daemon's.
        assert!(accounts.connect(1002, &limits).is_err());
        drop(a1);
        let a3 = accounts.connect(1000, &limits).unwrap();
        assert!(Arc::ptr_eq(&a2.account, &a3.account));
        drop((a2, a3, b));
        assert_eq!(accounts.connections(), 0);
        assert!(accounts.users().is_empty());
    }

    #[test]
    fn pages_and_notes_stop_at_their_caps() {
        let a = Account::new(7);
        assert!(a.try_pages(10, 16));
        assert!(!a.try_pages(7, 16));
        assert!(a.try_pages(6, 16));
        assert_eq!(a.pages(), 16);
        a.return_pages(16);
        // A count near the top of the type saturates instead of wrapping past the cap.
        assert!(!a.try_pages(u64::MAX, 16));
        assert_eq!(a.notes_up_to(2, 3), 2);
        assert_eq!(a.notes_up_to(5, 3), 1);
        assert_eq!(a.notes_up_to(5, 3), 0);
        a.return_notes(3);
        assert_eq!(a.notes(), 0);
    }

    #[test]
    fn requests_beyond_the_users_cap_wait_then_give_up() {
        let a = Account::new(7);
        let first = a.enter(1, Duration::from_millis(10)).unwrap();
        assert!(a.enter(1, Duration::from_millis(50)).is_none());
        drop(first);
        assert!(a.enter(1, Duration::from_millis(50)).is_some());
        assert_eq!(a.in_flight(), 0);
    }

    #[test]
    fn limits_are_set_by_name() {
        let mut l = Limits::for_ram(1 << 20);
        l.set("pages-per-uid", "100").unwrap();
        l.set("frame-timeout-ms", "250").unwrap();
        assert_eq!(l.pages_per_uid, 100);
        assert_eq!(l.frame_timeout, Duration::from_millis(250));
        assert!(l.set("pages", "1").is_err());
        assert!(l.set("notes", "-1").is_err());
        for (name, _) in Limits::NAMES {
            l.set(name, "5").unwrap();
        }
    }
}
