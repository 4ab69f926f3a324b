//! The browser dashboard (`/dash/`, `/dash/admin/`) in headless Chromium against
//! the live server (issue 40, item 4): `scripts/dash_browser.py` signs in through
//! the forms, checks every number on the pages against the usage APIs for the
//! page's own range (hour, day, month), takes screenshots at desktop and phone
//! widths into `target/dash-screenshots/` (kept as CI artifacts), and tries the
//! attacks: another tenant's key and account by URL, a session cookie replayed
//! after its key was revoked, forged and token-less form posts from another
//! origin, HTML in tenant and key names (escaped).
//!
//! The store is seeded so the windows differ: real generations a moment ago (two
//! keys of tenant A, one of tenant B) and older ledger rows of A spread over the
//! last 30 days (another model, an error, cached tokens). After the script, the
//! store is read here too, so a pass does not rest on the script's word alone.
//!
//! Needs `/usr/bin/chromium` and `/usr/bin/chromedriver` (Debian `chromium`,
//! `chromium-driver`: `scripts/test` installs them) and Selenium in the test
//! Python (`scripts/python-env`); without them the test fails and says so.

mod common;

use common::*;
use serde_json::json;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tessera_tenancy::{Limits, NewKey, Scopes};

const CHROMIUM: &str = "/usr/bin/chromium";
const CHROMEDRIVER: &str = "/usr/bin/chromedriver";
/// Tenant A's name: markup the pages must show as text.
const TENANT_A: &str = "Acme <b>&amp;</b> \"Co\"";
const TENANT_B: &str = "Beta <i>b</i> & co";
/// A's main key's name: a script element if the keys table failed to escape it
/// (the script counts `<script>` elements on every page).
const MAIN_KEY: &str = "main <script>alert(1)</script> & 'k'";
/// The name the script types into the create-key form (scripts/dash_browser.py).
const FORM_KEY: &str = "<img src=x onerror=alert(1)><b>k</b>";
/// A second model id in A's older rows, so the by-model table has two rows.
const OLD_MODEL: &str = "@cf/tessera/older-model";
/// The screenshots the script takes (a missing one means a step did not run).
const SCREENSHOTS: [&str; 6] = [
    "login-desktop.png",
    "login-phone.png",
    "tenant-desktop.png",
    "tenant-phone.png",
    "operator-desktop.png",
    "operator-phone.png",
];

/// Fails (never skips) when the browser is missing.
fn require_browser() {
    let missing: Vec<&str> = [CHROMIUM, CHROMEDRIVER]
        .into_iter()
        .filter(|p| !Path::new(p).exists())
        .collect();
    assert!(
        missing.is_empty(),
        "missing {missing:?}: the dashboard's browser test needs Chromium and chromedriver; \
         run scripts/test (it installs the Debian packages chromium and chromium-driver), \
         or apt-get install chromium chromium-driver"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dashboard_in_headless_chromium() {
    // Before the server starts: these block, and fail fast.
    require_browser();
    let python = test_python();

    let s = start().await;
    let store = s.store();
    // A: new-tenant limits with one left unlimited (the page shows `unlimited`).
    let limits = Limits {
        max_concurrent: 0,
        ..Limits::NEW_TENANT
    };
    let a = store.create_tenant(TENANT_A, limits).await.unwrap();
    let (main, key_a) = store
        .create_key_with(
            &a.id,
            &NewKey {
                scopes: Scopes::ALL,
                ..NewKey::named(MAIN_KEY)
            },
        )
        .await
        .unwrap();
    let (readonly, key_ro) = store
        .create_key_with(
            &a.id,
            &NewKey {
                name: "readonly <i>r</i>".into(),
                scopes: Scopes::from_names(["inference"]).unwrap(),
                expires_ms: None,
            },
        )
        .await
        .unwrap();
    let (b, key_b) = s.tenant_with_key(TENANT_B, Limits::NEW_TENANT).await;

    // Real generations: two with A's main key, one with its read-only key (the
    // by-key table gets two rows), one of B's.
    let runs = [
        (&a.id, &key_a, "Name a colour."),
        (&a.id, &key_a, "Name a fruit."),
        (&a.id, &key_ro, "Name a tree."),
        (&b.id, &key_b, "Name a river."),
    ];
    for (account, key, prompt) in runs {
        let (st, _, v) = s
            .post(
                &s.run_url(account),
                Some(key.as_str()),
                &json!({"prompt": prompt, "max_tokens": 6}),
            )
            .await;
        assert_eq!(st, 200, "{v}");
    }
    // Older rows of A, so the day and month windows differ from the hour: within
    // the day (another model's error among them), then over 30 days.
    const HOUR: i64 = 3_600_000;
    const DAY: i64 = 24 * HOUR;
    let older = [
        (MODEL, 3 * HOUR, 200, (120, 40, 32)),
        (OLD_MODEL, 5 * HOUR, 503, (0, 0, 0)),
        (MODEL, 2 * DAY, 200, (300, 60, 16)),
        (OLD_MODEL, 9 * DAY, 200, (410, 70, 0)),
        (MODEL, 20 * DAY, 200, (520, 80, 48)),
        (OLD_MODEL, 27 * DAY, 200, (630, 90, 0)),
    ];
    // Older ledger rows, as the server would have written them (not through it).
    let b_row = (
        &b.id,
        key_id_of(&key_b),
        MODEL,
        2 * HOUR,
        200,
        (9_000, 900, 0),
    );
    let rows = older
        .into_iter()
        .map(|(model, age, status, tokens)| {
            (&a.id, main.key_id.clone(), model, age, status, tokens)
        })
        // B's own older row: big numbers that would show if any page mixed tenants.
        .chain([b_row]);
    for (tenant, key_id, model, age, status, tokens) in rows {
        let r = past_usage(tenant, &key_id, model, age, status, tokens);
        assert!(s.store().record_usage(&r).await.unwrap());
    }
    s.settle().await;

    let shots = PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../target/dash-screenshots"
    ));
    std::fs::create_dir_all(&shots).unwrap();
    for name in SCREENSHOTS {
        let _ = std::fs::remove_file(shots.join(name));
    }
    let admin_base = s.admin_base.clone().unwrap_or_else(|| s.base.clone());
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/dash_browser.py");
    // tokio's process: the server keeps serving on this runtime meanwhile.
    let mut cmd = tokio::process::Command::new(&python);
    cmd.arg(script);
    for (flag, value) in [
        ("--base", s.base.as_str()),
        ("--admin-base", admin_base.as_str()),
        ("--key", key_a.as_str()),
        ("--account", a.id.as_str()),
        ("--other-key", key_b.as_str()),
        ("--other-account", b.id.as_str()),
        ("--readonly-key", key_ro.as_str()),
        ("--admin-token", ADMIN),
    ] {
        cmd.arg(flag).arg(value);
    }
    cmd.arg("--out")
        .arg(&shots)
        .env("SE_OFFLINE", "true")
        .kill_on_drop(true);
    let out = tokio::time::timeout(Duration::from_secs(600), cmd.output())
        .await
        .expect("scripts/dash_browser.py ran past 10 minutes")
        .expect("run scripts/dash_browser.py");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("{stdout}");
    if !stderr.trim().is_empty() {
        eprintln!("{stderr}");
    }
    assert!(
        out.status.success(),
        "scripts/dash_browser.py failed ({}); its FAIL lines:\n{}\n--- stderr:\n{stderr}",
        out.status,
        stdout
            .lines()
            .filter(|l| l.starts_with("FAIL"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    assert!(!stdout.contains("FAIL:"), "{stdout}");

    // What the script did, read back from the store.
    let keys = store.list_keys(Some(&a.id)).await.unwrap();
    let forged: Vec<_> = keys
        .iter()
        .filter(|k| k.name.starts_with("forged"))
        .collect();
    assert!(forged.is_empty(), "forged posts made keys: {forged:?}");
    let made = keys
        .iter()
        .find(|k| k.name == FORM_KEY)
        .unwrap_or_else(|| panic!("no key named {FORM_KEY:?} from the create-key form: {keys:?}"));
    assert_eq!(made.scopes, Scopes::DEFAULT, "{made:?}");
    assert!(made.expires_ms.is_some(), "{made:?}");
    assert!(
        made.revoked_ms.is_some(),
        "the replay check revokes it: {made:?}"
    );
    let state = |id: &str| keys.iter().find(|k| k.key_id == id).unwrap().revoked_ms;
    assert!(
        state(&main.key_id).is_none(),
        "A's main key must stay active"
    );
    assert!(
        state(&readonly.key_id).is_some(),
        "revoked through its form"
    );
    let b_keys = store.list_keys(Some(&b.id)).await.unwrap();
    assert!(
        b_keys.iter().all(|k| k.revoked_ms.is_none()),
        "A's session revoked a key of B: {b_keys:?}"
    );
    for name in SCREENSHOTS {
        let len = std::fs::metadata(shots.join(name)).map_or(0, |m| m.len());
        assert!(len > 0, "no screenshot {}", shots.join(name).display());
    }
}
