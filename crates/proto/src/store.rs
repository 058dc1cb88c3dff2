//! The layout of a store file: slot `n` is the page at byte offset `n * PAGE_SIZE`. A slot holds
//! one stable copy; a freed slot is a hole (punched), which reads as zeros and uses no memory.
//! The daemon's scope stores and an engine's own store share this layout and the way they free
//! slots.

use pageone_sys as sys;

const PAGE: u64 = sys::PAGE_SIZE as u64;

/// The byte offset of `slot` in a store file.
pub fn offset(slot: u32) -> u64 {
    slot as u64 * PAGE
}

/// Punches the slots `slots` (sorted) of the store file `fd`, one call per run of consecutive
/// slots; errors are ignored (a page left unpunched costs memory, not correctness).
pub fn punch_runs(fd: i32, slots: &[u32]) {
    for (k, m) in runs(slots) {
        let _ = sys::punch_hole(fd, offset(slots[k]), m as u64 * PAGE);
    }
}

/// The runs of consecutive slots in `slots`, as (index of the first, length): one file
/// operation each.
pub fn runs(slots: &[u32]) -> impl Iterator<Item = (usize, usize)> + '_ {
    let mut k = 0;
    std::iter::from_fn(move || {
        if k >= slots.len() {
            return None;
        }
        let mut m = 1;
        while k + m < slots.len() && slots[k + m] == slots[k].wrapping_add(m as u32) {
            m += 1;
        }
        let run = (k, m);
        k += m;
        Some(run)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_split_at_gaps() {
        let slots = [1, 2, 3, 7, 9, 10];
        assert_eq!(
            runs(&slots).collect::<Vec<_>>(),
            vec![(0, 3), (3, 1), (4, 2)]
        );
        assert_eq!(runs(&[]).count(), 0);
        // The top slot does not wrap into a run with slot 0.
        assert_eq!(runs(&[u32::MAX, 0]).count(), 2);
    }

    #[test]
    fn punched_runs_read_as_zeros_and_free_their_pages() {
        let fd = sys::memfd_create(c"punch-test").unwrap();
        use std::os::fd::AsRawFd;
        let fd = fd.as_raw_fd();
        sys::ftruncate(fd, 8 * PAGE).unwrap();
        let page = vec![0xabu8; 8 * PAGE as usize];
        sys::pwrite_pages(fd, &[page.as_ptr() as usize], 0).unwrap();
        let full = sys::file_usage(fd).unwrap().1;
        assert!(full >= PAGE);
        punch_runs(fd, &[0]);
        assert_eq!(sys::file_usage(fd).unwrap().1, full - PAGE);
    }
}
