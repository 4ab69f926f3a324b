//! `tessera ops check-config`: load a deployment file, check it offline (model context
//! windows read from the GGUF files, or the `context` fields) and report every
//! violation.

use serde_json::{json, Value};
use std::fmt::Write as _;
use std::io::Write;
use std::path::{Path, PathBuf};
use tessera_config::{ConfigError, DeploymentConfig, PoolFit, Verdict};

/// A deployment file that parsed, and what the checks found.
#[derive(Debug, Clone)]
pub struct Checked {
    /// The parsed file.
    pub config: DeploymentConfig,
    /// Every violation and the per (model, pool) I2 lines.
    pub verdict: Verdict,
}

/// The result of checking one deployment file.
#[derive(Debug)]
pub struct Report {
    /// The file checked, as given.
    pub file: PathBuf,
    /// The checks' results, or why the file could not be read or parsed.
    pub outcome: Result<Checked, ConfigError>,
}

/// Loads `path` and checks it offline ([`DeploymentConfig::check_offline`]).
/// Relative model paths are taken from the working directory, as nodes take them.
pub fn check_config(path: &Path) -> Report {
    let outcome = DeploymentConfig::load(path).map(|config| Checked {
        verdict: config.check_offline(),
        config,
    });
    Report {
        file: path.into(),
        outcome,
    }
}

impl Report {
    /// No violations, and the file parsed.
    pub fn is_ok(&self) -> bool {
        self.violation_count() == 0
    }

    /// Violations found; a file that cannot be read or parsed counts as one.
    pub fn violation_count(&self) -> usize {
        match &self.outcome {
            Ok(c) => c.verdict.violations.len(),
            Err(_) => 1,
        }
    }

    /// The human report: models and their context windows, one I2 line per
    /// (model, pool), every violation, and a last line `verdict: OK ...` or
    /// `verdict: FAIL ...`.
    pub fn to_text(&self) -> String {
        let mut s = String::new();
        // Writing to a String cannot fail.
        let _ = self.write_text(&mut s);
        s
    }

    fn write_text(&self, s: &mut String) -> std::fmt::Result {
        writeln!(s, "deployment file {}", self.file.display())?;
        let checked = match &self.outcome {
            Ok(c) => c,
            Err(e) => {
                writeln!(s, "violations (1):")?;
                writeln!(s, "  - [{}] {}", e.label(), indent(&e.to_string()))?;
                writeln!(s, "verdict: FAIL (1 violation)")?;
                return Ok(());
            }
        };
        let (config, verdict) = (&checked.config, &checked.verdict);
        writeln!(s, "gateway: listen {}", config.gateway.listen)?;
        let links = config.links();
        match links.tls_files() {
            Some((ca, dir)) => writeln!(
                s,
                "node links: mutual TLS, CA {}, certificates in {} (heartbeat {} ms, dead after {} ms)",
                ca.display(),
                dir.display(),
                links.heartbeat_ms,
                links.dead_after_ms
            )?,
            None => writeln!(
                s,
                "node links: NOT authenticated (no [node_links] ca/cert_dir): nodes and gateways start only with --insecure-node-links, on loopback"
            )?,
        }
        writeln!(s, "models:")?;
        for m in &verdict.models {
            let lifecycle = config.model(&m.id).map_or(String::new(), |e| {
                let mut s = String::new();
                if !e.aliases.is_empty() {
                    s.push_str(&format!(", aliases {}", e.aliases.join(", ")));
                }
                if let Some(d) = &e.deprecated {
                    s.push_str(&format!(", deprecated {d}"));
                }
                if let Some(d) = &e.sunset {
                    s.push_str(&format!(", sunset {d}"));
                }
                s
            });
            match m.context {
                Some(c) => writeln!(
                    s,
                    "  {}: context window {c} tokens ({}){lifecycle}",
                    m.id,
                    m.path.display()
                )?,
                None => writeln!(
                    s,
                    "  {}: context window unknown ({})",
                    m.id,
                    m.path.display()
                )?,
            }
        }
        writeln!(s, "pools:")?;
        for p in &config.pools {
            writeln!(
                s,
                "  {} pool \"{}\": {} node{}, page_size {}, kv_pool_tokens {}, usable {}",
                p.role,
                p.name,
                p.nodes.len(),
                plural(p.nodes.len()),
                p.page_size,
                p.kv_pool_tokens,
                p.usable_tokens()
            )?;
        }
        if !verdict.fits.is_empty() {
            writeln!(s, "I2 (usable KV tokens per node >= context window):")?;
            for f in &verdict.fits {
                writeln!(s, "  {}", fit_line(f))?;
            }
        }
        let n = verdict.violations.len();
        if n > 0 {
            writeln!(s, "violations ({n}):")?;
            for v in &verdict.violations {
                writeln!(s, "  - [{}] {v}", v.label())?;
            }
            writeln!(s, "verdict: FAIL ({n} violation{})", plural(n))?;
        } else {
            let nodes: usize = config.pools.iter().map(|p| p.nodes.len()).sum();
            writeln!(
                s,
                "verdict: OK ({} model{}, {} pool{}, {nodes} node{})",
                verdict.models.len(),
                plural(verdict.models.len()),
                config.pools.len(),
                plural(config.pools.len()),
                plural(nodes)
            )?;
        }
        Ok(())
    }

    /// The report as JSON: `file`, `ok`, `violations` (`label`, `message`), and when the
    /// file parsed, `gateway`, `node_links` (`mutual_tls`, `ca`, `cert_dir`,
    /// `heartbeat_ms`, `dead_after_ms`, `min_heartbeat_ms`, `max_dead_after_ms`,
    /// `allow_group_readable_keys`), `models` (`id`, `path`, `context` or null, and the
    /// catalog fields `description`, `tags`, `aliases`, `deprecated`, `sunset`), `pools`
    /// (`name`, `role`, `page_size`, `kv_pool_tokens`, `usable_tokens`, `nodes`,
    /// `models` or null) and `fits` (`model`, `pool`, `role`, `context`,
    /// `usable_tokens`, `ok`).
    pub fn to_json(&self) -> Value {
        let file = self.file.display().to_string();
        let checked = match &self.outcome {
            Ok(c) => c,
            Err(e) => {
                return json!({
                    "file": file,
                    "ok": false,
                    "violations": [{"label": e.label(), "message": e.to_string()}],
                })
            }
        };
        let (config, verdict) = (&checked.config, &checked.verdict);
        json!({
            "file": file,
            "ok": verdict.is_ok(),
            "violations": verdict.violations.iter().map(|v| json!({
                "label": v.label(),
                "message": v.to_string(),
            })).collect::<Vec<_>>(),
            "gateway": {"listen": config.gateway.listen.to_string()},
            "node_links": {
                "mutual_tls": config.links().tls_files().is_some(),
                "ca": config.links().ca.map(|p| p.display().to_string()),
                "cert_dir": config.links().cert_dir.map(|p| p.display().to_string()),
                "heartbeat_ms": config.links().heartbeat_ms,
                "dead_after_ms": config.links().dead_after_ms,
                "min_heartbeat_ms": config.links().min_heartbeat_ms,
                "max_dead_after_ms": config.links().max_dead_after_ms,
                "allow_group_readable_keys": config.links().allow_group_readable_keys,
            },
            "models": verdict.models.iter().map(|m| {
                let e = config.model(&m.id);
                json!({
                    "id": m.id,
                    "path": m.path.display().to_string(),
                    "context": m.context,
                    "description": e.and_then(|e| e.description.clone()),
                    "tags": e.map(|e| e.tags.clone()).unwrap_or_default(),
                    "aliases": e.map(|e| e.aliases.clone()).unwrap_or_default(),
                    "deprecated": e.and_then(|e| e.deprecated.clone()),
                    "sunset": e.and_then(|e| e.sunset.clone()),
                })
            }).collect::<Vec<_>>(),
            "pools": config.pools.iter().map(|p| json!({
                "name": p.name,
                "role": p.role.as_str(),
                "page_size": p.page_size,
                "kv_pool_tokens": p.kv_pool_tokens,
                "usable_tokens": p.usable_tokens(),
                "nodes": p.nodes,
                "models": p.models,
            })).collect::<Vec<_>>(),
            "fits": verdict.fits.iter().map(|f| json!({
                "model": f.model,
                "pool": f.pool,
                "role": f.role.as_str(),
                "context": f.context,
                "usable_tokens": f.usable_tokens,
                "ok": f.fits(),
            })).collect::<Vec<_>>(),
        })
    }
}

fn fit_line(f: &PoolFit) -> String {
    let (mark, cmp) = if f.fits() {
        ("ok  ", ">=")
    } else {
        ("FAIL", "<")
    };
    format!(
        "{mark} {} pool \"{}\" x {}: {} {cmp} {}",
        f.role, f.pool, f.model, f.usable_tokens, f.context
    )
}

fn plural(n: usize) -> &'static str {
    if n == 1 {
        ""
    } else {
        "s"
    }
}

/// Indents continuation lines (TOML errors span several) under a list item.
fn indent(text: &str) -> String {
    text.trim_end().replace('\n', "\n    ")
}

/// `tessera ops check-config` failed: the report was printed, and this is the summary.
#[derive(Debug, thiserror::Error)]
pub enum CheckConfigError {
    /// The file has violations (listed in the printed report).
    #[error(
        "deployment file {file} failed the configuration check: {count} violation{}",
        plural(*count)
    )]
    Violations {
        /// The file checked.
        file: PathBuf,
        /// How many violations.
        count: usize,
    },
    /// The report could not be written.
    #[error("cannot write the report: {0}")]
    Write(#[from] std::io::Error),
}

/// The whole command: checks `path`, writes the full report to `out` (text, or JSON
/// with `json`), then returns an error when there is any violation, so the binary
/// exits non-zero after printing the report.
pub fn check_config_command(
    path: &Path,
    json: bool,
    out: &mut dyn Write,
) -> Result<(), CheckConfigError> {
    let report = check_config(path);
    if json {
        writeln!(out, "{:#}", report.to_json())?;
    } else {
        write!(out, "{}", report.to_text())?;
    }
    out.flush()?;
    if report.is_ok() {
        Ok(())
    } else {
        Err(CheckConfigError::Violations {
            file: path.into(),
            count: report.violation_count(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn repo(p: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(p)
    }

    fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p
    }

    fn deployment(model_path: &Path, decode_tokens: usize) -> String {
        format!(
            r#"
[gateway]
listen = "127.0.0.1:8787"
[[models]]
id = "@cf/huggingfacetb/smollm2-135m-instruct"
path = "{}"
[[pools]]
name = "prefill"
role = "prefill"
kv_pool_tokens = 16384
nodes = ["127.0.0.1:9101"]
[[pools]]
name = "decode-a"
role = "decode"
kv_pool_tokens = {decode_tokens}
nodes = ["127.0.0.1:9201", "127.0.0.1:9202"]
"#,
            model_path.display()
        )
    }

    #[test]
    fn good_file_reports_ok() {
        let dir = tempfile::tempdir().unwrap();
        let model = repo("models/SmolLM2-135M-Instruct.Q4_1.gguf");
        let f = write(dir.path(), "t.toml", &deployment(&model, 8192));
        let mut out = Vec::new();
        check_config_command(&f, false, &mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        assert!(text.contains("context window 8192 tokens"), "{text}");
        assert!(
            text.contains("ok   decode pool \"decode-a\" x @cf/huggingfacetb/smollm2-135m-instruct: 8192 >= 8192"),
            "{text}"
        );
        assert!(
            text.ends_with("verdict: OK (1 model, 2 pools, 3 nodes)\n"),
            "{text}"
        );
    }

    #[test]
    fn small_pool_fails_after_printing_everything() {
        let dir = tempfile::tempdir().unwrap();
        let model = repo("models/SmolLM2-135M-Instruct.Q4_1.gguf");
        let f = write(dir.path(), "t.toml", &deployment(&model, 8176));
        let mut out = Vec::new();
        let err = check_config_command(&f, true, &mut out).unwrap_err();
        assert!(
            matches!(err, CheckConfigError::Violations { count: 1, .. }),
            "{err}"
        );
        let v: Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v["ok"], false);
        assert_eq!(v["violations"][0]["label"], "pool_too_small");
        assert_eq!(
            v["violations"][0]["message"],
            "decode pool \"decode-a\" holds 8176 usable KV tokens but model \
             @cf/huggingfacetb/smollm2-135m-instruct has a context window of 8192 tokens \
             (I2: a node's pool must hold a full context; raise kv_pool_tokens)"
        );
        assert_eq!(v["fits"][0]["ok"], true);
        assert_eq!(v["fits"][1]["ok"], false);
        assert_eq!(v["models"][0]["context"], 8192);
        assert_eq!(v["pools"][1]["usable_tokens"], 8176);
    }

    #[test]
    fn parse_error_is_one_violation() {
        let dir = tempfile::tempdir().unwrap();
        let f = write(
            dir.path(),
            "t.toml",
            "[gateway]\nlisten = \"127.0.0.1:1\"\nport = 1\n",
        );
        let report = check_config(&f);
        assert_eq!(report.violation_count(), 1);
        let text = report.to_text();
        assert!(text.contains("[invalid_config]"), "{text}");
        assert!(text.contains("unknown field `port`"), "{text}");
        assert!(text.ends_with("verdict: FAIL (1 violation)\n"), "{text}");
        assert_eq!(report.to_json()["violations"][0]["label"], "invalid_config");
    }

    #[test]
    fn repository_example_passes_from_the_repository_root() {
        // Its model path is relative to the repository root, like a node's working directory.
        let report = check_config(&repo("ops/deploy/tessera.toml"));
        let Ok(checked) = &report.outcome else {
            panic!("{}", report.to_text())
        };
        let mut config = checked.config.clone();
        for m in &mut config.models {
            m.path = repo(&m.path.display().to_string());
        }
        // It names mutual TLS files; issued (as its comments say), it passes.
        let links = config.links();
        assert!(links.tls_files().is_some(), "the example uses mutual TLS");
        let root = tempfile::tempdir().unwrap();
        let (ca, certs) = (root.path().join("ca"), root.path().join("certs"));
        crate::certs::init(&ca).unwrap();
        crate::certs::issue(&config, &ca, &certs, 1).unwrap();
        config.node_links = Some(tessera_config::NodeLinksConfig {
            ca: Some(certs.join(crate::certs::CA_CERT)),
            cert_dir: Some(certs.clone()),
            ..links
        });
        let verdict = config.check_offline();
        assert!(verdict.is_ok(), "{:?}", verdict.violations);
    }
}
