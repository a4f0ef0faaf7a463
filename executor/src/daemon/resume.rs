//! `resume`: a new sandbox on a snapshot's files, continuing its lineage.

use super::lookup::{restorable, SnapshotLookupError};
use super::snapshots::Base;
use crate::daemon::lineage::LineageError;
use crate::daemon::{lock, sandbox_info, Daemon};
use crate::error::{Classify, ErrorKind};
use crate::ids::SnapshotId;
use crate::model::LineageState;
use crate::model::{Rung, SnapshotClass, StartKind};
use crate::types::{LaunchRequest, SandboxInfo};

/// Why `resume` of a snapshot failed.
#[derive(Debug, thiserror::Error, displaydoc::Display)]
pub enum ResumeError {
    /// count is for fork
    Count,
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
            ResumeError::Count => ErrorKind::InvalidArgument,
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

    /// `resume --work-context ID`: start a sandbox for the lineage from the
    /// highest rung of its ladder that exists.
    pub fn resume_lineage(&self, id: &str, req: LaunchRequest) -> Result<SandboxInfo, LineageError> {
        if req.count.is_some() {
            return Err(LineageError::Count);
        }
        let launch = self.launch_spec(req)?;
        let wc = self.work_context_row(id)?;
        if wc.state != LineageState::Active {
            return Err(LineageError::Ended(id.to_string(), wc.state));
        }
        self.lineage_free(id)?;
        // Rungs 1 and 2: the head, else the snapshot the lineage began
        // from. A rung that cannot be restored (its row gone, a layer
        // missing, a hydration failing, a retired fork origin) is passed,
        // and why is recorded with the restore.
        let start_rung = if wc.start_kind == StartKind::Baseline { Rung::Baseline } else { Rung::Fork };
        let rungs = [(wc.head_id.as_ref(), Rung::Head), (wc.start_id.as_ref(), start_rung)];
        let mut fell = Vec::new();
        for (snap, rung) in rungs {
            let Some(snap) = snap else { continue };
            let _pin = self.pin_snapshot(snap)?;
            match self.rung_base(snap, rung)? {
                Ok(mut base) => {
                    base.work_context = wc.id.clone();
                    base.observed_head = wc.head_id.clone();
                    base.rung = rung;
                    base.fell = fell;
                    return Ok(sandbox_info(&*self.launch(&base, launch)?));
                }
                Err(why) => {
                    tracing::warn!("lineage {id}: {rung} {snap} cannot be restored ({why}); trying the next rung");
                    fell.push(format!("{rung} {snap}: {why}"));
                }
            }
        }
        // Rung 3: a cold start from the lineage's image.
        let image = lock(&self.db).image_by_id(wc.image_id)?.ok_or(LineageError::NoImageRow)?;
        let base = Base {
            layers: image.layers.clone(),
            image,
            snapshot: None,
            work_context: wc.id.clone(),
            observed_head: wc.head_id.clone(),
            rung: Rung::Image,
            captured_in_userns: false,
            fell,
            network: None,
        };
        Ok(sandbox_info(&*self.launch(&base, launch)?))
    }

    /// What a rung's snapshot starts a sandbox on, or why it cannot
    /// (`Ok(Err(reason))`): the caller falls to the next rung.
    fn rung_base(&self, snap: &SnapshotId, rung: Rung) -> Result<Result<Base, String>, LineageError> {
        let Some(row) = lock(&self.db).snapshot(snap)? else {
            return Ok(Err("its row is gone".into()));
        };
        if rung == Rung::Fork {
            // A fork origin continues only while its own lineage may.
            if let Err(e) = self.eligible_lineage(&row) {
                return Ok(Err(e.to_string()));
            }
        }
        // A rung whose layers cannot be had passes: a pulled one that does
        // not unpack, or one the fleet registry cannot give (down, a blob
        // missing or not matching its digest). A catalog failure does not.
        use crate::daemon::lookup::SnapshotLookupError as L;
        let base = match self.snapshot_base(&row) {
            Ok(base) => base,
            Err(L::Hydrate(e)) if e.passes_rung() => return Ok(Err(e.to_string())),
            Err(e) => return Err(e.into()),
        };
        let store = &self.rt.store;
        if let Some(l) = base.layers.iter().find(|l| !store.layer_dir(l.as_str()).join("fs").is_dir()) {
            return Ok(Err(format!("layer {l} is missing from the store")));
        }
        Ok(Ok(base))
    }
}
