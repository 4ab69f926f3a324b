//! The store against a real PostgreSQL server (see [`tessera_tenancy::testing`]).

mod common;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_store_contract() {
    let (_server, url) = tessera_tenancy::testing::PgServer::from_env_or_start();
    let store = tessera_tenancy::Store::connect(&url).await.unwrap();
    assert_eq!(store.backend(), "postgres");
    // A shared server may hold rows from earlier runs: the contract creates fresh
    // tenants with random ids, so counts below are per tenant.
    common::store_contract(&store).await;
    // Migrations are idempotent.
    let again = tessera_tenancy::Store::connect(&url).await.unwrap();
    assert!(again.list_tenants().await.unwrap().len() >= 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_scopes_audit_and_retention() {
    let (_server, url) = tessera_tenancy::testing::PgServer::from_env_or_start();
    let store = tessera_tenancy::Store::connect(&url).await.unwrap();
    common::store_admin_contract(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_scheduling_and_cache_salt() {
    let (_server, url) = tessera_tenancy::testing::PgServer::from_env_or_start();
    let store = tessera_tenancy::Store::connect(&url).await.unwrap();
    common::store_scheduling_contract(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_model_access() {
    let (_server, url) = tessera_tenancy::testing::PgServer::from_env_or_start();
    let store = tessera_tenancy::Store::connect(&url).await.unwrap();
    common::store_model_access_contract(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_dashboard_reads_and_sessions() {
    let (_server, url) = tessera_tenancy::testing::PgServer::from_env_or_start();
    let store = tessera_tenancy::Store::connect(&url).await.unwrap();
    common::store_dashboard_contract(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_finetunes() {
    let (_server, url) = tessera_tenancy::testing::PgServer::from_env_or_start();
    let store = tessera_tenancy::Store::connect(&url).await.unwrap();
    common::store_finetunes_contract(&store).await;
}
