//! What `/proc` says about the benchmark's processes: CPU time per thread (nanoseconds, from
//! `schedstat`), Pss, VMA counts, and `MemAvailable`.

use std::io;

/// Nanoseconds a thread has run: the first field of `/proc/PID/task/TID/schedstat`, else its
/// `utime + stime` ticks from `stat` (None if the thread is gone).
pub fn thread_cpu_ns(pid: u32, tid: u32) -> Option<u64> {
    let dir = format!("/proc/{pid}/task/{tid}");
    if let Some(ns) = std::fs::read_to_string(format!("{dir}/schedstat"))
        .ok()
        .and_then(|s| parse_schedstat(&s))
    {
        return Some(ns);
    }
    let stat = std::fs::read_to_string(format!("{dir}/stat")).ok()?;
    Some(stat_ticks(&stat)? * 1_000_000_000 / ticks_per_second())
}

fn parse_schedstat(s: &str) -> Option<u64> {
    s.split_whitespace().next()?.parse().ok()
}

fn ticks_per_second() -> u64 {
    // SAFETY: sysconf has no memory-safety preconditions.
    unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64
}

/// `utime + stime` in ticks from a `stat` line (fields 14 and 15).
fn stat_ticks(stat: &str) -> Option<u64> {
    let rest = stat.rsplit_once(')')?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
}

/// The threads of a process: (tid, name).
pub fn threads(pid: u32) -> Vec<(u32, String)> {
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|e| {
            let tid = e.file_name().to_str()?.parse().ok()?;
            let comm = std::fs::read_to_string(e.path().join("comm")).ok()?;
            Some((tid, comm.trim().to_string()))
        })
        .collect()
}

/// CPU nanoseconds of the threads of `pid` that `count` accepts (by tid and name), summed over
/// the threads alive now (a thread that exited is no longer counted).
pub fn threads_cpu_ns(pid: u32, count: impl Fn(u32, &str) -> bool) -> u64 {
    threads(pid)
        .into_iter()
        .filter(|(tid, name)| count(*tid, name))
        .filter_map(|(tid, _)| thread_cpu_ns(pid, tid))
        .sum()
}

/// CPU nanoseconds of a whole process, exited threads included (`stat` ticks; 0 if it is gone).
pub fn process_cpu_ns(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| stat_ticks(&s))
        .map_or(0, |t| t * 1_000_000_000 / ticks_per_second())
}

/// A `Field:   N kB` line's value from a `/proc` file's text.
fn kib_field(text: &str, field: &str) -> Option<u64> {
    text.lines().find_map(|l| {
        let v = l.strip_prefix(field)?.strip_prefix(':')?;
        v.trim().trim_end_matches("kB").trim().parse().ok()
    })
}

/// The Pss of a process in KiB (`/proc/PID/smaps_rollup`).
pub fn pss_kib(pid: u32) -> io::Result<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup"))?;
    kib_field(&s, "Pss")
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "no Pss in smaps_rollup"))
}

/// The number of VMAs of a process (lines of `/proc/PID/maps`).
pub fn map_count(pid: u32) -> io::Result<u64> {
    let s = std::fs::read(format!("/proc/{pid}/maps"))?;
    Ok(s.iter().filter(|&&b| b == b'\n').count() as u64)
}

/// `MemAvailable` in KiB.
pub fn mem_available_kib() -> io::Result<u64> {
    let s = std::fs::read_to_string("/proc/meminfo")?;
    kib_field(&s, "MemAvailable")
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "no MemAvailable in meminfo"))
}

/// The pid of a kernel thread or process by its name (`comm`), if one runs.
pub fn pid_of(name: &str) -> Option<u32> {
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: u32 = e.file_name().to_str()?.parse().ok()?;
        let comm = std::fs::read_to_string(e.path().join("comm")).ok()?;
        (comm.trim() == name).then_some(pid)
    })
}

/// The number of pages a process has merged by the kernel's KSM
/// (`ksm_merging_pages` of `/proc/PID/ksm_stat`; 0 where the kernel has no such file).
pub fn ksm_merging_pages(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/ksm_stat"))
        .ok()
        .and_then(|s| {
            s.lines().find_map(|l| {
                l.strip_prefix("ksm_merging_pages ")
                    .and_then(|v| v.trim().parse().ok())
            })
        })
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_are_parsed_from_procs_text() {
        assert_eq!(parse_schedstat("123456789 2000 17\n"), Some(123456789));
        let stat = "42 (a (b) c) S 1 2 3 4 5 6 7 8 9 10 250 50 0 0 20 0";
        assert_eq!(stat_ticks(stat), Some(300));
        let rollup = "Rss:  100 kB\nPss:   12345 kB\nPss_Anon: 3 kB\n";
        assert_eq!(kib_field(rollup, "Pss"), Some(12345));
        assert_eq!(kib_field(rollup, "Pss_Dirty"), None);
    }

    #[test]
    fn this_process_is_measured() {
        let me = std::process::id();
        assert!(pss_kib(me).unwrap() > 0);
        assert!(map_count(me).unwrap() > 5);
        assert!(mem_available_kib().unwrap() > 0);
        let t0 = threads_cpu_ns(me, |_, _| true);
        let spin = std::time::Instant::now();
        while spin.elapsed() < std::time::Duration::from_millis(30) {
            std::hint::black_box(0);
        }
        assert!(threads_cpu_ns(me, |_, _| true) > t0);
        assert!(threads(me).iter().any(|&(tid, _)| tid == me));
    }
}
