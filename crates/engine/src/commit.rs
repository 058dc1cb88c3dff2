//! The commit: runs of candidates are frozen, compared byte for byte with their stable copies (or
//! checked for zero), and replaced by one `mmap(MAP_PRIVATE | MAP_FIXED)` of the copies per subrun
//! (or released); pages that differ are put back, then blocked writers are woken. So a write is
//! never lost and pages that differ are never merged, whatever the hash or the index said.
//!
//! One committer thread commits the batches in order (remaps of one address space serialise on
//! `mmap_lock` anyway) while the engine thread classifies the next. The state lock is held for one
//! run at a time (at most `MAX_RUN` pages), so the classifier can record its next batch between
//! runs.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use pageone_index::KeyId;
use pageone_sync::lock;
use pageone_sys::{self as sys, uapi::*};

use crate::access::{equals_copy, PageReader, PAGE};
use crate::candidates::{Action, Candidate};
use crate::classify::Classified;
use crate::config::Config;
use crate::freeze::{Freezer, FrozenRun, ProtectedRun, MAX_RUN};
use crate::pool::Pool;
use crate::state::{Page, PageKind, RegionState, Shared, State};
use crate::store::Store;

/// What a read fault on a file mapping maps at once, aligned, of the pages in the page cache
/// (Linux's default `fault_around_bytes`).
const FAULT_AROUND_BYTES: usize = 64 << 10;

/// What the runs of one batch's commit share.
struct CommitCtx<'a> {
    sh: &'a Shared,
    pool: &'a Pool,
    config: &'a Config,
    budget: VmaBudget,
    /// The PPR pool whose marks recycled pages must still hold.
    recycler: Option<Arc<pageone_recycler::Pool>>,
    /// Seconds spent freezing, verifying and replacing, for the log.
    times: [f64; 3],
    /// Reads COW-broken pages to compare them.
    reader: PageReader,
}

/// The parts of the state a run's commit changes, borrowed from the holder of the state lock.
struct RunState<'s> {
    region: &'s mut RegionState,
    store: &'s mut Store,
    vmas: &'s mut usize,
    zero: &'s mut u64,
}

impl<'s> RunState<'s> {
    /// The state of the region starting at `region`, if it is registered.
    fn of(st: &'s mut State, region: usize) -> Option<Self> {
        let State {
            regions,
            store,
            vmas,
            zero,
            ..
        } = st;
        Some(RunState {
            region: regions.get_mut(&region)?,
            store,
            vmas,
            zero,
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

/// Copies `sid..sid + m`, for the `m` pages of a region from page `index` on.
#[derive(Clone, Copy)]
struct Subrun {
    index: usize,
    sid: KeyId,
    m: usize,
}

/// Freezes, verifies and replaces runs of the batch's candidates, in address order; `budget` is
/// the most VMAs the process may have after a merge.
pub(crate) fn commit(sh: &Shared, pool: &Pool, config: &Config, batch: &Classified, budget: usize) {
    let (cands, actions) = (&batch.cands, &batch.actions);
    let mut todo: Vec<usize> = (0..cands.len()).filter(|&i| actions[i].is_some()).collect();
    if todo.is_empty() {
        return;
    }
    let mut cx = CommitCtx {
        sh,
        pool,
        config,
        budget: VmaBudget::new(budget),
        recycler: lock(&sh.recycler).clone(),
        times: [0.0; 3],
        reader: PageReader::new(),
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

/// Commits the run of candidates `todo` starts with (candidate numbers in address order);
/// returns how many of them it took.
fn commit_run(
    cx: &mut CommitCtx<'_>,
    cands: &[Candidate],
    actions: &[Option<Action>],
    todo: &[usize],
) -> usize {
    let sh = cx.sh;
    let mut guard = lock(&sh.state);
    let Some(mut rs) = RunState::of(&mut guard, cands[todo[0]].region) else {
        return 1;
    };
    let mut run = next_run(rs.region, cands, actions, todo);
    if run.in_store {
        commit_broken(cx, &mut rs, &run);
        return run.n;
    }
    if !within_budget(cx, &mut rs, &mut run) {
        return run.n;
    }
    // Freezing and comparing need no state: the period lock keeps the region registered, and
    // a copy named by this batch stays allocated until the batch is done (only the committer
    // frees copies during a period).
    let store_base = rs.store.addr(0);
    let (scratch, pagemap) = (guard.scratch, guard.pagemap.clone());
    drop(guard);
    let freezer = Freezer {
        uffd: &sh.uffd,
        range: &sh.frozen,
        scratch,
        pagemap: &pagemap,
    };
    merge_run(cx, &run, store_base, freezer);
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

/// Merges that cannot be mapped for want of VMAs are not worth a freeze: they back off now.
/// Returns whether the run has anything left to do.
fn within_budget(cx: &mut CommitCtx<'_>, rs: &mut RunState<'_>, run: &mut Run) -> bool {
    if cx.budget.allows(rs.vmas, 2) {
        return true;
    }
    let mut limited = 0;
    for (k, a) in run.acts.iter_mut().enumerate().take(run.n) {
        if let Some(Action::Merge(_)) = a {
            *a = None;
            limited += 1;
            let p = &mut rs.region.pages[run.first_index + k];
            p.unchanged = 0;
            p.back_off(cx.config.max_backoff);
        }
    }
    cx.sh
        .counters
        .vma_limited
        .fetch_add(limited, Ordering::Relaxed);
    !run.acts[..run.n].iter().all(Option::is_none)
}

/// Merges a run of anonymous pages, step by step: freeze, compare, decide, replace, put back,
/// thaw.
fn merge_run(cx: &mut CommitCtx<'_>, run: &Run, store_base: usize, freezer: Freezer<'_>) {
    let acts = &run.acts[..run.n];
    map_copies_before_freeze(acts, store_base);
    let tf = Instant::now();
    // Freeze: from here until `frozen` is dropped, any access to the run blocks in the kernel.
    // SAFETY: the run is registered memory (the period lock keeps its region registered) that the
    // engine holds no reference into; the scratch area is empty (discarded after every run) and
    // only the committer freezes; the fault thread leaves the published run alone.
    let mut frozen = unsafe { FrozenRun::freeze(freezer, run.start, run.n) };
    let tv = Instant::now();
    // Verify on frozen bytes: byte-for-byte, on the workers when the run is long.
    let jobs = compare_jobs(&frozen, acts, store_base);
    let equal = verify_pages(cx.pool, cx.config.workers, jobs);
    let mut guard = lock(&cx.sh.state);
    let mut rs = RunState::of(&mut guard, run.region)
        .expect("the period lock keeps regions registered during a commit");
    let mut verdict = judge(cx, &mut rs, &frozen, acts, &equal);
    let tr = Instant::now();
    replace(cx, &mut rs, &mut frozen, run, &mut verdict);
    settle_unmerged(&mut rs, &mut frozen, run.first_index, &verdict[..run.n]);
    // Put back every moved page that is not merged or released, and free the originals of merged
    // and zero pages before the merges can be seen in the stats (whoever reads them may measure
    // the memory); then let writers in.
    frozen.restore();
    drop(guard);
    let td = Instant::now();
    drop(frozen);
    cx.times[0] += (tv - tf).as_secs_f64();
    cx.times[1] += (tr - tv).as_secs_f64();
    cx.times[2] += (td - tr).as_secs_f64();
}

/// The copies are read through the store's view to be compared: mapped now, before the freeze, by
/// reading one page of each aligned 64 KiB of the view (a read fault maps the pages of the file
/// around it, that much by Linux's default `fault_around_bytes`), instead of faulting during the
/// compare with the run frozen. Cheaper than `MADV_POPULATE_READ`, which walks every page, and
/// than reading every page (measured: docs/benchmarks.md). Pages left unmapped fault in during
/// the compare, as before.
fn map_copies_before_freeze(acts: &[Option<Action>], store_base: usize) {
    let mut k = 0;
    while k < acts.len() {
        let Some((sid, m)) = merge_subrun(acts, k) else {
            k += 1;
            continue;
        };
        let (mut at, end) = (
            store_base + sid as usize * PAGE,
            store_base + (sid as usize + m) * PAGE,
        );
        while at < end {
            // SAFETY: a copy named by this batch stays allocated until the batch is done
            // (see `commit_run`) and lies in the view, a read-only mapping of the store; volatile,
            // as the bytes are another process's to publish.
            unsafe { std::ptr::read_volatile(at as *const u64) };
            at = (at / FAULT_AROUND_BYTES + 1) * FAULT_AROUND_BYTES;
        }
        k += m;
    }
}

/// What [`verify_pages`] compares for each page of the frozen run.
fn compare_jobs(
    frozen: &FrozenRun<'_>,
    acts: &[Option<Action>],
    store_base: usize,
) -> Vec<(usize, usize)> {
    (0..acts.len())
        .map(|k| match (frozen.frozen_page(k), acts[k]) {
            (None, _) => (0, 0),
            (Some(f), Some(Action::Zero)) => (f, 0),
            (Some(f), Some(Action::Merge(sid))) => (f, store_base + sid as usize * PAGE),
            // Checked in `judge` on the mark's three words.
            (Some(_), Some(Action::Recycle(_)) | None) => (0, 0),
        })
        .collect()
}

/// What becomes of each page of the frozen run: released (`Zero`), merged onto its copy
/// (`Merge`, the reference counted now so that the sharing limit holds within the run), or put
/// back (`None`).
fn judge(
    cx: &CommitCtx<'_>,
    rs: &mut RunState<'_>,
    frozen: &FrozenRun<'_>,
    acts: &[Option<Action>],
    equal: &[bool],
) -> [Option<Action>; MAX_RUN] {
    let mut verdict = [None; MAX_RUN];
    for (k, v) in verdict.iter_mut().enumerate().take(acts.len()) {
        let Some(page) = frozen.frozen_page(k) else {
            continue;
        };
        *v = match acts[k] {
            Some(Action::Zero) if equal[k] => Some(Action::Zero),
            // Freed since classification named it (the tree can name a copy of an earlier
            // batch that merged nothing, freed after that batch's commit): mapping it would
            // map a page the store punches or reuses.
            Some(Action::Merge(sid)) if !rs.store.is_allocated(sid) => None,
            Some(Action::Merge(sid)) if rs.store.refs(sid) >= cx.config.max_sharing => {
                rs.store.retire(sid);
                None
            }
            Some(Action::Merge(sid)) if equal[k] => Some(Action::Merge(sid)),
            // Released like a zero page; without its mark (unmarked since), put back.
            Some(Action::Recycle(slot)) => {
                still_marked(cx, page, slot, frozen.start() + k * PAGE).then_some(Action::Zero)
            }
            _ => {
                cx.sh.counters.mismatches.fetch_add(1, Ordering::Relaxed);
                None
            }
        };
        if let Some(Action::Merge(sid)) = *v {
            rs.store.add_ref(sid);
        }
    }
    verdict
}

/// Whether the frozen page at `page`, moved from `addr`, still holds the PPR mark of the ticket
/// of `slot` (then it is released, and counted).
fn still_marked(cx: &CommitCtx<'_>, page: usize, slot: u32, addr: usize) -> bool {
    // SAFETY: `page` is the scratch slot holding the page moved out of the frozen address; only
    // the engine knows the scratch area, so nobody writes it meanwhile.
    let words = [0, 1, 2].map(|w| unsafe { std::ptr::read((page as *const u64).add(w)) });
    let ticket = pageone_recycler::Ticket { slot, addr };
    let marked = cx
        .recycler
        .as_ref()
        .is_some_and(|p| p.is_marked(&ticket, words));
    if marked {
        lock(&cx.sh.recycled_slots).push(slot);
        cx.sh.counters.recycled.fetch_add(1, Ordering::Relaxed);
    }
    marked
}

/// Replaces the pages judged equal: one mapping per subrun of consecutive copies. Mapped pages
/// are consumed; the pages of a subrun that could not be mapped are put back.
fn replace(
    cx: &mut CommitCtx<'_>,
    rs: &mut RunState<'_>,
    frozen: &mut FrozenRun<'_>,
    run: &Run,
    verdict: &mut [Option<Action>; MAX_RUN],
) {
    let mut k = 0;
    while k < run.n {
        let Some((sid, m)) = merge_subrun(&verdict[..run.n], k) else {
            k += 1;
            continue;
        };
        let index = run.first_index + k;
        let coalesces = index > 0 && {
            let left = rs.region.pages[index - 1];
            left.kind == PageKind::Merged && left.sid.wrapping_add(1) == sid
        };
        let cost = if coalesces { 1 } else { 2 };
        // SAFETY: the subrun is frozen (its pages are in scratch) and compared equal to its
        // copies.
        let ok = unsafe { map_copies(cx, rs, Subrun { index, sid, m }, cost) };
        if ok {
            (k..k + m).for_each(|q| frozen.consume(q));
        } else {
            verdict[k..k + m].fill(None);
        }
        k += m;
    }
}

/// Records what became of the run's pages that were not merged: released zero pages (consumed),
/// and pages put back (anonymous again).
fn settle_unmerged(
    rs: &mut RunState<'_>,
    frozen: &mut FrozenRun<'_>,
    first_index: usize,
    verdict: &[Option<Action>],
) {
    for (k, v) in verdict.iter().enumerate() {
        let p = &mut rs.region.pages[first_index + k];
        match v {
            Some(Action::Zero) => {
                frozen.consume(k);
                p.kind = PageKind::Zero;
                p.unchanged = 0;
                *rs.zero += 1;
            }
            Some(Action::Merge(_)) => {}
            // (A verdict is never Recycle: a recycled page's is Zero.)
            None | Some(Action::Recycle(_)) => {
                p.unchanged = 0;
                p.kind = PageKind::Anon;
            }
        }
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
    // `None`: some page is not in a write-protectable mapping; the run is left alone this time.
    let Some(mut held) = ProtectedRun::protect(u2, start, n) else {
        return;
    };
    let mut verdict: [Option<Action>; MAX_RUN] = [None; MAX_RUN];
    // The pages are held still, but read through the kernel all the same (they are the
    // program's mappings: unmapped meanwhile, a read fails instead of faulting).
    let reader = &mut cx.reader;
    for (k, v) in verdict.iter_mut().enumerate().take(n) {
        let Some(Action::Merge(sid)) = run.acts[k] else {
            continue;
        };
        if rs.store.refs(sid) >= cx.config.max_sharing {
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
    let mut k = 0;
    while k < n {
        let Some((sid, m)) = merge_subrun(&verdict[..n], k) else {
            rs.region.pages[run.first_index + k].unchanged = 0;
            k += 1;
            continue;
        };
        let index = run.first_index + k;
        // SAFETY: the subrun's pages are write-protected with writers blocked and equal their
        // copies (compared above).
        if unsafe { map_copies(cx, rs, Subrun { index, sid, m }, 2) } {
            (k..k + m).for_each(|q| held.mark_replaced(q));
        }
        k += m;
    }
    // Dropping `held` lets writers in: it un-protects what was not replaced, then wakes everyone
    // who waited on the run.
}

/// Maps copies `sid..sid + m` over the `m` pages of the run's region from page `index` on, if the
/// VMA budget has room for `cost` more VMAs, and settles every page either way (merged, or its
/// reference taken back and the page backed off). Returns whether the copies were mapped.
///
/// # Safety
///
/// The caller holds the pages still (moved out, or write-protected with writers blocked) and has
/// compared them equal to their copies, so replacing the mapping discards nothing.
unsafe fn map_copies(
    cx: &mut CommitCtx<'_>,
    rs: &mut RunState<'_>,
    sub: Subrun,
    cost: usize,
) -> bool {
    let Subrun { index, sid, m } = sub;
    let sh = cx.sh;
    let addr = rs.region.start + index * PAGE;
    let ok = if !cx.budget.allows(rs.vmas, cost) {
        sh.counters
            .vma_limited
            .fetch_add(m as u64, Ordering::Relaxed);
        false
    } else {
        // SAFETY: the pages are held still and equal their copies (this function's contract).
        match unsafe {
            sys::mmap_private_fixed(
                addr as *mut u8,
                m * PAGE,
                rs.store.fd(),
                sid as u64 * PAGE as u64,
            )
        } {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(error = %e, "merge mapping failed; pages are put back");
                false
            }
        }
    };
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
        watch_store_mapping(sh, addr, m);
    }
    ok
}

/// Registers a new mapping of the store with the store mappings' userfaultfd, so that its pages
/// can be frozen for a new merge if they are COW-broken later. Failing only costs that.
fn watch_store_mapping(sh: &Shared, addr: usize, pages: usize) {
    if let Some(u) = &sh.store_uffd {
        if let Err(e) = u.register(addr, pages * PAGE, UFFDIO_REGISTER_MODE_WP) {
            tracing::debug!(error = %e, "store mapping not write-protectable; it will not be re-merged");
        }
    }
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
    recounted: bool,
}

impl VmaBudget {
    fn new(budget: usize) -> Self {
        Self {
            budget,
            recounted: false,
        }
    }

    /// Whether `cost` more VMAs fit; `vmas` is the engine's count, corrected here if need be.
    fn allows(&mut self, vmas: &mut usize, cost: usize) -> bool {
        if *vmas + cost <= self.budget {
            return true;
        }
        if !self.recounted {
            self.recounted = true;
            if let Ok(n) = sys::map_count() {
                *vmas = n;
            }
        }
        *vmas + cost <= self.budget
    }
}

/// Compares frozen pages: `(frozen, copy)` pairs, `copy == 0` meaning "is it all zero?", and
/// `frozen == 0` meaning "not moved" (false). Long runs are split over the workers.
fn verify_pages(pool: &Pool, workers: usize, jobs: Vec<(usize, usize)>) -> Vec<bool> {
    fn check(frozen: usize, copy: usize) -> bool {
        if frozen == 0 {
            return false;
        }
        // SAFETY: `frozen` is a scratch page holding a page moved in by the committer, which waits
        // for this check; only the engine knows the scratch area, so nobody writes it meanwhile.
        let f = unsafe { std::slice::from_raw_parts(frozen as *const u8, PAGE) };
        if copy == 0 {
            return f.iter().all(|&b| b == 0);
        }
        // SAFETY: `copy` is a published stable copy: the store is written only before
        // publication, so it is immutable while referenced here.
        let c = unsafe { std::slice::from_raw_parts(copy as *const u8, PAGE) };
        f == c
    }
    let parts = workers.clamp(1, pool.size());
    if jobs.len() < 64 || parts == 1 {
        return jobs.iter().map(|&(f, c)| check(f, c)).collect();
    }
    let n = jobs.len();
    let mut equal: Vec<bool> = pool
        .map_parts(parts, Arc::new(jobs), |_, jobs| {
            jobs.iter().map(|&(f, c)| check(f, c)).collect::<Vec<_>>()
        })
        .into_iter()
        .flatten()
        .flatten()
        .collect();
    // A part that did not report (a bug) verifies nothing: nothing is merged.
    if equal.len() != n {
        equal = vec![false; n];
    }
    equal
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
}
