//! Export of a snapshot (its whole chain) as a standard OCI image layout, so
//! third-party tools (umoci, skopeo, registries) read what Strata wrote.
//!
//! Each layer of the chain becomes a blob: a snapshot's own blob when its
//! compression is the one asked for, otherwise the layer is serialised again
//! from its hydrated tree with `diff::write_delta` (deterministic, so the
//! same tree always gives the same diff_id) and compressed. The image config
//! carries the image's env, working dir, user, entrypoint and cmd, and the
//! manifest's annotations the snapshot's metadata.

use std::io::Write;
use std::path::{Path, PathBuf};

use std::collections::HashMap;

use crate::oci::layout::{MEDIA_OCI_CONFIG, MEDIA_OCI_MANIFEST};
use sha2::{Digest as _, Sha256};

use crate::catalog::{ImageRow, SnapshotRow};
use crate::store::diff;
use crate::store::{compress_into, remove_tree, BlobCompression, Store, StoreError};

#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    #[error("export path {0} must be absolute")]
    Relative(PathBuf),
    #[error("export path {0} already exists; choose a new directory")]
    Exists(PathBuf),
    #[error("serialise layer {hex}")]
    Layer {
        hex: String,
        #[source]
        source: diff::DiffError,
    },
    #[error("{step} {path}")]
    Io {
        step: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Store(#[from] StoreError),
    /// A digest recorded in the catalog is not a sha256 digest.
    #[error("recorded digest {digest:?}")]
    Digest {
        digest: String,
        #[source]
        source: crate::oci::DigestError,
    },
}

/// A descriptor of a blob whose digest the catalog recorded as text.
pub(crate) fn recorded_descriptor(
    media_type: &str,
    digest: &str,
    size: u64,
) -> Result<oci_spec::image::Descriptor, ExportError> {
    let d: crate::oci::Digest =
        digest.parse().map_err(|source| ExportError::Digest { digest: digest.to_string(), source })?;
    Ok(crate::oci::descriptor(media_type, &d, size))
}

fn io<'a>(step: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> ExportError + 'a {
    move |source| ExportError::Io { step, path: path.into(), source }
}

/// What was written.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, PartialEq)]
pub struct Exported {
    pub path: String,
    pub manifest_digest: String,
    pub layers: usize,
}

pub(crate) fn layer_media_type(c: BlobCompression) -> &'static str {
    match c {
        BlobCompression::Zstd => "application/vnd.oci.image.layer.v1.tar+zstd",
        BlobCompression::Gzip => "application/vnd.oci.image.layer.v1.tar+gzip",
    }
}

/// Write `bytes` as a blob of the layout; returns its descriptor digest.
fn put_blob(dir: &Path, bytes: &[u8]) -> Result<String, ExportError> {
    let hex = hex::encode(Sha256::digest(bytes));
    let p = dir.join("blobs/sha256").join(&hex);
    std::fs::write(&p, bytes).map_err(io("write", &p))?;
    Ok(format!("sha256:{hex}"))
}

pub(crate) fn oci_arch() -> &'static str {
    match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        other => other,
    }
}

/// Export the chain `image` + `chain` (root first) to a new directory `dest`.
pub fn export(
    store: &Store,
    image: &ImageRow,
    chain: &[SnapshotRow],
    dest: &Path,
    compression: BlobCompression,
) -> Result<Exported, ExportError> {
    if !dest.is_absolute() {
        return Err(ExportError::Relative(dest.into()));
    }
    if dest.symlink_metadata().is_ok() {
        return Err(ExportError::Exists(dest.into()));
    }
    // Build under tmp/, move into place at the end: a failure leaves nothing.
    let work = store.new_tmp("export")?;
    let result = write_layout(store, image, chain, &work, compression);
    let out = work.join("layout");
    // Only a cross-filesystem rename falls back to a copy, and the copy
    // creates `dest` exclusively: an export never writes into, or deletes, a
    // directory it did not create.
    let mut created = false;
    let done = result.and_then(|e| {
        match std::fs::rename(&out, dest) {
            Ok(()) => Ok(()),
            Err(err) if err.raw_os_error() == Some(libc::EXDEV) => std::fs::create_dir(dest).and_then(|()| {
                created = true;
                copy_dir(&out, dest)
            }),
            Err(err) => Err(err),
        }
        .map_err(io("move export into place", dest))?;
        Ok(e)
    });
    let _ = remove_tree(&work);
    if done.is_err() && created {
        let _ = std::fs::remove_dir_all(dest);
    }
    done.map(|mut e| {
        e.path = dest.display().to_string();
        e
    })
}

/// `rename` fails across filesystems; then copy the (flat) layout into the
/// directory the caller just created.
fn copy_dir(src: &Path, dst: &Path) -> std::io::Result<()> {
    std::fs::create_dir(dst.join("blobs"))?;
    std::fs::create_dir(dst.join("blobs/sha256"))?;
    for f in ["oci-layout", "index.json"] {
        std::fs::copy(src.join(f), dst.join(f))?;
    }
    for e in std::fs::read_dir(src.join("blobs/sha256"))? {
        let e = e?;
        std::fs::copy(e.path(), dst.join("blobs/sha256").join(e.file_name()))?;
    }
    Ok(())
}

fn write_layout(
    store: &Store,
    image: &ImageRow,
    chain: &[SnapshotRow],
    work: &Path,
    compression: BlobCompression,
) -> Result<Exported, ExportError> {
    let dir = work.join("layout");
    let blobs = dir.join("blobs/sha256");
    std::fs::create_dir_all(&blobs).map_err(io("create", &blobs))?;

    let mut layers = Vec::new();
    let mut diff_ids = Vec::new();
    let snapshot_of = |layer: &str| chain.iter().find(|s| s.layer == layer);
    for hex in image.layers.iter().chain(chain.iter().map(|s| &s.layer)) {
        let sealed =
            snapshot_of(hex).and_then(|s| Some((s, s.diff_id.as_ref()?.hex().to_string(), s.blob_digest.as_ref()?)));
        let (digest, size, diff_id) = match sealed {
            Some((s, diff_id, digest)) if s.compression == compression => {
                let dst = blobs.join(digest.hex());
                std::fs::copy(store.blob_path(digest.hex()), &dst).map_err(io("copy blob", &dst))?;
                (digest.to_string(), s.blob_size, diff_id)
            }
            _ => {
                let l = serialise_layer(store, hex, work, compression)?;
                let dst = blobs.join(&l.digest_hex);
                std::fs::rename(&l.path, &dst).map_err(io("move blob", &dst))?;
                (format!("sha256:{}", l.digest_hex), l.size, l.diff_id)
            }
        };
        diff_ids.push(format!("sha256:{diff_id}"));
        layers.push(recorded_descriptor(layer_media_type(compression), &digest, size)?);
    }

    let config = config_document(image, &diff_ids, HashMap::new());
    let config_bytes = crate::oci::canonical_json(&config).map_err(|e| ExportError::Io {
        step: "encode config",
        path: dir.clone(),
        source: e.into(),
    })?;
    let config_digest = put_blob(&dir, &config_bytes)?;
    let count = layers.len();
    let config_desc = recorded_descriptor(MEDIA_OCI_CONFIG, &config_digest, config_bytes.len() as u64)?;
    let manifest = manifest_document(config_desc, layers, chain_annotations(image, chain));
    let manifest_bytes = crate::oci::canonical_json(&manifest).map_err(|e| ExportError::Io {
        step: "encode manifest",
        path: dir.clone(),
        source: e.into(),
    })?;
    let manifest_digest = put_blob(&dir, &manifest_bytes)?;
    let mut entry = recorded_descriptor(MEDIA_OCI_MANIFEST, &manifest_digest, manifest_bytes.len() as u64)?;
    entry.set_annotations(Some(HashMap::from([(oci_spec::image::ANNOTATION_REF_NAME.to_string(), "latest".into())])));
    crate::oci::layout::write_root(&dir, vec![entry]).map_err(io("write the layout root in", &dir))?;
    Ok(Exported { path: String::new(), manifest_digest, layers: count })
}

/// A layer serialised again from its hydrated tree and compressed, in `work`.
pub(crate) struct Serialised {
    pub path: PathBuf,
    pub digest_hex: String,
    pub size: u64,
    pub diff_id: String,
}

/// Serialise layer `id` from its tree (`diff::write_delta`, deterministic)
/// and compress it into a blob file under `work`.
pub(crate) fn serialise_layer(
    store: &Store,
    id: &str,
    work: &Path,
    compression: BlobCompression,
) -> Result<Serialised, ExportError> {
    let tar = work.join(format!("{id}.tar"));
    let f = std::fs::File::create(&tar).map_err(io("create", &tar))?;
    let mut w = std::io::BufWriter::new(f);
    let (_, diff_id) = diff::write_delta(&store.layer_dir(id).join("fs"), &mut w)
        .map_err(|source| ExportError::Layer { hex: id.to_string(), source })?;
    w.flush().map_err(io("write", &tar))?;
    drop(w);
    let path = work.join(format!("{id}.blob"));
    let compressed = compress_into(&tar, compression, &path).map_err(io("compress", &tar));
    let _ = std::fs::remove_file(&tar);
    let (digest_hex, size) = compressed?;
    Ok(Serialised { path, digest_hex, size, diff_id })
}

/// The OCI image config of an image plus layers: the image's process
/// settings, `diff_ids` and `labels`.
pub(crate) fn config_document(
    image: &ImageRow,
    diff_ids: &[String],
    labels: HashMap<String, String>,
) -> oci_spec::image::ImageConfiguration {
    let c = &image.config;
    let some = |v: &Vec<String>| (!v.is_empty()).then(|| v.clone());
    let mut cfg = oci_spec::image::Config::default();
    cfg.set_env(some(&c.env));
    cfg.set_working_dir(c.working_dir.clone());
    cfg.set_user(c.user.clone());
    cfg.set_entrypoint(some(&c.entrypoint));
    cfg.set_cmd(some(&c.cmd));
    cfg.set_labels((!labels.is_empty()).then_some(labels));
    let mut rootfs = oci_spec::image::RootFs::default();
    rootfs.set_diff_ids(diff_ids.to_vec());
    let mut doc = oci_spec::image::ImageConfiguration::default();
    doc.set_architecture(oci_arch().into());
    doc.set_os(oci_spec::image::Os::Linux);
    doc.set_config(Some(cfg));
    doc.set_rootfs(rootfs);
    doc
}

/// The manifest's annotations: the image's name and the top snapshot.
pub(crate) fn chain_annotations(image: &ImageRow, chain: &[SnapshotRow]) -> HashMap<String, String> {
    let mut annotations = HashMap::new();
    annotations.insert("dev.strata.image".into(), image.name.to_string());
    if let Some(top) = chain.last() {
        annotations.insert("dev.strata.snapshot.id".into(), top.id.to_string());
        if let Some(parent) = &top.parent_id {
            annotations.insert("dev.strata.snapshot.parent".into(), parent.to_string());
        }
        annotations.insert("dev.strata.snapshot.source-sandbox".into(), top.source_sandbox.clone());
    }
    annotations
}

/// An OCI image manifest with annotations.
pub(crate) fn manifest_document(
    config: oci_spec::image::Descriptor,
    layers: Vec<oci_spec::image::Descriptor>,
    annotations: HashMap<String, String>,
) -> oci_spec::image::ImageManifest {
    let mut m = crate::oci::image_manifest(config, layers);
    m.set_annotations(Some(annotations));
    m
}
