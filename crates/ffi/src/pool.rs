//! Pages the program freed (PPR): the [`pageone_pool`] handle, marking and unmarking pages in
//! it, and handing it to an engine (`pageone_engine_recycle_from`).

use std::ffi::{c_int, c_void};
use std::sync::Arc;

use ::pageone_engine::recycler::Pool;

use crate::boundary::new_into;
use crate::engine::pageone_engine;
use crate::status::pageone_status::{self, *};

/// A pool of marks of pages the program freed (PPR: `pageone_pool_new`, `pageone_pool_free`).
/// Thread-safe: any thread may mark and unmark pages.
pub struct pageone_pool {
    pool: Arc<Pool>,
}

/// Creates a pool of `slots` marks (rounded up to a power of two; at most 2^31): at most that
/// many freed pages can wait for the engine at once. Stores it in `*out` (NULL on failure). Free
/// it with `pageone_pool_free`, after `pageone_engine_free` of every engine it was given to (or
/// keep it as long as they run).
///
/// # Safety
///
/// `out` must be NULL or valid for writing one pointer.
#[no_mangle]
pub unsafe extern "C" fn pageone_pool_new(
    slots: usize,
    out: *mut *mut pageone_pool,
) -> pageone_status {
    ffi_panic_boundary! {
        let make = || {
            Pool::new(slots)
                .map(|pool| pageone_pool {
                    pool: Arc::new(pool),
                })
                .map_err(|_| PAGEONE_INVALID_ARGUMENT)
        };
        // SAFETY: `out` is NULL or valid for writing one pointer by the contract.
        unsafe { new_into(out, make) }
    }
}

/// Frees a pool. NULL is allowed and does nothing. Engines it was given to keep their own
/// reference: marks they hold stay valid.
///
/// # Safety
///
/// `pool` must be NULL or a pool from `pageone_pool_new` not yet freed; no other call may use
/// it concurrently or afterwards.
#[no_mangle]
pub unsafe extern "C" fn pageone_pool_free(pool: *mut pageone_pool) {
    ffi_panic_boundary! {
        // SAFETY: NULL, or from Box::into_raw in pageone_pool_new and not freed yet, with no
        // concurrent user, by the contract.
        drop(unsafe { try_box_from_ptr!(pool) });
    }
}

/// Has the engine release the pages marked free in `pool` (PPR): every period, marked pages of
/// registered memory are given back to the kernel (they read as zeros afterwards) unless
/// unmarked first. Replaces a pool given before.
///
/// # Safety
///
/// `engine` and `pool` must be NULL or live.
#[no_mangle]
pub unsafe extern "C" fn pageone_engine_recycle_from(
    engine: *const pageone_engine,
    pool: *const pageone_pool,
) -> pageone_status {
    ffi_panic_boundary! {
        // SAFETY: NULL or live by the contract; both are only shared.
        let (engine, pool) = unsafe { (try_ref_from_ptr!(engine), try_ref_from_ptr!(pool)) };
        engine.engine.recycle_from(pool.pool.clone());
        PAGEONE_OK
    }
}

/// Whether `page` can be marked or unmarked at all: not NULL, and page-aligned.
fn is_page_start(page: *mut c_void) -> bool {
    !page.is_null() && (page as usize) % 4096 == 0
}

/// Marks the page at `page` free (a few atomic operations, no system call; its first 24 bytes
/// are overwritten). Returns 1 if it was marked, 0 if the pool is full or an argument is NULL
/// or unaligned (the page is then simply not recycled).
///
/// # Safety
///
/// `pool` must be NULL or live. `page` must be NULL or the page-aligned start of a page the
/// caller owns and does not use again before `pageone_pool_unmark` returns for it; its contents
/// may be gone (zeros) by then.
#[no_mangle]
pub unsafe extern "C" fn pageone_pool_mark(pool: *const pageone_pool, page: *mut c_void) -> c_int {
    ffi_panic_boundary! {
        if !is_page_start(page) {
            return 0;
        }
        // SAFETY: NULL or live by the contract.
        let pool = unsafe { try_ref_from_ptr!(pool) };
        // SAFETY: the caller's freed page, by the contract.
        let marked = unsafe { pool.pool.mark(page.cast()) };
        marked as c_int
    }
}

/// Takes the mark of `page` back before the caller reuses it. Afterwards the page holds what it
/// held (without the mark's 24 bytes) or zeros (it was recycled); every write to it is kept.
///
/// # Safety
///
/// `pool` must be NULL or live; `page` must be NULL or a page marked with this pool and not
/// unmarked since, still mapped.
#[no_mangle]
pub unsafe extern "C" fn pageone_pool_unmark(pool: *const pageone_pool, page: *mut c_void) {
    ffi_panic_boundary! {
        if !is_page_start(page) {
            return;
        }
        // SAFETY: NULL or live by the contract.
        let pool = unsafe { try_ref_from_ptr!(pool) };
        // SAFETY: a page this pool marked, by the contract.
        unsafe { pool.pool.unmark(page.cast()) };
    }
}
