//! A child forked after merging keeps its data, whatever the parent does with the copies it
//! inherited (own process: the fork pins copies for the rest of this test binary's life).

use std::time::Duration;

use pageone_engine::Engine;
use pageone_sys as sys;

const PAGE: usize = 4096;
const PAGES: usize = 256;

fn content(i: usize) -> u64 {
    (i % 16) as u64 + 1
}

fn page_ok(p: *const u8, i: usize) -> bool {
    // SAFETY: p points to a mapped page of the region; volatile: the engine may remap it.
    let v = unsafe { std::ptr::read_volatile(p.add(content(i) as usize * 8).cast::<u64>()) };
    v == content(i)
}

#[test]
fn a_forked_child_keeps_merged_data_when_the_parent_writes_and_unregisters() {
    let e = Engine::builder()
        .merge_period(Duration::from_millis(20))
        .build()
        .expect("engine");
    let len = PAGES * PAGE;
    let r = sys::mmap_anonymous(len).unwrap();
    for i in 0..PAGES {
        // SAFETY: page i of the fresh mapping; 16 distinct contents repeated (duplicates).
        unsafe {
            std::ptr::write_volatile(
                r.add(i * PAGE + content(i) as usize * 8).cast::<u64>(),
                content(i),
            )
        };
    }
    e.register(r, len).unwrap();
    let t0 = std::time::Instant::now();
    while e.stats().pages_sharing < (PAGES - 16) as u64 {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "merging did not happen"
        );
        e.wait_periods(1, Duration::from_secs(5));
    }
    // SAFETY: the child only reads memory, sleeps and _exits (async-signal-safe enough: no locks,
    // no allocation).
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        // Child: wait until the parent has broken every merge and freed what it could.
        // SAFETY: plain sleep.
        unsafe { libc::usleep(1_500_000) };
        let ok = (0..PAGES).all(|i| page_ok(r.wrapping_add(i * PAGE), i));
        // SAFETY: leaves without running the parent's destructors or test harness.
        unsafe { libc::_exit(if ok { 0 } else { 1 }) };
    }
    // Parent: write every page (copy-on-write breaks drop every reference), then unregister.
    for i in 0..PAGES {
        // SAFETY: the region is mapped and owned by this test; volatile write of one word.
        unsafe { std::ptr::write_volatile(r.add(i * PAGE + PAGE - 8).cast::<u64>(), 7) };
    }
    e.wait_periods(5, Duration::from_secs(10));
    e.unregister(r, len).unwrap();
    e.wait_periods(3, Duration::from_secs(10));
    let mut status = 0;
    // SAFETY: waits for our own child.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "the child lost merged data after its parent freed the copies (status {status:#x})"
    );
}

/// What a fork hook records for a child: the registered ranges, adjacent regions joined, and how
/// many there are when the buffer is too short.
#[test]
fn registered_ranges_join_adjacent_regions_and_count_what_does_not_fit() {
    let e = Engine::builder().build().expect("engine");
    let r = sys::mmap_anonymous(12 * PAGE).unwrap();
    let a = r as usize;
    e.register(r, 4 * PAGE).unwrap();
    e.register(r.wrapping_add(4 * PAGE), 4 * PAGE).unwrap();
    e.register(r.wrapping_add(10 * PAGE), 2 * PAGE).unwrap();
    let mut out = [(0, 0); 4];
    assert_eq!(e.registered_ranges(&mut out), 2);
    assert_eq!(
        out[..2],
        [(a, a + 8 * PAGE), (a + 10 * PAGE, a + 12 * PAGE)]
    );
    let mut short = [(0, 0); 1];
    assert_eq!(e.registered_ranges(&mut short), 2);
    assert_eq!(short[0], (a, a + 8 * PAGE));
    e.unregister(r, 12 * PAGE).unwrap();
    assert_eq!(e.registered_ranges(&mut out), 0);
}
