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
//!
//! Within a lane, one tenant holds at most half its slots (at least one): a
//! tenant's further jobs wait in that tenant's own queue, so one tenant's flood of
//! megabyte bodies cannot take every slot from the others (issue 32 review: their
//! time to first token had grown by seconds).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use tokio::sync::Semaphore;

/// Share entries kept before unused ones are swept.
const MAX_IDLE_SHARES: usize = 1024;

/// Which lane a job runs in (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Lane {
    /// One request's own steps.
    Request,
    /// An async batch's steps (its body and every item).
    Batch,
}

/// The pool: one semaphore per lane, and one per tenant and lane for the tenant's
/// share of it.
#[derive(Debug)]
pub(crate) struct CpuPool {
    request: Arc<Semaphore>,
    batch: Arc<Semaphore>,
    /// Slots of each lane.
    sizes: [usize; 2],
    /// Each tenant's share of a lane, while it has jobs there (entries without
    /// holders are removed).
    shares: Mutex<HashMap<(Lane, String), Arc<Semaphore>>>,
}

impl CpuPool {
    /// `threads` jobs at once in the request lane, `threads / 2` (at least 1) in the
    /// batch lane; one tenant at most half of either (at least 1).
    pub(crate) fn new(threads: usize) -> Self {
        let threads = threads.max(1);
        let batch = (threads / 2).max(1);
        Self {
            request: Arc::new(Semaphore::new(threads)),
            batch: Arc::new(Semaphore::new(batch)),
            sizes: [threads, batch],
            shares: Mutex::new(HashMap::new()),
        }
    }

    /// How many of `lane`'s slots one tenant may hold at once.
    pub(crate) fn tenant_share(&self, lane: Lane) -> usize {
        (self.sizes[lane as usize] / 2).max(1)
    }

    /// `tenant`'s share semaphore of `lane`, created on first use.
    fn share(&self, lane: Lane, tenant: &str) -> Arc<Semaphore> {
        let mut shares = self.shares.lock().unwrap_or_else(|e| e.into_inner());
        if shares.len() > MAX_IDLE_SHARES {
            // Entries a dropped caller left behind (its job still held a permit then).
            shares.retain(|_, s| Arc::strong_count(s) > 1);
        }
        shares
            .entry((lane, tenant.to_string()))
            .or_insert_with(|| Arc::new(Semaphore::new(self.tenant_share(lane))))
            .clone()
    }

    /// Drops `tenant`'s share of `lane` once no job holds or waits on it. Clones are
    /// only made under the lock, so a count of 1 there means the map's alone.
    fn release_share(&self, lane: Lane, tenant: &str, share: Arc<Semaphore>) {
        drop(share);
        let mut shares = self.shares.lock().unwrap_or_else(|e| e.into_inner());
        let key = (lane, tenant.to_string());
        if shares.get(&key).is_some_and(|s| Arc::strong_count(s) == 1) {
            shares.remove(&key);
        }
    }

    /// Tenants with a share entry now (jobs running or waiting), for tests.
    #[cfg(test)]
    fn tenants_tracked(&self) -> usize {
        self.shares.lock().unwrap().len()
    }

    /// Sized from the machine's cores (`std::thread::available_parallelism`).
    pub(crate) fn from_cores() -> Self {
        Self::new(std::thread::available_parallelism().map_or(1, |n| n.get()))
    }

    /// Runs `f` for `tenant` on a blocking thread once the tenant's share of `lane`
    /// and then `lane` itself have a free slot, and returns its result. A panic in
    /// `f` resumes in the caller, as if `f` ran inline.
    pub(crate) async fn run<T, F>(&self, lane: Lane, tenant: &str, f: F) -> T
    where
        F: FnOnce() -> T + Send + 'static,
        T: Send + 'static,
    {
        let share = self.share(lane, tenant);
        // Dropped (a caller gone away while waiting) or finished: the entry goes
        // once unused.
        let guard = ShareGuard {
            pool: self,
            lane,
            tenant,
            share: Some(share.clone()),
        };
        let mine = share
            .acquire_owned()
            .await
            .expect("the pool's semaphores are never closed");
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
            let _permits = (mine, permit);
            f()
        });
        let out = job.await;
        drop(guard);
        match out {
            Ok(v) => v,
            Err(e) => std::panic::resume_unwind(e.into_panic()),
        }
    }
}

/// Releases a tenant's share entry when [`CpuPool::run`] ends or is dropped.
struct ShareGuard<'a> {
    pool: &'a CpuPool,
    lane: Lane,
    tenant: &'a str,
    share: Option<Arc<Semaphore>>,
}

impl Drop for ShareGuard<'_> {
    fn drop(&mut self) {
        if let Some(s) = self.share.take() {
            self.pool.release_share(self.lane, self.tenant, s);
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
        // A tenant each, so that only the lane (not a tenant's share) bounds them.
        let jobs: Vec<_> = (0..8)
            .map(|i| {
                let (pool, running, most) = (pool.clone(), running.clone(), most.clone());
                tokio::spawn(async move {
                    pool.run(Lane::Batch, &format!("t{i}"), move || {
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
        assert!(most <= 2, "half of 4 in the batch lane: {most}");
        assert_eq!(pool.run(Lane::Request, "t", || 7).await, 7);
        assert_eq!(pool.tenants_tracked(), 0);
    }

    /// Tenant `a` fills its share of the request lane with jobs that wait for `b`'s
    /// job to finish: without shares, `a` would hold every slot and `b` never run.
    /// A deadlock, not a duration, is what this catches (the timeout only ends it).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn one_tenant_cannot_take_every_slot_of_a_lane() {
        let pool = Arc::new(CpuPool::new(2));
        assert_eq!(pool.tenant_share(Lane::Request), 1);
        let released = Arc::new((std::sync::Mutex::new(false), std::sync::Condvar::new()));
        let running = Arc::new(AtomicUsize::new(0));
        let most = Arc::new(AtomicUsize::new(0));
        let floods: Vec<_> = (0..6)
            .map(|_| {
                let (pool, released) = (pool.clone(), released.clone());
                let (running, most) = (running.clone(), most.clone());
                tokio::spawn(async move {
                    pool.run(Lane::Request, "a", move || {
                        let now = running.fetch_add(1, Ordering::SeqCst) + 1;
                        most.fetch_max(now, Ordering::SeqCst);
                        let (lock, cv) = &*released;
                        let mut done = lock.lock().unwrap();
                        while !*done {
                            done = cv.wait(done).unwrap();
                        }
                        running.fetch_sub(1, Ordering::SeqCst);
                    })
                    .await
                })
            })
            .collect();
        tokio::task::yield_now().await;
        let b = tokio::time::timeout(
            std::time::Duration::from_secs(60),
            pool.run(Lane::Request, "b", || 42),
        )
        .await;
        {
            let (lock, cv) = &*released;
            *lock.lock().unwrap() = true;
            cv.notify_all();
        }
        assert_eq!(b.ok(), Some(42), "tenant b never got a slot");
        for f in floods {
            f.await.unwrap();
        }
        assert_eq!(most.load(Ordering::SeqCst), 1, "a held more than its share");
        assert_eq!(
            pool.tenants_tracked(),
            0,
            "share entries are dropped when unused"
        );
    }
}
