//! Periods: the engine thread's loop (watch, classify in batches, hand each batch to the
//! committer, sleep out the period) and the committer thread's loop.
//!
//! A period holds the period lock from watch to the end of its last commit; `register` and
//! `unregister` take it too, so a region never changes shape under a period.

use std::collections::HashSet;
use std::io;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, SendError, SyncSender};
use std::sync::Arc;
use std::time::{Duration, Instant};

use pageone_sync::lock;
use pageone_sys as sys;

use crate::access::{read_words_each, Pre, PAGE};
use crate::candidates::{batches_by_content, Action, Candidate, ContentBatches};
use crate::candidates::{BATCH, REMOTE_BATCH};
use crate::classify::{classify, Classified, Relook, StoreView};
use crate::commit::commit;
use crate::config::Config;
use crate::layout::apply_changes;
use crate::pool::Pool;
use crate::read_ahead::use_read_ahead;
use crate::rejoin::{live_link, Rejoin};
use crate::remote::Remote;
use crate::sightings::sweep_first_sightings;
use crate::state::{page_at, PageKind, Shared, State};
use crate::stats::stats_of;
use crate::store::HeldCheck;
use crate::watch::{release_zero_probes, watch, PeriodClock, Watch};

/// Every this many periods, waiting first sightings are asked about again (daemon only), one
/// request's worth (`proto::MAX_ITEMS`) at a time.
const RELOOK_PERIODS: u64 = 16;
/// Relooks skipped in a row at most while offers keep coming (so a waiting page whose copy came
/// out under another hash is asked about again within 4 x RELOOK_PERIODS periods at the latest).
const RELOOK_SKIPS: u32 = 3;
/// Periods without anything to merge before the engine scans less often (see `engine_loop`).
const IDLE_PERIODS: u32 = 8;
/// Once idle, the engine sleeps at least this many times the CPU its last period took, with a
/// GiB or more registered (more below: see `idle_share_inv`): an idle engine costs about 1% of a
/// core, however many pages and mappings each scan walks.
const IDLE_CPU_SHARE_INV: u32 = 100;
/// The longest sleep between idle periods (a write to an idle region waits this long at most
/// before it counts).
const MAX_IDLE_SLEEP: Duration = Duration::from_secs(30);
/// How often an idle engine looks whether its daemon closed the connection (see
/// `sleep_out_period`).
const DAEMON_CHECK: Duration = Duration::from_secs(1);
/// Every this many periods the VMA count is read again once it is large (see `observe`).
const VMA_RECOUNT_PERIODS: u64 = 16;
/// Below this many VMAs, counting them (reading `/proc/self/maps`) every period is cheap.
const SMALL_VMA_COUNT: usize = 4096;
/// Most PPR tickets taken per period (the rest wait for the next one).
const MAX_TICKETS: usize = 1 << 16;
/// Periods with some work between returns of free heap memory (every period with many
/// candidates returns it at once).
const TRIM_PERIODS: u64 = 8;

/// What the engine thread hands the committer.
pub(crate) enum ToCommitter {
    Batch {
        batch: Classified,
        config: Arc<Config>,
        /// Most VMAs the process may have after a merge.
        budget: usize,
    },
    /// Answered once every batch sent before it is committed.
    Flush(SyncSender<()>),
}

/// The engine thread: a period, then sleep until the next one, until the engine stops.
pub(crate) fn engine_loop(sh: &Shared, pool: &Pool, committer: SyncSender<ToCommitter>) {
    let mut background = sys::Background::start();
    sh.count_cpu_of_this_thread();
    // Whether this period was started by `kick` rather than by the clock.
    let mut kicked = false;
    // Periods in a row that changed little (merges, zero pages released and copy-on-write
    // breaks under 1/1024 of the registered pages): after IDLE_PERIODS of them the engine
    // sleeps 2, 4, then 8 periods between scans, and at least 100 times what the last period
    // cost (see `Pace`). Scanning tens of thousands of VMAs is most of a
    // settled process's cost, and a settled guest keeps rewriting a few hundred unique pages,
    // which become candidates again and again without merging, so "no candidates" never
    // comes. A busy period, a registration or a kick brings the period back.
    let mut idle = 0u32;
    let mut rejoin = Rejoin::new();
    // The engine threads' CPU when the last period ended: what a period costs sets the idle pace.
    let mut cpu_before = sh.cpu_ns();
    while !sh.stop.load(Ordering::SeqCst) {
        background.check();
        let t0 = Instant::now();
        let config = Arc::new(lock(&sh.config).clone());
        if config.workers > pool.size() {
            if let Err(e) = pool.grow(config.workers) {
                tracing::warn!(error = %e, "could not add workers; keeping {}", pool.size());
            }
        }
        if rejoin.between_periods(sh, &config, t0) {
            idle = 0;
        }
        let cx = PeriodCtx {
            sh,
            config: &config,
            pool,
            committer: &committer,
        };
        // A panic in a period (a bug) costs that period's work, not the engine: every freeze
        // was let go while unwinding.
        let busy =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| locked_period(&cx, kicked)))
                .unwrap_or_else(|_| {
                    tracing::error!("a merge period panicked; memory is unchanged");
                    true
                });
        // An engine that only recycles keeps the period: a period with nothing marked costs a
        // look at the pool, and a mark waits one period at most.
        idle = if busy || !config.merging {
            0
        } else {
            idle.saturating_add(1)
        };
        // Relaxed: a hint for the next period's watch (this thread's own).
        sh.settled.store(idle >= IDLE_PERIODS, Ordering::Relaxed);
        {
            *lock(&sh.periods) += 1;
            sh.period_cv.notify_all();
        }
        let cpu_now = sh.cpu_ns();
        let spent = Duration::from_nanos(cpu_now.saturating_sub(cpu_before));
        cpu_before = cpu_now;
        let link = live_link(sh);
        let end = PeriodEnd {
            t0,
            period: config.merge_period,
            spent,
            wake_at: rejoin.wake_at(&config, link.as_ref()),
            link,
        };
        kicked = sleep_out_period(sh, end, &mut idle);
    }
}

/// What sets when the next period begins (see [`Pace::next`]).
#[derive(Clone, Copy, Debug)]
struct Pace {
    period: Duration,
    /// Idle periods in a row.
    idle: u32,
    /// The CPU the last period took.
    spent: Duration,
    /// Once idle, the engine sleeps at least this many times `spent` (see [`idle_share_inv`]).
    share_inv: u32,
}

impl Pace {
    /// How long after its start the next period begins, when no kick or registration comes
    /// first: one period while busy; after `IDLE_PERIODS` idle ones, 2, 4, then 8 periods, and
    /// never sooner than the CPU bound ([`cpu_bound`](Self::cpu_bound)).
    fn next(self) -> Duration {
        let Some(n) = self.idle.checked_sub(IDLE_PERIODS) else {
            return self.period;
        };
        let stretched = self.period * (1u32 << (n + 1).min(3));
        stretched.max(self.cpu_bound())
    }

    /// The part of [`next`](Self::next) that bounds an idle engine's CPU: one period while
    /// busy, else at least `share_inv` times what the last period `spent` (up to
    /// `MAX_IDLE_SLEEP`). The rest of an idle stretch is cut short when the program writes (see
    /// [`written_meanwhile`]).
    fn cpu_bound(self) -> Duration {
        if self.idle < IDLE_PERIODS {
            return self.period;
        }
        let sleep = self.spent.saturating_mul(self.share_inv);
        self.period.max(sleep.min(MAX_IDLE_SLEEP))
    }
}

/// How many times the CPU of its last period an idle engine watching `registered_bytes` sleeps:
/// `IDLE_CPU_SHARE_INV` (1% of a core) from a GiB up, in proportion below, down to 1/64 GiB. So
/// an idle engine costs at most 1% of a core per GiB it watches, and many small processes, each
/// with an engine of its own, cost no more when idle than one large one.
fn idle_share_inv(registered_bytes: u64) -> u32 {
    const GIB: u64 = 1 << 30;
    let inv = u64::from(IDLE_CPU_SHARE_INV) * GIB / registered_bytes.clamp(GIB / 64, GIB);
    u32::try_from(inv).unwrap_or(u32::MAX)
}

/// Minor faults since the last period that end an idle stretch: as many as the pages a busy
/// period changes (1/1024 of those registered; a write to a watched page faults once), 16 at
/// least.
fn wake_threshold(registered_pages: usize) -> u64 {
    (registered_pages as u64 / 1024).max(16)
}

/// Whether the program wrote enough since the last period (`faults` minor faults counted then,
/// `now` counted now) to end an idle stretch. Other faults count too: at worst the stretch ends
/// early, and `cpu_pace` still bounds the engine's CPU.
fn written_meanwhile(faults: u64, now: u64, threshold: u64) -> bool {
    now.saturating_sub(faults) >= threshold
}

/// What one period works with.
struct PeriodCtx<'a> {
    sh: &'a Shared,
    config: &'a Arc<Config>,
    pool: &'a Pool,
    committer: &'a SyncSender<ToCommitter>,
}

/// Runs a period under the period lock, then reports the counters to the daemon, if any. Returns
/// whether the period was busy: it changed at least 1/1024 of the registered pages (merges,
/// copy-on-write breaks and zero pages released or touched again), the program wrote at least
/// 1/64 of them (memory being filled or freed: what it becomes is worth a look next period; a
/// settled guest rewriting a few hundred pages is not busy), or it failed.
fn locked_period(cx: &PeriodCtx<'_>, kicked: bool) -> bool {
    let sh = cx.sh;
    let _period = lock(&sh.period_lock);
    apply_changes(sh, &mut lock(&sh.state));
    // Merges, copy-on-write breaks and zero pages released so far.
    let activity = || {
        let c = &sh.counters;
        let changes = c.merges.load(Ordering::Relaxed) + c.cow_breaks.load(Ordering::Relaxed);
        (changes, lock(&sh.state).zero)
    };
    let (changes0, zero0) = activity();
    let busy = match run_period(cx, kicked) {
        Ok(()) => {
            let (changes, zero) = activity();
            let done = changes - changes0 + zero.abs_diff(zero0);
            let st = lock(&sh.state);
            let pages = st.registered_pages() as u64;
            is_busy(done, st.written, pages)
        }
        Err(e) => {
            tracing::warn!(error = %e, "merge period failed; memory is unchanged");
            true
        }
    };
    let st = lock(&sh.state);
    if st.store.remote.is_some() {
        let json = serde_json::to_string(&stats_of(sh, &st)).unwrap_or_default();
        if let Some(r) = &st.store.remote {
            r.report(json);
        }
    }
    busy
}

/// Whether a period that changed `done` pages (merges, copy-on-write breaks, zero pages) and saw
/// `written` pages written, of `pages` registered, was busy (see [`locked_period`]).
fn is_busy(done: u64, written: u64, pages: u64) -> bool {
    (done > 0 && done * 1024 >= pages) || (written > 0 && written * 64 >= pages)
}

/// When the period that began at `t0` ends (see [`sleep_out_period`]).
struct PeriodEnd {
    t0: Instant,
    period: Duration,
    /// The CPU the period took.
    spent: Duration,
    /// The latest time to wake whatever the pace: the next try to join the daemon, when the
    /// engine has lost it (see `Rejoin::wake_at`).
    wake_at: Option<Instant>,
    /// The engine's live link to a daemon, if any: a daemon that dies while the engine idles is
    /// noticed within `DAEMON_CHECK`.
    link: Option<Arc<Remote>>,
}

/// Sleeps out the period that began at `t0` unless kicked or stopped: one `period`, stretched
/// after idle periods (see [`Pace`]; the period `spent` that much CPU), or until the deadline
/// registrations set (see `Shared::not_before`), or `wake_at`. Returns whether it was kicked.
fn sleep_out_period(sh: &Shared, end: PeriodEnd, idle: &mut u32) -> bool {
    let PeriodEnd {
        t0,
        period,
        spent,
        wake_at,
        link: daemon,
    } = end;
    let pages = sh.registered_pages();
    let share_inv = idle_share_inv(pages as u64 * PAGE as u64);
    let pace = |idle: u32| Pace {
        period,
        idle,
        spent,
        share_inv,
    };
    // Past the CPU bound, an idle stretch checks every period whether the program wrote.
    let earliest = t0 + pace(*idle).cpu_bound();
    let faults = sys::minor_faults().unwrap_or(0);
    let threshold = wake_threshold(pages);
    // A daemon that dies while the engine idles is noticed within `DAEMON_CHECK`, and joined
    // again once it is back (see `PeriodEnd::wake_at`), however long the idle sleep.
    let (m, cv) = &sh.kick;
    let mut k = lock(m);
    while !*k && !sh.stop.load(Ordering::SeqCst) {
        // Deferred to a period after the latest registration (see `not_before`). The bound
        // is counted from the first registration, not from the last scan: counted from the
        // scan (one period at most), a burst of registrations that began late in a period,
        // or after idle periods, was scanned in its middle, so its regions came up as
        // candidates in different periods, the later ones behind the others' merge work.
        // Writes do not cut a deferral short either: registering faults in the engine's own
        // state, and a program filling other memory between two registrations of a burst
        // would start the scan in its middle just the same.
        let (deadline, deferred) = match *lock(&sh.not_before) {
            Some((t, cap)) => {
                *idle = 0;
                (t.min(cap), true)
            }
            None => (t0 + pace(*idle).next(), false),
        };
        let deadline = wake_at.map_or(deadline, |w| deadline.min(w));
        let now = Instant::now();
        if now >= deadline {
            break;
        }
        if !deferred
            && now >= earliest
            && written_meanwhile(faults, sys::minor_faults().unwrap_or(0), threshold)
        {
            *idle = 0;
            break;
        }
        let next = if now >= earliest {
            deadline.min(now + period)
        } else {
            deadline.min(earliest)
        };
        let next = if daemon.is_some() {
            next.min(now + DAEMON_CHECK)
        } else {
            next
        };
        k = cv
            .wait_timeout(k, next - now)
            .unwrap_or_else(|e| e.into_inner())
            .0;
        if daemon.as_ref().is_some_and(|r| r.peer_closed()) {
            break;
        }
    }
    let kicked = *k;
    *k = false;
    if kicked {
        *idle = 0;
    }
    // A registration after the deadline keeps its own for the next period.
    let mut nb = lock(&sh.not_before);
    if nb.is_some_and(|(t, cap)| t.min(cap) <= Instant::now()) {
        *nb = None;
    }
    kicked
}

/// The committer thread: commits batches in the order the classifier sends them, while the
/// classifier works on the next one.
pub(crate) fn commit_loop(sh: &Shared, batches: Receiver<ToCommitter>) {
    let mut background = sys::Background::start();
    sh.count_cpu_of_this_thread();
    while let Ok(msg) = batches.recv() {
        background.check();
        match msg {
            ToCommitter::Batch {
                batch,
                config,
                budget,
            } => {
                let t0 = Instant::now();
                // A panic in a commit (a bug) loses that batch's merges, not the committer: the
                // frozen run's guard has let its writers go while unwinding.
                let committed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    commit(sh, &config, &batch, budget)
                }));
                if committed.is_err() {
                    tracing::error!("a commit panicked; its batch is not merged");
                }
                let mut st = lock(&sh.state);
                for id in batch.new_copies {
                    st.store.free_unmapped(id);
                }
                drop(st);
                tracing::debug!(
                    pid = std::process::id(),
                    candidates = batch.cands.len(),
                    commit_ms = t0.elapsed().as_secs_f64() * 1e3,
                    "commit"
                );
            }
            ToCommitter::Flush(done) => {
                let _ = done.send(());
            }
        }
    }
}

/// What the watch found for one period.
struct Watched {
    candidates: Vec<Candidate>,
    /// Pages to read for zeros (see `release_zero_probes`).
    zero_probes: Vec<Candidate>,
    view: StoreView,
    /// Whether pages wait in the first-sighting map.
    waiting: bool,
    tickets: Tickets,
    /// Whether waiting pages are asked about again this period (see `relook_due`).
    relook_now: bool,
    /// Huge pages to collapse again after the merges (see the `huge` module).
    collapsible: Vec<usize>,
}

/// PPR tickets claimed this period: their pages as candidates, in address order, and the
/// tickets' slots.
#[derive(Default)]
struct Tickets {
    cands: Vec<Candidate>,
    slots: Vec<u32>,
}

/// What handing a period's batches to the committer came to.
struct HandedOver {
    /// Every batch was handed over (the committer is there).
    all: bool,
    /// Some batch had candidates.
    worked: bool,
}

/// One period: watch, classify in batches while the committer commits them, then tidy up.
fn run_period(cx: &PeriodCtx<'_>, kicked: bool) -> io::Result<()> {
    let sh = cx.sh;
    let t_watch = Instant::now();
    let limit = sys::max_map_count().unwrap_or(65530);
    sh.counters.vma_limit.store(limit as u64, Ordering::Relaxed);
    let period = *lock(&sh.periods);
    let recycler = lock(&sh.recycler).clone();
    let Watched {
        mut candidates,
        zero_probes,
        view,
        waiting,
        tickets,
        relook_now,
        collapsible,
    } = observe(cx, kicked, period, recycler.as_deref())?;
    // Read-ahead still running is waited for when there is something to classify: it is that
    // same work, started earlier.
    let wait = !candidates.is_empty();
    use_read_ahead(sh, &mut candidates, wait);
    // Without the state lock (read through the kernel); after the read-ahead results, which
    // apply to candidates in address order.
    release_zero_probes(&mut candidates, &zero_probes);
    tracing::debug!(
        pid = std::process::id(),
        watch_ms = t_watch.elapsed().as_secs_f64() * 1e3,
        candidates = candidates.len(),
        "watch"
    );
    // In batches: memory freed by one batch's merges is reused for the next batch's stable
    // copies, savings show up progressively, and first sightings pair up across batches through
    // the first-sighting map. The committer commits a batch while the next one is classified.
    // With a daemon, an empty batch still collects the copies other processes made for pages
    // waiting here.
    let many = candidates.len() >= BATCH;
    let batches = order(cx, candidates, &view, many);
    let collect_only = (batches.is_empty() && view.remote.is_some() && waiting).then(Vec::new);
    let relook = (view.remote.is_some() && waiting && relook_now).then(|| Relook {
        skip: (period / RELOOK_PERIODS) as usize * crate::proto::MAX_ITEMS,
        take: crate::proto::MAX_ITEMS,
    });
    let budget = limit.saturating_sub(cx.config.vma_margin);
    let recycling = hand_over_tickets(cx, &tickets, budget);
    let handed = classify_batches(cx, &view, batches.chain(collect_only), relook, budget);
    if handed.all || recycling {
        let (done, wait) = std::sync::mpsc::sync_channel(1);
        if cx.committer.send(ToCommitter::Flush(done)).is_ok() {
            let _ = wait.recv();
        }
    }
    if let (Some(pool), true) = (&recycler, recycling) {
        finish_tickets(sh, pool, &tickets);
    }
    // After the merges: a huge page holding a page merged this period is not collapsed.
    crate::huge::collapse(sh, &collapsible, cx.config.merge_period);
    crate::ksm::hand_over_wanted(sh);
    crate::stranded::repair(sh);
    tidy_up(sh, many, handed.worked, period);
    Ok(())
}

/// The watch, under the state lock: this period's candidates (less the pages marked free, which
/// are released instead), the PPR tickets, a fresh VMA count when due, and what classification
/// needs of the store.
/// VMAs of room under the budget that make pages parked on it candidates again.
const UNPARK_ROOM: usize = 64;

/// Pages parked on the VMA budget (see `PageKind::Parked`) become candidates again at this watch
/// once the budget has room: the limit was raised, or mappings went away.
fn unpark_if_room(cx: &PeriodCtx<'_>, st: &mut State) {
    if st.parked == 0 {
        return;
    }
    // Relaxed: read each period by this thread (written above in `run_period`).
    let limit = cx.sh.counters.vma_limit.load(Ordering::Relaxed) as usize;
    let budget = limit.saturating_sub(cx.config.vma_margin);
    // Room for single pages again (half the engine's room left: see
    // `commit::pages_per_vma_wanted`): parked pages are mostly such, and room a page cannot have
    // would bring them back every period.
    let half_room = crate::commit::engine_room(budget, st.base_vmas) / 2;
    if st.vmas + UNPARK_ROOM + half_room > budget {
        return;
    }
    for r in st.regions.values_mut() {
        for p in r.pages.iter_mut().filter(|p| p.kind == PageKind::Parked) {
            p.kind = PageKind::Anon;
            p.unchanged = cx.config.merge_periods;
        }
    }
    st.parked = 0;
}

fn observe(
    cx: &PeriodCtx<'_>,
    kicked: bool,
    period: u64,
    recycler: Option<&pageone_recycler::Pool>,
) -> io::Result<Watched> {
    let mut st = lock(&cx.sh.state);
    unpark_if_room(cx, &mut st);
    crate::refusals::retry_if_due(&mut st, period, cx.config.merge_periods);
    let Watch {
        mut candidates,
        mut zero_probes,
        collapsible,
    } = watch(cx.sh, &mut st, cx.config, PeriodClock { kicked, period })?;
    // Pages marked free (PPR) are released this period: they skip the unchanged wait.
    let tickets = match recycler {
        Some(pool) => claim_marked(&st, pool),
        None => Tickets::default(),
    };
    if !tickets.cands.is_empty() {
        let taken: HashSet<usize> = tickets.cands.iter().map(|c| c.addr()).collect();
        candidates.retain(|c| !taken.contains(&c.addr()));
        zero_probes.retain(|c| !taken.contains(&c.addr()));
    }
    // Counting VMAs reads all of /proc/self/maps: megabytes of text with tens of thousands
    // of merged runs, which made the count most of an idle QEMU's engine CPU. So the count
    // is re-read every period only while it is small; otherwise every 16th period (the
    // margin covers what the program maps meanwhile; merges add their worst case to the
    // estimate), and by the commit when the estimate reaches the budget (`VmaBudget`).
    if st.vmas < SMALL_VMA_COUNT || period % VMA_RECOUNT_PERIODS == 0 {
        st.vmas = sys::map_count()?;
    }
    let view = StoreView {
        tree: st.store.local_index(),
        base: st.store.addr(0),
        fd: st.store.fd(),
        remote: st.store.remote.clone(),
    };
    let offered = std::mem::take(&mut st.offered);
    let relook_now = relook_due(period, offered, &mut st.relooks_skipped);
    Ok(Watched {
        candidates,
        zero_probes,
        view,
        waiting: !st.unstable.is_empty(),
        tickets,
        relook_now,
        collapsible,
    })
}

/// Orders the candidates into batches by content (see `batches_by_content`), of the length that
/// suits working alone or with a daemon.
fn order(
    cx: &PeriodCtx<'_>,
    candidates: Vec<Candidate>,
    view: &StoreView,
    many: bool,
) -> ContentBatches {
    let t_order = Instant::now();
    let batch = if view.remote.is_some() {
        REMOTE_BATCH
    } else {
        BATCH
    };
    let batches = batches_by_content(candidates, cx.pool, batch);
    tracing::debug!(order_ms = t_order.elapsed().as_secs_f64() * 1e3, "order");
    if many && view.remote.is_none() {
        // Contents seen once this period become first sightings (unless a stable copy has them):
        // room for them at once, instead of rehashing a map of up to hundreds of thousands of
        // entries into fresh memory doubling after doubling. (With a daemon, most are another
        // process's: each batch makes room for what the daemon left to it, see `classify`.)
        let singles = batches.singles();
        lock(&cx.sh.state).unstable.reserve(singles);
    }
    batches
}

/// Hands the pages of PPR tickets to the committer as a batch of their own: each is released if
/// its frozen bytes still hold its mark. Returns whether there were any.
fn hand_over_tickets(cx: &PeriodCtx<'_>, tickets: &Tickets, budget: usize) -> bool {
    if tickets.cands.is_empty() {
        return false;
    }
    lock(&cx.sh.recycled_slots).clear();
    let actions = tickets
        .slots
        .iter()
        .map(|&s| Some(Action::Recycle(s)))
        .collect();
    let batch = Classified {
        cands: tickets.cands.clone(),
        actions,
        new_copies: Vec::new(),
        made_here: Vec::new(),
    };
    // A send fails only when the committer is gone; then nothing is released, and the
    // tickets are ended all the same.
    let _ = cx.committer.send(ToCommitter::Batch {
        batch,
        config: cx.config.clone(),
        budget,
    });
    true
}

/// Classifies the batches one after the other, handing each to the committer, which commits it
/// while the next one is classified. Stops when the engine stops, or when the committer is gone
/// (giving the batch's copies back).
fn classify_batches(
    cx: &PeriodCtx<'_>,
    view: &StoreView,
    batches: impl Iterator<Item = Vec<Candidate>>,
    mut relook: Option<Relook>,
    budget: usize,
) -> HandedOver {
    let sh = cx.sh;
    let mut handed = HandedOver {
        all: true,
        worked: false,
    };
    for batch in batches {
        let Some(batch) = without_regions_for_ksm(sh, batch) else {
            continue;
        };
        let t0 = Instant::now();
        let classified = classify(sh, view, cx.config, batch, cx.pool, relook.take());
        handed.worked |= !classified.cands.is_empty();
        tracing::debug!(
            pid = std::process::id(),
            candidates = classified.cands.len(),
            classify_ms = t0.elapsed().as_secs_f64() * 1e3,
            "classify"
        );
        let msg = ToCommitter::Batch {
            batch: classified,
            config: cx.config.clone(),
            budget,
        };
        if let Err(SendError(ToCommitter::Batch { batch, .. })) = cx.committer.send(msg) {
            // Only a bug ends the committer early: give this batch's copies back, merge nothing.
            tracing::error!("the committer is gone; nothing more is merged");
            let mut st = lock(&sh.state);
            for id in batch.new_copies {
                st.store.free_unmapped(id);
            }
            handed.all = false;
            break;
        }
        if sh.stop.load(Ordering::Relaxed) {
            break;
        }
    }
    handed
}

/// `batch` less the candidates of regions (or chunks) an earlier batch's commit marked for the
/// kernel's KSM (see the `ksm` module): they are handed over at the end of this period, and
/// classifying the rest of such a region, the whole of it in the first period, would only delay
/// that. A page left whose content (read ahead) is one of theirs counts for its chunk as a page
/// whose duplicate went to KSM, and a chunk with enough of those goes too, left out from this
/// batch on (see `ksm::twins_went_to_ksm`). `None` if that leaves nothing of a batch that had
/// candidates (an empty batch still collects the copies other processes made).
fn without_regions_for_ksm(sh: &Shared, mut batch: Vec<Candidate>) -> Option<Vec<Candidate>> {
    if batch.is_empty() {
        return Some(batch);
    }
    let mut st = lock(&sh.state);
    let for_ksm = |st: &State, c: &Candidate| {
        st.regions
            .get(&c.region)
            .is_some_and(|r| r.wants_ksm_at(c.index()))
    };
    if !batch.iter().any(|c| for_ksm(&st, c)) {
        return Some(batch);
    }
    let (out, kept): (Vec<Candidate>, Vec<Candidate>) =
        batch.drain(..).partition(|c| for_ksm(&st, c));
    let theirs: HashSet<[u64; 2]> = out.iter().filter_map(hash_read_ahead).collect();
    for c in kept
        .iter()
        .filter(|c| hash_read_ahead(c).is_some_and(|h| theirs.contains(&h)))
    {
        // (Not a page of a region that shrank since the watch.)
        let region = st.regions.get_mut(&c.region);
        if let Some(r) = region.filter(|r| c.index() < r.pages.len()) {
            let chunk = r.chunk_mut(c.index());
            chunk.twins_to_ksm += 1;
            chunk.wants_ksm |= crate::ksm::twins_went_to_ksm(chunk);
        }
    }
    batch.extend(kept.into_iter().filter(|c| !for_ksm(&st, c)));
    drop(st);
    (!batch.is_empty()).then_some(batch)
}

/// The hash of a candidate's contents, where it was read ahead.
fn hash_read_ahead(c: &Candidate) -> Option<[u64; 2]> {
    match c.pre() {
        Pre::Hash(h) => Some(h),
        _ => None,
    }
}

/// Ends every ticket of this period, released or not, so no slot stays claimed.
fn finish_tickets(sh: &Shared, pool: &pageone_recycler::Pool, tickets: &Tickets) {
    let released: HashSet<u32> = std::mem::take(&mut *lock(&sh.recycled_slots))
        .into_iter()
        .collect();
    for (c, &slot) in tickets.cands.iter().zip(&tickets.slots) {
        let ticket = pageone_recycler::Ticket {
            slot,
            addr: c.addr(),
        };
        pool.finish(ticket, released.contains(&slot));
    }
}

/// The period's housekeeping: stale first sightings are swept, the store reclaims, and the C
/// heap's free memory is returned when due.
fn tidy_up(sh: &Shared, many: bool, worked: bool, period: u64) {
    // The mappings are read outside the state lock: registrations and stats() do not wait.
    let due = lock(&sh.state).store.held_check();
    let held = due.map(|held| {
        let before = lock(&sh.changes).store_moves();
        let mappings = sys::self_mappings();
        HeldCheck {
            held,
            mappings,
            moves: before..lock(&sh.changes).store_moves(),
        }
    });
    let trim = {
        let mut st = lock(&sh.state);
        sweep_first_sightings(&mut st);
        st.store.reclaim(held);
        // (Cut tables go back to the kernel with the heap's free memory, below.)
        st.heap_dirty |= !worked && st.store.shrink_unused_tables();
        // A period with many candidates made large short-lived allocations (candidates,
        // batches, read-ahead results, offers): their memory goes back at once, it counts
        // against the saving. Smaller ones go back every few periods of work, or at the first
        // idle period after some.
        st.heap_dirty |= worked;
        let trim = many || (st.heap_dirty && (!worked || period % TRIM_PERIODS == 0));
        st.heap_dirty &= !trim;
        trim
    };
    fetch_offers_for_forgotten(sh);
    if trim && lock(&sh.config).trim_c_heap {
        sys::release_free_heap();
    }
}

/// Fetches the offers that may wait at the daemon for content this process forgot (see
/// `Remote::offers_may_wait`) with a lookup of nothing, outside the state lock: the slots of
/// content no longer waiting here go back at once, the others wait for the next batch
/// (`State::offers_aside`). Without it an engine whose memory went to the kernel's KSM, or that
/// stopped classifying, kept those copies allocated in the store.
fn fetch_offers_for_forgotten(sh: &Shared) {
    let Some(remote) = live_link(sh).filter(|r| r.offers_may_wait()) else {
        return;
    };
    let Some((_, offers)) = remote.lookup(&[]) else {
        return;
    };
    let mut st = lock(&sh.state);
    let same = st
        .store
        .remote
        .as_ref()
        .is_some_and(|r| Arc::ptr_eq(r, &remote));
    if !same {
        // (Another daemon's store since: these slots are held there, not here.)
        return;
    }
    for (h, slot) in offers {
        if st.unstable.contains(h) {
            st.offers_aside.push((h, slot));
        } else if st.store.adopt(slot) == Some(true) {
            st.store.unadopt(slot);
        }
    }
    if let Some(r) = &st.store.remote {
        r.flush();
    }
}

/// Whether waiting pages are asked about again this period (see RELOOK_PERIODS): every
/// RELOOK_PERIODS periods, but not while other processes' copies for them keep coming (`offered`
/// in the last period). Those offers do that work already, and a relook would repeat up to a
/// request's worth of lookups (in the cross-process benchmark's merging, an eighth of all of
/// them). At most RELOOK_SKIPS in a row are skipped; `skipped` counts them.
fn relook_due(period: u64, offered: bool, skipped: &mut u32) -> bool {
    if period % RELOOK_PERIODS != 0 {
        return false;
    }
    if offered && *skipped < RELOOK_SKIPS {
        *skipped += 1;
        return false;
    }
    *skipped = 0;
    true
}

/// Takes the tickets of pages marked free in `pool` that the engine may release: ANON or UNIQUE
/// pages of registered regions (merged and COW-broken pages live in store mappings, which a
/// freeze cannot move). Returns them as candidates in address order with their tickets' slots.
/// The words are read through the kernel (a page unmapped meanwhile is no ticket); no run is
/// frozen then (the period's commits start after this), so a read never waits for the committer.
fn claim_marked(st: &State, pool: &pageone_recycler::Pool) -> Tickets {
    let recyclable = |addr: usize| {
        addr % PAGE == 0
            && page_at(&st.regions, addr)
                .is_some_and(|(_, _, p)| matches!(p.kind, PageKind::Anon | PageKind::Unique))
    };
    let tickets = pool.claim_batched(MAX_TICKETS, |addrs, marks| {
        let (wanted, at): (Vec<usize>, Vec<usize>) = addrs
            .iter()
            .enumerate()
            .filter(|&(_, &a)| recyclable(a))
            .map(|(k, &a)| (a, k))
            .unzip();
        // The program may write them meanwhile: the commit checks again on frozen bytes.
        let mut words = vec![None; wanted.len()];
        read_words_each::<3>(&wanted, &mut words);
        for (k, w) in at.into_iter().zip(words) {
            marks[k] = w;
        }
    });
    let mut out: Vec<(Candidate, u32)> = tickets
        .iter()
        .filter_map(|t| {
            let (region, _, _) = page_at(&st.regions, t.addr)?;
            let c = Candidate::new(region, t.addr, Pre::None);
            Some((c, t.slot))
        })
        .collect();
    out.sort_unstable_by_key(|(c, _)| c.addr());
    let (cands, slots) = out.into_iter().unzip();
    Tickets { cands, slots }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn pace(period: Duration, idle: u32, spent: Duration) -> Pace {
        Pace {
            period,
            idle,
            spent,
            share_inv: IDLE_CPU_SHARE_INV,
        }
    }

    /// Busy: one period. Idle: stretched 2, 4, 8 periods, and never sooner than 100 times the
    /// CPU of the last period, up to the cap.
    #[test]
    fn an_idle_engine_sleeps_in_proportion_to_what_a_period_costs() {
        let p = Duration::from_millis(50);
        let ms = Duration::from_millis;
        assert_eq!(pace(p, 0, ms(400)).next(), p, "busy periods keep the pace");
        assert_eq!(pace(p, IDLE_PERIODS - 1, ms(400)).next(), p);
        assert_eq!(pace(p, IDLE_PERIODS, ms(0)).next(), 2 * p);
        assert_eq!(pace(p, IDLE_PERIODS + 1, ms(1)).next(), 4 * p);
        assert_eq!(pace(p, IDLE_PERIODS + 9, ms(1)).next(), 8 * p);
        assert_eq!(pace(p, IDLE_PERIODS + 9, ms(100)).next(), ms(10_000));
        assert_eq!(pace(p, IDLE_PERIODS + 9, ms(5_000)).next(), MAX_IDLE_SLEEP);
        for spent_ms in [0, 1, 3, 10, 50, 299] {
            let spent = ms(spent_ms);
            let sleep = pace(p, IDLE_PERIODS + 2, spent).next();
            assert!(
                sleep >= spent * IDLE_CPU_SHARE_INV,
                "{spent_ms} ms: {sleep:?}"
            );
        }
    }

    /// 1% of a core from a GiB up; below, 1% per GiB, down to 1/64 GiB.
    #[test]
    fn an_idle_engine_costs_at_most_one_percent_of_a_core_per_gib() {
        let gib = 1u64 << 30;
        assert_eq!(idle_share_inv(64 * gib), 100);
        assert_eq!(idle_share_inv(gib), 100);
        assert_eq!(idle_share_inv(gib / 2), 200);
        assert_eq!(idle_share_inv(gib / 64), 6400);
        assert_eq!(idle_share_inv(4096), 6400);
        assert_eq!(idle_share_inv(0), 6400);
        let p = Duration::from_millis(200);
        let half_gib = Pace {
            share_inv: idle_share_inv(gib / 2),
            ..pace(p, IDLE_PERIODS + 9, Duration::from_millis(18))
        };
        assert_eq!(half_gib.next(), Duration::from_millis(3600));
    }

    /// Busy: changes of 1/1024 of the pages, or writes to 1/64 of them.
    #[test]
    fn a_period_is_busy_when_it_changed_or_saw_written_enough() {
        let pages = 65536;
        assert!(!is_busy(0, 0, pages));
        assert!(!is_busy(63, 1023, pages), "a settled guest's few rewrites");
        assert!(is_busy(64, 0, pages));
        assert!(is_busy(0, 1024, pages), "memory being filled or freed");
        assert!(!is_busy(0, 0, 0));
    }

    /// An idle stretch ends early on writes only past the CPU bound, and only on as many faults
    /// as a busy period's changes.
    #[test]
    fn writes_end_an_idle_stretch_past_the_cpu_bound() {
        let p = Duration::from_millis(50);
        let ms = Duration::from_millis;
        assert_eq!(pace(p, 0, ms(400)).cpu_bound(), p, "busy: one period");
        assert_eq!(pace(p, IDLE_PERIODS, ms(1)).cpu_bound(), ms(100));
        assert_eq!(pace(p, IDLE_PERIODS, ms(0)).cpu_bound(), p);
        for idle in [IDLE_PERIODS, IDLE_PERIODS + 5] {
            for spent_ms in [0, 1, 3, 10, 50, 299] {
                let spent = ms(spent_ms);
                assert!(pace(p, idle, spent).cpu_bound() <= pace(p, idle, spent).next());
            }
        }
        assert_eq!(wake_threshold(0), 16);
        assert_eq!(wake_threshold(1 << 20), 1024);
        assert!(!written_meanwhile(100, 115, 16));
        assert!(written_meanwhile(100, 116, 16));
        assert!(
            !written_meanwhile(100, 90, 16),
            "a counter read earlier never wakes"
        );
    }

    proptest! {
        /// Relooks come only every RELOOK_PERIODS periods, always when no offers came, and are
        /// never put off more than RELOOK_SKIPS times in a row, however offers come.
        #[test]
        fn relooks_are_put_off_a_bounded_number_of_times(
            offered in proptest::collection::vec(any::<bool>(), 0..400),
        ) {
            let mut skipped = 0;
            let mut put_off = 0;
            for (period, &offered) in offered.iter().enumerate() {
                let period = period as u64;
                let due = relook_due(period, offered, &mut skipped);
                if period % RELOOK_PERIODS != 0 {
                    prop_assert!(!due);
                    continue;
                }
                prop_assert!(due || offered);
                put_off = if due { 0 } else { put_off + 1 };
                prop_assert!(put_off <= RELOOK_SKIPS);
            }
        }
    }
}
