//! Test support: throwaway PostgreSQL and Redis servers (feature `test-util`).
//!
//! [`PgServer::from_env_or_start`] returns the server named by
//! `TESSERA_TEST_POSTGRES_URL` (`.ci/run` installs Debian's `postgresql`, starts it
//! and sets the variable), or else starts a private server from the installed
//! PostgreSQL binaries (initdb + pg_ctl in a temp dir, as the `postgres` user when
//! run as root, since initdb refuses root) and stops it on drop.
//!
//! [`RedisServer::from_env_or_start`] likewise returns `TESSERA_TEST_REDIS_URL`, or
//! starts a private `redis-server` (Debian's `redis-server`) on a unix socket in a
//! temp dir, without persistence, and kills it on drop.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A PostgreSQL server for tests.
pub struct PgServer {
    dir: tempfile::TempDir,
    bin: PathBuf,
    as_postgres: bool,
    url: String,
}

fn pg_bin() -> PathBuf {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .map(|e| e.path().join("bin"))
                .collect()
        })
        .unwrap_or_default();
    dirs.sort();
    dirs.into_iter()
        .rev()
        .find(|d| d.join("initdb").exists())
        .expect("PostgreSQL binaries not found: `apt-get install postgresql` (see .ci/run) or set TESSERA_TEST_POSTGRES_URL")
}

fn run(as_postgres: bool, bin: &Path, args: &[&str]) {
    if let Err(e) = try_run(as_postgres, bin, args) {
        panic!("{e}");
    }
}

/// Runs `bin` with `args` (as `postgres` when asked); the error names the command
/// and its stderr.
fn try_run(as_postgres: bool, bin: &Path, args: &[&str]) -> Result<(), String> {
    let mut c = if as_postgres {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]).arg(bin);
        c
    } else {
        Command::new(bin)
    };
    let out = c.args(args).output().unwrap();
    if out.status.success() {
        return Ok(());
    }
    Err(format!(
        "{} {args:?}: {}",
        bin.display(),
        String::from_utf8_lossy(&out.stderr)
    ))
}

/// A free loopback port now (another process may take it before it is used:
/// the caller retries).
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

impl PgServer {
    /// The URL of the test server: `TESSERA_TEST_POSTGRES_URL`, or a private server
    /// started now (kept alive by the returned guard).
    pub fn from_env_or_start() -> (Option<Self>, String) {
        match std::env::var("TESSERA_TEST_POSTGRES_URL") {
            Ok(u) if !u.is_empty() => (None, u),
            _ => {
                let s = Self::start();
                let u = s.url.clone();
                (Some(s), u)
            }
        }
    }

    /// Connection URL.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Starts a private server.
    pub fn start() -> Self {
        let bin = pg_bin();
        let dir = tempfile::tempdir().unwrap();
        // initdb refuses to run as root: then run the server as `postgres`.
        let as_postgres = Command::new("id")
            .arg("-u")
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
            .unwrap_or(false);
        if as_postgres {
            let st = Command::new("chown")
                .args(["-R", "postgres:postgres"])
                .arg(dir.path())
                .status()
                .unwrap();
            assert!(st.success());
        }
        let data = dir.path().join("data");
        let data_s = data.to_str().unwrap();
        run(
            as_postgres,
            &bin.join("initdb"),
            &[
                "-D",
                data_s,
                "-A",
                "trust",
                "-U",
                "tessera",
                "-E",
                "UTF8",
                "--no-sync",
            ],
        );
        let log = dir.path().join("log");
        // The port was free when picked, but a parallel test may take it first (a
        // full-suite run once failed here with "could not start server"): retry on
        // another port, and on the last failure show the server's own log.
        let mut attempt = 0;
        let port = loop {
            attempt += 1;
            let port = free_port();
            let opts = format!(
                "-p {port} -k {} -c listen_addresses=127.0.0.1 -c fsync=off",
                dir.path().display()
            );
            let started = try_run(
                as_postgres,
                &bin.join("pg_ctl"),
                &[
                    "-D",
                    data_s,
                    "-o",
                    &opts,
                    "-l",
                    log.to_str().unwrap(),
                    "-w",
                    "start",
                ],
            );
            match started {
                Ok(()) => break port,
                Err(e) if attempt >= 3 => panic!(
                    "{e}\nserver log:\n{}",
                    std::fs::read_to_string(&log).unwrap_or_default()
                ),
                Err(_) => std::thread::sleep(Duration::from_millis(200)),
            }
        };
        Self {
            url: format!("postgres://tessera@127.0.0.1:{port}/postgres"),
            dir,
            bin,
            as_postgres,
        }
    }
}

impl Drop for PgServer {
    fn drop(&mut self) {
        let data = self.dir.path().join("data");
        run(
            self.as_postgres,
            &self.bin.join("pg_ctl"),
            &["-D", data.to_str().unwrap(), "-m", "immediate", "stop"],
        );
    }
}

/// A Redis server for tests (see the module doc).
pub struct RedisServer {
    child: Child,
    _dir: tempfile::TempDir,
    socket: PathBuf,
}

impl RedisServer {
    /// The URL of the test server: `TESSERA_TEST_REDIS_URL`, or a private server
    /// started now (kept alive by the returned guard).
    pub fn from_env_or_start() -> (Option<Self>, String) {
        match std::env::var("TESSERA_TEST_REDIS_URL") {
            Ok(u) if !u.is_empty() => (None, u),
            _ => {
                let s = Self::start();
                let u = s.url();
                (Some(s), u)
            }
        }
    }

    /// Connection URL (`redis+unix:///...`).
    pub fn url(&self) -> String {
        format!("redis+unix://{}", self.socket.display())
    }

    /// Starts a private server on a unix socket (no TCP port, no persistence) and
    /// waits until it answers PING.
    ///
    /// Panics when `redis-server` is not installed (tests must not skip silently).
    pub fn start() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("redis.sock");
        let child = Command::new("redis-server")
            .args(["--port", "0", "--unixsocket"])
            .arg(&socket)
            .args([
                "--unixsocketperm",
                "700",
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .arg("--dir")
            .arg(dir.path())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot start redis-server ({e}): `apt-get install redis-server` (see \
                     scripts/test) or set TESSERA_TEST_REDIS_URL"
                )
            });
        let mut s = Self {
            child,
            _dir: dir,
            socket,
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while !ping(&s.socket) {
            if let Ok(Some(status)) = s.child.try_wait() {
                panic!("redis-server exited at start: {status}");
            }
            assert!(
                Instant::now() < deadline,
                "redis-server did not answer PING in 10 s"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        s
    }
}

/// Whether a Redis server answers PING on `socket`.
fn ping(socket: &Path) -> bool {
    use std::io::{Read, Write};
    let Ok(mut c) = std::os::unix::net::UnixStream::connect(socket) else {
        return false;
    };
    let _ = c.set_read_timeout(Some(Duration::from_secs(1)));
    let mut buf = [0u8; 7];
    c.write_all(b"PING\r\n").is_ok() && c.read_exact(&mut buf).is_ok() && &buf == b"+PONG\r\n"
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
