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
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("tessera.db").display());
    let store = tessera_tenancy::Store::connect(&url).await.unwrap();
    common::store_admin_contract(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_scheduling_and_cache_salt() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("tessera.db").display());
    let store = tessera_tenancy::Store::connect(&url).await.unwrap();
    common::store_scheduling_contract(&store).await;
}
