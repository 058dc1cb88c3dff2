//! Registration: memory becomes mergeable (the equivalent of `madvise(MADV_MERGEABLE)`) and
//! private again (`MADV_UNMERGEABLE`), with its contents intact either way.

use std::ops::Range;
use std::sync::atomic::Ordering;
use std::time::Instant;

use pageone_sync::lock;
use pageone_sys as sys;

use crate::access::PAGE;
use crate::anonymize::{anonymize_pieces, store_pieces, OnFailure};
use crate::config::WatchMode;
use crate::error::EngineError;
use crate::freeze::STORE_MODE;
use crate::layout::{apply_changes, changing_mappings, cut};
use crate::pool::Pool;
use crate::read_ahead::{forget_read_ahead, read_ahead};
use crate::state::{pages_in_mut, Page, PageKind, RegionState, Shared, State};
use crate::store::is_merged_mapping;
use crate::stranded::Stranded;

/// Registers `[a, a+len)` for merging (see `Engine::register`).
pub(crate) fn register(sh: &Shared, pool: &Pool, a: usize, len: usize) -> Result<(), EngineError> {
    let end = checked_range(a, len)?;
    let maps = sys::self_mappings().map_err(EngineError::Map)?;
    let mut st = lock(&sh.state);
    apply_changes(sh, &mut st);
    register_locked(sh, pool, &mut st, &maps, a..end)
}

/// Registers the parts of `[a, a+len)` not registered yet (see `Engine::merge`).
pub(crate) fn merge(sh: &Shared, pool: &Pool, a: usize, len: usize) -> Result<(), EngineError> {
    let end = checked_range(a, len)?;
    let maps = sys::self_mappings().map_err(EngineError::Map)?;
    let mut st = lock(&sh.state);
    apply_changes(sh, &mut st);
    let mut gaps = Vec::new();
    let mut cur = a;
    for r in st.regions.range(..end).map(|(_, r)| r) {
        let (rs, re) = (r.start, r.start + r.len());
        if re <= cur {
            continue;
        }
        if rs > cur {
            gaps.push(cur..rs.min(end));
        }
        cur = cur.max(re);
    }
    if cur < end {
        gaps.push(cur..end);
    }
    // Checked all first: nothing is registered unless every gap can be.
    for g in &gaps {
        registrable(&st, &maps, g.start, g.end)?;
    }
    for g in gaps {
        register_locked(sh, pool, &mut st, &maps, g)?;
    }
    Ok(())
}

/// `a + len` for a page-aligned, non-empty range.
pub(crate) fn checked_range(a: usize, len: usize) -> Result<usize, EngineError> {
    if a % PAGE != 0 || len % PAGE != 0 || len == 0 {
        return Err(EngineError::Unaligned { addr: a, len });
    }
    a.checked_add(len)
        .ok_or(EngineError::Unaligned { addr: a, len })
}

/// Registers `range` (the caller holds the state lock; `maps` are the process's mappings).
fn register_locked(
    sh: &Shared,
    pool: &Pool,
    st: &mut State,
    maps: &[sys::Mapping],
    range: Range<usize>,
) -> Result<(), EngineError> {
    let (a, end) = (range.start, range.end);
    let unmergeable = registrable(st, maps, a, end)?;
    if st.base_vmas == 0 {
        st.base_vmas = maps.len();
    }
    // What the engine maps here carries the program's advice (see `advice`): the kernel's.
    crate::advice::check_registered(a..end);
    // Nothing is mapped over untouched pages: registered for write-protection only, a first
    // touch is the kernel's own fault (see `Shared::freeze_mode`).
    watch_pieces(sh, a..end, &unmergeable)?;
    // (Config is a leaf lock: nothing takes another lock while holding it.)
    let merging = lock(&sh.config).merging;
    if sh.mode == WatchMode::UffdWp && merging {
        // Arm the watch now: pages written from here on show up in the next period's scan,
        // which counts the first unchanged period. (An engine that only recycles never
        // write-protects: a write stays the kernel's business.)
        st.pagemap
            .write_protect(a, end)
            .map_err(EngineError::Uffd)?;
    }
    let n = (end - a) / PAGE;
    // Checksums: every page in checksum mode, COW-broken pages in both modes.
    let sums = vec![0; n];
    let mut pages = Page::fresh(n);
    for r in &unmergeable {
        for p in &mut pages[(r.start - a) / PAGE..(r.end - a) / PAGE] {
            p.kind = PageKind::Broken;
        }
    }
    st.regions.insert(
        a,
        RegionState {
            merged_ever: !unmergeable.is_empty(),
            armed_at: (sh.mode == WatchMode::UffdWp).then(Instant::now),
            sums,
            ..RegionState::new(a, pages)
        },
    );
    if merging {
        read_ahead(st, pool, a, end, sh.mode);
    }
    if sh.mode == WatchMode::UffdWp {
        defer_next_period(sh);
    }
    tracing::debug!(addr = a, len = end - a, "registered");
    Ok(())
}

/// Checks that `[a, end)` can be registered: private anonymous memory, or private mappings of a
/// store (pages merged here and unregistered since, or merged by the process this one was forked
/// from: see `is_merged_mapping`), not overlapping a registered region or memory the engine
/// uses itself (see `apart`). Returns the pieces that
/// are mappings of a store: their pages are watched as copy-on-write-broken ones (left alone
/// while they map their copy, merged again once written).
fn registrable(
    st: &State,
    maps: &[sys::Mapping],
    a: usize,
    end: usize,
) -> Result<Vec<Range<usize>>, EngineError> {
    let len = end - a;
    if crate::apart::is_kept_apart(&(a..end)) {
        return Err(EngineError::EngineMemory { addr: a, len });
    }
    let mut cur = a;
    let mut unmergeable = Vec::new();
    for m in maps.iter().filter(|m| m.end > a && m.start < end) {
        let ours = m.perms == "rw-p" && (st.store.maps_inode(m.inode) || is_merged_mapping(m));
        if m.start > cur || !(m.is_private_anonymous_rw() || ours) {
            return Err(EngineError::NotAnonymous { addr: a, len });
        }
        if ours {
            unmergeable.push(m.start.max(a)..m.end.min(end));
        }
        cur = m.end;
    }
    if cur < end {
        return Err(EngineError::NotAnonymous { addr: a, len });
    }
    if st
        .regions
        .range(..end)
        .next_back()
        .is_some_and(|(_, r)| r.start + r.len() > a)
    {
        return Err(EngineError::Overlap { addr: a, len });
    }
    Ok(unmergeable)
}

/// Registers the pieces of `range` with their userfaultfd: anonymous pieces with the main context,
/// pieces that are mappings of the store (`unmergeable`: pages merged, then unmerged) with the
/// store mappings' context. On failure, the pieces registered so far are unregistered.
fn watch_pieces(
    sh: &Shared,
    range: Range<usize>,
    unmergeable: &[Range<usize>],
) -> Result<(), EngineError> {
    // (start, end, in a store mapping)
    let mut pieces: Vec<(usize, usize, bool)> = Vec::new();
    let mut cur = range.start;
    for r in unmergeable {
        if r.start > cur {
            pieces.push((cur, r.start, false));
        }
        pieces.push((r.start, r.end, true));
        cur = r.end;
    }
    if cur < range.end {
        pieces.push((cur, range.end, false));
    }
    for (k, &(s, e, store_piece)) in pieces.iter().enumerate() {
        let r = if store_piece {
            sh.store_uffd.as_ref().map_or(Ok(()), |u| {
                // Its pages mapped: a first touch would otherwise wait for the fault thread
                // (see `STORE_MODE`).
                u.register(s, e - s, STORE_MODE).map(|()| {
                    crate::commit::map_cached_unless_dropped(sh, s, 0..(e - s) / PAGE, |_| true)
                })
            })
        } else {
            sh.uffd.register(s, e - s, sh.reg_mode)
        };
        if let Err(err) = r {
            for &(s, e, store_piece) in &pieces[..k] {
                if !store_piece {
                    let _ = sh.uffd.unregister(s, e - s);
                } else if let Some(u) = &sh.store_uffd {
                    let _ = u.unregister(s, e - s);
                }
            }
            return Err(EngineError::Uffd(err));
        }
    }
    Ok(())
}

/// Defers the next period to a period after this registration (see `Shared::not_before`) and
/// wakes the sleeping engine loop so it takes the new deadline.
fn defer_next_period(sh: &Shared) {
    let period = lock(&sh.config).merge_period;
    let now = Instant::now();
    let t = now + period;
    let mut nb = lock(&sh.not_before);
    *nb = Some(match *nb {
        Some((old, cap)) => (old.max(t), cap),
        None => (t, now + period * 2),
    });
    drop(nb);
    sh.kick.1.notify_all();
}

/// Unregisters the registered pages of `[a, a+len)`, whole regions or parts of them (see
/// `Engine::unregister`): only those pages become private again; the rest of a region stays
/// registered. The caller's thread covers it as a change of mappings (no run is held still
/// meanwhile).
pub(crate) fn unregister(sh: &Shared, a: usize, len: usize) -> Result<(), EngineError> {
    let start = a & !(PAGE - 1);
    let end = a.saturating_add(len).saturating_add(PAGE - 1) & !(PAGE - 1);
    let _change = changing_mappings();
    let mut st = lock(&sh.state);
    apply_changes(sh, &mut st);
    let pieces = cut(&mut st, start..end);
    if pieces.is_empty() {
        return Err(EngineError::NotRegistered { addr: a, len });
    }
    forget_read_ahead(&mut st);
    for piece in pieces {
        unregister_region(sh, &mut st, piece);
    }
    Ok(())
}

/// The regions that meet `range`, each with the indices of its pages inside it (regions do not
/// overlap: those below `range` are not visited).
pub(crate) fn overlapping(
    st: &State,
    range: Range<usize>,
) -> impl Iterator<Item = (&RegionState, Range<usize>)> {
    st.regions
        .range(..range.end)
        .rev()
        .map(|(_, r)| r)
        .take_while(move |r| r.start + r.len() > range.start)
        .map(move |r| {
            let (lo, hi) = (r.start.max(range.start), (r.start + r.len()).min(range.end));
            (r, (lo - r.start) / PAGE..(hi - r.start) / PAGE)
        })
}

/// Registers `range`, fresh anonymous memory, like the region around it. Its pages are not
/// write-protected: a page written there is present without the write-protect bit, which the
/// watch reads as written (and protects again), as it would read a write to a protected page;
/// a page never written holds nothing to watch. (One system call less per drop of merged pages.)
pub(crate) fn watch_emptied(sh: &Shared, range: Range<usize>) -> Result<(), EngineError> {
    sh.uffd
        .register(range.start, range.len(), sh.reg_mode)
        .map_err(EngineError::Uffd)
}

/// Records that the pages of `range` are anonymous memory now (empty, or holding the bytes copied
/// there): their copies released, watched from scratch.
pub(crate) fn dropped_pages(st: &mut State, range: Range<usize>) {
    let State { regions, store, .. } = st;
    for p in pages_in_mut(regions, range) {
        if p.kind == PageKind::Merged {
            store.drop_ref(p.sid);
        }
        if p.kind.in_store_mapping() || p.kind == PageKind::Merged {
            p.kind = PageKind::Anon;
            p.unchanged = 0;
            p.epoch = p.epoch.wrapping_add(1);
        }
    }
}

/// Hands `range` of the region at `start` to the kernel's KSM (see the `ksm` module), if it
/// still wants it: its pages become the program's private memory again, as on unregistering,
/// and the range stays registered in name only, a region of its own marked mergeable for the
/// kernel; the rest of the region stays pageone's. Returns its length.
pub(crate) fn hand_to_ksm(sh: &Shared, start: usize, range: Range<usize>) -> Option<usize> {
    let _change = changing_mappings();
    let mut st = lock(&sh.state);
    apply_changes(sh, &mut st);
    let still_wanted = st.regions.get(&start).is_some_and(|r| {
        !r.to_ksm
            && crate::ksm::wanted_ranges(r)
                .iter()
                .any(|w| w.start <= range.start && range.end <= w.end)
    });
    if !still_wanted {
        return None;
    }
    forget_read_ahead(&mut st);
    let len = range.len();
    for piece in cut(&mut st, range.clone()) {
        unregister_region(sh, &mut st, piece);
    }
    // Registered again, for write-protection that is never armed: nothing faults, and the kernel
    // still reports the range unmapped, moved or dropped, so the engine forgets or moves it as
    // the program changes it.
    if let Err(e) = sh.uffd.register(range.start, len, sh.reg_mode) {
        tracing::warn!(error = %e, "memory handed to the kernel's KSM is no longer watched for unmapping");
    }
    st.regions.insert(
        range.start,
        RegionState {
            to_ksm: true,
            ..RegionState::new(range.start, Page::fresh(len / PAGE))
        },
    );
    crate::ksm::mark(range.start, len);
    Some(len)
}

/// Unregisters every region and says goodbye to the daemon, if any (the engine is stopping).
pub(crate) fn unregister_all(sh: &Shared) {
    let mut st = lock(&sh.state);
    forget_read_ahead(&mut st);
    let regions = std::mem::take(&mut st.regions);
    for (_, r) in regions {
        unregister_region(sh, &mut st, r);
    }
    st.store.say_goodbye();
}

/// Makes every page of `r` private again and releases its copies.
fn unregister_region(sh: &Shared, st: &mut State, mut r: RegionState) {
    let (start, end) = (r.start, r.start + r.len());
    if r.to_ksm {
        crate::ksm::take_back(start, r.len());
    }
    crate::sightings::forget_range(st, start..end);
    // Merged and COW-broken pages live in mappings of the store: turn those back into anonymous
    // memory, so the range behaves exactly as before registering (e.g. MADV_DONTNEED gives zeros).
    // First, while the store mappings' context still holds them: before Linux 6.17, unregistering
    // through the main context dropped the other context's registration too, and then the pages
    // could not be held still to be copied.
    let pieces = store_pieces(sh, st, start..end);
    for p in &pieces {
        // Unlocked by a call the engine did not see: given back unlocked.
        r.forget_unlocked(p.start, p.end - p.start);
    }
    let (anonymous, failed) = anonymize_pieces(sh, pieces, OnFailure::TryTheRest);
    for a in anonymous {
        // Locked again where the engine's mapping was (see `locking`).
        r.relock(a.start, a.len());
    }
    let mut stranded: Vec<Stranded> = failed
        .into_iter()
        .map(|p| Stranded {
            range: p.start..p.end,
            copies: Vec::new(),
        })
        .collect();
    st.huge.forget(start..end);
    // A parked page's waiters are held by the registration: its bytes go back first.
    sh.parking
        .put_back_before_unregistering(&sh.uffd, start..end);
    unregister_range(&sh.uffd, start, r.len());
    if let Some(u2) = &sh.store_uffd {
        unregister_range(u2, start, r.len());
    }
    for (i, p) in r.pages.iter().enumerate() {
        let addr = start + i * PAGE;
        if p.kind == PageKind::Merged {
            if let Some(s) = stranded.iter_mut().find(|s| s.range.contains(&addr)) {
                // Still a store mapping (no mapping to spare for the copy, at the limit): at
                // least make the page private, and keep its copy, which the mapping still maps
                // (see the `stranded` module).
                break_cow(addr);
                s.copies.push((addr, p.sid));
                continue;
            }
            st.store.drop_ref(p.sid);
        } else if p.kind == PageKind::Zero {
            st.zero -= 1;
        }
    }
    st.stranded.extend(stranded);
    st.store.punch_pending();
}

/// Unregisters `[start, start+len)` from `uffd`, piece by piece if the owner unmapped parts of it.
fn unregister_range(uffd: &sys::Uffd, start: usize, len: usize) {
    if uffd.unregister(start, len).is_err() {
        // Pieces of the range may have been unmapped by the owner; unregister what is left.
        if let Ok(maps) = sys::self_mappings() {
            for m in maps
                .iter()
                .filter(|m| m.end > start && m.start < start + len)
            {
                let s = m.start.max(start);
                let e = m.end.min(start + len);
                let _ = uffd.unregister(s, e - s);
            }
        }
    }
}

/// Gives the merged page at `addr` a private copy without changing a byte, as a write would
/// (KSM's unmerge does the same with a write fault).
fn break_cow(addr: usize) {
    // SAFETY: addr is a page of a private mapping the engine made; populating it writable copies
    // the page in the kernel, atomically with respect to concurrent writers.
    match unsafe { sys::madvise(addr as *mut u8, PAGE, libc::MADV_POPULATE_WRITE) } {
        // Before Linux 5.14 the advice is unknown; any other refusal (nothing mapped there, say)
        // leaves the page as it is: a write to memory that is not there would kill the program.
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {}
        _ => return,
    }
    // Before Linux 5.14: a compare-and-swap of a word with itself is a write (an atomic add of
    // zero is not: compilers may turn it into a load), and it cannot lose a concurrent store.
    // SAFETY: addr is mapped and 8-aligned; the owner may write it concurrently, which an atomic
    // read-modify-write tolerates.
    let w = unsafe { std::sync::atomic::AtomicU64::from_ptr(addr as *mut u64) };
    let mut v = w.load(Ordering::Relaxed);
    // Relaxed: only the write itself matters, not ordering with other memory.
    while let Err(cur) = w.compare_exchange_weak(v, v, Ordering::Relaxed, Ordering::Relaxed) {
        v = cur;
    }
}
