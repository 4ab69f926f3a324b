//! Usage ledger queries: record, read, prune and aggregate.

use super::dates::rfc3339;
use super::rows::{get_i64, get_str};
use super::types::{GroupBy, StoreError, UsageGroup, UsageRecord};
use super::Store;
use sqlx::any::AnyRow;

fn usage_from_row(r: &AnyRow) -> Result<UsageRecord, StoreError> {
    Ok(UsageRecord {
        request_id: get_str(r, "request_id")?,
        tenant_id: get_str(r, "tenant_id")?,
        key_id: get_str(r, "key_id")?,
        model: get_str(r, "model")?,
        endpoint: get_str(r, "endpoint")?,
        status: get_i64(r, "status")? as u16,
        error_code: get_i64(r, "error_code")? as u32,
        finish: get_str(r, "finish")?,
        input_tokens: get_i64(r, "input_tokens")?,
        output_tokens: get_i64(r, "output_tokens")?,
        cached_tokens: get_i64(r, "cached_tokens")?,
        cached_host_tokens: get_i64(r, "cached_host_tokens")?,
        cached_disk_tokens: get_i64(r, "cached_disk_tokens")?,
        ttft_us: get_i64(r, "ttft_us")?,
        duration_us: get_i64(r, "duration_us")?,
        created_ms: get_i64(r, "created_ms")?,
    })
}

impl Store {
    /// Writes a usage row. Returns false (and changes nothing) when a row with the
    /// same request id exists: a request is recorded exactly once.
    pub async fn record_usage(&self, u: &UsageRecord) -> Result<bool, StoreError> {
        let r = sqlx::query(
            "INSERT INTO usage_ledger (request_id, tenant_id, key_id, model, endpoint, status, \
             error_code, finish, input_tokens, output_tokens, cached_tokens, cached_host_tokens, \
             cached_disk_tokens, ttft_us, duration_us, created_ms) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16) \
             ON CONFLICT (request_id) DO NOTHING",
        )
        .bind(&u.request_id)
        .bind(&u.tenant_id)
        .bind(&u.key_id)
        .bind(&u.model)
        .bind(&u.endpoint)
        .bind(u.status as i64)
        .bind(u.error_code as i64)
        .bind(&u.finish)
        .bind(u.input_tokens)
        .bind(u.output_tokens)
        .bind(u.cached_tokens)
        .bind(u.cached_host_tokens)
        .bind(u.cached_disk_tokens)
        .bind(u.ttft_us)
        .bind(u.duration_us)
        .bind(u.created_ms)
        .execute(&self.pool)
        .await?;
        Ok(r.rows_affected() == 1)
    }

    /// Ledger rows, optionally of one tenant, oldest first.
    pub async fn usage_rows(
        &self,
        tenant_id: Option<&str>,
    ) -> Result<Vec<UsageRecord>, StoreError> {
        let base = "SELECT request_id, tenant_id, key_id, model, endpoint, status, error_code, \
                    finish, input_tokens, output_tokens, cached_tokens, cached_host_tokens, \
                    cached_disk_tokens, ttft_us, duration_us, created_ms FROM usage_ledger";
        let rows = self
            .select_for_tenant(base, "ORDER BY created_ms, request_id", tenant_id)
            .await?;
        rows.iter().map(usage_from_row).collect()
    }

    /// One ledger row by request id.
    pub async fn usage_row(&self, request_id: &str) -> Result<Option<UsageRecord>, StoreError> {
        let row = sqlx::query(
            "SELECT request_id, tenant_id, key_id, model, endpoint, status, error_code, finish, \
             input_tokens, output_tokens, cached_tokens, cached_host_tokens, cached_disk_tokens, \
             ttft_us, duration_us, created_ms FROM usage_ledger WHERE request_id = $1",
        )
        .bind(request_id)
        .fetch_optional(&self.pool)
        .await?;
        row.as_ref().map(usage_from_row).transpose()
    }

    /// Deletes ledger rows created before `before_ms` (the retention prune);
    /// returns how many.
    pub async fn prune_usage(&self, before_ms: i64) -> Result<u64, StoreError> {
        let r = sqlx::query("DELETE FROM usage_ledger WHERE created_ms < $1")
            .bind(before_ms)
            .execute(&self.pool)
            .await?;
        Ok(r.rows_affected())
    }

    /// Input + output tokens of `tenant_id` since `since_ms`.
    pub async fn tokens_since(&self, tenant_id: &str, since_ms: i64) -> Result<i64, StoreError> {
        let row = sqlx::query(
            "SELECT CAST(COALESCE(SUM(input_tokens + output_tokens), 0) AS BIGINT) AS n \
             FROM usage_ledger WHERE tenant_id = $1 AND created_ms >= $2",
        )
        .bind(tenant_id)
        .bind(since_ms)
        .fetch_one(&self.pool)
        .await?;
        get_i64(&row, "n")
    }

    /// A tenant's usage in `[since_ms, until_ms)`, grouped. Only `tenant_id`'s rows
    /// are ever read.
    pub async fn usage_summary(
        &self,
        tenant_id: &str,
        since_ms: i64,
        until_ms: i64,
        group_by: GroupBy,
    ) -> Result<Vec<UsageGroup>, StoreError> {
        let expr = match group_by {
            GroupBy::Model => "model",
            GroupBy::Key => "key_id",
            GroupBy::Hour => "(created_ms / 3600000) * 3600000",
            GroupBy::Day => "(created_ms / 86400000) * 86400000",
        };
        let q = format!(
            "SELECT {expr} AS k, COUNT(*) AS requests, \
             CAST(COALESCE(SUM(input_tokens), 0) AS BIGINT) AS input_tokens, \
             CAST(COALESCE(SUM(output_tokens), 0) AS BIGINT) AS output_tokens, \
             CAST(COALESCE(SUM(cached_tokens), 0) AS BIGINT) AS cached_tokens, \
             CAST(COALESCE(SUM(cached_host_tokens), 0) AS BIGINT) AS cached_host_tokens, \
             CAST(COALESCE(SUM(cached_disk_tokens), 0) AS BIGINT) AS cached_disk_tokens, \
             CAST(COALESCE(SUM(CASE WHEN status >= 400 THEN 1 ELSE 0 END), 0) AS BIGINT) AS errors \
             FROM usage_ledger WHERE tenant_id = $1 AND created_ms >= $2 AND created_ms < $3 \
             GROUP BY {expr} ORDER BY 1"
        );
        let rows = sqlx::query(&q)
            .bind(tenant_id)
            .bind(since_ms)
            .bind(until_ms)
            .fetch_all(&self.pool)
            .await?;
        rows.iter()
            .map(|r| {
                let key = match group_by {
                    GroupBy::Model | GroupBy::Key => get_str(r, "k")?,
                    GroupBy::Hour | GroupBy::Day => rfc3339(get_i64(r, "k")?),
                };
                Ok(UsageGroup {
                    key,
                    requests: get_i64(r, "requests")?,
                    input_tokens: get_i64(r, "input_tokens")?,
                    output_tokens: get_i64(r, "output_tokens")?,
                    cached_tokens: get_i64(r, "cached_tokens")?,
                    cached_host_tokens: get_i64(r, "cached_host_tokens")?,
                    cached_disk_tokens: get_i64(r, "cached_disk_tokens")?,
                    errors: get_i64(r, "errors")?,
                })
            })
            .collect()
    }
}
