//! Image import: an OCI layout (directory or archive) becomes an image row
//! plus hydrated layers, all or nothing.
//!
//! Layers are unpacked under `tmp/`, checked (blob digest, diff_id, hostile
//! entries), synced, and renamed into `layers/` only when every layer of the
//! image succeeded; then one transaction records the image. A failure leaves
//! nothing in the store. Imports are serialised by the caller's lock.

use std::path::Path;

use crate::db::{Db, DbError, ImageRow, LayerRow};
use crate::error::ErrorKind;
use crate::ids::ImageName;
use crate::oci;
use crate::store::{Store, StoreError};

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

impl ImageError {
    pub fn kind(&self) -> ErrorKind {
        match self {
            ImageError::Exists(_) | ImageError::InUse { .. } => ErrorKind::Conflict,
            ImageError::NotFound(_) => ErrorKind::NotFound,
            ImageError::Layout { source, .. } if source.is_io() => ErrorKind::Internal,
            ImageError::Layout { .. } => ErrorKind::InvalidArgument,
            ImageError::Unpack { source, .. } if source.is_io() => ErrorKind::Internal,
            ImageError::Unpack { .. } => ErrorKind::InvalidArgument,
            ImageError::Store(_) | ImageError::Db(_) => ErrorKind::Internal,
        }
    }
}

/// Import the image at `path` (its manifest tagged `tag`, if given) as
/// `name`. `db` is locked only for the short metadata steps, never while
/// unpacking.
pub fn import(
    store: &Store,
    db: &std::sync::Mutex<Db>,
    path: &Path,
    tag: Option<&str>,
    name: &ImageName,
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
        import_source(store, db, &src, name, &work, Vec::new())
    })();
    // Whatever happened, tmp/ holds nothing of this import afterwards.
    crate::store::remove_tree(&work)?;
    result
}

/// Import an opened image as `name`, using `work` (under `tmp/`) for the
/// unpacked layers. Layers this host has are not unpacked again (their
/// blobs may be absent from `src`); the blobs of the others are kept in
/// `blobs/` so that a push can send them as they are. `held`: what the
/// caller holds already (a pull: the layers it found here and did not
/// fetch), given up with this import's own holds.
pub(crate) fn import_source<'s>(
    store: &'s Store,
    db: &std::sync::Mutex<Db>,
    src: &oci::ImageSource,
    name: &ImageName,
    work: &Path,
    mut held: Vec<crate::store::Hold<'s>>,
) -> Result<ImageRow, ImageError> {
    let mut blobs = Vec::new();
    let result = (|| {
        // Unpack every layer this host lacks into tmp/ first.
        let mut rows = Vec::with_capacity(src.layers.len());
        let mut fresh = Vec::new();
        for (index, layer) in src.layers.iter().enumerate() {
            let hex = layer.diff_id.hex().to_string();
            // Held until the rows are in: another operation giving up the
            // same layer or blob meanwhile (or removing an image that had
            // it) must not delete it (`Hold`).
            held.push(store.hold_layer(&hex));
            let have = lock(db).layer_exists(&hex)? && store.layer_dir(&hex).join("fs").is_dir();
            let mut row = LayerRow::content(&hex, 0, 0);
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
            rows.push((row, layer.digest.to_string()));
        }

        // All layers are good: move them and their blobs into place, then
        // record the image.
        for (hex, dir) in &fresh {
            held.push(store.commit_layer(dir, hex, true)?.1);
        }
        for (index, layer) in src.layers.iter().enumerate() {
            let bhex = layer.digest.hex();
            held.push(store.hold_blob(bhex));
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
            if store.adopt_blob(&copy, bhex, true)? {
                blobs.push(bhex.to_string());
            }
        }
        let mut db = lock(db);
        let id = db.insert_image(
            name,
            &src.manifest_digest.to_string(),
            &src.config_digest.to_string(),
            &src.config,
            &rows,
        )?;
        db.image_by_id(id)?.ok_or_else(|| ImageError::NotFound(name.to_string()))
    })();
    if result.is_err() {
        // Roll back the layers no row lists (those this import put in
        // place, and those it found there that a removal, turned away by
        // its holds, left) and the blobs it added that no row lists.
        give_up(store, db, held, &blobs);
        if lock(db).image_by_name(name)?.is_some() {
            return Err(ImageError::Exists(name.to_string()));
        }
    }
    result
}

/// Give up what an operation held (layers and blobs it may have put in
/// place or found there) and the blobs `added`: each layer held, and each
/// blob added, is deleted unless a row lists it or another operation
/// holds it ([`Store::remove_orphans`]). On the way out of a failure:
/// errors are logged, not returned.
pub(crate) fn give_up(store: &Store, db: &std::sync::Mutex<Db>, held: Vec<crate::store::Hold<'_>>, added: &[String]) {
    let mut layers: Vec<String> = held.iter().filter(|h| h.is_layer()).map(|h| h.id().to_string()).collect();
    if layers.is_empty() && added.is_empty() {
        return;
    }
    layers.sort();
    layers.dedup();
    let db = lock(db);
    drop(held);
    // A row that cannot be looked up keeps its layer or blob.
    layers.retain(|id| match db.layer_exists(id) {
        Ok(listed) => !listed,
        Err(e) => {
            tracing::warn!("give up layer {id}: {}", crate::error::chain(&e));
            false
        }
    });
    let used = if added.is_empty() { Ok(Default::default()) } else { db.all_blobs() };
    let blobs: Vec<&str> = match used {
        Ok(used) => added.iter().filter(|h| !used.contains(&format!("sha256:{h}"))).map(String::as_str).collect(),
        Err(e) => {
            tracing::warn!("give up blobs {added:?}: {}", crate::error::chain(&e));
            Vec::new()
        }
    };
    if let Err(e) = store.remove_orphans(db, &layers, blobs) {
        tracing::warn!("give up layers {layers:?} and blobs {added:?}: {}", crate::error::chain(&e));
    }
}

/// Remove an image; refused while a sandbox uses it. Layers no other image
/// uses are deleted (rows first, then directories).
pub fn remove(store: &Store, db: &std::sync::Mutex<Db>, name: &ImageName) -> Result<(), ImageError> {
    let mut db = db.lock().unwrap_or_else(|p| p.into_inner());
    let image = db.image_by_name(name)?.ok_or_else(|| ImageError::NotFound(name.to_string()))?;
    match db.delete_image(image.id)? {
        Err(users) => Err(ImageError::InUse { name: name.to_string(), users }),
        Ok(orphans) => {
            let used = db.all_blobs()?;
            let blobs = image.blobs.iter().filter(|b| !used.contains(*b)).map(|b| b.trim_start_matches("sha256:"));
            store.remove_orphans(db, &orphans, blobs).map_err(ImageError::from)
        }
    }
}
