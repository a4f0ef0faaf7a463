//! `rollback`: a sandbox back to one of its own lineage's snapshots, in
//! place, with fresh processes.

use super::lookup::SnapshotLookupError;
use crate::daemon::{lock, sandbox_info, Daemon};
use crate::error::{Classify, ErrorKind};
use crate::ids::{SandboxId, SnapshotId};
use crate::model::{Rung, StartKind};
use crate::types::SandboxInfo;

/// Why `rollback` failed.
#[derive(Debug, thiserror::Error, displaydoc::Display)]
pub enum RollbackError {
    /// {0}
    Sandbox(#[from] crate::daemon::SandboxOpError),
    /// {0}
    Snapshot(#[from] SnapshotLookupError),
    /// snapshot {snapshot} is not in sandbox {sandbox}'s lineage (neither its base nor its own checkpoint)
    NotInLineage { snapshot: SnapshotId, sandbox: SandboxId },
    /// sandbox {sandbox} is {state}: rollback refused
    Stopping { sandbox: SandboxId, state: crate::sandbox::RunState },
    /// {0}
    Stop(#[from] crate::sandbox::SandboxError),
    /// {0}
    Launch(#[from] crate::daemon::LaunchError),
    /// {0}
    Db(#[from] crate::catalog::DbError),
}

impl Classify for RollbackError {
    fn kind(&self) -> ErrorKind {
        match self {
            RollbackError::Sandbox(e) => e.kind(),
            RollbackError::Snapshot(e) => e.kind(),
            RollbackError::NotInLineage { .. } | RollbackError::Stopping { .. } => ErrorKind::Conflict,
            RollbackError::Stop(e) => e.kind(),
            RollbackError::Launch(e) => e.kind(),
            RollbackError::Db(e) => e.kind(),
        }
    }
}

impl Daemon {
    /// Discard a sandbox's current changes and continue from a snapshot of
    /// its own lineage (its base chain, or a checkpoint it took). Processes
    /// are restarted fresh; the sandbox keeps its id, limits, env and
    /// hostname. Later checkpoints are children of that snapshot.
    pub fn rollback(&self, id: &str, to: &str) -> Result<SandboxInfo, RollbackError> {
        let sb = self.sandbox(id)?;
        let row = self.snapshot_row(to)?;
        let in_base = match &sb.spec.snapshot {
            Some(base) => lock(&self.db).snapshot_chain(base)?.iter().any(|s| s.id == row.id),
            None => false,
        };
        let (wc, observed) = lock(&self.db).sandbox_lineage(&sb.id)?;
        let own = wc.is_some() && row.work_context == wc;
        if !in_base && !own && row.source_sandbox != sb.id.as_str() {
            return Err(RollbackError::NotInLineage { snapshot: row.id, sandbox: sb.id.clone() });
        }
        let _pin = self.pin_snapshot(&row.id)?;
        let mut base = self.snapshot_base(&row)?;
        // Same lineage, same fence: a rollback does not move the head.
        base.work_context = match wc {
            Some(wc) => wc,
            None => {
                // A sandbox from before lineages: its own lineage, from now.
                let _ = self.new_lineage(Some(sb.id.as_str()), base.image.id, StartKind::Image, None);
                sb.id.to_string()
            }
        };
        base.observed_head = observed;
        base.rung = Rung::Rollback;
        if !sb.begin_stop() {
            return Err(RollbackError::Stopping { sandbox: sb.id.clone(), state: sb.run_state() });
        }
        // Keep the slot: reserve for the replacement before the old one goes.
        lock(&self.pool).reserved += 1;
        let result = (|| {
            if let Err(e) = sb.destroy(&self.rt.store) {
                sb.end_stop();
                return Err(RollbackError::from(e));
            }
            lock(&self.pool).live.remove(&sb.id);
            lock(&self.db).delete_sandbox(&sb.id)?;
            let launch = crate::daemon::LaunchSpec {
                id: None,
                wait: None,
                limits: sb.limits(),
                // The rolled-back sandbox keeps its deadline.
                lifetime: sb.lifetime(),
                env: sb.spec.env.clone(),
                // Its lineage's, from this host's file.
                secret_env: Vec::new(),
                hostname: Some(sb.spec.hostname.clone()),
                mounts: sb.spec.mounts.clone(),
                seccomp_unconfined: sb.spec.seccomp_unconfined,
                userns: Some(sb.spec.userns.is_some()),
                userns_map: sb.spec.userns,
                // Its network and policy (its address is given again).
                network: Some(sb.network_kept()),
                // The namespace it joined, joined again.
                netns: sb.spec.netns.clone(),
                // On the snapshot's layers (a sandbox on a host directory
                // has no snapshot to go back to).
                root_dir: None,
            };
            Ok(self.launch_reserved(&base, launch, Some(sb.id.clone()))?)
        })();
        let new = self.end_reservation(result)?;
        tracing::info!("rolled sandbox {} back to snapshot {}", new.id, row.id);
        Ok(sandbox_info(&new))
    }
}
