//! The HTTP+JSON API on the daemon's Unix socket. `serve` is the hyper
//! server (connections, timeouts, bodies, streams, the exec upgrade),
//! `route` turns a read request into a typed call on the [`Daemon`], and
//! [`ApiError`] is the one mapping from error kinds to
//! `{"error":{"code","message"}}` with a status.

pub mod http;
mod parse;

use parse::segments;
pub use parse::{parse, Action};

mod serve;

use serde::Serialize;
pub use serve::{serve, ServeConfig, DEFAULT_MAX_CONNECTIONS};

use crate::daemon::Daemon;
use crate::error::{chain, Classify, ErrorKind};
use crate::sandbox::ExecRequest;
use crate::types::{self, ErrorBody, ErrorDetail, ExecResult, VersionInfo};

pub const API_VERSION: &str = "v1";

#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub kind: ErrorKind,
    pub message: String,
    /// For 405: the methods the path takes (the `Allow` header).
    pub allow: Option<&'static str>,
}

impl ApiError {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> ApiError {
        ApiError { kind, message: message.into(), allow: None }
    }

    pub fn invalid(e: &dyn std::error::Error) -> ApiError {
        ApiError::new(ErrorKind::InvalidArgument, chain(e))
    }

    /// A host failure (500), or 507 if it ran out of space.
    pub fn internal(e: &(dyn std::error::Error + 'static)) -> ApiError {
        ApiError::new(ErrorKind::of_host_failure(e), chain(e))
    }

    pub fn status(&self) -> u16 {
        self.kind.status()
    }

    pub fn body(&self) -> Vec<u8> {
        let b = ErrorBody { error: ErrorDetail { code: self.kind.code().into(), message: self.message.clone() } };
        serde_json::to_vec(&b).unwrap_or_default()
    }
}

/// An operation's own error: its kind, and its chain as the message.
impl<E: Classify> From<E> for ApiError {
    fn from(e: E) -> Self {
        ApiError::new(e.kind(), chain(&e))
    }
}

/// A registry transfer whose progress is streamed (`progress: true`).
pub enum StreamOp {
    PullImage(types::RegistryRequest),
    PullSnapshot(types::RegistryRequest),
    PushSnapshot(String, types::RegistryRequest),
}

impl StreamOp {
    fn run(self, d: &Daemon, progress: &mut dyn FnMut(types::Progress)) -> Result<Reply, ApiError> {
        match self {
            StreamOp::PullImage(r) => json(201, &d.pull_image(&r, progress)?),
            StreamOp::PullSnapshot(r) => json(201, &d.pull_snapshot(&r, progress)?),
            StreamOp::PushSnapshot(id, r) => json(200, &d.push_snapshot(&id, &r, progress)?),
        }
    }

    /// Run it now, or (with `progress`) once the stream is open.
    fn reply(self, d: &Daemon, progress: bool) -> Result<Reply, ApiError> {
        if progress {
            Ok(Reply::Stream(self))
        } else {
            self.run(d, &mut |_| {})
        }
    }
}

/// What a request resolved to.
pub enum Reply {
    /// A 200 `application/x-ndjson` stream of `{"progress": ...}` lines,
    /// then one `{"status": N, "result": ...}` or `{"status": N, "error":
    /// ...}` line; the connection closes after it.
    Stream(StreamOp),
    Json(u16, Vec<u8>),
    Empty(u16),
    /// Prometheus metrics, OpenMetrics text.
    Metrics(String),
    /// A buffered exec for the server to run and wait for its own way
    /// (`api::serve`: on its async worker for a while, then on a thread);

    /// its answer is [`exec_result`].
    Exec {
        sandbox: crate::sandbox::InUse,
        req: ExecRequest,
        stdin: Vec<u8>,
    },
    /// Hand the connection to an attached exec (after a 101 response).
    Attach {
        sandbox: crate::sandbox::InUse,
        req: ExecRequest,
    },
    /// Join the connection to a TCP stream into a sandbox (after a 101).
    Port(std::net::TcpStream),
}

fn json<T: Serialize>(status: u16, v: &T) -> Result<Reply, ApiError> {
    serde_json::to_vec(v).map(|b| Reply::Json(status, b)).map_err(|e| ApiError::internal(&e))
}

/// Run a parsed request against the daemon.
pub fn execute(d: &Daemon, action: Action) -> Result<Reply, ApiError> {
    use Action as A;
    fn done<E: Into<ApiError>>(r: Result<(), E>) -> Result<Reply, ApiError> {
        r.map(|()| Reply::Empty(204)).map_err(Into::into)
    }
    match action {
        A::Version => json(
            200,
            &VersionInfo {
                version: env!("CARGO_PKG_VERSION").into(),
                api: API_VERSION.into(),
                cgroup: if crate::sandbox::cgroups::is_v2() { "v2" } else { "v1" }.into(),
            },
        ),
        A::Info => json(200, &d.host_info()?),
        A::DiskUsage => json(200, &d.disk_usage()?),
        A::Drain(r) => json(200, &d.drain(r)?),
        A::ListHosts => json(200, &d.hosts()?),
        A::GetHost(h) => json(200, &d.host(&h)?),
        A::DrainHost(h, r) => json(200, &d.drain_host(&h, r)?),
        A::ListImages => json(200, &d.list_images()?),
        A::PullImage(r) => {
            let p = r.progress;
            StreamOp::PullImage(r).reply(d, p)
        }
        A::ImportImage(b) => json(201, &d.import_image(&b.path, b.tag.as_deref(), &b.name)?),
        A::GetImage(name) => json(200, &d.get_image(&name)?),
        A::RemoveImage(name) => done(d.remove_image(&name)),
        A::ListSandboxes => json(200, &d.list_sandboxes()),
        A::CreateSandbox(b) => json(201, &d.create_sandbox(b)?),
        A::GetSandbox(id) => json(200, &crate::daemon::sandbox_info(&*d.sandbox(&id)?)),
        A::RemoveSandbox(id, wait) => {
            let removed = if wait { d.remove_sandbox_now(&id) } else { d.remove_sandbox(&id) };
            match removed {
                // Not here: one lost with its host is removed when that host is back.
                Err(e) if e.kind() == ErrorKind::NotFound => match d.stop_lost_sandbox(&id)? {
                    Some((host, host_down)) => json(202, &crate::types::RemovalDeferred { id, host, host_down }),
                    None => Err(e.into()),
                },
                r => done(r),
            }
        }
        A::Checkpoint(id, b) => {
            d.can_publish(b.kind, b.background)?;
            let snap = d.checkpoint(&id, b.compression.unwrap_or_default(), b.whole)?;
            json(201, &d.publish_made(snap, b.kind, b.background)?)
        }
        A::Suspend(id) => {
            let snap = d.suspend(&id)?;
            json(201, &d.publish_made(snap, d.suspend_type(), false)?)
        }
        A::Promote(id) => json(200, &d.promote(&id)?),
        A::Rollback(id, b) => json(200, &d.rollback(&id, &b.to)?),
        A::SandboxDiff(id) => json(200, &d.sandbox_diff(&id)?),
        A::PublishBaseline(id, b) => json(201, &d.publish_baseline(&id, b)?),
        A::Copy(id, b) => json(200, &d.copy(&id, &b)?),
        A::Pause(id) => done(d.pause_sandbox(&id)),
        A::Unpause(id) => done(d.unpause_sandbox(&id)),
        A::SetTimeout(id, b) => json(200, &d.set_timeout(&id, b)?),
        A::SetNetwork(id, b) => json(200, &d.set_network(&id, b)?),
        A::SetLimits(id, b) => json(200, &d.set_limits(&id, b)?),
        A::StartProcess(id, b) => json(201, &d.start_process(&id, b)?),
        A::ListProcesses(id) => json(200, &d.processes(&id)?),
        A::GetProcess(id, n, wait) => json(200, &d.process(&id, n, wait)?),
        A::SignalProcess(id, n, b) => json(200, &d.signal_process(&id, n, b)?),
        A::ForgetProcess(id, n) => done(d.forget_process(&id, n)),
        A::Metrics(id) => json(200, &d.sandbox_metrics(&id)?),
        A::Prometheus => Ok(Reply::Metrics(d.prometheus())),
        A::Port(id, port) => Ok(Reply::Port(d.connect_port(&id, port)?)),
        A::Exec(id, req, stdin) => Ok(Reply::Exec { sandbox: d.sandbox(&id)?, req, stdin }),
        A::Attach(id, req) => Ok(Reply::Attach { sandbox: d.sandbox(&id)?, req }),
        A::Logs(id, output) => json(200, &d.logs(&id, output)?),
        A::ListSnapshots(labels) => json(200, &d.list_snapshots_labelled(&labels)?),
        A::Evaluate(id, b) => json(201, &d.evaluate(&id, b)?),
        A::Evaluations(id) => json(200, &d.evaluations(&id)?),
        A::Label(id, b) => json(200, &d.label_snapshot(&id, b)?),
        A::Retain(id, on) => json(200, &d.retain_snapshot(&id, on)?),
        A::Patch(id, against) => json(200, &d.snapshot_patch(&id, against.as_deref())?),
        A::SealedResult(id) => json(200, &d.snapshot_result(&id)?),
        A::PullSnapshot(r) => {
            let p = r.progress;
            StreamOp::PullSnapshot(r).reply(d, p)
        }
        A::PushSnapshot(id, r) => {
            let p = r.progress;
            StreamOp::PushSnapshot(id, r).reply(d, p)
        }
        A::GetSnapshot(id) => json(200, &d.get_snapshot(&id)?),
        A::RemoveSnapshot(id) => done(d.remove_snapshot(&id)),
        A::SnapshotDiff(id) => json(200, &d.snapshot_diff(&id)?),
        A::Export(id, b) => json(201, &d.export_snapshot(&id, &b.path, b.compression.unwrap_or_default())?),
        A::Resume(id, b) => json(201, &d.resume(&id, b)?),
        A::Fork(id, b) => json(201, &d.fork(&id, b)?),
        A::Gc { retention, stale_after } => {
            json(200, &d.gc(retention.unwrap_or(d.cfg.retention), stale_after.unwrap_or(d.cfg.stale_after))?)
        }
        A::ListLineages => json(200, &d.list_lineages()?),
        A::Lineage(id) => json(200, &d.lineage(&id)?),
        A::ResumeLineage(id, b) => json(201, &d.resume_lineage(&id, b)?),
        A::RetireLineage(id) => json(200, &d.retire_lineage(&id)?),
        A::CloseLineage(id, b) => json(200, &d.close_lineage(&id, b.outcome)?),
    }
}

/// The body of a buffered exec's answer (200).
pub fn exec_result(out: crate::sandbox::ExecOutput) -> Result<Vec<u8>, ApiError> {
    let signal = match out.status {
        strata_shim::proto::ExitStatus::Signal(s) => Some(s),
        _ => None,
    };
    let result = ExecResult {
        exit_code: out.status.shell_code(),
        signal,
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        duration_ms: out.duration.as_secs_f64() * 1000.0,
        timed_out: out.timed_out,
        truncated: out.truncated,
    };
    serde_json::to_vec(&result).map_err(|e| ApiError::internal(&e))
}

/// Whether [`route`] answers `req` at once, from memory: a buffered or an
/// attached exec (with a body of at most 64 KiB to parse) is looked up and
/// handed back ([`Reply::Exec`], [`Reply::Attach`]) for the server to run
/// its own way. Every other request may block (files, SQLite, locks, the
/// network).
pub fn answers_at_once(req: &http::Request) -> bool {
    req.method == "POST"
        && req.body.len() <= 64 << 10
        && segments(&req.path).is_some_and(|(_, s)| matches!(s.as_slice(), ["sandboxes", _, "exec"]))
}

/// Resolve one request against the daemon: parse it, then execute it.
pub fn route(d: &Daemon, req: &http::Request) -> Result<Reply, ApiError> {
    // Ready pools refill only while no request is in flight.
    let _in_flight = d.request_started();
    let started = std::time::Instant::now();
    let action = parse(req)?;
    let name = action.name();
    let run = |action| execute(d, action).map_err(|e| placed(d, &req.path, e));
    let r = match idempotency_key(req) {
        Ok(Some(key)) if action.creates() => idempotent(d, key, req, action, run),
        Ok(_) => run(action),
        Err(e) => Err(e),
    };
    let status = match &r {
        Ok(Reply::Json(s, _) | Reply::Empty(s)) => *s,
        Ok(Reply::Port(_) | Reply::Attach { .. }) => 101,
        Ok(_) => 200,
        Err(e) => e.status(),
    };
    d.telemetry.request(name, status, started.elapsed());
    r
}

/// A 404 about a sandbox this host does not run but the catalog places on
/// another host of the fleet becomes a 409 naming that host (and why it
/// is down, if it is): the sandbox exists, and is to be asked of it.
fn placed(d: &Daemon, path: &str, e: ApiError) -> ApiError {
    if e.kind != ErrorKind::NotFound {
        return e;
    }
    let Some(id) = segments(path).and_then(|(_, s)| (s.first() == Some(&"sandboxes")).then(|| s.get(1).copied())?)
    else {
        return e;
    };
    // The catalog may be slow (or its lock held): not on an async worker.
    match tokio::task::block_in_place(|| d.sandbox_placement(id)) {
        Ok(Some((host, crate::catalog::HostState::Up))) => {
            ApiError::new(ErrorKind::Conflict, format!("sandbox {id} runs on host {host}; ask that host"))
        }
        Ok(Some((host, state))) => ApiError::new(
            ErrorKind::Conflict,
            format!(
                "sandbox {id} runs on host {host}, which is down ({}); ask that host once it is back",
                state.why_not_up().unwrap_or_default()
            ),
        ),
        Ok(None) => e,
        Err(lookup) => {
            tracing::warn!("where sandbox {id} runs: {}", crate::error::chain(&lookup));
            e
        }
    }
}

/// The `Idempotency-Key` header: 1-255 visible ASCII characters.
fn idempotency_key(req: &http::Request) -> Result<Option<&str>, ApiError> {
    let Some(key) = req.header("idempotency-key") else { return Ok(None) };
    if key.is_empty() || key.len() > 255 || !key.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(ApiError::new(
            ErrorKind::InvalidArgument,
            "Idempotency-Key must be 1-255 visible ASCII characters",
        ));
    }
    Ok(Some(key))
}

/// A request body with each `secret_env` entry cut to its name (the body
/// as it came if it has none, or is not a JSON object).
fn without_secret_values(body: &[u8]) -> std::borrow::Cow<'_, [u8]> {
    let Ok(serde_json::Value::Object(mut m)) = serde_json::from_slice::<serde_json::Value>(body) else {
        return body.into();
    };
    let Some(serde_json::Value::Array(entries)) = m.get_mut("secret_env") else { return body.into() };
    for e in entries.iter_mut() {
        if let Some(s) = e.as_str() {
            *e = s.split('=').next().unwrap_or("").into();
        }
    }
    serde_json::to_vec(&m).map_or(body.into(), Into::into)
}

/// Run a request that creates something at most once per key: the same
/// request again gets the first response; another request with the key,
/// 422. Only successes and lasting refusals are kept; a streamed or
/// upgraded reply, a 409, 429, 408 or 5xx is not (the key is forgotten: a
/// retry runs again).
fn idempotent(
    d: &Daemon,
    key: &str,
    req: &http::Request,
    action: Action,
    execute: impl FnOnce(Action) -> Result<Reply, ApiError>,
) -> Result<Reply, ApiError> {
    use sha2::Digest as _;
    let mut h = sha2::Sha256::new();
    // The catalog keeps the fingerprint: a secret env's values are not in
    // it (a digest of a guessable value gives it away), their names are.
    let body = without_secret_values(&req.body);
    for part in [req.method.as_bytes(), req.path.as_bytes(), req.query.as_bytes(), &body] {
        h.update((part.len() as u64).to_le_bytes());
        h.update(part);
    }
    let fingerprint = hex::encode(h.finalize());
    match d.claim_request(key, &fingerprint)? {
        crate::catalog::Claim::Claimed => {}
        crate::catalog::Claim::Done { status, body } if body.is_empty() => return Ok(Reply::Empty(status)),
        crate::catalog::Claim::Done { status, body } => return Ok(Reply::Json(status, body)),
        crate::catalog::Claim::Mismatch => {
            return Err(ApiError::new(
                ErrorKind::Unprocessable,
                format!("Idempotency-Key {key:?} was used with another request in the last 24 h"),
            ))
        }
        crate::catalog::Claim::InFlight => {
            return Err(ApiError::new(
                ErrorKind::Conflict,
                format!("a request with Idempotency-Key {key:?} is still running; retry later"),
            ))
        }
    }
    // Settled on every way out, a panic included (else the key would stay
    // in flight for 24 h).
    struct Unsettled<'a>(&'a Daemon, &'a str, bool);

    impl Drop for Unsettled<'_> {
        fn drop(&mut self) {
            if !self.2 {
                self.0.settle_request(self.1, None);
            }
        }
    }
    let mut guard = Unsettled(d, key, false);
    let reply = execute(action);
    // Kept: successes, and refusals that the same request will always get
    // (malformed, not found, ...). Not kept: conflicts and limits of the
    // moment (409, 429), timeouts, failures of the host (5xx).
    let kept = |s: u16| (200..300).contains(&s) || matches!(s, 400 | 404 | 405 | 413 | 422);
    match &reply {
        Ok(Reply::Json(s, b)) if kept(*s) => d.settle_request(key, Some((*s, b))),
        Ok(Reply::Empty(s)) if kept(*s) => d.settle_request(key, Some((*s, &[]))),
        Err(e) if kept(e.status()) => d.settle_request(key, Some((e.status(), &e.body()))),
        _ => d.settle_request(key, None),
    }
    guard.2 = true;
    reply
}

/// Whether the peer of `s` may use the API: root, or a process whose
/// group (SO_PEERCRED) or supplementary groups (SO_PEERGROUPS) include
/// `gid`, as they were when it connected.
fn peer_allowed(s: &impl std::os::fd::AsFd, gid: Option<u32>) -> Result<(), String> {
    let cred = nix::sys::socket::getsockopt(s, nix::sys::socket::sockopt::PeerCredentials)
        .map_err(|e| format!("read peer credentials: {e}"))?;
    if cred.uid() == 0 {
        return Ok(());
    }
    let who = format!("pid {} (uid {}, gid {})", cred.pid(), cred.uid(), cred.gid());
    let Some(gid) = gid else {
        return Err(format!("{who} is not root, and the daemon has no --socket-group"));
    };
    if cred.gid() == gid {
        return Ok(());
    }
    let groups = strata_shim::sys::peer_groups(s.as_fd()).map_err(|e| format!("read peer groups: {e}"))?;
    if groups.contains(&gid) {
        return Ok(());
    }
    Err(format!("{who} is not root and not in the socket group {gid}"))
}

#[cfg(test)]
mod tests;
