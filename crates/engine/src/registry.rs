//! Registration: memory becomes mergeable (the equivalent of `madvise(MADV_MERGEABLE)`) and
//! private again (`MADV_UNMERGEABLE`), with its contents intact either way.

use std::ops::Range;
use std::sync::atomic::Ordering;
use std::time::Instant;

use pageone_sync::lock;
use pageone_sys::{self as sys, uapi::*};

use crate::access::PAGE;
use crate::config::WatchMode;
use crate::error::EngineError;
use crate::layout::apply_changes;
use crate::pool::Pool;
use crate::read_ahead::{forget_read_ahead, read_ahead};
use crate::state::{Page, PageKind, RegionState, Shared, State};

/// Registers `[a, a+len)` for merging (see `Engine::register`).
pub(crate) fn register(sh: &Shared, pool: &Pool, a: usize, len: usize) -> Result<(), EngineError> {
    if a % PAGE != 0 || len % PAGE != 0 || len == 0 {
        return Err(EngineError::Unaligned { addr: a, len });
    }
    let end = a
        .checked_add(len)
        .ok_or(EngineError::Unaligned { addr: a, len })?;
    let _period = lock(&sh.period_lock);
    let maps = sys::self_mappings().map_err(EngineError::Map)?;
    let mut st = lock(&sh.state);
    apply_changes(sh, &mut st);
    let unmergeable = registrable(&st, &maps, a, end)?;
    watch_pieces(sh, a..end, &unmergeable)?;
    if sh.mode == WatchMode::UffdWp {
        // Arm the watch now: pages written from here on show up in the next period's scan,
        // which counts the first unchanged period.
        st.pagemap
            .write_protect(a, end)
            .map_err(EngineError::Uffd)?;
    }
    let n = len / PAGE;
    // Checksums: every page in checksum mode, COW-broken pages in both modes.
    let sums = vec![0; n];
    let mut pages = vec![Page::default(); n];
    for r in &unmergeable {
        for p in &mut pages[(r.start - a) / PAGE..(r.end - a) / PAGE] {
            p.kind = PageKind::Broken;
        }
    }
    st.regions.insert(
        a,
        RegionState {
            start: a,
            pages,
            merged_ever: !unmergeable.is_empty(),
            armed_at: (sh.mode == WatchMode::UffdWp).then(Instant::now),
            sums,
        },
    );
    read_ahead(&mut st, pool, a, end, sh.mode);
    drop(st);
    if sh.mode == WatchMode::UffdWp {
        defer_next_period(sh);
    }
    tracing::debug!(addr = a, len, "registered");
    Ok(())
}

/// Checks that `[a, end)` can be registered: private anonymous memory, or pages this engine
/// merged and later unmerged (private copies in mappings of its own store, which stay private:
/// they cannot be frozen again), not overlapping a registered region. Returns the pieces that are
/// mappings of the store.
fn registrable(
    st: &State,
    maps: &[sys::Mapping],
    a: usize,
    end: usize,
) -> Result<Vec<Range<usize>>, EngineError> {
    let len = end - a;
    let mut cur = a;
    let mut unmergeable = Vec::new();
    for m in maps.iter().filter(|m| m.end > a && m.start < end) {
        let ours = st.store.maps_inode(m.inode) && m.perms == "rw-p";
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
            sh.store_uffd
                .as_ref()
                .map_or(Ok(()), |u| u.register(s, e - s, UFFDIO_REGISTER_MODE_WP))
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

/// Unregisters the registered regions inside `[a, a+len)` (see `Engine::unregister`).
pub(crate) fn unregister(sh: &Shared, a: usize, len: usize) -> Result<(), EngineError> {
    let end = a.saturating_add(len);
    let _period = lock(&sh.period_lock);
    let mut st = lock(&sh.state);
    apply_changes(sh, &mut st);
    let keys: Vec<usize> = st.regions.range(a..end).map(|(&k, _)| k).collect();
    if keys.is_empty() {
        return Err(EngineError::NotRegistered { addr: a, len });
    }
    for k in &keys {
        let r = &st.regions[k];
        if r.start + r.len() > end {
            return Err(EngineError::Overlap { addr: a, len });
        }
    }
    forget_read_ahead(&mut st);
    for k in keys {
        let r = st.regions.remove(&k).expect("listed above");
        unregister_region(sh, &mut st, r);
    }
    Ok(())
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
fn unregister_region(sh: &Shared, st: &mut State, r: RegionState) {
    let (start, end) = (r.start, r.start + r.len());
    // First sightings in the range are forgotten: the range may be registered again later, with
    // page epochs starting over.
    st.unstable.retain(|_, addr, _| addr < start || addr >= end);
    unregister_range(&sh.uffd, start, r.len());
    // Merged and COW-broken pages live in mappings of the store: turn those back into anonymous
    // memory, so the range behaves exactly as before registering (e.g. MADV_DONTNEED gives zeros).
    let pieces: Vec<(usize, usize)> = sys::self_mappings()
        .unwrap_or_default()
        .iter()
        .filter(|m| {
            st.store.maps_inode(m.inode) && m.perms == "rw-p" && m.end > start && m.start < end
        })
        .map(|m| (m.start.max(start), m.end.min(end)))
        .collect();
    let mut failed = Vec::new();
    for &(s, e) in &pieces {
        if !anonymize(sh, s, e) {
            failed.push((s, e));
        }
    }
    if let Some(u2) = &sh.store_uffd {
        unregister_range(u2, start, r.len());
    }
    for (i, p) in r.pages.iter().enumerate() {
        let addr = start + i * PAGE;
        if p.kind == PageKind::Merged {
            if failed.iter().any(|&(s, e)| addr >= s && addr < e) {
                // Still a store mapping: at least make the page private.
                break_cow(addr);
            }
            st.store.drop_ref(p.sid);
        } else if p.kind == PageKind::Zero {
            st.zero -= 1;
        }
    }
    st.store.punch_pending();
}

/// Replaces the store mapping `[s, e)` by anonymous memory with the same contents: writers are
/// held off with write-protection, the pages are copied into a fresh anonymous mapping, and that
/// mapping is moved over the old one in one step (`mremap`), then writers are woken. Returns false
/// (changing nothing) if any step is not possible.
pub(crate) fn anonymize(sh: &Shared, s: usize, e: usize) -> bool {
    let Some(u2) = &sh.store_uffd else {
        return false;
    };
    let len = e - s;
    if u2.writeprotect(s, len, true).is_err() {
        let _ = u2.writeprotect(s, len, false);
        return false;
    }
    let ok = match sys::mmap_anonymous(len) {
        Ok(tmp) => {
            // The source is held still (writers block on write-protection) and read through the
            // kernel, as the program's memory; `tmp` is ours alone, `len` bytes long.
            // SAFETY: `tmp` is writable for `len` bytes.
            let copied = unsafe { sys::read_own_memory(tmp, &[(s, len)]) }.ok() == Some(len);
            // SAFETY: `tmp` is a whole mapping of ours; the destination holds exactly the bytes
            // just copied and belongs to the registered region.
            let moved = copied && unsafe { sys::mremap_fixed(tmp, len, s as *mut u8) }.is_ok();
            if !moved {
                // SAFETY: `tmp` is ours and nothing refers to it.
                let _ = unsafe { sys::munmap(tmp, len) };
            }
            moved
        }
        Err(_) => false,
    };
    if !ok {
        let _ = u2.writeprotect(s, len, false);
    }
    // Writers blocked on the old mapping retry their fault in the new one.
    let _ = u2.wake(s, len);
    ok
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
    if unsafe { sys::madvise(addr as *mut u8, PAGE, libc::MADV_POPULATE_WRITE) }.is_ok() {
        return;
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
