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
    /// Writes a usage row and adds it to its hour in `usage_hourly` (one
    /// transaction). Returns false (and changes nothing) when a row with the same
    /// request id exists: a request is recorded exactly once.
    pub async fn record_usage(&self, u: &UsageRecord) -> Result<bool, StoreError> {
        let mut tx = self.write_tx().await?;
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
        .execute(&mut *tx)
        .await?;
        if r.rows_affected() != 1 {
            return Ok(false);
        }
        sqlx::query(
            "INSERT INTO usage_hourly (tenant_id, hour_ms, model, key_id, requests, errors, \
             input_tokens, output_tokens, cached_tokens, cached_host_tokens, cached_disk_tokens) \
             VALUES ($1, $2, $3, $4, 1, $5, $6, $7, $8, $9, $10) \
             ON CONFLICT (tenant_id, hour_ms, model, key_id) DO UPDATE SET \
             requests = usage_hourly.requests + 1, \
             errors = usage_hourly.errors + excluded.errors, \
             input_tokens = usage_hourly.input_tokens + excluded.input_tokens, \
             output_tokens = usage_hourly.output_tokens + excluded.output_tokens, \
             cached_tokens = usage_hourly.cached_tokens + excluded.cached_tokens, \
             cached_host_tokens = usage_hourly.cached_host_tokens + excluded.cached_host_tokens, \
             cached_disk_tokens = usage_hourly.cached_disk_tokens + excluded.cached_disk_tokens",
        )
        .bind(&u.tenant_id)
        .bind(hour_floor(u.created_ms))
        .bind(&u.model)
        .bind(&u.key_id)
        .bind(i64::from(u.status >= 400))
        .bind(u.input_tokens)
        .bind(u.output_tokens)
        .bind(u.cached_tokens)
        .bind(u.cached_host_tokens)
        .bind(u.cached_disk_tokens)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(true)
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
        // The hours wholly before the cut go with it, and the hour it falls in is
        // summed again from the ledger rows it keeps, in the same transaction, so a
        // range that reaches back past the cut never counts a pruned row.
        let cut_hour = hour_floor(before_ms);
        let mut tx = self.write_tx().await?;
        sqlx::query("DELETE FROM usage_hourly WHERE hour_ms <= $1")
            .bind(cut_hour)
            .execute(&mut *tx)
            .await?;
        let r = sqlx::query("DELETE FROM usage_ledger WHERE created_ms < $1")
            .bind(before_ms)
            .execute(&mut *tx)
            .await?;
        sqlx::query(
            "INSERT INTO usage_hourly (tenant_id, hour_ms, model, key_id, requests, errors, \
             input_tokens, output_tokens, cached_tokens, cached_host_tokens, cached_disk_tokens) \
             SELECT tenant_id, $1, model, key_id, COUNT(*), \
             SUM(CASE WHEN status >= 400 THEN 1 ELSE 0 END), SUM(input_tokens), \
             SUM(output_tokens), SUM(cached_tokens), SUM(cached_host_tokens), \
             SUM(cached_disk_tokens) FROM usage_ledger \
             WHERE created_ms >= $1 AND created_ms < $2 GROUP BY tenant_id, model, key_id",
        )
        .bind(cut_hour)
        .bind(cut_hour.saturating_add(HOUR_MS))
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
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

    /// A tenant's usage in `[since_ms, until_ms)`, grouped; groups in key order.
    /// Only `tenant_id`'s rows are ever read.
    ///
    /// Whole UTC hours inside the range are read from `usage_hourly` (a month is
    /// ~720 rows per model and key, not one row per request), the partial hours at
    /// either end from the ledger itself, so the sums are exactly the ledger's.
    pub async fn usage_summary(
        &self,
        tenant_id: &str,
        since_ms: i64,
        until_ms: i64,
        group_by: GroupBy,
    ) -> Result<Vec<UsageGroup>, StoreError> {
        self.summary(Some(tenant_id), since_ms, until_ms, Grouping::By(group_by))
            .await
    }

    /// Every tenant's usage in `[since_ms, until_ms)`, one group per tenant id (the
    /// operator's view), read as [`Store::usage_summary`] reads one tenant's.
    pub async fn usage_by_tenant(
        &self,
        since_ms: i64,
        until_ms: i64,
    ) -> Result<Vec<UsageGroup>, StoreError> {
        self.summary(None, since_ms, until_ms, Grouping::Tenant)
            .await
    }

    async fn summary(
        &self,
        tenant_id: Option<&str>,
        since_ms: i64,
        until_ms: i64,
        group_by: Grouping,
    ) -> Result<Vec<UsageGroup>, StoreError> {
        let (first_hour, end_hour) = (hour_ceil(since_ms), hour_floor(until_ms));
        let mut parts = Vec::new();
        if first_hour >= end_hour {
            parts.push(
                self.grouped(
                    "usage_ledger",
                    "created_ms",
                    tenant_id,
                    since_ms,
                    until_ms,
                    group_by,
                )
                .await?,
            );
        } else {
            for (table, col, from, to) in [
                ("usage_ledger", "created_ms", since_ms, first_hour),
                ("usage_hourly", "hour_ms", first_hour, end_hour),
                ("usage_ledger", "created_ms", end_hour, until_ms),
            ] {
                if from < to {
                    parts.push(
                        self.grouped(table, col, tenant_id, from, to, group_by)
                            .await?,
                    );
                }
            }
        }
        Ok(merge_groups(parts))
    }

    /// Sums of `table` (the ledger, or `usage_hourly`, whose rows are sums) over
    /// `time_col` in `[from, to)`, grouped.
    async fn grouped(
        &self,
        table: &str,
        time_col: &str,
        tenant_id: Option<&str>,
        from: i64,
        to: i64,
        group_by: Grouping,
    ) -> Result<Vec<UsageGroup>, StoreError> {
        let rolled = table == "usage_hourly";
        let expr = match group_by {
            Grouping::By(GroupBy::Model) => "model".to_string(),
            Grouping::By(GroupBy::Key) => "key_id".to_string(),
            Grouping::By(GroupBy::Hour) => format!("({time_col} / 3600000) * 3600000"),
            Grouping::By(GroupBy::Day) => format!("({time_col} / 86400000) * 86400000"),
            Grouping::Tenant => "tenant_id".to_string(),
        };
        // Unauthenticated requests' rows (tenant '') belong to no tenant.
        let tenant_filter = if tenant_id.is_some() {
            "tenant_id = $3"
        } else {
            "tenant_id <> ''"
        };
        let (requests, errors) = if rolled {
            ("SUM(requests)", "SUM(errors)")
        } else {
            ("COUNT(*)", "SUM(CASE WHEN status >= 400 THEN 1 ELSE 0 END)")
        };
        let q = format!(
            "SELECT {expr} AS k, CAST({requests} AS BIGINT) AS requests, \
             CAST(COALESCE(SUM(input_tokens), 0) AS BIGINT) AS input_tokens, \
             CAST(COALESCE(SUM(output_tokens), 0) AS BIGINT) AS output_tokens, \
             CAST(COALESCE(SUM(cached_tokens), 0) AS BIGINT) AS cached_tokens, \
             CAST(COALESCE(SUM(cached_host_tokens), 0) AS BIGINT) AS cached_host_tokens, \
             CAST(COALESCE(SUM(cached_disk_tokens), 0) AS BIGINT) AS cached_disk_tokens, \
             CAST(COALESCE({errors}, 0) AS BIGINT) AS errors \
             FROM {table} WHERE {time_col} >= $1 AND {time_col} < $2 AND {tenant_filter} \
             GROUP BY {expr} ORDER BY 1"
        );
        let mut query = sqlx::query(&q).bind(from).bind(to);
        if let Some(t) = tenant_id {
            query = query.bind(t);
        }
        let rows = query.fetch_all(&self.pool).await?;
        rows.iter()
            .map(|r| {
                let key = match group_by {
                    Grouping::By(GroupBy::Hour | GroupBy::Day) => rfc3339(get_i64(r, "k")?),
                    _ => get_str(r, "k")?,
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

/// What a summary's groups are.
#[derive(Clone, Copy)]
enum Grouping {
    By(GroupBy),
    Tenant,
}

const HOUR_MS: i64 = 3_600_000;

/// The start of the UTC hour holding `ms` (saturating at the ends of `i64`: a
/// query may name any time).
fn hour_floor(ms: i64) -> i64 {
    ms.div_euclid(HOUR_MS).saturating_mul(HOUR_MS)
}

/// The first whole-hour boundary at or after `ms`.
fn hour_ceil(ms: i64) -> i64 {
    hour_floor(ms.saturating_add(HOUR_MS - 1))
}

/// Adds up groups of the same key across `parts`; the result in key order (bucket
/// keys are RFC 3339 UTC times of one width, so text order is time order).
fn merge_groups(parts: Vec<Vec<UsageGroup>>) -> Vec<UsageGroup> {
    let mut by_key: std::collections::BTreeMap<String, UsageGroup> = Default::default();
    for g in parts.into_iter().flatten() {
        match by_key.get_mut(&g.key) {
            None => {
                by_key.insert(g.key.clone(), g);
            }
            Some(t) => t.add(&g),
        }
    }
    by_key.into_values().collect()
}
