-- Tessera tenancy schema, version 8: tenants' LoRA fine-tunes. Same SQL on SQLite
-- and PostgreSQL.

-- One LoRA adapter of one tenant, checked against its base model at upload. The
-- name is unique per tenant; the id is random (nothing about a tenant or another
-- fine-tune can be read from it). visibility: 'private' (its tenant only) or
-- 'public' (every tenant may run it; set by an operator).
CREATE TABLE finetunes (
    id           TEXT PRIMARY KEY,
    tenant_id    TEXT NOT NULL,
    name         TEXT NOT NULL,
    base_model   TEXT NOT NULL,
    description  TEXT NOT NULL,
    visibility   TEXT NOT NULL,
    sha256       TEXT NOT NULL,      -- of the adapter file, lowercase hex
    size_bytes   BIGINT NOT NULL,
    lora_rank    BIGINT NOT NULL,
    alpha        DOUBLE PRECISION NOT NULL,
    targets      BIGINT NOT NULL,    -- adapted base weights
    created_ms   BIGINT NOT NULL,
    UNIQUE (tenant_id, name)
);
CREATE INDEX finetunes_visibility ON finetunes (visibility);

-- The adapter files, one per fine-tune (never shared between fine-tunes, so equal
-- files of two tenants stay two rows), deleted with it.
CREATE TABLE finetune_blobs (
    finetune_id  TEXT PRIMARY KEY,
    data         BYTEA NOT NULL
);
