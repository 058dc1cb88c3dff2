//! Waiting for the engine's periods (`pageone_engine_wait_periods`). Its own file only because
//! the header lists it after the pool's functions, and cbindgen lists functions in the order it
//! reads them.

use std::time::Duration;

use crate::engine::pageone_engine;
use crate::status::pageone_status::{self, *};

/// The longest wait honoured (about 31 years): longer timeouts are cut to it.
const MAX_WAIT_MS: u64 = 1 << 50;

/// Blocks until `n` more periods have completed (starting each one at once) or `timeout_ms`
/// milliseconds passed. Returns `PAGEONE_OK` when they completed, `PAGEONE_TIMEOUT` otherwise.
/// A page unchanged since registration is merged after `merge_periods` + 1 periods or so.
///
/// # Safety
///
/// `engine` must be NULL or a live engine.
#[no_mangle]
pub unsafe extern "C" fn pageone_engine_wait_periods(
    engine: *const pageone_engine,
    n: u64,
    timeout_ms: u64,
) -> pageone_status {
    ffi_panic_boundary! {
        // SAFETY: NULL or a live engine by the contract; engines are only shared.
        let engine = unsafe { try_ref_from_ptr!(engine) };
        let timeout = Duration::from_millis(timeout_ms.min(MAX_WAIT_MS));
        if engine.engine.wait_periods(n.min(u64::MAX / 2), timeout) {
            PAGEONE_OK
        } else {
            PAGEONE_TIMEOUT
        }
    }
}
