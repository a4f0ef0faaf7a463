//! A request parsed, with no I/O: its route, method, headers and body
//! become an [`Action`] (or the error the API answers: 404, 405 with its
//! `Allow` list, 400 for a bad body), before anything runs.

use std::time::Duration;

use serde::de::DeserializeOwned;

use crate::error::ErrorKind;
use crate::sandbox::ExecRequest;
use crate::types::{self, CreateRequest, ExecRequestBody, ImportRequest};

use super::{http, ApiError};

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
    PublishBaseline(String, crate::daemon::publish::PublishRequest),
    Copy(String, crate::sandbox::copy::CopyRequest),
    Pause(String),
    Unpause(String),
    SetTimeout(String, types::TimeoutRequest),
    /// `PUT /v1/sandboxes/{id}/network`: a new egress policy, live.
    SetNetwork(String, types::NetworkRequest),
    SetLimits(String, types::LimitsRequest),
    StartProcess(String, types::ProcessRequest),
    ListProcesses(String),
    GetProcess(String, u64, Option<u64>),
    SignalProcess(String, u64, types::SignalRequest),
    ForgetProcess(String, u64),
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
            A::SetLimits(..) => "set_limits",
            A::StartProcess(..) => "start_process",
            A::ListProcesses(_) => "list_processes",
            A::GetProcess(..) => "get_process",
            A::SignalProcess(..) => "signal_process",
            A::ForgetProcess(..) => "forget_process",
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
                | A::StartProcess(..)
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
    let id = |s: &&str| s.to_string();

    use Action as A;
    let action = match (segs.as_slice(), m) {
        (["version"], "GET") => A::Version,
        (["info"], "GET") => A::Info,
        (["df"], "GET") => A::DiskUsage,
        (["drain"], "POST") => A::Drain(Some(body_or_default(req)?)),
        (["drain"], "DELETE") => A::Drain(None),
        (["hosts"], "GET") => A::ListHosts,
        (["hosts", h], "GET") => A::GetHost(id(h)),
        (["hosts", h, "drain"], "POST") => A::DrainHost(id(h), Some(body_or_default(req)?)),
        (["hosts", h, "drain"], "DELETE") => A::DrainHost(id(h), None),
        (["images"], "GET") => A::ListImages,
        (["images", "pull"], "POST") => A::PullImage(body(req)?),
        (["images", "import"], "POST") => A::ImportImage(body(req)?),
        // Not image names: another method is the table's 405.
        (["images", "pull" | "import"], _) => return Err(unrouted(req, &segs)),
        (["images", _, ..], m) => {
            let name = http::percent_decode(rest.strip_prefix("/images/").unwrap_or(""));
            match m {
                "GET" => A::GetImage(name),
                "DELETE" => A::RemoveImage(name),
                _ => return Err(unrouted(req, &segs)),
            }
        }
        (["sandboxes"], "GET") => A::ListSandboxes,
        (["sandboxes"], "POST") => A::CreateSandbox(body(req)?),
        (["sandboxes", s], "GET") => A::GetSandbox(id(s)),
        (["sandboxes", s], "DELETE") => A::RemoveSandbox(id(s), flag(req, "wait")?),
        (["sandboxes", s, "network"], "PUT") => A::SetNetwork(id(s), body(req)?),
        (["sandboxes", s, "limits"], "PUT") => A::SetLimits(id(s), body(req)?),
        (["sandboxes", s, "processes", n], "GET") => A::GetProcess(id(s), process_id(n)?, wait_secs(req)?),
        (["sandboxes", s, "processes", n], "DELETE") => A::ForgetProcess(id(s), process_id(n)?),
        (["sandboxes", s, "processes", n, "signal"], "POST") => A::SignalProcess(id(s), process_id(n)?, body(req)?),
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
            "processes" => A::StartProcess(id(s), body(req)?),
            _ => return Err(unrouted(req, &segs)),
        },
        (["sandboxes", s, op], "GET") => match *op {
            "processes" => A::ListProcesses(id(s)),
            "logs" => A::Logs(id(s), flag(req, "output")?),
            "diff" => A::SandboxDiff(id(s)),
            "metrics" => A::Metrics(id(s)),
            _ => return Err(unrouted(req, &segs)),
        },
        (["snapshots"], "GET") => A::ListSnapshots(req.query_params("label")),
        (["snapshots", "pull"], "POST") => A::PullSnapshot(body(req)?),
        (["snapshots", "pull"], _) => return Err(unrouted(req, &segs)),
        (["snapshots", s], "GET") => A::GetSnapshot(id(s)),
        (["snapshots", s], "DELETE") => A::RemoveSnapshot(id(s)),
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
            _ => return Err(unrouted(req, &segs)),
        },
        (["snapshots", s, op], "GET") => match *op {
            "logs" => A::Logs(id(s), flag(req, "output")?),
            "diff" if flag(req, "patch")? => A::Patch(id(s), req.query_param("against")),
            "diff" => A::SnapshotDiff(id(s)),
            "evaluations" => A::Evaluations(id(s)),
            "result" => A::SealedResult(id(s)),
            _ => return Err(unrouted(req, &segs)),
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
        (["lineages"], "GET") => A::ListLineages,
        (["lineages", s], "GET") => A::Lineage(id(s)),
        (["lineages", s, "resume"], "POST") => A::ResumeLineage(id(s), body_or_default(req)?),
        (["lineages", s, "retire"], "POST") => A::RetireLineage(id(s)),
        (["lineages", s, "close"], "POST") => A::CloseLineage(id(s), body(req)?),
        _ => return Err(unrouted(req, &segs)),
    };
    Ok(action)
}

/// Every route under `/v1` and the methods it takes, first match wins:
/// `*` is one segment, `**` one or more (an image name has slashes). A
/// request whose path is here and whose method is not is a 405 with this
/// `Allow`; a path not here is a 404. `parse`'s match dispatches; the test
/// `the_route_table_is_what_parse_routes` checks that the two agree.
pub(super) const ROUTES: &[(&str, &str)] = &[
    ("version", "GET"),
    ("info", "GET"),
    ("df", "GET"),
    ("drain", "POST, DELETE"),
    ("hosts", "GET"),
    ("hosts/*", "GET"),
    ("hosts/*/drain", "POST, DELETE"),
    ("images", "GET"),
    ("images/pull", "POST"),
    ("images/import", "POST"),
    ("images/**", "GET, DELETE"),
    ("sandboxes", "GET, POST"),
    ("sandboxes/*", "GET, DELETE"),
    ("sandboxes/*/network", "PUT"),
    ("sandboxes/*/limits", "PUT"),
    ("sandboxes/*/processes", "GET, POST"),
    ("sandboxes/*/processes/*", "GET, DELETE"),
    ("sandboxes/*/processes/*/signal", "POST"),
    ("sandboxes/*/ports/*", "GET"),
    ("sandboxes/*/checkpoint", "POST"),
    ("sandboxes/*/suspend", "POST"),
    ("sandboxes/*/rollback", "POST"),
    ("sandboxes/*/baseline", "POST"),
    ("sandboxes/*/copy", "POST"),
    ("sandboxes/*/pause", "POST"),
    ("sandboxes/*/unpause", "POST"),
    ("sandboxes/*/timeout", "POST"),
    ("sandboxes/*/exec", "POST"),
    ("sandboxes/*/logs", "GET"),
    ("sandboxes/*/diff", "GET"),
    ("sandboxes/*/metrics", "GET"),
    ("snapshots", "GET"),
    ("snapshots/pull", "POST"),
    ("snapshots/*", "GET, DELETE"),
    ("snapshots/*/push", "POST"),
    ("snapshots/*/export", "POST"),
    ("snapshots/*/resume", "POST"),
    ("snapshots/*/fork", "POST"),
    ("snapshots/*/evaluate", "POST"),
    ("snapshots/*/labels", "POST"),
    ("snapshots/*/promote", "POST"),
    ("snapshots/*/retain", "POST"),
    ("snapshots/*/release", "POST"),
    ("snapshots/*/logs", "GET"),
    ("snapshots/*/diff", "GET"),
    ("snapshots/*/evaluations", "GET"),
    ("snapshots/*/result", "GET"),
    ("gc", "POST"),
    ("lineages", "GET"),
    ("lineages/*", "GET"),
    ("lineages/*/resume", "POST"),
    ("lineages/*/retire", "POST"),
    ("lineages/*/close", "POST"),
];

/// The methods the route `segs` matches takes (`None`: no such route).
fn allowed(segs: &[&str]) -> Option<&'static str> {
    ROUTES.iter().find(|(pattern, _)| route_matches(pattern, segs)).map(|(_, allow)| *allow)
}

fn route_matches(pattern: &str, segs: &[&str]) -> bool {
    let parts: Vec<&str> = pattern.split('/').collect();
    match parts.split_last() {
        Some((&"**", head)) => segs.len() > head.len() && route_matches(&head.join("/"), &segs[..head.len()]),
        _ => parts.len() == segs.len() && parts.iter().zip(segs).all(|(p, s)| *p == "*" || p == s),
    }
}

/// What a request `parse` does not route gets: 405 with the route's
/// `Allow` if the path is a route, else 404.
fn unrouted(req: &http::Request, segs: &[&str]) -> ApiError {
    match allowed(segs) {
        Some(allow) => ApiError {
            allow: Some(allow),
            ..ApiError::new(
                ErrorKind::MethodNotAllowed,
                format!("method {} not allowed on {} (allowed: {allow})", req.method, req.path),
            )
        },
        None => ApiError::new(ErrorKind::NotFound, format!("no route {} {}", req.method, req.path)),
    }
}

/// A process's id in a path.
fn process_id(n: &str) -> Result<u64, ApiError> {
    n.parse().map_err(|_| ApiError::new(ErrorKind::InvalidArgument, format!("process id {n:?} is not a number")))
}

/// `?wait=SECS` (checked against its maximum by the daemon).
fn wait_secs(req: &http::Request) -> Result<Option<u64>, ApiError> {
    req.query_param("wait")
        .map(|v| v.parse().map_err(|_| ApiError::new(ErrorKind::InvalidArgument, format!("wait={v:?}: use seconds"))))
        .transpose()
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

/// A path under `/v1`: what follows `/v1`, and its segments, as [`parse`]
/// routes them (None: not under `/v1`).
pub(super) fn segments(path: &str) -> Option<(&str, Vec<&str>)> {
    let rest = path.trim_end_matches('/').strip_prefix("/v1").filter(|r| r.is_empty() || r.starts_with('/'))?;
    Some((rest, rest.split('/').filter(|s| !s.is_empty()).collect()))
}
