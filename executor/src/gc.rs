//! Retention (DESIGN.md invariant 7): `strata gc` and the daemon's periodic
//! sweep retire stale lineages (neither captured nor restored within
//! `--stale-after`) and delete superseded, retired and failed snapshots
//! past `--retention`. A snapshot goes through the same removal as `strata
//! snapshot rm`, so one still used (by a live sandbox, a launch in flight, a
//! child snapshot, or as an active lineage's head) is kept; its layer and
//! blob go only when no image or remaining snapshot lists them.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::daemon::OpError;
use crate::daemon::{lock, Daemon};
use crate::error::ErrorKind;

/// What one collection did.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct GcReport {
    /// Lineages retired as stale.
    pub retired: Vec<String>,
    /// Snapshots deleted.
    pub deleted: Vec<String>,
    /// Snapshots past retention kept because something uses them, with why.
    pub kept: Vec<(String, String)>,
}

impl Daemon {
    /// Retire stale lineages, then delete what retention allows.
    pub fn gc(&self, retention: Duration, stale_after: Duration) -> Result<GcReport, OpError> {
        let now = crate::db::now();
        let cutoff = |d: Duration| now.saturating_sub(i64::try_from(d.as_secs()).unwrap_or(i64::MAX));
        let mut report = GcReport::default();
        // A lineage with a live sandbox is in use, however old its last append.
        let busy: std::collections::HashSet<String> =
            lock(&self.pool).live.values().filter_map(|s| s.spec.work_context.clone()).collect();
        // (Each list is taken first: the database lock must not be held
        // across the loop, whose body locks it again.)
        let stale = lock(&self.db).stale_lineages(cutoff(stale_after))?;
        for wc in stale {
            if !busy.contains(&wc) && lock(&self.db).retire_work_context(&wc)? {
                tracing::info!("gc: retired stale lineage {wc}");
                report.retired.push(wc);
            }
        }
        // Children before parents; a parent freed by a deleted child is
        // tried again on the next pass.
        let mut kept = std::collections::BTreeMap::new();
        loop {
            let mut progress = false;
            let candidates = lock(&self.db).gc_candidates(cutoff(retention))?;
            for id in candidates {
                if report.deleted.contains(&id) {
                    continue;
                }
                match self.remove_snapshot(&id) {
                    Ok(()) => {
                        tracing::info!("gc: deleted snapshot {id}");
                        kept.remove(&id);
                        report.deleted.push(id);
                        progress = true;
                    }
                    Err(e) if matches!(e.kind, ErrorKind::Conflict | ErrorKind::NotFound) => {
                        kept.insert(id, e.message);
                    }
                    Err(e) => return Err(e),
                }
            }
            if !progress {
                break;
            }
        }
        report.kept = kept.into_iter().collect();
        Ok(report)
    }

    /// Collect every `interval` on a background thread (never if zero).
    pub fn start_gc(self: &std::sync::Arc<Self>, interval: Duration, retention: Duration, stale_after: Duration) {
        if interval.is_zero() {
            return;
        }
        let d = self.clone();
        let spawned = std::thread::Builder::new().name("gc".into()).spawn(move || loop {
            std::thread::sleep(interval);
            if let Err(e) = d.gc(retention, stale_after) {
                tracing::error!("gc: {}", e.message);
            }
        });
        if let Err(e) = spawned {
            tracing::error!("start gc thread: {e}");
        }
    }
}
