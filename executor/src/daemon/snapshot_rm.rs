//! `snapshot rm`: a snapshot's removal, refused while something needs it;
//! its row first, its files after (finished at start-up if cut short).

use super::lookup::SnapshotLookupError;
use crate::catalog::SnapshotRow;
use crate::daemon::{lock, Daemon};
use crate::error::{Classify, ErrorKind};
use crate::ids::SnapshotId;
use crate::model::SnapshotState;
use crate::oci;
use crate::store::{Resource, Scope};

/// Why `snapshot rm` failed.
#[derive(Debug, thiserror::Error, displaydoc::Display)]
pub enum RemoveSnapshotError {
    /// {0}
    Snapshot(#[from] SnapshotLookupError),
    /// snapshot {id} is used by sandboxes {users:?}; remove them first
    UsedBy { id: SnapshotId, users: Vec<String> },
    /// snapshot {0} is in use by an operation in flight (resume, fork, rollback, sealing); retry
    InFlight(SnapshotId),
    /// snapshot {id} is still needed by {children:?} (child snapshots, the lineage it heads, sandboxes of other hosts); remove them first
    HasChildren { id: SnapshotId, children: Vec<String> },
    /// {0}
    Db(#[from] crate::catalog::DbError),
    /// {0}
    Collect(#[from] crate::daemon::CollectError),
}

impl Classify for RemoveSnapshotError {
    fn kind(&self) -> ErrorKind {
        match self {
            RemoveSnapshotError::Snapshot(e) => e.kind(),
            RemoveSnapshotError::Db(e) => e.kind(),
            RemoveSnapshotError::Collect(e) => e.kind(),
            _ => ErrorKind::Conflict,
        }
    }
}

impl Daemon {
    /// Remove a snapshot; refused while a sandbox, a launch in flight or a
    /// child snapshot uses it.
    pub fn remove_snapshot(&self, id: &str) -> Result<(), RemoveSnapshotError> {
        let row = self.snapshot_row(id)?;
        if row.state == SnapshotState::Capturing {
            return Err(RemoveSnapshotError::InFlight(row.id));
        }
        {
            // A sandbox being torn down still mounts the snapshot's layers:
            // wait for it (a removal stuck past that counts as a user).
            let started_from = |s: &crate::sandbox::Sandbox| s.spec.snapshot.as_deref() == Some(row.id.as_str());
            let mut pool = self.after_removals(started_from);
            let users: Vec<String> = pool.mounting().filter(|s| started_from(s)).map(|s| s.id.to_string()).collect();
            if !users.is_empty() {
                return Err(RemoveSnapshotError::UsedBy { id: row.id, users });
            }
            if pool.pinned.contains_key(row.id.as_str()) || !pool.doomed.insert(row.id.to_string()) {
                return Err(RemoveSnapshotError::InFlight(row.id));
            }
        }
        let r = self.remove_unused_snapshot(&row);
        lock(&self.pool).doomed.remove(row.id.as_str());
        r
    }

    fn remove_unused_snapshot(&self, row: &SnapshotRow) -> Result<(), RemoveSnapshotError> {
        if let Err(children) = lock(&self.db).begin_delete_snapshot(&row.id)? {
            return Err(RemoveSnapshotError::HasChildren { id: row.id.clone(), children });
        }
        self.finish_removal(&row.id)
    }

    /// The rest of a removal, once the snapshot is `deleting` (never
    /// restorable again): the layer and blob it alone holds are removed
    /// (under the database lock, as the collector removes: an operation
    /// that leases or lists them meanwhile keeps them), then its row. Run
    /// again at start-up for a removal a stopped daemon left half-way.
    pub(crate) fn finish_removal(&self, id: &str) -> Result<(), RemoveSnapshotError> {
        crate::failpoint::hit("snapshot-rm:deleting");
        let db = lock(&self.db);
        let (layer, blob) = db.held_only_by(id)?;
        let blob = blob.and_then(|d| d.parse::<oci::Digest>().ok()).map(|d| Resource::Blob(d.hex().to_string()));
        let doomed: std::collections::BTreeSet<Resource> =
            layer.map(Resource::Layer).into_iter().chain(blob.clone()).collect();
        self.rt.store.remove_unleased(db, &doomed).map_err(crate::daemon::CollectError::from)?;
        crate::failpoint::hit("snapshot-rm:files-removed");
        let (orphan, published) = lock(&self.db).finish_delete_snapshot(id)?;
        if published.is_some() {
            self.unpublish();
        }
        // What a lease kept is the collector's once nothing lists it.
        self.collect(Scope::Released, orphan.into_iter().map(Resource::Layer).chain(blob))?;
        Ok(())
    }
}
