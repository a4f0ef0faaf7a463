//! The HTTP+JSON API on the daemon's Unix socket. `serve` is the hyper
//! server (connections, timeouts, bodies, streams, the exec upgrade),
//! `route` turns a read request into a typed call on the [`Daemon`], and
//! [`ApiError`] is the one mapping from error kinds to
//! `{"error":{"code","message"}}` with a status.

pub mod http;
mod serve;
pub mod types;

pub use serve::{serve, ServeConfig, DEFAULT_MAX_CONNECTIONS};

use std::sync::Arc;
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::daemon::Daemon;
use crate::error::{chain, ErrorKind};
use crate::sandbox::ExecRequest;
use types::{CreateRequest, ErrorBody, ErrorDetail, ExecRequestBody, ExecResult, ImportRequest, VersionInfo};

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

impl From<crate::image::ImageError> for ApiError {
    fn from(e: crate::image::ImageError) -> Self {
        match e.kind() {
            ErrorKind::Internal => ApiError::internal(&e),
            kind => ApiError::new(kind, chain(&e)),
        }
    }
}

impl From<crate::sandbox::SandboxError> for ApiError {
    fn from(e: crate::sandbox::SandboxError) -> Self {
        match e.kind() {
            ErrorKind::Internal => ApiError::internal(&e),
            kind => ApiError::new(kind, chain(&e)),
        }
    }
}

impl From<crate::db::DbError> for ApiError {
    fn from(e: crate::db::DbError) -> Self {
        match &e {
            // The row a request was working on was deleted by another
            // request meanwhile (a checkpoint or suspend racing `rm`): that
            // object is gone, not the daemon broken.
            crate::db::DbError::Query { source: rusqlite::Error::QueryReturnedNoRows, what } => {
                ApiError::new(ErrorKind::NotFound, format!("{what}: not found (removed while this request ran)"))
            }
            _ => ApiError::internal(&e),
        }
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
    /// Hand the connection to an attached exec (after a 101 response).
    Attach {
        sandbox: Arc<crate::sandbox::Sandbox>,
        req: ExecRequest,
    },
}

fn json<T: Serialize>(status: u16, v: &T) -> Result<Reply, ApiError> {
    serde_json::to_vec(v).map(|b| Reply::Json(status, b)).map_err(|e| ApiError::internal(&e))
}

fn body<T: DeserializeOwned>(req: &http::Request) -> Result<T, ApiError> {
    // serde also accepts a JSON array for a struct; the API takes objects only.
    if req.body.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        return Err(ApiError::new(ErrorKind::InvalidArgument, "request body must be a JSON object"));
    }
    serde_json::from_slice(&req.body)
        .map_err(|e| ApiError::new(ErrorKind::InvalidArgument, format!("invalid JSON body: {e}")))
}

/// A body that may be omitted entirely (all fields optional).
fn body_or_default<T: DeserializeOwned + Default>(req: &http::Request) -> Result<T, ApiError> {
    // No body at all is the defaults; anything else must be a JSON object.
    if req.body.is_empty() {
        return Ok(T::default());
    }
    body(req)
}

fn exec_request(b: &ExecRequestBody) -> Result<ExecRequest, ApiError> {
    let timeout = match b.timeout {
        None => None,
        Some(t) if t.is_finite() && t > 0.0 && t <= 86_400.0 => Some(Duration::from_secs_f64(t)),
        Some(t) => {
            return Err(ApiError::new(
                ErrorKind::InvalidArgument,
                format!("timeout {t} must be between 0 and 86400 seconds"),
            ))
        }
    };
    Ok(ExecRequest {
        argv: b.argv.clone(),
        env: b.env.clone(),
        cwd: b.cwd.clone(),
        user: b.user.clone(),
        timeout,
        tty: b.tty,
        size: (b.rows.unwrap_or(24).max(1), b.cols.unwrap_or(80).max(1)),
    })
}

/// Resolve one request against the daemon.
pub fn route(d: &Daemon, req: &http::Request) -> Result<Reply, ApiError> {
    let path = req.path.trim_end_matches('/');
    let Some(rest) = path.strip_prefix("/v1").filter(|r| r.is_empty() || r.starts_with('/')) else {
        return Err(ApiError::new(
            ErrorKind::NotFound,
            format!("no route {} {} (the API lives under /v1)", req.method, req.path),
        ));
    };
    let segs: Vec<&str> = rest.split('/').filter(|s| !s.is_empty()).collect();
    let m = req.method.as_str();
    let not_allowed = |allow: &'static str| ApiError {
        allow: Some(allow),
        ..ApiError::new(
            ErrorKind::MethodNotAllowed,
            format!("method {m} not allowed on {} (allowed: {allow})", req.path),
        )
    };
    match segs.as_slice() {
        ["version"] => match m {
            "GET" => json(
                200,
                &VersionInfo {
                    version: env!("CARGO_PKG_VERSION").into(),
                    api: API_VERSION.into(),
                    cgroup: if crate::cgroups::is_v2() { "v2" } else { "v1" }.into(),
                },
            ),
            _ => Err(not_allowed("GET")),
        },
        ["images"] => match m {
            "GET" => json(200, &d.list_images()?),
            _ => Err(not_allowed("GET")),
        },
        ["images", "pull"] => match m {
            "POST" => {
                let b: types::RegistryRequest = body(req)?;
                let p = b.progress;
                StreamOp::PullImage(b).reply(d, p)
            }
            _ => Err(not_allowed("POST")),
        },
        ["images", "import"] => match m {
            "POST" => {
                let b: ImportRequest = body(req)?;
                json(201, &d.import_image(&b.path, b.tag.as_deref(), &b.name)?)
            }
            _ => Err(not_allowed("POST")),
        },
        ["images", ..] => {
            let name = http::percent_decode(rest.strip_prefix("/images/").unwrap_or(""));
            match m {
                "GET" => json(200, &d.get_image(&name)?),
                "DELETE" => d.remove_image(&name).map(|()| Reply::Empty(204)),
                _ => Err(not_allowed("GET, DELETE")),
            }
        }
        ["sandboxes"] => match m {
            "GET" => json(200, &d.list_sandboxes()),
            "POST" => {
                let b: CreateRequest = body(req)?;
                json(201, &d.create_sandbox(b)?)
            }
            _ => Err(not_allowed("GET, POST")),
        },
        ["sandboxes", id] => match m {
            "GET" => {
                let sb = d.sandbox(id)?;
                json(200, &crate::daemon::sandbox_info(&sb))
            }
            "DELETE" => d.remove_sandbox(id).map(|()| Reply::Empty(204)),
            _ => Err(not_allowed("GET, DELETE")),
        },
        ["sandboxes", id, "checkpoint"] => match m {
            "POST" => {
                let b: types::CheckpointRequest = body_or_default(req)?;
                json(201, &d.checkpoint(id, b.compression.unwrap_or_default())?)
            }
            _ => Err(not_allowed("POST")),
        },
        ["snapshots"] => match m {
            "GET" => json(200, &d.list_snapshots()?),
            _ => Err(not_allowed("GET")),
        },
        ["snapshots", "pull"] => match m {
            "POST" => {
                let b: types::RegistryRequest = body(req)?;
                let p = b.progress;
                StreamOp::PullSnapshot(b).reply(d, p)
            }
            _ => Err(not_allowed("POST")),
        },
        ["snapshots", id, "push"] => match m {
            "POST" => {
                let b: types::RegistryRequest = body(req)?;
                let p = b.progress;
                StreamOp::PushSnapshot(id.to_string(), b).reply(d, p)
            }
            _ => Err(not_allowed("POST")),
        },
        ["snapshots", id] => match m {
            "GET" => json(200, &d.get_snapshot(id)?),
            "DELETE" => d.remove_snapshot(id).map(|()| Reply::Empty(204)),
            _ => Err(not_allowed("GET, DELETE")),
        },
        ["snapshots", id, "diff"] => match m {
            "GET" => json(200, &d.snapshot_diff(id)?),
            _ => Err(not_allowed("GET")),
        },
        ["sandboxes", id, "suspend"] => match m {
            "POST" => json(201, &d.suspend(id)?),
            _ => Err(not_allowed("POST")),
        },
        ["sandboxes", id, "rollback"] => match m {
            "POST" => {
                let b: types::RollbackRequest = body(req)?;
                json(200, &d.rollback(id, &b.to)?)
            }
            _ => Err(not_allowed("POST")),
        },
        ["sandboxes", id, "logs"] | ["snapshots", id, "logs"] => match m {
            "GET" => json(200, &d.logs(id)?),
            _ => Err(not_allowed("GET")),
        },
        ["sandboxes", id, "diff"] => match m {
            "GET" => json(200, &d.sandbox_diff(id)?),
            _ => Err(not_allowed("GET")),
        },
        ["snapshots", id, "export"] => match m {
            "POST" => {
                let b: types::ExportRequest = body(req)?;
                json(201, &d.export_snapshot(id, &b.path, b.compression.unwrap_or_default())?)
            }
            _ => Err(not_allowed("POST")),
        },
        ["snapshots", id, "resume"] => match m {
            "POST" => json(201, &d.resume(id, body_or_default(req)?)?),
            _ => Err(not_allowed("POST")),
        },
        ["sandboxes", id, "baseline"] => match m {
            "POST" => json(201, &d.publish_baseline(id, body(req)?)?),
            _ => Err(not_allowed("POST")),
        },
        ["gc"] => match m {
            "POST" => {
                let r: crate::api::types::GcRequest = body_or_default(req)?;
                if [r.retention_secs, r.stale_after_secs].iter().flatten().any(|v| *v > i64::MAX as u64) {
                    return Err(ApiError::new(ErrorKind::InvalidArgument, "durations are int64 seconds"));
                }
                let secs = |v: Option<u64>, d: Duration| v.map(Duration::from_secs).unwrap_or(d);
                let retention = secs(r.retention_secs, d.cfg.retention);
                json(200, &d.gc(retention, secs(r.stale_after_secs, d.cfg.stale_after))?)
            }
            _ => Err(not_allowed("POST")),
        },
        ["lineages", id] => match m {
            "GET" => json(200, &d.lineage(id)?),
            _ => Err(not_allowed("GET")),
        },
        ["lineages", id, "resume"] => match m {
            "POST" => json(201, &d.resume_lineage(id, body_or_default(req)?)?),
            _ => Err(not_allowed("POST")),
        },
        ["lineages", id, "retire"] => match m {
            "POST" => json(200, &d.retire_lineage(id)?),
            _ => Err(not_allowed("POST")),
        },
        ["snapshots", id, "fork"] => match m {
            "POST" => json(201, &d.fork(id, body_or_default(req)?)?),
            _ => Err(not_allowed("POST")),
        },
        ["sandboxes", id, "copy"] => match m {
            "POST" => {
                let b: crate::copy::CopyRequest = body(req)?;
                json(200, &d.copy(id, &b)?)
            }
            _ => Err(not_allowed("POST")),
        },
        ["sandboxes", id, "pause"] => match m {
            "POST" => d.pause_sandbox(id).map(|()| Reply::Empty(204)),
            _ => Err(not_allowed("POST")),
        },
        ["sandboxes", id, "unpause"] => match m {
            "POST" => d.unpause_sandbox(id).map(|()| Reply::Empty(204)),
            _ => Err(not_allowed("POST")),
        },
        ["sandboxes", id, "exec"] => {
            if m != "POST" {
                return Err(not_allowed("POST"));
            }
            let sb = d.sandbox(id)?;
            let b: ExecRequestBody = body(req)?;
            let ereq = exec_request(&b)?;
            let upgrade = match req.header("upgrade") {
                None => false,
                Some(u) if u.eq_ignore_ascii_case(http::UPGRADE_PROTOCOL) => true,
                Some(u) => {
                    return Err(ApiError::new(
                        ErrorKind::InvalidArgument,
                        format!("cannot upgrade to {u:?}; the attached exec protocol is {}", http::UPGRADE_PROTOCOL),
                    ))
                }
            };
            if upgrade {
                if b.stdin.is_some() {
                    return Err(ApiError::new(
                        ErrorKind::InvalidArgument,
                        "stdin is sent as frames on an attached exec",
                    ));
                }
                return Ok(Reply::Attach { sandbox: sb, req: ereq });
            }
            let out = sb.exec_buffered(&ereq, b.stdin.unwrap_or_default().into_bytes())?;
            d.record_exec(&sb, &ereq, &out.summary);
            let signal = match out.status {
                strata_shim::proto::ExitStatus::Signal(s) => Some(s),
                _ => None,
            };
            json(
                200,
                &ExecResult {
                    exit_code: out.status.shell_code(),
                    signal,
                    stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
                    stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
                    duration_ms: out.duration.as_secs_f64() * 1000.0,
                    timed_out: out.timed_out,
                    truncated: out.truncated,
                },
            )
        }
        _ => Err(ApiError::new(ErrorKind::NotFound, format!("no route {} {}", req.method, req.path))),
    }
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
