//! The commit: runs of candidates are frozen, compared byte for byte with their stable copies (or
//! checked for zero), and replaced by one `mmap(MAP_PRIVATE | MAP_FIXED)` of the copies per subrun
//! (or released); pages that differ are put back, then blocked writers are woken. So a write is
//! never lost and pages that differ are never merged, whatever the hash or the index said.
//!
//! One committer thread commits the batches in order (remaps of one address space serialise on
//! `mmap_lock` anyway) while the engine thread classifies the next. The state lock is held for one
//! run at a time (at most `MAX_RUN` pages), so the classifier can record its next batch between
//! runs.

use std::collections::HashSet;
use std::ops::Range;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use pageone_index::KeyId;
use pageone_sync::lock;
use pageone_sys as sys;

use crate::access::{equals_copy, is_zero, PageReader, PAGE};
use crate::advice::Advice;
use crate::candidates::{Action, Candidate};
use crate::changes::{Change, Fate};
use crate::classify::Classified;
use crate::colocate::Colocated;
use crate::config::{Config, WatchMode};
use crate::freeze::{
    Freezer, FrozenRun, NormalPriority, ProtectedRun, Rearm, RestoreReport, Scratch, MAX_RUN,
};
use crate::layout::holding_still;
use crate::staging::{map_copies_registered, Copies};
use crate::state::{Page, PageKind, RegionState, Shared, State};
use crate::store::{Store, StoreFile};

/// What a read fault on a file mapping maps at once, aligned, of the pages in the page cache
/// (Linux's default `fault_around_bytes`).
const FAULT_AROUND_BYTES: usize = 64 << 10;

/// What the runs of one batch's commit share.
struct CommitCtx<'a> {
    sh: &'a Shared,
    config: &'a Config,
    budget: VmaBudget,
    /// The PPR pool whose marks recycled pages must still hold.
    recycler: Option<Arc<pageone_recycler::Pool>>,
    /// Seconds spent freezing, verifying and replacing, for the log.
    times: [f64; 3],
    /// Reads COW-broken pages to compare them.
    reader: PageReader,
    /// The scratch area's slots for the runs' frozen pages (discarded when the commit ends).
    scratch: Scratch<'a>,
    /// The normal scheduling class, from the first run held still to the end of the commit (see
    /// `NormalPriority`): two system calls per batch instead of per run, which with scattered
    /// pages is often a single page.
    priority: Option<NormalPriority>,
    /// The committer and the fault thread on one CPU, from the first run held still to the end of
    /// the commit (see the `colocate` module); dropped after `scratch`, whose discard is reported.
    colocated: Option<Colocated>,
    /// Whether the kernel's KSM runs, asked once per batch when needed.
    ksm_running: Option<bool>,
    /// Copies this batch made of its own pages that no page took yet (see
    /// `Classified::made_here`).
    untaken: HashSet<KeyId>,
}

impl CommitCtx<'_> {
    /// Whether memory may be handed to the kernel's KSM: asked for, and KSM runs (see the `ksm`
    /// module). (Only where memory handed over can stay registered for the kernel's reports of
    /// unmapping and moving without faults: the write-protect watch.)
    fn ksm_may_take(&mut self) -> bool {
        self.config.ksm_when_limited
            && self.sh.mode == WatchMode::UffdWp
            && *self.ksm_running.get_or_insert_with(crate::ksm::running)
    }

    /// Marks `region` for the kernel's KSM, whole, if the kernel refuses to freeze its pages.
    fn judge_region_for_ksm(&mut self, region: &mut RegionState) {
        if !region.wants_ksm && crate::ksm::refuses_pageone(region) && self.ksm_may_take() {
            region.wants_ksm = true;
        }
    }

    /// Adds the merge of the `m` pages from page `at` of `region` onto copies `sid..sid + m`,
    /// costing `cost` mappings, to its chunk's spending, unless each page takes the copy made of
    /// it (the first in address order to take a copy this batch made of its own pages): the
    /// copies lie as this process laid them out, side by side, so those merges are runs wherever
    /// the duplicates lie elsewhere, and say nothing of that. A merge the budget refused
    /// (`merging` false) counts all the same. Returns whether it counted.
    fn charge_chunk(
        &mut self,
        region: &mut RegionState,
        (at, sid, m): (usize, KeyId, usize),
        cost: usize,
        merging: bool,
    ) -> bool {
        let ids = (0..m as u32).map(|j| sid.wrapping_add(j));
        let makers = if merging {
            ids.filter(|id| self.untaken.remove(id)).count()
        } else {
            ids.filter(|id| self.untaken.contains(id)).count()
        };
        if makers == m {
            return false;
        }
        let chunk = &mut region.chunk_mut(at).spending;
        chunk.pages += m as u64;
        chunk.vmas += cost as u64;
        true
    }

    /// Marks the chunk of `region` holding page `index` for the kernel's KSM if its merges cost
    /// half a mapping per page or more (`refused`: the budget refused some, which judges
    /// sooner).
    fn judge_chunk_for_ksm(&mut self, region: &mut RegionState, index: usize, refused: bool) {
        let chunk = *region.chunk_mut(index);
        if !chunk.wants_ksm
            && crate::ksm::better_with_ksm(&chunk.spending, refused)
            && self.ksm_may_take()
        {
            region.chunk_mut(index).wants_ksm = true;
        }
    }

    /// Before the first run is held still: normal priority and the fault thread beside the
    /// committer, kept until the commit ends.
    fn hold_still_from_now(&mut self) {
        if self.priority.is_none() {
            self.priority = Some(NormalPriority::enter());
            self.colocated = Colocated::enter(self.sh);
        }
    }
}

/// The parts of the state a run's commit changes, borrowed from the holder of the state lock.
struct RunState<'s> {
    region: &'s mut RegionState,
    store: &'s mut Store,
    vmas: &'s mut usize,
    zero: &'s mut u64,
    refusals: &'s mut crate::refusals::Refusals,
}

impl<'s> RunState<'s> {
    /// The state of the region starting at `region`, if it is registered.
    fn of(st: &'s mut State, region: usize) -> Option<Self> {
        let State {
            regions,
            store,
            vmas,
            zero,
            refusals,
            ..
        } = st;
        Some(RunState {
            region: regions.get_mut(&region)?,
            store,
            vmas,
            zero,
            refusals,
        })
    }
}

/// A run of consecutive candidate pages of one region, with what to do with each.
struct Run {
    /// The region's start (its key in `State::regions`).
    region: usize,
    start: usize,
    first_index: usize,
    n: usize,
    /// Whether the pages live in store mappings (COW-broken, or on a replaced store): all or none.
    in_store: bool,
    acts: [Option<Action>; MAX_RUN],
}

/// Copies `sid..sid + m`, for the `m` pages of a region from page `index` on, whose mapping has
/// protection `prot` (`PROT_*`), which the copies' mapping keeps.
#[derive(Clone, Copy)]
struct Subrun {
    index: usize,
    sid: KeyId,
    m: usize,
    prot: libc::c_int,
    /// The dropped store ranges' mark when the pages were judged (see `ChangeLog::expect_merge`).
    since: u64,
}

/// Freezes, verifies and replaces runs of the batch's candidates, in address order; `budget` is
/// the most VMAs the process may have after a merge.
pub(crate) fn commit(sh: &Shared, config: &Config, batch: &Classified, budget: usize) {
    let (cands, actions) = (&batch.cands, &batch.actions);
    let mut todo: Vec<usize> = (0..cands.len()).filter(|&i| actions[i].is_some()).collect();
    if todo.is_empty() {
        return;
    }
    let (scratch, file, base_vmas) = {
        let st = lock(&sh.state);
        (st.scratch, st.store.file.clone(), st.base_vmas)
    };
    // (Before any run is frozen: it maps, registers and reads a setting.)
    if !config.stage_each_mapping {
        sh.staging.prepare(sh, &file);
    }
    let mut cx = CommitCtx {
        sh,
        config,
        budget: VmaBudget::new(budget, base_vmas),
        recycler: lock(&sh.recycler).clone(),
        times: [0.0; 3],
        reader: PageReader::new(),
        scratch: Scratch::new(scratch, &sh.changes),
        priority: None,
        colocated: None,
        ksm_running: None,
        untaken: untaken_copies(sh, config, batch),
    };
    todo.sort_unstable_by_key(|&i| cands[i].addr());
    let t_end = Instant::now();
    let mut i = 0;
    while i < todo.len() {
        i += commit_run(&mut cx, cands, actions, &todo[i..]);
    }
    tracing::debug!(
        move_ms = cx.times[0] * 1e3,
        verify_ms = cx.times[1] * 1e3,
        replace_ms = cx.times[2] * 1e3,
        total_ms = t_end.elapsed().as_secs_f64() * 1e3,
        "commit"
    );
    // The count after this commit (exact at the period's start, plus what merges added at most).
    sh.counters
        .vmas
        .store(lock(&sh.state).vmas as u64, Ordering::Relaxed);
}

/// The copies `batch` made of its own pages, which the chunks' judgement for the kernel's KSM
/// leaves out (see `CommitCtx::charge_chunk`); none where memory is never handed to KSM (not
/// asked for, or the checksum watch), where nothing reads them.
fn untaken_copies(sh: &Shared, config: &Config, batch: &Classified) -> HashSet<KeyId> {
    if config.ksm_when_limited && sh.mode == WatchMode::UffdWp {
        batch.made_here.iter().copied().collect()
    } else {
        HashSet::new()
    }
}

/// Commits the run of candidates `todo` starts with (candidate numbers in address order);
/// returns how many of them it took.
fn commit_run(
    cx: &mut CommitCtx<'_>,
    cands: &[Candidate],
    actions: &[Option<Action>],
    todo: &[usize],
) -> usize {
    let sh = cx.sh;
    // Before the state lock: the program's mapping changes take that one while covered.
    let _still = holding_still();
    let mut guard = lock(&sh.state);
    let Some(mut rs) = RunState::of(&mut guard, cands[todo[0]].region) else {
        return 1;
    };
    // The region may have shrunk since the watch (the program unmapped part of it).
    if cands[todo[0]].index() >= rs.region.pages.len() {
        return 1;
    }
    let run = next_run(rs.region, cands, actions, todo);
    if run.in_store {
        commit_broken(cx, &mut rs, &run);
        return run.n;
    }
    let Some(plan) = plan_run(cx, &mut rs, &run) else {
        return run.n;
    };
    let pagemap = guard.pagemap.clone();
    drop(guard);
    cx.hold_still_from_now();
    let freezer = Freezer {
        uffd: &sh.uffd,
        range: &sh.frozen,
        scratch: cx.scratch.take(run.n),
        locked: sh.locked_scratch.as_ref(),
        pagemap: &pagemap,
        changes: &sh.changes,
        parking: &sh.parking,
        rearm: sh.freeze_mode.map(|frozen| Rearm {
            frozen,
            watched: sh.reg_mode,
        }),
    };
    map_copies_before_freeze(&plan.acts[..run.n], &plan.holes, plan.store_base);
    let tf = Instant::now();
    let outcome = merge_frozen(cx, &run, &plan, freezer);
    cx.times[0] += tf.elapsed().as_secs_f64();
    outcome.log();
    if cx.config.populate_merged {
        map_merged_pages(sh, &run, &outcome);
    }
    let mut guard = lock(&sh.state);
    record_outcome(cx, &mut guard, &run, &plan, &outcome);
    run.n
}

/// The run `todo` starts with: candidates at consecutive addresses of one region, all in store
/// mappings or none, `MAX_RUN` at most.
fn next_run(
    region: &RegionState,
    cands: &[Candidate],
    actions: &[Option<Action>],
    todo: &[usize],
) -> Run {
    let first = &cands[todo[0]];
    let in_store = |t: usize| region.pages[cands[todo[t]].index()].kind.in_store_mapping();
    let run_in_store = in_store(0);
    let mut n = 1;
    while n < todo.len()
        && n < MAX_RUN
        && cands[todo[n]].region == first.region
        && cands[todo[n]].index() == first.index() + n
        && cands[todo[n]].index() < region.pages.len()
        && in_store(n) == run_in_store
    {
        n += 1;
    }
    let mut acts = [None; MAX_RUN];
    for (k, a) in acts.iter_mut().enumerate().take(n) {
        *a = actions[todo[k]];
    }
    Run {
        region: first.region,
        start: first.addr(),
        first_index: first.index(),
        n,
        in_store: run_in_store,
        acts,
    }
}

/// What a run may become, fixed before its freeze under the state lock, so that nothing between
/// the freeze and the wake takes a lock, allocates or logs (a program thread blocked on the run
/// may hold the allocator's lock or stderr's): every copy it may map is held by a reference
/// (none can be freed meanwhile), and the VMAs its mappings may cost are counted already.
struct Plan {
    /// Per page: release (`Zero`, `Recycle`), merge onto a copy held for it, or nothing.
    acts: [Option<Action>; MAX_RUN],
    /// The store's file and view.
    file: Arc<StoreFile>,
    store_base: usize,
    /// The copy the page left of the run maps, if merged: a subrun continuing it coalesces.
    left: Option<KeyId>,
    /// Where the run's first and last subruns meet mappings of the store already (see [`Sides`]).
    sides: Sides,
    /// VMAs counted for the run's mappings (their worst case).
    vmas: usize,
    /// The pages whose merge is onto a zero hole (see the `zero_holes` module): verified all
    /// zero, and given the zero page once their subrun is mapped.
    holes: HoleSet,
    /// The program's advice over the run, given to the copies mapped there (see `advice`).
    advice: Advice,
}

/// Which pages of a run merge onto zero holes.
#[derive(Clone, Copy, Default)]
struct HoleSet([u64; MAX_RUN / 64]);

impl HoleSet {
    fn insert(&mut self, k: usize) {
        self.0[k / 64] |= 1 << (k % 64);
    }

    fn contains(&self, k: usize) -> bool {
        self.0[k / 64] & (1 << (k % 64)) != 0
    }
}

/// Plans the run (see [`Plan`]): merges onto copies that are gone or full, or that the VMA budget
/// cannot afford, are dropped (and the pages back off); a reference is taken on every copy left.
/// `None` if nothing is left to do.
fn plan_run(cx: &mut CommitCtx<'_>, rs: &mut RunState<'_>, run: &Run) -> Option<Plan> {
    let mut acts = run.acts;
    for a in acts.iter_mut().take(run.n) {
        let Some(Action::Merge(sid)) = *a else {
            continue;
        };
        // Freed since classification named it (the tree can name a copy of an earlier batch that
        // merged nothing, freed after that batch's commit), or shared by as many pages as allowed.
        if !rs.store.is_allocated(sid) {
            *a = None;
        } else if rs.store.refs(sid) >= cx.config.max_sharing {
            rs.store.retire(sid);
            *a = None;
        }
    }
    let left = run
        .first_index
        .checked_sub(1)
        .map(|i| rs.region.pages[i])
        .filter(|p| p.kind == PageKind::Merged)
        .map(|p| p.sid);
    merge_zero_pages_onto_holes(&mut acts[..run.n], left, rs.store);
    let mut holes = HoleSet::default();
    for (k, a) in acts.iter().enumerate().take(run.n) {
        if let Some(Action::Merge(sid)) = *a {
            if rs.store.is_zero_hole(sid) {
                holes.insert(k);
            }
        }
    }
    release_lone_holes(&mut acts[..run.n], &holes, left);
    let sides = Sides::of(run, &rs.region.pages, left);
    let vmas = afford(cx, rs, run, &mut acts, &sides, &holes);
    // Pages released already (see `classify`'s zero gaps) are only ever merged onto holes.
    for (k, a) in acts.iter_mut().enumerate().take(run.n) {
        if *a == Some(Action::Zero) && rs.region.pages[run.first_index + k].kind == PageKind::Zero {
            *a = None;
        }
    }
    for a in acts.iter().take(run.n) {
        if let Some(Action::Merge(sid)) = *a {
            rs.store.add_ref(sid);
        }
    }
    if acts[..run.n].iter().all(Option::is_none) {
        return None;
    }
    Some(Plan {
        advice: crate::advice::over(run.start..run.start + run.n * PAGE),
        acts,
        file: rs.store.file.clone(),
        store_base: rs.store.addr(0),
        left,
        sides,
        vmas,
        holes,
    })
}

/// What lies beside a run, for the cost of its mappings ([`subrun_cost`]).
#[derive(Clone, Copy)]
struct Sides {
    /// The copy the page left of the run maps, if merged.
    left: Option<KeyId>,
    /// The pages left and right of the run are mappings of the store: a mapping ends there.
    left_in_store: bool,
    right_in_store: bool,
    /// The run's pages are mappings of the store themselves (COW-broken): their mappings are
    /// counted at their worst case.
    in_store: bool,
}

impl Sides {
    fn of(run: &Run, pages: &[Page], left: Option<KeyId>) -> Self {
        let in_store = |i: Option<usize>| {
            i.and_then(|i| pages.get(i))
                .is_some_and(|p| p.kind == PageKind::Merged || p.kind.in_store_mapping())
        };
        Sides {
            left,
            left_in_store: in_store(run.first_index.checked_sub(1)),
            right_in_store: in_store(Some(run.first_index + run.n)),
            in_store: run.in_store,
        }
    }
}

/// The VMAs the mapping of the subrun of `m` pages at `k` of a run of `n` adds, mapped in address
/// order after the run's subruns before it (`acts`: the run's merges): one for the mapping and one
/// for each side where it splits the anonymous mapping around it; a side where a mapping of the
/// store ends already (the page beside it is merged, in this run or before it) splits nothing.
/// A subrun continuing its left neighbour's copies extends that mapping (one at most). Pages
/// that live in store mappings themselves count two (one) whatever lies beside them.
fn subrun_cost(acts: &[Option<Action>], k: usize, m: usize, sid: KeyId, sides: &Sides) -> usize {
    let continues = k == 0 && sides.left.is_some_and(|l| l.wrapping_add(1) == sid);
    if continues {
        return 1;
    }
    if sides.in_store {
        return 2;
    }
    let left_ends = if k == 0 {
        sides.left_in_store
    } else {
        matches!(acts[k - 1], Some(Action::Merge(_)))
    };
    let right_ends = k + m == acts.len() && sides.right_in_store;
    2 - usize::from(left_ends) - usize::from(right_ends)
}

/// Zero pages between two merges whose copies lie around zero holes (see the `zero_holes`
/// module) merge onto those holes: the copies and the holes then map with one mapping of the
/// store. (Made for another batch's pages or this one's: the holes of a run of copies serve
/// every run of pages with the same contents.)
fn merge_zero_pages_onto_holes(acts: &mut [Option<Action>], left: Option<KeyId>, store: &Store) {
    let mut before = left;
    let mut k = 0;
    while k < acts.len() {
        let z = acts[k..]
            .iter()
            .take_while(|&&a| a == Some(Action::Zero))
            .count();
        if z == 0 {
            before = match acts[k] {
                Some(Action::Merge(sid)) => Some(sid),
                _ => None,
            };
            k += 1;
            continue;
        }
        let after = match acts.get(k + z) {
            Some(Some(Action::Merge(sid))) => Some(*sid),
            _ => None,
        };
        if let (Some(b), Some(a)) = (before, after) {
            let holes = (1..=z as KeyId).map(|d| b.wrapping_add(d));
            if a == b.wrapping_add(z as KeyId + 1)
                && holes
                    .clone()
                    .all(|h| store.is_allocated(h) && store.is_zero_hole(h))
            {
                for (q, h) in (k..k + z).zip(holes) {
                    acts[q] = Some(Action::Merge(h));
                }
            }
        }
        before = None;
        k += z;
    }
}

/// Zero pages merging onto zero holes with no copy beside them in their subrun (nor a left
/// neighbour mapping the copy before) would cost a mapping of their own: they are released as
/// zero pages instead.
fn release_lone_holes(acts: &mut [Option<Action>], holes: &HoleSet, left: Option<KeyId>) {
    let mut k = 0;
    while k < acts.len() {
        let Some((sid, m)) = merge_subrun(acts, k) else {
            k += 1;
            continue;
        };
        let continues = k == 0 && left.is_some_and(|l| l.wrapping_add(1) == sid);
        if !continues && (k..k + m).all(|q| holes.contains(q)) {
            acts[k..k + m].fill(Some(Action::Zero));
        }
        k += m;
    }
}

/// Keeps the run's merges the VMA budget affords, in address order (each at its cost: see
/// [`subrun_cost`]); the others are dropped and their pages
/// wait for room (zero pages on zero holes among them are released as zero pages instead).
/// Returns the VMAs counted for the merges kept.
fn afford(
    cx: &mut CommitCtx<'_>,
    rs: &mut RunState<'_>,
    run: &Run,
    acts: &mut [Option<Action>; MAX_RUN],
    sides: &Sides,
    holes: &HoleSet,
) -> usize {
    let (mut counted, mut limited, mut k) = (0, 0u64, 0);
    while k < run.n {
        let Some((sid, m)) = merge_subrun(&acts[..run.n], k) else {
            k += 1;
            continue;
        };
        let cost = subrun_cost(&acts[..run.n], k, m, sid, sides);
        // (Memory going to the kernel's KSM spends no more mappings.)
        let at = run.first_index + k;
        let to_ksm = rs.region.wants_ksm_at(at);
        if !to_ksm && cx.budget.allows(rs.vmas, cost, m) {
            *rs.vmas += cost;
            counted += cost;
            rs.region.spending.pages += m as u64;
            rs.region.spending.vmas += cost as u64;
            if cx.charge_chunk(rs.region, (at, sid, m), cost, true) {
                cx.judge_chunk_for_ksm(rs.region, at, false);
            }
            k += m;
            continue;
        }
        if !to_ksm {
            cx.charge_chunk(rs.region, (at, sid, m), cost, false);
        }
        for (q, a) in acts.iter_mut().enumerate().take(k + m).skip(k) {
            if holes.contains(q) {
                // A zero page: released as such, which costs no mapping.
                *a = Some(Action::Zero);
                continue;
            }
            *a = None;
            let p = &mut rs.region.pages[run.first_index + q];
            p.unchanged = 0;
            if !to_ksm {
                // It waits for room at no cost per period (see `PageKind::Parked`).
                p.kind = PageKind::Parked;
                limited += 1;
            }
        }
        k += m;
    }
    // Relaxed: a counter.
    cx.sh
        .counters
        .vma_limited
        .fetch_add(limited, Ordering::Relaxed);
    if limited > 0 {
        cx.judge_chunk_for_ksm(rs.region, run.first_index, true);
    }
    counted
}

/// What became of a frozen run, recorded after its writers were woken.
struct Outcome {
    /// Per page: merged onto its copy, released (`Zero`; `Recycle` for a PPR ticket), or put
    /// back (`None`).
    verdict: [Option<Action>; MAX_RUN],
    /// Pages compared unequal to their copy (or no longer zero, or unmarked).
    mismatches: u64,
    /// A mapping of copies that failed, to log after the wake.
    map_error: Option<std::io::Error>,
    /// Pages the freeze could not put back, to log after the wake.
    restore: RestoreReport,
    /// Pages the kernel would not move out (see the `refusals` module), and those it moved.
    refused: [bool; MAX_RUN],
    moved: [bool; MAX_RUN],
    /// Pages frozen out of locked memory (see the `locking` module).
    locked: [bool; MAX_RUN],
}

impl Outcome {
    /// Logs what went wrong while the run was frozen (nothing is logged during a freeze).
    fn log(&self) {
        if let Some(e) = &self.map_error {
            tracing::warn!(error = %e, "merge mapping failed; pages are put back");
        }
        self.restore.log();
    }
}

/// Freezes the run, compares the frozen bytes, maps the copies over the pages equal to theirs,
/// releases zero pages, puts the others back and wakes the writers: a sequence of system calls
/// on memory prepared beforehand, at normal priority (writers may be waiting; the caller entered
/// it).
fn merge_frozen(cx: &CommitCtx<'_>, run: &Run, plan: &Plan, freezer: Freezer<'_>) -> Outcome {
    let mut out = Outcome {
        verdict: [None; MAX_RUN],
        mismatches: 0,
        map_error: None,
        restore: RestoreReport::default(),
        refused: [false; MAX_RUN],
        moved: [false; MAX_RUN],
        locked: [false; MAX_RUN],
    };
    let log = lock(&cx.sh.changes);
    if log.touches(run.start..run.start + run.n * PAGE) {
        // The program changed the run's mapping since the period's watch: its state is stale
        // until the engine applies the change; nothing is frozen.
        return out;
    }
    // SAFETY: the run is registered memory the engine holds no reference into (no recorded change
    // touches it, and the log is held: see the `changes` module); the run's scratch slots are
    // empty (just taken) and only the committer freezes; the fault thread leaves the
    // published run alone.
    let mut frozen = unsafe { FrozenRun::freeze(freezer, &log, run.start, run.n) };
    drop(log);
    for k in 0..run.n {
        let Some(page) = frozen.frozen_page(k) else {
            out.refused[k] = frozen.refused(k);
            // An empty address reads zeros: it merges onto its zero hole as it is.
            if plan.holes.contains(k) && frozen.empty(k) {
                out.verdict[k] = plan.acts[k];
            }
            continue;
        };
        out.moved[k] = true;
        out.locked[k] = frozen.locked(k);
        // `page` is a scratch page holding the page moved out, which only the engine knows;
        // copies held by the plan stay allocated and unchanged.
        out.verdict[k] = match plan.acts[k] {
            // SAFETY: as said above.
            Some(Action::Zero) if unsafe { page_is_zero(page) } => Some(Action::Zero),
            // A zero hole reads zeros (and is never read through the view).
            // SAFETY: as said above.
            Some(Action::Merge(sid)) if plan.holes.contains(k) && unsafe { page_is_zero(page) } => {
                Some(Action::Merge(sid))
            }
            Some(Action::Merge(sid))
                if !plan.holes.contains(k) && frozen_equals_copy(page, plan, sid) =>
            {
                Some(Action::Merge(sid))
            }
            Some(Action::Recycle(slot)) if still_marked(cx, page, slot, run.start + k * PAGE) => {
                Some(Action::Recycle(slot))
            }
            None => None,
            _ => {
                out.mismatches += 1;
                None
            }
        };
    }
    // Changes the program made while the run was frozen (reported by the kernel, recorded by
    // the fault thread) are applied by the put-back: such pages are neither merged nor
    // released. The mappings about to be made are announced (their reports are the engine's).
    let mut log = lock(&cx.sh.changes);
    for (k, v) in out.verdict.iter_mut().enumerate().take(run.n) {
        if v.is_some() && frozen.fate(&log, k) != Fate::Kept {
            *v = None;
        }
    }
    // Holes whose neighbours turned out unequal are released as zero pages.
    release_lone_holes(&mut out.verdict[..run.n], &plan.holes, plan.left);
    // Pages the program drops from here on stay dropped under the copies (see `unfilled`).
    let since = log.unfilled.mark();
    for_each_subrun(&out.verdict[..run.n], |k, _, m| {
        log.expect_merge(mapping_change(run.start + k * PAGE, m), since);
    });
    drop(log);
    replace_frozen(cx, (run, plan), since, &mut frozen, &mut out);
    // (An empty page released instead of merged onto its hole stays as it is: empty.)
    let released = |k: usize| {
        out.moved[k] && matches!(out.verdict[k], Some(Action::Zero | Action::Recycle(_)))
    };
    let mut k = 0;
    while k < run.n {
        if !released(k) {
            k += 1;
            continue;
        }
        let m = (k..run.n).take_while(|&q| released(q)).count();
        // Released pages stay empty: once the run is no longer registered for missing faults
        // (when the guard goes), a touch there is the kernel's own fault.
        (k..k + m).for_each(|q| frozen.consume(q));
        k += m;
    }
    out.restore = frozen.restore();
    out
}

/// Maps the copies over each subrun of pages judged equal (one mapping per subrun of consecutive
/// copies); their pages are consumed. A subrun that cannot be mapped is put back.
fn replace_frozen(
    cx: &CommitCtx<'_>,
    (run, plan): (&Run, &Plan),
    since: u64,
    frozen: &mut FrozenRun<'_>,
    out: &mut Outcome,
) {
    let mut k = 0;
    while k < run.n {
        let Some((sid, m)) = merge_subrun(&out.verdict[..run.n], k) else {
            k += 1;
            continue;
        };
        let addr = run.start + k * PAGE;
        // (Frozen by moving, its mapping is read/write.)
        let copies = Copies {
            file: &plan.file,
            sid,
            m,
            prot: libc::PROT_READ | libc::PROT_WRITE,
        };
        // SAFETY: the subrun is frozen (its pages are in scratch) and compared equal to its
        // copies, which the plan holds; its unmapping was announced with mark `since`.
        match unsafe { map_copies_registered(cx.sh, addr, copies, since) } {
            Ok(registered) => {
                (k..k + m).for_each(|q| frozen.consume_mapped(q));
                plan.advice.give_copies(addr, m * PAGE);
                if registered {
                    map_zero_page_over_holes(cx.sh, run.start, k..k + m, &plan.holes);
                    map_copies_over_the_rest(cx.sh, run.start, k..k + m, &plan.holes);
                }
                // Over locked pages, locked (their entries are mapped now: see `locking`).
                for_each_stretch(
                    k..k + m,
                    |q| out.locked[q],
                    |q, mq| {
                        let _ = crate::locking::lock_on_fault(run.start + q * PAGE, mq * PAGE);
                    },
                );
            }
            Err(e) => {
                lock(&cx.sh.changes).unexpect(mapping_change(addr, m));
                out.verdict[k..k + m].fill(None);
                out.map_error = Some(e);
            }
        }
        k += m;
    }
}

/// Maps the kernel's zero page over the zero holes among pages `ks` of the run at `start`, just
/// mapped from the store (through the store mappings' userfaultfd, which they are registered
/// with): reading them then takes no page in the store's file. A hole read before this, or not
/// filled, reads zeros all the same, from a page the store's file gets for it.
fn map_zero_page_over_holes(sh: &Shared, start: usize, ks: Range<usize>, holes: &HoleSet) {
    let Some(u) = &sh.store_uffd else { return };
    for_each_stretch(
        ks,
        |k| holes.contains(k),
        |k, m| {
            let _ = u.fill_zero_pages(start + k * PAGE, m * PAGE);
        },
    );
}

/// Maps the copies of the pages `ks` of the run at `start` that are not over holes (their page
/// table entries; see [`STORE_MODE`](crate::freeze::STORE_MODE)), except where the program dropped them meanwhile.
fn map_copies_over_the_rest(sh: &Shared, start: usize, ks: Range<usize>, holes: &HoleSet) {
    map_cached_unless_dropped(sh, start, ks, |k| !holes.contains(k));
}

/// Maps the cached pages (copies) of the pages `ks` of the store mapping at `start` that are
/// `wanted`, except those the program dropped since they were judged (see the `unfilled`
/// module): those stay empty, to read zeros. Under the change log's lock, so that no drop is
/// recorded meanwhile, and none made (the kernel drops a page only once its report is read).
pub(crate) fn map_cached_unless_dropped(
    sh: &Shared,
    start: usize,
    ks: Range<usize>,
    wanted: impl Fn(usize) -> bool,
) {
    let Some(u) = &sh.store_uffd else { return };
    let log = lock(&sh.changes);
    let at = |k: usize| start + k * PAGE;
    for_each_stretch(
        ks,
        |k| wanted(k) && !log.unfilled.holds(at(k)),
        |k, m| {
            let _ = u.map_cached_pages(at(k), m * PAGE);
        },
    );
}

/// Calls `f(k, m)` for each longest stretch `k..k + m` of `ks` whose pages are `wanted`.
fn for_each_stretch(
    ks: Range<usize>,
    wanted: impl Fn(usize) -> bool,
    mut f: impl FnMut(usize, usize),
) {
    let mut k = ks.start;
    while k < ks.end {
        if !wanted(k) {
            k += 1;
            continue;
        }
        let m = (k..ks.end).take_while(|&q| wanted(q)).count();
        f(k, m);
        k += m;
    }
}

/// (`Config::populate_merged`) Maps the page-table entries of the copies just mapped over the
/// run, once its writers are woken and while the program's mapping changes are still held off
/// (`holding_still`): the kernel does no fault-around on a mapping registered with userfaultfd, so the first read of
/// every merged page would take a page fault of its own (as KSM, which merges in place, does
/// not). Read-only: the copies are mapped, not copied. A subrun the program changed meanwhile
/// (a report in the log) is left alone.
fn map_merged_pages(sh: &Shared, run: &Run, out: &Outcome) {
    for_each_subrun(&out.verdict[..run.n], |k, _, m| {
        let (a, len) = (run.start + k * PAGE, m * PAGE);
        if lock(&sh.changes).touches(a..a + len) {
            return;
        }
        // SAFETY: populating for reading changes no contents; the range is the subrun just
        // mapped from the store (a page-aligned range of this process).
        let _ = unsafe { sys::madvise(a as *mut u8, len, libc::MADV_POPULATE_READ) };
    });
}

/// Calls `f(k, sid, m)` for each subrun of merges in `acts` (`m` pages from `k`, copies from
/// `sid`).
fn for_each_subrun(acts: &[Option<Action>], mut f: impl FnMut(usize, KeyId, usize)) {
    let mut k = 0;
    while k < acts.len() {
        let Some((sid, m)) = merge_subrun(acts, k) else {
            k += 1;
            continue;
        };
        f(k, sid, m);
        k += m;
    }
}

/// How the kernel reports mapping `m` copies over the pages at `addr`: the old mapping there is
/// unmapped.
fn mapping_change(addr: usize, m: usize) -> Change {
    Change::Unmap {
        start: addr,
        end: addr + m * PAGE,
    }
}

/// Records what became of a run whose writers were woken: merged pages, released pages, pages
/// put back; references the plan took and did not use are given back, and VMAs counted and not
/// used are uncounted. If the run's region is gone (unregistered or unmapped meanwhile), its
/// mapped copies are no longer mapped by it.
fn record_outcome(cx: &mut CommitCtx<'_>, st: &mut State, run: &Run, plan: &Plan, out: &Outcome) {
    let sh = cx.sh;
    // Relaxed: counters.
    sh.counters
        .mismatches
        .fetch_add(out.mismatches, Ordering::Relaxed);
    // A subrun split by a page that compared unequal costs more than the plan counted: the count
    // is corrected both ways (the margin under the limit absorbs such splits).
    let used = used_vmas(run, plan, &out.verdict);
    st.vmas = (st.vmas + used).saturating_sub(plan.vmas);
    note_mapped(&mut st.store, run, plan, out);
    let Some(rs) = RunState::of(st, run.region) else {
        for a in plan.acts.iter().take(run.n) {
            if let Some(Action::Merge(sid)) = *a {
                st.store.drop_ref(sid);
            }
        }
        return;
    };
    let (mut merged, mut refused) = (0, 0);
    for k in 0..run.n {
        let Some(p) = rs.region.pages.get_mut(run.first_index + k) else {
            // The region shrank meanwhile: the page is gone.
            if let Some(Action::Merge(sid)) = plan.acts[k] {
                rs.store.drop_ref(sid);
            }
            continue;
        };
        if p.kind == PageKind::Zero {
            // Released already (a zero gap): merged onto its hole, or left as it was.
            match (plan.acts[k], out.verdict[k]) {
                (_, Some(Action::Merge(sid))) => {
                    *rs.zero -= 1;
                    settle(p, rs.store, sid, true, cx.config.max_backoff);
                    merged += 1;
                }
                (Some(Action::Merge(sid)), _) => rs.store.undo_ref(sid),
                _ => {}
            }
            continue;
        }
        match (plan.acts[k], out.verdict[k]) {
            (_, Some(Action::Merge(sid))) => {
                settle(p, rs.store, sid, true, cx.config.max_backoff);
                merged += 1;
                if out.locked[k] {
                    let at = (run.first_index + k) * PAGE;
                    rs.region.locked.add(at..at + PAGE);
                }
            }
            (Some(Action::Merge(sid)), _) => {
                rs.store.undo_ref(sid);
                p.unchanged = 0;
                p.kind = PageKind::Anon;
                if out.map_error.is_some() {
                    p.back_off(cx.config.max_backoff);
                }
            }
            (_, Some(Action::Recycle(_))) if !cx.config.merging => {
                // Recycling only: nothing watches the page, so it is anonymous memory again for
                // the next claim (the zero page until the program writes it).
                p.kind = PageKind::Anon;
                p.unchanged = 0;
            }
            (planned, Some(Action::Zero | Action::Recycle(_))) => {
                // A zero page planned onto a zero hole and released instead.
                if let Some(Action::Merge(sid)) = planned {
                    rs.store.undo_ref(sid);
                }
                p.kind = PageKind::Zero;
                p.unchanged = 0;
                *rs.zero += 1;
            }
            _ => {
                p.unchanged = 0;
                p.kind = PageKind::Anon;
            }
        }
        if out.refused[k] && matches!(plan.acts[k], Some(Action::Merge(_) | Action::Zero)) {
            // It waits until refused pages are tried again, or until it is dropped.
            p.kind = PageKind::Refused;
            rs.refusals.pages += 1;
            refused += 1;
        } else if out.moved[k] {
            rs.refusals.moved_out(run.start + k * PAGE);
        }
        if let Some(Action::Recycle(slot)) = out.verdict[k] {
            lock(&sh.recycled_slots).push(slot);
            sh.counters.recycled.fetch_add(1, Ordering::Relaxed);
        }
    }
    if merged > 0 {
        rs.region.merged_ever = true;
        sh.counters.merges.fetch_add(merged, Ordering::Relaxed);
    }
    if refused > 0 {
        // Memory that is not read/write (or locked, where the locked area could not be
        // locked), which the kernel's KSM merges where it runs.
        rs.region.spending.refused += refused;
        cx.judge_region_for_ksm(rs.region);
    }
}

/// Notes the copies mapped over the run's pages: those of its merges, and, where a mapping
/// failed (which may leave part of it made), every copy the plan held.
fn note_mapped(store: &mut Store, run: &Run, plan: &Plan, out: &Outcome) {
    let acts = if out.map_error.is_some() {
        &plan.acts
    } else {
        &out.verdict
    };
    for a in acts.iter().take(run.n) {
        if let Some(Action::Merge(sid)) = *a {
            store.note_mapped(sid..sid + 1);
        }
    }
}

/// The VMAs the run's mappings cost: as [`afford`] counted them, for the subruns mapped.
fn used_vmas(run: &Run, plan: &Plan, verdict: &[Option<Action>; MAX_RUN]) -> usize {
    let (mut used, mut k) = (0, 0);
    while k < run.n {
        let Some((sid, m)) = merge_subrun(&verdict[..run.n], k) else {
            k += 1;
            continue;
        };
        used += subrun_cost(&verdict[..run.n], k, m, sid, &plan.sides);
        k += m;
    }
    used
}

/// Whether the frozen page at `page`, moved from `addr`, still holds the PPR mark of the ticket
/// of `slot` (then it is released).
fn still_marked(cx: &CommitCtx<'_>, page: usize, slot: u32, addr: usize) -> bool {
    // SAFETY: `page` is the scratch slot holding the page moved out of the frozen address; only
    // the engine knows the scratch area, so nobody writes it meanwhile.
    let words = [0, 1, 2].map(|w| unsafe { std::ptr::read((page as *const u64).add(w)) });
    let ticket = pageone_recycler::Ticket { slot, addr };
    cx.recycler
        .as_ref()
        .is_some_and(|p| p.is_marked(&ticket, words))
}

/// Whether the page at `page` is all zero.
///
/// # Safety
/// `page` is a mapped page nobody writes during the call.
unsafe fn page_is_zero(page: usize) -> bool {
    // SAFETY: by the caller's contract.
    let f = unsafe { std::slice::from_raw_parts(page as *const u8, PAGE) };
    f.iter().all(|&b| b == 0)
}

/// Whether the frozen page at `page` (a scratch page only the engine knows) equals copy `sid`,
/// which the plan holds (allocated and unchanged).
fn frozen_equals_copy(page: usize, plan: &Plan, sid: KeyId) -> bool {
    // SAFETY: both are mapped pages nobody writes during the call (see above).
    unsafe { pages_equal(page, plan.store_base + sid as usize * PAGE) }
}

/// Whether the pages at `a` and `b` hold the same bytes.
///
/// # Safety
/// Both are mapped pages nobody writes during the call.
unsafe fn pages_equal(a: usize, b: usize) -> bool {
    // SAFETY: by the caller's contract.
    unsafe {
        std::slice::from_raw_parts(a as *const u8, PAGE)
            == std::slice::from_raw_parts(b as *const u8, PAGE)
    }
}

/// The copies are read through the store's view to be compared: mapped now, before the freeze, by
/// reading one page of each aligned 64 KiB of the view (a read fault maps the pages of the file
/// around it, that much by Linux's default `fault_around_bytes`), instead of faulting during the
/// compare with the run frozen. Cheaper than `MADV_POPULATE_READ`, which walks every page, and
/// than reading every page (measured: docs/benchmarks/history.md). Pages left unmapped fault in
/// during the compare, as before.
/// Zero holes are skipped: reading one would put a page in the store's file.
fn map_copies_before_freeze(acts: &[Option<Action>], holes: &HoleSet, store_base: usize) {
    let mut mapped_window = usize::MAX;
    for (k, a) in acts.iter().enumerate() {
        let Some(Action::Merge(sid)) = *a else {
            continue;
        };
        let at = store_base + sid as usize * PAGE;
        if holes.contains(k) || at / FAULT_AROUND_BYTES == mapped_window {
            continue;
        }
        mapped_window = at / FAULT_AROUND_BYTES;
        // SAFETY: a copy the plan holds stays allocated and lies in the view, a read-only
        // mapping of the store; volatile, as the bytes are another process's to publish.
        unsafe { std::ptr::read_volatile(at as *const u64) };
    }
}

/// Merges a run of COW-broken pages again. They live in store mappings, which `UFFDIO_MOVE` cannot
/// freeze, so writers are held off with synchronous write-protection instead: the pages stay
/// readable, any write blocks until the run is done, and the comparison reads bytes that cannot
/// change. Equal subruns are replaced by mappings of the copies; the rest is un-protected.
fn commit_broken(cx: &mut CommitCtx<'_>, rs: &mut RunState<'_>, run: &Run) {
    let sh = cx.sh;
    let Some(u2) = &sh.store_uffd else { return };
    let (start, n) = (run.start, run.n);
    // The copies are mapped with the protection of what they replace (the program may have made
    // merged memory read-only). Asked before the pages are held: it allocates nothing where the
    // kernel answers `PROCMAP_QUERY`, and a change of protection through the shim waits for the
    // commit. `None`: mappings of several protections; the run is left alone this time.
    let Ok(Some(prot)) = sh.maps.protection(start, start + n * PAGE) else {
        return;
    };
    // Where the program unlocked what the engine locked, by a call the engine did not see, what
    // replaces it here is not locked (asked before the pages are held: it may allocate).
    rs.region.forget_unlocked(start, n * PAGE);
    // `None`: some page is not in a write-protectable mapping; the run is left alone this time.
    cx.hold_still_from_now();
    // Pages the program drops from here on stay dropped under the copies (see `unfilled`).
    let since = lock(&sh.changes).unfilled.mark();
    // The program's advice, read before the pages are held (see `advice`).
    let advice = crate::advice::over(start..start + n * PAGE);
    let Some(mut held) = ProtectedRun::protect(u2, start, n) else {
        return;
    };
    let mut map_error = None;
    let verdict = judge_held(cx, rs, run);
    let mut k = 0;
    while k < n {
        if verdict[k] == Some(Action::Zero) {
            let m = (k..n)
                .take_while(|&q| verdict[q] == Some(Action::Zero))
                .count();
            let index = run.first_index + k;
            // SAFETY: the subrun's pages are write-protected with writers blocked and hold only
            // zeros (read above).
            match unsafe { release_zeroed(cx, rs, (index, m), prot) } {
                Ok(true) => {
                    (k..k + m).for_each(|q| held.mark_replaced(q));
                    advice.give_anonymous(start + k * PAGE, start + k * PAGE, m * PAGE);
                }
                Ok(false) => {}
                Err(e) => map_error = Some(e),
            }
            k += m;
            continue;
        }
        let Some((sid, m)) = merge_subrun(&verdict[..n], k) else {
            rs.region.pages[run.first_index + k].unchanged = 0;
            k += 1;
            continue;
        };
        let index = run.first_index + k;
        let sub = Subrun {
            index,
            sid,
            m,
            prot,
            since,
        };
        // SAFETY: the subrun's pages are write-protected with writers blocked and equal their
        // copies (compared above).
        match unsafe { map_copies(cx, rs, sub, 2) } {
            Ok(true) => {
                (k..k + m).for_each(|q| held.mark_replaced(q));
                advice.give_copies(start + k * PAGE, m * PAGE);
            }
            Ok(false) => {}
            Err(e) => map_error = Some(e),
        }
        k += m;
    }
    // Dropping `held` lets writers in: it un-protects what was not replaced, then wakes everyone
    // who waited on the run.
    drop(held);
    if let Some(e) = map_error {
        tracing::warn!(error = %e, "merge mapping failed; pages are put back");
    }
}

/// Maps copies `sid..sid + m` over the `m` pages of the run's region from page `index` on, if the
/// VMA budget has room for `cost` more VMAs, and settles every page either way (merged, or its
/// reference taken back and the page backed off). Returns whether the copies were mapped, and
/// the error of a mapping that failed (to log once the pages are let go).
///
/// # Safety
///
/// The caller holds the pages still (write-protected with writers blocked) and has compared them
/// equal to their copies, so replacing the mapping discards nothing.
unsafe fn map_copies(
    cx: &mut CommitCtx<'_>,
    rs: &mut RunState<'_>,
    sub: Subrun,
    cost: usize,
) -> Result<bool, std::io::Error> {
    let Subrun {
        index,
        sid,
        m,
        prot,
        since,
    } = sub;
    let sh = cx.sh;
    let addr = rs.region.start + index * PAGE;
    let mapped = if !cx.budget.allows(rs.vmas, cost, m) {
        sh.counters
            .vma_limited
            .fetch_add(m as u64, Ordering::Relaxed);
        Ok(false)
    } else {
        rs.store.note_mapped(sid..sid + m as KeyId);
        // The store mapping replaced is reported by its context: the engine's own change.
        lock(&sh.changes).expect_merge(mapping_change(addr, m), since);
        let copies = Copies {
            file: &rs.store.file,
            sid,
            m,
            prot,
        };
        // SAFETY: the pages are held still and equal their copies (this function's contract);
        // their unmapping was just announced with mark `since`.
        let r = unsafe { map_copies_registered(sh, addr, copies, since) };
        match r {
            Ok(registered) => {
                if registered {
                    map_cached_unless_dropped(sh, addr, 0..m, |_| true);
                }
                rs.region.relock(addr, m * PAGE);
                Ok(true)
            }
            Err(e) => {
                lock(&sh.changes).unexpect(mapping_change(addr, m));
                Err(e)
            }
        }
    };
    let ok = matches!(mapped, Ok(true));
    for q in 0..m {
        settle(
            &mut rs.region.pages[index + q],
            rs.store,
            sid + q as u32,
            ok,
            cx.config.max_backoff,
        );
    }
    if ok {
        *rs.vmas += cost;
        rs.region.merged_ever = true;
        sh.counters.merges.fetch_add(m as u64, Ordering::Relaxed);
    }
    mapped
}

/// What each page of a COW-broken run held still becomes, by its bytes read now: merged onto its
/// copy (equal to it; a reference is taken), released (all zero), or left (`None`).
fn judge_held(
    cx: &mut CommitCtx<'_>,
    rs: &mut RunState<'_>,
    run: &Run,
) -> [Option<Action>; MAX_RUN] {
    let sh = cx.sh;
    let start = run.start;
    let mut verdict: [Option<Action>; MAX_RUN] = [None; MAX_RUN];
    // The pages are held still, but read through the kernel all the same (they are the
    // program's mappings: unmapped meanwhile, a read fails instead of faulting).
    let reader = &mut cx.reader;
    for (k, v) in verdict.iter_mut().enumerate().take(run.n) {
        let sid = match run.acts[k] {
            Some(Action::Merge(sid)) => sid,
            Some(Action::Zero) => {
                // Zeroed after its merge (a guest freeing shared memory): released if it still
                // holds only zeros.
                if reader.read_one(start + k * PAGE).is_some_and(is_zero) {
                    *v = Some(Action::Zero);
                } else {
                    sh.counters.mismatches.fetch_add(1, Ordering::Relaxed);
                }
                continue;
            }
            _ => continue,
        };
        if rs.store.is_zero_hole(sid) {
            // Only anonymous zero pages get holes (see `zero_holes`); never read through the
            // view.
            continue;
        } else if rs.store.refs(sid) >= cx.config.max_sharing {
            rs.store.retire(sid);
        } else if reader
            .read_one(start + k * PAGE)
            .is_some_and(|b| equals_copy(b, rs.store.addr(sid)))
        {
            *v = Some(Action::Merge(sid));
            rs.store.add_ref(sid);
        } else {
            sh.counters.mismatches.fetch_add(1, Ordering::Relaxed);
        }
    }
    verdict
}

/// Releases the `m` zeroed pages of the run's region from page `index` on, in a mapping of the
/// store (COW-broken) with protection `prot`, if the VMA budget has room: an empty anonymous
/// mapping of that protection goes over them and
/// is registered like the region around it (a touch there is the kernel's own fault; a write maps
/// a page of its own, which the watch sees). Returns whether they were released, and
/// the error of a mapping that failed (to log once the pages are let go). Allocates nothing and
/// takes no lock a program thread may hold.
///
/// # Safety
///
/// The caller holds the pages still (write-protected with writers blocked) and has read them
/// all zero, so replacing the mapping discards nothing.
unsafe fn release_zeroed(
    cx: &mut CommitCtx<'_>,
    rs: &mut RunState<'_>,
    (index, m): (usize, usize),
    prot: libc::c_int,
) -> Result<bool, std::io::Error> {
    const COST: usize = 2;
    let sh = cx.sh;
    let (addr, len) = (rs.region.start + index * PAGE, m * PAGE);
    if !cx.budget.allows(rs.vmas, COST, m) {
        return Ok(false);
    }
    // The store mapping replaced is reported by its context: the engine's own change.
    lock(&sh.changes).expect(mapping_change(addr, m));
    // SAFETY: the pages are held still and hold only zeros (this function's contract); the
    // mapping replaces them, as a whole, by an empty private anonymous mapping of the same
    // protection (never inaccessible meanwhile: the program may read them while held).
    let mapped = unsafe { sys::mmap_anonymous_fixed(addr as *mut u8, len, prot) };
    if let Err(e) = mapped {
        lock(&sh.changes).unexpect(mapping_change(addr, m));
        return Err(e);
    }
    // Locked where they were (see `locking`; the caller gives the advice, see `advice`).
    rs.region.relock(addr, len);
    *rs.vmas += COST;
    // Registered like the memory around it; empty, a touch is the kernel's own fault.
    let registered = sh.uffd.register(addr, len, sh.reg_mode);
    // Not registered (the kernel refused): the pages hold nothing, but a freeze by moving them
    // out would not hold writers off there. As pages of a store mapping, a later freeze is a
    // write-protection through the store mappings' context, which fails: they are left alone.
    let kind = match registered {
        Ok(()) => PageKind::Zero,
        Err(_) => PageKind::Broken,
    };
    for p in &mut rs.region.pages[index..index + m] {
        p.kind = kind;
        p.unchanged = 0;
        p.epoch = p.epoch.wrapping_add(1);
    }
    if kind == PageKind::Zero {
        *rs.zero += m as u64;
    }
    registered.map(|()| true)
}

/// Records the outcome of mapping copy `copy` over a page: merged, or (`ok == false`) the
/// reference counted for it is taken back.
///
/// A merge that could not be mapped (the VMA budget is spent, or `mmap` failed) waits longer
/// each time, doubling up to `max_backoff` periods: a process at its VMA limit must not pay a
/// classification of every unmergeable page every two periods.
fn settle(p: &mut Page, store: &mut Store, copy: KeyId, ok: bool, max_backoff: u8) {
    if ok {
        // The page keeps its write history: a page that was written again after a merge
        // waits longer before the next one.
        *p = Page {
            sid: copy,
            kind: PageKind::Merged,
            unchanged: 0,
            writes: p.writes,
            epoch: p.epoch,
        };
    } else {
        store.undo_ref(copy);
        p.unchanged = 0;
        p.back_off(max_backoff);
    }
}

/// The VMA budget of one batch's commit. The engine's count is an estimate that merges raise by
/// their worst case (two VMAs, one when the copy continues its left neighbour's mapping), so
/// before it refuses a merge it is replaced by the kernel's count, once per batch (reading
/// `/proc/self/maps` costs milliseconds with tens of thousands of VMAs).
struct VmaBudget {
    budget: usize,
    /// The engine's share of it (see [`engine_room`]).
    room: usize,
    recounted: bool,
}

impl VmaBudget {
    /// `budget` VMAs at most, of which the process had `base` before it merged anything.
    fn new(budget: usize, base: usize) -> Self {
        Self {
            budget,
            room: engine_room(budget, base),
            recounted: false,
        }
    }

    /// Whether a merge of `pages` pages costing `cost` more VMAs is afforded; `vmas` is the
    /// engine's count, corrected here if need be. The budget is spent by profit (see
    /// [`pages_per_vma_wanted`]): a merge must save as many pages per VMA as the room left after
    /// it asks for, so that single pages do not take the room of long runs.
    fn allows(&mut self, vmas: &mut usize, cost: usize, pages: usize) -> bool {
        let fits = |v: usize| {
            let left = self.budget.checked_sub(v + cost);
            left.is_some_and(|left| pages >= cost * pages_per_vma_wanted(left, self.room))
        };
        if fits(*vmas) {
            return true;
        }
        if !self.recounted {
            self.recounted = true;
            if let Ok(n) = sys::map_count() {
                *vmas = n;
            }
        }
        fits(*vmas)
    }
}

/// The engine's room under a `budget` of VMAs: the budget less the `base` the process had
/// before merging (its own mappings), 1 at least.
pub(crate) fn engine_room(budget: usize, base: usize) -> usize {
    budget.saturating_sub(base).max(1)
}

/// The pages a merge must save per VMA it costs when `left` VMAs of the engine's `room` would be
/// left after it: any merge while half the room is left, then 2, 8 and 64 pages a VMA below a
/// half, a quarter and an eighth of it. Single pages scattered among others (a VMA each, at
/// best) take half the room at most; runs (hundreds of pages a VMA) merge until it is spent.
pub(crate) fn pages_per_vma_wanted(left: usize, room: usize) -> usize {
    match left {
        l if l >= room / 2 => 0,
        l if l >= room / 4 => 2,
        l if l >= room / 8 => 8,
        _ => 64,
    }
}

/// The subrun of merges at `k`: its first copy and its length, as long as the copies follow each
/// other (one mapping of the store covers it). `None` if `acts[k]` is not a merge.
fn merge_subrun(acts: &[Option<Action>], k: usize) -> Option<(KeyId, usize)> {
    let Some(Action::Merge(sid)) = acts[k] else {
        return None;
    };
    let m = acts[k..]
        .iter()
        .enumerate()
        .take_while(|&(j, a)| *a == Some(Action::Merge(sid.wrapping_add(j as u32))))
        .count();
    Some((sid, m))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Single pages (a VMA each) may take half the engine's room; runs of more pages per VMA
    /// take more of it, the longest all of it; less room left never asks less.
    #[test]
    fn the_room_goes_to_single_pages_for_half_and_to_runs_after() {
        let room = engine_room(65_530 - 1024, 300);
        assert_eq!(room, 64_206);
        assert_eq!(
            engine_room(100, 300),
            1,
            "no room: a process over its budget already"
        );
        assert_eq!(pages_per_vma_wanted(room, room), 0);
        assert_eq!(pages_per_vma_wanted(room / 2, room), 0);
        assert_eq!(pages_per_vma_wanted(room / 2 - 1, room), 2);
        assert_eq!(pages_per_vma_wanted(room / 4 - 1, room), 8);
        assert_eq!(pages_per_vma_wanted(room / 8 - 1, room), 64);
        assert_eq!(pages_per_vma_wanted(0, room), 64);
        let mut last = 0;
        for left in (0..=room).rev() {
            let wanted = pages_per_vma_wanted(left, room);
            assert!(wanted >= last, "less room asks no less");
            last = wanted;
        }
        // A full run (512 pages) at a VMA or two still fits with nothing else left.
        assert!(MAX_RUN >= 2 * pages_per_vma_wanted(0, room));
    }

    #[test]
    fn merge_subruns_end_where_copies_stop_following_each_other() {
        let m = |sid| Some(Action::Merge(sid));
        let acts = [m(5), m(6), m(8), Some(Action::Zero), m(9), None, m(3), m(4)];
        let found: Vec<_> = (0..acts.len()).map(|k| merge_subrun(&acts, k)).collect();
        assert_eq!(
            found,
            [
                Some((5, 2)),
                Some((6, 1)),
                Some((8, 1)),
                None,
                Some((9, 1)),
                None,
                Some((3, 2)),
                Some((4, 1)),
            ]
        );
    }

    /// The cost of each subrun of `acts`, mapped in address order, beside `sides`.
    fn costs(acts: &[Option<Action>], sides: &Sides) -> Vec<usize> {
        let mut out = Vec::new();
        let mut k = 0;
        while k < acts.len() {
            match merge_subrun(acts, k) {
                Some((sid, m)) => {
                    out.push(subrun_cost(acts, k, m, sid, sides));
                    k += m;
                }
                None => k += 1,
            }
        }
        out
    }

    #[test]
    fn a_mapping_costs_what_it_adds_to_the_process_mappings() {
        let m = |sid| Some(Action::Merge(sid));
        let anon = Sides {
            left: None,
            left_in_store: false,
            right_in_store: false,
            in_store: false,
        };
        // Inside anonymous memory: one mapping and two splits; the next page's mapping splits
        // only on its right.
        assert_eq!(costs(&[m(9), m(8), m(7)], &anon), [2, 1, 1]);
        // Pages not merged between them: each splits both sides.
        assert_eq!(
            costs(&[m(9), None, m(7), Some(Action::Zero), m(5)], &anon),
            [2, 2, 2]
        );
        // A run of copies is one mapping.
        assert_eq!(costs(&[m(3), m(4), m(5)], &anon), [2]);
        // Between merged pages, nothing is split; continuing the left neighbour's copies
        // extends its mapping.
        let between = Sides {
            left_in_store: true,
            right_in_store: true,
            ..anon
        };
        assert_eq!(costs(&[m(9)], &between), [0]);
        assert_eq!(costs(&[m(9), m(8)], &between), [1, 0]);
        let after = Sides {
            left: Some(8),
            left_in_store: true,
            ..anon
        };
        assert_eq!(costs(&[m(9), m(3)], &after), [1, 1]);
        // COW-broken pages (in store mappings themselves) are counted at their worst case.
        let broken = Sides {
            in_store: true,
            ..between
        };
        assert_eq!(costs(&[m(9), m(8)], &broken), [2, 2]);
    }
}
