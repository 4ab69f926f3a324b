-- Tessera tenancy schema, version 5: a tenant's own bounds on its cached KV. Same SQL
-- on SQLite and PostgreSQL.

-- Most prompt tokens (whole pages) each engine keeps cached for the tenant; 0: no
-- bound of its own (the engine's share of its pool still applies).
ALTER TABLE tenants ADD COLUMN cache_max_tokens BIGINT NOT NULL DEFAULT 0;
-- Seconds a cached page of the tenant may go unused before engines drop it; 0: none.
ALTER TABLE tenants ADD COLUMN cache_idle_ttl_secs BIGINT NOT NULL DEFAULT 0;
-- When they were last set (Unix ms): engines keep the latest limits they have seen.
ALTER TABLE tenants ADD COLUMN cache_limits_ms BIGINT NOT NULL DEFAULT 0;
