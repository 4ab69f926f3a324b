-- Tessera tenancy schema, version 7: the browser dashboard. Same SQL on SQLite and
-- PostgreSQL.

-- The usage ledger summed per tenant, UTC hour, model and key, kept in step with
-- the ledger by Store::record_usage (one transaction) so a month of usage is read
-- from ~720 rows per model and key instead of every request's row.
CREATE TABLE usage_hourly (
    tenant_id           TEXT NOT NULL,
    hour_ms             BIGINT NOT NULL,       -- bucket start, Unix ms, a whole UTC hour
    model               TEXT NOT NULL,
    key_id              TEXT NOT NULL,
    requests            BIGINT NOT NULL,
    errors              BIGINT NOT NULL,       -- rows with status >= 400
    input_tokens        BIGINT NOT NULL,
    output_tokens       BIGINT NOT NULL,
    cached_tokens       BIGINT NOT NULL,
    cached_host_tokens  BIGINT NOT NULL,
    cached_disk_tokens  BIGINT NOT NULL,
    PRIMARY KEY (tenant_id, hour_ms, model, key_id)
);
-- Every tenant's hours (the operator view) and the retention prune.
CREATE INDEX usage_hourly_time ON usage_hourly (hour_ms);
INSERT INTO usage_hourly (tenant_id, hour_ms, model, key_id, requests, errors,
    input_tokens, output_tokens, cached_tokens, cached_host_tokens, cached_disk_tokens)
SELECT tenant_id, (created_ms / 3600000) * 3600000, model, key_id, COUNT(*),
    SUM(CASE WHEN status >= 400 THEN 1 ELSE 0 END), SUM(input_tokens), SUM(output_tokens),
    SUM(cached_tokens), SUM(cached_host_tokens), SUM(cached_disk_tokens)
FROM usage_ledger GROUP BY tenant_id, (created_ms / 3600000) * 3600000, model, key_id;

-- Dashboard sign-ins: a session cookie's SHA-256 (never the cookie), whose key (a
-- tenant session) or admin token (tenant_id '', key_id 'admin:' and a digest of the
-- token, so a rotated token ends its sessions) it stands for,
-- its form token, and when it ends. A tenant session is checked against its key on
-- every page, so revoking the key ends it.
CREATE TABLE dash_sessions (
    id_sha256   TEXT PRIMARY KEY,
    tenant_id   TEXT NOT NULL,
    key_id      TEXT NOT NULL,
    csrf        TEXT NOT NULL,
    created_ms  BIGINT NOT NULL,
    expires_ms  BIGINT NOT NULL
);
CREATE INDEX dash_sessions_expiry ON dash_sessions (expires_ms);
