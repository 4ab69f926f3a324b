-- Tessera tenancy schema, version 3: fair scheduling and the prefix cache. Same SQL
-- on SQLite and PostgreSQL.

-- Fair-share weight (>= 1): the engine's virtual token counter of the tenant
-- advances by cost / weight, so weight 2 gets twice the service of weight 1.
ALTER TABLE tenants ADD COLUMN weight BIGINT NOT NULL DEFAULT 1;
-- Highest priority class the tenant's requests may run in: 'interactive' | 'batch'.
ALTER TABLE tenants ADD COLUMN max_priority TEXT NOT NULL DEFAULT 'interactive';
-- Salt of the tenant's prefix-cache namespace (hex; '' for tenants created before
-- this migration, which still get a namespace of their own from the account id).
-- Rotating it makes every page the tenant has cached unreachable.
ALTER TABLE tenants ADD COLUMN cache_salt TEXT NOT NULL DEFAULT '';
