//! `fork`: independent sandboxes on one snapshot, each in a lineage of its
//! own; no file data is copied.

use std::sync::Arc;

use super::lookup::SnapshotLookupError;
use super::snapshots::MAX_FORK;
use crate::daemon::{lock, sandbox_info, Base, Daemon};
use crate::error::{Classify, ErrorKind};
use crate::model::{Rung, SnapshotClass, StartKind};
use crate::types::{LaunchRequest, SandboxInfo};

/// Why a `fork` of a snapshot failed (all or nothing: no child is left).
#[derive(Debug, thiserror::Error, displaydoc::Display)]
pub enum ForkError {
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

impl Classify for ForkError {
    fn kind(&self) -> ErrorKind {
        match self {
            ForkError::BadCount { .. } | ForkError::HostnameForMany => ErrorKind::InvalidArgument,
            ForkError::NoRoom { .. } => ErrorKind::LimitReached,
            ForkError::Snapshot(e) => e.kind(),
            ForkError::Launch(e) => e.kind(),
            ForkError::Lineage(e) => e.kind(),
        }
    }
}

impl Daemon {
    /// Start `count` independent sandboxes on one snapshot. No file data is
    /// copied: they share its layers and each gets its own empty upper. All
    /// or nothing: if one cannot start, the others are removed.
    pub fn fork(&self, id: &str, req: LaunchRequest) -> Result<Vec<SandboxInfo>, ForkError> {
        let count = req.count.unwrap_or(1);
        if !(1..=MAX_FORK).contains(&count) {
            return Err(ForkError::BadCount { count, max: MAX_FORK });
        }
        if req.hostname.is_some() && count > 1 {
            return Err(ForkError::HostnameForMany);
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
                return Err(ForkError::NoRoom { count, free, max: self.max_sandboxes() });
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
                .map_err(ForkError::from)
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
                    self.launch(&child, launch.clone()).map_err(ForkError::from).inspect_err(|_| {
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
