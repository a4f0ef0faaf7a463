//! `suspend`: stop a sandbox and seal its upper by moving it (no copy),
//! releasing its slot; the blob is written in the background.

use std::time::Instant;

use super::capture::CaptureError;
use crate::daemon::{lock, Daemon};
use crate::types::SnapshotInfo;

impl Daemon {
    /// Stop every process of a sandbox, move its upper into the layer store
    /// as the snapshot's layer (no file data is read or copied), release the
    /// sandbox and return the snapshot. Hashing, syncing and compressing the
    /// layer happen in the background (`state` is `sealing` until then);
    /// resume and fork work at once.
    pub fn suspend(&self, id: &str) -> Result<SnapshotInfo, CaptureError> {
        let sb = self.sandbox(id)?;
        self.suspend_sandbox(&sb, None)
    }

    /// [`Daemon::suspend`] of `sb`, or with `idle` (its use count when its
    /// idle timeout was taken) the reaper's idle suspend, dropped
    /// (`UsedAgain`) if the sandbox was used since.
    pub(crate) fn suspend_sandbox(
        &self,
        sb: &crate::sandbox::Sandbox,
        idle: Option<u64>,
    ) -> Result<SnapshotInfo, CaptureError> {
        sb.own_layers("suspend")?;
        let started = Instant::now();
        // Refuse before stopping anything if the append would be refused (the
        // append checks again, atomically).
        self.check_fence(&sb.id)?;
        match idle {
            Some(uses) => sb.begin_idle_stop(uses)?,
            None if sb.begin_stop() => {}
            None => return Err(CaptureError::NotSuspendable(sb.id.clone())),
        }
        if let Err(e) = sb.stop() {
            sb.end_stop();
            return Err(e.into());
        }
        match self.leased(|lease| self.seal_upper(sb, started, lease)) {
            Ok(info) => {
                crate::failpoint::hit("suspend:appended");
                lock(&self.pool).live.remove(&sb.id);
                self.slots.notify_all();
                let _ = self.rt.store.discard_sandbox(&sb.id);
                self.queue_blob(&info.id);
                tracing::info!("suspended sandbox {} as snapshot {}", sb.id, info.id);
                Ok(info)
            }
            Err(e) => {
                // Its processes are gone, its upper is back in place: the
                // sandbox is listed as exited and can be removed.
                sb.end_stop();
                Err(e)
            }
        }
    }
}
