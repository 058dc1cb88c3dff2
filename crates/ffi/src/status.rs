//! Status codes: [`pageone_status`], its messages, and the two exports that need no handle
//! (`pageone_version`, `pageone_status_message`).

use std::ffi::{c_char, c_int, CStr};

use ::pageone_engine::EngineError;

/// The result of a pageone call: `PAGEONE_OK` (0) or why it failed.
///
/// Codes below 100 are about the call itself; codes from 100 on are the engine's errors.
/// Values are stable; new codes may be added.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum pageone_status {
    /// Success.
    PAGEONE_OK = 0,
    /// A pointer argument that must not be NULL was NULL.
    PAGEONE_NULL_ARGUMENT = 1,
    /// An argument was out of range or malformed (e.g. a string that is not UTF-8, an unknown
    /// enum value).
    PAGEONE_INVALID_ARGUMENT = 2,
    /// pageone panicked (a bug); the call had no effect or an incomplete one.
    PAGEONE_PANIC = 3,
    /// The wait ended before what was waited for happened.
    PAGEONE_TIMEOUT = 4,
    /// The kernel lacks a feature pageone needs (Linux >= 6.8 for `UFFDIO_MOVE`).
    PAGEONE_UNSUPPORTED = 100,
    /// userfaultfd could not be set up (permissions: `vm.unprivileged_userfaultfd`).
    PAGEONE_UFFD = 101,
    /// The stable store (memfd) could not be created.
    PAGEONE_STORE = 102,
    /// The content index failed.
    PAGEONE_INDEX = 103,
    /// The range is not page-aligned and non-empty.
    PAGEONE_UNALIGNED = 104,
    /// The range is not entirely private anonymous read/write memory.
    PAGEONE_NOT_ANONYMOUS = 105,
    /// The range overlaps a registered region without matching it.
    PAGEONE_OVERLAP = 106,
    /// The range is not registered.
    PAGEONE_NOT_REGISTERED = 107,
    /// The configuration is invalid (e.g. zero workers or a zero merge period).
    PAGEONE_CONFIG = 108,
    /// Memory could not be mapped.
    PAGEONE_MAP = 109,
    /// An engine thread could not be started.
    PAGEONE_THREAD = 110,
    /// The pageone daemon could not be joined.
    PAGEONE_DAEMON = 111,
    /// The kernel refused the call; `errno` holds its error.
    PAGEONE_REFUSED = 112,
}

use pageone_status::*;

impl From<&EngineError> for pageone_status {
    fn from(e: &EngineError) -> Self {
        match e {
            EngineError::Unsupported(_) => PAGEONE_UNSUPPORTED,
            EngineError::Uffd(_) => PAGEONE_UFFD,
            EngineError::Store(_) => PAGEONE_STORE,
            EngineError::Index(_) => PAGEONE_INDEX,
            EngineError::Unaligned { .. } => PAGEONE_UNALIGNED,
            // Memory the engine uses itself is not the program's anonymous memory either.
            EngineError::NotAnonymous { .. } | EngineError::EngineMemory { .. } => {
                PAGEONE_NOT_ANONYMOUS
            }
            EngineError::Overlap { .. } => PAGEONE_OVERLAP,
            EngineError::NotRegistered { .. } => PAGEONE_NOT_REGISTERED,
            EngineError::Config(_) => PAGEONE_CONFIG,
            EngineError::Map(_) => PAGEONE_MAP,
            EngineError::Thread(_) => PAGEONE_THREAD,
            EngineError::Daemon(_) => PAGEONE_DAEMON,
            EngineError::Refused(_) => PAGEONE_REFUSED,
        }
    }
}

/// Every status, for [`pageone_status_message`] (private: cbindgen would export it).
const ALL_STATUSES: [pageone_status; 18] = [
    PAGEONE_OK,
    PAGEONE_NULL_ARGUMENT,
    PAGEONE_INVALID_ARGUMENT,
    PAGEONE_PANIC,
    PAGEONE_TIMEOUT,
    PAGEONE_UNSUPPORTED,
    PAGEONE_UFFD,
    PAGEONE_STORE,
    PAGEONE_INDEX,
    PAGEONE_UNALIGNED,
    PAGEONE_NOT_ANONYMOUS,
    PAGEONE_OVERLAP,
    PAGEONE_NOT_REGISTERED,
    PAGEONE_CONFIG,
    PAGEONE_MAP,
    PAGEONE_THREAD,
    PAGEONE_DAEMON,
    PAGEONE_REFUSED,
];

impl pageone_status {
    /// A static description of the status.
    pub fn message(self) -> &'static CStr {
        match self {
            PAGEONE_OK => c"ok",
            PAGEONE_NULL_ARGUMENT => c"a required pointer argument was NULL",
            PAGEONE_INVALID_ARGUMENT => c"an argument was out of range or malformed",
            PAGEONE_PANIC => c"pageone panicked (a bug); the call did not complete",
            PAGEONE_TIMEOUT => c"timed out",
            PAGEONE_UNSUPPORTED => c"the kernel lacks a feature pageone needs (Linux >= 6.8)",
            PAGEONE_UFFD => c"userfaultfd could not be set up",
            PAGEONE_STORE => c"the stable store could not be created",
            PAGEONE_INDEX => c"the content index failed",
            PAGEONE_UNALIGNED => c"the range is not page-aligned and non-empty",
            PAGEONE_NOT_ANONYMOUS => {
                c"the range is not entirely private anonymous read/write memory"
            }
            PAGEONE_OVERLAP => c"the range overlaps a registered region without matching it",
            PAGEONE_NOT_REGISTERED => c"the range is not registered",
            PAGEONE_CONFIG => c"invalid configuration",
            PAGEONE_MAP => c"memory could not be mapped",
            PAGEONE_THREAD => c"an engine thread could not be started",
            PAGEONE_DAEMON => c"the pageone daemon could not be joined",
            PAGEONE_REFUSED => c"the kernel refused the call (errno says why)",
        }
    }
}

/// The status of an engine call.
pub(crate) fn status_of(r: Result<(), EngineError>) -> pageone_status {
    match r {
        Ok(()) => PAGEONE_OK,
        Err(e) => pageone_status::from(&e),
    }
}

/// The description of a value that is no `pageone_status`.
const UNKNOWN_STATUS: &CStr = c"unknown pageone status";

/// The version of the library, e.g. `"0.1.0"` (a static string).
#[no_mangle]
pub extern "C" fn pageone_version() -> *const c_char {
    const VERSION: &CStr =
        match CStr::from_bytes_with_nul(concat!(env!("CARGO_PKG_VERSION"), "\0").as_bytes()) {
            Ok(v) => v,
            Err(_) => panic!("the version contains a NUL"),
        };
    ffi_panic_boundary! { VERSION.as_ptr() }
}

/// A static, NUL-terminated description of `status` (a `pageone_status`); never NULL. Unknown
/// values give `"unknown pageone status"`.
#[no_mangle]
pub extern "C" fn pageone_status_message(status: c_int) -> *const c_char {
    ffi_panic_boundary! {
        on_panic: UNKNOWN_STATUS.as_ptr();
        ALL_STATUSES
            .iter()
            .find(|s| **s as c_int == status)
            .map_or(UNKNOWN_STATUS, |s| s.message())
            .as_ptr()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_status_has_a_distinct_message() {
        let mut seen = std::collections::HashSet::new();
        for s in ALL_STATUSES {
            let m = pageone_status_message(s as c_int);
            // SAFETY: pageone_status_message returns static NUL-terminated strings.
            let m = unsafe { CStr::from_ptr(m) };
            assert!(seen.insert(m.to_owned()), "{s:?}: duplicate message");
        }
        // SAFETY: as above.
        let unknown = unsafe { CStr::from_ptr(pageone_status_message(-7)) };
        assert_eq!(unknown, c"unknown pageone status");
    }

    #[test]
    fn version_is_the_crate_version() {
        // SAFETY: a static NUL-terminated string.
        let v = unsafe { CStr::from_ptr(pageone_version()) };
        assert_eq!(v.to_str().unwrap(), env!("CARGO_PKG_VERSION"));
    }
}
