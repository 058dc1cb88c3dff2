//! The wire protocol between engines (clients) and `pageone daemon`.
//!
//! Frames on a Unix stream socket: `u32 length` (little-endian, of what follows), `u32 tag`, body.
//! Every request gets exactly one reply. Bodies are fixed-size records behind counts, so a decoder
//! checks one bound per frame; a frame over [`MAX_FRAME`] or with inconsistent counts is an error
//! and ends the connection. Two frames carry a descriptor (`SCM_RIGHTS`): `Hello` (the read end
//! of the client's pipe, into which it `vmsplice`s the pages a copy request names) and `Welcome`
//! (the scope's store, re-opened read-only for the client).
//!
//! The daemon trusts nothing a client says: it hashes the bytes it copied itself, clients can only
//! release their own holds, and every merge is verified by the client on frozen bytes anyway.
//!
//! Over a cap of the daemon (store pages, report size, requests in flight), a request gets
//! [`Reply::OverCap`]: the client goes on with fewer merges, nothing else changes.
//!
//! [`store`] describes the store file both ends share (slot `n` is the page at `n * 4096`) and
//! how it is protected; [`auth`] which daemon a client trusts; [`socket`] where sockets live.

pub mod auth;
pub mod socket;
pub mod store;
mod wire;

pub use wire::*;

/// The environment variable `name`, unless this process runs in secure-execution mode
/// (set-user-ID, set-group-ID or file capabilities: `AT_SECURE`), whose environment is its
/// caller's to choose: then every `PAGEONE_*` setting (and the runtime directory) is ignored.
pub fn setting(name: &str) -> Option<std::ffi::OsString> {
    if pageone_sys::secure_execution() {
        return None;
    }
    std::env::var_os(name).filter(|v| !v.is_empty())
}
