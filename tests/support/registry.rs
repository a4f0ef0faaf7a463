//! A throwaway OCI distribution registry for the integration tests: Debian's
//! `docker-registry` (distribution 2.8, installed by scripts/install-deps.sh)
//! on `127.0.0.1:<free port>`, with filesystem storage in a temporary
//! directory, optionally behind htpasswd basic auth.
//!
//! Only the process this struct spawned is ever killed (SIGKILL, then
//! waited), on [`Registry::stop`] and on drop.
//!
//! Behaviour of distribution 2.8 worth knowing when writing tests against it:
//! - a manifest GET/HEAD whose `Accept` header does not list the OCI
//!   manifest type answers 404 `MANIFEST_UNKNOWN` ("OCI manifest found, but
//!   accept header does not support OCI manifests"), even by digest;
//! - manifest PUT checks that every referenced blob exists in the repository
//!   (400 `MANIFEST_BLOB_UNKNOWN`), but not the layer media type: OCI
//!   manifests with `application/vnd.oci.image.layer.v1.tar+zstd` layers are
//!   accepted and served back as pushed;
//! - blobs are served from storage without re-verification: a tampered data
//!   file (see [`Registry::blob_data`]) is sent as is, with the original
//!   `Docker-Content-Digest` and the new length; a removed one is a 404;
//! - `Location` headers are absolute (`http://127.0.0.1:PORT/v2/...`);
//! - no blob descriptor cache is configured, so edits to the storage are
//!   seen by the next request.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::PREFIX;

/// The registry binary (Debian package `docker-registry`).
pub const REGISTRY_BIN: &str = "/usr/bin/docker-registry";

const READY_TIMEOUT: Duration = Duration::from_secs(30);

pub struct Registry {
    child: Option<Child>,
    dir: tempfile::TempDir,
    port: u16,
    auth: Option<(String, String)>,
}

impl Registry {
    /// Anonymous registry on 127.0.0.1:<free port> with storage in a temp dir.
    pub fn start() -> Registry {
        Registry::start_inner(None)
    }

    /// Same, with basic auth: `user`/`password` in an htpasswd (bcrypt) file.
    pub fn start_with_auth(user: &str, password: &str) -> Registry {
        Registry::start_inner(Some((user.to_string(), password.to_string())))
    }

    fn start_inner(auth: Option<(String, String)>) -> Registry {
        assert!(
            std::path::Path::new(REGISTRY_BIN).exists(),
            "{REGISTRY_BIN} is missing: install the docker-registry package (scripts/install-deps.sh)"
        );
        let dir = tempfile::Builder::new().prefix(&format!("{PREFIX}-registry-")).tempdir().expect("tempdir");
        let mut reg = Registry { child: None, dir, port: 0, auth };
        if let Some((user, password)) = &reg.auth {
            let out = Command::new("htpasswd")
                .args(["-Bbn", user, password])
                .stdin(Stdio::null())
                .output()
                .expect("run htpasswd (package apache2-utils)");
            assert!(out.status.success(), "htpasswd failed: {}", String::from_utf8_lossy(&out.stderr));
            std::fs::write(reg.htpasswd_path(), &out.stdout).expect("write htpasswd");
        }
        // The free port is only free until the listener is dropped; retry
        // with another one if something else took it in between.
        for attempt in 1..=3 {
            reg.port = free_port();
            reg.write_config();
            reg.spawn();
            match reg.wait_ready() {
                Ok(()) => return reg,
                Err(e) => {
                    reg.stop();
                    let log = reg.log();
                    if attempt < 3 && log.contains("address already in use") {
                        continue;
                    }
                    panic!("docker-registry did not start: {e}\nlog:\n{log}");
                }
            }
        }
        unreachable!()
    }

    /// "127.0.0.1:PORT"
    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// The user and password of a [`Registry::start_with_auth`] registry.
    pub fn credentials(&self) -> Option<(&str, &str)> {
        self.auth.as_ref().map(|(u, p)| (u.as_str(), p.as_str()))
    }

    /// Kill (SIGKILL) and wait the process this struct started; no-op if stopped.
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Start again on the same port and storage (stopping it first if it
    /// is still running).
    pub fn restart(&mut self) {
        self.stop();
        self.spawn();
        if let Err(e) = self.wait_ready() {
            self.stop();
            panic!("docker-registry did not restart: {e}\nlog:\n{}", self.log());
        }
    }

    /// Root of the registry's filesystem storage.
    pub fn storage(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    /// Path of a blob's data file in the registry's filesystem storage,
    /// `<root>/docker/registry/v2/blobs/<alg>/<first 2 hex>/<hex>/data`,
    /// given `"<alg>:<hex>"` (e.g. `"sha256:…"`).
    pub fn blob_data(&self, digest: &str) -> PathBuf {
        let (alg, hex) = digest.split_once(':').unwrap_or_else(|| panic!("not a digest: {digest:?}"));
        assert!(
            !alg.is_empty() && hex.len() >= 2 && hex.bytes().all(|b| b.is_ascii_hexdigit()),
            "not a digest: {digest:?}"
        );
        self.storage().join("docker/registry/v2/blobs").join(alg).join(&hex[..2]).join(hex).join("data")
    }

    /// The registry's stdout and stderr (all runs), for diagnostics.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("registry.log")
    }

    fn config_path(&self) -> PathBuf {
        self.dir.path().join("config.yml")
    }

    fn htpasswd_path(&self) -> PathBuf {
        self.dir.path().join("htpasswd")
    }

    fn write_config(&self) {
        // JSON strings are valid YAML double-quoted scalars.
        let q = |p: PathBuf| serde_json::to_string(p.to_str().expect("UTF-8 temp dir")).unwrap();
        let mut cfg = format!(
            "version: 0.1\n\
             log:\n  level: warn\n  accesslog:\n    disabled: true\n\
             storage:\n  filesystem:\n    rootdirectory: {root}\n  delete:\n    enabled: true\n\
             http:\n  addr: 127.0.0.1:{port}\n  secret: strata-test-registry-secret\n\
             health:\n  storagedriver:\n    enabled: false\n",
            root = q(self.storage()),
            port = self.port,
        );
        if self.auth.is_some() {
            cfg.push_str(&format!(
                "auth:\n  htpasswd:\n    realm: strata-test\n    path: {}\n",
                q(self.htpasswd_path())
            ));
        }
        std::fs::write(self.config_path(), cfg).expect("write registry config");
    }

    fn spawn(&mut self) {
        assert!(self.child.is_none(), "registry already running");
        let log = std::fs::OpenOptions::new().create(true).append(true).open(self.log_path()).expect("registry log");
        let child = Command::new(REGISTRY_BIN)
            .arg("serve")
            .arg(self.config_path())
            .current_dir(self.dir.path())
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("spawn docker-registry");
        self.child = Some(child);
    }

    /// Poll `GET /v2/` until it answers 200 (with the credentials, if any).
    fn wait_ready(&mut self) -> Result<(), String> {
        let start = Instant::now();
        loop {
            let last = match self.probe() {
                Ok(200) => return Ok(()),
                Ok(code) => format!("GET /v2/ answered {code}"),
                Err(e) => e,
            };
            if let Some(st) = self.child.as_mut().expect("registry running").try_wait().expect("try_wait") {
                self.child = None;
                return Err(format!("docker-registry exited with {st}"));
            }
            if start.elapsed() > READY_TIMEOUT {
                return Err(format!("not ready after {READY_TIMEOUT:?} ({last})"));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Status code of an HTTP/1.0 `GET /v2/`.
    fn probe(&self) -> Result<u16, String> {
        let addr: SocketAddr = self.addr().parse().unwrap();
        let mut s = TcpStream::connect_timeout(&addr, Duration::from_millis(500)).map_err(|e| e.to_string())?;
        s.set_read_timeout(Some(Duration::from_secs(2))).map_err(|e| e.to_string())?;
        s.set_write_timeout(Some(Duration::from_secs(2))).map_err(|e| e.to_string())?;
        let mut req = format!("GET /v2/ HTTP/1.0\r\nHost: {}\r\n", self.addr());
        if let Some((user, password)) = &self.auth {
            req.push_str(&format!("Authorization: Basic {}\r\n", base64(format!("{user}:{password}").as_bytes())));
        }
        req.push_str("\r\n");
        s.write_all(req.as_bytes()).map_err(|e| e.to_string())?;
        let mut resp = Vec::new();
        s.read_to_end(&mut resp).map_err(|e| e.to_string())?;
        let resp = String::from_utf8_lossy(&resp);
        let status = resp.lines().next().unwrap_or_default();
        status.split(' ').nth(1).and_then(|c| c.parse().ok()).ok_or_else(|| format!("bad HTTP status line {status:?}"))
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        self.stop()
    }
}

/// A port that was free on 127.0.0.1 a moment ago.
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0").local_addr().unwrap().port()
}

/// Standard base64 with padding (for the Authorization header).
fn base64(input: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for chunk in input.chunks(3) {
        let b = [chunk[0], chunk.get(1).copied().unwrap_or(0), chunk.get(2).copied().unwrap_or(0)];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ALPHABET[(n >> (18 - 6 * i)) as usize & 63] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}
