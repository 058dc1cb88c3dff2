//! What `/proc` and `/proc/sys` say about this process and the machine: the mappings of
//! `/proc/self/maps` ([`Mapping`]), the VMA count and limit, and fields of `meminfo`,
//! `smaps_rollup` and `status`.

use std::io;

/// The kernel's VMA limit per process (`vm.max_map_count`).
pub fn max_map_count() -> io::Result<usize> {
    let s = std::fs::read_to_string("/proc/sys/vm/max_map_count")?;
    s.trim()
        .parse()
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "bad max_map_count"))
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
