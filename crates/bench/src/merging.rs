//! One side of the merging benchmark (`pageone-bench ksm`): KSM at its fastest, or pageone, on
//! the same workload processes ([`crate::workload`]), measured alike.
//!
//! The workload is `regions` regions of identical contents laid out by [`crate::layout`], all in
//! one process or one process per region (pageone's processes then share through a `pageone
//! daemon`), with optional writer threads. A run:
//!
//! 1. starts the processes (they fill their memory) and takes the "before" figures: Pss of the
//!    processes (and daemon), `MemAvailable`, [`HostMemory`], VMAs, the VMA slab caches;
//! 2. registers everything at once (`GO`) and samples the saving every `sample_every` (the
//!    side's counters, and `MemAvailable`) until 99% of the possible saving or the timeout:
//!    t50/t90/t99 and the CPU-seconds until then;
//! 3. lets the side finish (up to [`SETTLE_GRACE`] more, then two periods for frees), takes the
//!    "after" figures, then measures the side's CPU over a settle window;
//! 4. checks every byte of every process (`VERIFY`) and ends them.

use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use crate::dedup::{Data, HostMemory, Params, Sample, Series, Settled, SETTLE_GRACE};
use crate::layout::{self, Layout};
use crate::mapping_cost::{self, MappingCost};
use crate::processes::{ask_all, io_err, BenchDaemon, Client, Error};
use crate::workload::{Merger, Spec, WRITER_THREAD};
use crate::{ksm, procfs};

const PAGE: usize = 4096;
/// The daemon scope the pageone processes share.
const SCOPE: &str = "bench";

/// How the benchmark is run (the same for both sides).
#[derive(Clone, Debug)]
pub struct Setup {
    pub params: Params,
    pub layout: Layout,
    /// Writer threads per process.
    pub writers: usize,
    pub write_pause_us: u64,
    /// The regions are locked (`mlock`) before they are merged.
    pub locked: bool,
    /// One content in this many is all zero (0: none; see [`layout::is_zero_content`]).
    pub zero_every: usize,
    pub seed: u64,
    /// One process per region (pageone through a daemon) instead of one process for all.
    pub processes: bool,
    pub settle_window: Duration,
    pub sample_every: Duration,
    /// This executable: the workload processes are `EXE workload --spec JSON`.
    pub bench_exe: PathBuf,
    /// `pageone`, to run the daemon with (pageone's side with `processes`).
    pub pageone_exe: Option<PathBuf>,
}

impl Setup {
    fn region_pages(&self) -> usize {
        (self.params.region_mib << 20) / PAGE
    }

    /// What each workload process does.
    pub fn specs(&self, merger: Merger, data: Data) -> Vec<Spec> {
        let spec = |regions: Vec<usize>| Spec {
            merger,
            hard: data == Data::Hard,
            layout: self.layout,
            seed: self.seed,
            region_pages: self.region_pages(),
            regions,
            writers: self.writers,
            write_pause_us: self.write_pause_us,
            locked: self.locked,
            zero_every: self.zero_every,
            workers: self.params.workers,
            period_ms: self.params.merge_period.as_millis() as u64,
        };
        if self.processes {
            (0..self.params.regions).map(|k| spec(vec![k])).collect()
        } else {
            vec![spec((0..self.params.regions).collect())]
        }
    }

    /// Pages that can be saved (see [`layout::possible_saving`]).
    pub fn possible(&self) -> u64 {
        let regions: Vec<_> = (0..self.params.regions)
            .map(|k| layout::contents(self.layout, self.region_pages(), k, self.seed))
            .collect();
        layout::possible_saving(&regions, self.writers > 0, self.zero_every)
    }
}

/// The workload processes' counters, summed.
#[derive(Default)]
struct Counts {
    shared: u64,
    sharing: u64,
    zero: u64,
    writes: u64,
}

/// The processes of one side's run and how to read its figures.
struct Run {
    merger: Merger,
    clients: Vec<Client>,
    daemon: Option<(BenchDaemon, UnixStream)>,
    ksm: Option<ksm::KsmSession>,
    ksmd: Option<u32>,
}

impl Run {
    fn start(setup: &Setup, merger: Merger, data: Data) -> Result<Self, Error> {
        let ksm = if merger.ksm() {
            Some(
                ksm::KsmSession::new(0, 100_000)
                    .map_err(|e| Error::Run(format!("could not set KSM's knobs: {e}")))?,
            )
        } else {
            None
        };
        let daemon = match (&setup.pageone_exe, merger.pageone(), setup.processes) {
            (Some(exe), true, true) => {
                let socket =
                    std::env::temp_dir().join(format!("pageone-bench-{}.sock", std::process::id()));
                let d = BenchDaemon::start(exe, &socket)?;
                let sock =
                    UnixStream::connect(&socket).map_err(io_err("could not reach the daemon"))?;
                Some((d, sock))
            }
            (None, true, true) => {
                return Err(Error::Run(
                    "one process per region needs the `pageone` executable for its daemon".into(),
                ))
            }
            _ => None,
        };
        let mut clients = Vec::new();
        for spec in setup.specs(merger, data) {
            let json = serde_json::to_string(&spec).expect("a spec is JSON");
            let mut cmd = Command::new(&setup.bench_exe);
            cmd.args(["workload", "--spec", &json]);
            match &daemon {
                Some((d, _)) => cmd.env("PAGEONE_SOCKET", d.socket()),
                None => cmd.env_remove("PAGEONE_SOCKET"),
            };
            cmd.env("PAGEONE_SCOPE", SCOPE);
            clients.push(Client::start(cmd)?);
        }
        Ok(Self {
            merger,
            clients,
            daemon,
            ksm,
            ksmd: procfs::pid_of("ksmd"),
        })
    }

    /// Pages saved, by the side's counters, and the writes made so far. Zero pages count: KSM's
    /// merged onto the zero page (`ksm_zero_pages`, with `use_zero_pages`; else they share one
    /// KSM page, in `pages_sharing`), pageone's released or mapping zero holes.
    fn saved(&mut self) -> Result<(u64, u64), Error> {
        let by_ksm = if self.merger.ksm() {
            ksm::read("pages_sharing").unwrap_or(0) + ksm::read("ksm_zero_pages").unwrap_or(0)
        } else {
            0
        };
        let c = self.stats()?;
        if !self.merger.pageone() {
            return Ok((by_ksm, c.writes));
        }
        let merged = match &self.daemon {
            Some((d, sock)) => (c.shared + c.sharing).saturating_sub(d.copies(sock, SCOPE)?),
            None => c.sharing,
        };
        Ok((merged + c.zero + by_ksm, c.writes))
    }

    /// The processes' counters, summed.
    fn stats(&mut self) -> Result<Counts, Error> {
        let mut sum = Counts::default();
        for line in ask_all(&mut self.clients, "STATS")? {
            let v: serde_json::Value = serde_json::from_str(&line)
                .map_err(|e| Error::Run(format!("a STATS line was not JSON ({e}): {line:?}")))?;
            let n = |k: &str| v[k].as_u64().unwrap_or(0);
            sum.shared += n("pages_shared");
            sum.sharing += n("pages_sharing");
            sum.zero += n("zero_pages");
            sum.writes += n("writes");
        }
        Ok(sum)
    }

    /// CPU nanoseconds of the side so far: `ksmd`; or the engines' threads (every thread of the
    /// workload processes but the main one and the writers) and the daemon.
    fn cpu_ns(&self) -> u64 {
        let ksmd = match self.merger.ksm() {
            true => self
                .ksmd
                .and_then(|p| procfs::thread_cpu_ns(p, p))
                .unwrap_or(0),
            false => 0,
        };
        if !self.merger.pageone() {
            return ksmd;
        }
        let engines: u64 = self
            .clients
            .iter()
            .map(|c| {
                let pid = c.pid();
                procfs::threads_cpu_ns(pid, |tid, name| tid != pid && name != WRITER_THREAD)
            })
            .sum();
        ksmd + engines
            + self
                .daemon
                .as_ref()
                .map_or(0, |(d, _)| procfs::process_cpu_ns(d.pid()))
    }

    fn pids(&self) -> impl Iterator<Item = u32> + '_ {
        self.clients.iter().map(Client::pid)
    }

    /// Pss of the workload processes and the daemon, KiB.
    fn pss_kib(&self) -> Option<i64> {
        let daemon = self.daemon.as_ref().map(|(d, _)| d.pid());
        self.pids()
            .chain(daemon)
            .map(|p| procfs::pss_kib(p).ok().map(|k| k as i64))
            .sum()
    }

    fn vmas(&self) -> u64 {
        self.pids().filter_map(|p| procfs::map_count(p).ok()).sum()
    }

    /// The processes' pages mapping pageone's store, by half of their regions.
    fn merged_halves(&mut self) -> Result<[u64; 2], Error> {
        let mut sum = [0u64; 2];
        for line in ask_all(&mut self.clients, "HALVES")? {
            let h: [u64; 2] = serde_json::from_str(&line)
                .map_err(|e| Error::Run(format!("a HALVES line was not [n, m] ({e}): {line:?}")))?;
            sum[0] += h[0];
            sum[1] += h[1];
        }
        Ok(sum)
    }

    /// Checks every process's bytes, then ends them (each verifies again and unregisters).
    fn finish(mut self) -> Result<(), Error> {
        for (k, v) in ask_all(&mut self.clients, "VERIFY")?
            .into_iter()
            .enumerate()
        {
            if v != "OK" {
                return Err(Error::Run(format!(
                    "{} run: workload process {k} lost data ({v}): this is a bug, please report it",
                    self.merger.name()
                )));
            }
        }
        for c in self.clients.drain(..) {
            c.finish()?;
        }
        if let Some(s) = &self.ksm {
            s.stop_and_unmerge().map_err(io_err("could not stop KSM"))?;
        }
        Ok(())
    }
}

/// The figures taken before registration and after settling.
struct Figures {
    pss_kib: Option<i64>,
    mem_available_kib: Option<i64>,
    host: Option<HostMemory>,
    vmas: u64,
    slab_bytes: Option<u64>,
}

impl Figures {
    fn take(run: &Run) -> Self {
        Self {
            pss_kib: run.pss_kib(),
            mem_available_kib: procfs::mem_available_kib().ok().map(|k| k as i64),
            host: HostMemory::now(),
            vmas: run.vmas(),
            slab_bytes: mapping_cost::slab_bytes(),
        }
    }
}

/// What the sampling until 99% (or the timeout) and the grace after it found.
struct Race {
    series: Series,
    t99: Option<f64>,
    cpu_ns: u64,
    saved: u64,
    writes: u64,
}

/// Samples the saving from `t0` until 99% of `possible` or the timeout, then through the grace
/// (until all of `possible` or [`SETTLE_GRACE`]).
fn race(
    setup: &Setup,
    run: &mut Run,
    t0: Instant,
    cpu0: u64,
    possible: u64,
) -> Result<Race, Error> {
    let avail0 = procfs::mem_available_kib().unwrap_or(0) as i64;
    let mut r = Race {
        series: Series::default(),
        t99: None,
        cpu_ns: 0,
        saved: 0,
        writes: 0,
    };
    let target = possible * 99 / 100;
    let mut grace_end: Option<Instant> = None;
    loop {
        (r.saved, r.writes) = run.saved()?;
        let t = t0.elapsed().as_secs_f64();
        let avail = procfs::mem_available_kib().unwrap_or(0) as i64;
        r.series.push(t, r.saved, avail - avail0);
        if r.t99.is_none() && r.saved >= target.max(1) {
            r.t99 = Some(t);
        }
        let timed_out = t0.elapsed() >= setup.params.timeout;
        if grace_end.is_none() && (r.t99.is_some() || timed_out) {
            r.cpu_ns = run.cpu_ns().saturating_sub(cpu0);
            grace_end = Some(
                Instant::now()
                    + if timed_out {
                        Duration::ZERO
                    } else {
                        SETTLE_GRACE
                    },
            );
        }
        if grace_end.is_some_and(|g| Instant::now() >= g || r.saved >= possible) {
            return Ok(r);
        }
        std::thread::sleep(setup.sample_every);
    }
}

/// Runs one side on one data set (see the module's documentation).
pub fn run(setup: &Setup, merger: Merger, data: Data) -> Result<Sample, Error> {
    let mut run = Run::start(setup, merger, data)?;
    let possible = setup.possible();
    let before = Figures::take(&run);
    let cpu0 = run.cpu_ns();
    let t0 = Instant::now();
    for line in ask_all(&mut run.clients, "GO")? {
        if line != "GOING" {
            return Err(Error::Run(format!(
                "a workload process failed to register: {line:?}"
            )));
        }
    }
    if let Some(s) = &run.ksm {
        s.start().map_err(io_err("could not start KSM"))?;
    }
    let race = race(setup, &mut run, t0, cpu0, possible)?;
    std::thread::sleep(2 * setup.params.merge_period);
    let after = Figures::take(&run);
    let settled = settle(setup, &run);
    if let (Some(b), Some(a)) = (before.host, after.host) {
        eprintln!("    (host memory, MiB: {})", a.growth_since(&b));
    }
    let vmas_added = after.vmas as i64 - before.vmas as i64;
    let mapping_kernel = MappingCost::between(before.slab_bytes, after.slab_bytes, vmas_added);
    let saved_pss_kib = before.pss_kib.zip(after.pss_kib).map(|(b, a)| b - a);
    let merged_halves = run.merged_halves()?;
    run.finish()?;
    let s = &race.series;
    Ok(Sample {
        side: merger.name(),
        data,
        seconds_to_99: race.t99,
        cpu_seconds: race.cpu_ns as f64 / 1e9,
        pages_saved: race.saved,
        possible,
        memory_saved_kib: before
            .host
            .zip(after.host)
            .map(|(b, a)| b.total() - a.total()),
        layout: setup.layout,
        writers: setup.writers,
        t50: s.time_to(0.50, possible),
        t90: s.time_to(0.90, possible),
        t99: race.t99,
        saved_pss_kib,
        saved_memavailable_kib: after
            .mem_available_kib
            .zip(before.mem_available_kib)
            .map(|(a, b)| a - b),
        vmas_before: before.vmas,
        vmas_after: after.vmas,
        net_saved_kib: saved_pss_kib.map(|p| p - mapping_kernel.kib),
        mapping_kernel,
        settled,
        writes: race.writes,
        merged_halves,
        series: race.series,
    })
}

/// The side's CPU over the settle window.
fn settle(setup: &Setup, run: &Run) -> Settled {
    let c0 = run.cpu_ns();
    let t0 = Instant::now();
    std::thread::sleep(setup.settle_window);
    let cpu = run.cpu_ns().saturating_sub(c0) as f64 / 1e9;
    let secs = t0.elapsed().as_secs_f64();
    let gib = (setup.params.regions * setup.params.region_mib) as f64 / 1024.0;
    let processes = if setup.processes {
        setup.params.regions
    } else {
        1
    };
    Settled {
        window_seconds: secs,
        cpu_seconds: cpu,
        cpu_per_second_per_gib: cpu / secs / gib,
        core_percent_per_process: 100.0 * cpu / secs / processes as f64,
    }
}
