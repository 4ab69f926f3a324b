//! Resolving the fine-tune a request names (`lora`) for its tenant and loading its
//! adapter ([`resolve`]), and the fine-tune errors the API shares.

use crate::cpu::Lane;
use crate::error::{ApiError, ErrorKind};
use crate::state::{AppState, ServedModel};
use std::sync::Arc;
use tessera_model::lora::LoraWeights;
use tessera_serving::{AdapterFile, LoraRef};
use tessera_tenancy::StoreError;

/// The fine-tune `name` (id or name) of tenant `tenant_id` for a request to
/// `served`, loaded: its own, or a public one by id.
///
/// Errors: 404 naming `lora` for one the tenant cannot reach (another tenant's is
/// unknown to it); 400 when it was made for another base model; 503 when the store
/// cannot be read; 500 when its file does not load.
pub(crate) async fn resolve(
    state: &AppState,
    tenant_id: &str,
    served: &ServedModel,
    name: &str,
) -> Result<LoraRef, ApiError> {
    let unknown = || {
        let mut e = not_found(name);
        e.param = Some("lora".into());
        e
    };
    let ft = state
        .store
        .finetune_for(tenant_id, name)
        .await
        .map_err(store_error)?
        .ok_or_else(unknown)?;
    if ft.base_model != served.entry.id {
        return Err(bad(
            "lora",
            format!(
                "the fine-tune {name:?} is for model {}, not {}",
                ft.base_model, served.entry.id
            ),
        ));
    }
    let loaded = || {
        state
            .loras
            .get(&ft.id, &ft.sha256)
            .map(|(w, file)| LoraRef {
                id: ft.id.clone(),
                weights: Some(w),
                file: Some(file),
            })
    };
    if let Some(l) = loaded() {
        return Ok(l);
    }
    // One load per fine-tune at a time; who waited finds it loaded.
    let gate = state.loras.load_gate(&ft.id);
    let _loading = gate.lock().await;
    if let Some(l) = loaded() {
        return Ok(l);
    }
    let data = state
        .store
        .finetune_data(&ft.id)
        .await
        .map_err(store_error)?
        .ok_or_else(unknown)?;
    let (base, layers, id) = (
        served.model.lora_base.clone(),
        served.model.config().layers,
        ft.id.clone(),
    );
    let loaded = state
        .cpu
        .run(Lane::Request, tenant_id, move || {
            LoraWeights::load(&data, &base, &id, layers).map(|w| (w, data))
        })
        .await
        .map_err(|e| {
            state.metrics.lora_load("failed");
            tracing::error!(id = %ft.id, error = %e, "a stored fine-tune does not load");
            ApiError::new(ErrorKind::Internal, "the fine-tune could not be loaded")
        })?;
    state.metrics.lora_load("loaded");
    let (w, bytes) = loaded;
    let (w, file) = (
        Arc::new(w),
        Arc::new(AdapterFile {
            sha256: ft.sha256.clone(),
            bytes,
        }),
    );
    let (loaded, bytes, evicted) = state.loras.put(&ft.id, w.clone(), file.clone());
    state.metrics.lora_cache(loaded, bytes, evicted);
    Ok(LoraRef {
        id: ft.id,
        weights: Some(w),
        file: Some(file),
    })
}

/// The API's error for a store failure.
pub(crate) fn store_error(e: StoreError) -> ApiError {
    match e {
        StoreError::Invalid(m) => ApiError::new(ErrorKind::BadRequest, m),
        StoreError::Conflict(m) => ApiError::new(ErrorKind::Conflict, m),
        e => {
            tracing::error!(error = %e, "fine-tune store unavailable");
            ApiError::new(ErrorKind::Unavailable, "the fine-tune store is unavailable")
        }
    }
}

/// The 404 of a fine-tune the caller cannot reach (unknown, or another's).
pub(crate) fn not_found(id: &str) -> ApiError {
    let shown: String = id.chars().take(80).collect();
    ApiError::new(ErrorKind::NotFound, format!("no fine-tune {shown:?}"))
}

/// A 400 naming `param`.
pub(crate) fn bad(param: &str, message: String) -> ApiError {
    let mut e = ApiError::new(ErrorKind::BadRequest, message);
    e.param = Some(param.into());
    e
}
