//! The configuration handle: [`pageone_config`] and its builder exports (`pageone_config_new`,
//! `pageone_config_free`, `pageone_config_set_*`).

use std::ffi::{c_char, CStr, OsStr};
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;
use std::time::Duration;

use ::pageone_engine::{Config, Priority, WatchMode};

use crate::boundary::new_into;
use crate::stats::pageone_watch_mode;
use crate::status::pageone_status::{self, *};

/// Engine settings, built up with `pageone_config_set_*` and passed to `pageone_engine_new`.
/// Created by `pageone_config_new` with the engine's defaults (which read `$PAGEONE_SCOPE` and
/// `$PAGEONE_SOCKET` at that moment), freed by `pageone_config_free`. Not thread-safe.
pub struct pageone_config {
    pub(crate) config: Config,
}

/// The body of a `pageone_config_set_*` export, inside the panic boundary: a NULL `cfg` gives
/// `PAGEONE_NULL_ARGUMENT`; else `field` of the configuration becomes `value`, or with `try`
/// the `Ok` of `value` (an `Err` is returned as the status and the configuration is left as it
/// was). `value` is evaluated after `cfg` is checked.
///
/// Expands to `<*mut pageone_config>::as_mut`, so it must stand in an `unsafe` block whose
/// `SAFETY:` comment says why `cfg`, when not NULL, is a live configuration no other thread uses
/// during the call (and why `value` may do what it does).
macro_rules! config_setter {
    ($cfg:ident . $field:ident = try $value:expr) => {
        ffi_panic_boundary! {
            let cfg: &mut pageone_config = try_mut_from_ptr!($cfg);
            match $value {
                Ok(v) => {
                    cfg.config.$field = v;
                    PAGEONE_OK
                }
                Err(status) => status,
            }
        }
    };
    ($cfg:ident . $field:ident = $value:expr) => {
        config_setter!($cfg.$field = try Ok::<_, pageone_status>($value))
    };
}

/// Creates a configuration with the engine's defaults (2 workers, a 200 ms merge period, 2
/// periods, scope `$PAGEONE_SCOPE` or `"default"`, daemon `$PAGEONE_SOCKET` or none) and stores
/// it in `*out` (NULL on failure). Free it with `pageone_config_free`.
///
/// # Safety
///
/// `out` must be NULL or valid for writing one pointer.
#[no_mangle]
pub unsafe extern "C" fn pageone_config_new(out: *mut *mut pageone_config) -> pageone_status {
    ffi_panic_boundary! {
        let make = || {
            Ok(pageone_config {
                config: Config::default(),
            })
        };
        // SAFETY: `out` is NULL or valid for writing one pointer by the contract.
        unsafe { new_into(out, make) }
    }
}

/// Frees a configuration. NULL is allowed and does nothing. Engines created from it are not
/// affected.
///
/// # Safety
///
/// `cfg` must be NULL or a configuration from `pageone_config_new` not yet freed; it must not
/// be used afterwards.
#[no_mangle]
pub unsafe extern "C" fn pageone_config_free(cfg: *mut pageone_config) {
    ffi_panic_boundary! {
        // SAFETY: NULL, or from Box::into_raw in pageone_config_new and not freed yet, by the
        // contract.
        drop(unsafe { try_box_from_ptr!(cfg) });
    }
}

/// Sets the number of classification worker threads (at least 1; checked by
/// `pageone_engine_new`).
///
/// # Safety
///
/// `cfg` must be NULL or a live configuration not used by another thread during the call.
#[no_mangle]
pub unsafe extern "C" fn pageone_config_set_workers(
    cfg: *mut pageone_config,
    workers: usize,
) -> pageone_status {
    // SAFETY: NULL or a live configuration used by no other thread, by the contract.
    unsafe { config_setter!(cfg.workers = workers) }
}

/// Sets the length of one merge period in milliseconds (positive; checked by
/// `pageone_engine_new`).
///
/// # Safety
///
/// `cfg` must be NULL or a live configuration not used by another thread during the call.
#[no_mangle]
pub unsafe extern "C" fn pageone_config_set_merge_period_ms(
    cfg: *mut pageone_config,
    ms: u64,
) -> pageone_status {
    // SAFETY: NULL or a live configuration used by no other thread, by the contract.
    unsafe { config_setter!(cfg.merge_period = Duration::from_millis(ms)) }
}

/// Sets how many periods a page must stay unchanged before it is merged (at least 1; checked by
/// `pageone_engine_new`).
///
/// # Safety
///
/// `cfg` must be NULL or a live configuration not used by another thread during the call.
#[no_mangle]
pub unsafe extern "C" fn pageone_config_set_merge_periods(
    cfg: *mut pageone_config,
    periods: u8,
) -> pageone_status {
    // SAFETY: NULL or a live configuration used by no other thread, by the contract.
    unsafe { config_setter!(cfg.merge_periods = periods) }
}

/// Sets the cap, in periods, of the back-off for pages that keep changing.
///
/// # Safety
///
/// `cfg` must be NULL or a live configuration not used by another thread during the call.
#[no_mangle]
pub unsafe extern "C" fn pageone_config_set_max_backoff(
    cfg: *mut pageone_config,
    periods: u8,
) -> pageone_status {
    // SAFETY: NULL or a live configuration used by no other thread, by the contract.
    unsafe { config_setter!(cfg.max_backoff = periods) }
}

/// Sets the most pages mapping one stable copy (KSM's `max_page_sharing`; at least 2; checked
/// by `pageone_engine_new`).
///
/// # Safety
///
/// `cfg` must be NULL or a live configuration not used by another thread during the call.
#[no_mangle]
pub unsafe extern "C" fn pageone_config_set_max_sharing(
    cfg: *mut pageone_config,
    pages: u32,
) -> pageone_status {
    // SAFETY: NULL or a live configuration used by no other thread, by the contract.
    unsafe { config_setter!(cfg.max_sharing = pages) }
}

/// Sets how many VMAs are kept free below `vm.max_map_count`.
///
/// # Safety
///
/// `cfg` must be NULL or a live configuration not used by another thread during the call.
#[no_mangle]
pub unsafe extern "C" fn pageone_config_set_vma_margin(
    cfg: *mut pageone_config,
    vmas: usize,
) -> pageone_status {
    // SAFETY: NULL or a live configuration used by no other thread, by the contract.
    unsafe { config_setter!(cfg.vma_margin = vmas) }
}

/// Sets whether merged pages are mapped as they merge where the kernel cannot report minor faults
/// (`populate_merged` in the Rust API; elsewhere they always are).
///
/// # Safety
///
/// `cfg` must be NULL or a live configuration not used by another thread during the call.
#[no_mangle]
pub unsafe extern "C" fn pageone_config_set_populate_merged(
    cfg: *mut pageone_config,
    on: bool,
) -> pageone_status {
    // SAFETY: NULL or a live configuration used by no other thread, by the contract.
    unsafe { config_setter!(cfg.populate_merged = on) }
}

/// Sets whether the engine merges pages (the default). Off, it only recycles the pages marked
/// free in its pool (`pageone_engine_recycle_from`): registered memory is then neither
/// write-protected nor scanned (`merging` in the Rust API).
///
/// # Safety
///
/// `cfg` must be NULL or a live configuration not used by another thread during the call.
#[no_mangle]
pub unsafe extern "C" fn pageone_config_set_merging(
    cfg: *mut pageone_config,
    on: bool,
) -> pageone_status {
    // SAFETY: NULL or a live configuration used by no other thread, by the contract.
    unsafe { config_setter!(cfg.merging = on) }
}

/// Sets whether huge pages the watch split are collapsed back where nothing merged (the
/// default; `restore_huge_pages` in the Rust API).
///
/// # Safety
///
/// `cfg` must be NULL or a live configuration not used by another thread during the call.
#[no_mangle]
pub unsafe extern "C" fn pageone_config_set_restore_huge_pages(
    cfg: *mut pageone_config,
    on: bool,
) -> pageone_status {
    // SAFETY: NULL or a live configuration used by no other thread, by the contract.
    unsafe { config_setter!(cfg.restore_huge_pages = on) }
}

/// Sets whether memory whose merges cost a mapping per page (the 64 MiB parts of a region where
/// they do), or a region whose pages are not read/write, is handed to the kernel's KSM where it
/// runs (the default; `ksm_when_limited` in the Rust API).
///
/// # Safety
///
/// `cfg` must be NULL or a live configuration not used by another thread during the call.
#[no_mangle]
pub unsafe extern "C" fn pageone_config_set_ksm_when_limited(
    cfg: *mut pageone_config,
    on: bool,
) -> pageone_status {
    // SAFETY: NULL or a live configuration used by no other thread, by the contract.
    unsafe { config_setter!(cfg.ksm_when_limited = on) }
}

/// Sets how written pages are detected: a `pageone_watch_mode`. Other values give
/// `PAGEONE_INVALID_ARGUMENT`.
///
/// # Safety
///
/// `cfg` must be NULL or a live configuration not used by another thread during the call.
#[no_mangle]
pub unsafe extern "C" fn pageone_config_set_watch(
    cfg: *mut pageone_config,
    mode: u32,
) -> pageone_status {
    // SAFETY: NULL or a live configuration used by no other thread, by the contract.
    unsafe { config_setter!(cfg.watch = try watch_mode(mode)) }
}

/// How the engine's threads are scheduled (`pageone_config_set_priority`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum pageone_priority {
    /// Idle priority, but the normal class for a while when busy threads starve them while
    /// memory is short (the default).
    PAGEONE_PRIORITY_AUTO = 0,
    /// Idle priority always: spare CPU only.
    PAGEONE_PRIORITY_IDLE = 1,
    /// The normal class always, as the program's own threads.
    PAGEONE_PRIORITY_NORMAL = 2,
}

/// Sets how the engine's threads are scheduled: a `pageone_priority` (for the whole process:
/// the last engine started sets it). Other values give `PAGEONE_INVALID_ARGUMENT`.
///
/// # Safety
///
/// `cfg` must be NULL or a live configuration not used by another thread during the call.
#[no_mangle]
pub unsafe extern "C" fn pageone_config_set_priority(
    cfg: *mut pageone_config,
    priority: u32,
) -> pageone_status {
    // SAFETY: NULL or a live configuration used by no other thread, by the contract.
    unsafe { config_setter!(cfg.priority = try priority_of(priority)) }
}

/// A `pageone_priority` from C as the engine's [`Priority`].
fn priority_of(p: u32) -> Result<Priority, pageone_status> {
    match p {
        p if p == pageone_priority::PAGEONE_PRIORITY_AUTO as u32 => Ok(Priority::Auto),
        p if p == pageone_priority::PAGEONE_PRIORITY_IDLE as u32 => Ok(Priority::Idle),
        p if p == pageone_priority::PAGEONE_PRIORITY_NORMAL as u32 => Ok(Priority::Normal),
        _ => Err(PAGEONE_INVALID_ARGUMENT),
    }
}

/// Sets the scope (tenant) name: only pages of one scope are ever shared through a daemon.
/// `scope` is copied; it must be UTF-8 (else `PAGEONE_INVALID_ARGUMENT`).
///
/// # Safety
///
/// `cfg` must be NULL or a live configuration not used by another thread during the call;
/// `scope` must be NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn pageone_config_set_scope(
    cfg: *mut pageone_config,
    scope: *const c_char,
) -> pageone_status {
    // SAFETY: NULL or a live configuration used by no other thread, by the contract; `scope` is
    // NULL or NUL-terminated by the contract, and copied before returning.
    unsafe { config_setter!(cfg.scope = try utf8_arg(scope).map(str::to_owned)) }
}

/// Sets the pageone daemon socket to join; NULL: run alone even if `$PAGEONE_SOCKET` is set.
/// `socket` is copied.
///
/// # Safety
///
/// `cfg` must be NULL or a live configuration not used by another thread during the call;
/// `socket` must be NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn pageone_config_set_daemon(
    cfg: *mut pageone_config,
    socket: *const c_char,
) -> pageone_status {
    // SAFETY: NULL or a live configuration used by no other thread, by the contract; `socket`
    // is NULL or NUL-terminated by the contract, and copied before returning.
    unsafe { config_setter!(cfg.daemon = try daemon_socket(socket)) }
}

/// A `pageone_watch_mode` from C as the engine's [`WatchMode`].
fn watch_mode(mode: u32) -> Result<WatchMode, pageone_status> {
    match mode {
        m if m == pageone_watch_mode::PAGEONE_WATCH_AUTO as u32 => Ok(WatchMode::Auto),
        m if m == pageone_watch_mode::PAGEONE_WATCH_UFFD_WP as u32 => Ok(WatchMode::UffdWp),
        m if m == pageone_watch_mode::PAGEONE_WATCH_CHECKSUM as u32 => Ok(WatchMode::Checksum),
        _ => Err(PAGEONE_INVALID_ARGUMENT),
    }
}

/// A C string argument as UTF-8.
///
/// # Safety
///
/// `s` must be NULL or point to a NUL-terminated string that stays valid and unchanged for `'a`.
unsafe fn utf8_arg<'a>(s: *const c_char) -> Result<&'a str, pageone_status> {
    if s.is_null() {
        return Err(PAGEONE_NULL_ARGUMENT);
    }
    // SAFETY: not NULL (checked above); NUL-terminated and valid for 'a by the contract.
    let c = unsafe { CStr::from_ptr(s) };
    c.to_str().map_err(|_| PAGEONE_INVALID_ARGUMENT)
}

/// The daemon socket path of `pageone_config_set_daemon` (NULL: none; empty: invalid), copied.
///
/// # Safety
///
/// `socket` must be NULL or point to a NUL-terminated string.
unsafe fn daemon_socket(socket: *const c_char) -> Result<Option<PathBuf>, pageone_status> {
    if socket.is_null() {
        return Ok(None);
    }
    // SAFETY: not NULL, NUL-terminated by the contract; copied before returning.
    let bytes = unsafe { CStr::from_ptr(socket) }.to_bytes();
    if bytes.is_empty() {
        return Err(PAGEONE_INVALID_ARGUMENT);
    }
    Ok(Some(PathBuf::from(OsStr::from_bytes(bytes))))
}
