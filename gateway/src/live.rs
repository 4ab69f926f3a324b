//! Requests in flight by key, and the watcher that ends them when their key stops
//! being valid: revoked, expired, or its tenant suspended, through the admin API,
//! the CLI or another gateway sharing the store.
//!
//! Every admitted request registers its tenant and key ([`Live::register`]) and
//! holds the returned [`LiveGuard`] until its usage row is written. The watcher
//! ([`watch`]) asks the store which of the registered keys are no longer valid
//! ([`tessera_tenancy::Store::invalid_keys`]), every poll interval while anything is
//! in flight and at once when the admin API revokes or suspends ([`Live::kick`]),
//! and sends each affected request its error; the request's driver aborts it.

use crate::error::{ApiError, ErrorKind};
use dashmap::DashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tessera_tenancy::{AuthError, Store};
use tokio::sync::{watch, Notify};

struct Entry {
    key_id: String,
    kill: watch::Sender<Option<ApiError>>,
}

/// The registry of requests in flight (one per process, in `AppState`). Every
/// request registers and unregisters once; a [`DashMap`] keeps them from queueing on
/// one lock (the watcher's scans lock one shard at a time).
#[derive(Default)]
pub(crate) struct Live {
    entries: DashMap<u64, Entry>,
    next: AtomicU64,
    kick: Notify,
}

/// A registered request; unregisters on drop. `kill` turns `Some` when the
/// request must end with that error.
pub(crate) struct LiveGuard {
    live: Arc<Live>,
    id: u64,
    pub(crate) kill: watch::Receiver<Option<ApiError>>,
}

impl Drop for LiveGuard {
    fn drop(&mut self) {
        self.live.entries.remove(&self.id);
    }
}

impl Live {
    /// Registers a request made with `key_id`.
    pub(crate) fn register(self: &Arc<Self>, key_id: &str) -> LiveGuard {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let (kill, rx) = watch::channel(None);
        self.entries.insert(
            id,
            Entry {
                key_id: key_id.into(),
                kill,
            },
        );
        LiveGuard {
            live: self.clone(),
            id,
            kill: rx,
        }
    }

    /// Asks the watcher to check now (after the admin API revoked a key or
    /// suspended a tenant).
    pub(crate) fn kick(&self) {
        self.kick.notify_one();
    }

    fn keys(&self) -> Vec<String> {
        let mut keys: Vec<String> = self.entries.iter().map(|e| e.key_id.clone()).collect();
        keys.sort_unstable();
        keys.dedup();
        keys
    }

    /// Sends `err` to every request made with `key_id`; returns how many.
    fn kill_key(&self, key_id: &str, err: &ApiError) -> usize {
        let mut n = 0;
        for e in self.entries.iter().filter(|e| e.key_id == key_id) {
            if e.kill.borrow().is_none() {
                let _ = e.kill.send(Some(err.clone()));
                n += 1;
            }
        }
        n
    }
}

/// The error a request in flight ends with when its key stopped being valid.
pub(crate) fn abort_error(why: &AuthError) -> ApiError {
    let kind = match why {
        AuthError::Suspended(_) => ErrorKind::Forbidden,
        _ => ErrorKind::Unauthenticated,
    };
    ApiError::new(kind, format!("{why}; the request was aborted"))
}

/// The watcher loop: checks the keys of requests in flight every `poll` (and
/// when kicked) and kills those whose key is no longer valid. Runs until dropped.
pub(crate) async fn watch(live: Arc<Live>, store: Store, poll: Duration) {
    loop {
        tokio::select! {
            _ = tokio::time::sleep(poll) => {}
            _ = live.kick.notified() => {}
        }
        let keys = live.keys();
        if keys.is_empty() {
            continue;
        }
        match store.invalid_keys(&keys).await {
            Ok(bad) => {
                for (key_id, why) in bad {
                    let n = live.kill_key(&key_id, &abort_error(&why));
                    if n > 0 {
                        tracing::warn!(%key_id, reason = why.label(), requests = n,
                            "aborting requests in flight: key no longer valid");
                    }
                }
            }
            Err(e) => tracing::error!(error = %e, "cannot check the keys of requests in flight"),
        }
    }
}
