//! The store contract both backends must meet (same SQL for SQLite and PostgreSQL).

use tessera_tenancy::store::rfc3339;
use tessera_tenancy::{
    AuditCtx, AuthError, GroupBy, Limits, NewKey, Scope, Scopes, Store, TenantStatus, UsageRecord,
};

#[allow(clippy::too_many_arguments)] // a table row, one argument per column
fn row(
    id: &str,
    tenant: &str,
    key: &str,
    model: &str,
    status: u16,
    i: i64,
    o: i64,
    at: i64,
) -> UsageRecord {
    UsageRecord {
        request_id: id.into(),
        tenant_id: tenant.into(),
        key_id: key.into(),
        model: model.into(),
        endpoint: "test".into(),
        status,
        error_code: if status >= 400 { 3003 } else { 0 },
        finish: if status >= 400 {
            "error".into()
        } else {
            "stop".into()
        },
        input_tokens: i,
        output_tokens: o,
        cached_tokens: 0,
        cached_host_tokens: 0,
        cached_disk_tokens: 0,
        ttft_us: 10,
        duration_us: 20,
        created_ms: at,
    }
}

/// Tenants, keys, auth, revocation, suspension, limits, ledger idempotency and
/// usage grouping with tenant isolation.
pub(crate) async fn store_contract(store: &Store) {
    let lim = Limits {
        requests_per_minute: 5,
        ..Limits::default()
    };
    let a = store.create_tenant("alpha", lim).await.unwrap();
    let b = store
        .create_tenant("beta", Limits::default())
        .await
        .unwrap();
    assert_eq!(a.id.len(), 32);
    assert_ne!(a.id, b.id);
    let listed = store.list_tenants().await.unwrap();
    assert!(listed.iter().any(|t| t == &a));
    assert_eq!(store.tenant(&a.id).await.unwrap().unwrap().limits, lim);

    let (ka, secret_a) = store.create_key(&a.id, "k1").await.unwrap();
    let (kb, secret_b) = store.create_key(&b.id, "k2").await.unwrap();
    assert!(secret_a.starts_with(&format!("tsk_{}_", ka.key_id)));
    let p = store.authenticate(&secret_a).await.unwrap().unwrap();
    assert_eq!(
        (p.tenant.id.as_str(), p.key_id.as_str()),
        (a.id.as_str(), ka.key_id.as_str())
    );
    assert_eq!(
        store
            .authenticate(&secret_b)
            .await
            .unwrap()
            .unwrap()
            .tenant
            .id,
        b.id
    );
    // Wrong secret for a real key id, unknown id, malformed.
    let wrong = format!("tsk_{}_{}", ka.key_id, "0".repeat(64));
    assert_eq!(
        store.authenticate(&wrong).await.unwrap(),
        Err(AuthError::Invalid)
    );
    let unknown = format!("tsk_{}_{}", "f".repeat(16), "0".repeat(64));
    assert_eq!(
        store.authenticate(&unknown).await.unwrap(),
        Err(AuthError::Invalid)
    );
    assert_eq!(
        store.authenticate("sk-123").await.unwrap(),
        Err(AuthError::Malformed)
    );
    // Secrets are not stored.
    assert!(store.list_keys(None).await.unwrap().len() >= 2);
    // Revocation: effective immediately; a second revoke is a no-op.
    let (kr, secret_r) = store.create_key(&a.id, "short-lived").await.unwrap();
    assert!(store.revoke_key(&kr.key_id).await.unwrap());
    assert!(!store.revoke_key(&kr.key_id).await.unwrap());
    assert_eq!(
        store.authenticate(&secret_r).await.unwrap(),
        Err(AuthError::Revoked)
    );
    let keys_a = store.list_keys(Some(&a.id)).await.unwrap();
    assert_eq!(keys_a.len(), 2);
    assert!(keys_a
        .iter()
        .any(|k| k.key_id == kr.key_id && k.revoked_ms.is_some()));
    // Suspension.
    store
        .set_status(&b.id, TenantStatus::Suspended)
        .await
        .unwrap();
    assert_eq!(
        store.authenticate(&secret_b).await.unwrap(),
        Err(AuthError::Suspended(b.id.clone()))
    );
    store.set_status(&b.id, TenantStatus::Active).await.unwrap();
    assert!(store.authenticate(&secret_b).await.unwrap().is_ok());
    assert!(store
        .set_status("nope", TenantStatus::Active)
        .await
        .is_err());
    // Limits.
    let new = Limits {
        max_concurrent: 3,
        daily_tokens: 1_000_000,
        ..lim
    };
    store.set_limits(&a.id, new).await.unwrap();
    assert_eq!(store.tenant(&a.id).await.unwrap().unwrap().limits, new);

    // Ledger: exactly once per request id.
    let h = 3_600_000;
    let t0 = 1_767_225_600_000; // 2026-01-01T00:00:00Z
    assert!(store
        .record_usage(&row(
            &format!("{}-r1", a.id),
            &a.id,
            &ka.key_id,
            "m1",
            200,
            10,
            5,
            t0
        ))
        .await
        .unwrap());
    assert!(!store
        .record_usage(&row(
            &format!("{}-r1", a.id),
            &a.id,
            &ka.key_id,
            "m1",
            200,
            99,
            99,
            t0
        ))
        .await
        .unwrap());
    assert_eq!(
        store
            .usage_row(&format!("{}-r1", a.id))
            .await
            .unwrap()
            .unwrap()
            .input_tokens,
        10
    );
    store
        .record_usage(&row(
            &format!("{}-r2", a.id),
            &a.id,
            &ka.key_id,
            "m2",
            200,
            7,
            3,
            t0 + h + 5,
        ))
        .await
        .unwrap();
    store
        .record_usage(&row(
            &format!("{}-r3", a.id),
            &a.id,
            &kr.key_id,
            "m1",
            400,
            0,
            0,
            t0 + 25 * h,
        ))
        .await
        .unwrap();
    store
        .record_usage(&row(
            &format!("{}-r4", a.id),
            &b.id,
            &kb.key_id,
            "m1",
            200,
            1000,
            1000,
            t0,
        ))
        .await
        .unwrap();
    assert_eq!(store.usage_rows(Some(&a.id)).await.unwrap().len(), 3);

    let all = t0..t0 + 48 * h;
    let by_model = store
        .usage_summary(&a.id, all.start, all.end, GroupBy::Model)
        .await
        .unwrap();
    assert_eq!(by_model.len(), 2);
    assert_eq!(
        (
            by_model[0].key.as_str(),
            by_model[0].requests,
            by_model[0].input_tokens,
            by_model[0].output_tokens,
            by_model[0].errors
        ),
        ("m1", 2, 10, 5, 1)
    );
    assert_eq!(
        (by_model[1].key.as_str(), by_model[1].input_tokens),
        ("m2", 7)
    );
    let by_key = store
        .usage_summary(&a.id, all.start, all.end, GroupBy::Key)
        .await
        .unwrap();
    assert_eq!(by_key.len(), 2);
    let by_hour = store
        .usage_summary(&a.id, all.start, all.end, GroupBy::Hour)
        .await
        .unwrap();
    let hours: Vec<_> = by_hour.iter().map(|g| g.key.clone()).collect();
    assert_eq!(
        hours,
        vec![rfc3339(t0), rfc3339(t0 + h), rfc3339(t0 + 25 * h)]
    );
    assert_eq!(hours[0], "2026-01-01T00:00:00Z");
    let by_day = store
        .usage_summary(&a.id, all.start, all.end, GroupBy::Day)
        .await
        .unwrap();
    assert_eq!(by_day.len(), 2);
    assert_eq!(
        (
            by_day[0].key.as_str(),
            by_day[0].requests,
            by_day[0].input_tokens
        ),
        ("2026-01-01T00:00:00Z", 2, 17)
    );
    // Range is half-open and tenant-scoped.
    let first_hour = store
        .usage_summary(&a.id, t0, t0 + h, GroupBy::Model)
        .await
        .unwrap();
    assert_eq!(first_hour.len(), 1);
    assert_eq!(first_hour[0].input_tokens, 10);
    let b_sum = store
        .usage_summary(&b.id, all.start, all.end, GroupBy::Model)
        .await
        .unwrap();
    assert_eq!(b_sum.len(), 1);
    assert_eq!(b_sum[0].input_tokens, 1000);
    assert_eq!(store.tokens_since(&a.id, t0).await.unwrap(), 25);
    assert!(store.ping().await);
}

/// Key scopes and expiry, the audit log (one row per successful audited action,
/// none for unaudited calls or failed actions), the revocation check used for
/// requests in flight, and the retention prune.
pub(crate) async fn store_admin_contract(store: &Store) {
    let by = AuditCtx {
        request_id: tessera_tenancy::random_hex(16),
        source: "127.0.0.1:4242".into(),
    };
    let start = tessera_tenancy::now_ms();
    let admin = store.audited(&by);
    let t = admin
        .create_tenant("audited", Limits::NEW_TENANT)
        .await
        .unwrap();
    assert_eq!(t.limits, Limits::NEW_TENANT);
    // Scopes and expiry round-trip; existing-style keys get both scopes.
    let read_only = NewKey {
        name: "reader".into(),
        scopes: Scopes::parse("usage:read").unwrap(),
        expires_ms: None,
    };
    let (ki, kr) = admin.create_key(&t.id, &read_only).await.unwrap();
    assert_eq!(ki.scopes, read_only.scopes);
    let p = store.authenticate(&kr).await.unwrap().unwrap();
    assert!(p.scopes.contains(Scope::UsageRead) && !p.scopes.contains(Scope::Inference));
    let (_, full) = store.create_key(&t.id, "full").await.unwrap();
    assert_eq!(
        store.authenticate(&full).await.unwrap().unwrap().scopes,
        Scopes::DEFAULT
    );
    let expired = NewKey {
        name: "old".into(),
        scopes: Scopes::DEFAULT,
        expires_ms: Some(tessera_tenancy::now_ms() - 1),
    };
    let (ke, secret_e) = store.create_key_with(&t.id, &expired).await.unwrap();
    assert_eq!(
        store.authenticate(&secret_e).await.unwrap(),
        Err(AuthError::Expired)
    );
    let listed = store.list_keys(Some(&t.id)).await.unwrap();
    let le = listed.iter().find(|k| k.key_id == ke.key_id).unwrap();
    assert_eq!(le.expires_ms, expired.expires_ms);
    // The revocation check for requests in flight.
    let full_id = full[4..20].to_string();
    let ids = vec![
        ki.key_id.clone(),
        full_id.clone(),
        ke.key_id.clone(),
        "f".repeat(16),
    ];
    let mut bad = store.invalid_keys(&ids).await.unwrap();
    bad.sort_by(|a, b| a.0.cmp(&b.0));
    let mut want = vec![
        (ke.key_id.clone(), AuthError::Expired),
        ("f".repeat(16), AuthError::Invalid),
    ];
    want.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(bad, want);
    assert!(admin.revoke_key(&ki.key_id).await.unwrap());
    assert!(
        !admin.revoke_key(&ki.key_id).await.unwrap(),
        "already revoked"
    );
    admin
        .set_status(&t.id, TenantStatus::Suspended)
        .await
        .unwrap();
    let bad = store
        .invalid_keys(std::slice::from_ref(&full_id))
        .await
        .unwrap();
    assert_eq!(bad, vec![(full_id, AuthError::Suspended(t.id.clone()))]);
    admin.set_status(&t.id, TenantStatus::Active).await.unwrap();
    let new = Limits {
        daily_tokens: 5,
        ..Limits::NEW_TENANT
    };
    admin.set_limits(&t.id, new).await.unwrap();
    // Failed actions write nothing.
    assert!(admin
        .set_status("nope", TenantStatus::Active)
        .await
        .is_err());
    assert!(admin.create_key("nope", &NewKey::named("x")).await.is_err());
    // Audit: exactly the successful audited actions, in order, with who and what.
    let rows: Vec<_> = store
        .audit_rows(start, tessera_tenancy::now_ms() + 1, 1000)
        .await
        .unwrap()
        .into_iter()
        .filter(|r| r.request_id == by.request_id)
        .collect();
    let actions: Vec<_> = rows
        .iter()
        .map(|r| (r.action.as_str(), r.target.as_str()))
        .collect();
    assert_eq!(
        actions,
        vec![
            ("tenant.create", t.id.as_str()),
            ("key.create", ki.key_id.as_str()),
            ("key.revoke", ki.key_id.as_str()),
            ("tenant.suspend", t.id.as_str()),
            ("tenant.activate", t.id.as_str()),
            ("tenant.limits", t.id.as_str()),
        ]
    );
    assert!(rows
        .iter()
        .all(|r| r.source == "127.0.0.1:4242" && r.at_ms >= start));
    assert_eq!(rows[1].detail["scopes"], serde_json::json!(["usage:read"]));
    assert_eq!(rows[5].detail["limits"]["daily_tokens"], 5);
    assert!(
        !rows[1].detail.to_string().contains(&kr[21..]),
        "no secret in the audit log"
    );
    assert_eq!(
        store
            .audit_rows(start, tessera_tenancy::now_ms() + 1, 2)
            .await
            .unwrap()
            .len(),
        2
    );
    // Retention: rows before the cut go, later ones stay.
    let old = row(&format!("{}-old", t.id), &t.id, "k", "m", 200, 1, 1, 1_000);
    let recent = row(&format!("{}-new", t.id), &t.id, "k", "m", 200, 1, 1, start);
    store.record_usage(&old).await.unwrap();
    store.record_usage(&recent).await.unwrap();
    assert!(store.prune_usage(946_684_800_000).await.unwrap() >= 1); // 2000-01-01
    let left: Vec<_> = store
        .usage_rows(Some(&t.id))
        .await
        .unwrap()
        .into_iter()
        .map(|r| r.request_id)
        .collect();
    assert_eq!(left, vec![recent.request_id]);
}

/// Scheduling settings and the prefix-cache salt (migration 0003): defaults for a new
/// tenant, validated updates, audited changes, and a namespace that is the tenant's
/// own and changes when the salt rotates.
pub(crate) async fn store_scheduling_contract(store: &Store) {
    use tessera_tenancy::{PriorityCeiling, Scheduling, StoreError};
    let a = store
        .create_tenant("sched-a", Limits::default())
        .await
        .unwrap();
    let b = store
        .create_tenant("sched-b", Limits::default())
        .await
        .unwrap();
    assert_eq!(a.scheduling, Scheduling::default());
    assert_eq!(
        (a.scheduling.weight, a.scheduling.max_priority),
        (1, PriorityCeiling::Interactive)
    );
    assert_ne!(
        a.cache_namespace(),
        b.cache_namespace(),
        "namespaces are per tenant"
    );
    let by = AuditCtx {
        request_id: "req-sched".into(),
        source: "test".into(),
    };
    let admin = store.audited(&by);
    let s = Scheduling {
        weight: 3,
        max_priority: PriorityCeiling::Batch,
    };
    admin.set_scheduling(&a.id, s).await.unwrap();
    let got = store.tenant(&a.id).await.unwrap().unwrap();
    assert_eq!(got.scheduling, s);
    assert_eq!(
        got.cache_namespace(),
        a.cache_namespace(),
        "scheduling leaves the salt alone"
    );
    for w in [0, Scheduling::MAX_WEIGHT + 1] {
        let e = admin
            .set_scheduling(&a.id, Scheduling { weight: w, ..s })
            .await
            .unwrap_err();
        assert!(
            matches!(&e, StoreError::Invalid(m) if m.contains("weight")),
            "{e:?}"
        );
    }
    assert!(matches!(
        admin.set_scheduling("nope", s).await,
        Err(StoreError::NoTenant(_))
    ));
    admin.rotate_cache_salt(&a.id).await.unwrap();
    let rotated = store.tenant(&a.id).await.unwrap().unwrap();
    assert_ne!(rotated.cache_namespace(), a.cache_namespace());
    assert_eq!(rotated.scheduling, s);
    let same_b = store.tenant(&b.id).await.unwrap().unwrap();
    assert_eq!(
        same_b.cache_namespace(),
        b.cache_namespace(),
        "only a's salt moved"
    );
    assert!(matches!(
        admin.rotate_cache_salt("nope").await,
        Err(StoreError::NoTenant(_))
    ));
    // The key path sees the same record (what the gateway derives from).
    let (_, key) = store.create_key(&a.id, "k").await.unwrap();
    let p = store.authenticate(&key).await.unwrap().unwrap();
    assert_eq!(
        (p.tenant.scheduling, p.tenant.cache_namespace()),
        (s, rotated.cache_namespace())
    );
    let audit = store.audit_rows(0, i64::MAX, 10_000).await.unwrap();
    let mine: Vec<&str> = audit
        .iter()
        .filter(|r| r.target == a.id && r.request_id == "req-sched")
        .map(|r| r.action.as_str())
        .collect();
    assert_eq!(mine, ["tenant.scheduling", "tenant.rotate_cache_salt"]);
    assert!(
        audit
            .iter()
            .all(|r| !r.detail.to_string().contains(&rotated.cache_salt)),
        "the salt is never logged"
    );
}

/// Per-tenant model access: a model without a row is public; private to a list of
/// tenants, replaced as a whole, audited (`model.access`) only when it succeeds;
/// unknown tenants and tenants on a public model are refused without a change.
pub(crate) async fn store_model_access_contract(store: &Store) {
    let by = AuditCtx {
        request_id: tessera_tenancy::random_hex(16),
        source: "127.0.0.1:4242".into(),
    };
    let start = tessera_tenancy::now_ms();
    let a = store.create_tenant("a", Limits::default()).await.unwrap();
    let b = store.create_tenant("b", Limits::default()).await.unwrap();
    // A fresh id per run: a shared PostgreSQL server keeps earlier runs' rows.
    let model = format!("@cf/test/model-{}", tessera_tenancy::random_hex(4));
    let open = store.model_access(&model).await.unwrap();
    assert_eq!(open, tessera_tenancy::ModelAccess::public(&model));
    assert!(open.allows(&a.id) && open.allows(&b.id));

    let admin = store.audited(&by);
    let set = admin
        .set_model_access(&model, true, &[b.id.clone(), a.id.clone(), a.id.clone()])
        .await
        .unwrap();
    let mut both = vec![a.id.clone(), b.id.clone()];
    both.sort();
    assert_eq!(
        (set.private, &set.tenants),
        (true, &both),
        "sorted, once each"
    );
    let set = admin
        .set_model_access(&model, true, std::slice::from_ref(&a.id))
        .await
        .unwrap();
    let read = store.model_access(&model).await.unwrap();
    assert_eq!(read, set);
    assert!(read.allows(&a.id) && !read.allows(&b.id));
    assert!(store
        .list_model_access()
        .await
        .unwrap()
        .iter()
        .any(|m| m == &read));
    // Refused, nothing changes, nothing audited.
    let e = admin
        .set_model_access(&model, true, &["no-such-tenant".to_string()])
        .await
        .unwrap_err();
    assert!(e.to_string().contains("no-such-tenant"), "{e}");
    let e = admin
        .set_model_access(&model, false, std::slice::from_ref(&b.id))
        .await
        .unwrap_err();
    assert!(e.to_string().contains("public model"), "{e}");
    assert_eq!(store.model_access(&model).await.unwrap(), read);
    // Public again: everyone, no list; unaudited calls write no row.
    store.set_model_access(&model, false, &[]).await.unwrap();
    let open = store.model_access(&model).await.unwrap();
    assert!(!open.private && open.tenants.is_empty() && open.allows(&b.id));
    let rows: Vec<_> = store
        .audit_rows(start, tessera_tenancy::now_ms() + 1, 1000)
        .await
        .unwrap()
        .into_iter()
        .filter(|r| r.action == "model.access" && r.target == model)
        .collect();
    assert_eq!(rows.len(), 2, "{rows:?}");
    assert_eq!(rows[1].request_id, by.request_id);
    assert_eq!(
        rows[1].detail,
        serde_json::json!({"private": true, "tenants": [a.id]})
    );
}

/// The dashboard's reads: usage sums from the hourly rollup plus the ledger's partial
/// hours equal the ledger's own sums for any range (aligned or not, grouped every
/// way, per tenant and across tenants), a duplicate row counts once, a prune keeps
/// every later range exact; and dashboard sessions (only a digest stored, expiry,
/// ended one by one or by key).
pub(crate) async fn store_dashboard_contract(store: &Store) {
    let a = store
        .create_tenant("dash-a", Limits::UNLIMITED)
        .await
        .unwrap();
    let b = store
        .create_tenant("dash-b", Limits::UNLIMITED)
        .await
        .unwrap();
    let (ka, _) = store.create_key(&a.id, "a1").await.unwrap();
    let (ka2, _) = store.create_key(&a.id, "a2").await.unwrap();
    let (kb, _) = store.create_key(&b.id, "b1").await.unwrap();
    let h = 3_600_000i64;
    let t0 = 1_767_225_600_000i64; // 2026-01-01T00:00:00Z
                                   // A deterministic scatter of rows over 74 hours (an LCG: no rand dependency).
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let mut next = move |m: u64| {
        x = x
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (x >> 33) % m
    };
    let mut rows = Vec::new();
    for i in 0..400 {
        let (t, k) = match next(3) {
            0 => (&a.id, &ka.key_id),
            1 => (&a.id, &ka2.key_id),
            _ => (&b.id, &kb.key_id),
        };
        let model = ["m1", "m2", "m3"][next(3) as usize];
        let status = if next(10) == 0 { 500 } else { 200 };
        let mut r = row(
            &format!("{}-d{i}", a.id),
            t,
            k,
            model,
            status,
            next(900) as i64 + 1,
            next(300) as i64,
            t0 + next(74 * h as u64) as i64,
        );
        r.cached_tokens = next(50) as i64;
        r.cached_host_tokens = r.cached_tokens / 2;
        assert!(store.record_usage(&r).await.unwrap());
        rows.push(r);
    }
    // A duplicate request id is not recorded, nor summed, again.
    assert!(!store.record_usage(&rows[7]).await.unwrap());

    let naive = |tenant: Option<&str>,
                 since: i64,
                 until: i64,
                 by: Option<GroupBy>,
                 rows: &[UsageRecord]| {
        let mut m: std::collections::BTreeMap<String, [i64; 7]> = Default::default();
        for r in rows.iter().filter(|r| {
            r.created_ms >= since
                && r.created_ms < until
                && tenant.is_none_or(|t| r.tenant_id == t)
                && (tenant.is_some() || r.tenant_id == a.id || r.tenant_id == b.id)
        }) {
            let key = match by {
                None => r.tenant_id.clone(),
                Some(GroupBy::Model) => r.model.clone(),
                Some(GroupBy::Key) => r.key_id.clone(),
                Some(GroupBy::Hour) => rfc3339(r.created_ms / h * h),
                Some(GroupBy::Day) => rfc3339(r.created_ms / (24 * h) * (24 * h)),
            };
            let e = m.entry(key).or_default();
            let v = [
                1,
                i64::from(r.status >= 400),
                r.input_tokens,
                r.output_tokens,
                r.cached_tokens,
                r.cached_host_tokens,
                r.cached_disk_tokens,
            ];
            for (s, v) in e.iter_mut().zip(v) {
                *s += v;
            }
        }
        m.into_iter().collect::<Vec<_>>()
    };
    let flat = |gs: Vec<tessera_tenancy::UsageGroup>| {
        gs.into_iter()
            .map(|g| {
                (
                    g.key,
                    [
                        g.requests,
                        g.errors,
                        g.input_tokens,
                        g.output_tokens,
                        g.cached_tokens,
                        g.cached_host_tokens,
                        g.cached_disk_tokens,
                    ],
                )
            })
            .collect::<Vec<_>>()
    };
    let ranges = [
        (t0, t0 + 74 * h),
        (t0 + 3 * h, t0 + 27 * h),
        (t0 + 1_234, t0 + 50 * h + 77),
        (t0 + 5 * h + 10, t0 + 5 * h + 999_999),
        (t0 + 2 * h - 1, t0 + 3 * h + 1),
        (t0 + 70 * h + 5, t0 + 80 * h),
        (t0 - 5 * h, t0 + h),
    ];
    for (since, until) in ranges {
        for by in [GroupBy::Model, GroupBy::Key, GroupBy::Hour, GroupBy::Day] {
            let got = store.usage_summary(&a.id, since, until, by).await.unwrap();
            assert_eq!(
                flat(got),
                naive(Some(&a.id), since, until, Some(by), &rows),
                "{by:?} over {since}..{until}"
            );
        }
        let all: Vec<_> = flat(store.usage_by_tenant(since, until).await.unwrap())
            .into_iter()
            .filter(|(t, _)| *t == a.id || *t == b.id)
            .collect();
        assert_eq!(all, naive(None, since, until, None, &rows));
    }

    // A prune at an arbitrary time keeps every range exact (the ledger's rows that
    // remain), also one reaching back past the cut.
    let cut = t0 + 40 * h + 123_456;
    assert!(store.prune_usage(cut).await.unwrap() > 0);
    let kept: Vec<_> = rows
        .iter()
        .filter(|r| r.created_ms >= cut)
        .cloned()
        .collect();
    for (since, until) in [
        (cut, t0 + 74 * h),
        (cut + 2 * h, t0 + 70 * h + 1),
        (t0, t0 + 74 * h),
        (t0 + 40 * h, t0 + 41 * h),
    ] {
        let got = store
            .usage_summary(&a.id, since, until, GroupBy::Model)
            .await
            .unwrap();
        assert_eq!(
            flat(got),
            naive(Some(&a.id), since, until, Some(GroupBy::Model), &kept)
        );
    }
    // Any time a query names reads without overflow.
    for (since, until) in [
        (i64::MIN, i64::MAX),
        (i64::MIN, i64::MIN + 1),
        (i64::MAX - 1, i64::MAX),
    ] {
        for by in [GroupBy::Model, GroupBy::Hour] {
            store.usage_summary(&a.id, since, until, by).await.unwrap();
        }
    }
    assert!(store.audit_latest(3).await.unwrap().len() <= 3);

    // Sessions: the cookie opens its session; a wrong, malformed or ended one none.
    let (cookie, s) = store
        .create_dash_session(&a.id, &ka.key_id, 60_000)
        .await
        .unwrap();
    assert_eq!(cookie.len(), 64);
    assert_eq!(store.dash_session(&cookie).await.unwrap(), Some(s.clone()));
    assert!(!s.is_operator());
    assert_eq!(s.csrf.len(), 64);
    assert_ne!(s.csrf, cookie);
    let mut wrong = cookie.clone();
    wrong.replace_range(0..1, if wrong.starts_with('0') { "1" } else { "0" });
    assert_eq!(store.dash_session(&wrong).await.unwrap(), None);
    assert_eq!(store.dash_session("").await.unwrap(), None);
    assert_eq!(store.dash_session("' OR 1=1 --").await.unwrap(), None);
    let (expired, _) = store
        .create_dash_session(&a.id, &ka.key_id, -1)
        .await
        .unwrap();
    assert_eq!(store.dash_session(&expired).await.unwrap(), None);
    let op_id = tessera_tenancy::DashSession::operator_id("token-1");
    assert_ne!(op_id, tessera_tenancy::DashSession::operator_id("token-2"));
    assert!(!op_id.contains("token-1"));
    let (op, o) = store.create_dash_session("", &op_id, 60_000).await.unwrap();
    assert!(o.is_operator() && !s.is_operator());
    // Ending by key ends that key's sessions only (never an operator's).
    let (other, _) = store
        .create_dash_session(&a.id, &ka2.key_id, 60_000)
        .await
        .unwrap();
    assert_eq!(store.end_key_dash_sessions(&ka.key_id).await.unwrap(), 1);
    assert_eq!(store.dash_session(&cookie).await.unwrap(), None);
    assert!(store.dash_session(&other).await.unwrap().is_some());
    assert_eq!(store.end_key_dash_sessions(&op_id).await.unwrap(), 0);
    assert!(store.dash_session(&op).await.unwrap().is_some());
    assert!(store.end_dash_session(&other).await.unwrap());
    assert!(!store.end_dash_session(&other).await.unwrap());
}

/// Fine-tunes: stored with their file, reachable by their tenant alone (by id or
/// name) and by everyone once public (by id only), names unique per tenant, deletes
/// by the owner only, each change audited.
pub(crate) async fn store_finetunes_contract(store: &Store) {
    use tessera_tenancy::NewFinetune;
    let a = store
        .create_tenant("ft-a", Limits::NEW_TENANT)
        .await
        .unwrap();
    let b = store
        .create_tenant("ft-b", Limits::NEW_TENANT)
        .await
        .unwrap();
    let by = AuditCtx {
        request_id: "rid-ft".into(),
        source: "test".into(),
    };
    let file: Vec<u8> = (0..=255u8).cycle().take(70_000).collect();
    let new = |tenant: &'static str, name: &'static str| NewFinetune {
        tenant_id: tenant,
        name,
        base_model: "@cf/test/base",
        description: "d",
        rank: 8,
        alpha: 16.0,
        targets: 60,
        data: &[],
    };
    let a_id: &'static str = Box::leak(a.id.clone().into_boxed_str());
    let b_id: &'static str = Box::leak(b.id.clone().into_boxed_str());
    let ft = store
        .audited(&by)
        .create_finetune(&NewFinetune {
            data: &file,
            ..new(a_id, "mine")
        })
        .await
        .unwrap();
    assert_eq!(ft.size_bytes, 70_000);
    assert_eq!(ft.sha256.len(), 64);
    assert_eq!(
        (ft.rank, ft.alpha, ft.targets, ft.public),
        (8, 16.0, 60, false)
    );
    assert_eq!(store.finetune_data(&ft.id).await.unwrap().unwrap(), file);
    // The owner reaches it by id and by name; the other tenant by neither.
    for key in [&ft.id, "mine"] {
        assert_eq!(store.finetune_for(a_id, key).await.unwrap().unwrap(), ft);
        assert_eq!(store.finetune_for(b_id, key).await.unwrap(), None);
    }
    assert_eq!(store.finetunes_of(a_id).await.unwrap(), vec![ft.clone()]);
    assert!(store.finetunes_of(b_id).await.unwrap().is_empty());
    // Names are per tenant: B may use the same one; A may not twice.
    let bs = store.create_finetune(&new(b_id, "mine")).await.unwrap();
    assert_ne!(bs.id, ft.id);
    let dup = store.create_finetune(&new(a_id, "mine")).await.unwrap_err();
    assert!(
        matches!(dup, tessera_tenancy::StoreError::Conflict(_)),
        "{dup}"
    );
    for bad in ["", ".x", "a b", &"n".repeat(65)] {
        let name: &'static str = Box::leak(bad.to_string().into_boxed_str());
        assert!(matches!(
            store.create_finetune(&new(a_id, name)).await,
            Err(tessera_tenancy::StoreError::Invalid(_))
        ));
    }
    assert!(matches!(
        store.create_finetune(&new("no-such-tenant", "x")).await,
        Err(tessera_tenancy::StoreError::NoTenant(_))
    ));
    // Public: everyone by id, not by name; still only the owner deletes it.
    assert!(store
        .audited(&by)
        .set_finetune_public(&ft.id, true)
        .await
        .unwrap());
    let seen = store.finetune_for(b_id, &ft.id).await.unwrap().unwrap();
    assert!(seen.public && seen.tenant_id == a.id);
    // B's own "mine" wins over A's public one for B.
    assert_eq!(
        store.finetune_for(b_id, "mine").await.unwrap().unwrap().id,
        bs.id
    );
    assert!(store
        .public_finetunes()
        .await
        .unwrap()
        .iter()
        .any(|f| f.id == ft.id));
    assert_eq!(
        store
            .audited(&by)
            .delete_finetune(b_id, &ft.id)
            .await
            .unwrap(),
        None
    );
    let gone = store
        .audited(&by)
        .delete_finetune(a_id, "mine")
        .await
        .unwrap();
    assert_eq!(gone.unwrap().id, ft.id);
    assert_eq!(store.finetune_for(a_id, &ft.id).await.unwrap(), None);
    assert_eq!(store.finetune_data(&ft.id).await.unwrap(), None);
    assert!(!store.set_finetune_public(&ft.id, true).await.unwrap());
    // Audited: create, visibility, delete (B's refused delete wrote nothing).
    let actions: Vec<String> = store
        .audit_rows(0, i64::MAX, 10_000)
        .await
        .unwrap()
        .into_iter()
        .filter(|r| r.request_id == "rid-ft")
        .map(|r| r.action)
        .collect();
    let mine: Vec<&str> = actions.iter().map(String::as_str).rev().take(3).collect();
    assert_eq!(
        mine,
        ["finetune.delete", "finetune.visibility", "finetune.create"]
    );
}
