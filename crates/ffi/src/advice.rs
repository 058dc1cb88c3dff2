//! `pageone_advise`: advice the kernel keeps in a mapping's flags, carried onto pageone's own
//! mappings.

use std::ffi::{c_int, c_void};

use crate::status::pageone_status::{self, *};

/// The advice [`pageone_advise`] takes.
const CARRIED: [c_int; 6] = [
    libc::MADV_DONTDUMP,
    libc::MADV_DODUMP,
    libc::MADV_DONTFORK,
    libc::MADV_DOFORK,
    libc::MADV_HUGEPAGE,
    libc::MADV_NOHUGEPAGE,
];

/// `madvise(addr, len, advice)` for advice the kernel keeps in the flags of a mapping:
/// `MADV_DONTDUMP`, `MADV_DODUMP`, `MADV_DONTFORK`, `MADV_DOFORK`, `MADV_HUGEPAGE` or
/// `MADV_NOHUGEPAGE`. Answered as the kernel answers it (`PAGEONE_REFUSED`, with the kernel's
/// `errno`, where it refuses). Once taken, what any engine of the process maps there later
/// (merged pages, released pages, memory given back) is advised alike (huge pages: anonymous
/// memory only); a plain `madvise` would advise only what is mapped now. Made while no engine
/// holds pages there still. `PAGEONE_INVALID_ARGUMENT` for any other advice.
///
/// # Safety
///
/// The range must belong to the caller.
#[no_mangle]
pub unsafe extern "C" fn pageone_advise(
    addr: *mut c_void,
    len: usize,
    advice: c_int,
) -> pageone_status {
    ffi_panic_boundary! {
        ensure_not_null!(addr);
        if !CARRIED.contains(&advice) {
            return PAGEONE_INVALID_ARGUMENT;
        }
        let r = {
            let _change = ::pageone_engine::changing_mappings();
            // SAFETY: advice that changes no contents, on the caller's range (the contract).
            unsafe { libc::madvise(addr, len, advice) }
        };
        if r != 0 {
            // (`errno` is the kernel's.)
            return PAGEONE_REFUSED;
        }
        let start = addr as usize;
        // Taken, the range is page-aligned, and the kernel rounds `len` up to pages.
        let end = start.saturating_add(len.div_ceil(4096) * 4096);
        ::pageone_engine::advised(start..end, advice);
        PAGEONE_OK
    }
}
