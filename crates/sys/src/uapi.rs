//! Linux uapi constants and structures newer than the build host's headers (Debian 12 ships 6.1),
//! transcribed from `include/uapi/linux/userfaultfd.h` and `include/uapi/linux/fs.h`. Whether the
//! running kernel has them is detected at run time.

/// `_IOC(dir, type, nr, size)` as on x86-64 and arm64.
const fn ioc(dir: u64, ty: u64, nr: u64, size: usize) -> u64 {
    (dir << 30) | ((size as u64) << 16) | (ty << 8) | nr
}
const IOC_READ: u64 = 2;
const IOC_RW: u64 = 3;

/// `madvise` advice: `MADV_DONTNEED` that drops locked pages too (Linux 5.18; absent from the
/// `libc` crate).
pub const MADV_DONTNEED_LOCKED: libc::c_int = 24;

pub const UFFD_API: u64 = 0xAA;
pub const UFFD_USER_MODE_ONLY: libc::c_int = 1;

/// Minor faults on shmem (Linux 5.14): a page in the file's cache but not in the page tables.
pub const UFFD_FEATURE_MINOR_SHMEM: u64 = 1 << 10;
pub const UFFD_FEATURE_WP_HUGETLBFS_SHMEM: u64 = 1 << 12;
pub const UFFD_FEATURE_WP_UNPOPULATED: u64 = 1 << 13;
pub const UFFD_FEATURE_WP_ASYNC: u64 = 1 << 15;
pub const UFFD_FEATURE_MOVE: u64 = 1 << 16;

pub const UFFDIO_REGISTER_MODE_MISSING: u64 = 1 << 0;
pub const UFFDIO_REGISTER_MODE_WP: u64 = 1 << 1;
pub const UFFDIO_REGISTER_MODE_MINOR: u64 = 1 << 2;

pub const UFFDIO_MOVE_MODE_DONTWAKE: u64 = 1 << 0;
pub const UFFDIO_ZEROPAGE_MODE_DONTWAKE: u64 = 1 << 0;
pub const UFFDIO_MOVE_MODE_ALLOW_SRC_HOLES: u64 = 1 << 1;

pub const UFFD_FEATURE_EVENT_REMAP: u64 = 1 << 2;
pub const UFFD_FEATURE_EVENT_REMOVE: u64 = 1 << 3;
pub const UFFD_FEATURE_EVENT_UNMAP: u64 = 1 << 6;

pub const UFFD_EVENT_PAGEFAULT: u8 = 0x12;
pub const UFFD_EVENT_FORK: u8 = 0x13;
pub const UFFD_EVENT_REMAP: u8 = 0x14;
pub const UFFD_EVENT_REMOVE: u8 = 0x15;
pub const UFFD_EVENT_UNMAP: u8 = 0x16;

/// `include/uapi/asm-generic/socket.h` (Linux 6.5): a pidfd of a Unix socket's peer.
pub const SO_PEERPIDFD: libc::c_int = 77;

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct UffdioApi {
    pub api: u64,
    pub features: u64,
    pub ioctls: u64,
}
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct UffdioRange {
    pub start: u64,
    pub len: u64,
}
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct UffdioRegister {
    pub range: UffdioRange,
    pub mode: u64,
    pub ioctls: u64,
}
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct UffdioZeropage {
    pub range: UffdioRange,
    pub mode: u64,
    pub zeropage: i64,
}
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct UffdioCopy {
    pub dst: u64,
    pub src: u64,
    pub len: u64,
    pub mode: u64,
    pub copy: i64,
}
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct UffdioMove {
    pub dst: u64,
    pub src: u64,
    pub len: u64,
    pub mode: u64,
    pub moved: i64,
}
/// `struct uffd_msg` with the page-fault arm of its union spelled out.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct UffdMsg {
    pub event: u8,
    pub reserved1: u8,
    pub reserved2: u16,
    pub reserved3: u32,
    pub pf_flags: u64,
    pub pf_address: u64,
    pub pf_ptid: u32,
    pub pad: u32,
}

/// What a [`UffdMsg`] reports, its union read by its event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UffdEvent {
    /// A thread faulted at `address` (`write`: a write fault; `wp`: on write-protection;
    /// `minor`: the page is in the file's cache, only its page table entry is missing).
    PageFault {
        address: u64,
        write: bool,
        wp: bool,
        minor: bool,
    },
    /// `[from, from+len)` moved to `[to, to+len)` (`mremap`); the mapping there keeps the
    /// registration.
    Remap { from: u64, to: u64, len: u64 },
    /// The pages of `[start, end)` are about to be dropped (`MADV_DONTNEED`/`MADV_REMOVE`): the
    /// caller waits until the message is read, then the kernel zaps them.
    Remove { start: u64, end: u64 },
    /// `[start, end)` was unmapped (`munmap`, `mmap(MAP_FIXED)` over it, `mremap` shrinking it).
    Unmap { start: u64, end: u64 },
    /// Another event (`FORK` is never asked for).
    Other(u8),
}

impl UffdMsg {
    /// The event this message reports.
    pub fn event(&self) -> UffdEvent {
        // The union of `struct uffd_msg` starts at byte 8: the page-fault arm's flags, address
        // and thread id are the remap arm's from, to and len, and the remove arm's start and end.
        match self.event {
            UFFD_EVENT_PAGEFAULT => UffdEvent::PageFault {
                address: self.pf_address,
                write: self.pf_flags & UFFD_PAGEFAULT_FLAG_WRITE != 0,
                wp: self.pf_flags & UFFD_PAGEFAULT_FLAG_WP != 0,
                minor: self.pf_flags & UFFD_PAGEFAULT_FLAG_MINOR != 0,
            },
            UFFD_EVENT_REMAP => UffdEvent::Remap {
                from: self.pf_flags,
                to: self.pf_address,
                len: u64::from(self.pf_ptid) | u64::from(self.pad) << 32,
            },
            UFFD_EVENT_REMOVE => UffdEvent::Remove {
                start: self.pf_flags,
                end: self.pf_address,
            },
            UFFD_EVENT_UNMAP => UffdEvent::Unmap {
                start: self.pf_flags,
                end: self.pf_address,
            },
            e => UffdEvent::Other(e),
        }
    }
}

pub const UFFD_PAGEFAULT_FLAG_WRITE: u64 = 1 << 0;
pub const UFFD_PAGEFAULT_FLAG_WP: u64 = 1 << 1;
pub const UFFD_PAGEFAULT_FLAG_MINOR: u64 = 1 << 2;

pub const UFFDIO_API: u64 = ioc(IOC_RW, 0xAA, 0x3F, std::mem::size_of::<UffdioApi>());
pub const UFFDIO_REGISTER: u64 = ioc(IOC_RW, 0xAA, 0x00, std::mem::size_of::<UffdioRegister>());
pub const UFFDIO_UNREGISTER: u64 = ioc(IOC_READ, 0xAA, 0x01, std::mem::size_of::<UffdioRange>());
pub const UFFDIO_WAKE: u64 = ioc(IOC_READ, 0xAA, 0x02, std::mem::size_of::<UffdioRange>());
pub const UFFDIO_COPY: u64 = ioc(IOC_RW, 0xAA, 0x03, std::mem::size_of::<UffdioCopy>());
pub const UFFDIO_ZEROPAGE: u64 = ioc(IOC_RW, 0xAA, 0x04, std::mem::size_of::<UffdioZeropage>());
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct UffdioWriteprotect {
    pub range: UffdioRange,
    pub mode: u64,
}
pub const UFFDIO_WRITEPROTECT_MODE_WP: u64 = 1 << 0;
pub const UFFDIO_WRITEPROTECT: u64 = ioc(
    IOC_RW,
    0xAA,
    0x06,
    std::mem::size_of::<UffdioWriteprotect>(),
);
pub const UFFDIO_MOVE: u64 = ioc(IOC_RW, 0xAA, 0x05, std::mem::size_of::<UffdioMove>());
/// `struct uffdio_continue` (Linux 5.13).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct UffdioContinue {
    pub range: UffdioRange,
    pub mode: u64,
    pub mapped: i64,
}
pub const UFFDIO_CONTINUE_MODE_DONTWAKE: u64 = 1 << 0;
pub const UFFDIO_CONTINUE_MODE_WP: u64 = 1 << 1;
pub const UFFDIO_COPY_MODE_WP: u64 = 1 << 1;
pub const UFFDIO_CONTINUE: u64 = ioc(IOC_RW, 0xAA, 0x07, std::mem::size_of::<UffdioContinue>());

/// `struct pm_scan_arg` (6.7+).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct PmScanArg {
    pub size: u64,
    pub flags: u64,
    pub start: u64,
    pub end: u64,
    pub walk_end: u64,
    pub vec: u64,
    pub vec_len: u64,
    pub max_pages: u64,
    pub category_inverted: u64,
    pub category_mask: u64,
    pub category_anyof_mask: u64,
    pub return_mask: u64,
}
/// `struct page_region`: pages `[start, end)` share `categories`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PageRegion {
    pub start: u64,
    pub end: u64,
    pub categories: u64,
}

pub const PAGEMAP_SCAN: u64 = ioc(IOC_RW, b'f' as u64, 16, std::mem::size_of::<PmScanArg>());
pub const PM_SCAN_WP_MATCHING: u64 = 1 << 0;
pub const PM_SCAN_CHECK_WPASYNC: u64 = 1 << 1;

pub const PAGE_IS_WPALLOWED: u64 = 1 << 0;
pub const PAGE_IS_WRITTEN: u64 = 1 << 1;
pub const PAGE_IS_FILE: u64 = 1 << 2;
pub const PAGE_IS_PRESENT: u64 = 1 << 3;
pub const PAGE_IS_SWAPPED: u64 = 1 << 4;
pub const PAGE_IS_PFNZERO: u64 = 1 << 5;
pub const PAGE_IS_HUGE: u64 = 1 << 6;

/// `struct procmap_query` (6.11+): one mapping of the process, asked of `/proc/PID/maps`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct ProcmapQuery {
    pub size: u64,
    pub query_flags: u64,
    pub query_addr: u64,
    pub vma_start: u64,
    pub vma_end: u64,
    pub vma_flags: u64,
    pub vma_page_size: u64,
    pub vma_offset: u64,
    pub inode: u64,
    pub dev_major: u32,
    pub dev_minor: u32,
    pub vma_name_size: u32,
    pub build_id_size: u32,
    pub vma_name_addr: u64,
    pub build_id_addr: u64,
}

pub const PROCMAP_QUERY: u64 = ioc(IOC_RW, b'f' as u64, 17, std::mem::size_of::<ProcmapQuery>());
pub const PROCMAP_QUERY_VMA_READABLE: u64 = 1 << 0;
pub const PROCMAP_QUERY_VMA_WRITABLE: u64 = 1 << 1;
pub const PROCMAP_QUERY_VMA_EXECUTABLE: u64 = 1 << 2;
pub const PROCMAP_QUERY_VMA_SHARED: u64 = 1 << 3;
/// The mapping holding the address, or else the first one above it.
pub const PROCMAP_QUERY_COVERING_OR_NEXT_VMA: u64 = 1 << 4;

/// Classic pagemap entry bits.
pub const PM_PRESENT: u64 = 1 << 63;
pub const PM_SWAPPED: u64 = 1 << 62;
pub const PM_FILE: u64 = 1 << 61;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ioctl_numbers_match_the_kernel_headers() {
        // Values computed by the C preprocessor from linux/userfaultfd.h and linux/fs.h (6.8+).
        assert_eq!(UFFDIO_API, 0xc018_aa3f);
        assert_eq!(UFFDIO_REGISTER, 0xc020_aa00);
        assert_eq!(UFFDIO_UNREGISTER, 0x8010_aa01);
        assert_eq!(UFFDIO_WAKE, 0x8010_aa02);
        assert_eq!(UFFDIO_COPY, 0xc028_aa03);
        assert_eq!(UFFDIO_ZEROPAGE, 0xc020_aa04);
        assert_eq!(UFFDIO_MOVE, 0xc028_aa05);
        assert_eq!(UFFDIO_WRITEPROTECT, 0xc018_aa06);
        assert_eq!(PAGEMAP_SCAN, 0xc060_6610);
        assert_eq!(PROCMAP_QUERY, 0xc068_6611);
        assert_eq!(std::mem::size_of::<UffdMsg>(), 32);
    }
}
