//! `PUT /v1/sandboxes/{id}/limits` (`strata update`): a live sandbox's
//! memory, pids and CPU limits changed in place, as `runc update` and
//! containerd's Update do. The new limits pass the same checks a create's
//! do (the daemon's defaults and maximums included), are written to the
//! sandbox's cgroup, and are kept in its spec (a restarted daemon adopts
//! them). The disk cap is the size of the sandbox's own file system and
//! cannot change.

use crate::daemon::{lock, sandbox_info, Daemon};
use crate::error::{Classify, ErrorKind};
use crate::ids::SandboxId;
use crate::types::{LimitsRequest, SandboxInfo};

/// Why a limits change was refused.
#[derive(Debug, thiserror::Error, displaydoc::Display)]
pub enum LimitsOpError {
    /// {0}
    Sandbox(#[from] crate::daemon::SandboxOpError),
    /// {0}
    Invalid(#[from] crate::sandbox::cgroups::LimitsError),
    /// a disk cap is the size of the sandbox's own file system, fixed when it starts
    Disk,
    /// sandbox {id}: the kernel refused the new limits ({source}); the old ones stay
    Refused {
        id: SandboxId,
        #[source]
        source: Box<crate::sandbox::cgroups::CgroupError>,
    },
    /// sandbox {0} is going away
    Gone(SandboxId),
    /// {0}
    Db(#[from] crate::catalog::DbError),
}

impl Classify for LimitsOpError {
    fn kind(&self) -> ErrorKind {
        match self {
            LimitsOpError::Sandbox(e) => e.kind(),
            LimitsOpError::Invalid(_) | LimitsOpError::Disk => ErrorKind::InvalidArgument,
            // A memory limit below what the sandbox holds (v1 answers EBUSY).
            LimitsOpError::Refused { .. } | LimitsOpError::Gone(_) => ErrorKind::Conflict,
            LimitsOpError::Db(e) => e.kind(),
        }
    }
}

impl Daemon {
    /// Change a live sandbox's limits; what the request leaves out stays.
    pub fn set_limits(&self, id: &str, req: LimitsRequest) -> Result<SandboxInfo, LimitsOpError> {
        if req.disk.is_some() {
            return Err(LimitsOpError::Disk);
        }
        let sb = self.sandbox(id)?;
        if sb.gone().is_set() {
            return Err(LimitsOpError::Gone(sb.id.clone()));
        }
        let asked = req.over(sb.limits());
        asked.validate(self.host_cpus)?;
        let new = self.cfg.limit_policy.settle(asked)?;
        let old = sb
            .set_limits(new)
            .map_err(|source| LimitsOpError::Refused { id: sb.id.clone(), source: Box::new(source) })?;
        let undo = |e| {
            let _ = sb.set_limits(old);
            e
        };
        match lock(&self.db).set_sandbox_limits(&sb.id, &sb.limits()) {
            Ok(true) => {}
            Ok(false) => return Err(undo(LimitsOpError::Gone(sb.id.clone()))),
            Err(e) => return Err(undo(e.into())),
        }
        let l = sb.limits();
        tracing::info!("sandbox {}: limits now memory {:?} pids {:?} cpus {:?}", sb.id, l.memory, l.pids, l.cpus);
        Ok(sandbox_info(&sb))
    }
}
