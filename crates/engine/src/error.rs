//! Why an engine operation failed.

use std::io;

use crate::proto::ProtoError;

/// Why an engine operation failed.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("the kernel lacks a feature pageone needs: {0}")]
    Unsupported(&'static str),
    #[error("userfaultfd could not be set up")]
    Uffd(#[source] io::Error),
    #[error("the stable store could not be created")]
    Store(#[source] io::Error),
    #[error("the content index failed")]
    Index(#[source] pageone_index::IndexError),
    #[error("range {addr:#x}+{len:#x} is not page-aligned and non-empty")]
    Unaligned { addr: usize, len: usize },
    #[error("range {addr:#x}+{len:#x} is not entirely private anonymous read/write memory")]
    NotAnonymous { addr: usize, len: usize },
    #[error("range {addr:#x}+{len:#x} overlaps memory the engine uses itself")]
    EngineMemory { addr: usize, len: usize },
    #[error("range {addr:#x}+{len:#x} overlaps a registered region without matching it")]
    Overlap { addr: usize, len: usize },
    #[error("range {addr:#x}+{len:#x} is not registered")]
    NotRegistered { addr: usize, len: usize },
    #[error("invalid configuration: {0}")]
    Config(&'static str),
    #[error("memory could not be mapped")]
    Map(#[source] io::Error),
    #[error("the kernel refused the call")]
    Refused(#[source] io::Error),
    #[error("the engine thread could not be started")]
    Thread(#[source] io::Error),
    #[error("the pageone daemon could not be joined")]
    Daemon(#[source] DaemonError),
}

/// Why the pageone daemon could not be joined.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DaemonError {
    #[error("its socket could not be connected to")]
    Connect(#[source] io::Error),
    #[error("the connection's timeouts could not be set")]
    Timeout(#[source] io::Error),
    #[error("the greeting failed")]
    Greeting(#[source] ProtoError),
    #[error("the daemon answered the greeting without a store")]
    NoStore,
    #[error("the daemon offered an unusable store")]
    UnusableStore,
    #[error("its store was refused: {0}")]
    StoreRefused(String),
}

/// An error with its sources, as one line (`outer: inner: innermost`), for logs.
pub(crate) struct Chain<'a>(pub(crate) &'a dyn std::error::Error);

impl std::fmt::Display for Chain<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)?;
        let mut source = self.0.source();
        while let Some(e) = source {
            write!(f, ": {e}")?;
            source = e.source();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_daemon_error_reads_as_one_line_with_its_cause() {
        let e = EngineError::Daemon(DaemonError::Connect(io::Error::from(
            io::ErrorKind::NotFound,
        )));
        assert_eq!(
            Chain(&e).to_string(),
            "the pageone daemon could not be joined: its socket could not be connected to: \
             entity not found"
        );
        let e = EngineError::Daemon(DaemonError::NoStore);
        assert_eq!(
            Chain(&e).to_string(),
            "the pageone daemon could not be joined: the daemon answered the greeting without a \
             store"
        );
    }
}
