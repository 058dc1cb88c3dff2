//! What every export goes through, after rustls-ffi: the panic boundary
//! (`ffi_panic_boundary!`) and the NULL checks of pointer arguments (`try_ref_from_ptr!`,
//! `try_mut_from_ptr!`, `try_box_from_ptr!`, `ensure_not_null!`), each answering with the
//! export's own "panicked" or "NULL argument" value, and the body of the `*_new` exports
//! ([`new_into`]).

use std::ffi::c_int;

use crate::status::pageone_status::{self, *};

/// What an export returns when its body panicked.
pub(crate) trait PanicOrDefault {
    fn value() -> Self;
}

impl PanicOrDefault for pageone_status {
    fn value() -> Self {
        PAGEONE_PANIC
    }
}

/// A function that returns nothing swallows the panic.
impl PanicOrDefault for () {
    fn value() -> Self {}
}

/// `pageone_pool_mark`: "not marked".
impl PanicOrDefault for c_int {
    fn value() -> Self {
        0
    }
}

/// NULL. An export that promises more (`pageone_status_message`: never NULL) gives its own value
/// with `on_panic:`.
impl<T> PanicOrDefault for *const T {
    fn value() -> Self {
        std::ptr::null()
    }
}

/// What an export returns when a pointer argument it needs is NULL.
pub(crate) trait NullParameterOrDefault {
    fn value() -> Self;
}

impl NullParameterOrDefault for pageone_status {
    fn value() -> Self {
        PAGEONE_NULL_ARGUMENT
    }
}

/// `*_free` and `pageone_pool_unmark`: NULL is allowed and does nothing.
impl NullParameterOrDefault for () {
    fn value() -> Self {}
}

/// `pageone_pool_mark`: "not marked".
impl NullParameterOrDefault for c_int {
    fn value() -> Self {
        0
    }
}

/// Runs the body of an export, turning a panic into the export's [`PanicOrDefault`] value
/// (`PAGEONE_PANIC` for a status), or into the expression after `on_panic:` when one is given:
/// no unwinding crosses into C. The body is a closure's: its `return` (and the early return of
/// the `try_*` macros) returns from the export.
macro_rules! ffi_panic_boundary {
    (on_panic: $on_panic:expr; $($body:tt)*) => {
        match ::std::panic::catch_unwind(::std::panic::AssertUnwindSafe(|| { $($body)* })) {
            Ok(ret) => ret,
            Err(_) => $on_panic,
        }
    };
    ($($body:tt)*) => {
        ffi_panic_boundary!(on_panic: $crate::boundary::PanicOrDefault::value(); $($body)*)
    };
}

/// `&T` from a pointer argument, or an early return of the export's [`NullParameterOrDefault`]
/// value (`PAGEONE_NULL_ARGUMENT` for a status) when it is NULL.
///
/// Expands to `<*const T>::as_ref`, so it must stand in an `unsafe` block whose `SAFETY:`
/// comment says why the pointer, when not NULL, is live and unchanged for the call.
macro_rules! try_ref_from_ptr {
    ($ptr:expr) => {
        match $ptr.as_ref() {
            Some(r) => r,
            None => return $crate::boundary::NullParameterOrDefault::value(),
        }
    };
}

/// `&mut T` from a pointer argument, or an early return as `try_ref_from_ptr!` when it is NULL.
///
/// Expands to `<*mut T>::as_mut`, so it must stand in an `unsafe` block whose `SAFETY:` comment
/// says why the pointer, when not NULL, is live and used by no one else for the call.
macro_rules! try_mut_from_ptr {
    ($ptr:expr) => {
        match $ptr.as_mut() {
            Some(r) => r,
            None => return $crate::boundary::NullParameterOrDefault::value(),
        }
    };
}

/// The `Box<T>` a `*_new` export handed out as a pointer, taken back to be dropped, or an early
/// return as `try_ref_from_ptr!` when the pointer is NULL.
///
/// Expands to `Box::from_raw`, so it must stand in an `unsafe` block whose `SAFETY:` comment
/// says why the pointer, when not NULL, came from `Box::into_raw` and is not used again.
macro_rules! try_box_from_ptr {
    ($ptr:expr) => {{
        let ptr = $ptr;
        if ptr.is_null() {
            return $crate::boundary::NullParameterOrDefault::value();
        }
        ::std::boxed::Box::from_raw(ptr)
    }};
}

/// An early return of the export's [`NullParameterOrDefault`] value when any of the pointers
/// is NULL (for pointers that are only written or passed on, never turned into references).
macro_rules! ensure_not_null {
    ($($ptr:expr),+ $(,)?) => {
        if $($ptr.is_null())||+ {
            return $crate::boundary::NullParameterOrDefault::value();
        }
    };
}

/// The body of a `*_new` export: `*out` is NULL until `make` succeeds, then holds the new heap
/// object (freed by the matching `*_free`); a NULL `out` is refused.
///
/// # Safety
///
/// `out` must be NULL or valid for writing one pointer.
pub(crate) unsafe fn new_into<T>(
    out: *mut *mut T,
    make: impl FnOnce() -> Result<T, pageone_status>,
) -> pageone_status {
    ensure_not_null!(out);
    // SAFETY: not NULL (checked) and valid for a write by the contract.
    unsafe { out.write(std::ptr::null_mut()) };
    match make() {
        Ok(v) => {
            // SAFETY: as above.
            unsafe { out.write(Box::into_raw(Box::new(v))) };
            PAGEONE_OK
        }
        Err(status) => status,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status_that_panics() -> pageone_status {
        ffi_panic_boundary! { panic!("boom") }
    }

    fn int_that_panics() -> c_int {
        ffi_panic_boundary! { panic!("boom") }
    }

    fn string_that_panics() -> *const std::ffi::c_char {
        ffi_panic_boundary! {
            on_panic: c"fallback".as_ptr();
            panic!("boom")
        }
    }

    /// The status of `*p` when it is not NULL.
    ///
    /// # Safety
    ///
    /// `p` must be NULL or live.
    unsafe fn read_status(p: *const pageone_status) -> pageone_status {
        ffi_panic_boundary! {
            // SAFETY: NULL or live by the contract.
            let s = unsafe { try_ref_from_ptr!(p) };
            *s
        }
    }

    /// Counts the calls that get past the NULL checks.
    fn count_if_not_null(p: *const u8, q: *const u8, passed: &mut u32) {
        ffi_panic_boundary! {
            ensure_not_null!(p, q);
            *passed += 1;
        }
    }

    #[test]
    fn a_panic_becomes_the_exports_panic_value() {
        assert_eq!(status_that_panics(), PAGEONE_PANIC);
        assert_eq!(int_that_panics(), 0);
        // SAFETY: a static NUL-terminated string.
        let s = unsafe { std::ffi::CStr::from_ptr(string_that_panics()) };
        assert_eq!(s, c"fallback");
    }

    #[test]
    fn a_null_pointer_returns_early_with_the_exports_null_value() {
        // SAFETY: NULL, then a live local.
        unsafe {
            assert_eq!(read_status(std::ptr::null()), PAGEONE_NULL_ARGUMENT);
            assert_eq!(read_status(&PAGEONE_TIMEOUT), PAGEONE_TIMEOUT);
        }
        let mut passed = 0;
        let b = 0u8;
        count_if_not_null(&b, std::ptr::null(), &mut passed);
        count_if_not_null(std::ptr::null(), &b, &mut passed);
        assert_eq!(passed, 0);
        count_if_not_null(&b, &b, &mut passed);
        assert_eq!(passed, 1);
    }

    #[test]
    fn new_into_clears_out_on_failure_and_refuses_null() {
        let mut out: *mut u32 = std::ptr::NonNull::dangling().as_ptr();
        // SAFETY: `out` is a live local; NULL is allowed.
        unsafe {
            assert_eq!(new_into(&mut out, || Err(PAGEONE_CONFIG)), PAGEONE_CONFIG);
            assert!(out.is_null());
            assert_eq!(
                new_into::<u32>(std::ptr::null_mut(), || Ok(1)),
                PAGEONE_NULL_ARGUMENT
            );
            assert_eq!(new_into(&mut out, || Ok(7)), PAGEONE_OK);
            assert_eq!(*Box::from_raw(out), 7);
        }
    }
}
