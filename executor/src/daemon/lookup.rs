//! Finding what a verb works on: a live sandbox (refused while it stops,
//! or named on another host), the list of them, and a snapshot pinned
//! against removal while a launch reads it.

use std::sync::Arc;

use crate::catalog::DbError;
use crate::error::{Classify, ErrorKind};
use crate::ids::{SandboxId, SnapshotId};
use crate::sandbox::{self, Sandbox};
use crate::types::SandboxInfo;

use super::{lock, snapshots, Daemon};

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
        limits: s.spec.limits,
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
        secret_env: s.spec.secret_names.clone(),
    }
}

impl Daemon {
    /// Pin `id` against removal; refused if it is being removed.
    pub(crate) fn pin_snapshot(&self, id: &SnapshotId) -> Result<SnapshotPin<'_>, snapshots::SnapshotLookupError> {
        let mut pool = lock(&self.pool);
        if pool.doomed.contains(id.as_str()) {
            return Err(snapshots::SnapshotLookupError::BeingRemoved(id.clone()));
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
}
