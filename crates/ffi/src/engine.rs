//! The engine handle: [`pageone_engine`], started from a configuration, and the exports that
//! run it (register, unregister, stats, kick).

use std::ffi::{c_int, c_void};

use ::pageone_engine::{Config, DropAdvice, Engine, EngineError};

use crate::boundary::new_into;
use crate::config::pageone_config;
use crate::stats::pageone_stats;
use crate::status::pageone_status::{self, *};
use crate::status::status_of;

/// A running deduplication engine (`pageone_engine_new`, `pageone_engine_free`).
pub struct pageone_engine {
    pub(crate) engine: Engine,
}

// The engine is shared between the caller's threads.
const _: fn() = || {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Engine>();
};

fn start(c: &Config) -> Result<Engine, EngineError> {
    let engine = Engine::builder()
        .workers(c.workers)
        .merge_period(c.merge_period)
        .merge_periods(c.merge_periods)
        .max_sharing(c.max_sharing)
        .scope(c.scope.clone())
        .watch(c.watch)
        .vma_margin(c.vma_margin)
        .populate_merged(c.populate_merged)
        .merging(c.merging)
        .priority(c.priority)
        .daemon(c.daemon.clone())
        .build()?;
    // The builder has no setter for the back-off cap.
    let max_backoff = c.max_backoff;
    engine.reconfigure(|c| c.max_backoff = max_backoff)?;
    Ok(engine)
}

/// Starts an engine with the configuration `cfg` (NULL: the defaults of `pageone_config_new`)
/// and stores it in `*out` (NULL on failure). `cfg` may be freed or changed afterwards. Free
/// the engine with `pageone_engine_free`.
///
/// Needs Linux >= 6.8 (`UFFDIO_MOVE`) and permission to use userfaultfd.
///
/// # Safety
///
/// `cfg` must be NULL or a live configuration not being changed by another thread; `out` must
/// be NULL or valid for writing one pointer.
#[no_mangle]
pub unsafe extern "C" fn pageone_engine_new(
    cfg: *const pageone_config,
    out: *mut *mut pageone_engine,
) -> pageone_status {
    ffi_panic_boundary! {
        let make = || {
            // SAFETY: NULL or a live configuration by the contract.
            let config = match unsafe { cfg.as_ref() } {
                Some(c) => c.config.clone(),
                None => Config::default(),
            };
            start(&config)
                .map(|engine| pageone_engine { engine })
                .map_err(|e| pageone_status::from(&e))
        };
        // SAFETY: `out` is NULL or valid for writing one pointer by the contract.
        unsafe { new_into(out, make) }
    }
}

/// Stops and frees an engine: every registered page becomes private again with its contents
/// intact. NULL is allowed and does nothing.
///
/// # Safety
///
/// `engine` must be NULL or an engine from `pageone_engine_new` not yet freed; no other call
/// may use it concurrently or afterwards.
#[no_mangle]
pub unsafe extern "C" fn pageone_engine_free(engine: *mut pageone_engine) {
    ffi_panic_boundary! {
        // SAFETY: NULL, or from Box::into_raw in pageone_engine_new and not freed yet, with no
        // concurrent user, by the contract.
        let engine = unsafe { try_box_from_ptr!(engine) };
        engine.engine.shutdown();
    }
}

/// Registers `[addr, addr + len)` for merging, the equivalent of `madvise(MADV_MERGEABLE)`. The
/// range must be page-aligned private anonymous read/write memory (`mmap(MAP_PRIVATE |
/// MAP_ANONYMOUS)`). The engine never changes its contents; registering does not populate it.
///
/// # Safety
///
/// `engine` must be NULL or a live engine. The range must belong to the caller, who must not
/// unmap or remap it while it is registered (unregister it first).
#[no_mangle]
pub unsafe extern "C" fn pageone_engine_register(
    engine: *const pageone_engine,
    addr: *mut c_void,
    len: usize,
) -> pageone_status {
    ffi_panic_boundary! {
        ensure_not_null!(addr);
        // SAFETY: NULL or a live engine by the contract; engines are only shared.
        let engine = unsafe { try_ref_from_ptr!(engine) };
        status_of(engine.engine.register(addr.cast(), len))
    }
}

/// Unregisters the registered pages inside `[addr, addr + len)`, the equivalent of
/// `madvise(MADV_UNMERGEABLE)`: those pages become private again with their contents intact, and
/// the rest of each region stays registered. `PAGEONE_NOT_REGISTERED` if none was.
///
/// # Safety
///
/// `engine` must be NULL or a live engine.
#[no_mangle]
pub unsafe extern "C" fn pageone_engine_unregister(
    engine: *const pageone_engine,
    addr: *mut c_void,
    len: usize,
) -> pageone_status {
    ffi_panic_boundary! {
        ensure_not_null!(addr);
        // SAFETY: NULL or a live engine by the contract; engines are only shared.
        let engine = unsafe { try_ref_from_ptr!(engine) };
        status_of(engine.engine.unregister(addr.cast(), len))
    }
}

/// `madvise(addr, len, advice)` for `MADV_DONTNEED`, `MADV_DONTNEED_LOCKED` or `MADV_FREE`, as
/// the kernel answers it (`PAGEONE_REFUSED` with the kernel's `errno` where it refuses), with
/// merged pages made empty: they read zeros, as the kernel promises (`MADV_FREE` of merged pages
/// drops them, which it allows). Merged pages are mappings of pageone's store: a plain `madvise`
/// would leave them reading their merged copy, so call this instead of `madvise` on registered
/// memory. `PAGEONE_INVALID_ARGUMENT` for any other advice.
///
/// # Safety
///
/// `engine` must be NULL or a live engine. The range must belong to the caller, whose data there
/// is dropped.
#[no_mangle]
pub unsafe extern "C" fn pageone_engine_drop_pages(
    engine: *const pageone_engine,
    addr: *mut c_void,
    len: usize,
    advice: c_int,
) -> pageone_status {
    ffi_panic_boundary! {
        ensure_not_null!(addr);
        // SAFETY: NULL or a live engine by the contract; engines are only shared.
        let engine = unsafe { try_ref_from_ptr!(engine) };
        let Some(how) = DropAdvice::from_madvise(advice) else {
            return PAGEONE_INVALID_ARGUMENT;
        };
        let r = engine.engine.drop_pages(addr.cast(), len, how);
        if let Err(EngineError::Refused(e)) = &r {
            // SAFETY: errno is this thread's.
            unsafe { *libc::__errno_location() = e.raw_os_error().unwrap_or(libc::EINVAL) };
        }
        status_of(r)
    }
}

/// The caller locked (`locked` true: `mlock`, `mlock2`) or unlocked (`munlock`) `[addr, addr +
/// len)`, and the kernel took it: what the engine maps over registered pages there later
/// (merged pages, released pages, memory given back) is locked or left unlocked alike. Call it
/// after the kernel's call; without it, the engine locks what it maps over pages it found locked
/// when it merged them, and only those.
///
/// # Safety
///
/// `engine` must be NULL or a live engine.
#[no_mangle]
pub unsafe extern "C" fn pageone_engine_locking_changed(
    engine: *const pageone_engine,
    addr: *mut c_void,
    len: usize,
    locked: bool,
) -> pageone_status {
    ffi_panic_boundary! {
        ensure_not_null!(addr);
        // SAFETY: NULL or a live engine by the contract; engines are only shared.
        let engine = unsafe { try_ref_from_ptr!(engine) };
        engine.engine.locking_changed(addr.cast(), len, locked);
        PAGEONE_OK
    }
}

/// Writes a snapshot of the engine's counters to `*out`.
///
/// # Safety
///
/// `engine` must be NULL or a live engine; `out` must be NULL or valid for writing one
/// `pageone_stats`.
#[no_mangle]
pub unsafe extern "C" fn pageone_engine_stats(
    engine: *const pageone_engine,
    out: *mut pageone_stats,
) -> pageone_status {
    ffi_panic_boundary! {
        ensure_not_null!(out);
        // SAFETY: NULL or a live engine by the contract; engines are only shared.
        let engine = unsafe { try_ref_from_ptr!(engine) };
        let s = pageone_stats::from(&engine.engine.stats());
        // SAFETY: not NULL (checked) and valid for a write by the contract.
        unsafe { out.write(s) };
        PAGEONE_OK
    }
}

/// Starts the next period now instead of at the end of the current merge period.
///
/// # Safety
///
/// `engine` must be NULL or a live engine.
#[no_mangle]
pub unsafe extern "C" fn pageone_engine_kick(engine: *const pageone_engine) -> pageone_status {
    ffi_panic_boundary! {
        // SAFETY: NULL or a live engine by the contract; engines are only shared.
        let engine = unsafe { try_ref_from_ptr!(engine) };
        engine.engine.kick();
        PAGEONE_OK
    }
}
