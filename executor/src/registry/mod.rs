//! A client for the OCI distribution API (the registry protocol of Docker
//! Hub, distribution, Harbor, Zot, ECR, GHCR): manifests and blobs in and out,
//! with anonymous, basic and bearer-token authentication.
//!
//! Owns: the HTTP exchanges, authentication challenges, and digest checks of
//! everything it downloads (a registry is not trusted to serve what it was
//! asked for). Does not own: what the blobs mean (`distribution`) or where
//! they are kept (`store`).
//!
//! Why not `oci-client` (issue 18.4, read at v0.17.0, 2026-05): it cannot
//! keep what this client does. Its token scope is the target repository
//! only and it never answers a 401 again, so a cross-repository mount gets
//! 401 from Docker Hub and distribution (its issue #235), and a 202 to a
//! mount is an error to it rather than an upload into that session; a
//! streamed push is 4 MiB chunked PATCHes only (no monolithic PUT from a
//! file; ECR answers those with 201 and drops later chunks), or the whole
//! blob in memory; manifests, tokens and error bodies are read without a
//! size cap and blobs without a size check (a hostile registry streams
//! until the hash fails at the end); failed token requests fall back to
//! anonymous silently; there is no progress hook and no write timeout. It
//! is async-only over reqwest with aws-lc. Worth another look if a release
//! brings multi-scope tokens for mounts, a 401 re-challenge, monolithic
//! streamed pushes and body limits. The documents are oci-spec types all
//! the same (`distribution::fetch_documents`).
#![forbid(unsafe_code)]

pub mod reference;

use std::io::{self, Read, Write};
use std::path::Path;
use std::sync::Mutex;
use std::time::Duration;

use base64::Engine as _;
use sha2::{Digest as _, Sha256};

use crate::error::ErrorKind;
use crate::oci::Digest;
pub use reference::{Reference, ReferenceError};

/// Largest manifest or index accepted (containerd's limit is 4 MiB).
pub const MAX_MANIFEST: u64 = 4 << 20;
/// Media types a manifest GET accepts. distribution answers 404 to a request
/// for an OCI manifest whose Accept header does not name OCI types.
pub const MANIFEST_ACCEPT: &str = "application/vnd.oci.image.manifest.v1+json, \
     application/vnd.oci.image.index.v1+json, \
     application/vnd.docker.distribution.manifest.v2+json, \
     application/vnd.docker.distribution.manifest.list.v2+json";

/// Credentials for basic auth, or for the token endpoint of bearer auth.
#[derive(Clone, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
pub struct Credentials {
    pub username: String,
    pub password: String,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Credentials({}, <redacted>)", self.username)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    #[error("registry {registry} is unreachable")]
    Unreachable {
        registry: String,
        #[source]
        source: Box<ureq::Transport>,
    },
    #[error("registry {registry} refused the credentials{}", if *.anonymous { " (none were given)" } else { "" })]
    Unauthorized { registry: String, anonymous: bool },
    #[error("registry {registry} has no {what}")]
    NotFound { registry: String, what: String },
    #[error("registry {registry} answered {status} to {method} {path}: {message}")]
    Status { registry: String, method: &'static str, path: String, status: u16, message: String },
    #[error("registry {registry} served {what} that does not match its digest {expected} (got {actual})")]
    Digest { registry: String, what: String, expected: String, actual: String },
    #[error("registry {registry} served {what} of {actual} bytes, expected {expected}")]
    Size { registry: String, what: String, expected: u64, actual: u64 },
    #[error("registry {registry}: {what} is over the {limit}-byte limit")]
    TooLarge { registry: String, what: String, limit: u64 },
    #[error("registry {registry}: {what}")]
    Protocol { registry: String, what: String },
    #[error("{step} {what} from registry {registry}")]
    Io {
        registry: String,
        step: &'static str,
        what: String,
        #[source]
        source: io::Error,
    },
}

impl crate::error::Classify for RegistryError {
    fn kind(&self) -> ErrorKind {
        match self {
            RegistryError::NotFound { .. } => ErrorKind::NotFound,
            RegistryError::Io { source, .. } => match ErrorKind::of_host_failure(source) {
                ErrorKind::NoSpace => ErrorKind::NoSpace,
                _ => ErrorKind::Upstream,
            },
            _ => ErrorKind::Upstream,
        }
    }
}

/// A request body that can be sent again (after an auth challenge).
enum Body<'a> {
    Empty,
    Bytes(&'a [u8]),
    File(&'a Path, u64),
}

/// What happened to a blob on push.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pushed {
    /// The registry had it in this repository already.
    Present,
    /// Mounted from another repository of the same registry.
    Mounted,
    /// Uploaded.
    Uploaded,
}

/// One registry, one set of credentials. Tokens are cached per client.
pub struct Client {
    agent: ureq::Agent,
    base: String,
    registry: String,
    credentials: Option<Credentials>,
    authorization: Mutex<Option<String>>,
}

impl Client {
    /// A client for `registry` (host[:port]); `insecure` speaks plain HTTP.
    pub fn new(registry: &str, insecure: bool, credentials: Option<Credentials>) -> Client {
        let agent = ureq::AgentBuilder::new()
            .timeout_connect(Duration::from_secs(15))
            .timeout_read(Duration::from_secs(120))
            .timeout_write(Duration::from_secs(120))
            .redirects(5)
            .user_agent(concat!("strata/", env!("CARGO_PKG_VERSION")))
            .build();
        let host = if registry == reference::DOCKER_HUB { "registry-1.docker.io" } else { registry };
        let scheme = if insecure { "http" } else { "https" };
        Client {
            agent,
            base: format!("{scheme}://{host}"),
            registry: registry.to_string(),
            credentials,
            authorization: Mutex::new(None),
        }
    }

    pub fn registry(&self) -> &str {
        &self.registry
    }

    fn url(&self, path: &str) -> String {
        if path.starts_with("http://") || path.starts_with("https://") {
            path.to_string()
        } else {
            format!("{}{path}", self.base)
        }
    }

    fn unreachable(&self, t: ureq::Transport) -> RegistryError {
        RegistryError::Unreachable { registry: self.registry.clone(), source: Box::new(t) }
    }

    /// One request, answering at most one authentication challenge.
    /// Statuses outside `ok` become errors carrying the registry's message.
    fn send(
        &self,
        method: &'static str,
        path: &str,
        headers: &[(&str, &str)],
        body: Body<'_>,
        ok: &[u16],
    ) -> Result<ureq::Response, RegistryError> {
        let url = self.url(path);
        let mut challenged = false;
        loop {
            let mut req = self.agent.request(method, &url);
            for (k, v) in headers {
                req = req.set(k, v);
            }
            let auth = self.authorization.lock().unwrap_or_else(|p| p.into_inner()).clone();
            if let Some(a) = &auth {
                req = req.set("Authorization", a);
            }
            let result = match &body {
                Body::Empty => req.call(),
                Body::Bytes(b) => req.send_bytes(b),
                Body::File(p, size) => {
                    let f = std::fs::File::open(p).map_err(|source| RegistryError::Io {
                        registry: self.registry.clone(),
                        step: "open",
                        what: p.display().to_string(),
                        source,
                    })?;
                    req.set("Content-Length", &size.to_string()).send(io::BufReader::with_capacity(1 << 20, f))
                }
            };
            let (status, resp) = match result {
                Ok(r) => (r.status(), r),
                Err(ureq::Error::Status(code, r)) => (code, r),
                Err(ureq::Error::Transport(t)) => return Err(self.unreachable(t)),
            };
            if status == 401 && !challenged {
                challenged = true;
                let challenge = resp.header("WWW-Authenticate").unwrap_or_default().to_string();
                self.authenticate(&challenge)?;
                continue;
            }
            if status == 401 || (status == 403 && self.credentials.is_some()) {
                return Err(RegistryError::Unauthorized {
                    registry: self.registry.clone(),
                    anonymous: self.credentials.is_none(),
                });
            }
            if ok.contains(&status) {
                return Ok(resp);
            }
            let message = error_message(resp);
            return Err(RegistryError::Status {
                registry: self.registry.clone(),
                method,
                path: path.split('?').next().unwrap_or_default().to_string(),
                status,
                message,
            });
        }
    }

    /// Answer a `WWW-Authenticate` challenge: basic sends the credentials,
    /// bearer fetches a token from the realm (with the credentials if any).
    fn authenticate(&self, challenge: &str) -> Result<(), RegistryError> {
        let unauthorized =
            || RegistryError::Unauthorized { registry: self.registry.clone(), anonymous: self.credentials.is_none() };
        let (scheme, params) = parse_challenge(challenge);
        let header = match scheme.to_ascii_lowercase().as_str() {
            "basic" => {
                let c = self.credentials.as_ref().ok_or_else(unauthorized)?;
                format!("Basic {}", basic(c))
            }
            "bearer" => format!("Bearer {}", self.token(&params)?),
            _ => return Err(unauthorized()),
        };
        *self.authorization.lock().unwrap_or_else(|p| p.into_inner()) = Some(header);
        Ok(())
    }

    fn token(&self, params: &[(String, String)]) -> Result<String, RegistryError> {
        let get = |k: &str| params.iter().find(|(n, _)| n.eq_ignore_ascii_case(k)).map(|(_, v)| v.as_str());
        let realm = get("realm").ok_or_else(|| RegistryError::Protocol {
            registry: self.registry.clone(),
            what: "bearer challenge without a realm".into(),
        })?;
        let mut req = self.agent.get(realm);
        for key in ["service", "scope"] {
            if let Some(v) = get(key) {
                req = req.query(key, v);
            }
        }
        if let Some(c) = &self.credentials {
            req = req.set("Authorization", &format!("Basic {}", basic(c)));
        }
        let resp = match req.call() {
            Ok(r) => r,
            Err(ureq::Error::Status(401 | 403, _)) => {
                return Err(RegistryError::Unauthorized {
                    registry: self.registry.clone(),
                    anonymous: self.credentials.is_none(),
                })
            }
            Err(ureq::Error::Status(status, r)) => {
                return Err(RegistryError::Status {
                    registry: self.registry.clone(),
                    method: "GET",
                    path: realm.to_string(),
                    status,
                    message: error_message(r),
                })
            }
            Err(ureq::Error::Transport(t)) => return Err(self.unreachable(t)),
        };
        #[derive(serde::Deserialize)]
        struct Token {
            token: Option<String>,
            access_token: Option<String>,
        }
        let t: Token = serde_json::from_reader(resp.into_reader().take(1 << 20)).map_err(|e| {
            RegistryError::Protocol { registry: self.registry.clone(), what: format!("token response: {e}") }
        })?;
        t.token.or(t.access_token).filter(|t| !t.is_empty()).ok_or_else(|| RegistryError::Protocol {
            registry: self.registry.clone(),
            what: "token response without a token".into(),
        })
    }

    /// Fetch a manifest or index; returns its media type, bytes and digest.
    /// A reference by digest is checked against it.
    pub fn get_manifest(&self, repo: &str, reference: &str) -> Result<(String, Vec<u8>, Digest), RegistryError> {
        let path = format!("/v2/{repo}/manifests/{reference}");
        let resp =
            self.send("GET", &path, &[("Accept", MANIFEST_ACCEPT)], Body::Empty, &[200]).map_err(|e| match e {
                RegistryError::Status { status: 404, .. } => RegistryError::NotFound {
                    registry: self.registry.clone(),
                    what: format!("manifest {repo}:{reference}"),
                },
                e => e,
            })?;
        let media_type = resp.content_type().to_string();
        let what = format!("manifest {repo}:{reference}");
        let mut bytes = Vec::new();
        resp.into_reader().take(MAX_MANIFEST + 1).read_to_end(&mut bytes).map_err(|source| RegistryError::Io {
            registry: self.registry.clone(),
            step: "read",
            what: what.clone(),
            source,
        })?;
        if bytes.len() as u64 > MAX_MANIFEST {
            return Err(RegistryError::TooLarge { registry: self.registry.clone(), what, limit: MAX_MANIFEST });
        }
        let digest = Digest::sha256(&bytes);
        if let Ok(expected) = reference.parse::<Digest>() {
            if expected != digest {
                return Err(RegistryError::Digest {
                    registry: self.registry.clone(),
                    what,
                    expected: expected.to_string(),
                    actual: digest.to_string(),
                });
            }
        }
        Ok((media_type, bytes, digest))
    }

    /// Delete the manifest tagged `tag`, by its digest as the distribution
    /// API asks; false if there was none. The blobs it lists stay: other
    /// manifests may list them, and the registry's own garbage collection
    /// frees what none lists. A registry that does not allow deletes
    /// answers 405 (an error).
    pub fn delete_manifest(&self, repo: &str, tag: &str) -> Result<bool, RegistryError> {
        let digest = match self.get_manifest(repo, tag) {
            Ok((_, _, digest)) => digest,
            Err(RegistryError::NotFound { .. }) => return Ok(false),
            Err(e) => return Err(e),
        };
        match self.send("DELETE", &format!("/v2/{repo}/manifests/{digest}"), &[], Body::Empty, &[202]) {
            Ok(_) => Ok(true),
            Err(RegistryError::Status { status: 404, .. }) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Download a blob into `out`, checking its size and digest. Returns
    /// the bytes written; on a mismatch `out` holds garbage the caller drops.
    pub fn get_blob(
        &self,
        repo: &str,
        digest: &Digest,
        size: u64,
        out: &mut dyn Write,
        progress: &mut dyn FnMut(u64),
    ) -> Result<u64, RegistryError> {
        let path = format!("/v2/{repo}/blobs/{digest}");
        let what = format!("blob {digest}");
        let resp = self.send("GET", &path, &[], Body::Empty, &[200]).map_err(|e| match e {
            RegistryError::Status { status: 404, .. } => {
                RegistryError::NotFound { registry: self.registry.clone(), what: format!("blob {digest} in {repo}") }
            }
            e => e,
        })?;
        let io_err =
            |step, source| RegistryError::Io { registry: self.registry.clone(), step, what: what.clone(), source };
        let mut reader = resp.into_reader().take(size + 1);
        let mut hasher = Sha256::new();
        let mut buf = vec![0u8; 1 << 20];
        let mut total = 0u64;
        loop {
            let n = match reader.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(io_err("download", e)),
            };
            total += n as u64;
            if total > size {
                return Err(RegistryError::Size {
                    registry: self.registry.clone(),
                    what,
                    expected: size,
                    actual: total,
                });
            }
            hasher.update(&buf[..n]);
            out.write_all(&buf[..n]).map_err(|e| io_err("write", e))?;
            progress(n as u64);
        }
        if total != size {
            return Err(RegistryError::Size { registry: self.registry.clone(), what, expected: size, actual: total });
        }
        let actual = Digest::from_hasher(hasher);
        if &actual != digest {
            return Err(RegistryError::Digest {
                registry: self.registry.clone(),
                what,
                expected: digest.to_string(),
                actual: actual.to_string(),
            });
        }
        Ok(total)
    }

    /// Whether the repository has the blob (HEAD).
    pub fn has_blob(&self, repo: &str, digest: &Digest) -> Result<bool, RegistryError> {
        let resp = self.send("HEAD", &format!("/v2/{repo}/blobs/{digest}"), &[], Body::Empty, &[200, 404])?;
        Ok(resp.status() == 200)
    }

    /// Push the blob at `path` unless the repository has it: HEAD first,
    /// then a cross-repository mount from `mount_from` (a repository of the
    /// same registry that has it), then a monolithic upload.
    pub fn push_blob(
        &self,
        repo: &str,
        digest: &Digest,
        path: &Path,
        size: u64,
        mount_from: Option<&str>,
    ) -> Result<Pushed, RegistryError> {
        if self.has_blob(repo, digest)? {
            return Ok(Pushed::Present);
        }
        let start = match mount_from.filter(|from| *from != repo) {
            Some(from) => format!("/v2/{repo}/blobs/uploads/?mount={digest}&from={from}"),
            None => format!("/v2/{repo}/blobs/uploads/"),
        };
        let resp = self.send("POST", &start, &[("Content-Length", "0")], Body::Empty, &[201, 202])?;
        if resp.status() == 201 {
            return Ok(Pushed::Mounted);
        }
        let location = self.location(&resp)?;
        let sep = if location.contains('?') { '&' } else { '?' };
        let put = format!("{location}{sep}digest={digest}");
        self.send("PUT", &put, &[("Content-Type", "application/octet-stream")], Body::File(path, size), &[201])?;
        Ok(Pushed::Uploaded)
    }

    /// Push small bytes (a config) as a blob.
    pub fn push_bytes(&self, repo: &str, digest: &Digest, bytes: &[u8]) -> Result<Pushed, RegistryError> {
        if self.has_blob(repo, digest)? {
            return Ok(Pushed::Present);
        }
        let resp =
            self.send("POST", &format!("/v2/{repo}/blobs/uploads/"), &[("Content-Length", "0")], Body::Empty, &[202])?;
        let location = self.location(&resp)?;
        let sep = if location.contains('?') { '&' } else { '?' };
        let put = format!("{location}{sep}digest={digest}");
        self.send("PUT", &put, &[("Content-Type", "application/octet-stream")], Body::Bytes(bytes), &[201])?;
        Ok(Pushed::Uploaded)
    }

    /// Put a manifest under `tag`.
    pub fn put_manifest(&self, repo: &str, tag: &str, media_type: &str, bytes: &[u8]) -> Result<(), RegistryError> {
        self.send(
            "PUT",
            &format!("/v2/{repo}/manifests/{tag}"),
            &[("Content-Type", media_type)],
            Body::Bytes(bytes),
            &[200, 201],
        )?;
        Ok(())
    }

    fn location(&self, resp: &ureq::Response) -> Result<String, RegistryError> {
        resp.header("Location").map(str::to_string).ok_or_else(|| RegistryError::Protocol {
            registry: self.registry.clone(),
            what: "upload session without a Location".into(),
        })
    }
}

fn basic(c: &Credentials) -> String {
    base64::engine::general_purpose::STANDARD.encode(format!("{}:{}", c.username, c.password))
}

/// The first error message of a registry's error body
/// (`{"errors":[{"code":..,"message":..}]}`), else the body's start.
fn error_message(resp: ureq::Response) -> String {
    let mut body = String::new();
    let _ = resp.into_reader().take(64 << 10).read_to_string(&mut body);
    #[derive(serde::Deserialize)]
    struct Errors {
        errors: Vec<Entry>,
    }
    #[derive(serde::Deserialize)]
    struct Entry {
        code: Option<String>,
        message: Option<String>,
    }
    match serde_json::from_str::<Errors>(&body) {
        Ok(e) if !e.errors.is_empty() => e
            .errors
            .iter()
            .map(|x| {
                format!("{} {}", x.code.as_deref().unwrap_or(""), x.message.as_deref().unwrap_or("")).trim().to_string()
            })
            .collect::<Vec<_>>()
            .join("; "),
        _ => body.chars().take(200).collect::<String>().trim().to_string(),
    }
}

/// Split `Bearer realm="...",service="...",scope="..."` into its scheme and
/// parameters (values may be quoted; quoted values may contain commas).
pub fn parse_challenge(header: &str) -> (String, Vec<(String, String)>) {
    let header = header.trim();
    let (scheme, rest) = header.split_once(' ').unwrap_or((header, ""));
    let mut params = Vec::new();
    let mut chars = rest.chars().peekable();
    loop {
        while chars.peek().is_some_and(|c| *c == ',' || c.is_whitespace()) {
            chars.next();
        }
        let key: String = chars.by_ref().take_while(|c| *c != '=').collect::<String>().trim().to_string();
        if key.is_empty() {
            break;
        }
        let mut value = String::new();
        if chars.peek() == Some(&'"') {
            chars.next();
            while let Some(c) = chars.next() {
                match c {
                    '\\' => value.extend(chars.next()),
                    '"' => break,
                    c => value.push(c),
                }
            }
        } else {
            while let Some(c) = chars.peek().copied() {
                if c == ',' {
                    break;
                }
                value.push(c);
                chars.next();
            }
        }
        params.push((key, value.trim().to_string()));
    }
    (scheme.to_string(), params)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{BufRead, BufReader};
    use std::net::TcpListener;

    #[test]
    fn parses_bearer_and_basic_challenges() {
        let (s, p) = parse_challenge(
            r#"Bearer realm="https://auth.example/token",service="registry.example",scope="repository:a/b:pull,push""#,
        );
        assert_eq!(s, "Bearer");
        assert_eq!(
            p,
            vec![
                ("realm".into(), "https://auth.example/token".into()),
                ("service".into(), "registry.example".into()),
                ("scope".into(), "repository:a/b:pull,push".into()),
            ]
        );
        let (s, p) = parse_challenge(r#"Basic realm="x""#);
        assert_eq!((s.as_str(), p.len()), ("Basic", 1));
        assert_eq!(parse_challenge("").1, vec![]);
    }

    /// A one-thread HTTP server answering each request with `respond`.
    fn serve(mut respond: impl FnMut(&str, &[String]) -> String + Send + 'static, requests: usize) -> String {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        std::thread::spawn(move || {
            for stream in listener.incoming().take(requests) {
                let mut stream = stream.unwrap();
                let mut reader = BufReader::new(stream.try_clone().unwrap());
                let mut line = String::new();
                reader.read_line(&mut line).unwrap();
                let mut headers = Vec::new();
                loop {
                    let mut h = String::new();
                    reader.read_line(&mut h).unwrap();
                    if h.trim().is_empty() {
                        break;
                    }
                    headers.push(h.trim().to_string());
                }
                let reply = respond(line.trim(), &headers);
                stream.write_all(reply.as_bytes()).unwrap();
            }
        });
        addr
    }

    fn reply(status: &str, headers: &[String], body: &str) -> String {
        format!(
            "HTTP/1.1 {status}\r\nContent-Length: {}\r\nConnection: close\r\n{}\r\n{body}",
            body.len(),
            headers.iter().map(|h| format!("{h}\r\n")).collect::<String>()
        )
    }

    #[test]
    fn bearer_auth_fetches_a_token_with_the_credentials_and_retries() {
        let manifest = r#"{"schemaVersion":2}"#;
        let digest = Digest::sha256(manifest.as_bytes());
        let addr = std::sync::Arc::new(Mutex::new(String::new()));
        let a2 = addr.clone();
        let user = basic(&Credentials { username: "u".into(), password: "p".into() });
        let real = serve(
            move |line, headers| {
                let auth = headers.iter().find_map(|h| h.strip_prefix("Authorization: ")).unwrap_or("");
                if line.starts_with("GET /token?service=reg&scope=repository%3Aa%3Apull") {
                    assert_eq!(auth, format!("Basic {user}"));
                    return reply("200 OK", &[], r#"{"token":"t0k"}"#);
                }
                if auth == "Bearer t0k" {
                    return reply(
                        "200 OK",
                        &["Content-Type: application/vnd.oci.image.manifest.v1+json".into()],
                        manifest,
                    );
                }
                let realm = format!("http://{}/token", a2.lock().unwrap());
                reply(
                    "401 Unauthorized",
                    &[format!(r#"WWW-Authenticate: Bearer realm="{realm}",service="reg",scope="repository:a:pull""#)],
                    "",
                )
            },
            3,
        );
        *addr.lock().unwrap() = real.clone();
        let c = Client::new(&real, true, Some(Credentials { username: "u".into(), password: "p".into() }));
        let (mt, bytes, d) = c.get_manifest("a", &digest.to_string()).unwrap();
        assert_eq!(mt, "application/vnd.oci.image.manifest.v1+json");
        assert_eq!(bytes, manifest.as_bytes());
        assert_eq!(d, digest);
    }

    #[test]
    fn a_blob_with_the_wrong_digest_is_refused() {
        let addr = serve(|_, _| reply("200 OK", &[], "not what was asked"), 1);
        let c = Client::new(&addr, true, None);
        let want = Digest::sha256(b"something else!!!!");
        let mut out = Vec::new();
        let e = c.get_blob("a", &want, 18, &mut out, &mut |_| {}).unwrap_err();
        assert!(matches!(e, RegistryError::Digest { .. }), "{e}");
        assert!(e.to_string().contains(want.as_str()) && e.to_string().contains(&addr), "{e}");
    }

    #[test]
    fn refused_credentials_are_an_auth_error_not_a_retry_loop() {
        let addr = serve(|_, _| reply("401 Unauthorized", &[r#"WWW-Authenticate: Basic realm="r""#.into()], ""), 2);
        let c = Client::new(&addr, true, Some(Credentials { username: "u".into(), password: "bad".into() }));
        let e = c.has_blob("a", &Digest::sha256(b"x")).unwrap_err();
        assert!(matches!(e, RegistryError::Unauthorized { anonymous: false, .. }), "{e}");
    }
}
