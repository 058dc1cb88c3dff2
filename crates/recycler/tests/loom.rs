//! Loom model of the mark/unmark/recycle race. Run with
//! `RUSTFLAGS="--cfg loom" cargo test -p pageone-recycler --test loom --release`.
//!
//! The page is three mark words and one data word behind a mutex: the kernel makes every access
//! to a frozen page wait, which the recycler models by holding the mutex from its check to the
//! release. The property: whatever the interleaving, a write the program makes after `unmark`
//! returns is never released, and no slot stays taken.
#![cfg(loom)]

use loom::sync::{Arc, Mutex};
use loom::thread;
use pageone_recycler::Pool;

const ADDR: usize = 0x7000;
const DATA: u64 = 42;

struct Page {
    words: [u64; 4],
}

fn recycle_once(pool: &Pool, page: &Mutex<Page>) {
    let tickets = pool.claim(4, |a| {
        assert_eq!(a, ADDR);
        let g = page.lock().unwrap();
        Some([g.words[0], g.words[1], g.words[2]])
    });
    for t in tickets {
        // Freeze, check the mark on the frozen bytes, release (zeros) or put back.
        let mut g = page.lock().unwrap();
        let released = pool.is_marked(&t, [g.words[0], g.words[1], g.words[2]]);
        if released {
            g.words = [0; 4];
        }
        drop(g);
        pool.finish(t, released);
    }
}

#[test]
fn a_write_after_unmark_is_never_released() {
    loom::model(|| {
        let pool = Arc::new(Pool::with_values(2, 7, 99));
        let page = Arc::new(Mutex::new(Page { words: [0; 4] }));
        let (p, g) = (pool.clone(), page.clone());
        let app = thread::spawn(move || {
            assert!(p.mark_with(ADDR, |k, v| g.lock().unwrap().words[k] = v));
            p.unmark_with(
                ADDR,
                |k| g.lock().unwrap().words[k],
                |k, v| g.lock().unwrap().words[k] = v,
            );
            g.lock().unwrap().words[3] = DATA;
        });
        recycle_once(&pool, &page);
        app.join().unwrap();
        assert_eq!(
            page.lock().unwrap().words[3],
            DATA,
            "a write after unmark was lost"
        );
        assert_eq!(pool.busy_slots(), 0, "a slot leaked");
    });
}

#[test]
fn a_marked_page_is_released_once_and_its_slot_freed() {
    loom::model(|| {
        let pool = Arc::new(Pool::with_values(2, 7, 99));
        let page = Arc::new(Mutex::new(Page {
            words: [0, 0, 0, 5],
        }));
        let (p, g) = (pool.clone(), page.clone());
        let app = thread::spawn(move || {
            assert!(p.mark_with(ADDR, |k, v| g.lock().unwrap().words[k] = v));
        });
        recycle_once(&pool, &page);
        app.join().unwrap();
        // The recycler met the mark, or ran before it: another pass finishes the job.
        recycle_once(&pool, &page);
        assert_eq!(page.lock().unwrap().words, [0; 4]);
        assert_eq!(pool.stats().recycled, 1);
        assert_eq!(pool.busy_slots(), 0);
    });
}
