//! Read-ahead: the pages of a newly registered range are read on the workers while they wait out
//! their unchanged periods, so that when they are candidates their classification is done and
//! their period's batches are ordered by content.

use std::sync::{Arc, Mutex, MutexGuard};

use pageone_sync::lock;
use pageone_sys::uapi::*;

use crate::access::{classify_bytes, PageReader, Pre, PAGE};
use crate::candidates::{Candidate, PagePre};
use crate::config::WatchMode;
use crate::pool::Pool;
use crate::state::{PageKind, Shared, State};
use crate::watch::present_pages;

/// Pages read ahead per part of a read-ahead job (small parts, so that other submitters' parts
/// are not held up long behind them).
const AHEAD_PART: usize = 1024;
/// Most pages read ahead and not yet used, over all registrations (24 bytes each while kept):
/// beyond that, pages are read when they are candidates, as without read-ahead.
const AHEAD_MAX_PAGES: usize = 512 * 1024;
/// Periods read-ahead results are kept after they were installed: pages are due two periods
/// after registration, one more when registration fell just before a scan. (Epochs count writes
/// in a `u8`: results must not outlive a wrap-around either.)
const AHEAD_PERIODS: u32 = 4;

/// The results of one read-ahead part: present pages in address order, with what reading each
/// found.
type AheadPart = Vec<PagePre>;

/// A read-ahead queued on the workers: its address range and, per part of `AHEAD_PART` pages,
/// where the part puts its results.
pub(crate) struct AheadJob {
    done: crate::pool::Pending,
    start: usize,
    end: usize,
    parts: Arc<Vec<Mutex<AheadPart>>>,
    /// The store's allocation mark when the job started (see `AheadBlock::allocation_mark`).
    allocation_mark: u64,
}

/// Results of a finished read-ahead of `[start, end)`: `parts[k]` holds, in address order, the
/// present pages of the range's `k`th `AHEAD_PART` pages with what reading them found.
pub(crate) struct AheadBlock {
    start: usize,
    end: usize,
    parts: Vec<AheadPart>,
    /// The store's allocation mark when the read began: a stable copy found then and given out
    /// again since may hold other bytes now (freed and reused), and is not proposed.
    allocation_mark: u64,
}

impl AheadBlock {
    fn pages(&self) -> usize {
        self.parts.iter().map(Vec::len).sum()
    }
}

/// Reads the present pages of a newly registered range on the workers, in what is otherwise idle
/// time (the range's pages wait two whole periods before they are candidates): zero, equal to a
/// stable copy, or else their hash. A page unwritten until it is a candidate skips that work, and
/// its period's batches are ordered by content. The reads come after the range was armed, so any
/// write after a read is seen by the watch (the page's epoch changes and the result is not used);
/// every result is a hint only, as every merge is verified on frozen bytes.
///
/// Each part finds its own present pages (`PAGEMAP_SCAN`), so registering costs only the
/// queueing: the registering thread is the program's own.
pub(crate) fn read_ahead(st: &mut State, pool: &Pool, start: usize, end: usize, mode: WatchMode) {
    let room = AHEAD_MAX_PAGES.saturating_sub(ahead_pages(st));
    let end = end.min(start + room * PAGE);
    if end <= start {
        return;
    }
    // Allocated here, filled by the workers: results live in this thread's heap, not in the
    // workers' malloc arenas (which kept the memory after it was freed).
    let pages = (end - start) / PAGE;
    let n_parts = pages.div_ceil(AHEAD_PART);
    let parts: Arc<Vec<Mutex<AheadPart>>> = Arc::new(
        (0..n_parts)
            .map(|k| Mutex::new(Vec::with_capacity(AHEAD_PART.min(pages - k * AHEAD_PART))))
            .collect(),
    );
    let tree = st.store.local_index();
    let store_base = st.store.addr(0);
    let allocation_mark = st.store.allocation_mark();
    let pagemap = st.pagemap.clone();
    let out = parts.clone();
    let done = pool.spawn(
        n_parts,
        Arc::new(move |part| {
            let lo = start + part * AHEAD_PART * PAGE;
            let hi = (lo + AHEAD_PART * PAGE).min(end);
            // Only present pages (reading a missing one would fault it in), neither the zero
            // page nor a file page.
            let mut found = Vec::new();
            if pagemap
                .scan(lo, hi, &present_pages(mode), &mut found)
                .is_err()
            {
                return;
            }
            let mut reader = PageReader::new();
            let mut res = lock(&out[part]);
            let addrs = found
                .iter()
                .filter(|r| r.categories & (PAGE_IS_PFNZERO | PAGE_IS_FILE) == 0)
                .flat_map(|r| (r.start as usize..r.end as usize).step_by(PAGE));
            reader.read_each(addrs, |addr, bytes| {
                let pre = bytes.map_or(Pre::None, |b| {
                    classify_bytes(b, tree.as_deref(), store_base)
                });
                res.push(PagePre::new(addr, pre));
            });
        }),
    );
    st.ahead_jobs.push(AheadJob {
        done,
        start,
        end,
        parts,
        allocation_mark,
    });
}

/// Pages read ahead or being read, whose results are kept.
pub(crate) fn ahead_pages(st: &State) -> usize {
    st.ahead_jobs
        .iter()
        .map(|j| (j.end - j.start) / PAGE)
        .sum::<usize>()
        + st.ahead.iter().map(AheadBlock::pages).sum::<usize>()
}

/// Waits for the read-ahead jobs (they read registered pages, which must stay mapped meanwhile)
/// and drops every result: called when regions are unregistered (the same addresses may be
/// registered again, with page epochs starting over).
pub(crate) fn forget_read_ahead(st: &mut State) {
    for j in st.ahead_jobs.drain(..) {
        j.done.wait();
    }
    st.ahead = Vec::new();
}

/// Installs the results of finished read-ahead jobs (of all of them when `wait`), and gives the
/// candidates that are ANON pages unwritten since their read the result.
pub(crate) fn use_read_ahead(sh: &Shared, cands: &mut [Candidate], wait: bool) {
    let mut st = install_read_ahead(sh, wait);
    if st.ahead.is_empty() || cands.is_empty() {
        return;
    }
    let State {
        ahead,
        regions,
        store,
        ..
    } = &mut *st;
    // Candidates and blocks are in address order; blocks do not overlap (one per registration).
    // A block whose pages all came up as candidates has served: it is dropped now (it holds 24
    // bytes per page).
    let mut used = vec![0usize; ahead.len()];
    // The block, its part and the position in it that the next candidate is looked up from.
    let (mut bi, mut pi, mut at) = (0, usize::MAX, 0);
    for c in cands.iter_mut() {
        while ahead.get(bi).is_some_and(|b| b.end <= c.addr()) {
            bi += 1;
            pi = usize::MAX;
        }
        let Some(b) = ahead.get(bi) else {
            break;
        };
        if c.addr() < b.start {
            continue;
        }
        let part = (c.addr() - b.start) / (AHEAD_PART * PAGE);
        if part != pi {
            (pi, at) = (part, 0);
        }
        let Some(p) = b.parts.get(part) else {
            continue;
        };
        while p.get(at).is_some_and(|e| e.addr() < c.addr()) {
            at += 1;
        }
        let Some(pre) = p.get(at).filter(|e| e.addr() == c.addr()).map(PagePre::pre) else {
            continue;
        };
        used[bi] += 1;
        let fresh = regions
            .get(&c.region)
            .and_then(|r| r.pages.get(c.index()))
            .is_some_and(|p| p.kind == PageKind::Anon && p.epoch == 0);
        let stale =
            matches!(pre, Pre::Stable(id) if store.reallocated_since(id, b.allocation_mark));
        if fresh && !stale {
            c.set_pre(pre);
        }
    }
    let mut k = 0;
    ahead.retain(|b| {
        k += 1;
        used[k - 1] < b.pages()
    });
}

/// Installs the results of finished read-ahead jobs (of all of them when `wait`); results kept
/// more than `AHEAD_PERIODS` periods without new ones are dropped. Returns the state lock.
fn install_read_ahead(sh: &Shared, wait: bool) -> MutexGuard<'_, State> {
    let jobs: Vec<AheadJob> = {
        let mut st = lock(&sh.state);
        let (done, running): (Vec<_>, Vec<_>) = std::mem::take(&mut st.ahead_jobs)
            .into_iter()
            .partition(|j| wait || j.done.is_done());
        st.ahead_jobs = running;
        done
    };
    let mut st = lock(&sh.state);
    if !jobs.is_empty() {
        // Waited for without the state lock: the jobs do not take it.
        drop(st);
        for j in &jobs {
            j.done.wait();
        }
        let blocks: Vec<AheadBlock> = jobs
            .into_iter()
            .map(|j| AheadBlock {
                start: j.start,
                end: j.end,
                allocation_mark: j.allocation_mark,
                parts: j
                    .parts
                    .iter()
                    .map(|p| std::mem::take(&mut *lock(p)))
                    .collect(),
            })
            .collect();
        st = lock(&sh.state);
        st.ahead.extend(blocks);
        st.ahead.sort_unstable_by_key(|b| b.start);
        st.ahead_age = 0;
    } else if !st.ahead.is_empty() {
        st.ahead_age += 1;
        if st.ahead_age > AHEAD_PERIODS {
            st.ahead = Vec::new();
        }
    }
    st
}
