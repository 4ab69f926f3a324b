//! A small fork-join pool for the forward pass: `parallel_for(n, f)` runs
//! `f(0..n)` on the calling thread plus persistent workers.
//!
//! Why not rayon: a decode step issues ~150 short parallel regions (tens of
//! microseconds each). Rayon parks idle workers, and waking them costs as much as
//! the work (measured: ~25% of batch-1 decode time in the scheduler). Here workers
//! spin for a short while after each region before they park, so back-to-back
//! regions of one step never pay a wake-up.
//!
//! Protocol (one region at a time, serialized by `gate`):
//! 1. the caller stores the job, zeroes `done`, then publishes `state = (n, 0)`
//!    (release): `n` tasks, next index 0;
//! 2. anyone (caller or worker) claims index `i` by a compare-exchange of `state`
//!    from `(n, i)` to `(n, i + 1)` (acquire), and only then reads the job; after
//!    `f(i)` it increments `done` (release);
//! 3. the caller returns once `done == n` (acquire), so no claim is outstanding and
//!    the job is never read after `f` is gone. A worker that wakes late finds
//!    `(n, n)` and claims nothing, so the caller never waits for sleepers.
//!
//! Parking uses a mutex + condvar; `sleeping` and `state` use `SeqCst` so a worker
//! about to sleep either sees the new work or is counted and notified.

use std::cell::Cell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::OnceLock;
use std::time::Duration;
use sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::*};
use sync::{Arc, Condvar, JobCell, Mutex};

/// Synchronization primitives: std normally, loom's under `--cfg loom` so the
/// protocol below is model-checked (`RUSTFLAGS="--cfg loom" cargo test -p
/// tessera-kernels --release pool::loom_tests`).
mod sync {
    #[cfg(loom)]
    pub(super) use loom::sync::{atomic, Arc, Condvar, Mutex};
    #[cfg(not(loom))]
    pub(super) use std::sync::{atomic, Arc, Condvar, Mutex};

    use super::Job;

    /// The published job pointer.
    pub(super) struct JobCell(
        #[cfg(loom)] loom::cell::UnsafeCell<Job>,
        #[cfg(not(loom))] std::cell::UnsafeCell<Job>,
    );

    impl JobCell {
        pub(super) fn new(j: Job) -> Self {
            #[cfg(loom)]
            return Self(loom::cell::UnsafeCell::new(j));
            #[cfg(not(loom))]
            return Self(std::cell::UnsafeCell::new(j));
        }

        /// # Safety
        /// No other thread may be reading the job (no outstanding claim).
        pub(super) unsafe fn set(&self, j: Job) {
            #[cfg(loom)]
            self.0.with_mut(|p| unsafe { *p = j });
            #[cfg(not(loom))]
            unsafe {
                *self.0.get() = j
            };
        }

        /// # Safety
        /// The caller holds a claim of the current region.
        pub(super) unsafe fn get(&self) -> Job {
            #[cfg(loom)]
            return self.0.with(|p| unsafe { *p });
            #[cfg(not(loom))]
            return unsafe { *self.0.get() };
        }
    }

    /// Busy-wait hint (a scheduler yield under loom, which must see every wait).
    pub(super) fn spin() {
        #[cfg(loom)]
        loom::thread::yield_now();
        #[cfg(not(loom))]
        std::hint::spin_loop();
    }

    pub(super) fn yield_now() {
        #[cfg(loom)]
        loom::thread::yield_now();
        #[cfg(not(loom))]
        std::thread::yield_now();
    }

    pub(super) fn spawn(name: String, f: impl FnOnce() + Send + 'static) -> JoinHandle {
        #[cfg(loom)]
        {
            let _ = name;
            loom::thread::spawn(f)
        }
        #[cfg(not(loom))]
        std::thread::Builder::new()
            .name(name)
            .spawn(f)
            .expect("spawn kernel worker")
    }

    #[cfg(loom)]
    pub(super) type JoinHandle = loom::thread::JoinHandle<()>;
    #[cfg(not(loom))]
    pub(super) type JoinHandle = std::thread::JoinHandle<()>;

    /// Whether an idle worker should keep spinning (`started` = when it went idle).
    pub(super) fn keep_spinning(started: std::time::Instant, spins: u32) -> bool {
        #[cfg(loom)]
        {
            let _ = (started, spins);
            false
        }
        #[cfg(not(loom))]
        {
            !spins.is_multiple_of(256) || started.elapsed() < super::SPIN
        }
    }
}

/// How long an idle worker spins before it parks.
#[cfg_attr(loom, allow(dead_code))]
const SPIN: Duration = Duration::from_micros(500);

type Job = *const (dyn Fn(usize) + Sync);

struct Shared {
    /// `(n << 32) | next`.
    state: AtomicU64,
    job: JobCell,
    done: AtomicUsize,
    panicked: AtomicBool,
    sleeping: AtomicUsize,
    shutdown: AtomicBool,
    park: Mutex<()>,
    wake: Condvar,
}

// SAFETY: `job` is written only by the caller holding `gate` while no claim is
// outstanding (`done == n` of the previous region), and read only by a thread
// holding a claim of the current region. `Job` points at a `Sync` closure.
unsafe impl Sync for Shared {}
unsafe impl Send for Shared {}

fn unpack(v: u64) -> (usize, usize) {
    ((v >> 32) as usize, (v & 0xFFFF_FFFF) as usize)
}

impl Shared {
    /// Claims the next task of the current region, if any.
    fn claim(&self) -> Option<usize> {
        let mut v = self.state.load(Acquire);
        loop {
            let (n, i) = unpack(v);
            if i >= n {
                return None;
            }
            match self.state.compare_exchange_weak(v, v + 1, AcqRel, Acquire) {
                Ok(_) => return Some(i),
                Err(cur) => v = cur,
            }
        }
    }

    fn has_work(&self) -> bool {
        let (n, i) = unpack(self.state.load(SeqCst));
        i < n
    }

    /// Claims and runs tasks until none are left.
    fn run(&self) {
        while let Some(i) = self.claim() {
            // SAFETY: our claim keeps the region (and so the job) alive.
            let f = unsafe { &*self.job.get() };
            if catch_unwind(AssertUnwindSafe(|| f(i))).is_err() {
                self.panicked.store(true, Relaxed);
            }
            self.done.fetch_add(1, Release);
        }
    }
}

/// A fork-join pool with `workers` background threads.
pub struct ThreadPool {
    shared: Arc<Shared>,
    gate: Mutex<()>,
    workers: usize,
    handles: Vec<sync::JoinHandle>,
}

#[cfg(not(loom))]
thread_local! {
    static IN_REGION: Cell<bool> = const { Cell::new(false) };
}
#[cfg(loom)]
loom::thread_local! {
    static IN_REGION: Cell<bool> = Cell::new(false);
}

fn noop(_: usize) {}

impl ThreadPool {
    /// Starts `workers` background threads (0 runs everything on the caller).
    pub fn new(workers: usize) -> Self {
        let noop: &(dyn Fn(usize) + Sync) = &noop;
        let shared = Arc::new(Shared {
            state: AtomicU64::new(0),
            job: JobCell::new(noop as Job),
            done: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            sleeping: AtomicUsize::new(0),
            shutdown: AtomicBool::new(false),
            park: Mutex::new(()),
            wake: Condvar::new(),
        });
        let handles = (0..workers)
            .map(|i| {
                let s = shared.clone();
                sync::spawn(format!("tessera-kernel-{i}"), move || worker(&s))
            })
            .collect();
        Self {
            shared,
            gate: Mutex::new(()),
            workers,
            handles,
        }
    }

    /// Threads that run a region, the caller included.
    pub fn threads(&self) -> usize {
        self.workers + 1
    }

    /// Runs `f(i)` for every `i` in `0..n`, spread over the pool; returns when all
    /// calls are done. Nested calls (from inside `f`) run serially.
    ///
    /// Panics if any `f(i)` panicked (after all tasks finished).
    pub fn parallel_for(&self, n: usize, f: impl Fn(usize) + Sync) {
        if n == 0 {
            return;
        }
        if self.workers == 0 || n == 1 || IN_REGION.with(|c| c.get()) {
            (0..n).for_each(f);
            return;
        }
        assert!(n < 1 << 32, "too many tasks");
        let _gate = self.gate.lock().unwrap_or_else(|e| e.into_inner());
        let s = &*self.shared;
        let job: &(dyn Fn(usize) + Sync) = &f;
        // SAFETY: lifetime erased; we return only after every claimed task is done.
        let job: Job = unsafe { std::mem::transmute::<&(dyn Fn(usize) + Sync), Job>(job) };
        // SAFETY: no claim is outstanding (previous region completed).
        unsafe { s.job.set(job) };
        s.done.store(0, Relaxed);
        s.panicked.store(false, Relaxed);
        s.state.store((n as u64) << 32, SeqCst);
        if s.sleeping.load(SeqCst) > 0 {
            let _g = s.park.lock().unwrap_or_else(|e| e.into_inner());
            s.wake.notify_all();
        }
        IN_REGION.with(|c| c.set(true));
        s.run();
        IN_REGION.with(|c| c.set(false));
        let mut spins = 0u32;
        while s.done.load(Acquire) != n {
            spins = spins.saturating_add(1);
            if spins < 4096 {
                sync::spin();
            } else {
                // A worker holding a claim was descheduled: give it the core.
                sync::yield_now();
            }
        }
        assert!(!s.panicked.load(Relaxed), "a kernel task panicked");
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, SeqCst);
        {
            let _g = self.shared.park.lock().unwrap_or_else(|e| e.into_inner());
            self.shared.wake.notify_all();
        }
        for h in self.handles.drain(..) {
            let _ = h.join();
        }
    }
}

fn worker(s: &Shared) {
    IN_REGION.with(|c| c.set(true));
    loop {
        s.run();
        let start = std::time::Instant::now();
        let mut spins = 0u32;
        loop {
            if s.shutdown.load(Relaxed) {
                return;
            }
            if s.has_work() {
                break;
            }
            spins = spins.wrapping_add(1);
            if sync::keep_spinning(start, spins) {
                sync::spin();
                continue;
            }
            let mut g = s.park.lock().unwrap_or_else(|e| e.into_inner());
            s.sleeping.fetch_add(1, SeqCst);
            while !s.has_work() && !s.shutdown.load(SeqCst) {
                g = s.wake.wait(g).unwrap_or_else(|e| e.into_inner());
            }
            s.sleeping.fetch_sub(1, SeqCst);
        }
    }
}

/// The process-wide pool: `available_parallelism - 1` workers, or
/// `TESSERA_THREADS - 1` when that variable is set.
pub fn global() -> &'static ThreadPool {
    static POOL: OnceLock<ThreadPool> = OnceLock::new();
    POOL.get_or_init(|| {
        let threads = std::env::var("TESSERA_THREADS")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
        ThreadPool::new(threads.max(1) - 1)
    })
}

#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;

    /// Two regions back to back with one worker: every task runs exactly once per
    /// region, the caller never returns before its tasks are done, and the job of
    /// region 1 is never read after the caller left it (loom checks the UnsafeCell
    /// accesses), under every interleaving including the worker parking.
    #[test]
    fn regions_complete_exactly_once_under_all_interleavings() {
        let mut model = loom::model::Builder::new();
        // Bounded preemption keeps the search finite with the spin-waits; the
        // bound of 2 covers a claim racing the next region's publication.
        model.preemption_bound = Some(3);
        model.check(|| {
            let pool = ThreadPool::new(1);
            for _ in 0..2 {
                let hits = [AtomicUsize::new(0), AtomicUsize::new(0)];
                pool.parallel_for(2, |i| {
                    hits[i].fetch_add(1, Relaxed);
                });
                assert_eq!(hits[0].load(Relaxed), 1);
                assert_eq!(hits[1].load(Relaxed), 1);
            }
            drop(pool);
        });
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    #[test]
    fn every_index_runs_exactly_once_across_many_regions() {
        let pool = ThreadPool::new(3);
        for n in [1, 2, 3, 7, 64, 1000] {
            let hits: Vec<AtomicU32> = (0..n).map(|_| AtomicU32::new(0)).collect();
            for _ in 0..50 {
                pool.parallel_for(n, |i| {
                    hits[i].fetch_add(1, Relaxed);
                });
            }
            assert!(hits.iter().all(|h| h.load(Relaxed) == 50), "n = {n}");
        }
    }

    #[test]
    fn regions_after_workers_parked_still_complete() {
        let pool = ThreadPool::new(1);
        let sum = AtomicUsize::new(0);
        pool.parallel_for(10, |i| {
            sum.fetch_add(i, Relaxed);
        });
        std::thread::sleep(SPIN * 3); // the worker parks
        pool.parallel_for(10, |i| {
            sum.fetch_add(i, Relaxed);
        });
        assert_eq!(sum.load(Relaxed), 90);
    }

    #[test]
    fn nested_regions_run_serially_instead_of_deadlocking() {
        let pool = ThreadPool::new(2);
        let count = AtomicUsize::new(0);
        pool.parallel_for(4, |_| {
            pool.parallel_for(5, |_| {
                count.fetch_add(1, Relaxed);
            })
        });
        assert_eq!(count.load(Relaxed), 20);
    }

    #[test]
    fn concurrent_callers_are_serialized() {
        let pool = Arc::new(ThreadPool::new(1));
        let total = Arc::new(AtomicUsize::new(0));
        let handles: Vec<_> = (0..4)
            .map(|_| {
                let (pool, total) = (pool.clone(), total.clone());
                std::thread::spawn(move || {
                    for _ in 0..100 {
                        pool.parallel_for(8, |_| {
                            total.fetch_add(1, Relaxed);
                        });
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        assert_eq!(total.load(Relaxed), 4 * 100 * 8);
    }

    #[test]
    fn a_panicking_task_panics_the_caller_and_the_pool_survives() {
        let pool = ThreadPool::new(2);
        let r = catch_unwind(AssertUnwindSafe(|| {
            pool.parallel_for(16, |i| assert!(i != 11, "task 11 fails"))
        }));
        assert!(r.is_err());
        let count = AtomicUsize::new(0);
        pool.parallel_for(16, |_| {
            count.fetch_add(1, Relaxed);
        });
        assert_eq!(count.load(Relaxed), 16);
    }
}
