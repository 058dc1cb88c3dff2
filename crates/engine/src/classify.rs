//! Classification: what to do with each candidate of a batch, decided on the worker threads.
//!
//! Zero pages first: an all-zero candidate is released without touching any index. Then the
//! stable index is searched; pages not found are grouped by an xxh3-128 hash of their contents,
//! with each other and with the first sightings of earlier periods (and, with a daemon, with what
//! the scope's other processes have). Each group of two or more gets a new stable copy; copies of
//! a run of pages get consecutive ids. Singletons wait in the first-sighting map.
//!
//! The state lock is taken only to group first sightings and to record the new copies; reading
//! pages, writing copies and indexing them run without it, so the committer works meanwhile.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, MutexGuard};
use std::time::Instant;

use pageone_index::{KeyId, SdTree};
use pageone_sync::lock;

use crate::access::{classify_bytes, joined, stable_copy, HashOfHash, PageReader, Pre, PAGE};
use crate::candidates::{push_candidate, Action, Candidate, CandidateSet};
use crate::config::{Config, WatchMode};
use crate::pool::Pool;
use crate::proto;
use crate::remote::{Offers, Remote};
use crate::sightings::take_waiting;
use crate::state::{PageKind, Shared, State};
use crate::store::{Store, StoreKeys};
use crate::stripes::{self, Room};
use crate::zero_holes::{self, Slot};

/// A batch classified and ready for the committer.
pub(crate) struct Classified {
    pub(crate) cands: Vec<Candidate>,
    pub(crate) actions: Vec<Option<Action>>,
    /// Copies made for this batch; those that merged nothing are freed after its commit.
    pub(crate) new_copies: Vec<KeyId>,
    /// The copies this batch made of its own pages (not those another process made): the
    /// first page to take each is the one it was made of, whose merge says nothing of where its
    /// duplicates lie (see `ksm::better_with_ksm`).
    pub(crate) made_here: Vec<KeyId>,
}

/// What classification needs of the store without its lock: fixed for the engine's life.
pub(crate) struct StoreView {
    /// The stable tree; `None` with a daemon (see `Store::local_index`).
    pub(crate) tree: Option<Arc<SdTree<StoreKeys>>>,
    pub(crate) base: usize,
    pub(crate) fd: i32,
    pub(crate) remote: Option<Arc<Remote>>,
}

/// Which waiting first sightings to ask the daemon about again in a batch.
#[derive(Clone, Copy)]
pub(crate) struct Relook {
    pub(crate) skip: usize,
    pub(crate) take: usize,
}

/// What classifying one batch works with.
struct Ctx<'a> {
    sh: &'a Shared,
    view: &'a StoreView,
    pool: &'a Pool,
    /// Parts the work on the workers is split into.
    parts: usize,
}

/// Decides, on the worker threads, what to do with each candidate (adding UNIQUE pages of earlier
/// periods that turn out to be duplicates).
pub(crate) fn classify(
    sh: &Shared,
    view: &StoreView,
    config: &Config,
    cands: Vec<Candidate>,
    pool: &Pool,
    relook: Option<Relook>,
) -> Classified {
    let t_start = Instant::now();
    let cx = Ctx {
        sh,
        view,
        pool,
        parts: config.workers.clamp(1, pool.size()),
    };
    // Phase 1: zero check, stable index, hash of first sightings.
    let read = read_batch(&cx, &cands);
    let t_phase1 = Instant::now();
    tracing::debug!(
        phase1_ms = (t_phase1 - t_start).as_secs_f64() * 1e3,
        "classify"
    );
    let Some(FirstRead { actions, hashes }) = read else {
        // A worker failed (it cannot, short of a bug): merge nothing in this batch.
        let n = cands.len();
        return Classified {
            cands,
            actions: vec![None; n],
            new_copies: Vec::new(),
            made_here: Vec::new(),
        };
    };
    // Phase 2: group first sightings by hash, with this period's candidates and with the UNIQUE
    // pages of earlier periods (and across processes); each group of two or more gets a stable
    // copy, in address order so that runs of pages get runs of ids. Singletons become UNIQUE and
    // wait in the map.
    let mut g = Grouping::new(cands, actions, hashes.len());
    let mut guard = lock(&sh.state);
    g.pair(&mut guard, &hashes);
    if let Some(remote) = &view.remote {
        guard = g.ask_daemon(&cx, guard, remote, relook);
    }
    g.wait_alone(&mut guard, config.max_backoff);
    g.add_zero_gaps(&cx, &guard);
    // A copy serves at most `max_sharing` pages of this process: larger groups, and groups whose
    // adopted copy is (nearly) full here, are split; each further chunk is led by a page that
    // gets a copy of its own (a fresh one: through the daemon, it must not be deduplicated back
    // onto the full copy).
    let fresh = split_groups(&mut g, &guard.store, config.max_sharing);
    // Their copies are not indexed: the tree would answer with the full copy of that content.
    let mut chunk_leaders = CandidateSet::default();
    for &l in &fresh {
        chunk_leaders.insert(l);
    }
    if g.groups.is_empty() && g.adopted.is_empty() && fresh.is_empty() {
        return g.classified(Vec::new(), Vec::new());
    }
    // New copies lie in the order the pages, in address order, first take them: runs of pages
    // map runs of copies (a stripe in turn, interleaved contents' copies in turn).
    let first_use = g.first_use(&fresh);
    let t_group = Instant::now();
    let mut copies = g.copies(&cx, guard, fresh, &first_use);
    write_local_copies(&cx, &mut copies);
    let t_copy = Instant::now();
    let (mut new_copies, made_here) = g.publish(&cx, &copies.todo, &chunk_leaders);
    // The committer merges zero pages onto the holes between the copies around them (this
    // batch's or a later one's); those left unmapped are freed after the commit.
    new_copies.extend(copies.holes.iter().map(|&(_, id)| id));
    if let Some(remote) = &view.remote {
        new_copies.extend(g.hold_remote_holes(&cx, remote));
    }
    tracing::debug!(
        phase1_to_group_ms = (t_group - t_phase1).as_secs_f64() * 1e3,
        copy_ms = (t_copy - t_group).as_secs_f64() * 1e3,
        publish_ms = t_copy.elapsed().as_secs_f64() * 1e3,
        "classify"
    );
    g.classified(new_copies, made_here)
}

/// A candidate as phase 1 reads it.
#[derive(Clone, Copy)]
struct Item {
    addr: usize,
    pre: Pre,
    /// Read ahead, and alone of its content in the batch.
    alone: bool,
}

/// What phase 1 found: an action for each candidate (zero, or a stable copy), and the hashes of
/// the others with their candidate numbers, in candidate order.
struct FirstRead {
    actions: Vec<Option<Action>>,
    hashes: Vec<(u128, u32)>,
}

/// Phase 1, on the workers: zero check, stable index, hash of first sightings (done already for
/// pages read ahead). `None` if a worker did not report.
fn read_batch(cx: &Ctx<'_>, cands: &[Candidate]) -> Option<FirstRead> {
    // A page read ahead whose content is alone in this batch may have a stable copy published
    // since its read: it looks in the tree as usual (the others are grouped by their hash).
    // (With a daemon there is no tree here: the daemon is asked by hash either way.)
    let mut in_batch: HashMap<u128, bool, HashOfHash> = HashMap::default();
    for c in cands.iter().filter(|_| cx.view.tree.is_some()) {
        if let Pre::Hash(h) = c.pre() {
            in_batch
                .entry(joined(h))
                .and_modify(|alone| *alone = false)
                .or_insert(true);
        }
    }
    let items: Arc<Vec<Item>> = Arc::new(
        cands
            .iter()
            .map(|c| {
                let alone = match c.pre() {
                    Pre::Hash(h) => in_batch.get(&joined(h)).copied().unwrap_or(true),
                    _ => false,
                };
                Item {
                    addr: c.addr(),
                    pre: c.pre(),
                    alone,
                }
            })
            .collect(),
    );
    drop(in_batch);
    let tree = cx.view.tree.clone();
    let store_base = cx.view.base;
    let parts_out = cx.pool.map_parts(cx.parts, items, move |lo, items| {
        let mut acts = Vec::with_capacity(items.len());
        let mut hs = Vec::new();
        // Pages not read ahead are read now, the same way; a page read ahead and alone in the
        // batch is read again to look in the tree.
        let mut pres: Vec<Pre> = items.iter().map(|i| i.pre).collect();
        let reread = |i: &Item| match i.pre {
            Pre::None => true,
            Pre::Hash(_) => i.alone && tree.is_some(),
            _ => false,
        };
        let todo = (0..items.len()).filter(|&k| reread(&items[k]));
        let mut reader = PageReader::new();
        let mut next = todo.clone();
        reader.read_each(todo.map(|k| items[k].addr), |_, bytes| {
            let k = next.next().expect("one result per page read");
            pres[k] = match (items[k].pre, bytes) {
                (_, None) => Pre::None,
                (Pre::None, Some(b)) => classify_bytes(b, tree.as_deref(), store_base),
                (p, Some(b)) => match tree.as_deref().and_then(|t| stable_copy(b, t, store_base)) {
                    Some(id) => Pre::Stable(id),
                    None => p,
                },
            };
        });
        for (k, &pre) in pres.iter().enumerate() {
            match pre {
                Pre::Zero => acts.push(Some(Action::Zero)),
                Pre::Stable(id) => acts.push(Some(Action::Merge(id))),
                Pre::Hash(h) => {
                    acts.push(None);
                    hs.push((joined(h), (lo + k) as u32));
                }
                Pre::None => acts.push(None),
            }
        }
        (acts, hs)
    });
    let mut actions: Vec<Option<Action>> = Vec::with_capacity(cands.len());
    let mut hashes: Vec<(u128, u32)> = Vec::new();
    for (mut a, mut h) in parts_out.into_iter().flatten() {
        actions.append(&mut a);
        hashes.append(&mut h);
    }
    (actions.len() == cands.len()).then_some(FirstRead { actions, hashes })
}

/// A batch being grouped by content: its candidates (waiting first sightings join them as they
/// pair up), their actions, and the groups found. Candidates are named by their number.
struct Grouping {
    cands: Vec<Candidate>,
    actions: Vec<Option<Action>>,
    /// Per hash: its first candidate, and whether that leads a group (of two pages or more, or
    /// of a copy made elsewhere).
    first: HashMap<u128, (u32, bool), HashOfHash>,
    /// The first candidate of each group that needs a new copy.
    groups: Vec<u32>,
    /// The other pages of groups: (candidate, first).
    member_of: Vec<(u32, u32)>,
    /// Candidates that adopt a copy the daemon holds: (candidate, slot).
    adopted: Vec<(u32, KeyId)>,
    /// Zero pages given zero holes between new copies: (candidate, id).
    holes: Vec<(u32, KeyId)>,
}

/// A hash asked about at the daemon: its first candidate, and whether that leads a group.
struct Asked {
    hash: u128,
    first: u32,
    grouped: bool,
}

/// The copy the first candidate of a group gets, made for this batch (`is_new`) or not, and
/// whether it was made of this batch's own pages (`made_here`: not a copy another process made).
#[derive(Clone, Copy)]
struct GroupCopy {
    first: u32,
    id: KeyId,
    is_new: bool,
    made_here: bool,
}

/// Where the pages of a batch, in address order, first take each new copy, by the page leading
/// it (see `Grouping::first_use`).
struct FirstUse(HashMap<u32, usize>);

impl FirstUse {
    /// The address of the first page that takes the copy `leader` leads.
    fn at(&self, leader: u32) -> usize {
        self.0.get(&leader).copied().unwrap_or(usize::MAX)
    }

    /// Puts `leaders` in the order pages first take their copies.
    fn sort(&self, leaders: &mut [u32]) {
        leaders.sort_unstable_by_key(|&l| (self.at(l), l));
    }
}

/// The copies of a batch's groups, and the local ones still to be written (`srcs[k]` into
/// `to_write[k]`).
struct Copies {
    todo: Vec<GroupCopy>,
    srcs: Vec<usize>,
    to_write: Option<Vec<KeyId>>,
    /// Zero holes between the new copies: (candidate, id), never written.
    holes: Vec<(u32, KeyId)>,
}

impl Grouping {
    fn new(cands: Vec<Candidate>, actions: Vec<Option<Action>>, hashes: usize) -> Self {
        Grouping {
            cands,
            actions,
            first: HashMap::with_capacity_and_hasher(hashes, HashOfHash::default()),
            groups: Vec::new(),
            member_of: Vec::new(),
            adopted: Vec::new(),
            holes: Vec::new(),
        }
    }

    fn classified(self, new_copies: Vec<KeyId>, made_here: Vec<KeyId>) -> Classified {
        Classified {
            cands: self.cands,
            actions: self.actions,
            new_copies,
            made_here,
        }
    }

    /// Groups the batch's first sightings (`hashes`, in candidate order: parts are consecutive
    /// chunks, appended in order) with each other and with the UNIQUE pages of earlier periods.
    fn pair(&mut self, st: &mut State, hashes: &[(u128, u32)]) {
        for &(h, i) in hashes {
            if let Some((f, grouped)) = self.first.get_mut(&h) {
                if !*grouped {
                    *grouped = true;
                    self.groups.push(*f);
                }
                self.member_of.push((i, *f));
                continue;
            }
            if let Some(c) = take_waiting(st, h) {
                let j = push_candidate(&mut self.cands, &mut self.actions, c);
                self.first.insert(h, (i, true));
                self.groups.push(i);
                self.member_of.push((j, i));
                continue;
            }
            self.first.insert(h, (i, false));
        }
    }

    /// Across processes: asks the scope's daemon about this batch's first sightings. A hash with
    /// a copy is adopted (no copy made here); one another process noted is copied even when
    /// single here; the rest wait as before. Offers are copies made for content this process
    /// noted. The call is made without the state lock (the committer goes on meanwhile; it does
    /// not touch the first-sighting map nor pages waiting in it): the lock is given back taken
    /// again.
    fn ask_daemon<'s>(
        &mut self,
        cx: &Ctx<'s>,
        guard: MutexGuard<'s, State>,
        remote: &Remote,
        relook: Option<Relook>,
    ) -> MutexGuard<'s, State> {
        let asked: Vec<Asked> = self
            .first
            .iter()
            .map(|(&hash, &(first, grouped))| Asked {
                hash,
                first,
                grouped,
            })
            .collect();
        let mut hs: Vec<u128> = asked.iter().map(|k| k.hash).collect();
        // Pages waiting in the first-sighting map are asked about again now and then: the copy
        // another process was to make for them may have come out under another hash (its page
        // changed), and then no offer ever comes.
        if let Some(r) = relook {
            let n = guard.unstable.len();
            hs.extend(
                guard
                    .unstable
                    .keys()
                    .cycle()
                    .skip(r.skip % n.max(1))
                    .take(r.take.min(n))
                    .filter(|h| !self.first.contains_key(h)),
            );
        }
        drop(guard);
        let reply = remote.lookup(&hs);
        let mut guard = lock(&cx.sh.state);
        if let Some((answers, offers)) = reply {
            let st = &mut *guard;
            let n = asked.len();
            self.take_relooked(st, &hs[n..], &answers[n..]);
            self.take_answers(st, &asked, &answers);
            self.take_offers(st, offers);
        }
        guard
    }

    /// The daemon's answers about waiting pages asked about again: a page still waiting joins the
    /// batch, to be copied or to adopt the copy found.
    fn take_relooked(&mut self, st: &mut State, hashes: &[u128], answers: &[u32]) {
        for (&h, &a) in hashes.iter().zip(answers) {
            if a == proto::NOTED {
                continue;
            }
            match (take_waiting(st, h), a) {
                (Some(c), _) => {
                    let j = push_candidate(&mut self.cands, &mut self.actions, c);
                    self.first.insert(h, (j, true));
                    if a == proto::WANTED {
                        self.groups.push(j);
                    } else {
                        self.adopted.push((j, a));
                    }
                }
                // Not usable any more: give the hold back (unless this process holds it).
                (None, slot) if slot != proto::WANTED => {
                    if st.store.adopt(slot) == Some(true) {
                        st.store.unadopt(slot);
                    }
                }
                (None, _) => {}
            }
        }
    }

    /// The daemon's answers about this batch's first sightings.
    fn take_answers(&mut self, st: &mut State, asked: &[Asked], answers: &[u32]) {
        let mut taken = CandidateSet::default();
        for (
            &Asked {
                hash: h,
                first: i,
                grouped,
            },
            &a,
        ) in asked.iter().zip(answers)
        {
            match a {
                proto::NOTED => {
                    // A page still on a replaced store gets a copy here even alone of its
                    // content: it is a merge already (a copy of its own costs no memory),
                    // and the replaced store is freed once no page maps it.
                    let c = &self.cands[i as usize];
                    let foreign = st.store.has_replaced()
                        && st
                            .regions
                            .get(&c.region)
                            .and_then(|r| r.pages.get(c.index()))
                            .is_some_and(|p| p.kind == PageKind::Foreign);
                    if foreign && !grouped {
                        self.first.insert(h, (i, true));
                        self.groups.push(i);
                    }
                }
                proto::WANTED => {
                    if !grouped {
                        self.first.insert(h, (i, true));
                        self.groups.push(i);
                    }
                }
                slot => {
                    self.first.insert(h, (i, true));
                    taken.insert(i);
                    self.adopted.push((i, slot));
                }
            }
        }
        self.groups.retain(|&g| !taken.contains(g));
    }

    /// Copies other processes made for content waiting here: its page joins the batch to adopt
    /// them.
    fn take_offers(&mut self, st: &mut State, offers: Offers) {
        let aside = std::mem::take(&mut st.offers_aside);
        for (h, slot) in offers.into_iter().chain(aside) {
            match take_waiting(st, h) {
                Some(c) => {
                    st.offered = true;
                    let j = push_candidate(&mut self.cands, &mut self.actions, c);
                    self.adopted.push((j, slot));
                }
                // Not usable any more: give the hold back (unless this process holds it anyway).
                None => {
                    if st.store.adopt(slot) == Some(true) {
                        st.store.unadopt(slot);
                    }
                }
            }
        }
    }

    /// Candidates alone of their content become UNIQUE and wait in the first-sighting map.
    fn wait_alone(&self, st: &mut State, max_backoff: u8) {
        // Room for the new first sightings at once (a map larger than its entries need would have
        // them spread over more fresh memory).
        st.unstable.reserve(
            self.first
                .values()
                .filter(|&&(_, grouped)| !grouped)
                .count(),
        );
        for (&h, &(i, grouped)) in &self.first {
            if !grouped {
                let c = &self.cands[i as usize];
                let page = st
                    .regions
                    .get_mut(&c.region)
                    .and_then(|r| r.pages.get_mut(c.index()));
                if let Some(p) = page {
                    p.unchanged = 0;
                    if !p.kind.in_store_mapping() {
                        p.kind = PageKind::Unique;
                        st.unstable.insert(h, c.addr(), p.epoch);
                    } else {
                        // A COW-broken page is re-hashed when it is a candidate again instead;
                        // each miss doubles the wait (to max_backoff periods), so the many unique
                        // pages a booting guest rewrites do not cost a hash and a lookup every two
                        // periods.
                        p.back_off(max_backoff);
                    }
                    st.unshared += 1;
                }
            }
        }
    }

    /// The copies of the groups (`groups`, then the leaders of `fresh` copies, each in the order
    /// pages first take them: see `first_use`), then the adopted slots. Local copies are only
    /// allocated here: they are written without the lock, their ids being this batch's alone
    /// until published. With a daemon, it makes them, asked without the lock. Releases the state
    /// lock.
    fn copies<'s>(
        &mut self,
        cx: &Ctx<'s>,
        mut guard: MutexGuard<'s, State>,
        fresh: Vec<u32>,
        first_use: &FirstUse,
    ) -> Copies {
        let (made, srcs, to_write) = match &cx.view.remote {
            Some(remote) => {
                if self.groups.is_empty() && fresh.is_empty() {
                    (Vec::new(), Vec::new(), None)
                } else {
                    let zero_at = self.zero_pages_for_holes(cx, &guard);
                    drop(guard);
                    let (made, holes) = self.copy_remote(remote, fresh, first_use, &zero_at);
                    let holes: Vec<_> = holes
                        .into_iter()
                        .map(|(c, slot)| (c, slot, crate::store::reads_zero(cx.view.fd, slot)))
                        .collect();
                    guard = lock(&cx.sh.state);
                    let st = &mut *guard;
                    let made = made
                        .into_iter()
                        .map(|s| {
                            let id = s?;
                            st.store.adopt(id).map(|fresh| (id, fresh))
                        })
                        .collect();
                    self.adopt_holes(st, holes);
                    (made, Vec::new(), None)
                }
            }
            None => {
                let (made, srcs, ids) = self.alloc_local(cx, &mut guard, fresh, first_use);
                let made = made.into_iter().map(|id| Some((id?, true))).collect();
                (made, srcs, Some(ids))
            }
        };
        let st = &mut *guard;
        let mut todo = Vec::with_capacity(self.groups.len() + self.adopted.len());
        for (&g, m) in self.groups.iter().zip(made) {
            if let Some((id, fresh)) = m {
                todo.push(GroupCopy {
                    first: g,
                    id,
                    is_new: fresh,
                    made_here: true,
                });
            }
        }
        for &(i, slot) in &self.adopted {
            if let Some(fresh) = st.store.adopt(slot) {
                todo.push(GroupCopy {
                    first: i,
                    id: slot,
                    is_new: fresh,
                    made_here: false,
                });
            }
        }
        Copies {
            todo,
            srcs,
            to_write,
            holes: std::mem::take(&mut self.holes),
        }
    }

    /// Where the pages of the batch, in address order, first take each new copy (by the page
    /// leading it: a group's leader, or a fresh copy's): the lowest address of the pages that
    /// take it.
    fn first_use(&self, fresh: &[u32]) -> FirstUse {
        let addr_of = |c: u32| self.cands[c as usize].addr();
        let mut first: HashMap<u32, usize> = self
            .groups
            .iter()
            .chain(fresh)
            .map(|&l| (l, addr_of(l)))
            .collect();
        for &(c, l) in &self.member_of {
            if let Some(a) = first.get_mut(&l) {
                *a = (*a).min(addr_of(c));
            }
        }
        FirstUse(first)
    }

    /// Has the daemon make the groups' copies (deduplicated in the scope), then the `fresh` ones
    /// (never deduplicated; the daemon gives a request's slots side by side where its store
    /// allows), each request in the order pages first take them. Their leaders join `groups`;
    /// the slots, in the order of `groups`. Zero pages of `zero_at` lying between the groups'
    /// copies (see the `zero_holes` module) go with them, and the daemon makes each a zero hole
    /// of its own: `(candidate, slot)` of those it gave a slot.
    fn copy_remote(
        &mut self,
        remote: &Remote,
        mut fresh: Vec<u32>,
        first_use: &FirstUse,
        zero_at: &HashMap<usize, u32>,
    ) -> (Vec<Option<KeyId>>, Vec<(u32, KeyId)>) {
        first_use.sort(&mut self.groups);
        first_use.sort(&mut fresh);
        let addr_of = |g: &u32| self.cands[*g as usize].addr();
        let at: Vec<usize> = self.groups.iter().map(|&l| first_use.at(l)).collect();
        let layout = zero_holes::lay_out(&at, zero_at);
        let srcs: Vec<usize> = layout
            .iter()
            .map(|s| match *s {
                Slot::Copy(j) => addr_of(&self.groups[j]),
                Slot::Hole(c) => self.cands[c as usize].addr(),
            })
            .collect();
        let fresh_srcs: Vec<usize> = fresh.iter().map(addr_of).collect();
        let mut slots = vec![None; self.groups.len()];
        let mut holes = Vec::new();
        for (s, got) in layout.iter().zip(remote.copy(&srcs, false)) {
            match *s {
                Slot::Copy(j) => slots[j] = got,
                Slot::Hole(c) => holes.extend(got.map(|slot| (c, slot))),
            }
        }
        slots.extend(remote.copy(&fresh_srcs, true));
        self.groups.append(&mut fresh);
        (slots, holes)
    }

    /// With a daemon, zero pages of the batch between two of its merges whose copies lie
    /// around zero holes that another process had made (see `zero_holes::between_merges`):
    /// the daemon holds those holes for this process too, so that the committer merges the
    /// zero pages onto them. Returns the holes taken (freed after the commit if unmapped).
    fn hold_remote_holes(&mut self, cx: &Ctx<'_>, remote: &Remote) -> Vec<KeyId> {
        let wanted = {
            let st = lock(&cx.sh.state);
            let zero_at = self.zero_pages_for_holes(cx, &st);
            if zero_at.is_empty() {
                return Vec::new();
            }
            let merged: HashMap<usize, KeyId> = self
                .cands
                .iter()
                .zip(&self.actions)
                .filter_map(|(c, a)| match a {
                    Some(Action::Merge(id)) => Some((c.addr(), *id)),
                    _ => None,
                })
                .collect();
            let mut wanted = zero_holes::between_merges(&merged, &zero_at);
            // Those known here already: a zero hole needs no asking, and a copy is no hole.
            wanted.retain(|&(_, h)| !st.store.is_allocated(h));
            wanted
        };
        if wanted.is_empty() {
            return Vec::new();
        }
        let slots: Vec<u32> = wanted.iter().map(|&(_, h)| h).collect();
        let held: Vec<_> = wanted
            .iter()
            .zip(remote.hold_holes(&slots))
            .filter_map(|(&(c, _), got)| got.map(|h| (c, h)))
            .map(|(c, h)| (c, h, crate::store::reads_zero(cx.view.fd, h)))
            .collect();
        let before = self.holes.len();
        self.adopt_holes(&mut lock(&cx.sh.state), held);
        self.holes[before..].iter().map(|&(_, h)| h).collect()
    }

    /// Takes the slots the daemon gave this batch's zero pages, `(candidate, slot, whether it
    /// reads zeros)`: those new here and reading zeros are zero holes, which join `holes`; the
    /// others are given back (a daemon that answered with a copy of zero content instead).
    fn adopt_holes(&mut self, st: &mut State, holes: Vec<(u32, KeyId, bool)>) {
        for (cand, slot, zero) in holes {
            match st.store.adopt(slot) {
                Some(true) if zero => {
                    st.store.mark_zero_holes(&[slot]);
                    self.holes.push((cand, slot));
                }
                Some(true) => st.store.unadopt(slot),
                // In use here already, or not usable: still held for its own life here.
                Some(false) | None => {}
            }
        }
    }

    /// Allocates the local copies of the groups and of the `fresh` leaders (which join `groups`),
    /// all in the order pages first take them (`first_use`), with zero holes between them where
    /// they fit (see the `zero_holes` module; recorded in `self.holes`). Returns the id of each
    /// group's copy (`None` where the store is full), and the copies to write: sources and ids.
    fn alloc_local(
        &mut self,
        cx: &Ctx<'_>,
        st: &mut State,
        fresh: Vec<u32>,
        first_use: &FirstUse,
    ) -> (Vec<Option<KeyId>>, Vec<usize>, Vec<KeyId>) {
        self.groups.extend(fresh);
        first_use.sort(&mut self.groups);
        // Each copy is written from the page that first takes it (equal to its leader's: they
        // are of one group), and holes go between copies first taken at neighbouring addresses.
        let srcs: Vec<usize> = self.groups.iter().map(|&l| first_use.at(l)).collect();
        let zero_at = self.zero_pages_for_holes(cx, st);
        let slots = zero_holes::lay_out(&srcs, &zero_at);
        let Some(got) = st.store.alloc(slots.len()) else {
            tracing::warn!("stable store is full; first sightings are not merged this period");
            return (vec![None; srcs.len()], Vec::new(), Vec::new());
        };
        let mut made = vec![None; srcs.len()];
        for (slot, &id) in slots.iter().zip(&got) {
            match *slot {
                Slot::Copy(j) => made[j] = Some(id),
                Slot::Hole(cand) => self.holes.push((cand, id)),
            }
        }
        let hole_ids: Vec<KeyId> = self.holes.iter().map(|&(_, id)| id).collect();
        st.store.mark_zero_holes(&hole_ids);
        let ids = made.iter().flatten().copied().collect();
        (made, srcs, ids)
    }

    /// Zero gaps: pages released as zero pages before (empty, or mapping the kernel's zero
    /// page) in stretches of at most `MAX_HOLE_GAP` pages, among the batch's zero pages, between
    /// two other candidates at neighbouring addresses. They join the batch as zero pages, so
    /// that where the pages around them merge onto copies around zero holes, they merge onto
    /// those holes (see the `zero_holes` module): the run of merged pages stays one mapping of
    /// the store. The committer merges them onto holes only: released already, they are never
    /// released again. (Not in locked memory: the engine's locked area holds moved pages.)
    fn add_zero_gaps(&mut self, cx: &Ctx<'_>, st: &State) {
        // (`st.zero` counts the pages released as zero pages.)
        if st.zero == 0 || cx.sh.store_uffd.is_none() || cx.sh.mode != WatchMode::UffdWp {
            return;
        }
        // Candidates by (region, index): whether each is a zero page.
        let at: HashMap<(usize, usize), bool> = self
            .cands
            .iter()
            .zip(&self.actions)
            .map(|(c, a)| ((c.region, c.index()), *a == Some(Action::Zero)))
            .collect();
        let mut gaps = Vec::new();
        for (&(region, i), _) in at.iter().filter(|&(_, &zero)| !zero) {
            let Some(r) = st.regions.get(&region) else {
                continue;
            };
            let released = |j: usize| {
                r.pages.get(j).is_some_and(|p| p.kind == PageKind::Zero)
                    && r.locked.within(j * PAGE..(j + 1) * PAGE).next().is_none()
            };
            let mut found = Vec::new();
            for j in i + 1..=i + zero_holes::MAX_HOLE_GAP + 1 {
                match at.get(&(region, j)) {
                    Some(false) => {
                        gaps.extend(found.iter().map(|&j| (region, j)));
                        break;
                    }
                    Some(true) => {}
                    None if released(j) => found.push(j),
                    None => break,
                }
            }
        }
        for (region, j) in gaps {
            let c = Candidate::new(region, region + j * PAGE, Pre::None);
            let k = push_candidate(&mut self.cands, &mut self.actions, c);
            self.actions[k as usize] = Some(Action::Zero);
        }
    }

    /// The zero pages of the batch that may be kept in runs of merged pages, by address: all of
    /// them released as zero pages, in anonymous memory (not in store mappings: those merge
    /// under write-protection, which compares with the copy's bytes). Only where the zero page
    /// can be mapped over holes in store mappings (the store mappings' userfaultfd) and the
    /// watch tells it from a page written (the write-protect mode's scans report it as the zero
    /// page; checksums do not).
    fn zero_pages_for_holes(&self, cx: &Ctx<'_>, st: &State) -> HashMap<usize, u32> {
        if cx.sh.store_uffd.is_none() || cx.sh.mode != WatchMode::UffdWp {
            return HashMap::new();
        }
        let anonymous = |c: &Candidate| {
            st.regions
                .get(&c.region)
                .and_then(|r| r.pages.get(c.index()))
                .is_some_and(|p| !p.kind.in_store_mapping())
        };
        self.cands
            .iter()
            .enumerate()
            .filter(|&(i, c)| self.actions[i] == Some(Action::Zero) && anonymous(c))
            .map(|(i, c)| (c.addr(), i as u32))
            .collect()
    }

    /// Indexes the new copies on the workers (the SD tree takes concurrent inserts), then records
    /// the outcomes serially and gives every page of a group its copy. Returns the copies made
    /// for this batch, and those of them made of its own pages (see `Classified::made_here`).
    fn publish(
        &mut self,
        cx: &Ctx<'_>,
        todo: &[GroupCopy],
        chunk_leaders: &CandidateSet,
    ) -> (Vec<KeyId>, Vec<KeyId>) {
        let fresh: Vec<KeyId> = todo
            .iter()
            .filter(|t| t.is_new && !chunk_leaders.contains(t.first))
            .map(|t| t.id)
            .collect();
        let mut inserted = match &cx.view.tree {
            Some(tree) => insert_parallel(cx.pool, cx.parts, tree, &fresh),
            None => Vec::new(),
        }
        .into_iter();
        let mut guard = lock(&cx.sh.state);
        let st = &mut *guard;
        let (mut new_copies, mut made_here) = (Vec::new(), Vec::new());
        // The copy of each group, by its first candidate.
        let mut id_of_first: Vec<Option<KeyId>> = vec![None; self.cands.len()];
        for &GroupCopy {
            first: g,
            id,
            is_new,
            made_here: ours,
        } in todo
        {
            let used = if is_new && chunk_leaders.contains(g) {
                // Allocated here and never indexed: freed when its last page lets go of it.
                new_copies.push(id);
                id
            } else if is_new {
                new_copies.push(id);
                let recorded = if cx.view.tree.is_some() {
                    let ins = inserted
                        .next()
                        .unwrap_or(Err(pageone_index::IndexError::Full(0)));
                    st.store.record_insert(id, ins)
                } else {
                    Ok(st.store.record_adopted(id))
                };
                match recorded {
                    Ok(used) => used,
                    Err(e) => {
                        tracing::warn!(error = %e, "stable copy not published");
                        continue;
                    }
                }
            } else {
                id
            };
            id_of_first[g as usize] = Some(used);
            self.actions[g as usize] = Some(Action::Merge(used));
            if ours {
                made_here.push(used);
            }
        }
        for &(i, f) in &self.member_of {
            if let Some(id) = id_of_first[f as usize] {
                self.actions[i as usize] = Some(Action::Merge(id));
            }
        }
        (new_copies, made_here)
    }
}

/// Writes the new local copies: the kernel reads the source pages (they may be changing: every
/// merge is verified later on frozen bytes). If that fails, the copies are freed and their groups
/// merge nothing.
fn write_local_copies(cx: &Ctx<'_>, copies: &mut Copies) {
    let Some(ids) = &copies.to_write else {
        return;
    };
    if let Err(e) = crate::store::write_copies(cx.view.fd, &copies.srcs, ids) {
        tracing::warn!(error = %e, "stable copies could not be written; not merging them");
        let mut st = lock(&cx.sh.state);
        for &id in ids {
            st.store.free_unmapped(id);
        }
        for (_, id) in copies.holes.drain(..) {
            st.store.free_unmapped(id);
        }
        let written: HashSet<KeyId> = ids.iter().copied().collect();
        copies.todo.retain(|t| !written.contains(&t.id));
    }
}

/// Splits groups so that no copy serves more than `max_sharing` pages of this process, into
/// stripes of copies the pages take in turn (see the `stripes` module). `groups` are leaders of
/// new copies, `adopted` leaders of copies the daemon holds, `member_of` the other pages as
/// (candidate, leader), re-pointed to the leaders of the copies they take. An adopted copy
/// that is full here gives its leader a fresh copy (and is no longer adopted). Returns the
/// leaders of the fresh copies.
fn split_groups(g: &mut Grouping, store: &Store, max_sharing: u32) -> Vec<u32> {
    let leaders: Vec<(u32, Room)> = g
        .groups
        .iter()
        .map(|&l| (l, Room::New))
        .chain(
            g.adopted
                .iter()
                .map(|&(l, slot)| (l, Room::Adopted(store.room(slot, max_sharing) as usize))),
        )
        .collect();
    let cands = &g.cands;
    let stripes = stripes::split(max_sharing as usize, &leaders, &mut g.member_of, |c| {
        cands[c as usize].addr()
    });
    let full: HashSet<u32> = leaders
        .iter()
        .filter(|&&(_, room)| matches!(room, Room::Adopted(0)))
        .map(|&(l, _)| l)
        .collect();
    g.adopted.retain(|(l, _)| !full.contains(l));
    if stripes.is_empty() {
        return Vec::new();
    }
    let new: HashSet<u32> = g.groups.iter().copied().collect();
    stripes
        .into_iter()
        .flatten()
        .filter(|l| !new.contains(l))
        .collect()
}

/// Inserts `ids` into the stable tree from the worker threads; results in the order of `ids`.
fn insert_parallel(
    pool: &Pool,
    parts: usize,
    tree: &Arc<pageone_index::SdTree<crate::store::StoreKeys>>,
    ids: &[KeyId],
) -> Vec<Result<pageone_index::Insert, pageone_index::IndexError>> {
    let tree = tree.clone();
    let n = ids.len();
    let mut all: Vec<_> = pool
        .map_parts(parts, Arc::new(ids.to_vec()), move |_, ids| {
            ids.iter()
                .map(|&id| tree.insert_or_get(id))
                .collect::<Vec<_>>()
        })
        .into_iter()
        .flatten()
        .flatten()
        .collect();
    // A part that did not report publishes nothing.
    while all.len() < n {
        all.push(Err(pageone_index::IndexError::Full(0)));
    }
    all
}
