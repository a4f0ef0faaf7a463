//! Image import: an OCI layout (directory or archive) becomes an image row
//! plus hydrated layers, all or nothing.
//!
//! Layers are unpacked under `tmp/`, checked (blob digest, diff_id, hostile
//! entries), synced, and renamed into `layers/` only when every layer of the
//! image succeeded; then one transaction records the image. A failure leaves
//! nothing in the store. Imports are serialised by the caller's lock.

use std::path::Path;

use crate::catalog::{Db, DbError, ImageRow, LayerRow};
use crate::error::ErrorKind;
use crate::ids::ImageName;
use crate::oci;
use crate::store::{Lease, Resource, Store, StoreError};

fn lock(db: &std::sync::Mutex<Db>) -> std::sync::MutexGuard<'_, Db> {
    db.lock().unwrap_or_else(|p| p.into_inner())
}

#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    #[error("image {0} already exists")]
    Exists(String),
    #[error("image {0} not found")]
    NotFound(String),
    #[error("image {name} is used by {users:?}; remove them first")]
    InUse { name: String, users: Vec<String> },
    #[error("read OCI image at {path}")]
    Layout {
        path: String,
        #[source]
        source: oci::LayoutError,
    },
    #[error("unpack layer {index} ({digest})")]
    Unpack {
        index: usize,
        digest: String,
        #[source]
        source: oci::UnpackError,
    },
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Db(#[from] DbError),
}

impl crate::error::Classify for ImageError {
    fn kind(&self) -> ErrorKind {
        match self {
            ImageError::Exists(_) | ImageError::InUse { .. } => ErrorKind::Conflict,
            ImageError::NotFound(_) => ErrorKind::NotFound,
            ImageError::Layout { source, .. } if source.is_io() => ErrorKind::of_host_failure(self),
            ImageError::Layout { .. } => ErrorKind::InvalidArgument,
            ImageError::Unpack { source, .. } if source.is_io() => ErrorKind::of_host_failure(self),
            ImageError::Unpack { .. } => ErrorKind::InvalidArgument,
            ImageError::Store(_) => ErrorKind::of_host_failure(self),
            ImageError::Db(e) => crate::error::Classify::kind(e),
        }
    }
}

/// Import the image at `path` (its manifest tagged `tag`, if given) as
/// `name`, its layers and blobs held by `lease`. `db` is locked only for
/// the short metadata steps, never while unpacking.
pub fn import(
    store: &Store,
    db: &std::sync::Mutex<Db>,
    path: &Path,
    tag: Option<&str>,
    name: &ImageName,
    lease: &Lease,
) -> Result<ImageRow, ImageError> {
    if lock(db).image_by_name(name)?.is_some() {
        return Err(ImageError::Exists(name.to_string()));
    }
    let work = store.new_tmp("import")?;
    let result = (|| {
        let scratch = work.join("src");
        std::fs::create_dir(&scratch).map_err(|source| StoreError::Io {
            step: "create",
            path: scratch.clone(),
            source,
        })?;
        let src = oci::open(path, &scratch, tag)
            .map_err(|source| ImageError::Layout { path: path.display().to_string(), source })?;
        import_source(store, db, &src, name, &work, lease)
    })();
    // Whatever happened, tmp/ holds nothing of this import afterwards.
    crate::store::remove_tree(&work)?;
    result
}

/// Import an opened image as `name`, using `work` (under `tmp/`) for the
/// unpacked layers. Layers this host has are not unpacked again (their
/// blobs may be absent from `src`); the blobs of the others are kept in
/// `blobs/` so that a push can send them as they are. Every layer and
/// blob it lists is held by `lease` before it is looked for (a pull's
/// lease holds the layers it found here already); what a failed import
/// put in place is the collector's once the lease ends.
pub(crate) fn import_source(
    store: &Store,
    db: &std::sync::Mutex<Db>,
    src: &oci::ImageSource,
    name: &ImageName,
    work: &Path,
    lease: &Lease,
) -> Result<ImageRow, ImageError> {
    let result = (|| {
        // Unpack every layer this host lacks into tmp/ first.
        let mut rows = Vec::with_capacity(src.layers.len());
        let mut fresh = Vec::new();
        for (index, layer) in src.layers.iter().enumerate() {
            let hex = layer.diff_id.hex().to_string();
            // Leased until the rows are in: the collector must not remove
            // it meanwhile (another operation's failure, or the removal of
            // an image that had it, may make it a candidate).
            lease.layer(&hex);
            let have = lock(db).layer_exists(&hex)? && store.layer_dir(&hex).join("fs").is_dir();
            let mut row = LayerRow::content(crate::ids::LayerId::from(&layer.diff_id), 0, 0);
            if !have && !fresh.iter().any(|(h, _): &(String, _)| *h == hex) {
                let dir = work.join(format!("layer-{index}"));
                let fs = dir.join("fs");
                std::fs::create_dir_all(&fs).map_err(|source| StoreError::Io {
                    step: "create",
                    path: fs.clone(),
                    source,
                })?;
                let stats = oci::unpack_layer(layer, &fs).map_err(|source| ImageError::Unpack {
                    index,
                    digest: layer.digest.to_string(),
                    source,
                })?;
                row.size = stats.bytes;
                row.entries = stats.entries;
                fresh.push((hex, dir));
            }
            rows.push((row, layer.digest.clone()));
        }

        // All layers are good: move them and their blobs into place, then
        // record the image.
        for (hex, dir) in &fresh {
            store.commit_layer(dir, hex, true, lease)?;
        }
        for (index, layer) in src.layers.iter().enumerate() {
            let bhex = layer.digest.hex();
            lease.blob(bhex);
            if store.blob_path(bhex).is_file() || !layer.blob_path.is_file() {
                continue;
            }
            let copy = work.join(format!("blob-{index}"));
            if layer.blob_path.starts_with(work) {
                std::fs::rename(&layer.blob_path, &copy)
            } else {
                std::fs::copy(&layer.blob_path, &copy).map(drop)
            }
            .map_err(|source| StoreError::Io { step: "keep blob", path: copy.clone(), source })?;
            store.adopt_blob(&copy, bhex, true, lease)?;
        }
        let mut db = lock(db);
        let id = db.insert_image(name, &src.manifest_digest, &src.config_digest, &src.config, &rows)?;
        db.image_by_id(id)?.ok_or_else(|| ImageError::NotFound(name.to_string()))
    })();
    if result.is_err() && lock(db).image_by_name(name)?.is_some() {
        return Err(ImageError::Exists(name.to_string()));
    }
    result
}

/// Remove an image's rows; refused while a sandbox uses it. Returns the
/// layers and blobs it listed that no row lists any more, for the
/// collector.
pub fn remove(db: &std::sync::Mutex<Db>, name: &ImageName) -> Result<Vec<Resource>, ImageError> {
    let mut db = db.lock().unwrap_or_else(|p| p.into_inner());
    let image = db.image_by_name(name)?.ok_or_else(|| ImageError::NotFound(name.to_string()))?;
    match db.delete_image(image.id)? {
        Err(users) => Err(ImageError::InUse { name: name.to_string(), users }),
        Ok(orphans) => {
            let blobs = image.blobs.iter().map(|b| Resource::Blob(b.hex().into()));
            Ok(orphans.into_iter().map(Resource::Layer).chain(blobs).collect())
        }
    }
}
