//! Why an engine operation failed.

use std::io;

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
    #[error("range {addr:#x}+{len:#x} overlaps a registered region without matching it")]
    Overlap { addr: usize, len: usize },
    #[error("range {addr:#x}+{len:#x} is not registered")]
    NotRegistered { addr: usize, len: usize },
    #[error("invalid configuration: {0}")]
    Config(&'static str),
    #[error("memory could not be mapped")]
    Map(#[source] io::Error),
    #[error("the engine thread could not be started")]
    Thread(#[source] io::Error),
    #[error("the pageone daemon could not be joined: {0}")]
    Daemon(String),
}
