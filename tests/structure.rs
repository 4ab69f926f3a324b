//! The workspace's structure, checked: no crate imports one above it, and no
//! crate's modules import each other in a circle (issue 33, item 7).
//!
//! Reads sources as text (no compiler): `use` paths and qualified paths
//! (`crate::a::B`, `super::c`, `self::d`, a child module's name) are resolved to
//! the file that defines the module they name. Comments, string literals and
//! `#[cfg(test)]` items are skipped: a test module may reach anywhere.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The crate layers, bottom up: a crate may depend only on crates of a lower
/// layer (docs/architecture.md draws the same picture).
const LAYERS: &[(&str, u32)] = &[
    ("tessera-kernels", 0),
    ("tessera-transfer", 1),
    ("tessera-model", 1),
    ("tessera-config", 1),
    ("tessera-tenancy", 1),
    ("tessera-loadtest", 1),
    ("tessera-engine", 2),
    ("tessera-ops", 2),
    ("tessera-serving", 3),
    ("tessera-gateway", 4),
    ("tessera", 5),
];

/// Pairs that the layers alone would allow but the design forbids: KV transfer
/// knows pages, not models; the gateway speaks to backends only through
/// `tessera-serving`'s handles.
const FORBIDDEN: &[(&str, &str)] = &[
    ("tessera-transfer", "tessera-model"),
    ("tessera-gateway", "tessera-transfer"),
    ("tessera-gateway", "tessera-engine"),
];

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

struct Crate {
    name: String,
    dir: PathBuf,
    /// Workspace crates in `[dependencies]` (not dev- or build-dependencies).
    deps: Vec<String>,
}

fn workspace_crates() -> Vec<Crate> {
    let manifest: toml::Table = std::fs::read_to_string(root().join("Cargo.toml"))
        .unwrap()
        .parse()
        .unwrap();
    let members = manifest["workspace"]["members"].as_array().unwrap();
    let mut dirs = vec![root()];
    dirs.extend(members.iter().map(|m| root().join(m.as_str().unwrap())));
    dirs.into_iter()
        .map(|dir| {
            let m: toml::Table = std::fs::read_to_string(dir.join("Cargo.toml"))
                .unwrap()
                .parse()
                .unwrap();
            let name = m["package"]["name"].as_str().unwrap().to_string();
            let deps = m
                .get("dependencies")
                .and_then(|d| d.as_table())
                .map(|d| {
                    d.iter()
                        .filter(|(_, v)| v.get("path").is_some())
                        .map(|(k, v)| {
                            v.get("package")
                                .and_then(|p| p.as_str())
                                .unwrap_or(k)
                                .to_string()
                        })
                        .collect()
                })
                .unwrap_or_default();
            Crate { name, dir, deps }
        })
        .collect()
}

#[test]
fn no_crate_depends_on_a_crate_above_it() {
    let layer: BTreeMap<&str, u32> = LAYERS.iter().copied().collect();
    let mut wrong = Vec::new();
    for c in workspace_crates() {
        let Some(&own) = layer.get(c.name.as_str()) else {
            wrong.push(format!(
                "{} has no layer in tests/structure.rs LAYERS",
                c.name
            ));
            continue;
        };
        for d in &c.deps {
            match layer.get(d.as_str()) {
                Some(&l) if l < own => {}
                Some(&l) => wrong.push(format!(
                    "{} (layer {own}) depends on {d} (layer {l}), not below it",
                    c.name
                )),
                None => wrong.push(format!("{d} has no layer in tests/structure.rs LAYERS")),
            }
            if FORBIDDEN.contains(&(c.name.as_str(), d.as_str())) {
                wrong.push(format!("{} must not depend on {d}", c.name));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "crate layering broken:\n{}",
        wrong.join("\n")
    );
}

#[test]
fn no_crate_has_a_module_import_circle() {
    let mut found = Vec::new();
    for c in workspace_crates() {
        for target in ["src/lib.rs", "src/main.rs"] {
            let file = c.dir.join(target);
            if file.exists() {
                let graph = module_graph(&file);
                for circle in circles(&graph) {
                    let names: Vec<String> = circle
                        .iter()
                        .map(|f| f.strip_prefix(root()).unwrap_or(f).display().to_string())
                        .collect();
                    found.push(format!("{} ({target}): {}", c.name, names.join(" <-> ")));
                }
            }
        }
    }
    assert!(
        found.is_empty(),
        "module import circles:\n{}",
        found.join("\n")
    );
}

#[test]
fn the_checker_finds_a_planted_circle_and_ignores_test_modules() {
    let dir = tempdir();
    let w = |p: &str, s: &str| std::fs::write(dir.join(p), s).unwrap();
    // lib.rs re-exports a child that uses the crate root: a facade, no circle.
    w(
        "lib.rs",
        "mod a;\nmod b;\nmod c;\npub use a::A;\npub struct R;\n",
    );
    w(
        "a.rs",
        "use crate::b::B; // crate::c::C in a comment\npub struct A;\n",
    );
    w(
        "b.rs",
        "pub struct B;\nfn f(_: crate::R) -> super::a::A { let _ = \"crate::c\"; todo!() }\n",
    );
    w(
        "c.rs",
        "pub struct C;\n#[cfg(test)]\nmod tests {\n    use crate::a::A;\n}\n",
    );
    let graph = module_graph(&dir.join("lib.rs"));
    let found = circles(&graph);
    assert_eq!(found.len(), 1, "{found:?}");
    let names: BTreeSet<_> = found[0]
        .iter()
        .map(|p| p.file_name().unwrap().to_str().unwrap().to_string())
        .collect();
    assert_eq!(
        names,
        BTreeSet::from(["a.rs".to_string(), "b.rs".to_string()])
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

fn tempdir() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tessera-structure-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A module: its path from the crate root (`["kv", "pool"]`) and the file
/// that holds it (inline modules share their file).
#[derive(Clone)]
struct Module {
    path: Vec<String>,
    file: PathBuf,
}

/// file -> files it imports from, over every module of the crate rooted at
/// `root_file`.
fn module_graph(root_file: &Path) -> BTreeMap<PathBuf, BTreeSet<PathBuf>> {
    // Pass 1: every module and its file, with the cleaned text of each file.
    let mut modules: Vec<Module> = Vec::new();
    let mut texts: BTreeMap<PathBuf, String> = BTreeMap::new();
    let mut stack = vec![(Vec::<String>::new(), root_file.to_path_buf(), true)];
    while let Some((path, file, owns_dir)) = stack.pop() {
        let Ok(raw) = std::fs::read_to_string(&file) else {
            continue;
        };
        let text = strip_tests(&clean(&raw));
        modules.push(Module {
            path: path.clone(),
            file: file.clone(),
        });
        // A `foo.rs` holds its children in `foo/`; lib.rs, main.rs, mod.rs in their own folder.
        let dir = if owns_dir {
            file.parent().unwrap().to_path_buf()
        } else {
            file.with_extension("")
        };
        for (child, inline) in declared_modules(&text) {
            let mut p = path.clone();
            p.push(child.clone());
            if inline {
                modules.push(Module {
                    path: p,
                    file: file.clone(),
                });
                continue;
            }
            let flat = dir.join(format!("{child}.rs"));
            let nested = dir.join(&child).join("mod.rs");
            if flat.exists() {
                stack.push((p, flat, false));
            } else if nested.exists() {
                stack.push((p, nested, true));
            }
        }
        texts.insert(file, text);
    }
    let by_path: BTreeMap<Vec<String>, PathBuf> = modules
        .iter()
        .map(|m| (m.path.clone(), m.file.clone()))
        .collect();

    // Pass 2: each file's paths, resolved to the deepest module they name.
    let mut graph: BTreeMap<PathBuf, BTreeSet<PathBuf>> = BTreeMap::new();
    for m in modules.iter().filter(|m| texts.contains_key(&m.file)) {
        // Only a file's own (outermost) module resolves its paths.
        if modules
            .iter()
            .any(|o| o.file == m.file && o.path.len() < m.path.len())
        {
            continue;
        }
        let text = &texts[&m.file];
        let children: BTreeSet<String> = declared_modules(text).into_iter().map(|c| c.0).collect();
        let edges = graph.entry(m.file.clone()).or_default();
        for (path, reexport) in referenced_paths(text) {
            let Some(absolute) = absolute(&m.path, &children, &path) else {
                continue;
            };
            // A module re-exporting its own descendants is their facade, not
            // a user of them (`pub use device::CudaDevice` in `cuda/mod.rs`).
            if reexport && absolute.len() > m.path.len() && absolute.starts_with(&m.path) {
                continue;
            }
            // The deepest prefix that is a module.
            for n in (1..=absolute.len()).rev() {
                if let Some(f) = by_path.get(&absolute[..n]) {
                    if *f != m.file {
                        edges.insert(f.clone());
                    }
                    break;
                }
            }
        }
    }
    graph
}

/// `path` (segments as written) made absolute from module `here`, or None
/// for paths into other crates.
fn absolute(here: &[String], children: &BTreeSet<String>, path: &[String]) -> Option<Vec<String>> {
    let first = path.first()?;
    match first.as_str() {
        "crate" => Some(path[1..].to_vec()),
        "self" => Some(here.iter().chain(&path[1..]).cloned().collect()),
        "super" => {
            let mut base = here.to_vec();
            let mut rest = path;
            while rest.first().map(String::as_str) == Some("super") {
                base.pop();
                rest = &rest[1..];
            }
            Some(base.into_iter().chain(rest.iter().cloned()).collect())
        }
        child if children.contains(child) => {
            Some(here.iter().chain(path.iter()).cloned().collect())
        }
        _ => None,
    }
}

/// `mod name;` (false) and `mod name {` (true) declarations at any depth.
fn declared_modules(text: &str) -> Vec<(String, bool)> {
    let words = tokens(text);
    let mut out = Vec::new();
    for i in 0..words.len() {
        if words[i] == "mod" && i + 2 < words.len() && is_ident(&words[i + 1]) {
            match words[i + 2].as_str() {
                ";" => out.push((words[i + 1].clone(), false)),
                "{" => out.push((words[i + 1].clone(), true)),
                _ => {}
            }
        }
    }
    out
}

/// Every path a file names: the expanded `use` trees and every `a::b` chain,
/// each with whether it is a re-export (`pub use`, `pub(crate) use`).
fn referenced_paths(text: &str) -> Vec<(Vec<String>, bool)> {
    let words = tokens(text);
    let mut out = Vec::new();
    let mut i = 0;
    while i < words.len() {
        if words[i] == "use" {
            let end = words[i..]
                .iter()
                .position(|w| w == ";")
                .map_or(words.len(), |p| i + p);
            let reexport = (i >= 1 && words[i - 1] == "pub")
                || (i >= 4 && words[i - 4] == "pub" && words[i - 1] == ")");
            let mut paths = Vec::new();
            expand_use(&words[i + 1..end], &[], &mut paths);
            out.extend(paths.into_iter().map(|p| (p, reexport)));
            i = end;
            continue;
        }
        if is_ident(&words[i]) && words.get(i + 1).map(String::as_str) == Some("::") {
            let preceded = i > 0 && words[i - 1] == "::";
            if !preceded {
                let mut path = vec![words[i].clone()];
                let mut j = i + 1;
                while words.get(j).map(String::as_str) == Some("::")
                    && words.get(j + 1).is_some_and(|w| is_ident(w))
                {
                    path.push(words[j + 1].clone());
                    j += 2;
                }
                out.push((path, false));
                i = j;
                continue;
            }
        }
        i += 1;
    }
    out
}

/// Expands one `use` tree (`a::{b, c::{d as e}}`) into its paths.
fn expand_use(words: &[String], prefix: &[String], out: &mut Vec<Vec<String>>) {
    let mut path = prefix.to_vec();
    let mut i = 0;
    while i < words.len() {
        let w = &words[i];
        if w == "{" {
            // Split the group at top-level commas.
            let mut depth = 0;
            let mut start = i + 1;
            for j in i..words.len() {
                match words[j].as_str() {
                    "{" => depth += 1,
                    "}" => {
                        depth -= 1;
                        if depth == 0 {
                            expand_use(&words[start..j], &path, out);
                            return;
                        }
                    }
                    "," if depth == 1 => {
                        expand_use(&words[start..j], &path, out);
                        start = j + 1;
                    }
                    _ => {}
                }
            }
            return;
        }
        if w == "as" {
            break;
        }
        if is_ident(w) || w == "*" {
            path.push(w.clone());
        }
        i += 1;
    }
    if !path.is_empty() {
        out.push(path);
    }
}

/// Identifiers, `::`, and single punctuation characters.
fn tokens(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let chars: Vec<char> = text.chars().collect();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c.is_alphanumeric() || c == '_' {
            let start = i;
            while i < chars.len() && (chars[i].is_alphanumeric() || chars[i] == '_') {
                i += 1;
            }
            out.push(chars[start..i].iter().collect());
        } else if c == ':' && chars.get(i + 1) == Some(&':') {
            out.push("::".into());
            i += 2;
        } else {
            if !c.is_whitespace() {
                out.push(c.to_string());
            }
            i += 1;
        }
    }
    out
}

fn is_ident(w: &str) -> bool {
    w.chars()
        .next()
        .is_some_and(|c| c.is_alphabetic() || c == '_')
}

/// The text without comments, string and char literals (their bytes blanked).
fn clean(raw: &str) -> String {
    let b: Vec<char> = raw.chars().collect();
    let mut out = String::with_capacity(raw.len());
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        let next = b.get(i + 1).copied();
        if c == '/' && next == Some('/') {
            while i < b.len() && b[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && next == Some('*') {
            let mut depth = 0;
            while i < b.len() {
                if b[i] == '/' && b.get(i + 1) == Some(&'*') {
                    depth += 1;
                    i += 2;
                } else if b[i] == '*' && b.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
            out.push(' ');
        } else if c == 'r' && (next == Some('"') || next == Some('#')) && !prev_ident(&b, i) {
            // Raw string r"..." or r#"..."#.
            let mut j = i + 1;
            let mut hashes = 0;
            while b.get(j) == Some(&'#') {
                hashes += 1;
                j += 1;
            }
            if b.get(j) != Some(&'"') {
                out.push(c);
                i += 1;
                continue;
            }
            j += 1;
            loop {
                if j >= b.len() {
                    break;
                }
                if b[j] == '"' && (0..hashes).all(|k| b.get(j + 1 + k) == Some(&'#')) {
                    j += 1 + hashes;
                    break;
                }
                j += 1;
            }
            out.push_str("\"\"");
            i = j;
        } else if c == '"' {
            i += 1;
            while i < b.len() && b[i] != '"' {
                if b[i] == '\\' {
                    i += 1;
                }
                i += 1;
            }
            i += 1;
            out.push_str("\"\"");
        } else if c == '\'' {
            // A char literal ('a', '\n', '\u{1F}') or a lifetime ('a).
            if next == Some('\\') {
                let mut j = i + 2;
                while j < b.len() && b[j] != '\'' {
                    j += 1;
                }
                i = j + 1;
                out.push_str("' '");
            } else if b.get(i + 2) == Some(&'\'') {
                i += 3;
                out.push_str("' '");
            } else {
                out.push(c);
                i += 1;
            }
        } else {
            out.push(c);
            i += 1;
        }
    }
    out
}

fn prev_ident(b: &[char], i: usize) -> bool {
    i > 0 && (b[i - 1].is_alphanumeric() || b[i - 1] == '_')
}

/// The text without items under `#[cfg(test)]` (a module, function or `use`).
fn strip_tests(text: &str) -> String {
    let mut out = text.to_string();
    while let Some(at) = out.find("#[cfg(test)]") {
        let rest = &out[at..];
        // The item ends at its first `;` before any `{`, or at its block's close.
        let semi = rest.find(';');
        let open = rest.find('{');
        let end = match (semi, open) {
            (Some(s), Some(o)) if s < o => at + s + 1,
            (_, Some(o)) => {
                let mut depth = 0;
                let mut end = out.len();
                for (k, ch) in out[at + o..].char_indices() {
                    match ch {
                        '{' => depth += 1,
                        '}' => {
                            depth -= 1;
                            if depth == 0 {
                                end = at + o + k + 1;
                                break;
                            }
                        }
                        _ => {}
                    }
                }
                end
            }
            (Some(s), None) => at + s + 1,
            (None, None) => out.len(),
        };
        out.replace_range(at..end, " ");
    }
    out
}

/// The strongly connected components of more than one file (Tarjan).
fn circles(graph: &BTreeMap<PathBuf, BTreeSet<PathBuf>>) -> Vec<Vec<PathBuf>> {
    let nodes: Vec<&PathBuf> = graph.keys().collect();
    let index_of: BTreeMap<&PathBuf, usize> =
        nodes.iter().enumerate().map(|(i, n)| (*n, i)).collect();
    let succ: Vec<Vec<usize>> = nodes
        .iter()
        .map(|n| {
            graph[*n]
                .iter()
                .filter_map(|m| index_of.get(m).copied())
                .collect()
        })
        .collect();
    let mut t = Tarjan {
        succ: &succ,
        index: vec![usize::MAX; nodes.len()],
        low: vec![0; nodes.len()],
        on_stack: vec![false; nodes.len()],
        stack: Vec::new(),
        next: 0,
        components: Vec::new(),
    };
    for v in 0..nodes.len() {
        if t.index[v] == usize::MAX {
            t.visit(v);
        }
    }
    t.components
        .into_iter()
        .map(|c| {
            let mut files: Vec<PathBuf> = c.into_iter().map(|i| nodes[i].clone()).collect();
            files.sort();
            files
        })
        .collect()
}

struct Tarjan<'a> {
    succ: &'a [Vec<usize>],
    index: Vec<usize>,
    low: Vec<usize>,
    on_stack: Vec<bool>,
    stack: Vec<usize>,
    next: usize,
    components: Vec<Vec<usize>>,
}

impl Tarjan<'_> {
    fn visit(&mut self, v: usize) {
        self.index[v] = self.next;
        self.low[v] = self.next;
        self.next += 1;
        self.stack.push(v);
        self.on_stack[v] = true;
        for &w in &self.succ[v] {
            if self.index[w] == usize::MAX {
                self.visit(w);
                self.low[v] = self.low[v].min(self.low[w]);
            } else if self.on_stack[w] {
                self.low[v] = self.low[v].min(self.index[w]);
            }
        }
        if self.low[v] == self.index[v] {
            let mut component = Vec::new();
            loop {
                let w = self.stack.pop().unwrap();
                self.on_stack[w] = false;
                component.push(w);
                if w == v {
                    break;
                }
            }
            if component.len() > 1 {
                self.components.push(component);
            }
        }
    }
}
