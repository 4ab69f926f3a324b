//! Tests of the deployment file: parsing, every violation, I2, context windows and
//! node-link checks.

use super::*;
use std::path::{Path, PathBuf};

const MODEL: &str = "@cf/huggingfacetb/smollm2-135m-instruct";

fn pool(name: &str, role: NodeRole, kv_pool_tokens: usize, node: &str) -> PoolConfig {
    PoolConfig {
        name: name.into(),
        role,
        page_size: 16,
        kv_pool_tokens,
        nodes: vec![node.into()],
        models: None,
    }
}

fn model(id: &str, context: Option<usize>) -> ModelEntry {
    ModelEntry {
        id: id.into(),
        path: PathBuf::from("/nonexistent/tessera-test/model.gguf"),
        context,
        ..ModelEntry::default()
    }
}

/// One prefill and one decode pool of 16384 tokens, one model with context 8192.
fn pd() -> DeploymentConfig {
    DeploymentConfig {
        gateway: GatewaySection {
            listen: "127.0.0.1:8787".parse().unwrap(),
        },
        models: vec![model(MODEL, Some(8192))],
        pools: vec![
            pool("prefill", NodeRole::Prefill, 16384, "127.0.0.1:9101"),
            pool("decode", NodeRole::Decode, 16384, "127.0.0.1:9201"),
        ],
        node_links: None,
    }
}

fn fixed(c: usize) -> impl FnMut(&ModelEntry) -> Result<usize, String> {
    move |_| Ok(c)
}

fn labels(v: &[Violation]) -> Vec<&'static str> {
    v.iter().map(Violation::label).collect()
}

#[test]
fn usable_tokens_is_whole_pages() {
    let mut p = pool("p", NodeRole::Decode, 16384, "h:1");
    assert_eq!(p.usable_tokens(), 16384);
    p.kv_pool_tokens = 16383;
    assert_eq!(p.usable_tokens(), 16368);
    p.kv_pool_tokens = 15;
    assert_eq!(p.usable_tokens(), 0);
    p.kv_pool_tokens = 100;
    p.page_size = 7;
    assert_eq!(p.usable_tokens(), 98);
    p.page_size = 0;
    assert_eq!(p.usable_tokens(), 0);
}

#[test]
fn role_parses_and_prints() {
    for r in NodeRole::ALL {
        assert_eq!(r.to_string().parse::<NodeRole>(), Ok(r));
    }
    assert_eq!(NodeRole::Prefill.to_string(), "prefill");
    assert_eq!(
        "Decode".parse::<NodeRole>(),
        Err(UnknownRole("Decode".into()))
    );
}

#[test]
fn i2_boundary_usable_equal_to_context_passes_one_page_less_fails() {
    assert_eq!(
        check_pool_fits(MODEL, 8192, NodeRole::Decode, "d", 8192),
        Ok(())
    );
    let err = check_pool_fits(MODEL, 8192, NodeRole::Decode, "decode-a", 8192 - 16).unwrap_err();
    assert_eq!(
        err,
        PoolTooSmall {
            model: MODEL.into(),
            context: 8192,
            role: NodeRole::Decode,
            pool: "decode-a".into(),
            usable_tokens: 8176,
        }
    );
    let msg = err.to_string();
    assert!(
        msg.starts_with(&format!(
            "decode pool \"decode-a\" holds 8176 usable KV tokens but model {MODEL} has a \
                 context window of 8192 tokens (I2"
        )),
        "{msg}"
    );
}

#[test]
fn i2_uses_whole_pages_of_the_pool() {
    // 8200 tokens configured, but only 512 whole pages (8192 tokens) are usable.
    let mut p = pool("prefill", NodeRole::Prefill, 8200, "h:1");
    assert_eq!(p.check_fits(MODEL, 8192), Ok(()));
    assert!(p.check_fits(MODEL, 8193).is_err());
    // A context that is not a page multiple needs the next whole page.
    p.kv_pool_tokens = 8191;
    assert_eq!(p.check_fits(MODEL, 8176), Ok(()));
    assert_eq!(p.check_fits(MODEL, 8177).unwrap_err().usable_tokens, 8176);
}

#[test]
fn good_pd_deployment_passes_with_one_line_per_pool() {
    let v = pd().check(fixed(8192));
    assert!(v.is_ok(), "{:?}", v.violations);
    assert_eq!(v.fits.len(), 2);
    assert!(v.fits.iter().all(PoolFit::fits));
    assert_eq!(v.models[0].context, Some(8192));
    assert!(v.into_result().is_ok());
}

#[test]
fn every_small_pool_is_reported_not_just_the_first() {
    let mut c = pd();
    c.pools[0].kv_pool_tokens = 4096;
    c.pools[1].kv_pool_tokens = 8191;
    let v = c.check(fixed(8192));
    assert_eq!(labels(&v.violations), ["pool_too_small", "pool_too_small"]);
    let Violation::PoolTooSmall(e) = &v.violations[1] else {
        unreachable!()
    };
    assert_eq!(
        (e.role, e.usable_tokens, e.context),
        (NodeRole::Decode, 8176, 8192)
    );
    let err = v.into_result().unwrap_err().to_string();
    assert!(
        err.starts_with("deployment configuration rejected (2 violations)"),
        "{err}"
    );
    assert!(err.contains("prefill pool \"prefill\" holds 4096"), "{err}");
}

#[test]
fn structural_violations_each_reported() {
    let mut c = pd();
    c.models.push(model(MODEL, None));
    c.pools
        .push(pool("decode", NodeRole::Decode, 16384, "127.0.0.1:9301"));
    c.pools[0].page_size = 0;
    c.pools[1].models = Some(vec!["@cf/nope".into()]);
    c.pools[2].nodes = vec![];
    let v = c.check(fixed(8192));
    assert_eq!(
        labels(&v.violations),
        [
            "duplicate_model",
            "zero_page_size",
            "unknown_model",
            "duplicate_pool",
            "no_nodes",
        ]
    );
    // Duplicate model ids are checked once; the zero-page pool gets no I2 line.
    assert_eq!(v.models.len(), 1);
    assert_eq!(v.fits.len(), 1);
    assert_eq!(v.fits[0].pool, "decode");
}

#[test]
fn no_models_and_empty_pool_model_list() {
    let mut c = pd();
    c.models.clear();
    c.pools[0].models = Some(vec![]);
    let v = c.check(fixed(8192));
    assert_eq!(labels(&v.violations), ["no_models", "no_pool_models"]);
    assert_eq!(
        v.violations[1].to_string(),
        "pool \"prefill\" serves no models (`models = []`); list models or omit `models`"
    );
}

#[test]
fn pd_needs_prefill_and_decode_unless_colocated() {
    let mut c = pd();
    c.pools.remove(1);
    let v = c.check(fixed(8192));
    assert_eq!(
        v.violations,
        [Violation::MissingRole {
            model: MODEL.into(),
            role: NodeRole::Decode
        }]
    );
    assert!(v.violations[0].to_string().contains("has no decode pool"));

    // A pool limited to another model does not cover this one.
    let mut c = pd();
    c.models.push(model("@cf/other", Some(4096)));
    c.pools[0].models = Some(vec!["@cf/other".into()]);
    c.pools[1].models = Some(vec![MODEL.into()]);
    let v = c.check(fixed(8192));
    assert_eq!(
        v.violations,
        [
            Violation::MissingRole {
                model: MODEL.into(),
                role: NodeRole::Prefill
            },
            Violation::MissingRole {
                model: "@cf/other".into(),
                role: NodeRole::Decode
            },
        ]
    );

    // One colocated pool serves everything alone.
    let mut c = pd();
    c.pools = vec![pool("all", NodeRole::Colocated, 8192, "127.0.0.1:9000")];
    assert!(c.check(fixed(8192)).is_ok());
}

#[test]
fn node_addresses_must_be_host_port_and_unique() {
    for good in [
        "127.0.0.1:9101",
        "[::1]:9101",
        "node-1.pd.svc.cluster.local:9101",
        "h:1",
    ] {
        assert_eq!(check_host_port(good), Ok(()), "{good}");
    }
    for bad in [
        "127.0.0.1",
        ":9101",
        "h:0",
        "h:65536",
        "h:port",
        "::1:9101",
        "bad_host:1",
        "-h:1",
        "a..b:1",
    ] {
        assert!(check_host_port(bad).is_err(), "{bad}");
    }
    let mut c = pd();
    c.pools[0].nodes = vec!["127.0.0.1".into(), "127.0.0.1:9201".into()];
    let v = c.check(fixed(8192));
    assert_eq!(
        labels(&v.violations),
        ["bad_node_address", "duplicate_node"]
    );
    assert_eq!(
        v.violations[0].to_string(),
        "pool \"prefill\": node address `127.0.0.1` is not host:port: missing `:port`"
    );
    assert_eq!(
        v.violations[1].to_string(),
        "node `127.0.0.1:9201` is listed more than once (pools \"prefill\" and \"decode\")"
    );
}

#[test]
fn context_that_disagrees_with_the_gguf_is_named_and_pools_are_still_checked() {
    let mut c = pd();
    c.models[0].path = gguf_path();
    c.models[0].context = Some(4096);
    for p in &mut c.pools {
        p.kv_pool_tokens = 4096;
    }
    let v = c.check_offline();
    let mut got = labels(&v.violations);
    got.sort_unstable();
    assert_eq!(
        got,
        ["context_mismatch", "pool_too_small", "pool_too_small"]
    );
    let msg = v
        .violations
        .iter()
        .find(|e| e.label() == "context_mismatch")
        .unwrap()
        .to_string();
    assert!(msg.contains("4096") && msg.contains("8192"), "{msg}");
}

#[test]
fn unknown_context_is_a_violation_naming_the_model() {
    let mut c = pd();
    c.models[0].context = None;
    let v = c.check_offline();
    assert_eq!(labels(&v.violations), ["context_unknown"]);
    let msg = v.violations[0].to_string();
    assert!(
            msg.starts_with(&format!("cannot determine the context window of model {MODEL}: model file /nonexistent/tessera-test/model.gguf not found")),
            "{msg}"
        );
    assert!(msg.contains("set `context = N`"), "{msg}");
    assert_eq!(v.models[0].context, None);
    assert!(v.fits.is_empty());
    // With `context` set and no file, the configured value is used.
    assert!(pd().check_offline().is_ok());
}

#[test]
fn dates_parse_to_unix_seconds_and_bad_ones_are_named() {
    assert_eq!(parse_date("1970-01-01"), Ok(0));
    assert_eq!(parse_date("2000-03-01"), Ok(951_868_800));
    assert_eq!(parse_date("2024-02-29"), Ok(1_709_164_800));
    for bad in [
        "2023-02-29",
        "2024-13-01",
        "2024-1-01",
        "24-01-01",
        "2024-01-00",
        "x",
    ] {
        let e = parse_date(bad).unwrap_err();
        assert!(e.contains(bad), "{e}");
    }
}

#[test]
fn catalog_fields_are_checked_and_aliases_name_one_model() {
    let mut cfg = pd();
    let other = "@cf/tessera/other";
    cfg.models.push(ModelEntry {
        aliases: vec!["short".into(), MODEL.to_uppercase()],
        deprecated: Some("2026-02-30".into()),
        ..model(other, Some(8192))
    });
    cfg.models[0].aliases = vec!["SHORT".into()];
    cfg.models[0].tags = vec![String::new()];
    cfg.models[0].deprecated = Some("2026-06-01".into());
    cfg.models[0].sunset = Some("2026-01-01".into());
    cfg.models[0].description = Some("x".repeat(1025));
    let v = cfg.structural_violations();
    let fields: Vec<(String, String)> = v
        .iter()
        .filter_map(|v| match v {
            Violation::BadModelField { model, field, .. } => Some((model.clone(), field.clone())),
            _ => None,
        })
        .collect();
    for f in ["tags", "sunset", "description"] {
        assert!(fields.contains(&(MODEL.into(), f.into())), "{f}: {v:?}");
    }
    assert!(
        fields.contains(&(other.into(), "deprecated".into())),
        "{v:?}"
    );
    let dups: Vec<String> = v
        .iter()
        .filter(|v| v.label() == "duplicate_alias")
        .map(|v| v.to_string())
        .collect();
    assert_eq!(
        dups,
        vec![
            format!("alias short of model {other} is already an alias of model {MODEL}"),
            format!(
                "alias {} of model {other} is already the id of model {MODEL}",
                MODEL.to_uppercase()
            ),
        ]
    );
    // Both models on the same prefill and decode pools: a node loads one model.
    let labels: Vec<&str> = v.iter().map(Violation::label).collect();
    assert_eq!(
        labels.iter().filter(|l| **l == "pool_models").count(),
        2,
        "{v:?}"
    );
    let e = DeploymentConfig::parse(
        "[gateway]\nlisten = \"127.0.0.1:1\"\n[[models]]\nid = \"a\"\npath = \"a\"\nsunset = 5\n",
        Path::new("t.toml"),
    )
    .unwrap_err();
    assert!(e.to_string().contains("sunset"), "{e}");
}

fn gguf_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf")
}

#[test]
fn context_window_from_the_real_gguf() {
    let path = gguf_path();
    assert_eq!(read_context_window(&path).unwrap(), 8192);
    let mut m = ModelEntry {
        id: MODEL.into(),
        path,
        context: None,
        ..ModelEntry::default()
    };
    assert_eq!(m.context_window().unwrap(), 8192);
    m.context = Some(8192);
    assert_eq!(m.context_window().unwrap(), 8192);
    m.context = Some(4096);
    let err = m.context_window().unwrap_err();
    assert!(
        matches!(
            err,
            ContextError::Mismatch {
                configured: 4096,
                gguf: 8192,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn a_file_that_is_not_gguf_is_an_error() {
    let dir = std::env::temp_dir().join(format!("tessera-config-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("not.gguf");
    std::fs::write(&path, b"definitely not gguf").unwrap();
    let err = read_context_window(&path).unwrap_err();
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(matches!(err, ContextError::Gguf { .. }), "{err}");
}

const EXAMPLE: &str = r#"
[gateway]
listen = "127.0.0.1:8787"

[[models]]
id = "@cf/huggingfacetb/smollm2-135m-instruct"
path = "models/SmolLM2-135M-Instruct.Q4_1.gguf"
context = 8192

[[pools]]
name = "prefill"
role = "prefill"
kv_pool_tokens = 16384
nodes = ["127.0.0.1:9101"]

[[pools]]
name = "decode"
role = "decode"
page_size = 32
kv_pool_tokens = 16384
nodes = ["127.0.0.1:9201"]
models = ["@cf/huggingfacetb/smollm2-135m-instruct"]
"#;

#[test]
fn parses_the_documented_schema() {
    let c = DeploymentConfig::parse(EXAMPLE, Path::new("t.toml")).unwrap();
    assert_eq!(c.gateway.listen, "127.0.0.1:8787".parse().unwrap());
    assert_eq!(c.models[0].context, Some(8192));
    assert_eq!(c.pools[0].page_size, DEFAULT_PAGE_SIZE);
    assert_eq!(c.pools[0].models, None);
    assert_eq!(c.pools[1].page_size, 32);
    assert_eq!(c.pools[1].role, NodeRole::Decode);
    assert_eq!(c.pools_with_role(NodeRole::Decode).count(), 1);
    assert_eq!(c.pool("decode").unwrap().nodes, ["127.0.0.1:9201"]);
    let served: Vec<_> = c.models_served_by(&c.pools[1]).map(|m| &m.id).collect();
    assert_eq!(served, [MODEL]);
}

#[test]
fn the_repository_example_parses_and_passes() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../ops/deploy/tessera.toml");
    let mut c = DeploymentConfig::load(&path).unwrap();
    // Its model path is relative to the repository root.
    for m in &mut c.models {
        m.path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../..")
            .join(&m.path);
    }
    // It names mutual TLS files that only `tessera ops certs issue` creates (the
    // ops tests issue them); everything else passes.
    assert!(c.links().tls_files().is_some());
    let v = c.check_offline();
    let other: Vec<&Violation> = v
        .violations
        .iter()
        .filter(|v| v.label() != "node_link_file")
        .collect();
    assert!(other.is_empty(), "{other:?}");
    assert_eq!(v.fits.len(), 2);
}

#[test]
fn unknown_fields_and_bad_values_are_parse_errors_with_location() {
    let bad = EXAMPLE.replace(
        "kv_pool_tokens = 16384\nnodes = [\"127.0.0.1:9101\"]",
        "kv_pool_tokens = 16384\nkv_pool_tokenz = 1\nnodes = [\"127.0.0.1:9101\"]",
    );
    let err = DeploymentConfig::parse(&bad, Path::new("deploy/t.toml")).unwrap_err();
    assert_eq!(err.label(), "invalid_config");
    let msg = err.to_string();
    assert!(
        msg.starts_with("invalid deployment file deploy/t.toml: "),
        "{msg}"
    );
    assert!(msg.contains("unknown field `kv_pool_tokenz`"), "{msg}");
    assert!(msg.contains("line 14"), "{msg}");

    let bad = EXAMPLE.replace("role = \"prefill\"", "role = \"both\"");
    let msg = DeploymentConfig::parse(&bad, Path::new("t.toml"))
        .unwrap_err()
        .to_string();
    assert!(msg.contains("both"), "{msg}");

    let bad = EXAMPLE.replace("127.0.0.1:8787", "localhost");
    assert!(DeploymentConfig::parse(&bad, Path::new("t.toml")).is_err());

    let err = DeploymentConfig::load(Path::new("/nonexistent/tessera.toml")).unwrap_err();
    assert_eq!(err.label(), "unreadable_config");
    assert!(err
        .to_string()
        .starts_with("cannot read deployment file /nonexistent/tessera.toml: "));
}

#[test]
fn node_links_section_parses_and_its_structure_is_checked() {
    let base = r#"
[gateway]
listen = "127.0.0.1:8787"
[[models]]
id = "m"
path = "/nonexistent/m.gguf"
context = 16
[[pools]]
name = "p"
role = "prefill"
kv_pool_tokens = 16
nodes = ["127.0.0.1:9101"]
[[pools]]
name = "d"
role = "decode"
kv_pool_tokens = 16
nodes = ["10.0.0.2:9201"]
"#;
    let parse = |extra: &str| {
        DeploymentConfig::parse(&format!("{base}{extra}"), Path::new("t.toml")).unwrap()
    };
    // No TLS: the node off loopback is named.
    let cfg = parse("");
    assert_eq!(cfg.links(), NodeLinksConfig::default());
    assert_eq!(
        cfg.structural_violations(),
        vec![Violation::InsecureNodeLinks {
            address: "10.0.0.2:9201".into()
        }]
    );
    // Mutual TLS configured: no structural violation; identities in file order.
    let cfg = parse("[node_links]\nca = \"c/ca.pem\"\ncert_dir = \"c\"\nheartbeat_ms = 200\n");
    assert_eq!(cfg.structural_violations(), vec![]);
    assert_eq!(cfg.links().heartbeat_ms, 200);
    assert_eq!(cfg.links().dead_after_ms, 5000);
    let names: Vec<String> = cfg
        .link_identities()
        .iter()
        .map(|i| i.name().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "gateway.tessera",
            "prefill-9101.127.0.0.1.tessera",
            "decode-9201.10.0.0.2.tessera"
        ]
    );
    // Its files are checked offline, one violation per identity, naming the path.
    let files = cfg.node_link_file_violations();
    assert_eq!(labels(&files), ["node_link_file"; 3]);
    assert!(files[0].to_string().contains("c/ca.pem"), "{}", files[0]);
    // A process checks only its own identity's files (it is given no others).
    let own = cfg
        .check_offline_for(&LinkIdentity::Gateway)
        .violations
        .into_iter()
        .filter(|v| v.label() == "node_link_file")
        .count();
    assert_eq!(own, 1);
    let all = cfg
        .check_offline()
        .violations
        .into_iter()
        .filter(|v| v.label() == "node_link_file")
        .count();
    assert_eq!(all, 3);
    // Half a TLS setup, and timings that would call a quiet link dead.
    let cfg = parse("[node_links]\nca = \"c/ca.pem\"\nheartbeat_ms = 5000\n");
    assert_eq!(
        labels(&cfg.structural_violations()),
        ["node_links_incomplete", "bad_liveness"]
    );
    // A heartbeat of 1 ms and a dead-after of an hour: refused, naming the
    // field, the bound and the fix; the bounds themselves are configurable.
    let tls = "[node_links]\nca = \"c/ca.pem\"\ncert_dir = \"c\"\n";
    let cfg = parse(&format!("{tls}heartbeat_ms = 1\ndead_after_ms = 3600000\n"));
    let v = cfg.structural_violations();
    assert_eq!(labels(&v), ["heartbeat_too_short", "dead_after_too_long"]);
    let (short, long) = (v[0].to_string(), v[1].to_string());
    assert!(
        short.contains("heartbeat_ms = 1 is below min_heartbeat_ms = 50")
            && short.contains("raise heartbeat_ms"),
        "{short}"
    );
    assert!(
        long.contains("dead_after_ms = 3600000 is above max_dead_after_ms = 60000")
            && long.contains("lower dead_after_ms"),
        "{long}"
    );
    let cfg = parse(&format!("{tls}heartbeat_ms = 49\ndead_after_ms = 60001\n"));
    assert_eq!(
        labels(&cfg.structural_violations()),
        ["heartbeat_too_short", "dead_after_too_long"]
    );
    let cfg = parse(&format!("{tls}heartbeat_ms = 50\ndead_after_ms = 60000\n"));
    assert_eq!(cfg.structural_violations(), vec![]);
    let cfg = parse(&format!(
        "{tls}heartbeat_ms = 10\ndead_after_ms = 600000\nmin_heartbeat_ms = 10\n\
             max_dead_after_ms = 600000\n"
    ));
    assert_eq!(cfg.structural_violations(), vec![]);
    let e = DeploymentConfig::parse(
        &format!("{base}[node_links]\nkey = 1\n"),
        Path::new("t.toml"),
    );
    assert!(e.is_err());
}

#[test]
fn only_node_membership_changes_need_no_restart() {
    let text = |decode: &str, kv: usize| {
        EXAMPLE
            .replace(
                r#"nodes = ["127.0.0.1:9201"]"#,
                &format!("nodes = [{decode}]"),
            )
            .replace(
                "page_size = 32\nkv_pool_tokens = 16384",
                &format!("page_size = 32\nkv_pool_tokens = {kv}"),
            )
    };
    let parse = |t: String| DeploymentConfig::parse(&t, Path::new("t.toml")).unwrap();
    let old = parse(text(r#""127.0.0.1:9201""#, 16384));
    let added = parse(text(r#""127.0.0.1:9201", "127.0.0.1:9202""#, 16384));
    assert_eq!(old.changes_needing_restart(&added), Vec::<String>::new());
    assert_eq!(added.changes_needing_restart(&old), Vec::<String>::new());
    let resized = parse(text(r#""127.0.0.1:9201""#, 32768));
    let c = old.changes_needing_restart(&resized);
    assert_eq!(c.len(), 1, "{c:?}");
    assert!(c[0].contains("pool decode"), "{c:?}");
    let mut moved = old.clone();
    moved.gateway.listen = "127.0.0.1:9999".parse().unwrap();
    moved.pools.pop();
    let c = old.changes_needing_restart(&moved);
    assert_eq!(c.len(), 2, "{c:?}");
}
