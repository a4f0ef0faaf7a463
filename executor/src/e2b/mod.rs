//! An E2B-compatible listener (`strata daemon --e2b-listen ADDR`): the
//! control API E2B's SDK calls, and the API of E2B's in-sandbox agent
//! (envd: `process.Process` and `filesystem.Filesystem` over the Connect
//! protocol, `/files`, `/health`) for every sandbox, on one TCP listener.
//! envd requests name their sandbox by the `E2b-Sandbox-Id` header (the
//! SDK sends it when `E2B_SANDBOX_URL` points here) or by a `Host` of
//! `49983-<id>.<domain>`; they must carry that sandbox's
//! `X-Access-Token`. Any other `<port>-<id>.<domain>` is that port of the
//! sandbox, relayed (`proxy`). Control requests carry an API key (`X-API-KEY`, one
//! of `--e2b-api-keys`); a key sees only what it made.
//!
//! This module sits beside `api`: it turns E2B's requests into the
//! daemon's operations and never touches a sandbox's files or processes
//! but through them (`fs` resolves every path as `strata cp` does).

pub mod clients;
mod connect;
mod control;
pub mod fs;
mod listing;
mod network;
mod process;
mod proxy;
mod transfer;
pub mod users;
mod watch;

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::TcpListener;

pub use clients::ClientLimits;
use clients::Clients;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Limited};
use hyper::body::{Frame, Incoming, SizeHint};
use hyper::service::service_fn;
use hyper::{Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use tokio::sync::{mpsc, watch as tokio_watch};

use self::connect::{field, Code, RpcError};
// `%XX` and `+` decoded, as the Unix-socket API decodes its queries.
use self::process::Procs;
pub use crate::api::http::percent_decode;
use crate::daemon::{lock, Daemon};

/// The port envd listens on in an E2B sandbox (part of its host names).
pub const ENVD_PORT: u16 = 49983;
/// How often a `WatchDir` stream looks for events.
const WATCH_POLL: Duration = Duration::from_millis(50);
/// Quiet time after which a `WatchDir` stream sends a keepalive.
const WATCH_KEEPALIVE: Duration = Duration::from_secs(5);
/// How often state of sandboxes that went is looked for.
const PRUNE_EVERY: Duration = Duration::from_secs(10);
/// How long a request head may take (and a kept-alive connection idle).
const HEADER_TIMEOUT: Duration = Duration::from_secs(30);
/// Connections the listener keeps open at once.
pub const MAX_CONNECTIONS: usize = 1024;
/// `/files` transfers served at once (more wait); each holds about a
/// megabyte (transfer.rs).
pub const MAX_TRANSFERS: usize = 32;

#[derive(Debug, Clone)]
pub struct E2bConfig {
    /// The API keys clients may use.
    pub keys: Vec<String>,
    /// For `Host: 49983-<id>.<domain>` routing, and the `domain` a create
    /// answers.
    pub domain: Option<String>,
    /// What one client (source address) may hold at once.
    pub clients: ClientLimits,
    /// The disk cap of the sandboxes E2B clients start (`--e2b-disk`;
    /// E2B's templates carry a disk size, here one holds for all).
    pub disk: Option<u64>,
    /// The operator's policy of which `envVars` are secret
    /// (`--e2b-secret-env`): names, or prefixes ending in `*`. Those are
    /// the sandbox's `secret_env`, never stored with its E2B row.
    pub secret_env: Vec<String>,
}

/// Whether `name` is secret by `policy` (names, or `PREFIX*`).
pub fn is_secret(policy: &[String], name: &str) -> bool {
    policy.iter().any(|p| match p.strip_suffix('*') {
        Some(prefix) => name.starts_with(prefix),
        None => p == name,
    })
}

/// Read `--e2b-api-keys`: one key per line; blank lines and `#` comments
/// skipped.
pub fn read_keys(path: &std::path::Path) -> std::io::Result<Vec<String>> {
    let text = std::fs::read_to_string(path)?;
    let keys: Vec<String> =
        text.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')).map(String::from).collect();
    if keys.is_empty() {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, "no API key in the file"));
    }
    Ok(keys)
}

fn hash(key: &str) -> String {
    hex::encode(Sha256::digest(key.as_bytes()))
}

/// The listener's state.
pub struct E2b {
    d: Arc<Daemon>,
    /// sha256 hex of each API key.
    keys: Vec<String>,
    domain: Option<String>,
    /// [`E2bConfig::disk`].
    disk: Option<u64>,
    /// [`E2bConfig::secret_env`].
    secret_env: Vec<String>,
    /// E2B processes, by the Strata sandbox they run in.
    procs: Mutex<HashMap<String, Arc<Procs>>>,
    watchers: watch::Watchers,
    /// Per E2B sandbox: the lock its pause, connect and kill hold.
    lifecycle: Mutex<HashMap<String, Arc<Mutex<()>>>>,
    /// When processes and watchers of gone sandboxes were last dropped.
    pruned: Mutex<std::time::Instant>,
    /// File transfers in flight at once (each may hold its file in memory).
    transfers: Arc<tokio::sync::Semaphore>,
    /// Each client's connections and requests.
    clients: Arc<Clients>,
}

/// A request, read whole.
pub struct Req {
    pub method: String,
    pub path: String,
    query: Vec<(String, String)>,
    headers: hyper::HeaderMap,
    pub body: Bytes,
    /// A `/files` request's body, unread (`body` is empty then).
    transfer: Option<transfer::Transfer>,
}

impl Req {
    pub fn query(&self, key: &str) -> Option<String> {
        self.query.iter().find(|(k, _)| k == key).map(|(_, v)| v.clone())
    }
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
}

/// An `application/x-www-form-urlencoded` string's pairs (`+` is a space).
pub fn form_decode(s: &str) -> Vec<(String, String)> {
    s.split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (percent_decode(k), percent_decode(v))
        })
        .collect()
}

/// A response.
pub struct Resp {
    status: u16,
    content_type: &'static str,
    body: RespBody,
    headers: Vec<(&'static str, String)>,
}

enum RespBody {
    Whole(Bytes),
    Frames(mpsc::Receiver<Bytes>),
}

impl Resp {
    pub fn json(status: u16, v: Value) -> Resp {
        Resp::bytes(status, "application/json", v.to_string().into_bytes())
    }
    pub fn empty(status: u16) -> Resp {
        Resp::bytes(status, "", Vec::new())
    }
    fn bytes(status: u16, content_type: &'static str, b: Vec<u8>) -> Resp {
        Resp { status, content_type, body: RespBody::Whole(Bytes::from(b)), headers: Vec::new() }
    }
    fn frames(rx: mpsc::Receiver<Bytes>) -> Resp {
        Resp { status: 200, content_type: "application/connect+json", body: RespBody::Frames(rx), headers: Vec::new() }
    }
    /// E2B's control error body.
    fn error(status: u16, message: &str) -> Resp {
        Resp::json(status, json!({"code": status, "message": message}))
    }
    fn rpc_error(e: &RpcError) -> Resp {
        Resp::json(e.code.status(), e.to_json())
    }
}

impl From<control::ApiError> for Resp {
    fn from(e: control::ApiError) -> Resp {
        if e.status >= 500 {
            tracing::error!("e2b: {}", e.message);
        }
        Resp::error(e.status, &e.message)
    }
}

struct Body(RespBody);

impl hyper::body::Body for Body {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        match &mut self.0 {
            RespBody::Whole(b) if b.is_empty() => Poll::Ready(None),
            RespBody::Whole(b) => Poll::Ready(Some(Ok(Frame::data(std::mem::take(b))))),
            RespBody::Frames(rx) => rx.poll_recv(cx).map(|f| f.map(|b| Ok(Frame::data(b)))),
        }
    }

    fn is_end_stream(&self) -> bool {
        matches!(&self.0, RespBody::Whole(b) if b.is_empty())
    }

    fn size_hint(&self) -> SizeHint {
        match &self.0 {
            RespBody::Whole(b) => SizeHint::with_exact(b.len() as u64),
            RespBody::Frames(_) => SizeHint::default(),
        }
    }
}

/// Serve E2B's API on `listener` until `stop` turns true.
pub fn serve(
    d: Arc<Daemon>,
    listener: TcpListener,
    cfg: E2bConfig,
    mut stop: tokio_watch::Receiver<bool>,
) -> std::io::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .max_blocking_threads(256)
        .thread_name("e2b")
        .enable_all()
        .build()?;
    listener.set_nonblocking(true)?;
    let e2b = Arc::new(E2b {
        d,
        keys: cfg.keys.iter().map(|k| hash(k)).collect(),
        domain: cfg.domain,
        disk: cfg.disk,
        secret_env: cfg.secret_env,
        procs: Mutex::new(HashMap::new()),
        watchers: watch::Watchers::default(),
        lifecycle: Mutex::new(HashMap::new()),
        pruned: Mutex::new(std::time::Instant::now()),
        transfers: Arc::new(tokio::sync::Semaphore::new(MAX_TRANSFERS)),
        clients: Clients::new(cfg.clients),
    });
    let restoring = e2b.clone();
    std::thread::spawn(move || restoring.restore_processes());
    let result = rt.block_on(async move {
        let listener = tokio::net::TcpListener::from_std(listener)?;
        let connections = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
        loop {
            let (conn, peer) = tokio::select! {
                r = listener.accept() => match r {
                    Ok(c) => c,
                    Err(e) => {
                        tracing::warn!("e2b accept: {e}");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                },
                _ = stop.changed() => break,
            };
            // Past the cap a connection is closed at once (the SDK retries
            // connection failures).
            let Ok(open) = connections.clone().try_acquire_owned() else {
                tracing::warn!("e2b: {MAX_CONNECTIONS} connections open; closing a new one");
                continue;
            };
            // And past its own cap (clients.rs), so that one client cannot
            // hold them all.
            let Some(mine) = e2b.clients.connection(peer.ip()) else { continue };
            let _ = conn.set_nodelay(true);
            let e2b = e2b.clone();
            tokio::spawn(async move {
                let _open = (open, mine);
                let svc = service_fn(move |req| {
                    let e2b = e2b.clone();
                    async move { Ok::<_, Infallible>(e2b.answer(req, peer.ip()).await) }
                });
                // A head must be whole 30 s after the connection opens or
                // its last response (an idle kept-alive connection closes).
                let _ = hyper::server::conn::http1::Builder::new()
                    .timer(hyper_util::rt::TokioTimer::new())
                    .header_read_timeout(HEADER_TIMEOUT)
                    .keep_alive(true)
                    .serve_connection(TokioIo::new(conn), svc)
                    .with_upgrades()
                    .await;
            });
        }
        Ok(())
    });
    rt.shutdown_background();
    result
}

fn respond(r: Resp) -> Response<Body> {
    let mut out = Response::new(Body(r.body));
    *out.status_mut() = StatusCode::from_u16(r.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let h = out.headers_mut();
    if !r.content_type.is_empty() {
        h.insert(hyper::header::CONTENT_TYPE, hyper::header::HeaderValue::from_static(r.content_type));
    }
    for (k, v) in r.headers {
        if let Ok(v) = hyper::header::HeaderValue::from_str(&v) {
            h.insert(k, v);
        }
    }
    out
}

/// `given == secret`, in time that does not depend on where they differ.
fn same_secret(given: &str, secret: &str) -> bool {
    given.len() == secret.len() && given.bytes().zip(secret.bytes()).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
}

/// Which API a path belongs to.
fn is_envd(path: &str) -> bool {
    path.starts_with("/process.Process/")
        || path.starts_with("/filesystem.Filesystem/")
        || path == "/files"
        || path == "/health"
}

impl E2b {
    async fn answer(self: Arc<Self>, req: hyper::Request<Incoming>, client: std::net::IpAddr) -> Response<Body> {
        // Held until the answer's head (a stream's body goes on without).
        let Some(_request) = self.clients.request(client) else {
            return respond(Resp::error(
                429,
                &format!("too many requests in flight from {client}; wait for some to end"),
            ));
        };
        // A sandbox's own port (any but envd's): relayed whole, streaming.
        if let Some((port, id)) = self.host_target(req.headers()).filter(|(p, _)| *p != ENVD_PORT) {
            return self.forward(req, port, id).await;
        }
        let (parts, body) = req.into_parts();
        let mut req = Req {
            method: parts.method.to_string(),
            path: parts.uri.path().to_string(),
            query: form_decode(parts.uri.query().unwrap_or("")),
            headers: parts.headers,
            body: Bytes::new(),
            transfer: None,
        };
        // Who may ask is settled on the head: no body is read for a caller
        // without a key or token.
        let this = self.clone();
        let admitted = match tokio::task::block_in_place(|| this.admit(&req)) {
            Ok(a) => a,
            Err(r) => return respond(r),
        };
        // File transfers stream on a thread of their own (transfer.rs),
        // each with one of a few permits.
        if req.path == "/files" {
            let permit = self.transfers.clone().acquire_owned().await.ok();
            req.transfer = Some(transfer::Transfer::new(body, permit));
            let this = self.clone();
            return match tokio::task::spawn_blocking(move || this.route(&req, admitted)).await {
                Ok(r) => respond(r),
                Err(e) => respond(Resp::error(500, &format!("file transfer: {e}"))),
            };
        }
        let limit = connect::MAX_MESSAGE;
        req.body = match tokio::time::timeout(Duration::from_secs(300), Limited::new(body, limit).collect()).await {
            Err(_) => return respond(Resp::error(408, "request body not received within 300 s")),
            Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => {
                return respond(Resp::error(413, &format!("request body exceeds {limit} bytes")))
            }
            Ok(Err(e)) => return respond(Resp::error(400, &format!("read request body: {e}"))),
            Ok(Ok(b)) => b.to_bytes(),
        };
        let this = self.clone();
        respond(tokio::task::block_in_place(move || this.route(&req, admitted)))
    }

    /// Drop the process tables and watchers of sandboxes the daemon ended
    /// on its own (a deadline), at most every [`PRUNE_EVERY`].
    fn prune(&self) {
        {
            let mut last = lock(&self.pruned);
            if last.elapsed() < PRUNE_EVERY {
                return;
            }
            *last = std::time::Instant::now();
        }
        let live: std::collections::HashSet<String> = self.d.list_sandboxes().into_iter().map(|s| s.id).collect();
        lock(&self.procs).retain(|id, _| live.contains(id));
        for gone in self.watchers.sandboxes().difference(&live) {
            self.watchers.forget(gone);
        }
    }

    /// Check a request's credentials from its head: an API key for the
    /// control API; for envd, the named sandbox's token, and the sandbox
    /// running.
    fn admit(&self, req: &Req) -> Result<Admitted, Resp> {
        let by_host = self.host_sandbox(req);
        if !is_envd(&req.path) && by_host.is_none() {
            return match req.header("x-api-key").map(hash).filter(|h| self.keys.contains(h)) {
                Some(owner) => Ok(Admitted::Control(owner)),
                None => Err(Resp::error(401, "a valid X-API-KEY is required")),
            };
        }
        let rpc = req.path.contains('.');
        let fail = |e: RpcError| refuse(rpc, e);
        let Some(id) = req.header("e2b-sandbox-id").map(String::from).or(by_host) else {
            return Err(fail(RpcError::invalid(
                "no sandbox named (E2b-Sandbox-Id header, or Host 49983-<id>.<domain>)",
            )));
        };
        let row = match lock(&self.d.db).e2b_sandbox(&id) {
            Ok(Some(row)) => row,
            Ok(None) => return Err(fail(RpcError::new(Code::Unavailable, format!("sandbox {id} was not found")))),
            Err(e) => return Err(fail(RpcError::internal(crate::error::chain(&e)))),
        };
        // Compared in constant time: the token is the sandbox's key.
        if !same_secret(req.header("x-access-token").unwrap_or(""), &row.token) {
            let e = RpcError::new(Code::Unauthenticated, format!("sandbox {id}: a valid X-Access-Token is required"));
            return Err(fail(e));
        }
        match row.sandbox.as_deref().map(|s| self.d.sandbox(s)) {
            Some(Ok(sb)) if sb.is_alive() && sb.run_state() == crate::sandbox::RunState::Running => {
                Ok(Admitted::Envd { id, sb, rpc })
            }
            // Another host of the fleet runs it: say which.
            Some(Err(_)) => {
                let why = match self.d.sandbox_elsewhere(row.sandbox.as_deref().unwrap_or_default()) {
                    Ok(Some(host)) => format!("runs on host {host}"),
                    _ => "was not found (paused or ended)".to_string(),
                };
                Err(fail(RpcError::new(Code::Unavailable, format!("sandbox {id} {why}"))))
            }
            _ => Err(fail(RpcError::new(Code::Unavailable, format!("sandbox {id} was not found (paused or ended)")))),
        }
    }

    fn route(self: &Arc<Self>, req: &Req, admitted: Admitted) -> Resp {
        self.prune();
        let owner = match admitted {
            Admitted::Control(owner) => owner,
            Admitted::Envd { id, sb, rpc } => return self.envd(req, &id, &sb, &|e| refuse(rpc, e)),
        };
        let segs: Vec<String> = req.path.split('/').filter(|s| !s.is_empty()).map(percent_decode).collect();
        let segs: Vec<&str> = segs.iter().map(String::as_str).collect();
        let m = req.method.as_str();
        let (route, r) = match (m, segs.as_slice()) {
            ("POST", ["v2", "sandboxes"] | ["sandboxes"]) => ("POST /sandboxes", self.create(&owner, req)),
            ("GET", ["v2", "sandboxes"] | ["sandboxes"]) => ("GET /sandboxes", self.list(&owner, req)),
            ("GET", ["sandboxes", id]) => ("GET /sandboxes/{id}", self.get(&owner, id)),
            ("DELETE", ["sandboxes", id]) => ("DELETE /sandboxes/{id}", self.kill(&owner, id)),
            ("POST", ["sandboxes", id, "timeout"]) => {
                ("POST /sandboxes/{id}/timeout", self.set_timeout(&owner, id, req))
            }
            ("POST", ["sandboxes", id, "pause"]) => ("POST /sandboxes/{id}/pause", self.pause(&owner, id, req)),
            ("POST", ["sandboxes", id, "fork"]) => ("POST /sandboxes/{id}/fork", self.fork(&owner, id, req)),
            ("POST", ["v2", "sandboxes", id, "connect"] | ["sandboxes", id, "connect" | "resume"]) => {
                ("POST /sandboxes/{id}/connect", self.connect(&owner, id, req))
            }
            ("POST", ["sandboxes", id, "snapshots"]) => {
                ("POST /sandboxes/{id}/snapshots", self.snapshot(&owner, id, req))
            }
            ("PUT", ["sandboxes", id, "network"]) => {
                ("PUT /sandboxes/{id}/network", self.update_network(&owner, id, req))
            }
            ("GET", ["sandboxes", id, "metrics"]) => ("GET /sandboxes/{id}/metrics", self.metrics(&owner, id, req)),
            ("GET", ["snapshots"]) => ("GET /snapshots", self.snapshots(&owner, req)),
            ("DELETE", ["templates", id]) => ("DELETE /templates/{id}", self.delete_snapshot(&owner, id)),
            _ => {
                self.d.telemetry.e2b("unknown", 404);
                return Resp::error(404, &format!("no route {m} {} in Strata's E2B API", req.path));
            }
        };
        let resp = r.unwrap_or_else(Resp::from);
        self.d.telemetry.e2b(route, resp.status);
        resp
    }

    /// The sandbox a `Host: 49983-<id>.<domain>` names.
    fn host_sandbox(&self, req: &Req) -> Option<String> {
        self.host_target(&req.headers).filter(|(port, _)| *port == ENVD_PORT).map(|(_, id)| id)
    }

    /// The port and sandbox a `Host: <port>-<id>.<domain>` names.
    fn host_target(&self, headers: &hyper::HeaderMap) -> Option<(u16, String)> {
        let domain = self.domain.as_deref()?;
        let host = headers.get(hyper::header::HOST)?.to_str().ok()?.split(':').next()?;
        let sub = host.strip_suffix(domain)?.strip_suffix('.')?;
        let (port, id) = sub.split_once('-')?;
        let port = port.parse::<u16>().ok().filter(|p| *p > 0)?;
        (!id.is_empty() && !id.contains('.')).then(|| (port, id.to_string()))
    }

    /// Take back the commands a daemon before this one left running
    /// (`Procs::restore`), in every sandbox the catalog has any for.
    fn restore_processes(&self) {
        let sandboxes = match lock(&self.d.db).e2b_process_sandboxes() {
            Ok(s) => s,
            Err(e) => return tracing::warn!("read the E2B process table: {}", crate::error::chain(&e)),
        };
        for id in sandboxes {
            // Not an `InUse`: taking its commands back is not a use.
            if let Some(sb) = self.d.live_sandbox(&id) {
                self.processes(&sb);
            }
        }
    }

    /// The sandbox's process table; the first call after a daemon restart
    /// takes back the commands the catalog records ([`Procs::restore`]).
    fn processes(&self, sb: &Arc<crate::sandbox::Sandbox>) -> Arc<Procs> {
        let procs = lock(&self.procs).entry(sb.id.to_string()).or_default().clone();
        procs.restore(&self.d, sb);
        procs
    }

    /// Forget the processes (and watchers) of a Strata sandbox that goes.
    fn forget_processes(&self, sandbox: &str) {
        lock(&self.procs).remove(sandbox);
        self.watchers.forget(sandbox);
    }

    /// An envd request to a running sandbox, its token checked.
    fn envd(
        self: &Arc<Self>,
        req: &Req,
        id: &str,
        sb: &Arc<crate::sandbox::Sandbox>,
        fail: &dyn Fn(RpcError) -> Resp,
    ) -> Resp {
        if req.path == "/health" {
            return Resp::empty(204);
        }
        let rpc = if req.path == "/files" {
            None
        } else {
            let Some((service, method)) = req.path.trim_start_matches('/').split_once('/') else {
                return fail(RpcError::new(Code::Unimplemented, format!("no method {}", req.path)));
            };
            if req.method != "POST" {
                return Resp::error(405, "Connect calls are POSTs");
            }
            let streaming = req.header("content-type").is_some_and(|c| c.starts_with("application/connect+json"));
            let msgs =
                if streaming { connect::messages(&req.body) } else { connect::parse(&req.body).map(|m| vec![m]) };
            match msgs {
                Ok(msgs) => Some((service, method, streaming, msgs)),
                Err(e) => return Resp::rpc_error(&e),
            }
        };
        // Calls on a running command need neither the sandbox's tree nor
        // its users.
        if let Some((service @ "process.Process", method, streaming, msgs)) = &rpc {
            if *method != "Start" {
                return answer_rpc(self.process_call(sb, service, method, msgs), *streaming);
            }
        }
        let tree = match fs::Tree::open(sb.shim_pid, sb.spec.userns) {
            Ok(t) => t,
            Err(e) => return fail(e),
        };
        // The root was opened through the shim's pid: that pid must still
        // be the shim's (its pidfd says so), and the sandbox running.
        if !sb.is_alive() || sb.run_state() != crate::sandbox::RunState::Running {
            return fail(RpcError::new(Code::Unavailable, format!("sandbox {id} was not found (not running)")));
        }
        // The user: `Authorization: Basic base64(user:)`, `?username=`,
        // else the default (`Accounts::default_user`).
        let name = req
            .header("authorization")
            .and_then(|a| a.strip_prefix("Basic "))
            .and_then(|b| field::bytes(&json!({"a": b}), "a").ok())
            .map(|b| String::from_utf8_lossy(&b).split(':').next().unwrap_or("").to_string())
            .or_else(|| req.query("username"))
            .filter(|n| !n.is_empty());
        let d = &sb.defaults;
        let user = match name {
            None => tree.accounts.default_user(d.image_user.then_some((d.uid, d.gid))),
            Some(name) => match tree.accounts.user(&name) {
                Some(u) => u,
                None => return fail(RpcError::invalid(format!("user {name:?} is not in the sandbox's /etc/passwd"))),
            },
        };
        let env = Envd { e2b: self, sb, tree: &tree, user: &user, req };
        let Some((service, method, streaming, msgs)) = rpc else {
            return tree.as_user(&user, |_| env.files()).and_then(|r| r).unwrap_or_else(transfer::refused);
        };
        let first = msgs.first().cloned().unwrap_or_else(|| json!({}));
        let timeout = req.header("connect-timeout-ms").and_then(|t| t.parse::<u64>().ok()).filter(|t| *t > 0);
        let r = match (service, method) {
            ("process.Process", "Start") => {
                let procs = self.processes(sb);
                process::StartRequest::parse(&first)
                    .and_then(|s| procs.start(&self.d, sb, &user, s, timeout.map(Duration::from_millis)))
                    .map(Reply::Stream)
            }
            ("filesystem.Filesystem", "WatchDir") => {
                tree.as_user(&user, |_| env.watch_stream(&first)).and_then(|r| r).map(Reply::Stream)
            }
            ("filesystem.Filesystem", m) => {
                tree.as_user(&user, |_| env.filesystem(m, &first)).and_then(|r| r).map(Reply::Message)
            }
            _ => Err(RpcError::new(Code::Unimplemented, format!("{service}/{method} is not implemented"))),
        };
        answer_rpc(r, streaming)
    }

    /// `process.Process` calls on a command already started.
    fn process_call(
        &self,
        sb: &Arc<crate::sandbox::Sandbox>,
        service: &str,
        method: &str,
        msgs: &[Value],
    ) -> Result<Reply, RpcError> {
        let procs = self.processes(sb);
        let first = msgs.first().cloned().unwrap_or_else(|| json!({}));
        let done = |r: Result<(), RpcError>| r.map(|()| Reply::Message(json!({})));
        match method {
            "Connect" => procs.connect(&first).map(Reply::Stream),
            "List" => Ok(Reply::Message(procs.list())),
            "SendInput" => done(procs.input(&first, first.get("input").unwrap_or(&Value::Null))),
            // A start naming the process, then input messages.
            "StreamInput" => {
                let start = first
                    .get("start")
                    .ok_or_else(|| RpcError::invalid("the first StreamInput message must be a start"))?;
                for m in &msgs[1..] {
                    if let Some(input) = m.get("data").and_then(|d| d.get("input")) {
                        procs.input(start, input)?;
                    }
                }
                Ok(Reply::OneOfStream(json!({})))
            }
            "CloseStdin" => done(procs.close_stdin(sb, &first)),
            "SendSignal" => done(procs.signal(sb, &first)),
            "Update" => done(procs.update(&first)),
            _ => Err(RpcError::new(Code::Unimplemented, format!("{service}/{method} is not implemented"))),
        }
    }
}

/// A Connect reply: unary JSON, or (for a streaming request) frames.
fn answer_rpc(r: Result<Reply, RpcError>, streaming: bool) -> Resp {
    match (r, streaming) {
        (Ok(Reply::Message(m)), false) => Resp::json(200, m),
        (Ok(Reply::Message(m)) | Ok(Reply::OneOfStream(m)), true) => {
            let (tx, rx) = mpsc::channel(2);
            let _ = tx.try_send(connect::message(&m));
            let _ = tx.try_send(connect::end(None));
            Resp::frames(rx)
        }
        (Ok(Reply::OneOfStream(m)), false) => Resp::json(200, m),
        (Ok(Reply::Stream(rx)), _) => Resp::frames(rx),
        (Err(e), true) => {
            let (tx, rx) = mpsc::channel(1);
            let _ = tx.try_send(connect::end(Some(&e)));
            Resp::frames(rx)
        }
        (Err(e), false) => Resp::rpc_error(&e),
    }
}

/// An envd error as the route answers it: a Connect error for RPCs; for
/// plain routes a status, and for a sandbox that is not running what
/// E2B's proxy answers (502, "was not found").
fn refuse(rpc: bool, e: RpcError) -> Resp {
    match (rpc, e.code) {
        (true, _) => Resp::rpc_error(&e),
        (false, Code::Unavailable) => Resp::error(502, &e.message),
        (false, _) => Resp::error(e.code.status(), &e.message),
    }
}

/// A request whose credentials were checked.
enum Admitted {
    /// The control API, for the key with this hash.
    Control(String),
    /// envd of a running sandbox; `fail` answers an error in the form the
    /// route expects (Connect or plain).
    Envd { id: String, sb: crate::sandbox::InUse, rpc: bool },
}

enum Reply {
    Message(Value),
    /// A client stream's one reply message.
    OneOfStream(Value),
    Stream(process::Frames),
}

/// One envd request, its sandbox found and its caller checked.
struct Envd<'a> {
    e2b: &'a Arc<E2b>,
    sb: &'a Arc<crate::sandbox::Sandbox>,
    tree: &'a fs::Tree,
    user: &'a users::User,
    req: &'a Req,
}

impl Envd<'_> {
    fn path(&self, m: &Value, key: &str) -> Result<String, RpcError> {
        fs::absolute(field::str(m, key)?, self.user)
    }

    fn filesystem(&self, method: &str, m: &Value) -> Result<Value, RpcError> {
        let t = self.tree;
        match method {
            "Stat" => Ok(json!({"entry": t.stat(&self.path(m, "path")?)?})),
            "ListDir" => Ok(json!({"entries": t.list(&self.path(m, "path")?, field::uint(m, "depth")?)?})),
            "MakeDir" => {
                let p = self.path(m, "path")?;
                if !t.make_dir(&p)? {
                    return Err(RpcError::new(Code::AlreadyExists, format!("{p}: the directory already exists")));
                }
                Ok(json!({"entry": t.stat(&p)?}))
            }
            "Move" => Ok(json!({"entry": t.rename(&self.path(m, "source")?, &self.path(m, "destination")?)?})),
            "Remove" => t.remove(&self.path(m, "path")?).map(|()| json!({})),
            "CreateWatcher" => {
                let p = self.path(m, "path")?;
                let (recursive, entry) = (field::bool(m, "recursive")?, field::bool(m, "includeEntry")?);
                let id = self.e2b.watchers.create(self.sb.id.as_str(), t, &p, recursive, entry)?;
                Ok(json!({"watcherId": id}))
            }
            "GetWatcherEvents" => {
                let events = self.e2b.watchers.events(self.sb.id.as_str(), t, field::str(m, "watcherId")?)?;
                Ok(json!({"events": events}))
            }
            "RemoveWatcher" => {
                self.e2b.watchers.remove(self.sb.id.as_str(), field::str(m, "watcherId")?).map(|()| json!({}))
            }
            _ => Err(RpcError::new(Code::Unimplemented, format!("filesystem.Filesystem/{method} is not implemented"))),
        }
    }

    /// `WatchDir`: a watcher whose events are streamed as they come (a
    /// thread polls it every [`WATCH_POLL`]) until the client goes; a
    /// keepalive every [`WATCH_KEEPALIVE`] of quiet finds out that it has.
    fn watch_stream(&self, m: &Value) -> Result<process::Frames, RpcError> {
        let path = self.path(m, "path")?;
        let sandbox = self.sb.id.to_string();
        let (recursive, entry) = (field::bool(m, "recursive")?, field::bool(m, "includeEntry")?);
        let id = self.e2b.watchers.create(&sandbox, self.tree, &path, recursive, entry)?;
        let (tx, rx) = mpsc::channel(64);
        let _ = tx.try_send(connect::message(&json!({"start": {}})));
        let (e2b, shim_pid, userns, user) =
            (self.e2b.clone(), self.sb.shim_pid, self.sb.spec.userns, self.user.clone());
        std::thread::spawn(move || {
            let ended = (|| -> Result<(), RpcError> {
                // The root opened as the daemon (its /proc/<shim>/root); then
                // this thread acts as the caller, as envd would, for the
                // directories it adds and the entries it reads.
                let tree = fs::Tree::open(shim_pid, userns)?;
                tree.become_user(&user)?;
                let mut quiet = std::time::Instant::now();
                loop {
                    std::thread::sleep(WATCH_POLL);
                    if tx.is_closed() {
                        return Ok(());
                    }
                    let mut frames: Vec<Bytes> = e2b
                        .watchers
                        .events(&sandbox, &tree, &id)?
                        .into_iter()
                        .map(|ev| connect::message(&json!({"filesystem": ev})))
                        .collect();
                    if frames.is_empty() && quiet.elapsed() >= WATCH_KEEPALIVE {
                        frames.push(connect::message(&json!({"keepalive": {}})));
                    }
                    for f in frames {
                        quiet = std::time::Instant::now();
                        if tx.blocking_send(f).is_err() {
                            return Ok(());
                        }
                    }
                }
            })();
            let _ = e2b.watchers.remove(&sandbox, &id);
            let _ = tx.blocking_send(connect::end(ended.err().as_ref()));
        });
        Ok(rx)
    }
}

#[cfg(test)]
mod tests;
