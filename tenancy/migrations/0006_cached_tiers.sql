-- Tessera tenancy schema, version 6: cached prompt tokens per tier in the usage
-- ledger. Same SQL on SQLite and PostgreSQL.

-- Of cached_tokens, those restored from an engine's host-memory tier, and those
-- restored from its sealed disk tier (the rest were hits in the engine's pool).
ALTER TABLE usage_ledger ADD COLUMN cached_host_tokens BIGINT NOT NULL DEFAULT 0;
ALTER TABLE usage_ledger ADD COLUMN cached_disk_tokens BIGINT NOT NULL DEFAULT 0;
