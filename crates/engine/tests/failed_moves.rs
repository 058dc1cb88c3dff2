//! Merged memory made anonymous again when the kernel refuses to move a part of its copy, as a
//! kernel short of memory would (injected: `Engine::fail_a_copys_move_after`): nothing is lost,
//! no writer is held, and where the kernel unmapped the destination first (Linux 6.8 to 6.16
//! may) nothing another thread mapped in that hole meanwhile is replaced. A binary of its own:
//! the tests of other files map and unmap memory, which could land in such a hole.

use pageone_engine::{MoveFailure, SQUATTER};

mod common;
use common::{
    advise, halves_unregistered, holds, pages_without, small_engine, store_mappings, unmap,
    wait_for, PAGE,
};

/// Merged memory advised in parts is made anonymous again part by part; when the move of a part
/// fails (as a kernel short of memory fails it), nothing is lost and no writer is held: a
/// writer of a page after the failed part goes on, every page keeps its bytes, and it all ends
/// anonymous memory with the advice of its part (the span tried again mapping by mapping).
#[test]
fn a_failed_move_of_a_part_of_a_copy_loses_nothing_and_holds_no_writer() {
    failed_move_of_a_part_loses_nothing(MoveFailure::Refused);
}

/// The same where the kernel unmapped the part's destination before it refused (Linux 6.8 to
/// 6.16 may, when the mapping count reached the limit meanwhile): the copy goes into the hole.
#[test]
fn a_move_refused_after_unmapping_its_destination_loses_nothing() {
    failed_move_of_a_part_loses_nothing(MoveFailure::AfterUnmapping);
}

/// The same where another thread of the program mapped memory at the end of that hole before
/// the engine went on: it keeps that memory and its bytes, and every other page of the part goes
/// back with its bytes and advice. (The copy was once moved into the whole hole, replacing the
/// other thread's mapping: seen on Linux 6.12, where a test binary's other tests map memory.)
#[test]
fn a_hole_left_by_a_refused_move_is_filled_around_another_threads_mapping() {
    failed_move_of_a_part_loses_nothing(MoveFailure::AfterUnmappingTaken { pages: 3 });
}

/// The same where the move into the hole is refused too, before unmapping anything: the bytes
/// are copied into the hole.
#[test]
fn a_hole_whose_move_is_refused_again_takes_the_bytes_copied() {
    failed_move_of_a_part_loses_nothing(MoveFailure::AfterUnmappingTwice);
}

/// Page `i` of `base` holds the other thread's bytes in every word.
fn squatted(base: usize, i: usize) -> bool {
    (0..PAGE / 8).all(|w| {
        // SAFETY: a word of the test's range, mapped, which no thread writes meanwhile.
        let v = unsafe { ((base + i * PAGE + w * 8) as *const u64).read_volatile() };
        v == SQUATTER
    })
}

fn failed_move_of_a_part_loses_nothing(how: MoveFailure) {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    // One at a time: the failure asked for is the process's.
    static ONE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = ONE.lock().unwrap_or_else(|e| e.into_inner());
    use std::sync::Arc;
    let e = small_engine(false);
    let n = 64;
    let (base, len) = (halves_unregistered(n), 2 * n * PAGE);
    e.merge(base as *mut u8, len).unwrap();
    advise(base + 16 * PAGE, 32 * PAGE, libc::MADV_DONTFORK);
    let s = wait_for(&e, |s| s.pages_sharing >= n as u64);
    assert_eq!(s.pages_sharing, n as u64, "{s:?}");
    assert!(store_mappings(base, len) > 0);
    // A writer of page 100's last word (zero in every page's contents), in the second half.
    let (stop, written) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicU64::new(0)),
    );
    let word = base + 101 * PAGE - 8;
    let writer = {
        let (stop, written) = (stop.clone(), written.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                let v = written.load(Ordering::Relaxed) + 1;
                // SAFETY: a word of the test's mapping only this thread writes until joined,
                // which happens before the mapping is unmapped.
                unsafe { (word as *mut u64).write_volatile(v) };
                written.store(v, Ordering::Relaxed);
            }
        })
    };
    // The span's first part ([0, 16)) moves; the second's move fails.
    e.fail_a_copys_move_after(1, base as *mut u8, len, how);
    e.unregister(base as *mut u8, len).unwrap();
    assert!(!e.copy_move_failure_pending(), "no move failed");
    let before = written.load(Ordering::Relaxed);
    std::thread::sleep(std::time::Duration::from_millis(200));
    assert!(
        written.load(Ordering::Relaxed) > before,
        "the writer is held after the failed move"
    );
    stop.store(true, Ordering::Relaxed);
    writer.join().unwrap();
    assert_eq!(store_mappings(base, len), 0, "store mappings left");
    // The part that failed is [16, 48), the end of it the other thread's where it took it.
    let taken = match how {
        MoveFailure::AfterUnmappingTaken { pages } => 48 - pages..48,
        _ => 48..48,
    };
    let inherited: Vec<usize> = (0..16).chain(taken.clone()).chain(48..2 * n).collect();
    assert_eq!(pages_without("dc", base, 2 * n), inherited);
    // SAFETY: the writer was joined; nothing else writes the mapping.
    let last = unsafe { (word as *const u64).read_volatile() };
    assert_eq!(
        last,
        written.load(Ordering::Relaxed),
        "the last write was lost"
    );
    // SAFETY: as above.
    unsafe { (word as *mut u64).write_volatile(0) };
    for i in 0..2 * n {
        if taken.contains(&i) {
            assert!(squatted(base, i), "the other thread's page {i}");
        } else {
            assert!(holds(base, i, (i % n) as u64 + 1), "page {i}");
        }
    }
    unmap(base, len);
}
