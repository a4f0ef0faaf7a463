//! `resume`: a new sandbox on a snapshot's files, continuing its lineage.

use super::snapshots::{restorable, SnapshotLookupError};
use crate::daemon::{lock, sandbox_info, Daemon};
use crate::error::{Classify, ErrorKind};
use crate::model::{Rung, SnapshotClass, StartKind};
use crate::types::{LaunchRequest, SandboxInfo};

/// Why `resume` or `fork` of a snapshot failed.
#[derive(Debug, thiserror::Error, displaydoc::Display)]
pub enum ResumeError {
    /// count is for fork
    Count,
    /// count must be 1-{max}, got {count}
    BadCount { count: u32, max: u32 },
    /// a hostname can only be given to a fork of count 1
    HostnameForMany,
    /// fork of {count} refused: {free} of {max} sandbox slots free (--max-sandboxes)
    NoRoom { count: u32, free: usize, max: usize },
    /// {0}
    Snapshot(#[from] SnapshotLookupError),
    /// {0}
    Launch(#[from] crate::daemon::LaunchError),
    /// {0}
    Lineage(#[from] crate::daemon::lineage::LineageError),
}

impl Classify for ResumeError {
    fn kind(&self) -> ErrorKind {
        match self {
            ResumeError::Count | ResumeError::BadCount { .. } | ResumeError::HostnameForMany => {
                ErrorKind::InvalidArgument
            }
            ResumeError::NoRoom { .. } => ErrorKind::LimitReached,
            ResumeError::Snapshot(e) => e.kind(),
            ResumeError::Launch(e) => e.kind(),
            ResumeError::Lineage(e) => e.kind(),
        }
    }
}

impl Daemon {
    /// Start a sandbox whose files are exactly the snapshot's.
    pub fn resume(&self, id: &str, req: LaunchRequest) -> Result<SandboxInfo, ResumeError> {
        if req.count.is_some() {
            return Err(ResumeError::Count);
        }
        let launch = self.launch_spec(req)?;
        let row = self.snapshot_row(id)?;
        // A checkpoint continues its own lineage: refused before the
        // snapshot is pinned (a removal racing a refused resume is not
        // refused for it) and before any layer is fetched, if the lineage
        // has ended or another sandbox holds it.
        restorable(&row)?;
        let lineage = match row.class {
            SnapshotClass::Baseline => None,
            _ => Some(self.eligible_lineage(&row).and_then(|wc| self.lineage_free(&wc.id).map(|()| wc))?),
        };
        let _pin = self.pin_snapshot(&row.id)?;
        let mut base = self.snapshot_base(&row)?;
        let Some(wc) = lineage else {
            // New work from a baseline: a lineage of its own.
            let wc = self.new_lineage(None, base.image.id, StartKind::Baseline, Some(&row.id))?;
            (base.work_context, base.observed_head, base.rung) = (wc.clone(), None, Rung::Baseline);
            return Ok(self.launch(&base, launch).map(|sb| sandbox_info(&sb)).inspect_err(|_| {
                let _ = lock(&self.db).delete_unused_work_context(&wc);
            })?);
        };
        // Fenced on the lineage's head as it was read above.
        (base.work_context, base.observed_head) = (wc.id, wc.head_id);
        Ok(sandbox_info(&*self.launch(&base, launch)?))
    }
}
