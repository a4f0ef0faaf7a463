//! Pause and unpause: a temporal snapshot. Every process of the sandbox is
//! frozen in place by the cgroup freezer (v1 `freezer.state`, v2
//! `cgroup.freeze`) and thawed later. Nothing is written to the store: a
//! thousand pauses cost nothing but the freeze itself.

use std::time::Duration;

use super::{RunEvent, Sandbox, SandboxError};

/// How long the kernel may take to freeze every task.
const FREEZE_TIMEOUT: Duration = Duration::from_secs(10);

impl Sandbox {
    pub fn pause(&self) -> Result<(), SandboxError> {
        self.transition(RunEvent::Pause, "pause", || self.cgroup.freeze(FREEZE_TIMEOUT).map_err(SandboxError::Freezer))
            .map(drop)
    }

    pub fn unpause(&self) -> Result<(), SandboxError> {
        self.transition(RunEvent::Unpause, "unpause", || self.cgroup.thaw().map_err(SandboxError::Freezer)).map(drop)
    }
}
