//! `checkpoint`: seal what a running sandbox changed as a new snapshot at
//! its lineage's head; the sandbox runs on.

use std::time::Instant;

use super::capture::{removed_meanwhile, store_err, CaptureError, Capturing};
use crate::catalog::{LayerRow, SnapshotRow};
use crate::daemon::{lock, Daemon};
use crate::store::{remove_tree, BlobCompression};
use crate::types::SnapshotInfo;

impl Daemon {
    /// Seal the sandbox's current changes as a snapshot; it keeps running.
    /// What changed since its last checkpoint, over that one, unless
    /// `whole` (or there is none): then every change since it started.
    pub fn checkpoint(
        &self,
        id: &str,
        compression: BlobCompression,
        whole: bool,
    ) -> Result<SnapshotInfo, CaptureError> {
        let sb = self.sandbox(id)?;
        sb.own_layers("checkpoint")?;
        let started = Instant::now();
        // Refused before any row while it cannot be captured (stopping, or
        // in another capture); the capture checks again as it freezes.
        let state = sb.run_state();
        if state.next(crate::sandbox::RunEvent::Capture).is_none() {
            let refused = crate::sandbox::SandboxError::State { id: sb.id.clone(), state, action: "checkpoint" };
            return Err(refused.into());
        }
        // Incremental over the sandbox's last checkpoint, if that is still
        // there and what was recorded of it still holds.
        let since = if whole { None } else { self.last_capture(&sb) };
        let parent = since.as_ref().map(|(row, _)| row.id.clone()).or_else(|| sb.spec.snapshot.clone());
        // A row from now on (`capturing`: listed, never restorable), fenced
        // as its append will be: a sandbox fenced out of its lineage fails
        // before any work.
        let capture = {
            let mut db = lock(&self.db);
            let image = db.image_by_name(&sb.spec.image.parse()?)?.ok_or(CaptureError::NoImageRow)?;
            match db.begin_capture(&sb.id, image.id, parent.clone())? {
                Ok(id) => id,
                Err(fence) => return Err(CaptureError::Fenced { what: "checkpoint", fence }),
            }
        };
        crate::failpoint::hit("checkpoint:begun");
        let work = self.rt.store.new_tmp("checkpoint").map_err(store_err);
        // Appended to the sandbox's lineage, fenced on the head it observed.
        let append = |db: &mut crate::catalog::Db, row: &mut SnapshotRow, layer: &LayerRow| match db
            .append_checkpoint(&sb.id, row, layer, false, false)?
        {
            Ok(()) => Ok(()),
            Err(fence) => Err(CaptureError::Fenced { what: "checkpoint", fence }),
        };
        let result = work.and_then(|work| {
            let r = self.leased(|lease| {
                let cap = Capturing { sb: &sb, id: &capture, since: since.as_ref(), work: &work, started };
                self.capture_in(&cap, compression, &append, lease)
            });
            let _ = remove_tree(&work);
            r
        });
        // Whatever failed once the sandbox went away failed because it did.
        let result = result.map_err(|e| if sb.gone().is_set() { removed_meanwhile(&sb) } else { e });
        if let Err(e) = &result {
            if let Err(db) = lock(&self.db).capture_failed(capture.as_str(), &crate::error::chain(e)) {
                tracing::warn!("checkpoint {capture}: {}", crate::error::chain(&db));
            }
        }
        result
    }
}
