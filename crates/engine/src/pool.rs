//! The engine's worker threads: started once at idle CPU priority and reused every period, so the
//! engine never creates threads (and their stack VMAs) while the process may be near its VMA or
//! memory limit.
//!
//! The pool is a queue of parts shared by every thread that submits work (the classifier and the
//! committer run concurrently). A submitter runs parts of its own job while it waits, so a job
//! finishes even when every worker is busy with another submitter's parts, and no CPU idles.

use pageone_sync::lock;
use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex};

use pageone_sys as sys;

use crate::apart::{self, EngineThread};

type Job = Arc<dyn Fn(usize) + Send + Sync>;

/// Counts down the parts of one job; its submitter waits for zero.
struct Latch {
    remaining: Mutex<usize>,
    zero: Condvar,
}

impl Latch {
    fn count_down(&self) {
        let mut r = lock(&self.remaining);
        *r -= 1;
        if *r == 0 {
            self.zero.notify_all();
        }
    }
}

/// A job queued with [`Pool::spawn`].
pub(crate) struct Pending(Arc<Latch>);

impl Pending {
    /// Waits until every part of the job ran (the workers run queued parts until the pool is
    /// dropped, so this returns while the pool lives).
    pub(crate) fn wait(&self) {
        let mut r = lock(&self.0.remaining);
        while *r > 0 {
            r = self.0.zero.wait(r).unwrap_or_else(|e| e.into_inner());
        }
    }

    pub(crate) fn is_done(&self) -> bool {
        *lock(&self.0.remaining) == 0
    }
}

struct Task {
    job: Job,
    part: usize,
    latch: Arc<Latch>,
}

impl Task {
    fn run(self) {
        let Task { job, part, latch } = self;
        // A panicking part must not leave its submitter waiting forever.
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| job(part)));
        // The job, and what it holds, goes before the count: a submitter woken by the last part
        // holds the job's shared data alone again.
        drop(job);
        latch.count_down();
    }
}

#[derive(Default)]
struct Queue {
    tasks: VecDeque<Task>,
    stop: bool,
}

struct Shared {
    queue: Mutex<Queue>,
    work: Condvar,
    /// Where each worker records its CPU clock when it starts.
    clocks: Arc<Mutex<Vec<sys::CpuClock>>>,
}

pub(crate) struct Pool {
    shared: Arc<Shared>,
    threads: Mutex<Vec<EngineThread<()>>>,
}

impl Pool {
    /// Starts `n` workers; each adds its CPU clock to `clocks`.
    pub(crate) fn new(n: usize, clocks: Arc<Mutex<Vec<sys::CpuClock>>>) -> std::io::Result<Self> {
        let pool = Self {
            shared: Arc::new(Shared {
                queue: Mutex::new(Queue::default()),
                work: Condvar::new(),
                clocks,
            }),
            threads: Mutex::new(Vec::new()),
        };
        pool.grow(n.max(1))?;
        Ok(pool)
    }

    pub(crate) fn size(&self) -> usize {
        lock(&self.threads).len()
    }

    /// Adds workers up to `n`.
    pub(crate) fn grow(&self, n: usize) -> std::io::Result<()> {
        let mut threads = lock(&self.threads);
        while threads.len() < n {
            let index = threads.len();
            let shared = self.shared.clone();
            let t = apart::spawn(format!("pageone-worker-{index}"), move || worker(&shared))?;
            threads.push(t);
        }
        Ok(())
    }

    /// Queues `job(part)` for `part` in `0..parts` and returns at once; the workers run the parts
    /// in order of submission.
    pub(crate) fn spawn(&self, parts: usize, job: Job) -> Pending {
        let parts = parts.max(1);
        let latch = Arc::new(Latch {
            remaining: Mutex::new(parts),
            zero: Condvar::new(),
        });
        {
            let mut q = lock(&self.shared.queue);
            for part in 0..parts {
                q.tasks.push_back(Task {
                    job: job.clone(),
                    part,
                    latch: latch.clone(),
                });
            }
        }
        self.shared.work.notify_all();
        Pending(latch)
    }

    /// Runs `job(part)` for `part` in `0..parts` and waits for all; the calling thread runs parts
    /// too (its CPU time is its own, not the pool's).
    pub(crate) fn run(&self, parts: usize, job: Job) {
        let pending = self.spawn(parts, job);
        // Help with this job's parts that no worker took yet.
        loop {
            let mine = {
                let mut q = lock(&self.shared.queue);
                let at = q
                    .tasks
                    .iter()
                    .position(|t| Arc::ptr_eq(&t.latch, &pending.0));
                at.and_then(|i| q.tasks.remove(i))
            };
            match mine {
                Some(t) => t.run(),
                None => break,
            }
        }
        pending.wait();
    }

    /// Splits `items` into `parts` consecutive chunks and runs `f(first index, chunk)` for each;
    /// returns the results in chunk order (`None` for a part that did not report, which only a
    /// bug can cause: callers then act on nothing).
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
        let parts = parts.max(1);
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
                    *lock(&out[part]) = Some(r);
                }),
            );
        }
        out.iter().map(|m| lock(m).take()).collect()
    }
}

fn worker(sh: &Shared) {
    let mut background = sys::Background::start();
    if let Ok(c) = sys::CpuClock::current() {
        lock(&sh.clocks).push(c);
    }
    loop {
        let task = {
            let mut q = lock(&sh.queue);
            loop {
                // Queued parts run even when stopping: someone may wait for them.
                if let Some(t) = q.tasks.pop_front() {
                    break t;
                }
                if q.stop {
                    return;
                }
                q = sh.work.wait(q).unwrap_or_else(|e| e.into_inner());
            }
        };
        background.check();
        task.run();
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        lock(&self.shared.queue).stop = true;
        self.shared.work.notify_all();
        for t in lock(&self.threads).drain(..) {
            let _ = t.join();
        }
    }
}
