//! Exec logs: a live sandbox's records, and the log a snapshot seals (its
//! chain's segments).

use super::execlog::snapshot_log;
use super::lookup::SnapshotLookupError;
use crate::daemon::{lock, Daemon};

impl Daemon {
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
