//! Locking all of the process's memory (`mlockall(MCL_CURRENT)`) but the engine's own.
//!
//! The kernel locks every mapping, and fills each as it locks it: the engine's views of the
//! store (as large as the memory by default: every page of the file allocated), its staging area
//! (a private copy of each), and its scratch and locked areas (filled, no page could move into
//! them), and every store mapping of merged pages (locking a private mapping of a file for
//! writing copies each page: every merge undone). So the shim locks the mappings one by one
//! instead: the engine's own are left out, the merged pages are locked on fault (as they stand,
//! mapped), and the rest as the program asked.

use std::ops::Range;

use pageone_sync::lock;
use pageone_sys as sys;

use crate::apart;
use crate::error::EngineError;
use crate::locking;
use crate::state::{region_at, Shared};
use crate::store::is_store_mapping;

/// Locks the process's current mappings as `mlockall(MCL_CURRENT)` does (on fault only with
/// `on_fault`, as `MCL_ONFAULT`), but for the engine's own memory, as the module documentation
/// says (`Engine::lock_current` has what the engine maps over registered memory later locked
/// too). A mapping the kernel refuses to lock is left as it is (the kernel's `mlockall` goes on
/// past those too).
pub(crate) fn lock_current(sh: &Shared, on_fault: bool) -> Result<(), EngineError> {
    let maps = sys::self_mappings().map_err(EngineError::Map)?;
    // What to lock, and how, decided under the state lock; locked after it, as locking fills
    // mappings, which takes as long as the memory is large.
    let to_lock: Vec<(Range<usize>, bool)> = {
        let st = lock(&sh.state);
        let own = own_areas(sh, st.scratch);
        maps.iter()
            .filter(|m| {
                let r = m.start..m.end;
                !own.iter().any(|o| o.start < r.end && r.start < o.end) && !apart::is_kept_apart(&r)
            })
            .filter_map(|m| {
                let merged = is_store_mapping(m);
                // A store mapping outside registered memory: a view of the store or the staging
                // area.
                let theirs = !merged || region_at(&st.regions, m.start).is_some();
                theirs.then_some((m.start..m.end, merged || on_fault))
            })
            .collect()
    };
    for (r, lazily) in to_lock {
        let _ = locking::lock_range(r, lazily);
    }
    Ok(())
}

/// The engine's anonymous areas that must stay empty: the scratch area (at `scratch`) and the
/// locked area.
fn own_areas(sh: &Shared, scratch: usize) -> Vec<Range<usize>> {
    let scratch = scratch..scratch + crate::freeze::SCRATCH_SLOTS * crate::access::PAGE;
    let locked = sh
        .locked_scratch
        .as_ref()
        .map(locking::LockedScratch::range);
    std::iter::once(scratch).chain(locked).collect()
}
