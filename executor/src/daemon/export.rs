//! `snapshot export`: a snapshot's whole chain as an OCI image layout.

use std::path::Path;

use super::lookup::{restorable, SnapshotLookupError};
use crate::daemon::{lock, Daemon};
use crate::error::{Classify, ErrorKind};
use crate::store::BlobCompression;

/// Why `snapshot export` failed.
#[derive(Debug, thiserror::Error, displaydoc::Display)]
pub enum SnapshotExportError {
    /// {0}
    Snapshot(#[from] SnapshotLookupError),
    /// {0}
    Export(#[from] crate::export::ExportError),
    /// {0}
    Db(#[from] crate::catalog::DbError),
}

impl Classify for SnapshotExportError {
    fn kind(&self) -> ErrorKind {
        match self {
            SnapshotExportError::Snapshot(e) => e.kind(),
            SnapshotExportError::Export(crate::export::ExportError::Relative(_)) => ErrorKind::InvalidArgument,
            SnapshotExportError::Export(crate::export::ExportError::Exists(_)) => ErrorKind::Conflict,
            SnapshotExportError::Export(_) => ErrorKind::of_host_failure(self),
            SnapshotExportError::Db(e) => e.kind(),
        }
    }
}

impl Daemon {
    /// Write the snapshot's whole chain as an OCI image layout at `path`.
    pub fn export_snapshot(
        &self,
        id: &str,
        path: &str,
        compression: BlobCompression,
    ) -> Result<crate::export::Exported, SnapshotExportError> {
        let row = self.snapshot_row(id)?;
        restorable(&row)?;
        let _pin = self.pin_snapshot(&row.id)?;
        let (image, chain) = {
            let db = lock(&self.db);
            let image = db.image_by_id(row.image_id)?.ok_or(SnapshotLookupError::NoImageRow)?;
            (image, db.snapshot_layer_chain(&row.id)?)
        };
        for s in &chain {
            self.hydrate_layer(&s.layer).map_err(|e| SnapshotLookupError::Hydrate(Box::new(e)))?;
        }
        Ok(crate::export::export(&self.rt.store, &image, &chain, Path::new(path), compression)?)
    }
}
