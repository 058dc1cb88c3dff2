//! What `/proc` and `/proc/sys` say about this process and the machine: the mappings of
//! `/proc/self/maps` ([`Mapping`]; those of one range through [`Maps`]), the VMA count and limit,
//! and fields of `meminfo`, `smaps_rollup` and `status`.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;

use crate::cvt;
use crate::uapi::*;

/// The kernel's VMA limit per process (`vm.max_map_count`).
pub fn max_map_count() -> io::Result<usize> {
    let s = std::fs::read_to_string("/proc/sys/vm/max_map_count")?;
    s.trim()
        .parse()
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "bad max_map_count"))
}

/// Whether the kernel refuses to overcommit memory (`vm.overcommit_memory` is 2). Allocates
/// nothing. `false` if the setting cannot be read.
pub fn overcommit_is_strict() -> bool {
    use std::io::Read;
    let mut buf = [0u8; 8];
    let n = File::open("/proc/sys/vm/overcommit_memory").and_then(|mut f| f.read(&mut buf));
    matches!(n, Ok(n) if buf[..n].trim_ascii() == b"2")
}

/// Sets `vm.max_map_count` (root only; used by tests of the VMA-limit path).
pub fn set_max_map_count(n: usize) -> io::Result<()> {
    std::fs::write("/proc/sys/vm/max_map_count", format!("{n}\n"))
}

/// The number of VMAs of the calling process (lines of `/proc/self/maps`).
pub fn map_count() -> io::Result<usize> {
    let s = std::fs::read("/proc/self/maps")?;
    Ok(s.iter().filter(|&&b| b == b'\n').count())
}

/// One line of `/proc/self/maps`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mapping {
    pub start: usize,
    pub end: usize,
    pub perms: String,
    pub offset: u64,
    pub inode: u64,
    pub path: String,
}

impl Mapping {
    /// The protection (`PROT_*`) its permissions say.
    pub fn prot(&self) -> libc::c_int {
        let b = self.perms.as_bytes();
        let on = |i: usize, c: u8, p: libc::c_int| if b.get(i) == Some(&c) { p } else { 0 };
        on(0, b'r', libc::PROT_READ) | on(1, b'w', libc::PROT_WRITE) | on(2, b'x', libc::PROT_EXEC)
    }

    /// A private, read/write, anonymous mapping (including `[heap]` and `[stack]`): what the engine
    /// may register.
    pub fn is_private_anonymous_rw(&self) -> bool {
        self.perms.starts_with("rw") && self.perms.ends_with('p') && self.inode == 0 && {
            self.path.is_empty() || self.path == "[heap]" || self.path.starts_with("[anon:")
        }
    }
}

/// Parses `/proc/self/maps`.
pub fn self_mappings() -> io::Result<Vec<Mapping>> {
    let s = std::fs::read_to_string("/proc/self/maps")?;
    let mut out = Vec::new();
    for line in s.lines() {
        let mut it = line.split_ascii_whitespace();
        let (Some(range), Some(perms), Some(off), Some(_dev), Some(inode)) =
            (it.next(), it.next(), it.next(), it.next(), it.next())
        else {
            continue;
        };
        let path = it.collect::<Vec<_>>().join(" ");
        let Some((a, b)) = range.split_once('-') else {
            continue;
        };
        let (Ok(start), Ok(end)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16))
        else {
            continue;
        };
        out.push(Mapping {
            start,
            end,
            perms: perms.to_string(),
            offset: u64::from_str_radix(off, 16).unwrap_or(0),
            inode: inode.parse().unwrap_or(0),
            path,
        });
    }
    Ok(out)
}

/// The mappings of `self_mappings` that meet `[start, end)`.
fn self_mappings_filtered(start: usize, end: usize) -> io::Result<Vec<Mapping>> {
    let mut all = self_mappings()?;
    all.retain(|m| m.end > start && m.start < end);
    Ok(all)
}

/// The process's mappings that meet `[start, end)`, in address order (see [`Maps::in_range`]),
/// with `/proc/self/maps` opened for the call: for a process that may have forked since a
/// [`Maps`] was opened.
pub fn self_mappings_in(start: usize, end: usize) -> io::Result<Vec<Mapping>> {
    Maps::open()?.in_range(start, end)
}

/// Longest mapping name asked of the kernel (`PATH_MAX`).
const NAME_MAX_BYTES: usize = 4096;

/// This process's `/proc/self/maps`, kept open to ask for the mappings of a range with the
/// `PROCMAP_QUERY` ioctl (Linux 6.11): a call per mapping, which costs what the range holds, not
/// what the process holds (reading the whole file costs tens of microseconds per call). Opened by
/// one process, it answers for that process (not for a child after `fork`).
#[derive(Debug)]
pub struct Maps {
    file: File,
}

impl Maps {
    /// Opens `/proc/self/maps`.
    pub fn open() -> io::Result<Self> {
        Ok(Self {
            file: File::open("/proc/self/maps")?,
        })
    }

    /// The mappings that meet `[start, end)`, in address order, whole (not cut to the range):
    /// asked one by one where the kernel has `PROCMAP_QUERY`, else read from the whole file.
    pub fn in_range(&self, start: usize, end: usize) -> io::Result<Vec<Mapping>> {
        let mut out = Vec::new();
        let mut name = vec![0u8; NAME_MAX_BYTES];
        let mut at = start;
        while at < end {
            match self.query(at, &mut name) {
                Ok(Some(m)) if m.start < end => {
                    at = m.end;
                    out.push(m);
                }
                Ok(_) => break,
                Err(e) if matches!(e.raw_os_error(), Some(libc::ENOTTY | libc::EINVAL)) => {
                    return self_mappings_filtered(start, end);
                }
                Err(e) => return Err(e),
            }
        }
        Ok(out)
    }

    /// The protection (`PROT_*`) of `[start, end)` if one protection covers all of it (`None`: a
    /// hole, or mappings of different protections). Allocates nothing where the kernel has
    /// `PROCMAP_QUERY` (else it reads the whole file).
    pub fn protection(&self, start: usize, end: usize) -> io::Result<Option<libc::c_int>> {
        let mut prot = None;
        let mut at = start;
        while at < end {
            let mut q = ProcmapQuery {
                size: std::mem::size_of::<ProcmapQuery>() as u64,
                query_flags: PROCMAP_QUERY_COVERING_OR_NEXT_VMA,
                query_addr: at as u64,
                ..Default::default()
            };
            // SAFETY: q is a live procmap_query asking for no name and no build id.
            let r = unsafe { crate::raw_ioctl(self.file.as_raw_fd(), PROCMAP_QUERY, &mut q) };
            match cvt(r as libc::c_long) {
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return Ok(None),
                Err(e) if matches!(e.raw_os_error(), Some(libc::ENOTTY | libc::EINVAL)) => {
                    return Ok(same_protection(
                        &self_mappings_filtered(start, end)?,
                        start,
                        end,
                    ));
                }
                Err(e) => return Err(e),
                Ok(_) => {}
            }
            let p = protection_of(q.vma_flags);
            if q.vma_start as usize > at || prot.is_some_and(|x| x != p) {
                return Ok(None);
            }
            prot = Some(p);
            at = q.vma_end as usize;
        }
        Ok(prot)
    }

    /// The mapping holding `addr` or else the first above it (`None`: there is none), its name
    /// read into `name`.
    fn query(&self, addr: usize, name: &mut [u8]) -> io::Result<Option<Mapping>> {
        let mut q = ProcmapQuery {
            size: std::mem::size_of::<ProcmapQuery>() as u64,
            query_flags: PROCMAP_QUERY_COVERING_OR_NEXT_VMA,
            query_addr: addr as u64,
            vma_name_size: name.len() as u32,
            vma_name_addr: name.as_mut_ptr() as u64,
            ..Default::default()
        };
        // SAFETY: q is a live procmap_query whose name buffer is `name`, writable for the size
        // given; no build id is asked for.
        let r = unsafe { crate::raw_ioctl(self.file.as_raw_fd(), PROCMAP_QUERY, &mut q) };
        match cvt(r as libc::c_long) {
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(None),
            Err(e) => Err(e),
            Ok(_) => Ok(Some(mapping_of(&q, name))),
        }
    }
}

/// The `PROT_*` bits of a `PROCMAP_QUERY` answer's flags.
fn protection_of(vma_flags: u64) -> libc::c_int {
    let on = |bit: u64, p: libc::c_int| if vma_flags & bit != 0 { p } else { 0 };
    on(PROCMAP_QUERY_VMA_READABLE, libc::PROT_READ)
        | on(PROCMAP_QUERY_VMA_WRITABLE, libc::PROT_WRITE)
        | on(PROCMAP_QUERY_VMA_EXECUTABLE, libc::PROT_EXEC)
}

/// [`Maps::protection`] from the mappings that meet `[start, end)`, in address order.
fn same_protection(maps: &[Mapping], start: usize, end: usize) -> Option<libc::c_int> {
    let mut prot = None;
    let mut at = start;
    for m in maps {
        if m.start > at || prot.is_some_and(|p| p != m.prot()) {
            return None;
        }
        prot = Some(m.prot());
        at = m.end;
    }
    (at >= end).then_some(prot).flatten()
}

/// The [`Mapping`] a `PROCMAP_QUERY` answer describes, as its line of `/proc/self/maps` would.
fn mapping_of(q: &ProcmapQuery, name: &[u8]) -> Mapping {
    let flag = |bit: u64, c: char| if q.vma_flags & bit != 0 { c } else { '-' };
    let perms = [
        flag(PROCMAP_QUERY_VMA_READABLE, 'r'),
        flag(PROCMAP_QUERY_VMA_WRITABLE, 'w'),
        flag(PROCMAP_QUERY_VMA_EXECUTABLE, 'x'),
        if q.vma_flags & PROCMAP_QUERY_VMA_SHARED != 0 {
            's'
        } else {
            'p'
        },
    ];
    // The size returned counts the terminating NUL; 0 when the mapping has no name.
    let len = (q.vma_name_size as usize).saturating_sub(1).min(name.len());
    Mapping {
        start: q.vma_start as usize,
        end: q.vma_end as usize,
        perms: perms.iter().collect(),
        offset: q.vma_offset,
        inode: q.inode,
        path: String::from_utf8_lossy(&name[..len]).into_owned(),
    }
}

/// Process-wide memory figures from `/proc/meminfo` and `/proc/self/smaps_rollup`, in KiB.
pub fn meminfo_kib(field: &str) -> io::Result<u64> {
    read_kib("/proc/meminfo", field)
}

/// A field (e.g. `Pss`, `Rss`, `Pss_Anon`) of `/proc/self/smaps_rollup`, in KiB.
pub fn self_smaps_rollup_kib(field: &str) -> io::Result<u64> {
    read_kib("/proc/self/smaps_rollup", field)
}

/// A field (e.g. `RssAnon`) of `/proc/self/status`, in KiB: the kernel's counters, read without
/// walking page tables as `smaps_rollup` does.
pub fn self_status_kib(field: &str) -> io::Result<u64> {
    read_kib("/proc/self/status", field)
}

/// The process's locked mappings (`lo` among the `VmFlags` of `/proc/self/smaps`), as address
/// ranges in order. Reading it walks every mapping's page tables: for tests and diagnostics.
pub fn self_locked_mappings() -> io::Result<Vec<std::ops::Range<usize>>> {
    self_mappings_flagged("lo")
}

/// The ranges of this process's mappings whose `VmFlags` in `/proc/self/smaps` hold `flag`
/// (`lo` locked, `dd` not dumped, `dc` not inherited by a child), in address order. Reading the
/// file walks the page tables of every mapping: call it rarely.
pub fn self_mappings_flagged(flag: &str) -> io::Result<Vec<std::ops::Range<usize>>> {
    Ok(self_mappings_flagged_each(&[flag])?.remove(0))
}

/// [`self_mappings_flagged`] for each of `flags`, from one read of the file.
pub fn self_mappings_flagged_each(flags: &[&str]) -> io::Result<Vec<Vec<std::ops::Range<usize>>>> {
    let smaps = std::fs::read_to_string("/proc/self/smaps")?;
    let mut out = vec![Vec::new(); flags.len()];
    let mut current = None;
    for line in smaps.lines() {
        let head = line.split_whitespace().next().unwrap_or("");
        if let Some((a, b)) = head.split_once('-') {
            if let (Ok(a), Ok(b)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16)) {
                current = Some(a..b);
                continue;
            }
        }
        if let (Some(vm), Some(r)) = (line.strip_prefix("VmFlags:"), &current) {
            for f in vm.split_whitespace() {
                if let Some(i) = flags.iter().position(|&x| x == f) {
                    out[i].push(r.clone());
                }
            }
            current = None;
        }
    }
    Ok(out)
}

fn read_kib(path: &str, field: &str) -> io::Result<u64> {
    let s = std::fs::read_to_string(path)?;
    for line in s.lines() {
        if let Some(rest) = line.strip_prefix(field) {
            if let Some(v) = rest.strip_prefix(':') {
                let num = v.trim().trim_end_matches("kB").trim();
                return num
                    .parse()
                    .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "bad number"));
            }
        }
    }
    Err(io::Error::new(
        io::ErrorKind::NotFound,
        format!("no field {field} in {path}"),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{memfd_create, mmap_anonymous, mmap_private_fixed, munmap, raw_mprotect};

    /// A mapping locked on fault shows as locked; its unlocked neighbour does not.
    #[test]
    fn locked_mappings_are_listed() {
        let p = mmap_anonymous(3 * PAGE).unwrap() as usize;
        // SAFETY: locks a page of this test's own mapping; it changes no contents.
        let r = unsafe { libc::syscall(libc::SYS_mlock2, p + PAGE, PAGE, libc::MLOCK_ONFAULT) };
        if r != 0 {
            eprintln!("skipped: mlock2 refused ({})", io::Error::last_os_error());
            return;
        }
        let locked = self_locked_mappings().unwrap();
        assert!(locked.contains(&(p + PAGE..p + 2 * PAGE)), "{locked:x?}");
        assert!(!locked
            .iter()
            .any(|m| m.contains(&p) || m.contains(&(p + 2 * PAGE))));
        // SAFETY: this test's own mapping, which nothing refers to.
        unsafe { munmap(p as *mut u8, 3 * PAGE) }.unwrap();
    }

    const PAGE: usize = 4096;

    /// Eight pages: a private mapping of a memfd at page 2, page 5 read-only, the rest
    /// anonymous read/write: five mappings.
    fn mixed_mappings() -> (*mut u8, std::os::fd::OwnedFd) {
        let p = mmap_anonymous(8 * PAGE).unwrap();
        let fd = memfd_create(c"procfs-test").unwrap();
        crate::ftruncate(fd.as_raw_fd(), PAGE as u64).unwrap();
        // SAFETY: the test's own fresh mapping; nothing refers into it.
        unsafe {
            mmap_private_fixed(p.add(2 * PAGE), PAGE, fd.as_raw_fd(), 0).unwrap();
            assert_eq!(
                raw_mprotect(p.add(5 * PAGE).cast(), PAGE, libc::PROT_READ),
                0
            );
        }
        (p, fd)
    }

    #[test]
    fn the_protection_of_a_range_is_that_of_all_its_mappings() {
        let (p, _fd) = mixed_mappings();
        let at = |k: usize| p as usize + k * PAGE;
        let maps = Maps::open().unwrap();
        let rw = Some(libc::PROT_READ | libc::PROT_WRITE);
        let cases = [
            ((0, 4), rw),
            ((5, 6), Some(libc::PROT_READ)),
            ((4, 6), None),
            ((6, 8), rw),
        ];
        let check = |(a, e): (usize, usize), want| {
            assert_eq!(
                maps.protection(at(a), at(e)).unwrap(),
                want,
                "pages {a}..{e}"
            );
            let listed = self_mappings_filtered(at(a), at(e)).unwrap();
            assert_eq!(
                same_protection(&listed, at(a), at(e)),
                want,
                "pages {a}..{e}"
            );
        };
        cases.into_iter().for_each(|(r, want)| check(r, want));
        // SAFETY: the test's own mapping; nothing refers into it.
        unsafe { munmap(p.add(7 * PAGE), PAGE).unwrap() };
        check((6, 8), None);
        // SAFETY: as above.
        unsafe { munmap(p, 7 * PAGE).unwrap() };
    }

    #[test]
    fn the_mappings_of_a_range_are_those_the_whole_file_lists() {
        let (p, _fd) = mixed_mappings();
        let (a, e) = (p as usize, p as usize + 8 * PAGE);
        let asked = Maps::open().unwrap().in_range(a + PAGE, e - PAGE).unwrap();
        let listed = self_mappings_filtered(a + PAGE, e - PAGE).unwrap();
        // Compared inside the test's own mapping: between the two reads another test's thread
        // may map memory next to it, which the kernel joins to its first or last mapping.
        let inside = |v: &[Mapping]| -> Vec<Mapping> {
            v.iter()
                .map(|m| Mapping {
                    start: m.start.max(a),
                    end: m.end.min(e),
                    ..m.clone()
                })
                .collect()
        };
        assert_eq!(inside(&asked), inside(&listed));
        assert_eq!(asked.len(), 5, "{asked:?}");
        assert!(asked[1].inode != 0 && asked[1].path.contains("procfs-test"));
        assert_eq!((asked[1].start, asked[1].end), (a + 2 * PAGE, a + 3 * PAGE));
        assert_eq!(asked[3].perms, "r--p");
        assert!(asked[0].is_private_anonymous_rw() && asked[0].start <= a);
        // The ioctl itself, where the kernel has it (else the answers above are the file's).
        let mut name = vec![0u8; NAME_MAX_BYTES];
        match Maps::open().unwrap().query(a + 2 * PAGE, &mut name) {
            Err(e) if e.raw_os_error() == Some(libc::ENOTTY) => {}
            r => assert_eq!(r.unwrap().as_ref(), Some(&asked[1])),
        }
        // SAFETY: the test's own mapping, unmapped whole.
        unsafe { munmap(p, 8 * PAGE).unwrap() };
    }

    #[test]
    fn a_range_with_nothing_mapped_has_no_mappings() {
        let p = mmap_anonymous(3 * PAGE).unwrap();
        // SAFETY: the middle page of the test's own mapping.
        unsafe { munmap(p.add(PAGE), PAGE).unwrap() };
        let a = p as usize + PAGE;
        assert_eq!(self_mappings_in(a, a + PAGE).unwrap(), Vec::new());
        // SAFETY: the test's own pages, unmapped.
        unsafe {
            munmap(p, PAGE).unwrap();
            munmap(p.add(2 * PAGE), PAGE).unwrap();
        }
    }
}
