//! A process of the merging benchmark (`pageone-bench workload --spec JSON`, run by
//! [`crate::merging`]): the same program for both sides.
//!
//! It maps its regions, fills them with seed data laid out by [`crate::layout`], prints `READY
//! <pid>`, then serves its standard input, one command a line:
//!
//! * `GO`: registers every region (KSM: `madvise(MADV_MERGEABLE)`; pageone: an in-process engine,
//!   joining `$PAGEONE_SOCKET`'s daemon when set), starts the writers, answers `GOING`.
//! * `STATS`: the engine's `pages_shared` and `pages_sharing` (0 under KSM) and the writes so far,
//!   as one JSON line.
//! * `VERIFY`: with the writers held still, checks every byte: `OK` or `BAD <page>`.
//!
//! At the end of its input it stops the writers, verifies, unregisters and exits (1 if a page was
//! wrong). Writers are threads named `bench-writer`: each writes one word of random pages among
//! the positions of [`layout::written`] (its own share of them), pausing between writes.

use std::io::{BufRead, Write};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use pageone_engine::Engine;
use pageone_seed::{fill_page, Data};
use pageone_sys as sys;
use rand::{Rng, SeedableRng};

use crate::layout::{self, Layout};

const PAGE: usize = 4096;
/// The word writers write (past the seed data's bytes, which end before byte 261).
pub const WRITE_WORD: usize = 256;
/// The name of writer threads (their CPU is the program's, not the merger's).
pub const WRITER_THREAD: &str = "bench-writer";

/// Who merges.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Merger {
    Ksm,
    Pageone,
    /// pageone with the kernel's KSM running too, for the pages pageone's mapping budget cannot
    /// afford (`Config::ksm_when_limited`).
    Hybrid,
}

impl Merger {
    pub fn name(self) -> &'static str {
        match self {
            Merger::Ksm => "ksm",
            Merger::Pageone => "pageone",
            Merger::Hybrid => "hybrid",
        }
    }

    /// Whether pageone's engines run on this side.
    pub fn pageone(self) -> bool {
        self != Merger::Ksm
    }

    /// Whether the kernel's KSM runs on this side.
    pub fn ksm(self) -> bool {
        self != Merger::Pageone
    }
}

/// What one workload process does.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct Spec {
    pub merger: Merger,
    pub hard: bool,
    pub layout: Layout,
    pub seed: u64,
    pub region_pages: usize,
    /// The regions this process holds, by their index in the layout.
    pub regions: Vec<usize>,
    pub writers: usize,
    /// Pause of each writer between two writes, in microseconds (0: none).
    pub write_pause_us: u64,
    /// Lock the regions (`mlock`) once filled.
    #[serde(default)]
    pub locked: bool,
    /// One content in this many is all zero (0: none; see `layout::is_zero_content`).
    #[serde(default)]
    pub zero_every: usize,
    pub workers: usize,
    pub period_ms: u64,
}

impl Spec {
    pub fn data(&self) -> Data {
        if self.hard {
            Data::Hard
        } else {
            Data::Easy
        }
    }
}

/// Why a workload process failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("the engine failed: {0}")]
    Engine(#[from] pageone_engine::EngineError),
    #[error("page {0} does not hold what was written")]
    Wrong(usize),
}

/// The regions of this process and what each page must hold.
struct Regions {
    base: Vec<*mut u8>,
    contents: Vec<Vec<u32>>,
    pages: usize,
    data: Data,
    zero_every: usize,
}

impl Regions {
    fn new(s: &Spec) -> std::io::Result<Self> {
        let mut r = Self {
            base: Vec::new(),
            contents: Vec::new(),
            pages: s.region_pages,
            data: s.data(),
            zero_every: s.zero_every,
        };
        for &k in &s.regions {
            let p = sys::mmap_anonymous(s.region_pages * PAGE)?;
            let c = layout::contents(s.layout, s.region_pages, k, s.seed);
            for (i, &content) in c.iter().enumerate() {
                if layout::is_zero_content(content, s.zero_every) {
                    // Written all zero (present, as a program's zeroed page is).
                    // SAFETY: page i of a fresh private mapping owned here.
                    unsafe { p.add(i * PAGE).write_bytes(0, PAGE) };
                    continue;
                }
                // SAFETY: page i of a fresh private mapping owned here, zero as fill_page wants.
                unsafe { fill_page(p.add(i * PAGE), r.data, content as u64) };
            }
            // SAFETY: locking the mapping just made changes no contents.
            if s.locked && unsafe { libc::mlock(p.cast(), s.region_pages * PAGE) } != 0 {
                return Err(std::io::Error::last_os_error());
            }
            r.base.push(p);
            r.contents.push(c);
        }
        Ok(r)
    }

    /// Pages of the regions' first halves, and of their second halves, that map pageone's store
    /// (merged pages, zero holes among them): where the mapping budget went (see
    /// `Layout::Mixed`).
    fn merged_halves(&self) -> std::io::Result<[u64; 2]> {
        let maps = sys::self_mappings()?;
        let mut out = [0u64; 2];
        for &b in &self.base {
            let (b, mid, end) = (
                b as usize,
                b as usize + self.pages / 2 * PAGE,
                b as usize + self.pages * PAGE,
            );
            for m in maps.iter().filter(|m| pageone_engine::is_merged_mapping(m)) {
                for (h, r) in [(0, b..mid), (1, mid..end)] {
                    let (lo, hi) = (m.start.max(r.start), m.end.min(r.end));
                    out[h] += (hi.saturating_sub(lo) / PAGE) as u64;
                }
            }
        }
        Ok(out)
    }

    fn page(&self, slot: usize) -> *mut u8 {
        // SAFETY: slot < regions * pages: inside one of the mappings.
        unsafe { self.base[slot / self.pages].add(slot % self.pages * PAGE) }
    }

    fn slots(&self) -> usize {
        self.base.len() * self.pages
    }

    /// The first page that differs from its content (and its writer's last word), if any.
    fn check(&self, shadow: Option<&[AtomicU64]>) -> Option<usize> {
        let (mut want, mut got) = ([0u8; PAGE], [0u8; PAGE]);
        for slot in 0..self.slots() {
            want.fill(0);
            let content = self.contents[slot / self.pages][slot % self.pages];
            if !layout::is_zero_content(content, self.zero_every) {
                // SAFETY: `want` is a local page.
                unsafe { fill_page(want.as_mut_ptr(), self.data, content as u64) };
            }
            if let Some(v) = shadow.and_then(|s| writer_slot(slot, self.pages).map(|w| &s[w])) {
                let v = v.load(Ordering::SeqCst);
                if v != 0 {
                    want[WRITE_WORD..WRITE_WORD + 8].copy_from_slice(&v.to_ne_bytes());
                }
            }
            // SAFETY: the page is mapped; nothing writes it meanwhile (writers are held still
            // and the merger never changes contents), so a copy is what the program sees.
            unsafe { std::ptr::copy_nonoverlapping(self.page(slot), got.as_mut_ptr(), PAGE) };
            if got != want {
                return Some(slot);
            }
        }
        None
    }
}

impl Drop for Regions {
    fn drop(&mut self) {
        for &p in &self.base {
            // SAFETY: mapped in `new`; no reference into it outlives self.
            let _ = unsafe { sys::munmap(p, self.pages * PAGE) };
        }
    }
}

/// The shadow slot of a written page (position `slot % pages` of its region), if writers write it.
fn writer_slot(slot: usize, pages: usize) -> Option<usize> {
    layout::written(slot % pages).then_some(slot / layout::WRITER_STRIDE)
}

/// The writer threads, stopped when dropped.
struct Writers {
    shadow: Arc<Vec<AtomicU64>>,
    pause: Arc<AtomicBool>,
    parked: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
    writes: Arc<AtomicU64>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

/// Addresses as numbers, to move into writer threads.
struct Targets(Vec<usize>);

impl Writers {
    fn start(r: &Regions, s: &Spec) -> Self {
        let n = s.writers;
        let mut w = Self {
            shadow: Arc::new(
                (0..r.slots().div_ceil(layout::WRITER_STRIDE))
                    .map(|_| AtomicU64::new(0))
                    .collect(),
            ),
            pause: Arc::default(),
            parked: Arc::default(),
            stop: Arc::default(),
            writes: Arc::default(),
            threads: Vec::new(),
        };
        for t in 0..n {
            // Writer t's share: every n-th written page.
            let mine: Vec<usize> = (0..r.slots())
                .filter(|&slot| writer_slot(slot, r.pages).is_some_and(|k| k % n == t))
                .collect();
            let targets = Targets(mine.iter().map(|&slot| r.page(slot) as usize).collect());
            let tag = (s.regions[0] as u64 + 1) << 56 | (t as u64) << 48;
            let (sh, pa, pk, st, wr) = (
                w.shadow.clone(),
                w.pause.clone(),
                w.parked.clone(),
                w.stop.clone(),
                w.writes.clone(),
            );
            let pause = Duration::from_micros(s.write_pause_us);
            let seed = s.seed ^ tag;
            let thread = std::thread::Builder::new()
                .name(WRITER_THREAD.into())
                .spawn(move || {
                    let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
                    let mut seq = 0u64;
                    // SeqCst throughout: a benchmark's helper, where plain reasoning beats speed.
                    while !st.load(Ordering::SeqCst) && !targets.0.is_empty() {
                        if pa.load(Ordering::SeqCst) {
                            pk.fetch_add(1, Ordering::SeqCst);
                            while pa.load(Ordering::SeqCst) && !st.load(Ordering::SeqCst) {
                                std::thread::sleep(Duration::from_micros(100));
                            }
                            pk.fetch_sub(1, Ordering::SeqCst);
                            continue;
                        }
                        let k = rng.gen_range(0..targets.0.len());
                        seq += 1;
                        let v = tag | seq;
                        // SAFETY: a page of the process's regions, mapped while writers run
                        // (they are stopped before the regions go); only this thread writes this
                        // word, and the merger keeps every write (that is what VERIFY checks).
                        unsafe {
                            std::ptr::write_volatile((targets.0[k] + WRITE_WORD) as *mut u64, v)
                        };
                        sh[mine[k] / layout::WRITER_STRIDE].store(v, Ordering::SeqCst);
                        wr.fetch_add(1, Ordering::Relaxed);
                        if !pause.is_zero() {
                            std::thread::sleep(pause);
                        }
                    }
                })
                .expect("a writer thread starts");
            w.threads.push(thread);
        }
        w
    }

    /// Runs `f` with every writer held still.
    fn paused<T>(&self, f: impl FnOnce() -> T) -> T {
        self.pause.store(true, Ordering::SeqCst);
        while self.parked.load(Ordering::SeqCst) < self.threads.len() {
            std::thread::sleep(Duration::from_micros(100));
        }
        let r = f();
        self.pause.store(false, Ordering::SeqCst);
        r
    }
}

impl Drop for Writers {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// Registers the regions with the side's merger (the engine for pageone).
fn register(r: &Regions, engine: Option<&Engine>) -> Result<(), Error> {
    for &p in &r.base {
        match engine {
            Some(e) => e.register(p, r.pages * PAGE)?,
            // SAFETY: MADV_MERGEABLE does not change contents.
            None => unsafe { sys::madvise(p, r.pages * PAGE, libc::MADV_MERGEABLE) }?,
        }
    }
    Ok(())
}

fn unregister(r: &Regions, engine: Option<&Engine>) -> Result<(), Error> {
    for &p in &r.base {
        match engine {
            Some(e) => e.unregister(p, r.pages * PAGE)?,
            // SAFETY: MADV_UNMERGEABLE does not change contents.
            None => unsafe { sys::madvise(p, r.pages * PAGE, libc::MADV_UNMERGEABLE) }?,
        }
    }
    Ok(())
}

/// Runs one workload process (see the module's documentation).
pub fn serve(s: &Spec) -> Result<(), Error> {
    let engine = if s.merger.pageone() {
        Some(
            Engine::builder()
                .workers(s.workers)
                .merge_period(Duration::from_millis(s.period_ms))
                .ksm_when_limited(s.merger == Merger::Hybrid)
                .build()?,
        )
    } else {
        None
    };
    let regions = Regions::new(s)?;
    let mut writers: Option<Writers> = None;
    let mut out = std::io::stdout().lock();
    writeln!(out, "READY {}", std::process::id())?;
    out.flush()?;
    let verify = |w: &Option<Writers>| match w {
        Some(w) => w.paused(|| regions.check(Some(&w.shadow))),
        None => regions.check(None),
    };
    for line in std::io::stdin().lock().lines() {
        match line?.trim() {
            "GO" => {
                register(&regions, engine.as_ref())?;
                if s.writers > 0 && writers.is_none() {
                    writers = Some(Writers::start(&regions, s));
                }
                writeln!(out, "GOING")?
            }
            "STATS" => {
                let st = engine.as_ref().map(Engine::stats);
                let writes = writers
                    .as_ref()
                    .map_or(0, |w| w.writes.load(Ordering::Relaxed));
                let v = serde_json::json!({
                    "pages_shared": st.as_ref().map_or(0, |s| s.pages_shared),
                    "pages_sharing": st.as_ref().map_or(0, |s| s.pages_sharing),
                    "zero_pages": st.as_ref().map_or(0, |s| s.zero_pages),
                    "writes": writes,
                });
                writeln!(out, "{v}")?
            }
            "HALVES" => {
                let v = serde_json::json!(regions.merged_halves()?);
                writeln!(out, "{v}")?
            }
            "VERIFY" => match verify(&writers) {
                None => writeln!(out, "OK")?,
                Some(i) => writeln!(out, "BAD {i}")?,
            },
            other => writeln!(out, "ERR unknown command {other:?}")?,
        }
        out.flush()?;
    }
    let bad = verify(&writers);
    drop(writers);
    unregister(&regions, engine.as_ref())?;
    if let Some(e) = engine {
        e.shutdown();
    }
    match bad {
        Some(i) => Err(Error::Wrong(i)),
        None => Ok(()),
    }
}
