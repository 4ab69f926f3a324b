//! The store against a real SQLite file.

mod common;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_store_contract() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("tessera.db").display());
    let store = tessera_tenancy::Store::connect(&url).await.unwrap();
    assert_eq!(store.backend(), "sqlite");
    common::store_contract(&store).await;
    // Reopening runs no migration twice and keeps the data.
    drop(store);
    let again = tessera_tenancy::Store::connect(&url).await.unwrap();
    assert_eq!(again.list_tenants().await.unwrap().len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_scopes_audit_and_retention() {
    let (_dir, store) = fresh_store().await;
    common::store_admin_contract(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_scheduling_and_cache_salt() {
    let (_dir, store) = fresh_store().await;
    common::store_scheduling_contract(&store).await;
}

/// Writers on the pool's several connections at once: a transaction that reads
/// before it writes must wait for the lock, not fail with "database is locked".
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_writers_wait_for_the_lock() {
    let (_dir, store) = fresh_store().await;
    let tenant = store
        .create_tenant("alpha", tessera_tenancy::Limits::default())
        .await
        .unwrap();
    let mut tasks = Vec::new();
    for i in 0..16 {
        let store = store.clone();
        let id = tenant.id.clone();
        tasks.push(tokio::spawn(async move {
            for j in 0..8 {
                store.create_key(&id, &format!("k{i}-{j}")).await?;
            }
            Ok::<_, tessera_tenancy::StoreError>(())
        }));
    }
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    assert_eq!(
        store.list_keys(Some(&tenant.id)).await.unwrap().len(),
        16 * 8
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_model_access() {
    let (_dir, store) = fresh_store().await;
    common::store_model_access_contract(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_dashboard_reads_and_sessions() {
    let (_dir, store) = fresh_store().await;
    common::store_dashboard_contract(&store).await;
}

/// A store in a fresh SQLite file (kept while the directory lives).
async fn fresh_store() -> (tempfile::TempDir, tessera_tenancy::Store) {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("tessera.db").display());
    let store = tessera_tenancy::Store::connect(&url).await.unwrap();
    (dir, store)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_finetunes() {
    let (_dir, store) = fresh_store().await;
    common::store_finetunes_contract(&store).await;
}
