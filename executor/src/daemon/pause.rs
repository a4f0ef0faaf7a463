//! `pause` and `unpause`: freeze a sandbox in place (its cgroup's freezer)
//! and thaw it.

use crate::catalog::SandboxState;

use super::{lock, Daemon, SandboxOpError};

impl Daemon {
    /// Freeze every process of a sandbox in place (temporal snapshot).
    pub fn pause_sandbox(&self, id: &str) -> Result<(), SandboxOpError> {
        let sb = self.sandbox(id)?;
        sb.pause()?;
        lock(&self.db).set_sandbox_state(&sb.id, SandboxState::Paused)?;
        Ok(())
    }

    pub fn unpause_sandbox(&self, id: &str) -> Result<(), SandboxOpError> {
        let sb = self.sandbox(id)?;
        sb.unpause()?;
        lock(&self.db).set_sandbox_state(&sb.id, SandboxState::Running)?;
        Ok(())
    }
}
