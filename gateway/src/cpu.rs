//! The bounded pool for the CPU-heavy steps of the request path: parsing a body,
//! chat templates, tokenizing, grammar compiles (everything `validation` does).
//! They run on tokio's blocking threads, never on the async workers, so that a
//! slow body (a 1 MB batch of 256 items) cannot stall `/healthz`, other
//! connections or other tenants' streams.
//!
//! Two lanes, each a semaphore: [`Lane::Request`] (one request's body, as many
//! jobs at once as the machine has cores) and [`Lane::Batch`] (an async batch's
//! body and items, half the cores, at least one), so that batches queue behind
//! each other and never take every thread from single requests. The permit is held
//! by the blocking job itself: a caller that goes away (client disconnect) does not
//! free its slot before the job ends, so the bound holds.

use std::sync::Arc;
use tokio::sync::Semaphore;

/// Which lane a job runs in (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Lane {
    /// One request's own steps.
    Request,
    /// An async batch's steps (its body and every item).
    Batch,
}

/// The pool: one semaphore per lane.
#[derive(Debug)]
pub(crate) struct CpuPool {
    request: Arc<Semaphore>,
    batch: Arc<Semaphore>,
}

impl CpuPool {
    /// `threads` jobs at once in the request lane, `threads / 2` (at least 1) in the
    /// batch lane.
    pub(crate) fn new(threads: usize) -> Self {
        let threads = threads.max(1);
        Self {
            request: Arc::new(Semaphore::new(threads)),
            batch: Arc::new(Semaphore::new((threads / 2).max(1))),
        }
    }

    /// Sized from the machine's cores (`std::thread::available_parallelism`).
    pub(crate) fn from_cores() -> Self {
        Self::new(std::thread::available_parallelism().map_or(1, |n| n.get()))
    }

    /// Runs `f` on a blocking thread once `lane` has a free slot, and returns its
    /// result. A panic in `f` resumes in the caller, as if `f` ran inline.
    pub(crate) async fn run<T, F>(&self, lane: Lane, f: F) -> T
    where
        F: FnOnce() -> T + Send + 'static,
        T: Send + 'static,
    {
        let sem = match lane {
            Lane::Request => &self.request,
            Lane::Batch => &self.batch,
        };
        let permit = sem
            .clone()
            .acquire_owned()
            .await
            .expect("the pool's semaphores are never closed");
        let job = tokio::task::spawn_blocking(move || {
            let _permit = permit;
            f()
        });
        match job.await {
            Ok(v) => v,
            Err(e) => std::panic::resume_unwind(e.into_panic()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn lanes_bound_the_jobs_running_at_once() {
        let pool = Arc::new(CpuPool::new(4));
        let running = Arc::new(AtomicUsize::new(0));
        let most = Arc::new(AtomicUsize::new(0));
        let jobs: Vec<_> = (0..8)
            .map(|_| {
                let (pool, running, most) = (pool.clone(), running.clone(), most.clone());
                tokio::spawn(async move {
                    pool.run(Lane::Batch, move || {
                        let now = running.fetch_add(1, Ordering::SeqCst) + 1;
                        most.fetch_max(now, Ordering::SeqCst);
                        std::thread::sleep(std::time::Duration::from_millis(20));
                        running.fetch_sub(1, Ordering::SeqCst);
                    })
                    .await
                })
            })
            .collect();
        for j in jobs {
            j.await.unwrap();
        }
        let most = most.load(Ordering::SeqCst);
        assert!(
            (1..=2).contains(&most),
            "half of 4 in the batch lane: {most}"
        );
        assert_eq!(pool.run(Lane::Request, || 7).await, 7);
    }
}
