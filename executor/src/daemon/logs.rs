//! Exec logs: a live sandbox's records, and the log a snapshot seals (its
//! chain's segments).

use super::snapshots::SnapshotLookupError;
use crate::catalog::SnapshotRow;
use crate::daemon::{lock, Daemon};

/// A snapshot's sealed exec log: its chain's segments, root first.
pub(crate) fn snapshot_log(
    db: &crate::catalog::Db,
    id: &str,
    output: bool,
) -> Result<Vec<crate::catalog::ExecRecord>, crate::catalog::DbError> {
    let mut out = Vec::new();
    for s in db.snapshot_chain(id)? {
        out.extend(own_log(db, &s, output)?);
    }
    Ok(out)
}

/// The exec records a snapshot seals itself (its segment of the log):
/// its source sandbox's records with ids in `(log_from, log_upto]`; for a
/// pulled snapshot, the records its pull inserted, whatever sandbox ran
/// them (`log_pulled`). None for a snapshot that records no log.
pub(crate) fn own_log(
    db: &crate::catalog::Db,
    s: &SnapshotRow,
    output: bool,
) -> Result<Vec<crate::catalog::ExecRecord>, crate::catalog::DbError> {
    let (from, upto) = (s.info["log_from"].as_i64().unwrap_or(0), s.info["log_upto"].as_i64().unwrap_or(0));
    let sandbox = (s.info["log_pulled"] != true).then_some(s.source_sandbox.as_str());
    db.exec_records(sandbox, from, Some(upto), output)
}

impl Daemon {
    /// Keep a finished command in the sandbox's exec log.
    pub fn record_exec(
        &self,
        sb: &crate::sandbox::Sandbox,
        req: &crate::sandbox::ExecRequest,
        s: &crate::sandbox::ExecSummary,
    ) {
        self.telemetry.exec(s.duration);
        let rec = crate::catalog::ExecRecord {
            id: 0,
            sandbox_id: sb.id.to_string(),
            argv: req.argv.clone(),
            cwd: req.cwd.clone().unwrap_or_else(|| sb.defaults.cwd.clone()),
            started_at: s.started_at.duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0),
            duration_ms: s.duration.as_secs_f64() * 1000.0,
            exit_code: s.status.shell_code(),
            output_bytes: s.output_bytes,
            output: Some(s.kept.clone()),
        };
        // A command that ends after its sandbox began to go (removed, or
        // rolled back: the discarded timeline) is not logged (`execlog.rs`).
        self.queue_exec_record(sb, rec);
    }

    /// The exec log of a live sandbox (the log of the snapshot it runs
    /// on, then its own commands since it started or rolled back), or the
    /// log sealed with a snapshot: each snapshot of its chain adds its
    /// source sandbox's records between its `log_from` and `log_upto`.
    /// With `output`, each record carries its output as kept.
    pub fn logs(&self, id: &str, output: bool) -> Result<Vec<crate::catalog::ExecRecord>, SnapshotLookupError> {
        if let Ok(sb) = self.sandbox(id) {
            self.settle_exec_log();
            let db = lock(&self.db);
            let mut out = match &sb.spec.snapshot {
                Some(s) => snapshot_log(&db, s, output)?,
                None => Vec::new(),
            };
            out.extend(db.exec_records(Some(sb.id.as_str()), sb.spec.log_from, None, output)?);
            return Ok(out);
        }
        let row = self.snapshot_row(id)?;
        Ok(snapshot_log(&lock(&self.db), &row.id, output)?)
    }
}
