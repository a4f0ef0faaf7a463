//! `fork`: independent sandboxes on one snapshot, each in a lineage of its
//! own; no file data is copied.

use std::sync::Arc;

use super::resume::ResumeError;
use super::snapshots::MAX_FORK;
use crate::daemon::{lock, sandbox_info, Base, Daemon};
use crate::model::{Rung, SnapshotClass, StartKind};
use crate::types::{LaunchRequest, SandboxInfo};

impl Daemon {
    /// Start `count` independent sandboxes on one snapshot. No file data is
    /// copied: they share its layers and each gets its own empty upper. All
    /// or nothing: if one cannot start, the others are removed.
    pub fn fork(&self, id: &str, req: LaunchRequest) -> Result<Vec<SandboxInfo>, ResumeError> {
        let count = req.count.unwrap_or(1);
        if !(1..=MAX_FORK).contains(&count) {
            return Err(ResumeError::BadCount { count, max: MAX_FORK });
        }
        if req.hostname.is_some() && count > 1 {
            return Err(ResumeError::HostnameForMany);
        }
        // Validate once, before anything is reserved or started.
        let launch = self.launch_spec(req)?;
        let row = self.snapshot_row(id)?;
        let _pin = self.pin_snapshot(&row.id)?;
        let base = self.snapshot_base(&row)?;
        {
            let pool = lock(&self.pool);
            // Slots removals still hold are not counted: they come free in
            // moments, and each launch below waits for its own.
            let free = self.max_sandboxes().saturating_sub(pool.live.len() + pool.reserved);
            if (count as usize) > free {
                return Err(ResumeError::NoRoom { count, free, max: self.max_sandboxes() });
            }
        }
        let (start_kind, rung) = match row.class {
            SnapshotClass::Baseline => (StartKind::Baseline, Rung::Baseline),
            SnapshotClass::Checkpoint => (StartKind::Fork, Rung::Fork),
        };
        if row.class != SnapshotClass::Baseline {
            self.eligible_lineage(&row)?;
        }
        // Each child is an explicit branch: a lineage of its own, whose
        // origin is the snapshot.
        let mut made: Vec<Arc<crate::sandbox::Sandbox>> = Vec::new();
        for _ in 0..count {
            let launched = self
                .new_lineage(None, base.image.id, start_kind, Some(&row.id))
                .map_err(ResumeError::from)
                .and_then(|wc| {
                    let child = Base {
                        work_context: wc.clone(),
                        observed_head: None,
                        rung,
                        image: base.image.clone(),
                        layers: base.layers.clone(),
                        snapshot: base.snapshot.clone(),
                        captured_in_userns: base.captured_in_userns,
                        fell: Vec::new(),
                        network: base.network.clone(),
                    };
                    self.launch(&child, launch.clone()).map_err(ResumeError::from).inspect_err(|_| {
                        let _ = lock(&self.db).delete_unused_work_context(&wc);
                    })
                });
            match launched {
                Ok(sb) => made.push(sb),
                Err(e) => {
                    for sb in made {
                        let _ = self.remove_sandbox(sb.id.as_str());
                    }
                    return Err(e);
                }
            }
        }
        Ok(made.iter().map(|s| sandbox_info(s)).collect())
    }
}
