//! The stable store: one memfd page per shared content, and the SD tree that indexes them.
//!
//! A stable copy is written once, before its id is published in the tree, and never changes while
//! the id is published or mapped; it is freed (hole punched) when no page maps it any more, and its
//! id is reused only after the tree's grace period (`KeySource::release`). Reference counts are
//! kept by the committer thread alone, so they need no atomics.

use std::ops::Range;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use pageone_index::{Insert, KeyId, KeySource, SdTree};
use pageone_sys as sys;

use crate::held::{covered_copies, Held};
use crate::proto::store::{punch_runs, runs};
use crate::remote::Remote;
use crate::EngineError;

const PAGE: usize = sys::PAGE_SIZE;

/// Set at the first `fork` of this process. A child inherits the private mappings of stable
/// copies, which this engine does not count, so from then on no copy is freed here (nor released
/// to the daemon, which keeps a client's holds until every process sharing its socket has exited
/// or exec'd). Memory of copies freed later is retained instead: correct, not lean.
static FORKED: AtomicBool = AtomicBool::new(false);

extern "C" fn nothing() {}

extern "C" fn note_fork() {
    // Relaxed: read by the engine thread of this process (parent) or not at all (child, where the
    // engine's threads do not exist); the fork itself orders it for the child.
    FORKED.store(true, Ordering::Relaxed);
}

/// In a forked child: its own engine (one started after the fork) has a store of its own, which
/// no other process maps until the child forks in turn. The copies of the parent's store it
/// inherited are not this store's, and are never freed by it.
extern "C" fn forked_child() {
    // Relaxed: see note_fork.
    FORKED.store(false, Ordering::Relaxed);
}

fn watch_forks() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if let Err(e) = sys::at_fork(note_fork, nothing, forked_child) {
            // Without the hook, forks would be unsafe to combine with merging: say so loudly.
            tracing::error!(error = %e, "cannot watch for fork(); copies may be freed under children");
        }
    });
}

/// Whether `m` maps a store file privately for reading and writing, as merged pages are mapped:
/// this engine's store, a daemon's, or that of the process this one was forked from (memfds named
/// `pageone-stable` or `pageone-scope`). Its pages map copies until written, then are private
/// copies in that mapping.
pub fn is_merged_mapping(m: &sys::Mapping) -> bool {
    m.perms == "rw-p" && is_private_store_mapping(m)
}

/// Whether `m` is a private mapping of a store file, with any protection (see
/// [`is_merged_mapping`]).
pub(crate) fn is_private_store_mapping(m: &sys::Mapping) -> bool {
    m.perms.ends_with('p') && is_store_mapping(m)
}

/// Whether `m` maps a store file (a memfd named `pageone-stable`, an engine's own store, or
/// `pageone-scope`, a daemon's), privately or shared, with any protection.
pub fn is_store_mapping(m: &sys::Mapping) -> bool {
    let names = ["/memfd:pageone-stable", "/memfd:pageone-scope"];
    names.iter().any(|n| m.path.starts_with(n))
}

/// The process's mappings, read for the copies held when the read began (see
/// [`Store::held_check`]).
pub(crate) struct HeldCheck {
    pub(crate) held: usize,
    pub(crate) mappings: std::io::Result<Vec<sys::Mapping>>,
    /// The program's moves of store mappings counted before and after the mappings were read
    /// (`ChangeLog::store_moves`).
    pub(crate) moves: std::ops::Range<u64>,
}

/// The memfd and this process's shared view of it.
pub(crate) struct StoreFile {
    fd: OwnedFd,
    base: usize,
    capacity: u32,
    /// Where the engine's staging area of this file starts, 0 if it has none (see the `staging`
    /// module): it maps every copy, and holds none.
    pub(crate) staging_at: AtomicUsize,
    /// Ids whose grace period has passed, ready for reuse.
    released: Mutex<Vec<KeyId>>,
}

impl StoreFile {
    pub(crate) fn fd(&self) -> i32 {
        self.fd.as_raw_fd()
    }

    /// The file's length (the view's) in bytes.
    pub(crate) fn len(&self) -> usize {
        self.capacity as usize * PAGE
    }
}

impl Drop for StoreFile {
    fn drop(&mut self) {
        // The view goes with the last reference to the file (the tree's, a read-ahead job's):
        // nothing reads it afterwards. A store given up for a new daemon's is freed this way
        // once no merged page maps it any more.
        // SAFETY: `base` is this file's view of `capacity` pages, mapped by `Store::new` or
        // `Store::shared` and unmapped only here.
        let _ = unsafe { sys::munmap(self.base as *mut u8, self.capacity as usize * PAGE) };
    }
}

impl StoreFile {
    /// Reads word `i` (big-endian) of copy `id`; 0 for a word outside the store (the index never
    /// asks for one, but a bug must not become a read outside the mapping).
    fn word(&self, id: KeyId, i: usize) -> u64 {
        debug_assert!(id < self.capacity && i < PAGE / 8);
        if id >= self.capacity || i >= PAGE / 8 {
            return 0;
        }
        let p = (self.base + id as usize * PAGE + i * 8) as *const u64;
        // SAFETY: `id < capacity` and `i < PAGE / 8`, checked above, keep p inside the live shared
        // mapping, 8-aligned. Volatile because the mapping is shared memory: a copy is immutable
        // while published, but the compiler must not assume anything about memory another process
        // may map.
        u64::from_be(unsafe { std::ptr::read_volatile(p) })
    }
}

/// The SD tree's view of the store.
pub(crate) struct StoreKeys(pub(crate) Arc<StoreFile>);

impl KeySource for StoreKeys {
    fn word(&self, id: KeyId, i: usize) -> u64 {
        self.0.word(id, i)
    }
    fn release(&self, id: KeyId) {
        self.0
            .released
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(id);
    }
}

/// Ids below which the per-id tables are never cut (see [`Store::shrink_unused_tables`]).
const SHRINK_MIN_IDS: usize = 4096;

/// The stable store and its index. Mutated only by the committer; `tree` and `file` are read
/// concurrently by workers.
pub(crate) struct Store {
    pub(crate) file: Arc<StoreFile>,
    pub(crate) tree: Arc<SdTree<StoreKeys>>,
    /// Mappings per copy (index = id).
    refs: Vec<u32>,
    /// Whether the copy's id is published in the tree.
    indexed: Vec<bool>,
    /// Whether the tree may still read the id (published, or removed but not yet released).
    /// (A count: with a daemon, a slot released by the tree can be adopted and inserted again
    /// before the tree's release of the earlier removal arrives.)
    in_tree: Vec<u32>,
    /// Whether the id holds a live copy (allocated and not yet freed).
    allocated: Vec<bool>,
    /// Per id, the allocation (a count of `alloc` calls) that last gave it out: a copy named
    /// before that may have held other bytes (see [`Store::reallocated_since`]).
    allocated_at: Vec<u64>,
    /// `alloc` calls so far.
    allocs: u64,
    /// Ids `alloc` gave out so far (for tests: how many copies merges made).
    pub(crate) given_out: u64,
    /// Entries of published copies, to remove them by handle (as long as the highest id ever
    /// inserted in the tree).
    entries: Vec<Option<pageone_index::Entry>>,
    /// Next never-used id (ids below it are in use or released).
    bump: u32,
    /// Ids free for reuse (released by the tree, or never published).
    free: Vec<KeyId>,
    /// Ids freed and not yet punched: `punch_pending` punches runs of them with one call each
    /// (unregistering frees hundreds of thousands), then they are reusable.
    pending: Vec<KeyId>,
    /// Whether the id is a zero hole: allocated to keep a zero page inside a run of merged pages,
    /// never written (it reads zeros and takes no memory) and never indexed. Pages mapping it are
    /// counted as zero pages, not in `shared`/`sharing_refs`.
    zero_hole: Vec<bool>,
    /// Whether a page mapped the copy since the process's mappings last showed none covering
    /// it: freed, it is held until they do (see the `held` module).
    mapped: Vec<bool>,
    /// Copies freed while a mapping may still cover them.
    held: Held,
    /// Held copies of a store of this engine's own, not yet punched.
    held_unpunched: Vec<KeyId>,
    /// Copies with refs > 0.
    pub(crate) shared: u64,
    /// Sum of refs.
    pub(crate) sharing_refs: u64,
    /// Pages mapping zero holes.
    pub(crate) hole_refs: u64,
    /// The daemon, when the store is a scope's shared store: it makes and frees the copies, and
    /// ids are its slots.
    pub(crate) remote: Option<Arc<Remote>>,
    /// Inodes of the stores this one replaced (a daemon lost, then joined again): pages merged
    /// onto them may still map them.
    retired_inodes: Vec<u64>,
    /// The memfd's inode number (read once: it is compared with every mapping of the process).
    inode: u64,
}

/// Leaves the engine's view of a store at `base` out of the process's core dumps: the kernel
/// dumps shared mappings of a memfd by default (as shared anonymous memory), and the view holds
/// every copy of the store, a daemon's holding other processes' pages. The program's merged
/// pages are its own mappings of the store, dumped or not as the program's settings say.
fn leave_out_of_dumps(base: usize, len: usize) {
    // SAFETY: the advice changes no contents; the view is the engine's own.
    if let Err(e) = unsafe { sys::madvise(base as *mut u8, len, libc::MADV_DONTDUMP) } {
        tracing::debug!(error = %e, "the store's view is left in core dumps");
    }
}

impl Store {
    pub(crate) fn new(capacity_pages: u32) -> Result<Self, EngineError> {
        let fd = sys::memfd_create(c"pageone-stable").map_err(EngineError::Store)?;
        let bytes = capacity_pages as u64 * PAGE as u64;
        sys::ftruncate(fd.as_raw_fd(), bytes).map_err(EngineError::Store)?;
        let base = sys::mmap_shared(fd.as_raw_fd(), bytes as usize, 0)
            .map_err(EngineError::Store)? as usize;
        leave_out_of_dumps(base, bytes as usize);
        Self::with_file(fd, base, capacity_pages, None)
    }

    /// The scope's store of a daemon (`fd` read-only), reached through `remote`.
    pub(crate) fn shared(
        fd: OwnedFd,
        capacity_pages: u32,
        remote: Remote,
    ) -> Result<Self, EngineError> {
        let bytes = capacity_pages as usize * PAGE;
        let base =
            sys::mmap_shared_readonly(fd.as_raw_fd(), bytes).map_err(EngineError::Store)? as usize;
        leave_out_of_dumps(base, bytes);
        Self::with_file(fd, base, capacity_pages, Some(Arc::new(remote)))
    }

    fn with_file(
        fd: OwnedFd,
        base: usize,
        capacity_pages: u32,
        remote: Option<Arc<Remote>>,
    ) -> Result<Self, EngineError> {
        watch_forks();
        let file = Arc::new(StoreFile {
            fd,
            base,
            capacity: capacity_pages,
            staging_at: AtomicUsize::new(0),
            released: Mutex::new(Vec::new()),
        });
        let inode = {
            use std::os::unix::fs::MetadataExt;
            let dup = file.fd.try_clone().map_err(EngineError::Store)?;
            std::fs::File::from(dup)
                .metadata()
                .map_err(EngineError::Store)?
                .ino()
        };
        let tree =
            Arc::new(SdTree::new(StoreKeys(file.clone()), PAGE).map_err(EngineError::Index)?);
        Ok(Self {
            file,
            tree,
            refs: Vec::new(),
            indexed: Vec::new(),
            in_tree: Vec::new(),
            allocated: Vec::new(),
            allocated_at: Vec::new(),
            allocs: 0,
            given_out: 0,
            entries: Vec::new(),
            bump: 0,
            free: Vec::new(),
            pending: Vec::new(),
            zero_hole: Vec::new(),
            mapped: Vec::new(),
            held: Held::default(),
            held_unpunched: Vec::new(),
            shared: 0,
            sharing_refs: 0,
            hole_refs: 0,
            remote,
            retired_inodes: Vec::new(),
            inode,
        })
    }

    /// Takes over from `old`, whose copies may still be mapped by pages merged onto it: its
    /// mappings are still recognised as store mappings (see [`Store::maps_inode`]). `old` itself
    /// (its index, its view, its daemon link) goes. The same daemon joined again hands out the
    /// same file: that one is not replaced (its copies stay held for this process by the old
    /// connection until the process exits, and are held again as pages move).
    pub(crate) fn take_over(&mut self, old: Store) {
        let current = self.inode();
        self.retired_inodes = old.retired_inodes.clone();
        self.retired_inodes.push(old.inode());
        self.retired_inodes.retain(|&i| i != current);
    }

    /// Whether mappings of file `inode` are mappings of this store or of one it replaced.
    pub(crate) fn maps_inode(&self, inode: u64) -> bool {
        inode == self.inode() || self.replaced_inode(inode)
    }

    /// Whether file `inode` is a store this one replaced.
    pub(crate) fn replaced_inode(&self, inode: u64) -> bool {
        self.retired_inodes.contains(&inode)
    }

    pub(crate) fn has_replaced(&self) -> bool {
        !self.retired_inodes.is_empty()
    }

    /// No mapping of a replaced store is left.
    pub(crate) fn forget_replaced(&mut self) {
        self.retired_inodes.clear();
    }

    /// The memfd's inode number, to recognise this store's mappings in `/proc/self/maps`.
    pub(crate) fn inode(&self) -> u64 {
        self.inode
    }

    pub(crate) fn fd(&self) -> i32 {
        self.file.fd.as_raw_fd()
    }

    /// Address of copy `id` in this process's shared view.
    pub(crate) fn addr(&self, id: KeyId) -> usize {
        self.file.base + id as usize * PAGE
    }

    /// Allocates `n` ids, consecutive when possible so that runs of merged pages map with one call.
    pub(crate) fn alloc(&mut self, n: usize) -> Option<Vec<KeyId>> {
        self.collect_released();
        let mut out = Vec::with_capacity(n);
        let fresh = (self.file.capacity - self.bump) as usize;
        let from_bump = n.min(fresh);
        if from_bump < n {
            self.punch_pending();
        }
        out.extend(self.bump..self.bump + from_bump as u32);
        self.bump += from_bump as u32;
        while out.len() < n {
            match self.free.pop() {
                Some(id) => out.push(id),
                None => {
                    // Not enough: give the ids back and report the store full.
                    self.free
                        .extend(out.iter().filter(|&&id| (id as usize) < self.refs.len()));
                    return None;
                }
            }
        }
        if self.bump > 0 {
            self.ensure(self.bump - 1);
        }
        for &id in &out {
            self.allocated[id as usize] = true;
            self.allocated_at[id as usize] = self.allocs;
            self.zero_hole[id as usize] = false;
        }
        self.allocs += 1;
        self.given_out += out.len() as u64;
        Some(out)
    }

    /// Whether `id` holds a live copy (allocated and not freed since).
    pub(crate) fn is_allocated(&self, id: KeyId) -> bool {
        self.allocated.get(id as usize).copied().unwrap_or(false)
    }

    /// A mark to pass to [`Store::reallocated_since`] later.
    pub(crate) fn allocation_mark(&self) -> u64 {
        self.allocs
    }

    /// Whether `id` was given out again after `mark` was taken: a copy named before may have been
    /// freed and reused for other bytes since (a page read ahead periods ago named it).
    pub(crate) fn reallocated_since(&self, id: KeyId, mark: u64) -> bool {
        self.allocated_at
            .get(id as usize)
            .is_some_and(|&at| at >= mark)
    }

    /// Takes the ids whose grace period ended; those already freed become reusable.
    fn collect_released(&mut self) {
        let released =
            std::mem::take(&mut *self.file.released.lock().unwrap_or_else(|e| e.into_inner()));
        for id in released {
            let t = &mut self.in_tree[id as usize];
            *t = t.saturating_sub(1);
            if *t == 0 && !self.allocated[id as usize] {
                self.give_back(id);
            }
        }
    }

    /// Frees the copies whose grace period has ended (called every period, so memory comes back
    /// even when no new copy is allocated), and the held copies that `mappings` (read after
    /// [`Store::held_check`]) show no mapping covers any more.
    pub(crate) fn reclaim(&mut self, mappings: Option<HeldCheck>) {
        // Let the epoch advance so that deferred releases run.
        for _ in 0..2 {
            crossbeam_epoch::pin().flush();
        }
        self.collect_released();
        if let Some(check) = mappings {
            self.release_held(check);
        }
        if let Some(r) = &self.remote {
            r.flush();
        }
        self.punch_pending();
    }

    /// When held copies are due to be checked against the process's mappings: how many are
    /// held now, the ones the mappings read next decide for (see the `held` module). The
    /// mappings are read without the engine's state lock (about 0.5 ms per thousand), then
    /// handed to [`Store::reclaim`].
    pub(crate) fn held_check(&self) -> Option<usize> {
        // Relaxed: see note_fork. After a fork a child may still map what this process no
        // longer does (its copy of a mapping this process unmapped since): held for good, as
        // every copy freed after a fork is kept.
        let due = self.held.due(std::time::Instant::now()) && !FORKED.load(Ordering::Relaxed);
        due.then(|| self.held.snapshot())
    }

    /// Gives back the held copies of the snapshot that no mapping covers any more (see the
    /// `held` module).
    fn release_held(&mut self, check: HeldCheck) {
        let now = std::time::Instant::now();
        if FORKED.load(Ordering::Relaxed) {
            return;
        }
        let maps = match check.mappings {
            Ok(m) => m,
            Err(e) => {
                tracing::debug!(error = %e, "the mappings could not be read; copies stay held");
                self.held.put_off(now);
                return;
            }
        };
        // Relaxed: orders nothing. An area mapped but not yet recorded here is taken for a
        // mapping of every copy, which keeps them held until the next check: never a copy freed
        // while mapped.
        let area = self.file.staging_at.load(Ordering::Relaxed);
        let maps: Vec<_> = maps.into_iter().filter(|m| m.start != area).collect();
        let covered = covered_copies(&maps, self.inode);
        for id in self.held.clear(&covered, check.held, now, check.moves) {
            let i = id as usize;
            // Given out again meanwhile (adopted from the daemon): its next free decides.
            if self.allocated[i] || self.in_tree[i] != 0 {
                continue;
            }
            self.mapped[i] = false;
            self.release(id);
        }
    }

    /// Copies held back from reuse (see the `held` module).
    pub(crate) fn held(&self) -> usize {
        self.held.len()
    }

    /// Tells the daemon, if any, that this process maps none of its copies any more (called once
    /// every region is unregistered, so merged pages are private again). Not after a `fork`: a
    /// child may still map copies.
    pub(crate) fn say_goodbye(&self) {
        // Relaxed: see note_fork.
        if FORKED.load(Ordering::Relaxed) {
            return;
        }
        if let Some(r) = &self.remote {
            r.goodbye();
        }
    }

    /// Punches the copies freed since the last call, one call per run of consecutive ids, and
    /// makes their ids reusable (lowest first, so reused ids come in runs too).
    pub(crate) fn punch_pending(&mut self) {
        if !self.held_unpunched.is_empty() {
            let mut ids = std::mem::take(&mut self.held_unpunched);
            ids.sort_unstable();
            punch_runs(self.fd(), &ids);
        }
        if self.pending.is_empty() {
            return;
        }
        let mut ids = std::mem::take(&mut self.pending);
        ids.sort_unstable();
        punch_runs(self.fd(), &ids);
        // `alloc` pops from the end.
        self.free.extend(ids.iter().rev());
    }

    /// Records the outcome of inserting copy `id` (already written) into the tree. Returns the id
    /// to use: `id`, or the id of an identical copy already published (then `id` is freed).
    pub(crate) fn record_insert(
        &mut self,
        id: KeyId,
        result: Result<Insert, pageone_index::IndexError>,
    ) -> Result<KeyId, EngineError> {
        let result = match result {
            Ok(r) => r,
            Err(e) => {
                self.discard(id);
                return Err(EngineError::Index(e));
            }
        };
        match result {
            Insert::Inserted(e) => {
                self.indexed[id as usize] = true;
                self.in_tree[id as usize] += 1;
                if self.entries.len() <= id as usize {
                    self.entries.resize(id as usize + 1, None);
                }
                self.entries[id as usize] = Some(e);
                Ok(id)
            }
            Insert::Found(e) => {
                self.discard(id);
                Ok(e.key())
            }
        }
    }

    /// The tree to look pages up in, `None` with a daemon: there the daemon's index answers by
    /// hash for every copy of the scope (this process's adopted ones included), so walking a
    /// tree of them here would only repeat that (with reads of the copies' bytes) for every page.
    pub(crate) fn local_index(&self) -> Option<Arc<SdTree<StoreKeys>>> {
        self.remote.is_none().then(|| self.tree.clone())
    }

    /// Records a daemon's slot, new here, as usable for merges (see [`Store::local_index`]: it
    /// is not put in the tree). Returns the id.
    pub(crate) fn record_adopted(&mut self, id: KeyId) -> KeyId {
        self.indexed[id as usize] = true;
        id
    }

    /// Frees an unpublished, unmapped copy.
    fn discard(&mut self, id: KeyId) {
        self.allocated[id as usize] = false;
        if self.in_tree[id as usize] == 0 {
            self.give_back(id);
        }
    }

    /// How many more pages of this process may map copy `id` under the sharing limit `cap`: none
    /// when the copy was retired here (it reached the limit), `cap` when it is new here.
    pub(crate) fn room(&self, id: KeyId, cap: u32) -> u32 {
        let i = id as usize;
        match self.refs.get(i) {
            None => cap,
            Some(_) if self.allocated[i] && !self.indexed[i] => 0,
            Some(&r) => cap.saturating_sub(r),
        }
    }

    /// Whether this is a store of the process's own (no daemon): its counts of the pages
    /// mapping each copy are then all of them.
    pub(crate) fn is_local(&self) -> bool {
        self.remote.is_none()
    }

    pub(crate) fn refs(&self, id: KeyId) -> u32 {
        self.refs[id as usize]
    }

    /// One more page maps copy `id`, or is about to: a reference taken for a merge is taken
    /// back (`undo_ref`) if the merge does not happen. Whether a mapping of the copy was made, or
    /// tried, is noted apart (`note_mapped`).
    pub(crate) fn add_ref(&mut self, id: KeyId) {
        let r = &mut self.refs[id as usize];
        *r += 1;
        if self.zero_hole[id as usize] {
            self.hole_refs += 1;
            return;
        }
        if *r == 1 {
            self.shared += 1;
        }
        self.sharing_refs += 1;
    }

    /// A mapping of copies `ids` over the program's pages was made or tried: once freed, they
    /// are held until the process's mappings show none covering them (see the `held` module).
    /// Copies whose merges never got that far (pages refused or changed, the budget spent) are
    /// reused at once.
    pub(crate) fn note_mapped(&mut self, ids: Range<KeyId>) {
        self.mapped[ids.start as usize..ids.end as usize].fill(true);
    }

    /// Takes one page's reference off copy `id`; returns whether none is left.
    fn take_ref(&mut self, id: KeyId) -> bool {
        let r = &mut self.refs[id as usize];
        debug_assert!(*r > 0);
        *r -= 1;
        let none_left = *r == 0;
        if self.zero_hole[id as usize] {
            self.hole_refs -= 1;
        } else {
            self.sharing_refs -= 1;
            if none_left {
                self.shared -= 1;
            }
        }
        none_left
    }

    /// Marks the freshly allocated, unpublished ids `ids` as zero holes (see `zero_hole`): the
    /// caller leaves them unwritten. Allocated ids read zeros: fresh ones were never written, and
    /// freed ones are punched before they are given out again.
    pub(crate) fn mark_zero_holes(&mut self, ids: &[KeyId]) {
        for &id in ids {
            debug_assert!(self.allocated[id as usize] && self.refs[id as usize] == 0);
            self.zero_hole[id as usize] = true;
        }
    }

    /// Whether `id` is a zero hole (see `zero_hole`).
    pub(crate) fn is_zero_hole(&self, id: KeyId) -> bool {
        self.zero_hole.get(id as usize).copied().unwrap_or(false)
    }

    /// Takes copy `id` out of the index (it stays mapped by its pages) so that a new copy is made
    /// for further duplicates: how the per-copy sharing limit is enforced.
    pub(crate) fn retire(&mut self, id: KeyId) {
        if let Some(e) = self.entries.get_mut(id as usize).and_then(Option::take) {
            self.tree.remove(e);
        }
        self.indexed[id as usize] = false;
    }

    /// Takes back a reference counted for a merge that did not happen, without freeing the copy:
    /// other pages of this period may still merge with it (new copies left unmapped are freed at
    /// the end of the period).
    pub(crate) fn undo_ref(&mut self, id: KeyId) {
        self.take_ref(id);
    }

    /// One page fewer maps copy `id`; frees the copy when none does.
    pub(crate) fn drop_ref(&mut self, id: KeyId) {
        if self.take_ref(id) {
            self.free_unmapped(id);
        }
    }

    /// Frees copy `id` if no page maps it (used for copies made this period that merged nothing).
    pub(crate) fn free_unmapped(&mut self, id: KeyId) {
        if self.refs[id as usize] != 0 || !self.allocated[id as usize] {
            return;
        }
        self.retire(id);
        self.allocated[id as usize] = false;
        // The tree may read a removed key until it releases it (walkers in flight, and inner
        // nodes keep it as a representative until their generation check fails), so a copy it
        // indexed is punched and reused only then (collect_released). Punching earlier made
        // lookups of equal pages miss and duplicate copies appear.
        if self.in_tree[id as usize] == 0 {
            self.give_back(id);
        }
    }

    /// Frees an id nothing counts as mapping it or indexes; held while a mapping may still cover
    /// it (see the `held` module), else released at once.
    fn give_back(&mut self, id: KeyId) {
        // Relaxed: see note_fork. A copy freed just before a fork is not mapped by anyone.
        if FORKED.load(Ordering::Relaxed) {
            return;
        }
        if self.mapped[id as usize] {
            self.held.hold(id);
            match &self.remote {
                Some(r) => r.vacate(id),
                None => self.held_unpunched.push(id),
            }
            return;
        }
        self.release(id);
    }

    /// Frees an id no page covers: punched (by `punch_pending`) and reused here, or released to
    /// the daemon.
    fn release(&mut self, id: KeyId) {
        match &self.remote {
            Some(r) => r.release(id),
            None => self.pending.push(id),
        }
    }

    /// With a daemon, ids are the scope's slots, and the per-id tables reach the highest slot this
    /// process ever used (20 bytes an id: 2.6 MiB for a scope of 512 MiB of copies, in every
    /// process of it). Where none of the top half of the tables is in use here any more (this
    /// process's merged memory went: unregistered, unmerged, handed to the kernel's KSM), they are
    /// cut to the last id in use and their memory goes back. Called between periods that did no
    /// work; it reads the tables only when few copies are mapped here.
    /// Returns whether it cut them.
    pub(crate) fn shrink_unused_tables(&mut self) -> bool {
        let len = self.refs.len();
        if self.remote.is_none() || len < SHRINK_MIN_IDS || self.shared as usize * 4 > len {
            return false;
        }
        let in_use = |i: usize| {
            self.refs[i] != 0
                || self.allocated[i]
                || self.indexed[i]
                || self.in_tree[i] != 0
                || self.zero_hole[i]
                || self.mapped[i]
        };
        let Some(keep) = unused_tail_from(len, in_use) else {
            return false;
        };
        fn cut<T>(v: &mut Vec<T>, keep: usize) {
            v.truncate(keep);
            v.shrink_to_fit();
        }
        cut(&mut self.refs, keep);
        cut(&mut self.indexed, keep);
        cut(&mut self.in_tree, keep);
        cut(&mut self.allocated, keep);
        cut(&mut self.allocated_at, keep);
        cut(&mut self.zero_hole, keep);
        cut(&mut self.mapped, keep);
        true
    }

    fn ensure(&mut self, id: KeyId) {
        let need = id as usize + 1;
        if self.refs.len() < need {
            self.refs.resize(need, 0);
            self.indexed.resize(need, false);
            self.in_tree.resize(need, 0);
            self.allocated.resize(need, false);
            self.allocated_at.resize(need, 0);
            self.zero_hole.resize(need, false);
            self.mapped.resize(need, false);
            // `entries` grows only with insertions into the tree (none with a daemon).
        }
    }

    /// Takes a slot the daemon holds for this process. `Some(true)`: new here, to be inserted in
    /// the tree; `Some(false)`: already indexed here, usable as is; `None`: not usable now (it is
    /// being retired here), and still held for the id's own life here.
    pub(crate) fn adopt(&mut self, id: KeyId) -> Option<bool> {
        if id >= self.file.capacity {
            return None;
        }
        self.ensure(id);
        if let Some(r) = &self.remote {
            // An answer from before this process vacated the slot: the daemon may empty it.
            if r.is_vacated(id) {
                return None;
            }
            r.keep(id);
        }
        let i = id as usize;
        match (self.allocated[i], self.indexed[i]) {
            (true, true) => Some(false),
            // Retired (sharing limit) and still mapped here: not for new merges.
            (true, false) => None,
            // New here, or removed from the tree and not yet released (in_tree counts both
            // insertions, so the copy is given back only after both releases).
            (false, _) => {
                self.allocated[i] = true;
                // A copy, unless the caller marks it a zero hole (`mark_zero_holes`): the slot
                // may have been one here before the daemon gave it other contents.
                self.zero_hole[i] = false;
                Some(true)
            }
        }
    }

    /// Gives back a slot adopted as new that will not be used.
    pub(crate) fn unadopt(&mut self, id: KeyId) {
        self.allocated[id as usize] = false;
        if self.in_tree[id as usize] == 0 {
            self.give_back(id);
        }
    }

    /// Whether this store is a daemon's scope store that can no longer be reached.
    pub(crate) fn daemon_state(&self) -> &'static str {
        match &self.remote {
            None => "none",
            Some(r) if r.is_lost() => "lost",
            Some(_) => "connected",
        }
    }

    /// Bytes of engine metadata attributable to the store (tree nodes and per-copy arrays).
    pub(crate) fn metadata_bytes(&self) -> u64 {
        // Per id: refs and in_tree (4 bytes each), allocated_at (8), indexed, allocated,
        // zero_hole and mapped (1 each); tree entries only up to the highest id ever inserted.
        let per_id = 2 * std::mem::size_of::<u32>()
            + std::mem::size_of::<u64>()
            + 4 * std::mem::size_of::<bool>();
        let entries = self.entries.len() * std::mem::size_of::<Option<pageone_index::Entry>>();
        (self.tree.nodes_allocated() * 32 + self.refs.len() * per_id + entries) as u64
    }
}

/// Where per-id tables of `len` ids can be cut (see [`Store::shrink_unused_tables`]): after the
/// last id `in_use`, if that leaves half of them or less.
fn unused_tail_from(len: usize, in_use: impl Fn(usize) -> bool) -> Option<usize> {
    let keep = (0..len).rposition(in_use).map_or(0, |i| i + 1);
    (keep * 2 <= len).then_some(keep)
}

/// Writes the pages at `srcs` into the store file `fd` as copies `ids`, one `pwritev` per run of
/// consecutive ids. Needs no lock on the store: the ids are allocated to the caller and not yet
/// published. The kernel reads the sources, which may be changing: every merge is verified later
/// on frozen bytes.
pub(crate) fn write_copies(fd: i32, srcs: &[usize], ids: &[KeyId]) -> std::io::Result<()> {
    for (k, m) in runs(ids) {
        sys::pwrite_pages(fd, &srcs[k..k + m], ids[k] as u64 * PAGE as u64)?;
    }
    Ok(())
}

/// Whether slot `id` of the store at `fd` reads all zeros (a zero hole a daemon made: read
/// with `pread`, which reads a hole of the file as zeros without giving it a page, as a read
/// through a mapping would).
pub(crate) fn reads_zero(fd: i32, id: KeyId) -> bool {
    let mut page = [0u8; PAGE];
    // SAFETY: `page` is this function's own buffer, not borrowed during the call.
    let got = unsafe { sys::pread_into(fd, page.as_mut_ptr(), PAGE, id as u64 * PAGE as u64) };
    got.is_ok_and(|n| n == PAGE) && page.iter().all(|&b| b == 0)
}

#[cfg(test)]
mod tests {
    use super::{unused_tail_from, Store};
    use proptest::prelude::*;

    proptest! {
        /// The tables are cut only after the last id in use, and only when that frees half of
        /// them or more.
        #[test]
        fn tables_are_cut_only_past_the_last_id_in_use(
            used in proptest::collection::vec(any::<bool>(), 0..300),
        ) {
            let len = used.len();
            match unused_tail_from(len, |i| used[i]) {
                Some(keep) => {
                    prop_assert!(keep * 2 <= len);
                    prop_assert!(used[keep..].iter().all(|&u| !u));
                    prop_assert!(keep == 0 || used[keep - 1]);
                }
                None => {
                    let last = used.iter().rposition(|&u| u).map_or(0, |i| i + 1);
                    prop_assert!(last * 2 > len);
                }
            }
        }
    }

    /// A slot that was a zero hole here, freed and taken again (a daemon that gave it other
    /// contents meanwhile), is a copy again: merges onto it compare with its bytes.
    #[test]
    fn a_slot_taken_again_is_no_zero_hole_any_more() {
        let mut store = Store::new(4).unwrap();
        assert_eq!(store.adopt(2), Some(true));
        store.mark_zero_holes(&[2]);
        assert!(store.is_zero_hole(2));
        store.free_unmapped(2);
        assert!(!store.is_allocated(2));
        assert_eq!(store.adopt(2), Some(true));
        assert!(!store.is_zero_hole(2));
    }

    /// A copy named before an allocation mark is known stale once its id is given out again
    /// (freed, punched, reused), and only then.
    #[test]
    fn reuse_of_an_id_after_a_mark_is_seen() {
        // Two pages: fresh ids run out, so the next allocation reuses a freed one.
        let mut store = Store::new(2).unwrap();
        let ids = store.alloc(2).unwrap();
        let mark = store.allocation_mark();
        assert!(!store.reallocated_since(ids[0], mark));
        assert!(!store.reallocated_since(ids[1], mark));
        // Never published in the tree: freed at once, reusable once punched.
        store.free_unmapped(ids[0]);
        store.punch_pending();
        let again = store.alloc(1).unwrap();
        assert_eq!(again, vec![ids[0]]);
        assert!(store.reallocated_since(ids[0], mark));
        assert!(!store.reallocated_since(ids[1], mark));
        // A mark taken after the reuse does not see it.
        assert!(!store.reallocated_since(ids[0], store.allocation_mark()));
    }
}
