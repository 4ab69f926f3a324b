-- Tessera tenancy schema, version 4: per-tenant model access. Same SQL on SQLite
-- and PostgreSQL.

-- A model's visibility, by catalog id: 'public' (every tenant may use it) or
-- 'private' (only the tenants in model_grants). A model without a row is public.
CREATE TABLE model_access (
    model TEXT PRIMARY KEY,
    visibility TEXT NOT NULL,
    updated_ms BIGINT NOT NULL
);

-- The tenants a private model admits. Setting a model's access replaces its
-- list; a public model has none.
CREATE TABLE model_grants (
    model TEXT NOT NULL,
    tenant_id TEXT NOT NULL,
    PRIMARY KEY (model, tenant_id)
);
CREATE INDEX model_grants_tenant ON model_grants (tenant_id);
