-- Tessera tenancy schema, version 1. The same SQL runs on SQLite and PostgreSQL:
-- BIGINT and TEXT only, times as Unix milliseconds, no driver-specific types.

CREATE TABLE tenants (
    id          TEXT PRIMARY KEY,          -- account id: 32 lowercase hex chars
    name        TEXT NOT NULL,
    status      TEXT NOT NULL,             -- 'active' | 'suspended'
    created_ms  BIGINT NOT NULL
);

-- Per-tenant limits; 0 means unlimited.
CREATE TABLE tenant_limits (
    tenant_id                 TEXT PRIMARY KEY REFERENCES tenants(id),
    requests_per_minute       BIGINT NOT NULL,
    input_tokens_per_minute   BIGINT NOT NULL,
    output_tokens_per_minute  BIGINT NOT NULL,
    max_concurrent            BIGINT NOT NULL,
    daily_tokens              BIGINT NOT NULL
);

-- API keys `tsk_<key_id>_<secret>`: only the SHA-256 of the secret is stored.
CREATE TABLE api_keys (
    key_id         TEXT PRIMARY KEY,
    tenant_id      TEXT NOT NULL REFERENCES tenants(id),
    name           TEXT NOT NULL,
    secret_sha256  TEXT NOT NULL,
    created_ms     BIGINT NOT NULL,
    revoked_ms     BIGINT                  -- NULL while the key is active
);
CREATE INDEX api_keys_tenant ON api_keys (tenant_id);

-- One row per request id, written exactly once (also for errors and aborts).
-- tenant_id and key_id are '' when the caller could not be authenticated.
CREATE TABLE usage_ledger (
    request_id     TEXT PRIMARY KEY,
    tenant_id      TEXT NOT NULL,
    key_id         TEXT NOT NULL,
    model          TEXT NOT NULL,
    endpoint       TEXT NOT NULL,
    status         BIGINT NOT NULL,        -- HTTP status sent (200 for streams that began)
    error_code     BIGINT NOT NULL,        -- Workers AI error code, 0 when none
    finish         TEXT NOT NULL,          -- stop | length | error | aborted
    input_tokens   BIGINT NOT NULL,
    output_tokens  BIGINT NOT NULL,
    cached_tokens  BIGINT NOT NULL,
    ttft_us        BIGINT NOT NULL,
    duration_us    BIGINT NOT NULL,
    created_ms     BIGINT NOT NULL
);
CREATE INDEX usage_ledger_tenant_time ON usage_ledger (tenant_id, created_ms);
