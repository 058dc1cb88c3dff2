//! What memory operations cost the program (`pageone-bench overhead`): each of [`Op::ALL`] timed
//! in a fresh process ([`crate::ops`]) per repetition, for each side:
//!
//! * plain: `MADV_MERGEABLE` with KSM not running;
//! * KSM at its fastest (`sleep_millisecs=0`, `pages_to_scan=100000`);
//! * pageone: the same program under `LD_PRELOAD=libpageone_preload.so` with
//!   `PAGEONE_MERGE_PERIOD_MS` set, with a store of its own, or with `--daemon` a daemon's (as
//!   `pageone run` runs a program).
//!
//! For [`Op::WriteStall`] this process keeps a busy thread on every CPU (normal priority) while
//! the writers run. Results pool the repetitions' histograms; the exit is timed here, from the
//! child's last clock reading to its reaping.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::ksm::KsmSession;
use crate::latency::{Histogram, Summary};
use crate::ops::{Op, OpOutput, OpSpec, Side, Stall};
use crate::processes::{io_err, Error};
use pageone_sys::monotonic_ns;

/// How the benchmark is run.
#[derive(Clone, Debug)]
pub struct Setup {
    pub sides: Vec<Side>,
    pub ops: Vec<Op>,
    pub pages: usize,
    /// Processes per side and operation (their samples are pooled).
    pub reps: usize,
    pub calls: usize,
    pub call_pages: usize,
    pub period_ms: u64,
    pub merge_timeout: Duration,
    pub stall: Stall,
    /// Busy threads during the stall (default: one per CPU).
    pub busy_threads: usize,
    /// This executable: the children are `EXE overhead-child --spec JSON`.
    pub bench_exe: PathBuf,
    /// `libpageone_preload.so`, for pageone's side.
    pub preload: Option<PathBuf>,
    /// A daemon's socket: pageone's side shares its store (scope `overhead`), as under
    /// `pageone run`; `None`: the process's own store.
    pub daemon_socket: Option<PathBuf>,
}

/// One operation on one side, over its repetitions.
#[derive(Clone, Debug, serde::Serialize)]
pub struct OpResult {
    pub op: Op,
    pub side: Side,
    pub reps: usize,
    pub pages: usize,
    /// The least fraction of the region merged when the operation began, over the repetitions.
    pub merged_fraction: f64,
    /// [`Op::WriteStall`]: the least fraction merged when the writers stopped.
    pub merged_fraction_after: Option<f64>,
    /// Seconds the region took to merge (the longest repetition).
    pub merge_seconds: f64,
    /// Nanoseconds per page: p50, p99, p99.9, max, mean, count. For a write stall: per write.
    pub ns_per_page: Summary,
    /// Nanoseconds per call, for operations made of calls (munmap, partial, fork, exit).
    pub ns_per_call: Option<Summary>,
    /// [`Op::WriteStall`]: writes that took at least 100 µs, 1 ms and 10 ms.
    pub stalls_over: Option<[u64; 3]>,
    /// [`Op::HugeRead`]: the least fraction of the region mapped by huge pages when the reads
    /// began, over the repetitions.
    pub huge_fraction: Option<f64>,
    pub wrong_pages: u64,
}

/// Busy threads spinning at normal priority until dropped.
struct Busy {
    stop: Arc<AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Busy {
    fn start(n: usize) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let threads = (0..n)
            .map(|_| {
                let stop = stop.clone();
                // Relaxed: only a stop flag, nothing is published through it.
                std::thread::spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        std::hint::spin_loop();
                    }
                })
            })
            .collect();
        Self { stop, threads }
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// Kills a child (by its pid, before it is reaped) if it outlives its deadline.
struct Watchdog {
    done: Arc<AtomicBool>,
}

impl Watchdog {
    fn start(pid: u32, deadline: Duration) -> Self {
        let done = Arc::new(AtomicBool::new(false));
        let d = done.clone();
        std::thread::spawn(move || {
            let t0 = std::time::Instant::now();
            // SeqCst: pairs with the store in drop, which happens before the child is reaped.
            while !d.load(Ordering::SeqCst) {
                if t0.elapsed() > deadline {
                    eprintln!("  a child ran past {} s: killed", deadline.as_secs());
                    // SAFETY: our own child, not yet reaped (its pid cannot be reused).
                    unsafe { libc::kill(pid as i32, libc::SIGKILL) };
                    return;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        });
        Self { done }
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.done.store(true, Ordering::SeqCst);
        std::thread::sleep(Duration::from_millis(60)); // let the watcher see it before reaping
    }
}

/// Runs one child for `spec`; returns its output, and the exit time (ns) for [`Op::Exit`].
fn one(setup: &Setup, spec: &OpSpec) -> Result<(OpOutput, Option<u64>), Error> {
    let mut cmd = Command::new(&setup.bench_exe);
    cmd.args(["overhead-child", "--spec"])
        .arg(serde_json::to_string(spec).expect("JSON"))
        .env_remove("PAGEONE_SOCKET")
        .env_remove("LD_PRELOAD")
        .stdout(Stdio::piped());
    if spec.side == Side::Pageone {
        let lib = setup.preload.as_ref().ok_or_else(|| {
            Error::Run("pageone's side needs libpageone_preload.so (--preload)".into())
        })?;
        cmd.env("LD_PRELOAD", lib)
            .env("PAGEONE_MERGE_PERIOD_MS", setup.period_ms.to_string());
        if let Some(socket) = &setup.daemon_socket {
            cmd.env("PAGEONE_SOCKET", socket)
                .env("PAGEONE_SCOPE", "overhead");
        }
    }
    let mut child = cmd.spawn().map_err(io_err("could not start a child"))?;
    let deadline = setup.merge_timeout + Duration::from_secs_f64(spec.stall.seconds + 120.0);
    let dog = Watchdog::start(child.id(), deadline);
    let mut line = String::new();
    let mut out = BufReader::new(child.stdout.take().expect("piped"));
    out.read_line(&mut line)
        .map_err(io_err("could not read a child's output"))?;
    let status = child.wait().map_err(io_err("waiting for a child"))?;
    let t1 = monotonic_ns();
    drop(dog);
    let o: OpOutput = serde_json::from_str(line.trim()).map_err(|e| {
        Error::Run(format!(
            "{} on {}: the child ended ({status}) without its results ({e}): {line:?}",
            spec.op.name(),
            spec.side.name()
        ))
    })?;
    if !status.success() {
        return Err(Error::Run(format!(
            "{} on {}: the child ended with {status}",
            spec.op.name(),
            spec.side.name()
        )));
    }
    if spec.side == Side::Pageone && !o.preloaded {
        return Err(Error::Run(
            "the child did not load libpageone_preload.so: pageone's side would be plain".into(),
        ));
    }
    let exit_ns = o.exit_t0_ns.map(|t0| t1.saturating_sub(t0));
    Ok((o, exit_ns))
}

/// Runs one operation on one side, `setup.reps` times.
fn op_on_side(setup: &Setup, op: Op, side: Side) -> Result<OpResult, Error> {
    let spec = OpSpec {
        op,
        side,
        pages: setup.pages,
        calls: setup.calls,
        call_pages: setup.call_pages,
        merge_timeout_ms: setup.merge_timeout.as_millis() as u64,
        stall: setup.stall.clone(),
    };
    let (mut per_page, mut per_call) = (Histogram::default(), Histogram::default());
    let mut r = OpResult {
        op,
        side,
        reps: setup.reps,
        pages: setup.pages,
        merged_fraction: 1.0,
        merged_fraction_after: None,
        merge_seconds: 0.0,
        ns_per_page: Summary::default(),
        ns_per_call: None,
        stalls_over: None,
        huge_fraction: None,
        wrong_pages: 0,
    };
    for _ in 0..setup.reps {
        let busy = (op == Op::WriteStall).then(|| Busy::start(setup.busy_threads));
        let (o, exit_ns) = one(setup, &spec)?;
        drop(busy);
        let frac = |m: u64| m as f64 / setup.pages.max(1) as f64;
        r.merged_fraction = r.merged_fraction.min(frac(o.merged_pages));
        if let Some(a) = o.merged_pages_after {
            let f = r.merged_fraction_after.unwrap_or(1.0).min(frac(a));
            r.merged_fraction_after = Some(f);
        }
        r.merge_seconds = r.merge_seconds.max(o.merge_seconds);
        if let Some(h) = o.huge_pages {
            let f = h as f64 / (setup.pages / 512 * 512).max(1) as f64;
            r.huge_fraction = Some(r.huge_fraction.unwrap_or(1.0).min(f));
        }
        r.wrong_pages += o.wrong_pages;
        per_page.merge(&Histogram::from_sparse(&o.per_page));
        if let Some(c) = &o.per_call {
            per_call.merge(&Histogram::from_sparse(c));
        }
        if let Some(ns) = exit_ns {
            per_call.record(ns);
            per_page.record(ns / setup.pages.max(1) as u64);
        }
    }
    r.ns_per_page = per_page.summary();
    if per_call.count() > 0 {
        r.ns_per_call = Some(per_call.summary());
    }
    if op == Op::WriteStall {
        r.stalls_over = Some([100_000, 1_000_000, 10_000_000].map(|b| per_page.at_least(b)));
    }
    Ok(r)
}

/// Runs every operation on every side, calling `each` with each result as it comes.
pub fn run(setup: &Setup, mut each: impl FnMut(&OpResult)) -> Result<Vec<OpResult>, Error> {
    let mut results = Vec::new();
    for &side in &setup.sides {
        // Plain and pageone run with KSM stopped (and everything it merged unmerged); KSM's side
        // at its fastest. Every knob is restored afterwards.
        let session = if crate::ksm::available() {
            Some(
                KsmSession::new(0, 100_000)
                    .map_err(|e| Error::Run(format!("could not set KSM's knobs: {e}")))?,
            )
        } else if side == Side::Ksm {
            return Err(Error::Run(
                "KSM is not available or not writable here (needs root and /sys/kernel/mm/ksm)"
                    .into(),
            ));
        } else {
            if crate::ksm::read("run").is_ok_and(|r| r == 1) {
                return Err(Error::Run(format!(
                    "KSM is running and cannot be stopped by this user: {} would not be {}",
                    side.name(),
                    side.name()
                )));
            }
            None
        };
        if let (Some(s), Side::Ksm) = (&session, side) {
            s.start().map_err(io_err("could not start KSM"))?;
        }
        for &op in &setup.ops {
            let r = op_on_side(setup, op, side)?;
            each(&r);
            results.push(r);
            if let (Some(s), Side::Ksm) = (&session, side) {
                // Unmerge what is left between operations (the children are gone anyway).
                s.stop_and_unmerge().map_err(io_err("could not stop KSM"))?;
                s.start().map_err(io_err("could not start KSM"))?;
            }
        }
    }
    Ok(results)
}
