//! The engine's worker threads: started once at idle CPU priority and reused every period, so the
//! engine never creates threads (and their stack VMAs) while the process may be near its VMA or
//! memory limit.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use pageone_sys as sys;

type Job = Arc<dyn Fn(usize) + Send + Sync>;

struct State {
    job: Option<Job>,
    /// Incremented for every job; a worker runs each generation once.
    generation: u64,
    /// Workers taking part in the current job (the first `parts`).
    parts: usize,
    remaining: usize,
    stop: bool,
}

struct Shared {
    state: Mutex<State>,
    work: Condvar,
    done: Condvar,
    cpu_ns: AtomicU64,
}

pub(crate) struct Pool {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
}

fn lock(m: &Mutex<State>) -> std::sync::MutexGuard<'_, State> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Pool {
    pub(crate) fn new(n: usize) -> std::io::Result<Self> {
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                job: None,
                generation: 0,
                parts: 0,
                remaining: 0,
                stop: false,
            }),
            work: Condvar::new(),
            done: Condvar::new(),
            cpu_ns: AtomicU64::new(0),
        });
        let mut pool = Self {
            shared,
            threads: Vec::new(),
        };
        pool.grow(n.max(1))?;
        Ok(pool)
    }

    pub(crate) fn size(&self) -> usize {
        self.threads.len()
    }

    /// Adds workers up to `n` (called on reconfiguration, never during a period).
    pub(crate) fn grow(&mut self, n: usize) -> std::io::Result<()> {
        while self.threads.len() < n {
            let index = self.threads.len();
            let shared = self.shared.clone();
            let t = std::thread::Builder::new()
                .name(format!("pageone-worker-{index}"))
                .spawn(move || worker(&shared, index))?;
            self.threads.push(t);
        }
        Ok(())
    }

    /// Runs `job(part)` for `part` in `0..parts` on the first `parts` workers and waits for all.
    pub(crate) fn run(&self, parts: usize, job: Job) {
        let parts = parts.clamp(1, self.threads.len());
        let mut st = lock(&self.shared.state);
        st.job = Some(job);
        st.generation += 1;
        st.parts = parts;
        st.remaining = parts;
        self.shared.work.notify_all();
        while st.remaining > 0 {
            st = self.shared.done.wait(st).unwrap_or_else(|e| e.into_inner());
        }
        st.job = None;
    }

    /// Splits `items` into `parts` consecutive chunks and runs `f(first index, chunk)` for each on
    /// the workers; returns the results in chunk order (`None` for a part that did not report,
    /// which only a bug can cause: callers then act on nothing).
    pub(crate) fn map_parts<T, R, F>(
        &self,
        parts: usize,
        items: Arc<Vec<T>>,
        f: F,
    ) -> Vec<Option<R>>
    where
        T: Send + Sync + 'static,
        R: Send + 'static,
        F: Fn(usize, &[T]) -> R + Send + Sync + 'static,
    {
        let parts = parts.clamp(1, self.threads.len());
        let n = items.len();
        let chunk = n.div_ceil(parts).max(1);
        let out: Arc<Vec<Mutex<Option<R>>>> =
            Arc::new((0..parts).map(|_| Mutex::new(None)).collect());
        {
            let out = out.clone();
            self.run(
                parts,
                Arc::new(move |part| {
                    let lo = (part * chunk).min(n);
                    let hi = ((part + 1) * chunk).min(n);
                    let r = f(lo, &items[lo..hi]);
                    *out[part].lock().unwrap_or_else(|e| e.into_inner()) = Some(r);
                }),
            );
        }
        out.iter()
            .map(|m| m.lock().unwrap_or_else(|e| e.into_inner()).take())
            .collect()
    }

    /// CPU time the workers spent in jobs so far, in nanoseconds.
    pub(crate) fn cpu_ns(&self) -> u64 {
        // Relaxed: a statistic; each worker's add happens before it reports the job done.
        self.shared.cpu_ns.load(Ordering::Relaxed)
    }
}

fn worker(sh: &Shared, index: usize) {
    let _ = sys::set_thread_idle_priority();
    let mut seen = 0;
    loop {
        let job = {
            let mut st = lock(&sh.state);
            loop {
                if st.stop {
                    return;
                }
                if st.generation != seen {
                    seen = st.generation;
                    if index < st.parts {
                        break st.job.clone();
                    }
                }
                st = sh.work.wait(st).unwrap_or_else(|e| e.into_inner());
            }
        };
        let t = sys::thread_cpu_time_ns();
        if let Some(job) = job {
            // A panicking job must not leave the committer waiting forever.
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| job(index)));
        }
        sh.cpu_ns
            .fetch_add(sys::thread_cpu_time_ns() - t, Ordering::Relaxed);
        let mut st = lock(&sh.state);
        st.remaining -= 1;
        if st.remaining == 0 {
            sh.done.notify_all();
        }
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        lock(&self.shared.state).stop = true;
        self.shared.work.notify_all();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}
