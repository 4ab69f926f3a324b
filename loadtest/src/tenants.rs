//! The tenants a run uses: created through a Tessera gateway's admin API, read
//! from a keys file, or virtual (one shared key or none: canaries still tell the
//! tenants' requests apart, but the server cannot).

use crate::args::LoadtestArgs;
use crate::error::{InputFile, LoadtestError};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

/// One tenant as the harness sees it.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Tenant {
    /// Name in reports (`t0`, `t1`, ... or the name given at creation).
    #[serde(default)]
    pub label: String,
    /// Account id (the `{account_id}` of `/client/v4/accounts/...`); `None` for
    /// virtual tenants.
    #[serde(default)]
    pub account_id: Option<String>,
    /// Bearer key; `None`: no `Authorization` header.
    #[serde(default)]
    pub key: Option<String>,
}

impl Tenant {
    /// Whether the server knows this tenant (it has its own account and key), so
    /// that its usage can be read back.
    pub fn is_real(&self) -> bool {
        self.account_id.is_some() && self.key.is_some()
    }
}

/// `n` virtual tenants sharing `key`.
pub fn virtual_tenants(n: usize, key: Option<&str>) -> Vec<Tenant> {
    (0..n)
        .map(|i| Tenant {
            label: format!("t{i}"),
            account_id: None,
            key: key.map(str::to_string),
        })
        .collect()
}

/// Reads a keys file: a JSON array of `{"account_id", "key"}` objects, or one such
/// object per line.
///
/// # Errors
/// An unreadable file, malformed JSON, or an entry without a key.
pub fn read_keys_file(path: &std::path::Path) -> Result<Vec<Tenant>, LoadtestError> {
    let text = std::fs::read_to_string(path).map_err(|source| LoadtestError::ReadInput {
        file: InputFile::Keys,
        path: path.into(),
        source,
    })?;
    let bad = |line, source| LoadtestError::BadKeysFile {
        path: path.into(),
        line,
        source,
    };
    let mut tenants: Vec<Tenant> = if text.trim_start().starts_with('[') {
        serde_json::from_str(&text).map_err(|e| bad(None, e))?
    } else {
        text.lines()
            .filter(|l| !l.trim().is_empty())
            .enumerate()
            .map(|(i, l)| serde_json::from_str(l).map_err(|e| bad(Some(i + 1), e)))
            .collect::<Result<_, _>>()?
    };
    if tenants.is_empty() {
        return Err(LoadtestError::NoTenants { path: path.into() });
    }
    for (i, t) in tenants.iter_mut().enumerate() {
        if t.key.is_none() {
            return Err(LoadtestError::KeylessTenant {
                path: path.into(),
                entry: i,
            });
        }
        if t.label.is_empty() {
            t.label = format!("t{i}");
        }
    }
    Ok(tenants)
}

/// Creates `n` tenants with one key each through the admin API
/// (`POST /admin/v1/tenants {"name", "create_key": true}`), named
/// `loadtest-<run>-<i>` with default (unlimited) limits.
///
/// # Errors
/// Any non-2xx answer (a wrong admin token gives 401) or an unexpected body.
pub async fn create_tenants(
    http: &reqwest::Client,
    base: &str,
    admin_token: &str,
    n: usize,
    run: &str,
) -> Result<Vec<Tenant>, LoadtestError> {
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let name = format!("loadtest-{run}-{i}");
        let url = format!("{base}/admin/v1/tenants");
        let resp = http
            .post(&url)
            .bearer_auth(admin_token)
            .json(&json!({"name": name, "create_key": true}))
            .send()
            .await
            .map_err(|source| LoadtestError::Request {
                method: "POST",
                url,
                source,
            })?;
        let status = resp.status();
        let body: Value = resp.json().await.unwrap_or(Value::Null);
        if !status.is_success() {
            return Err(LoadtestError::TenantRefused { name, status, body });
        }
        let account_id = body["result"]["tenant"]["id"].as_str();
        let key = body["result"]["key"]["secret"].as_str();
        match (account_id, key) {
            (Some(a), Some(k)) => out.push(Tenant {
                label: format!("t{i}"),
                account_id: Some(a.to_string()),
                key: Some(k.to_string()),
            }),
            _ => return Err(LoadtestError::TenantAnswer { name, body }),
        }
    }
    Ok(out)
}

/// The tenants for the main target, as the arguments ask.
///
/// # Errors
/// See [`create_tenants`] and [`read_keys_file`].
pub async fn resolve(
    http: &reqwest::Client,
    args: &LoadtestArgs,
    run: &str,
) -> Result<Vec<Tenant>, LoadtestError> {
    if let Some(path) = &args.keys_file {
        return read_keys_file(path);
    }
    if let Some(tok) = &args.admin_token {
        return create_tenants(http, &args.primary_url(), tok, args.tenants, run).await;
    }
    Ok(virtual_tenants(args.tenants, args.api_key.as_deref()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_file_as_array_or_lines() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("k.json");
        std::fs::write(
            &p,
            r#"[{"account_id":"a1","key":"tsk_1"},{"account_id":"a2","key":"tsk_2","label":"acme"}]"#,
        )
        .unwrap();
        let t = read_keys_file(&p).unwrap();
        assert_eq!(t.len(), 2);
        assert_eq!(t[0].label, "t0");
        assert_eq!(t[1].label, "acme");
        assert!(t[1].is_real());
        std::fs::write(
            &p,
            "{\"account_id\":\"a1\",\"key\":\"k\"}\n\n{\"key\":\"k2\"}\n",
        )
        .unwrap();
        let t = read_keys_file(&p).unwrap();
        assert_eq!(t.len(), 2);
        assert!(!t[1].is_real());
        std::fs::write(&p, "{\"account_id\":\"a1\"}\n").unwrap();
        assert!(read_keys_file(&p)
            .unwrap_err()
            .to_string()
            .contains("no `key`"));
    }
}
