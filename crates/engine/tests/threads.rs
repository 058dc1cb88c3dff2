//! The engine's threads never run the program's signal handlers: a handler touching registered
//! memory on the thread that answers faults (or on the committer, in its own frozen run) would
//! block it for ever.

use std::time::Duration;

use pageone_engine::Engine;

/// The signals blocked by each of this process's threads whose name starts with `prefix`.
fn blocked_by_threads(prefix: &str) -> Vec<(String, u64)> {
    let mut out = Vec::new();
    for task in std::fs::read_dir("/proc/self/task").unwrap() {
        let dir = task.unwrap().path();
        let Ok(name) = std::fs::read_to_string(dir.join("comm")) else {
            continue;
        };
        if !name.starts_with(prefix) {
            continue;
        }
        let status = std::fs::read_to_string(dir.join("status")).unwrap();
        let mask = status
            .lines()
            .find_map(|l| l.strip_prefix("SigBlk:"))
            .map(|v| u64::from_str_radix(v.trim(), 16).unwrap())
            .unwrap();
        out.push((name.trim().to_string(), mask));
    }
    out
}

#[test]
fn engine_threads_block_every_signal_a_program_can_handle() {
    let e = Engine::builder()
        .workers(2)
        .merge_period(Duration::from_millis(20))
        .build()
        .expect("engine");
    let region = e.alloc_region(64 << 10).unwrap();
    e.wait_periods(2, Duration::from_secs(5));
    let threads = blocked_by_threads("pageone-");
    assert!(
        threads.len() >= 4,
        "the engine, committer, fault thread and workers run: {threads:?}"
    );
    let bit = |sig: i32| 1u64 << (sig - 1);
    let handled = [
        libc::SIGINT,
        libc::SIGTERM,
        libc::SIGHUP,
        libc::SIGUSR1,
        libc::SIGUSR2,
        libc::SIGCHLD,
        libc::SIGALRM,
        libc::SIGIO,
        libc::SIGRTMIN() + 2,
    ];
    for (name, mask) in &threads {
        for sig in handled {
            assert_ne!(
                mask & bit(sig),
                0,
                "{name} takes signal {sig} (mask {mask:#x})"
            );
        }
    }
    // The calling thread's own mask is left as it was.
    let this = std::fs::read_to_string("/proc/thread-self/status").unwrap();
    let mine = this
        .lines()
        .find_map(|l| l.strip_prefix("SigBlk:"))
        .map(|v| u64::from_str_radix(v.trim(), 16).unwrap())
        .unwrap();
    assert_eq!(mine & bit(libc::SIGUSR1), 0);
    drop(region);
}
