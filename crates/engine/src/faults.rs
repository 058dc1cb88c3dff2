//! The fault thread: answers missing faults in registered memory that are not frozen pages (first
//! touches, released zero pages) with the shared zero page.

use std::sync::atomic::Ordering;
use std::time::Duration;

use pageone_sync::lock;
use pageone_sys::{self as sys, uapi::*};

use crate::access::{PAGE, WORDS};
use crate::state::Shared;

/// Answers missing faults that are not frozen pages with the zero page.
pub(crate) fn fault_loop(sh: &Shared) {
    sh.count_cpu_of_this_thread();
    let fds = [
        sh.uffd.as_raw_fd(),
        std::os::fd::AsRawFd::as_raw_fd(&sh.stop_fd),
    ];
    loop {
        if sh.stop.load(Ordering::SeqCst) && lock(&sh.state).regions.is_empty() {
            return;
        }
        if sys::poll_readable(&fds, 100).is_err() {
            std::thread::sleep(Duration::from_millis(1));
        }
        while let Ok(Some(msg)) = sh.uffd.read_event() {
            if msg.event != UFFD_EVENT_PAGEFAULT {
                continue;
            }
            let addr = msg.pf_address as usize & !(PAGE - 1);
            let gate = sh.frozen.gate();
            if gate.is_frozen(addr) {
                continue; // The committer wakes it after replacing the page.
            }
            // A first touch or a released zero page: map the shared zero page. A write-protect
            // marker (async watching of an unpopulated page) makes that fail with EEXIST: clear
            // it and retry, or as a last resort install a zeroed page. Other errors (EEXIST
            // because the page came back, ENOENT because the address is now a merged mapping)
            // only need the wake.
            static ZEROS: [u64; WORDS] = [0; WORDS];
            let r = match sh.uffd.zeropage(addr, PAGE) {
                Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {
                    let _ = sh.uffd.writeprotect(addr, PAGE, false);
                    sh.uffd.zeropage(addr, PAGE).or_else(|_| {
                        // SAFETY: ZEROS is a static page of zeros.
                        unsafe { sh.uffd.copy(addr, ZEROS.as_ptr().cast(), PAGE) }
                    })
                }
                r => r,
            };
            if r.is_err() {
                let _ = sh.uffd.wake(addr, PAGE);
            }
        }
    }
}
