//! The HTTP+JSON API on the daemon's Unix socket. `serve` is the hyper
//! server (connections, timeouts, bodies, streams, the exec upgrade),
//! `route` turns a read request into a typed call on the [`Daemon`], and
//! [`ApiError`] is the one mapping from error kinds to
//! `{"error":{"code","message"}}` with a status.

pub mod http;
mod serve;

pub use serve::{serve, ServeConfig, DEFAULT_MAX_CONNECTIONS};

use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::daemon::Daemon;
use crate::error::{chain, Classify, ErrorKind};
use crate::sandbox::ExecRequest;
use crate::types::{
    self, CreateRequest, ErrorBody, ErrorDetail, ExecRequestBody, ExecResult, ImportRequest, VersionInfo,
};

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
        // The daemon's to set.
        keep_output: 0,
    })
}

/// A request, parsed: the operation and its typed input. [`parse`] makes
/// one from a read request without I/O (it touches no daemon state, so it
/// can be tested alone); [`execute`] runs it against the daemon.
#[derive(Debug)]
pub enum Action {
    Version,
    Info,
    /// The store's use (`GET /v1/df`).
    DiskUsage,
    /// Start draining (`Some`) or stop (`None`).
    Drain(Option<types::DrainRequest>),
    ListHosts,
    /// Publish a snapshot to the fleet registry.
    Promote(String),
    GetHost(String),
    /// Drain a host of the fleet (`Some`) or end its drain (`None`).
    DrainHost(String, Option<types::DrainRequest>),
    ListImages,
    PullImage(types::RegistryRequest),
    ImportImage(ImportRequest),
    GetImage(String),
    RemoveImage(String),
    ListSandboxes,
    CreateSandbox(CreateRequest),
    GetSandbox(String),
    /// The id; whether to answer only once its teardown is done (`?wait`).
    RemoveSandbox(String, bool),
    Checkpoint(String, types::CheckpointRequest),
    Suspend(String),
    Rollback(String, types::RollbackRequest),
    SandboxDiff(String),
    PublishBaseline(String, crate::daemon::baseline::PublishRequest),
    Copy(String, crate::copy::CopyRequest),
    Pause(String),
    Unpause(String),
    SetTimeout(String, types::TimeoutRequest),
    /// `PUT /v1/sandboxes/{id}/network`: a new egress policy, live.
    SetNetwork(String, types::NetworkRequest),
    /// `GET /v1/sandboxes/{id}/metrics`: its use now.
    Metrics(String),
    /// `GET /v1/sandboxes/{id}/ports/{port}` with `Upgrade: tcp`: a
    /// stream to the sandbox's `127.0.0.1:port`.
    Port(String, u16),
    /// A buffered exec: run to completion, answer with its output.
    Exec(String, ExecRequest, Vec<u8>),
    /// An attached exec: the connection is upgraded to the exec stream.
    Attach(String, ExecRequest),
    /// An exec log: of a live sandbox or of a snapshot's chain; with the
    /// commands' output if asked (`?output=true`).
    Logs(String, bool),
    /// Snapshots, those with every label selector given (`?label=K[=V]`).
    ListSnapshots(Vec<String>),
    Evaluate(String, types::EvaluateRequest),
    Evaluations(String),
    Label(String, types::LabelRequest),
    /// Retain (true) or release (false).
    Retain(String, bool),
    /// `GET /v1/snapshots/{id}/diff?patch=true[&against=SNAP]`.
    Patch(String, Option<String>),
    SealedResult(String),
    PullSnapshot(types::RegistryRequest),
    PushSnapshot(String, types::RegistryRequest),
    GetSnapshot(String),
    RemoveSnapshot(String),
    SnapshotDiff(String),
    Export(String, types::ExportRequest),
    Resume(String, types::LaunchRequest),
    Fork(String, types::LaunchRequest),
    /// A collection pass; `None` takes the daemon's configured durations.
    Gc {
        retention: Option<Duration>,
        stale_after: Option<Duration>,
    },
    ListLineages,
    Lineage(String),
    ResumeLineage(String, types::LaunchRequest),
    RetireLineage(String),
    CloseLineage(String, types::CloseLineageRequest),
    /// `GET /metrics`: the daemon's Prometheus metrics.
    Prometheus,
}

impl Action {
    /// Its name in metrics (`strata_api_requests{operation=...}`).
    pub fn name(&self) -> &'static str {
        use Action as A;
        match self {
            A::Version => "version",
            A::Info => "info",
            A::DiskUsage => "disk_usage",
            A::Drain(_) => "drain",
            A::ListHosts => "list_hosts",
            A::Promote(_) => "promote",
            A::GetHost(_) => "get_host",
            A::DrainHost(..) => "drain_host",
            A::ListImages => "list_images",
            A::PullImage(_) => "pull_image",
            A::ImportImage(_) => "import_image",
            A::GetImage(_) => "get_image",
            A::RemoveImage(_) => "remove_image",
            A::ListSandboxes => "list_sandboxes",
            A::CreateSandbox(_) => "create_sandbox",
            A::GetSandbox(_) => "get_sandbox",
            A::RemoveSandbox(..) => "remove_sandbox",
            A::Checkpoint(..) => "checkpoint",
            A::Suspend(_) => "suspend",
            A::Rollback(..) => "rollback",
            A::SandboxDiff(_) => "sandbox_diff",
            A::PublishBaseline(..) => "publish_baseline",
            A::Copy(..) => "copy",
            A::Pause(_) => "pause",
            A::Unpause(_) => "unpause",
            A::SetTimeout(..) => "set_timeout",
            A::SetNetwork(..) => "set_network",
            A::Metrics(_) => "metrics",
            A::Port(..) => "port",
            A::Exec(..) => "exec",
            A::Attach(..) => "attach",
            A::Logs(..) => "logs",
            A::ListSnapshots(_) => "list_snapshots",
            A::Evaluate(..) => "evaluate",
            A::Evaluations(_) => "evaluations",
            A::Label(..) => "label",
            A::Retain(..) => "retain",
            A::Patch(..) => "patch",
            A::SealedResult(_) => "sealed_result",
            A::PullSnapshot(_) => "pull_snapshot",
            A::PushSnapshot(..) => "push_snapshot",
            A::GetSnapshot(_) => "get_snapshot",
            A::RemoveSnapshot(_) => "remove_snapshot",
            A::SnapshotDiff(_) => "snapshot_diff",
            A::Export(..) => "export",
            A::Resume(..) => "resume",
            A::Fork(..) => "fork",
            A::Gc { .. } => "gc",
            A::ListLineages => "list_lineages",
            A::Lineage(_) => "lineage",
            A::ResumeLineage(..) => "resume_lineage",
            A::RetireLineage(_) => "retire_lineage",
            A::CloseLineage(..) => "close_lineage",
            A::Prometheus => "prometheus",
        }
    }

    /// Whether it makes something a retry must not make twice (what an
    /// `Idempotency-Key` applies to).
    pub fn creates(&self) -> bool {
        use Action as A;
        matches!(
            self,
            A::CreateSandbox(_)
                | A::Resume(..)
                | A::Fork(..)
                | A::ResumeLineage(..)
                | A::Checkpoint(..)
                | A::Suspend(_)
                | A::PublishBaseline(..)
                | A::PushSnapshot(..)
                | A::PullSnapshot(_)
                | A::PullImage(_)
                | A::ImportImage(_)
                | A::Export(..)
                | A::Evaluate(..)
        )
    }
}

/// Parse a request: its route, method, headers and body. No I/O.
pub fn parse(req: &http::Request) -> Result<Action, ApiError> {
    // Where Prometheus looks by default, outside the versioned API.
    if req.path == "/metrics" {
        if req.method != "GET" {
            return Err(ApiError {
                allow: Some("GET"),
                ..ApiError::new(ErrorKind::MethodNotAllowed, format!("method {} not allowed on /metrics", req.method))
            });
        }
        return Ok(Action::Prometheus);
    }
    let Some((rest, segs)) = segments(&req.path) else {
        return Err(ApiError::new(
            ErrorKind::NotFound,
            format!("no route {} {} (the API lives under /v1)", req.method, req.path),
        ));
    };
    let m = req.method.as_str();
    let not_allowed = |allow: &'static str| ApiError {
        allow: Some(allow),
        ..ApiError::new(
            ErrorKind::MethodNotAllowed,
            format!("method {m} not allowed on {} (allowed: {allow})", req.path),
        )
    };
    let id = |s: &&str| s.to_string();
    use Action as A;
    let action = match (segs.as_slice(), m) {
        (["version"], "GET") => A::Version,
        (["version"], _) => return Err(not_allowed("GET")),
        (["info"], "GET") => A::Info,
        (["info"], _) => return Err(not_allowed("GET")),
        (["df"], "GET") => A::DiskUsage,
        (["df"], _) => return Err(not_allowed("GET")),
        (["drain"], "POST") => A::Drain(Some(body_or_default(req)?)),
        (["drain"], "DELETE") => A::Drain(None),
        (["drain"], _) => return Err(not_allowed("POST, DELETE")),
        (["hosts"], "GET") => A::ListHosts,
        (["hosts"], _) => return Err(not_allowed("GET")),
        (["hosts", h], "GET") => A::GetHost(id(h)),
        (["hosts", _], _) => return Err(not_allowed("GET")),
        (["hosts", h, "drain"], "POST") => A::DrainHost(id(h), Some(body_or_default(req)?)),
        (["hosts", h, "drain"], "DELETE") => A::DrainHost(id(h), None),
        (["hosts", _, "drain"], _) => return Err(not_allowed("POST, DELETE")),
        (["images"], "GET") => A::ListImages,
        (["images"], _) => return Err(not_allowed("GET")),
        (["images", "pull"], "POST") => A::PullImage(body(req)?),
        (["images", "pull"], _) => return Err(not_allowed("POST")),
        (["images", "import"], "POST") => A::ImportImage(body(req)?),
        (["images", "import"], _) => return Err(not_allowed("POST")),
        (["images", ..], m) => {
            let name = http::percent_decode(rest.strip_prefix("/images/").unwrap_or(""));
            match m {
                "GET" => A::GetImage(name),
                "DELETE" => A::RemoveImage(name),
                _ => return Err(not_allowed("GET, DELETE")),
            }
        }
        (["sandboxes"], "GET") => A::ListSandboxes,
        (["sandboxes"], "POST") => A::CreateSandbox(body(req)?),
        (["sandboxes"], _) => return Err(not_allowed("GET, POST")),
        (["sandboxes", s], "GET") => A::GetSandbox(id(s)),
        (["sandboxes", s], "DELETE") => A::RemoveSandbox(id(s), flag(req, "wait")?),
        (["sandboxes", _], _) => return Err(not_allowed("GET, DELETE")),
        (["sandboxes", s, "network"], "PUT") => A::SetNetwork(id(s), body(req)?),
        (["sandboxes", _, "network"], _) => return Err(not_allowed("PUT")),
        (["sandboxes", s, "ports", p], "GET") => {
            let port = p
                .parse::<u16>()
                .ok()
                .filter(|p| *p > 0)
                .ok_or_else(|| ApiError::new(ErrorKind::InvalidArgument, format!("port {p:?}: use 1-65535")))?;
            if !req.header("upgrade").is_some_and(|u| u.eq_ignore_ascii_case(http::PORT_UPGRADE)) {
                return Err(ApiError::new(
                    ErrorKind::InvalidArgument,
                    format!("a port stream needs Connection: Upgrade and Upgrade: {}", http::PORT_UPGRADE),
                ));
            }
            A::Port(id(s), port)
        }
        (["sandboxes", _, "ports", _], _) => return Err(not_allowed("GET")),
        (["sandboxes", s, op], "POST") => match *op {
            "checkpoint" => A::Checkpoint(id(s), body_or_default(req)?),
            "suspend" => A::Suspend(id(s)),
            "rollback" => A::Rollback(id(s), body(req)?),
            "baseline" => A::PublishBaseline(id(s), body(req)?),
            "copy" => A::Copy(id(s), body(req)?),
            "pause" => A::Pause(id(s)),
            "unpause" => A::Unpause(id(s)),
            "timeout" => A::SetTimeout(id(s), body(req)?),
            "exec" => exec_action(id(s), req)?,
            "logs" | "diff" | "metrics" => return Err(not_allowed("GET")),
            _ => return Err(no_route(req)),
        },
        (["sandboxes", s, op], "GET") => match *op {
            "logs" => A::Logs(id(s), flag(req, "output")?),
            "diff" => A::SandboxDiff(id(s)),
            "metrics" => A::Metrics(id(s)),
            "checkpoint" | "suspend" | "rollback" | "baseline" | "copy" | "pause" | "unpause" | "timeout" | "exec" => {
                return Err(not_allowed("POST"))
            }
            _ => return Err(no_route(req)),
        },
        (["snapshots"], "GET") => A::ListSnapshots(req.query_params("label")),
        (["snapshots"], _) => return Err(not_allowed("GET")),
        (["snapshots", "pull"], "POST") => A::PullSnapshot(body(req)?),
        (["snapshots", "pull"], _) => return Err(not_allowed("POST")),
        (["snapshots", s], "GET") => A::GetSnapshot(id(s)),
        (["snapshots", s], "DELETE") => A::RemoveSnapshot(id(s)),
        (["snapshots", _], _) => return Err(not_allowed("GET, DELETE")),
        (["snapshots", s, op], "POST") => match *op {
            "push" => A::PushSnapshot(id(s), body(req)?),
            "export" => A::Export(id(s), body(req)?),
            "resume" => A::Resume(id(s), body_or_default(req)?),
            "fork" => A::Fork(id(s), body_or_default(req)?),
            "evaluate" => A::Evaluate(id(s), body(req)?),
            "labels" => A::Label(id(s), body(req)?),
            "promote" => A::Promote(id(s)),
            "retain" => A::Retain(id(s), true),
            "release" => A::Retain(id(s), false),
            "logs" | "diff" | "evaluations" | "result" => return Err(not_allowed("GET")),
            _ => return Err(no_route(req)),
        },
        (["snapshots", s, op], "GET") => match *op {
            "logs" => A::Logs(id(s), flag(req, "output")?),
            "diff" if flag(req, "patch")? => A::Patch(id(s), req.query_param("against")),
            "diff" => A::SnapshotDiff(id(s)),
            "evaluations" => A::Evaluations(id(s)),
            "result" => A::SealedResult(id(s)),
            "push" | "export" | "resume" | "fork" | "evaluate" | "labels" | "retain" | "release" | "promote" => {
                return Err(not_allowed("POST"))
            }
            _ => return Err(no_route(req)),
        },
        (["gc"], "POST") => {
            let r: types::GcRequest = body_or_default(req)?;
            if [r.retention_secs, r.stale_after_secs].iter().flatten().any(|v| *v > i64::MAX as u64) {
                return Err(ApiError::new(ErrorKind::InvalidArgument, "durations are int64 seconds"));
            }
            A::Gc {
                retention: r.retention_secs.map(Duration::from_secs),
                stale_after: r.stale_after_secs.map(Duration::from_secs),
            }
        }
        (["gc"], _) => return Err(not_allowed("POST")),
        (["lineages"], "GET") => A::ListLineages,
        (["lineages"], _) => return Err(not_allowed("GET")),
        (["lineages", s], "GET") => A::Lineage(id(s)),
        (["lineages", _], _) => return Err(not_allowed("GET")),
        (["lineages", s, "resume"], "POST") => A::ResumeLineage(id(s), body_or_default(req)?),
        (["lineages", s, "retire"], "POST") => A::RetireLineage(id(s)),
        (["lineages", s, "close"], "POST") => A::CloseLineage(id(s), body(req)?),
        (["lineages", _, "resume" | "retire" | "close"], _) => return Err(not_allowed("POST")),
        (["sandboxes" | "snapshots", _, op], _) if known_op(segs[0], op) => {
            return Err(not_allowed(if matches!(*op, "logs" | "diff" | "evaluations" | "result") {
                "GET"
            } else {
                "POST"
            }))
        }
        _ => return Err(no_route(req)),
    };
    Ok(action)
}

fn no_route(req: &http::Request) -> ApiError {
    ApiError::new(ErrorKind::NotFound, format!("no route {} {}", req.method, req.path))
}

/// A boolean query parameter: absent or `false` is false, `true` (or
/// empty, `?output`) is true.
fn flag(req: &http::Request, key: &str) -> Result<bool, ApiError> {
    match req.query_param(key).as_deref() {
        None | Some("false") | Some("0") => Ok(false),
        Some("true") | Some("1") | Some("") => Ok(true),
        Some(v) => Err(ApiError::new(ErrorKind::InvalidArgument, format!("{key}={v:?}: use true or false"))),
    }
}

/// Whether `op` is an operation on a sandbox or snapshot (so another
/// method on it is a 405, not a 404).
fn known_op(on: &str, op: &str) -> bool {
    match on {
        "sandboxes" => {
            matches!(
                op,
                "checkpoint"
                    | "suspend"
                    | "rollback"
                    | "baseline"
                    | "copy"
                    | "pause"
                    | "unpause"
                    | "exec"
                    | "logs"
                    | "diff"
            )
        }
        _ => matches!(
            op,
            "promote"
                | "push"
                | "export"
                | "resume"
                | "fork"
                | "logs"
                | "diff"
                | "evaluate"
                | "evaluations"
                | "labels"
                | "retain"
                | "release"
                | "result"
        ),
    }
}

/// `POST /v1/sandboxes/{id}/exec`: buffered, or attached when the request
/// asks to upgrade to the exec stream protocol.
fn exec_action(id: String, req: &http::Request) -> Result<Action, ApiError> {
    let b: ExecRequestBody = body(req)?;
    let ereq = exec_request(&b)?;
    match req.header("upgrade") {
        None => Ok(Action::Exec(id, ereq, b.stdin.unwrap_or_default().into_bytes())),
        Some(u) if !u.eq_ignore_ascii_case(http::UPGRADE_PROTOCOL) => Err(ApiError::new(
            ErrorKind::InvalidArgument,
            format!("cannot upgrade to {u:?}; the attached exec protocol is {}", http::UPGRADE_PROTOCOL),
        )),
        Some(_) if b.stdin.is_some() => {
            Err(ApiError::new(ErrorKind::InvalidArgument, "stdin is sent as frames on an attached exec"))
        }
        Some(_) => Ok(Action::Attach(id, ereq)),
    }
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
                cgroup: if crate::cgroups::is_v2() { "v2" } else { "v1" }.into(),
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

/// A path under `/v1`: what follows `/v1`, and its segments, as [`parse`]
/// routes them (None: not under `/v1`).
fn segments(path: &str) -> Option<(&str, Vec<&str>)> {
    let rest = path.trim_end_matches('/').strip_prefix("/v1").filter(|r| r.is_empty() || r.starts_with('/'))?;
    Some((rest, rest.split('/').filter(|s| !s.is_empty()).collect()))
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
        Ok(Some((host, None))) => {
            ApiError::new(ErrorKind::Conflict, format!("sandbox {id} runs on host {host}; ask that host"))
        }
        Ok(Some((host, Some(why)))) => ApiError::new(
            ErrorKind::Conflict,
            format!("sandbox {id} runs on host {host}, which is down ({why}); ask that host once it is back"),
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
        crate::db::Claim::Claimed => {}
        crate::db::Claim::Done { status, body } if body.is_empty() => return Ok(Reply::Empty(status)),
        crate::db::Claim::Done { status, body } => return Ok(Reply::Json(status, body)),
        crate::db::Claim::Mismatch => {
            return Err(ApiError::new(
                ErrorKind::Unprocessable,
                format!("Idempotency-Key {key:?} was used with another request in the last 24 h"),
            ))
        }
        crate::db::Claim::InFlight => {
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
mod tests {
    use super::*;

    #[test]
    fn an_idempotency_fingerprint_holds_no_secret_value() {
        let with = |v: &str| format!(r#"{{"image": "a", "secret_env": ["TOKEN={v}"], "env": ["A=1"]}}"#);
        let (a, b) = (with("one"), with("two"));
        let cut = without_secret_values(a.as_bytes());
        assert!(!String::from_utf8_lossy(&cut).contains("one"));
        assert_eq!(cut, without_secret_values(b.as_bytes()));
        assert!(String::from_utf8_lossy(&cut).contains("TOKEN") && String::from_utf8_lossy(&cut).contains("A=1"));
        assert_eq!(&*without_secret_values(b"not json"), b"not json");
    }

    fn req(method: &str, path: &str, body: &str) -> http::Request {
        let (path, query) = path.split_once('?').unwrap_or((path, ""));
        http::Request {
            method: method.into(),
            path: path.into(),
            query: query.into(),
            body: body.as_bytes().to_vec(),
            ..Default::default()
        }
    }

    fn parsed(method: &str, path: &str, body: &str) -> Result<Action, ApiError> {
        parse(&req(method, path, body))
    }

    #[test]
    fn each_route_parses_to_its_operation() {
        assert!(matches!(parsed("GET", "/v1/version", ""), Ok(Action::Version)));
        assert!(matches!(parsed("GET", "/v1/sandboxes/", ""), Ok(Action::ListSandboxes)));
        assert!(matches!(parsed("GET", "/v1/hosts", ""), Ok(Action::ListHosts)));
        assert!(matches!(parsed("GET", "/v1/hosts/h1", ""), Ok(Action::GetHost(h)) if h == "h1"));
        assert!(matches!(
            parsed("POST", "/v1/hosts/h1/drain", r#"{"reason":"r"}"#),
            Ok(Action::DrainHost(h, Some(r))) if h == "h1" && r.reason.as_deref() == Some("r")
        ));
        assert!(matches!(parsed("DELETE", "/v1/hosts/h1/drain", ""), Ok(Action::DrainHost(_, None))));
        assert!(
            matches!(parsed("POST", "/v1/sandboxes", r#"{"image":"x"}"#), Ok(Action::CreateSandbox(c)) if c.image == "x")
        );
        assert!(
            matches!(parsed("DELETE", "/v1/sandboxes/abc", ""), Ok(Action::RemoveSandbox(id, false)) if id == "abc")
        );
        assert!(matches!(parsed("DELETE", "/v1/sandboxes/abc?wait=true", ""), Ok(Action::RemoveSandbox(_, true))));
        assert!(parsed("DELETE", "/v1/sandboxes/abc?wait=soon", "").is_err());
        assert!(matches!(parsed("GET", "/v1/images/a%2Fb:1", ""), Ok(Action::GetImage(n)) if n == "a/b:1"));
        assert!(matches!(parsed("GET", "/v1/snapshots/s1/logs", ""), Ok(Action::Logs(id, false)) if id == "s1"));
        assert!(matches!(parsed("GET", "/v1/sandboxes/s1/logs?output=true", ""), Ok(Action::Logs(_, true))));
        assert!(parsed("GET", "/v1/sandboxes/s1/logs?output=yes", "").is_err());
        assert!(matches!(
            parsed("GET", "/v1/snapshots?label=a%3Db&label=c", ""),
            Ok(Action::ListSnapshots(l)) if l == ["a=b", "c"]
        ));
        assert!(matches!(
            parsed("GET", "/v1/snapshots/s1/diff?patch=true&against=s0", ""),
            Ok(Action::Patch(id, Some(a))) if id == "s1" && a == "s0"
        ));
        assert!(matches!(parsed("GET", "/v1/snapshots/s1/diff", ""), Ok(Action::SnapshotDiff(_))));
        assert!(matches!(
            parsed("POST", "/v1/snapshots/s1/evaluate", r#"{"name":"t","version":"1","argv":["true"]}"#),
            Ok(Action::Evaluate(_, e)) if e.name == "t" && !e.again
        ));
        assert!(matches!(parsed("POST", "/v1/snapshots/s1/release", ""), Ok(Action::Retain(_, false))));
        assert!(matches!(parsed("GET", "/v1/snapshots/s1/result", ""), Ok(Action::SealedResult(_))));
        assert!(
            matches!(parsed("POST", "/v1/snapshots/s1/fork", ""), Ok(Action::Fork(id, l)) if id == "s1" && l.count.is_none())
        );
        assert!(matches!(
            parsed("POST", "/v1/gc", r#"{"retention_secs":5}"#),
            Ok(Action::Gc { retention: Some(r), stale_after: None }) if r == Duration::from_secs(5)
        ));
        assert!(matches!(
            parsed("POST", "/v1/sandboxes/abc/checkpoint", ""),
            Ok(Action::Checkpoint(id, c)) if id == "abc" && c.compression.is_none()
        ));
    }

    #[test]
    fn a_wrong_method_is_405_with_allow_and_an_unknown_path_404() {
        for (m, p, allow) in [
            ("POST", "/v1/version", "GET"),
            ("PUT", "/v1/sandboxes", "GET, POST"),
            ("POST", "/v1/sandboxes/abc", "GET, DELETE"),
            ("GET", "/v1/sandboxes/abc/exec", "POST"),
            ("DELETE", "/v1/sandboxes/abc/pause", "POST"),
            ("POST", "/v1/sandboxes/abc/logs", "GET"),
            ("PUT", "/v1/snapshots/abc/diff", "GET"),
            ("GET", "/v1/lineages/w/retire", "POST"),
            ("POST", "/v1/lineages", "GET"),
            ("POST", "/v1/hosts", "GET"),
            ("DELETE", "/v1/hosts/h1", "GET"),
            ("GET", "/v1/hosts/h1/drain", "POST, DELETE"),
        ] {
            let e = parsed(m, p, "").unwrap_err();
            assert_eq!((e.kind, e.allow), (ErrorKind::MethodNotAllowed, Some(allow)), "{m} {p}");
        }
        for (m, p) in [("GET", "/version"), ("GET", "/v1/nope"), ("POST", "/v1/sandboxes/abc/nope"), ("GET", "/v1x")] {
            assert_eq!(parsed(m, p, "").unwrap_err().kind, ErrorKind::NotFound, "{m} {p}");
        }
    }

    #[test]
    fn bodies_are_checked_before_anything_runs() {
        for (p, body) in [
            ("/v1/sandboxes", "[]"),
            ("/v1/sandboxes", r#"{"image":"x","bogus":1}"#),
            ("/v1/sandboxes/abc/exec", r#"{"argv":["true"],"timeout":-1}"#),
            ("/v1/gc", r#"{"retention_secs":18446744073709551615}"#),
            ("/v1/sandboxes/abc/rollback", ""),
        ] {
            assert_eq!(parsed("POST", p, body).unwrap_err().kind, ErrorKind::InvalidArgument, "{p} {body}");
        }
    }

    #[test]
    fn an_operations_error_keeps_its_kind_and_its_doc_comment_message() {
        use crate::daemon::{CreateError, LaunchError};
        let e = ApiError::from(CreateError::Launch(LaunchError::Full { live: 3, max: 3 }));
        assert_eq!(e.kind, ErrorKind::LimitReached);
        assert_eq!(e.message, "sandbox limit reached: 3 of 3 live (daemon --max-sandboxes)");
        let e = ApiError::from(CreateError::NoImage("busybox".parse().unwrap()));
        assert_eq!((e.kind, e.message.as_str()), (ErrorKind::NotFound, "image busybox:latest not found"));
        let bad = "nope:".parse::<crate::ids::ImageName>().unwrap_err();
        let e = ApiError::from(CreateError::Name(bad));
        assert_eq!(e.kind, ErrorKind::InvalidArgument);
        assert!(e.message.starts_with("invalid image name \"nope:\""), "{}", e.message);
    }

    #[test]
    fn an_exec_is_attached_only_when_it_asks_for_the_exec_protocol() {
        let mut r = req("POST", "/v1/sandboxes/abc/exec", r#"{"argv":["sh"]}"#);
        assert!(
            matches!(parse(&r), Ok(Action::Exec(id, e, stdin)) if id == "abc" && e.argv == ["sh"] && stdin.is_empty())
        );
        r.headers.push(("Upgrade".into(), http::UPGRADE_PROTOCOL.into()));
        assert!(matches!(parse(&r), Ok(Action::Attach(id, _)) if id == "abc"));
        r.body = br#"{"argv":["sh"],"stdin":"x"}"#.to_vec();
        assert_eq!(parse(&r).unwrap_err().kind, ErrorKind::InvalidArgument);
        r.headers[0].1 = "websocket".into();
        r.body = br#"{"argv":["sh"]}"#.to_vec();
        assert_eq!(parse(&r).unwrap_err().kind, ErrorKind::InvalidArgument);
    }
}
