//! Retention (docs/design.md invariant 7): `strata gc` and the daemon's periodic
//! sweep retire stale lineages (neither captured nor restored within
//! `--stale-after`, and no sandbox of the catalog, on any host, in them)
//! and delete superseded, retired and failed snapshots
//! past `--retention`. A snapshot goes through the same removal as `strata
//! snapshot rm`, so one still used (by a live sandbox, a launch in flight, a
//! child snapshot, or as an active lineage's head) is kept; its layer and
//! blob go only when no image or remaining snapshot lists them.
//!
//!
//! It runs above the verbs: a snapshot it deletes goes through
//! `snapshot_rm`, and the collector (`gc.rs`) removes what that unlisted.

use std::time::Duration;

use crate::daemon::CollectError;
use crate::daemon::{lock, Daemon};
use crate::error::{Classify, ErrorKind};
use crate::store::Scope;
use crate::types::GcReport;

/// Why `gc` failed (what it retired and deleted before stays so).
#[derive(Debug, thiserror::Error, displaydoc::Display)]
pub enum GcError {
    /// {0}
    Db(#[from] crate::catalog::DbError),
    /// remove snapshot {id}: {source}
    Remove { id: String, source: crate::daemon::snapshot_rm::RemoveSnapshotError },
    /// {0}
    Collect(#[from] CollectError),
}

impl crate::error::Classify for GcError {
    fn kind(&self) -> ErrorKind {
        match self {
            GcError::Db(e) => e.kind(),
            GcError::Remove { source, .. } => source.kind(),
            GcError::Collect(e) => e.kind(),
        }
    }
}

impl Daemon {
    /// Remove the secrets file of every lineage the catalog has not active.
    fn sweep_secrets(&self) {
        for wc in self.secrets.lineages() {
            let active = match lock(&self.db).work_context(&wc) {
                Ok(row) => row.is_some_and(|r| r.state == crate::model::LineageState::Active),
                Err(e) => return tracing::warn!("gc: read lineage {wc}: {}", crate::error::chain(&e)),
            };
            if !active {
                tracing::info!("gc: lineage {wc} has ended: its secret env goes");
                self.forget_secrets(&wc);
            }
        }
    }

    /// Retire stale lineages, then delete what retention allows.
    pub fn gc(&self, retention: Duration, stale_after: Duration) -> Result<GcReport, GcError> {
        let now = crate::catalog::now();
        let cutoff = |d: Duration| now.saturating_sub(i64::try_from(d.as_secs()).unwrap_or(i64::MAX));
        let mut report = GcReport::default();
        // A lineage with a live sandbox is in use, however old its last
        // append: the retirement checks that, and the staleness, again.
        // (Each list is taken first: the database lock must not be held
        // across the loop, whose body locks it again.)
        let stale = lock(&self.db).stale_lineages(cutoff(stale_after))?;
        for wc in stale {
            if lock(&self.db).retire_stale_work_context(&wc, cutoff(stale_after))? {
                tracing::info!("gc: retired stale lineage {wc}");
                self.forget_secrets(&wc);
                report.retired.push(wc);
            }
        }
        // Secrets of lineages that ended elsewhere (another host closed or
        // retired them) or are gone: this host's copy goes too.
        self.sweep_secrets();
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
                    Err(e) if matches!(e.kind(), ErrorKind::Conflict | ErrorKind::NotFound) => {
                        kept.insert(id, crate::error::chain(&e));
                    }
                    Err(source) => return Err(GcError::Remove { id, source }),
                }
            }
            if !progress {
                break;
            }
        }
        report.kept = kept.into_iter().collect();
        // Suspends sealed while their layer was in use share it now.
        // (The list first: a `for` would hold the lock across the loop.)
        let duplicates = lock(&self.db).duplicate_suspended_layers()?;
        for id in duplicates {
            if let Ok(id) = id.parse() {
                self.share_layer(&id, 0)?;
            }
        }
        report.collected = self.collect(Scope::Everything, [])?;
        Ok(report)
    }

    /// Collect every `interval` on a background thread (never if zero).
    pub fn start_gc(self: &std::sync::Arc<Self>, interval: Duration, retention: Duration, stale_after: Duration) {
        if interval.is_zero() {
            return;
        }
        let d = self.clone();
        super::background("gc", "only `strata gc` collects", move || loop {
            std::thread::sleep(interval);
            if let Err(e) = d.gc(retention, stale_after) {
                tracing::error!("gc: {}", crate::error::chain(&e));
            }
        });
    }
}
