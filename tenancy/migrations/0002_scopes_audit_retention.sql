-- Tessera tenancy schema, version 2: key scopes and expiry, the admin audit log,
-- and an index for the ledger's retention prune. Same SQL on SQLite and PostgreSQL.

-- Space-separated scopes (`inference`, `usage:read`); existing keys keep both.
ALTER TABLE api_keys ADD COLUMN scopes TEXT NOT NULL DEFAULT 'inference usage:read';
-- Unix ms after which the key is refused; NULL: never expires.
ALTER TABLE api_keys ADD COLUMN expires_ms BIGINT;

-- One row per successful admin action (admin API or CLI), written in the same
-- transaction as the action. `id` sorts in time order (hex microseconds + random).
CREATE TABLE admin_audit (
    id          TEXT PRIMARY KEY,
    at_ms       BIGINT NOT NULL,
    action      TEXT NOT NULL,             -- tenant.create | tenant.suspend | ... | key.revoke
    target      TEXT NOT NULL,             -- tenant id or key id
    request_id  TEXT NOT NULL,             -- the admin request's x-request-id (random per CLI run)
    source      TEXT NOT NULL,             -- peer address of the admin request, or `cli:<user>`
    detail      TEXT NOT NULL              -- JSON: what was set (never a key secret)
);
CREATE INDEX admin_audit_time ON admin_audit (at_ms);

-- The retention prune deletes by time across tenants.
CREATE INDEX usage_ledger_time ON usage_ledger (created_ms);
