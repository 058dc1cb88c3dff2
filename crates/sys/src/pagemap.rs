//! `/proc/self/pagemap`: the [`Pagemap`] file, its `PAGEMAP_SCAN` ioctl ([`ScanQuery`]) and
//! classic entry reads, and whether this kernel has the ioctl ([`pagemap_scan_supported`]).

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;

use crate::uapi::*;
use crate::{cvt, PAGE_SIZE};

/// The least room (in ranges) a `PAGEMAP_SCAN` call gets for its output.
const MIN_SCAN_ROOM: usize = 1024;

/// What a `PAGEMAP_SCAN` matches and reports (fields of `struct pm_scan_arg`): a page matches
/// when `(categories ^ category_inverted) & category_mask == category_mask` and, if
/// `category_anyof_mask` is set, `categories & category_anyof_mask != 0`.
#[derive(Clone, Copy, Debug, Default)]
pub struct ScanQuery {
    pub flags: u64,
    pub category_mask: u64,
    pub category_inverted: u64,
    pub category_anyof_mask: u64,
    pub return_mask: u64,
}

/// The process's `/proc/self/pagemap`, for the `PAGEMAP_SCAN` ioctl and classic entry reads.
#[derive(Debug)]
pub struct Pagemap {
    file: File,
}

impl Pagemap {
    /// Opens `/proc/self/pagemap`.
    pub fn open() -> io::Result<Self> {
        Ok(Self {
            file: File::open("/proc/self/pagemap")?,
        })
    }

    /// Runs `PAGEMAP_SCAN` over `[start, end)`, appending matching page ranges to `out` (the
    /// kernel merges adjacent pages with equal categories). With `PM_SCAN_WP_MATCHING`, pages
    /// reported are also write-protected again (async uffd-wp): "written since last scan" becomes
    /// "written since now". VMAs without async uffd-wp are skipped silently in that mode.
    pub fn scan(
        &self,
        start: usize,
        end: usize,
        q: &ScanQuery,
        out: &mut Vec<PageRegion>,
    ) -> io::Result<()> {
        self.walk(start, end, q, Some(out))
    }

    /// The `PAGEMAP_SCAN` loop of [`Pagemap::scan`] and [`Pagemap::write_protect`]: resumes at
    /// `walk_end` until `end`. The kernel writes the ranges found straight into the spare room of
    /// `out`, which grows (doubling) when a call fills it: a vector kept from walk to walk takes
    /// one call per walk, where a fixed buffer took one per 1024 ranges (a region with tens of
    /// thousands of merged runs returns as many). Without `out` the kernel gets no output vector
    /// (then, with `PM_SCAN_WP_MATCHING`, it takes its exclusive write-protect path).
    ///
    /// A call whose walk filled the kernel's own buffer (512 ranges) and then went on to `end`
    /// reports (Linux up to at least 6.18) a `walk_end` where that buffer last filled, not `end`:
    /// the next call walks from there again, and the ranges after it (512 at most) come twice,
    /// each as then found. The loop follows `walk_end` all the same: it is what the call reports.
    fn walk(
        &self,
        start: usize,
        end: usize,
        q: &ScanQuery,
        mut out: Option<&mut Vec<PageRegion>>,
    ) -> io::Result<()> {
        let mut cur = start as u64;
        while cur < end as u64 {
            let (vec, vec_len) = match out.as_deref_mut() {
                Some(out) => {
                    if out.capacity() - out.len() < MIN_SCAN_ROOM {
                        out.reserve(out.len().max(MIN_SCAN_ROOM));
                    }
                    let spare = out.spare_capacity_mut();
                    (spare.as_mut_ptr() as u64, spare.len() as u64)
                }
                None => (0, 0),
            };
            let mut arg = PmScanArg {
                size: std::mem::size_of::<PmScanArg>() as u64,
                flags: q.flags,
                start: cur,
                end: end as u64,
                walk_end: 0,
                vec,
                vec_len,
                max_pages: 0,
                category_inverted: q.category_inverted,
                category_mask: q.category_mask,
                category_anyof_mask: q.category_anyof_mask,
                return_mask: q.return_mask,
            };
            // SAFETY: arg is a live pm_scan_arg whose vec points to the vec_len regions of room
            // `out` has past its length (not read, only written by the kernel), or has no vector
            // at all (vec and vec_len 0).
            let n = cvt(
                unsafe { crate::raw_ioctl(self.file.as_raw_fd(), PAGEMAP_SCAN, &mut arg) }
                    as libc::c_long,
            )? as usize;
            if let Some(out) = out.as_deref_mut() {
                assert!(
                    n as u64 <= vec_len,
                    "PAGEMAP_SCAN reported more than its room"
                );
                // SAFETY: the kernel wrote `n` whole regions (plain integers) at the start of the
                // spare room, within its capacity.
                unsafe { out.set_len(out.len() + n) };
            }
            if arg.walk_end <= cur {
                break;
            }
            cur = arg.walk_end;
        }
        Ok(())
    }

    /// Whether each of the `n` pages from `start` has all the categories of `mask` (e.g.
    /// `PAGE_IS_PRESENT`).
    pub fn pages_with(&self, start: usize, n: usize, mask: u64) -> io::Result<Vec<bool>> {
        let q = ScanQuery {
            category_mask: mask,
            return_mask: mask,
            ..Default::default()
        };
        self.pages_matching(start, n, &q)
    }

    /// Whether each of the `n` pages from `start` has any of the categories of `mask`.
    pub fn pages_with_any(&self, start: usize, n: usize, mask: u64) -> io::Result<Vec<bool>> {
        let q = ScanQuery {
            category_anyof_mask: mask,
            return_mask: mask,
            ..Default::default()
        };
        self.pages_matching(start, n, &q)
    }

    fn pages_matching(&self, start: usize, n: usize, q: &ScanQuery) -> io::Result<Vec<bool>> {
        let mut found = Vec::new();
        self.scan(start, start + n * PAGE_SIZE, q, &mut found)?;
        let mut out = vec![false; n];
        for r in &found {
            let lo = (r.start as usize - start) / PAGE_SIZE;
            let hi = ((r.end as usize - start) / PAGE_SIZE).min(n);
            out[lo..hi].fill(true);
        }
        Ok(out)
    }

    /// How many of the `n` pages from `start` have all the categories of `mask`.
    pub fn count_pages(&self, start: usize, n: usize, mask: u64) -> io::Result<usize> {
        Ok(self
            .pages_with(start, n, mask)?
            .iter()
            .filter(|&&b| b)
            .count())
    }

    /// Write-protects (async uffd-wp) every page of `[start, end)` not protected yet, reporting
    /// nothing: `PAGEMAP_SCAN` with `PM_SCAN_WP_MATCHING` and no output vector. VMAs without async
    /// uffd-wp are skipped, and so are unpopulated entries.
    ///
    /// The zero page (small or huge) is left unprotected: it cannot be written in place (a write
    /// maps a new page, which shows as written), and a write to a protected huge zero page would
    /// make the kernel split it into small pages, where an unprotected one gets a whole huge
    /// page in one fault.
    pub fn write_protect(&self, start: usize, end: usize) -> io::Result<()> {
        let q = ScanQuery {
            flags: PM_SCAN_WP_MATCHING,
            category_mask: PAGE_IS_WRITTEN | PAGE_IS_PFNZERO,
            category_inverted: PAGE_IS_PFNZERO,
            // Pages only: the kernel counts an unpopulated entry as written, and protecting it
            // would install a marker (a page table where there was none, and no huge page for
            // the first touch there).
            category_anyof_mask: PAGE_IS_PRESENT | PAGE_IS_SWAPPED,
            return_mask: PAGE_IS_WRITTEN,
        };
        self.walk(start, end, &q, None)
    }

    /// Reads classic pagemap entries for the pages of `[start, start + n*4096)`.
    pub fn entries(&self, start: usize, n: usize, out: &mut Vec<u64>) -> io::Result<()> {
        use std::os::unix::fs::FileExt;
        let mut bytes = vec![0u8; n * 8];
        self.file
            .read_exact_at(&mut bytes, (start / PAGE_SIZE * 8) as u64)?;
        out.extend(
            bytes
                .chunks_exact(8)
                .map(|c| u64::from_ne_bytes(c.try_into().unwrap())),
        );
        Ok(())
    }
}

/// Whether this kernel has the `PAGEMAP_SCAN` ioctl (6.7+).
pub fn pagemap_scan_supported() -> bool {
    let Ok(pm) = Pagemap::open() else {
        return false;
    };
    let mut v = Vec::new();
    // An empty-but-valid query: ENOTTY/EINVAL on kernels without the ioctl.
    let probe = [0u8; PAGE_SIZE];
    let a = probe.as_ptr() as usize & !(PAGE_SIZE - 1);
    let q = ScanQuery {
        category_anyof_mask: PAGE_IS_PRESENT,
        return_mask: PAGE_IS_PRESENT,
        ..ScanQuery::default()
    };
    pm.scan(a, a + PAGE_SIZE, &q, &mut v).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A scan that finds more ranges than a call's room returns every one of them, after what the
    /// vector held already: every other page of 4096 present is 2048 ranges of one page.
    #[test]
    fn a_scan_returns_every_range_however_many() {
        if !pagemap_scan_supported() {
            eprintln!("skipped: this kernel lacks PAGEMAP_SCAN");
            return;
        }
        const N: usize = 4096;
        let base = crate::mmap_anonymous(N * PAGE_SIZE).unwrap() as usize;
        for k in (0..N).step_by(2) {
            // SAFETY: a page of the fresh mapping above, which only this test uses.
            unsafe { std::ptr::write_volatile((base + k * PAGE_SIZE) as *mut u8, 1) };
        }
        let pm = Pagemap::open().unwrap();
        let q = ScanQuery {
            category_mask: PAGE_IS_PRESENT,
            return_mask: PAGE_IS_PRESENT,
            ..ScanQuery::default()
        };
        let kept = PageRegion {
            start: 1,
            end: 2,
            categories: 3,
        };
        let mut out = vec![kept];
        pm.scan(base, base + N * PAGE_SIZE, &q, &mut out).unwrap();
        assert_eq!(out[0], kept, "what the vector held stays");
        let mut present = vec![false; N];
        for r in &out[1..] {
            assert_eq!(r.categories, PAGE_IS_PRESENT);
            let (lo, hi) = (r.start as usize - base, r.end as usize - base);
            present[lo / PAGE_SIZE..hi / PAGE_SIZE].fill(true);
        }
        let want: Vec<bool> = (0..N).map(|k| k % 2 == 0).collect();
        assert!(present == want, "the ranges are not the present pages");
        assert!(out.len() > N / 2, "{} ranges", out.len() - 1);
        // SAFETY: the mapping above; nothing refers to it any more.
        unsafe { crate::munmap(base as *mut u8, N * PAGE_SIZE) }.unwrap();
    }
}
