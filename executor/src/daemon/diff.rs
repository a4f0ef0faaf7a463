//! `diff`: what a sandbox or a snapshot changed against the layers below.

use super::lookup::{restorable, SnapshotLookupError};
use crate::daemon::Daemon;
use crate::error::{Classify, ErrorKind};
use crate::ids::LayerId;

/// Why `snapshot diff` failed.
#[derive(Debug, thiserror::Error, displaydoc::Display)]
pub enum SnapshotDiffError {
    /// {0}
    Snapshot(#[from] SnapshotLookupError),
    /// {0}
    Diff(#[from] crate::store::diff::DiffError),
}

impl Classify for SnapshotDiffError {
    fn kind(&self) -> ErrorKind {
        match self {
            SnapshotDiffError::Snapshot(e) => e.kind(),
            SnapshotDiffError::Diff(_) => ErrorKind::of_host_failure(self),
        }
    }
}

impl Daemon {
    fn layer_fs(&self, hexes: &[LayerId]) -> Vec<std::path::PathBuf> {
        hexes.iter().rev().map(|h| self.rt.store.layer_dir(h).join("fs")).collect()
    }

    /// Added, changed and deleted paths of a live sandbox's upper.
    pub fn sandbox_diff(&self, id: &str) -> Result<Vec<crate::store::layers::Change>, crate::daemon::SandboxOpError> {
        let sb = self.sandbox(id)?;
        sb.own_layers("diff")?;
        let upper = sb.dirs(&self.rt.store).upper;
        let lowers = self.layer_fs(&sb.spec.layers);
        Ok(sb.while_frozen("diff", || {
            crate::store::layers::changes(&upper, &lowers).map_err(crate::sandbox::SandboxError::Capture)
        })?)
    }

    /// Added, changed and deleted paths of a snapshot's own delta.
    pub fn snapshot_diff(&self, id: &str) -> Result<Vec<crate::store::layers::Change>, SnapshotDiffError> {
        let row = self.snapshot_row(id)?;
        restorable(&row)?;
        let _pin = self.pin_snapshot(&row.id)?;
        let base = self.snapshot_base(&row)?;
        let below = &base.layers[..base.layers.len().saturating_sub(1)];
        let delta = self.rt.store.layer_dir(&row.layer).join("fs");
        Ok(crate::store::layers::changes(&delta, &self.layer_fs(below))?)
    }

    /// What changed from `against` (default: what the snapshot ran on) to
    /// the snapshot, as a unified diff.
    pub fn snapshot_patch(
        &self,
        id: &str,
        against: Option<&str>,
    ) -> Result<crate::store::patch::Patch, SnapshotDiffError> {
        let row = self.snapshot_row(id)?;
        let _pin = self.pin_snapshot(&row.id)?;
        let new = self.snapshot_base(&row)?;
        // What it ran on: its parent's tree (a compacted snapshot's own
        // layer holds its whole chain), else its image's.
        let other = match against.map(str::to_string).or_else(|| row.parent_id.as_ref().map(|p| p.to_string())) {
            Some(other) => match self.snapshot_row(&other) {
                Ok(o) => Some(o),
                Err(SnapshotLookupError::NotFound(_)) if against.is_none() => None,
                Err(e) => return Err(e.into()),
            },
            None => None,
        };
        let _other_pin = other.as_ref().map(|o| self.pin_snapshot(&o.id)).transpose()?;
        let old = match &other {
            Some(o) => self.snapshot_base(o)?.layers,
            None => new.image.layers.clone(),
        };
        let new = new.layers;
        let fs = |layers: &[crate::ids::LayerId]| -> Vec<std::path::PathBuf> {
            layers.iter().rev().map(|l| self.rt.store.layer_dir(l).join("fs")).collect()
        };
        Ok(crate::store::patch::patch(&fs(&old), &fs(&new))?)
    }
}
