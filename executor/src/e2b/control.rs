//! E2B's control API (the routes the current SDK calls), on the daemon's
//! own operations: a sandbox is a Strata sandbox with a work context of
//! its own; pause suspends it into that lineage and connect resumes the
//! lineage (files kept, processes not); a timeout is the sandbox's
//! deadline (kill, or pause with `autoPause`); snapshots are checkpoints.
//! Every row names the API key that made it (as a hash) and only that key
//! sees it.

use std::collections::BTreeMap;
use std::sync::Arc;

use serde_json::{json, Value};

use super::listing::{Paging, SandboxFilter};
use super::{E2b, Req, Resp};
use crate::catalog::{E2bSandbox, E2bSnapshot, E2bSpec};
use crate::daemon::lock;
use crate::error::{chain, Classify, ErrorKind};
use crate::model::OnTimeout;
use crate::types::{CreateRequest, LaunchRequest, SandboxInfo};

/// The envd version reported: every feature gate of the SDK (2.63) open.
pub const ENVD_VERSION: &str = "0.6.4";
/// Seconds a sandbox lives when its create names no timeout (E2B's).
pub const DEFAULT_TIMEOUT: u64 = 300;
/// The longest timeout accepted (E2B Pro's 24 h).
pub const MAX_TIMEOUT: u64 = 86_400;
/// Most forks one call makes (E2B's).
pub const MAX_FORKS: u64 = 20;
/// Most sandboxes (or snapshots) one list page holds.
pub const MAX_PAGE: usize = 100;

/// A control API error: status and message, as E2B's `Error` body.
#[derive(Debug)]
pub struct ApiError {
    pub status: u16,
    pub message: String,
}

impl ApiError {
    pub fn new(status: u16, message: impl Into<String>) -> ApiError {
        ApiError { status, message: message.into() }
    }
    pub(super) fn bad(message: impl Into<String>) -> ApiError {
        ApiError::new(400, message)
    }
    fn not_found(id: &str) -> ApiError {
        ApiError::new(404, format!("sandbox {id} not found"))
    }
}

/// A daemon operation's error, by its kind.
impl<E: Classify> From<E> for ApiError {
    fn from(e: E) -> Self {
        let status = match e.kind() {
            ErrorKind::InvalidArgument | ErrorKind::Unprocessable => 400,
            ErrorKind::NotFound => 404,
            ErrorKind::Conflict => 409,
            // 429 would make the SDK retry silently; say it once.
            ErrorKind::LimitReached => 409,
            ErrorKind::NoSpace => 507,
            _ => 500,
        };
        ApiError::new(status, chain(&e))
    }
}

pub(super) type Result<T> = std::result::Result<T, ApiError>;

fn body(req: &Req) -> Result<serde_json::Map<String, Value>> {
    if req.body.iter().all(u8::is_ascii_whitespace) {
        return Ok(serde_json::Map::new());
    }
    match serde_json::from_slice(&req.body) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) => Err(ApiError::bad("the request body must be a JSON object")),
        Err(e) => Err(ApiError::bad(format!("invalid JSON body: {e}"))),
    }
}

fn strings(v: Option<&Value>, what: &str) -> Result<BTreeMap<String, String>> {
    match v {
        None | Some(Value::Null) => Ok(BTreeMap::new()),
        Some(Value::Object(m)) => m
            .iter()
            .map(|(k, v)| match v {
                Value::String(s) => Ok((k.clone(), s.clone())),
                _ => Err(ApiError::bad(format!("{what}.{k} must be a string"))),
            })
            .collect(),
        Some(_) => Err(ApiError::bad(format!("{what} must be an object of strings"))),
    }
}

fn timeout(v: Option<&Value>, default: u64) -> Result<u64> {
    match v {
        None | Some(Value::Null) => Ok(default),
        Some(t) => match t.as_u64() {
            Some(t) if (1..=MAX_TIMEOUT).contains(&t) => Ok(t),
            _ => Err(ApiError::bad(format!("timeout {t} must be between 1 and {MAX_TIMEOUT} seconds"))),
        },
    }
}

/// Why a pause or snapshot that keeps memory is refused.
const NO_MEMORY: &str =
    "memory snapshots are not supported: pauses and snapshots keep the filesystem only (mode \"filesystem\"); processes are not kept";

/// An optional boolean field.
fn flag(b: &serde_json::Map<String, Value>, key: &str) -> Result<bool> {
    match b.get(key) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(v)) => Ok(*v),
        Some(_) => Err(ApiError::bad(format!("{key} must be true or false"))),
    }
}

fn random_hex(bytes: usize) -> String {
    let mut b = vec![0u8; bytes];
    rand::RngCore::fill_bytes(&mut rand::rngs::OsRng, &mut b);
    hex::encode(b)
}

fn now_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64)
}

fn time(ms: i64) -> String {
    super::fs::rfc3339(ms.div_euclid(1000), ms.rem_euclid(1000) * 1_000_000)
}

/// Where an E2B sandbox is now.
enum Run {
    Running(Box<SandboxInfo>),
    Paused,
    /// Its Strata sandbox runs on another host of the fleet (the catalog
    /// says which): listed as running, changed only through that host.
    Elsewhere(String),
}

impl Run {
    /// The running sandbox here, or 409 saying why not (`paused`: what a
    /// paused one is told).
    fn here(self, id: &str, paused: &str) -> Result<Box<SandboxInfo>> {
        match self {
            Run::Running(info) => Ok(info),
            Run::Paused => Err(ApiError::new(409, format!("sandbox {id} {paused}"))),
            Run::Elsewhere(host) => Err(elsewhere(id, &host)),
        }
    }
}

/// The answer to a change asked of a sandbox another host runs.
fn elsewhere(id: &str, host: &str) -> ApiError {
    ApiError::new(409, format!("sandbox {id} runs on host {host}; ask that host's E2B API"))
}

impl E2b {
    /// The lock that orders lifecycle changes of one E2B sandbox (pause,
    /// connect, kill, and reconciling a row whose Strata sandbox is gone).
    fn hold(&self, id: &str) -> Arc<std::sync::Mutex<()>> {
        lock(&self.lifecycle).entry(id.to_string()).or_default().clone()
    }

    /// The row of `id` if `owner` made it, with where it runs now (see
    /// [`E2b::sandbox_held`]); takes the sandbox's lifecycle lock when the
    /// row needs reconciling.
    fn sandbox(&self, owner: &str, id: &str) -> Result<(E2bSandbox, Run)> {
        let row =
            lock(&self.d.db).e2b_sandbox(id)?.filter(|r| r.owner == owner).ok_or_else(|| ApiError::not_found(id))?;
        self.locate(owner, row)
    }

    /// Where the sandbox of a row read just now runs.
    fn locate(&self, owner: &str, row: E2bSandbox) -> Result<(E2bSandbox, Run)> {
        let id = row.id.clone();
        match row.sandbox.as_deref().map(|s| self.d.sandbox(s)) {
            None => Ok((row, Run::Paused)),
            Some(Ok(sb)) => Ok((row, Run::Running(Box::new(crate::daemon::sandbox_info(&sb))))),
            Some(Err(_)) => {
                let held = self.hold(&id);
                let _g = lock(&held);
                self.sandbox_held(owner, &id)
            }
        }
    }

    /// As [`E2b::sandbox`], its lifecycle lock held by the caller. A row
    /// whose Strata sandbox is not live here is another host's if the
    /// catalog places it there, starting or stopping here if the catalog
    /// still has it on this host; else it was ended by a daemon (its
    /// deadline): paused if that suspended it (its work context's head is
    /// a snapshot of that sandbox), else gone: the row is dropped and its
    /// work context retired.
    fn sandbox_held(&self, owner: &str, id: &str) -> Result<(E2bSandbox, Run)> {
        let row =
            lock(&self.d.db).e2b_sandbox(id)?.filter(|r| r.owner == owner).ok_or_else(|| ApiError::not_found(id))?;
        let Some(current) = row.sandbox.clone() else { return Ok((row, Run::Paused)) };
        if let Ok(sb) = self.d.sandbox(&current) {
            return Ok((row, Run::Running(Box::new(crate::daemon::sandbox_info(&sb)))));
        }
        match lock(&self.d.db).sandbox_place(&current)?.map(|(host, _)| host) {
            Some(Some(h)) if h != self.d.cfg.host_id => return Ok((row, Run::Elsewhere(h))),
            Some(_) => return Err(ApiError::new(409, format!("sandbox {id} is starting or stopping here; try again"))),
            None => {}
        }
        self.forget_processes(&current);
        let suspended =
            self.d.lineage(&row.work_context).ok().and_then(|l| l.checkpoints.last().cloned()).is_some_and(|head| {
                head.source_sandbox == current && head.class == crate::model::SnapshotClass::Checkpoint
            });
        if suspended {
            lock(&self.d.db).set_e2b_sandbox_run(id, None, row.started_at)?;
            return Ok((E2bSandbox { sandbox: None, ..row }, Run::Paused));
        }
        self.drop_row(&row);
        Err(ApiError::not_found(id))
    }

    /// Forget an E2B sandbox: its row, its lock, its work context.
    fn drop_row(&self, row: &E2bSandbox) {
        if let Err(e) = lock(&self.d.db).delete_e2b_sandbox(&row.id) {
            tracing::warn!("e2b {}: delete its row: {}", row.id, chain(&e));
        }
        lock(&self.lifecycle).remove(&row.id);
        if let Err(e) = self.d.retire_lineage(&row.work_context) {
            tracing::warn!("e2b {}: retire work context {}: {}", row.id, row.work_context, chain(&e));
        }
    }

    /// The `Sandbox` model a create or connect answers.
    fn created(&self, row: &E2bSandbox) -> Value {
        json!({
            "templateID": row.template,
            "sandboxID": row.id,
            "clientID": self.client_id(),
            "envdVersion": ENVD_VERSION,
            "envdAccessToken": row.token,
            "trafficAccessToken": row.spec.traffic_token,
            "alias": row.template,
            "domain": self.domain,
        })
    }

    fn client_id(&self) -> String {
        nix::unistd::gethostname().map(|h| h.to_string_lossy().into_owned()).unwrap_or_else(|_| "strata".into())
    }

    /// `SandboxDetail` / `ListedSandbox`.
    fn detail(&self, row: &E2bSandbox, run: &Run) -> Value {
        let paused = (crate::daemon::cpu_count(), crate::daemon::memory_total() >> 20, 0);
        let (state, cpus, memory, disk, end) = match run {
            Run::Running(info) => (
                "running",
                info.limits.cpus.map_or_else(crate::daemon::cpu_count, |c| c.ceil() as u64),
                info.limits.memory.unwrap_or_else(crate::daemon::memory_total) >> 20,
                info.limits.disk.unwrap_or(0) >> 20,
                info.lifetime.deadline_ms.unwrap_or(row.started_at + row.spec.timeout as i64 * 1000),
            ),
            Run::Paused => ("paused", paused.0, paused.1, paused.2, row.started_at),
            // What that host gives it is in its own answers; here its
            // start and timeout.
            Run::Elsewhere(_) => {
                ("running", paused.0, paused.1, paused.2, row.started_at + row.spec.timeout as i64 * 1000)
            }
        };
        let mut v = json!({
            "templateID": row.template,
            "sandboxID": row.id,
            "clientID": self.client_id(),
            "alias": row.template,
            "startedAt": time(row.started_at),
            "endAt": time(end),
            "envdVersion": ENVD_VERSION,
            "cpuCount": cpus,
            "memoryMB": memory,
            "diskSizeMB": disk,
            "state": state,
            "metadata": row.spec.metadata,
            "envdAccessToken": row.token,
            "lifecycle": {"autoResume": false, "onTimeout": if row.spec.auto_pause { "pause" } else { "kill" }},
        });
        if matches!(run, Run::Paused) {
            // What a pause keeps: files, not processes or memory.
            v["pauseMode"] = json!("filesystem");
        }
        v
    }

    fn env(spec: &E2bSpec) -> Vec<String> {
        spec.env.iter().map(|(k, v)| format!("{k}={v}")).collect()
    }

    fn on_timeout(spec: &E2bSpec) -> OnTimeout {
        if spec.auto_pause {
            OnTimeout::Suspend
        } else {
            OnTimeout::Remove
        }
    }

    /// `POST /v2/sandboxes`.
    pub fn create(self: &Arc<Self>, owner: &str, req: &Req) -> Result<Resp> {
        let b = body(req)?;
        let template = match b.get("templateID") {
            Some(Value::String(t)) if !t.is_empty() => t.clone(),
            _ => return Err(ApiError::bad("templateID is required")),
        };
        let net = super::network::create_options(&b, self.d.networked())?;
        // What E2B offers and Strata does not: refused, not ignored.
        for key in ["mcp", "iam"] {
            if b.get(key).is_some_and(|v| !v.is_null()) {
                return Err(ApiError::bad(format!("{key} is not supported by Strata's E2B API")));
            }
        }
        if b.get("volumeMounts").is_some_and(|v| v.as_array().is_none_or(|a| !a.is_empty())) {
            return Err(ApiError::bad("volumeMounts are not supported by Strata's E2B API"));
        }
        let auto_pause = flag(&b, "autoPause")?;
        if flag(&b, "autoPauseMemory")? {
            return Err(ApiError::bad(NO_MEMORY));
        }
        if b.get("autoResume").and_then(|a| a.get("enabled")).is_some_and(|e| e == &Value::Bool(true)) {
            return Err(ApiError::bad("autoResume is not supported: connect to a paused sandbox to resume it"));
        }
        // Secret envVars (the operator's policy) go to the sandbox only:
        // never into the E2B row's spec, the catalog's sandbox row or an
        // artifact (`daemon/secrets.rs`).
        let (secret, env): (BTreeMap<_, _>, BTreeMap<_, _>) =
            strings(b.get("envVars"), "envVars")?.into_iter().partition(|(k, _)| super::is_secret(&self.secret_env, k));
        let secret_env: Vec<String> = secret.iter().map(|(k, v)| format!("{k}={v}")).collect();
        let spec = E2bSpec {
            metadata: strings(b.get("metadata"), "metadata")?,
            env,
            auto_pause,
            timeout: timeout(b.get("timeout"), DEFAULT_TIMEOUT)?,
            traffic_token: net.private.then(|| random_hex(16)),
        };
        let snapshot = lock(&self.d.db).e2b_snapshots(owner)?.into_iter().find(|s| s.id == template);
        let info = match snapshot {
            // A snapshot of this key's: a new sandbox forked from it.
            Some(s) => {
                self.d.fork(&s.id, LaunchRequest { network: net.request, secret_env, ..self.launch(&spec) })?.remove(0)
            }
            None => {
                if self.d.get_image(&template).is_err() {
                    return Err(ApiError::new(
                        404,
                        format!("template {template:?} not found (an image name or a snapshot id)"),
                    ));
                }
                self.d.create_sandbox(CreateRequest {
                    image: template.clone(),
                    env: Self::env(&spec),
                    secret_env,
                    timeout: Some(spec.timeout),
                    on_timeout: Some(Self::on_timeout(&spec)),
                    network: net.request,
                    disk: self.disk,
                    ..Default::default()
                })?
            }
        };
        let row = self.record(owner, template, spec, &info)?;
        Ok(Resp::json(201, self.created(&row)))
    }

    /// Record a new E2B sandbox run by the Strata sandbox `info` (removed
    /// again if the row cannot be written).
    fn record(&self, owner: &str, template: String, spec: E2bSpec, info: &SandboxInfo) -> Result<E2bSandbox> {
        let row = E2bSandbox {
            id: format!("i{}", random_hex(10)),
            owner: owner.to_string(),
            token: random_hex(16),
            template,
            work_context: info.work_context.clone().unwrap_or_default(),
            spec,
            sandbox: Some(info.id.clone()),
            started_at: now_ms(),
        };
        if let Err(e) = lock(&self.d.db).insert_e2b_sandbox(&row) {
            let _ = self.d.remove_sandbox(&info.id);
            return Err(e.into());
        }
        Ok(row)
    }

    /// `POST /sandboxes/{id}/fork`: a checkpoint of it (it keeps running),
    /// then `count` new sandboxes from that checkpoint, each with its
    /// metadata, env and timeout behaviour; each succeeds or fails alone.
    pub fn fork(&self, owner: &str, id: &str, req: &Req) -> Result<Resp> {
        let b = body(req)?;
        let count = match b.get("count") {
            None | Some(Value::Null) => 1,
            Some(c) => c
                .as_u64()
                .filter(|c| (1..=MAX_FORKS).contains(c))
                .ok_or_else(|| ApiError::bad(format!("count {c} must be between 1 and {MAX_FORKS}")))?,
        };
        let (row, run) = self.sandbox(owner, id)?;
        let info = run.here(id, "is paused; connect to it first")?;
        let spec = E2bSpec { timeout: timeout(b.get("timeout"), row.spec.timeout)?, ..row.spec.clone() };
        // Each fork has a traffic token of its own, if its parent has one.
        let token = || spec.traffic_token.as_ref().map(|_| random_hex(16));
        let snap = self.d.checkpoint(&info.id, crate::model::BlobCompression::default(), false)?;
        // A fork gets its parent's secret env, as E2B's gets its envVars.
        let secret_env = self.d.secrets.read(&row.work_context).map_err(|e| ApiError::new(500, e.to_string()))?;
        let results: Vec<Value> = (0..count)
            .map(|_| {
                let launch = LaunchRequest { secret_env: secret_env.clone().unwrap_or_default(), ..self.launch(&spec) };
                let child = self.d.fork(snap.id.as_str(), launch).map_err(ApiError::from).and_then(|mut made| {
                    let spec = E2bSpec { traffic_token: token(), ..spec.clone() };
                    self.record(owner, row.template.clone(), spec, &made.remove(0))
                });
                match child {
                    Ok(child) => json!({"sandbox": self.created(&child)}),
                    Err(e) => json!({"error": {"code": e.status, "message": e.message}}),
                }
            })
            .collect();
        Ok(Resp::json(201, Value::Array(results)))
    }

    /// `PUT /sandboxes/{id}/network`: its egress rules replaced (new
    /// connections follow them at once).
    pub fn update_network(&self, owner: &str, id: &str, req: &Req) -> Result<Resp> {
        let request = super::network::update_request(&body(req)?)?;
        let (_, run) = self.sandbox(owner, id)?;
        let info = run.here(id, "is paused; connect to it first")?;
        self.d.set_network(&info.id, request)?;
        Ok(Resp::empty(204))
    }

    /// A resume's or fork's settings from what the create asked for.
    fn launch(&self, spec: &E2bSpec) -> LaunchRequest {
        LaunchRequest {
            disk: self.disk,
            env: Self::env(spec),
            timeout: Some(spec.timeout),
            on_timeout: Some(Self::on_timeout(spec)),
            ..Default::default()
        }
    }

    /// `GET /sandboxes/{id}`.
    pub fn get(&self, owner: &str, id: &str) -> Result<Resp> {
        let (row, run) = self.sandbox(owner, id)?;
        Ok(Resp::json(200, self.detail(&row, &run)))
    }

    /// `GET /v2/sandboxes` (and `/sandboxes`): filtered by metadata,
    /// state, template and start time, newest first (`order=asc`: oldest),
    /// paged by `limit` and `nextToken` (see [`super::listing`]).
    pub fn list(&self, owner: &str, req: &Req) -> Result<Resp> {
        let filter = SandboxFilter::parse(req)?;
        let paging = Paging::parse(req)?;
        let rows = lock(&self.d.db).e2b_sandboxes(owner)?;
        let mut kept = Vec::new();
        for row in rows {
            if !filter.keeps(&row.template, row.started_at, &row.spec.metadata) {
                continue;
            }
            let Ok((row, run)) = self.locate(owner, row) else { continue };
            if filter.keeps_state(if matches!(run, Run::Paused) { "paused" } else { "running" }) {
                kept.push((row, run));
            }
        }
        let (page, next) = paging.page(kept, |(r, _)| (r.started_at, r.id.as_str()));
        let list: Vec<Value> = page.iter().map(|(r, run)| self.detail(r, run)).collect();
        let mut resp = Resp::json(200, Value::Array(list));
        if let Some(token) = next {
            resp.headers.push(("x-next-token", token));
        }
        Ok(resp)
    }

    /// `GET /sandboxes/{id}/metrics`: E2B's `SandboxMetric`s from `start`
    /// to `end` (unix seconds, both optional), one each 5 s while it ran
    /// on this daemon (see `daemon::metrics`) and one taken now; none for
    /// a paused sandbox.
    pub fn metrics(&self, owner: &str, id: &str, req: &Req) -> Result<Resp> {
        let secs = |k: &str| -> Result<Option<i64>> {
            req.query(k)
                .map(|v| {
                    v.parse::<i64>().map_err(|_| ApiError::bad(format!("{k} {v:?} is not a unix time in seconds")))
                })
                .transpose()
        };
        let (start, end) = (secs("start")?.map(|s| s * 1000), secs("end")?.map(|e| e * 1000 + 999));
        let (_, run) = self.sandbox(owner, id)?;
        if matches!(run, Run::Paused) {
            return Ok(Resp::json(200, json!([])));
        }
        let info = run.here(id, "is paused")?;
        let samples = self.d.sandbox_metrics_between(&info.id, start, end)?;
        Ok(Resp::json(200, Value::Array(samples.iter().map(e2b_metric).collect())))
    }

    /// `DELETE /sandboxes/{id}`: the sandbox, its processes and its work
    /// context (retired: nothing resumes it; gc collects it).
    pub fn kill(&self, owner: &str, id: &str) -> Result<Resp> {
        let held = self.hold(id);
        let _g = lock(&held);
        let (row, run) = self.sandbox_held(owner, id)?;
        // Another host's is removed by that host; one whose host is down
        // (lost, as far as the fleet knows) is forgotten here (its row and
        // work context) and its catalog row marked stopped, which that
        // host carries out when it is back (at its start, or its next
        // heartbeat if it never stopped). The mark is written only while
        // the host is still down: one back meanwhile is asked instead. A
        // row marked so already (a removal through the Strata API) is
        // forgotten here too.
        if let Run::Elsewhere(host) = &run {
            let sandbox = row.sandbox.as_deref().unwrap_or_default();
            let marked = || -> Result<bool> {
                let place = lock(&self.d.db).sandbox_place(sandbox)?;
                Ok(place.is_some_and(|(_, state)| state == crate::catalog::SandboxState::Stopped))
            };
            if self.d.stop_lost_sandbox(sandbox)?.is_none() && !marked()? {
                return Err(elsewhere(id, host));
            }
        }
        if let Run::Running(info) = run {
            match self.d.remove_sandbox(&info.id) {
                Ok(()) => {}
                Err(e) if e.kind() == ErrorKind::NotFound => {}
                Err(e) => return Err(e.into()),
            }
            self.forget_processes(&info.id);
        }
        self.drop_row(&row);
        Ok(Resp::empty(204))
    }

    /// `POST /sandboxes/{id}/timeout`: a new deadline from now.
    pub fn set_timeout(&self, owner: &str, id: &str, req: &Req) -> Result<Resp> {
        let b = body(req)?;
        let t = timeout(b.get("timeout"), 0).and_then(|t| match t {
            0 => Err(ApiError::bad("timeout is required")),
            t => Ok(t),
        })?;
        let (row, run) = self.sandbox(owner, id)?;
        let info = run.here(id, "is paused; connect to it first")?;
        self.d.set_timeout(
            &info.id,
            crate::types::TimeoutRequest { timeout: t, on_timeout: Some(Self::on_timeout(&row.spec)) },
        )?;
        Ok(Resp::empty(204))
    }

    /// `POST /sandboxes/{id}/pause`: suspend into its work context.
    pub fn pause(&self, owner: &str, id: &str, req: &Req) -> Result<Resp> {
        if flag(&body(req)?, "memory")? {
            return Err(ApiError::bad(NO_MEMORY));
        }
        let held = self.hold(id);
        let _g = lock(&held);
        let (row, run) = self.sandbox_held(owner, id)?;
        let info = run.here(id, "is already paused")?;
        // Published as any suspend is, so that any host can resume it.
        self.d.publish_suspend(self.d.suspend(&info.id)?);
        self.forget_processes(&info.id);
        lock(&self.d.db).set_e2b_sandbox_run(id, None, row.started_at)?;
        Ok(Resp::empty(204))
    }

    /// `POST /v2/sandboxes/{id}/connect` (and `/sandboxes/{id}/resume`):
    /// 200 if it runs (its deadline moved later when a timeout is given
    /// that ends after it; never earlier), 201
    /// once resumed from its work context.
    pub fn connect(&self, owner: &str, id: &str, req: &Req) -> Result<Resp> {
        let b = body(req)?;
        let held = self.hold(id);
        let _g = lock(&held);
        let (row, run) = self.sandbox_held(owner, id)?;
        let t = timeout(b.get("timeout"), row.spec.timeout)?;
        // Resumed here it would run twice.
        if let Run::Elsewhere(host) = &run {
            return Err(elsewhere(id, host));
        }
        if let Run::Running(info) = run {
            if b.get("timeout").is_some_and(|v| !v.is_null()) {
                self.d.extend_timeout(
                    &info.id,
                    crate::types::TimeoutRequest { timeout: t, on_timeout: Some(Self::on_timeout(&row.spec)) },
                )?;
            }
            return Ok(Resp::json(200, self.created(&row)));
        }
        let info =
            self.d.resume_lineage(&row.work_context, LaunchRequest { timeout: Some(t), ..self.launch(&row.spec) })?;
        let row = E2bSandbox { sandbox: Some(info.id.clone()), started_at: now_ms(), ..row };
        if let Err(e) = lock(&self.d.db).set_e2b_sandbox_run(id, Some(&info.id), row.started_at) {
            let _ = self.d.remove_sandbox(&info.id);
            return Err(e.into());
        }
        Ok(Resp::json(201, self.created(&row)))
    }

    /// `POST /sandboxes/{id}/snapshots`: a checkpoint, usable as a
    /// `templateID`.
    pub fn snapshot(&self, owner: &str, id: &str, req: &Req) -> Result<Resp> {
        let b = body(req)?;
        let name = match b.get("name") {
            None | Some(Value::Null) => None,
            Some(Value::String(n)) if n.len() <= 128 => Some(n.clone()),
            Some(_) => return Err(ApiError::bad("name must be a string of at most 128 bytes")),
        };
        if flag(&b, "memory")? {
            return Err(ApiError::bad(NO_MEMORY));
        }
        let (_, run) = self.sandbox(owner, id)?;
        let info = run.here(id, "is paused; connect to it first")?;
        let snap = self.d.checkpoint(&info.id, crate::model::BlobCompression::default(), false)?;
        let s = E2bSnapshot {
            id: snap.id.to_string(),
            owner: owner.to_string(),
            sandbox: id.to_string(),
            name,
            created_at: now_ms(),
        };
        lock(&self.d.db).insert_e2b_snapshot(&s)?;
        Ok(Resp::json(201, snapshot_json(&s)))
    }

    /// `GET /snapshots` (`sandboxID` filter).
    pub fn snapshots(&self, owner: &str, req: &Req) -> Result<Resp> {
        let of = req.query("sandboxID");
        let name = req.query("name");
        let paging = Paging::parse(req)?;
        let kept: Vec<E2bSnapshot> = lock(&self.d.db)
            .e2b_snapshots(owner)?
            .into_iter()
            .filter(|s| of.as_deref().is_none_or(|o| s.sandbox == o))
            .filter(|s| name.as_deref().is_none_or(|n| snapshot_named(s, n)))
            .collect();
        let (page, next) = paging.page(kept, |s| (s.created_at, s.id.as_str()));
        let mut resp = Resp::json(200, Value::Array(page.iter().map(snapshot_json).collect()));
        if let Some(token) = next {
            resp.headers.push(("x-next-token", token));
        }
        Ok(resp)
    }

    /// `DELETE /templates/{id}`: one of this key's snapshots.
    pub fn delete_snapshot(&self, owner: &str, id: &str) -> Result<Resp> {
        if !lock(&self.d.db).e2b_snapshots(owner)?.iter().any(|s| s.id == id) {
            return Err(ApiError::new(404, format!("snapshot {id} not found")));
        }
        match self.d.remove_snapshot(id) {
            Ok(()) => {}
            // Later checkpoints of its sandbox are layered over it: it
            // stops being a template now, and its bytes go with theirs
            // (the collector removes it once nothing builds on it).
            Err(e) if e.kind() == ErrorKind::Conflict => {
                tracing::info!("e2b snapshot {id} deleted; kept in the store under its children: {}", chain(&e));
                lock(&self.d.db).delete_e2b_snapshot(id)?;
            }
            Err(e) => return Err(e.into()),
        }
        Ok(Resp::empty(204))
    }
}

/// Whether `s` answers to `name`: its name, with or without the tag
/// (`my-snapshot` names `my-snapshot:latest`), or its id.
fn snapshot_named(s: &E2bSnapshot, name: &str) -> bool {
    s.id == name
        || s.name.as_deref().is_some_and(|n| n == name || n.split_once(':').is_some_and(|(base, _)| base == name))
}

/// E2B's `SandboxMetric`.
fn e2b_metric(m: &crate::types::SandboxMetrics) -> Value {
    json!({
        "timestamp": time(m.timestamp),
        "timestampUnix": m.timestamp.div_euclid(1000),
        "cpuCount": m.cpu_count,
        "cpuUsedPct": m.cpu_used_pct,
        "memUsed": m.mem_used,
        "memTotal": m.mem_total,
        "memCache": m.mem_cache,
        "diskUsed": m.disk_used,
        "diskTotal": m.disk_total,
    })
}

fn snapshot_json(s: &E2bSnapshot) -> Value {
    let names: Vec<&str> = s.name.as_deref().into_iter().collect();
    json!({"snapshotID": s.id, "names": names})
}
