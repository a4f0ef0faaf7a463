//! Finding what a verb works on: a live sandbox (refused while it stops,
//! or named on another host), the list of them, and a snapshot pinned
//! against removal while a launch reads it.

use std::sync::Arc;

use crate::catalog::DbError;
use crate::error::{Classify, ErrorKind};
use crate::ids::{SandboxId, SnapshotId};
use crate::sandbox::{self, Sandbox};
use crate::types::SandboxInfo;

use super::{lock, Daemon};
use crate::catalog::ImageRow;
use crate::catalog::SnapshotRow;
use crate::model::SnapshotState;
use crate::types::ImageInfo;

/// Why an operation on a live sandbox (look-up, pause, unpause, exec,
/// remove) failed.
#[derive(Debug, thiserror::Error, displaydoc::Display)]
pub enum SandboxOpError {
    /// sandbox {0} not found
    NotFound(String),
    /// sandbox {0} is already being removed
    BeingRemoved(SandboxId),
    /// sandbox {0} is past its deadline or idle timeout and going (removed or suspended); too late to renew
    Expiring(SandboxId),
    /// {0}
    Invalid(String),
    /// {0}
    Sandbox(#[from] sandbox::SandboxError),
    /// {0}
    Db(#[from] DbError),
}

impl Classify for SandboxOpError {
    fn kind(&self) -> ErrorKind {
        match self {
            SandboxOpError::NotFound(_) => ErrorKind::NotFound,
            SandboxOpError::BeingRemoved(_) | SandboxOpError::Expiring(_) => ErrorKind::Conflict,
            SandboxOpError::Invalid(_) => ErrorKind::InvalidArgument,
            SandboxOpError::Sandbox(e) => e.kind(),
            SandboxOpError::Db(e) => e.kind(),
        }
    }
}

/// Whether a snapshot's files can be read (resumed, forked, exported,
/// pushed, diffed): not while it is being captured or removed, nor after a
/// capture that failed (it holds nothing). A suspend whose seal failed
/// still holds its files and is restorable by id.
pub(crate) fn restorable(row: &SnapshotRow) -> Result<(), SnapshotLookupError> {
    let why = match row.state {
        SnapshotState::Capturing => "is still being captured",
        SnapshotState::Deleting => return Err(SnapshotLookupError::BeingRemoved(row.id.clone())),
        SnapshotState::Failed if row.info.capture_error.is_some() => "is a capture that failed",
        _ => return Ok(()),
    };
    let reason = row.info.capture_error.as_deref().map(|e| format!(" ({e})")).unwrap_or_default();
    Err(SnapshotLookupError::NotRestorable(format!("snapshot {} {why}{reason}", row.id)))
}

/// Why a snapshot could not be found, listed or shown: the look-up that
/// every operation on a snapshot starts with.
#[derive(Debug, thiserror::Error, displaydoc::Display)]
pub enum SnapshotLookupError {
    /// snapshot {0} not found
    NotFound(String),
    /// snapshot {0} is being removed
    BeingRemoved(SnapshotId),
    /// snapshot's image row is missing
    NoImageRow,
    /// {0}
    NotRestorable(String),
    /// {0}
    Db(#[from] crate::catalog::DbError),
    /// {0}
    Hydrate(Box<super::hydrate::HydrateError>),
}

impl Classify for SnapshotLookupError {
    fn kind(&self) -> ErrorKind {
        match self {
            SnapshotLookupError::NotFound(_) | SnapshotLookupError::BeingRemoved(_) => ErrorKind::NotFound,
            SnapshotLookupError::NoImageRow => ErrorKind::Internal,
            SnapshotLookupError::NotRestorable(_) => ErrorKind::Conflict,
            SnapshotLookupError::Db(e) => e.kind(),
            SnapshotLookupError::Hydrate(e) => e.kind(),
        }
    }
}

/// A pin on a snapshot for as long as a launch from it is in flight (see
/// [`Pool::pinned`]); unpinned on drop.
pub(crate) struct SnapshotPin<'d> {
    daemon: &'d Daemon,
    id: String,
}

impl Drop for SnapshotPin<'_> {
    fn drop(&mut self) {
        let mut pool = lock(&self.daemon.pool);
        if let Some(n) = pool.pinned.get_mut(&self.id) {
            *n -= 1;
            if *n == 0 {
                pool.pinned.remove(&self.id);
            }
        }
    }
}

pub fn sandbox_info(s: &Sandbox) -> SandboxInfo {
    SandboxInfo {
        id: s.id.to_string(),
        image: s.spec.image.clone(),
        state: if s.is_alive() { s.run_state().to_string() } else { "exited".to_string() },
        limits: s.limits(),
        hostname: s.spec.hostname.clone(),
        created_at: s.created_at,
        shim_pid: s.shim_pid,
        cgroup: s.cgroup_path().to_string(),
        mounts: s.spec.mounts.clone(),
        userns: s.spec.userns,
        work_context: s.spec.work_context.clone(),
        restored: s.spec.restored.clone(),
        seccomp: if s.spec.seccomp_unconfined { "unconfined" } else { "default" }.into(),
        lifetime: s.lifetime(),
        network: s.network_spec(),
        netns: s.spec.netns.clone(),
        secret_env: s.spec.secret_names.clone(),
    }
}

pub(crate) fn image_info(r: &ImageRow) -> ImageInfo {
    ImageInfo {
        name: r.name.clone(),
        manifest_digest: r.manifest_digest.to_string(),
        config_digest: r.config_digest.to_string(),
        layers: r.layers.iter().map(|h| format!("sha256:{h}")).collect(),
        created_at: r.created_at,
    }
}

impl Daemon {
    /// Pin `id` against removal; refused if it is being removed.
    pub(crate) fn pin_snapshot(&self, id: &SnapshotId) -> Result<SnapshotPin<'_>, SnapshotLookupError> {
        let mut pool = lock(&self.pool);
        if pool.doomed.contains(id.as_str()) {
            return Err(SnapshotLookupError::BeingRemoved(id.clone()));
        }
        *pool.pinned.entry(id.to_string()).or_default() += 1;
        Ok(SnapshotPin { daemon: self, id: id.to_string() })
    }

    /// A live sandbox of this host by id, not marked in use (for the
    /// daemon's own work on it, which must not count as activity).
    pub fn live_sandbox(&self, id: &str) -> Option<Arc<Sandbox>> {
        let id: SandboxId = id.parse().ok()?;
        lock(&self.pool).live.get(&id).cloned()
    }

    /// A live sandbox by id, in use until the handle is dropped: no idle
    /// suspend cuts into the call that looked it up, and its idle timeout
    /// starts again when the call ends.
    pub fn sandbox(&self, id: &str) -> Result<sandbox::InUse, SandboxOpError> {
        let id: SandboxId = id.parse().map_err(|_| SandboxOpError::NotFound(format!("{id:?}")))?;
        let sb = lock(&self.pool).live.get(&id).cloned().ok_or_else(|| SandboxOpError::NotFound(id.to_string()))?;
        Ok(sandbox::InUse::new(sb))
    }

    pub fn list_sandboxes(&self) -> Vec<SandboxInfo> {
        // Clone the handles first: a sandbox's state lock may be held by a
        // slow freeze, and the pool lock must not wait on it.
        let live: Vec<Arc<Sandbox>> = lock(&self.pool).live.values().cloned().collect();
        let mut v: Vec<SandboxInfo> = live.iter().map(|s| sandbox_info(s)).collect();
        v.sort_by(|a, b| (a.created_at, &a.id).cmp(&(b.created_at, &b.id)));
        v
    }

    pub(crate) fn snapshot_row(&self, id: &str) -> Result<SnapshotRow, SnapshotLookupError> {
        self.snapshot_row_in(&lock(&self.db), id)
    }

    pub(crate) fn snapshot_row_in(
        &self,
        db: &crate::catalog::Db,
        id: &str,
    ) -> Result<SnapshotRow, SnapshotLookupError> {
        let not_found = || SnapshotLookupError::NotFound(format!("{id:?}"));
        let id: SnapshotId = id.parse().map_err(|_| not_found())?;
        db.snapshot(id.as_str())?.ok_or_else(not_found)
    }
}
