//! Sealed results (the end of an attempt: quiesce → seal → evaluate →
//! resolve): evaluations run against a snapshot and recorded with it,
//! labels and retention (resolve), its patch, and the one document that
//! holds all of it (`GET /v1/snapshots/{id}/result`).
//!
//! An evaluation runs its command in a throwaway sandbox forked from the
//! snapshot (its own empty upper: the snapshot's tree is never changed;
//! a loopback-only network, whatever the snapshot's sandbox had; a
//! deadline, so a daemon that dies mid-way still removes it after a restart), reads the JSON the
//! command wrote to `$STRATA_RESULT` through the same confined resolution
//! as `cp`, removes the sandbox and its lineage, and records the outcome.

use std::collections::BTreeMap;

use crate::catalog::{Evaluation, MAX_LABEL_KEY, MAX_LABEL_VALUE};
use crate::daemon::lookup::SnapshotLookupError;
use crate::daemon::{lock, Daemon};
use crate::error::{Classify, ErrorKind};
use crate::model::{Rung, SnapshotClass, StartKind};
use crate::types::{EvaluateRequest, LabelRequest, Provenance, SealedResult, SnapshotInfo};

/// Where an evaluation's command writes its result (`$STRATA_RESULT`):
/// a name new for each run, so that no file the snapshot holds (an agent
/// planting `{"passed": 999}`) can pass for the evaluator's result.
fn result_path() -> String {
    format!("/tmp/strata-result-{:016x}.json", rand::random::<u64>())
}
/// The most of a result that is kept.
pub const MAX_RESULT: u64 = 1 << 20;
/// An evaluation's default and longest time (seconds).
pub const DEFAULT_EVAL_TIMEOUT: u64 = 600;
pub const MAX_EVAL_TIMEOUT: u64 = 86_400;

/// Why `evaluate` failed (a command that fails is a recorded evaluation,
/// not an error).
#[derive(Debug, thiserror::Error, displaydoc::Display)]
pub enum EvaluateError {
    /// {0}
    Invalid(String),
    /// {0}
    Snapshot(#[from] SnapshotLookupError),
    /// {0}
    Lineage(#[from] crate::daemon::lineage::LineageError),
    /// start the evaluation's sandbox: {0}
    Launch(#[from] crate::daemon::LaunchError),
    /// run the evaluation: {0}
    Run(#[from] crate::sandbox::SandboxError),
    /// {0}
    Db(#[from] crate::catalog::DbError),
}

impl Classify for EvaluateError {
    fn kind(&self) -> ErrorKind {
        match self {
            EvaluateError::Invalid(_) => ErrorKind::InvalidArgument,
            EvaluateError::Snapshot(e) => e.kind(),
            EvaluateError::Lineage(e) => e.kind(),
            EvaluateError::Launch(e) => e.kind(),
            EvaluateError::Run(e) => e.kind(),
            EvaluateError::Db(e) => e.kind(),
        }
    }
}

/// Why labelling a snapshot failed.
#[derive(Debug, thiserror::Error, displaydoc::Display)]
pub enum LabelError {
    /// {0}
    Invalid(String),
    /// {0}
    Snapshot(#[from] SnapshotLookupError),
    /// {0}
    Db(#[from] crate::catalog::DbError),
}

impl Classify for LabelError {
    fn kind(&self) -> ErrorKind {
        match self {
            LabelError::Invalid(_) => ErrorKind::InvalidArgument,
            LabelError::Snapshot(e) => e.kind(),
            LabelError::Db(e) => e.kind(),
        }
    }
}

/// An evaluation's name or version, or a label key: 1-128 of
/// `[A-Za-z0-9._:/-]`.
fn word(what: &str, s: &str) -> Result<(), String> {
    let ok =
        (1..=MAX_LABEL_KEY).contains(&s.len()) && s.bytes().all(|b| b.is_ascii_alphanumeric() || b"._:/-".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(format!("{what} {s:?} must be 1-{MAX_LABEL_KEY} characters of A-Z a-z 0-9 . _ : / -"))
    }
}

/// A label selector (`KEY` or `KEY=VALUE`) matches these labels.
pub fn matches(labels: &BTreeMap<String, String>, selector: &str) -> bool {
    match selector.split_once('=') {
        Some((k, v)) => labels.get(k).is_some_and(|have| have == v),
        None => labels.contains_key(selector),
    }
}

impl Daemon {
    /// Run `req.argv` against snapshot `id` and record it; the recorded
    /// one when this name and version ran on it before (unless `again`).
    pub fn evaluate(&self, id: &str, req: EvaluateRequest) -> Result<Evaluation, EvaluateError> {
        word("name", &req.name).and_then(|()| word("version", &req.version)).map_err(EvaluateError::Invalid)?;
        if req.argv.is_empty() {
            return Err(EvaluateError::Invalid("argv must not be empty".into()));
        }
        if let Some(e) = req.env.iter().find(|e| !e.contains('=') || e.starts_with('=')) {
            return Err(EvaluateError::Invalid(format!("env {e:?} is not KEY=VALUE")));
        }
        let timeout = req.timeout.unwrap_or(DEFAULT_EVAL_TIMEOUT);
        if !(1..=MAX_EVAL_TIMEOUT).contains(&timeout) {
            return Err(EvaluateError::Invalid(format!("timeout must be 1-{MAX_EVAL_TIMEOUT} seconds")));
        }
        let row = self.snapshot_row(id)?;
        if !req.again {
            if let Some(e) = lock(&self.db).evaluation(&row.id, &req.name, &req.version)? {
                return Ok(e);
            }
        }
        let _pin = self.pin_snapshot(&row.id)?;
        let mut base = self.snapshot_base(&row)?;
        let (start_kind, rung) = match row.class {
            SnapshotClass::Baseline => (StartKind::Baseline, Rung::Baseline),
            SnapshotClass::Checkpoint => (StartKind::Fork, Rung::Fork),
        };
        let wc = self.new_lineage(None, base.image.id, start_kind, Some(&row.id))?;
        (base.work_context, base.observed_head, base.rung) = (wc.clone(), None, rung);
        // Untrusted code against a sealed result: no network, whatever the
        // snapshot's sandbox had.
        base.network = None;
        // Removed by the reaper should this daemon die before it does.
        let launch = crate::types::LaunchRequest {
            timeout: Some(timeout + 60),
            on_timeout: Some(crate::model::OnTimeout::Remove),
            ..Default::default()
        };
        let ran =
            self.launch_spec(launch).and_then(|l| self.launch(&base, l)).map_err(EvaluateError::from).and_then(|sb| {
                let path = result_path();
                let mut env = vec![format!("STRATA_RESULT={path}")];
                env.extend(req.env.iter().cloned());
                let ereq = crate::sandbox::ExecRequest {
                    argv: req.argv.clone(),
                    env,
                    timeout: Some(std::time::Duration::from_secs(timeout)),
                    size: (24, 80),
                    keep_output: self.cfg.keep_output,
                    ..Default::default()
                };
                let out = sb.exec_buffered(&ereq, Vec::new());
                let result = out.as_ref().ok().map(|_| {
                    let read = crate::sandbox::read_file(sb.shim_pid, &path, MAX_RESULT);
                    match read {
                        Ok(None) => (None, None),
                        Ok(Some(bytes)) => match serde_json::from_slice::<serde_json::Value>(&bytes) {
                            Ok(v) => (Some(v), None),
                            Err(e) => (None, Some(format!("$STRATA_RESULT is not JSON: {e}"))),
                        },
                        Err(e) => (None, Some(crate::error::chain(&e))),
                    }
                });
                if let Err(e) = self.remove_sandbox(sb.id.as_str()) {
                    tracing::warn!("evaluation sandbox {}: {}", sb.id, crate::error::chain(&e));
                }
                Ok((out?, result.unwrap_or_default()))
            });
        if let Err(e) = lock(&self.db).delete_throwaway_lineage(&wc) {
            tracing::warn!("evaluation lineage {wc}: {}", crate::error::chain(&e));
        }
        let (out, (result, result_error)) = ran?;
        let mut e = Evaluation {
            id: 0,
            snapshot: row.id.to_string(),
            name: req.name,
            version: req.version,
            argv: req.argv,
            exit_code: out.status.shell_code(),
            timed_out: out.timed_out,
            duration_ms: out.duration.as_secs_f64() * 1000.0,
            output: out.summary.kept,
            result,
            result_error,
            created_at: crate::catalog::now(),
            recorded: false,
        };
        e.id = lock(&self.db).insert_evaluation(&e)?;
        tracing::info!("evaluation {} {} of snapshot {}: exit {}", e.name, e.version, e.snapshot, e.exit_code);
        Ok(e)
    }

    /// A snapshot's evaluations, oldest first.
    pub fn evaluations(&self, id: &str) -> Result<Vec<Evaluation>, SnapshotLookupError> {
        let row = self.snapshot_row(id)?;
        Ok(lock(&self.db).evaluations(&row.id)?)
    }

    /// Set or remove labels of a snapshot (idempotent).
    pub fn label_snapshot(&self, id: &str, req: LabelRequest) -> Result<SnapshotInfo, LabelError> {
        for (k, v) in &req.labels {
            word("label", k).map_err(LabelError::Invalid)?;
            if let Some(v) = v {
                if v.len() > MAX_LABEL_VALUE || v.chars().any(char::is_control) {
                    return Err(LabelError::Invalid(format!(
                        "label {k}: a value is at most {MAX_LABEL_VALUE} bytes, no control characters"
                    )));
                }
            }
        }
        let row = self.snapshot_row(id)?;
        lock(&self.db).set_labels(&row.id, &req.labels)?;
        Ok(self.get_snapshot(&row.id)?)
    }

    /// Retain a snapshot (gc keeps it whatever its age) or release it.
    pub fn retain_snapshot(&self, id: &str, retained: bool) -> Result<SnapshotInfo, SnapshotLookupError> {
        let row = self.snapshot_row(id)?;
        lock(&self.db).set_retained(&row.id, retained)?;
        self.get_snapshot(&row.id)
    }

    /// The snapshots whose labels match every selector (`KEY` or
    /// `KEY=VALUE`).
    pub fn list_snapshots_labelled(&self, selectors: &[String]) -> Result<Vec<SnapshotInfo>, SnapshotLookupError> {
        let all = self.list_snapshots()?;
        Ok(all.into_iter().filter(|s| selectors.iter().all(|sel| matches(&s.labels, sel))).collect())
    }

    /// Everything recorded of a snapshot: itself, its chain and where it
    /// came from, its log with output, evaluations, labels.
    pub fn snapshot_result(&self, id: &str) -> Result<SealedResult, SnapshotLookupError> {
        let db = lock(&self.db);
        let row = self.snapshot_row_in(&db, id)?;
        let snapshot = self.snapshot_info_locked(&db, &row)?;
        let chain: Vec<_> = db.snapshot_chain(&row.id)?.into_iter().map(|s| s.id).collect();
        let image = db.image_by_id(row.image_id)?.ok_or(SnapshotLookupError::NoImageRow)?;
        let provenance = Provenance {
            image: image.name.clone(),
            image_manifest_digest: image.manifest_digest.to_string(),
            image_config_digest: image.config_digest.to_string(),
            parents: chain.iter().rev().skip(1).cloned().collect(),
            source_sandbox: row.source_sandbox.clone(),
            host: self.cfg.host_id.clone(),
            pulled_from: row.info.pulled_from.clone(),
            strata_version: env!("CARGO_PKG_VERSION").into(),
        };
        Ok(SealedResult {
            logs: crate::daemon::execlog::snapshot_log(&db, &row.id, true)?,
            evaluations: db.evaluations(&row.id)?,
            labels: snapshot.labels.clone(),
            retained: snapshot.retained,
            snapshot,
            chain,
            provenance,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_selectors() {
        assert!(word("name", "tests/unit:v1.2").is_ok());
        assert!(word("name", "").is_err());
        assert!(word("name", "a b").is_err());
        assert!(word("name", &"x".repeat(129)).is_err());
        let labels: BTreeMap<String, String> = [("verdict".to_string(), "accepted".to_string())].into();
        assert!(matches(&labels, "verdict"));
        assert!(matches(&labels, "verdict=accepted"));
        assert!(!matches(&labels, "verdict=rejected"));
        assert!(!matches(&labels, "other"));
    }
}
