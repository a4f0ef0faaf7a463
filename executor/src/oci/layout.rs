//! Reading an OCI image layout (the `oci-layout` + `index.json` + `blobs/`
//! directory that skopeo, umoci and buildah write) or an OCI archive (the
//! same directory as a tar) into an `ImageSource`: the chosen manifest, the
//! image config and one `LayerSource` per layer.
//!
//! Every blob read here (nested indexes, the manifest, the config) is checked
//! against its descriptor's size and sha256 before it is parsed. Layer blobs
//! are only checked for presence and size: `unpack` hashes them while it
//! reads them. Digests are validated before they become paths, so a
//! descriptor cannot point outside `blobs/sha256/`. Owns nothing on disk
//! except the caller's scratch directory, which an archive is extracted into.
#![forbid(unsafe_code)]

use std::ffi::OsStr;
use std::fmt;
use std::fs::{self, File, OpenOptions};
use std::io::{self, BufReader, Read};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::digest::{Digest, DigestError};
use super::meter::{Meter, MeterState};
use super::tarpath::{self, PathError};

/// OCI image index (`index.json` and nested multi-platform indexes).
pub const MEDIA_OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";
/// OCI image manifest.
pub const MEDIA_OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
/// OCI image config.
pub const MEDIA_OCI_CONFIG: &str = "application/vnd.oci.image.config.v1+json";
/// Docker v2 schema 2 manifest list, the Docker form of an image index.
pub const MEDIA_DOCKER_LIST: &str = "application/vnd.docker.distribution.manifest.list.v2+json";
/// Docker v2 schema 2 manifest.
pub const MEDIA_DOCKER_MANIFEST: &str = "application/vnd.docker.distribution.manifest.v2+json";
/// Docker v2 schema 2 image config.
pub const MEDIA_DOCKER_CONFIG: &str = "application/vnd.docker.container.image.v1+json";

/// Annotation that names a manifest in `index.json` (the tag).
const REF_NAME: &str = "org.opencontainers.image.ref.name";
/// Largest index, manifest or config accepted (containerd allows 4 MiB for
/// manifests; configs with long histories can be bigger).
const MAX_JSON: u64 = 8 << 20;
/// How many image indexes may nest below `index.json`.
const MAX_DEPTH: usize = 4;

/// How a layer blob is compressed, from its media type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Compression {
    None,
    Gzip,
    Zstd,
}

impl Compression {
    /// The compression of a layer media type, OCI or Docker v2s2; `None` for
    /// media types that are not layers.
    pub fn from_media_type(media_type: &str) -> Option<Self> {
        match media_type {
            "application/vnd.oci.image.layer.v1.tar"
            | "application/vnd.oci.image.layer.nondistributable.v1.tar"
            | "application/vnd.docker.image.rootfs.diff.tar" => Some(Compression::None),
            "application/vnd.oci.image.layer.v1.tar+gzip"
            | "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip"
            | "application/vnd.docker.image.rootfs.diff.tar.gzip"
            | "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip" => Some(Compression::Gzip),
            "application/vnd.oci.image.layer.v1.tar+zstd"
            | "application/vnd.oci.image.layer.nondistributable.v1.tar+zstd" => Some(Compression::Zstd),
            _ => None,
        }
    }
}

impl fmt::Display for Compression {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Compression::None => "uncompressed",
            Compression::Gzip => "gzip",
            Compression::Zstd => "zstd",
        })
    }
}

/// The parts of an OCI image config that start a process, as stored with an
/// image. Empty strings in the source config become `None`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct ImageConfig {
    pub env: Vec<String>,
    pub working_dir: Option<String>,
    pub user: Option<String>,
    pub entrypoint: Vec<String>,
    pub cmd: Vec<String>,
}

/// One layer of an image: where its blob is and what it must hash to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerSource {
    /// `blobs/sha256/<hex>` inside the layout.
    pub blob_path: PathBuf,
    /// Digest of the blob as stored (compressed).
    pub digest: Digest,
    /// Size of the blob in bytes, from the manifest.
    pub size: u64,
    pub media_type: String,
    /// Digest of the uncompressed tar, from the config's `rootfs.diff_ids`.
    pub diff_id: Digest,
    pub compression: Compression,
}

/// An image read from a layout: the verified manifest and config and its
/// layers, bottom first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageSource {
    pub manifest_digest: Digest,
    /// The manifest exactly as stored (its sha256 is `manifest_digest`).
    pub manifest_json: Vec<u8>,
    pub config_digest: Digest,
    pub config: ImageConfig,
    /// The config exactly as stored (its sha256 is `config_digest`).
    pub config_json: Vec<u8>,
    pub layers: Vec<LayerSource>,
}

/// Why an image layout or archive could not be read.
#[derive(Debug, thiserror::Error)]
pub enum LayoutError {
    /// The image path could not be inspected.
    #[error("inspect image source {path}")]
    Inspect {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// The image path is a socket, device or similar.
    #[error("image source {path} is neither a directory nor a file")]
    NotDirOrFile { path: PathBuf },
    /// The scratch directory for an archive could not be listed.
    #[error("inspect scratch directory {path}")]
    Scratch {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// The scratch directory for an archive already has entries.
    #[error("scratch directory {path} is not empty")]
    ScratchNotEmpty { path: PathBuf },
    /// The archive could not be read or is not a well-formed tar.
    #[error("read oci archive {path}")]
    ReadArchive {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// PAX or long-name records in the archive are implausibly large.
    #[error("oci archive {path}: tar headers exceed the size limit")]
    ArchiveHeaderTooLarge { path: PathBuf },
    /// An archive entry name is absolute, climbs with `..` or is malformed.
    #[error("oci archive entry {entry:?} {problem}")]
    ArchivePath { entry: PathBuf, problem: PathError },
    /// An archive entry is a symlink, hard link, device or other non-file.
    #[error("oci archive entry {entry:?} is a {kind}; only regular files and directories are allowed")]
    ArchiveEntryType { entry: PathBuf, kind: &'static str },
    /// The archive ends inside an entry's data.
    #[error("oci archive entry {entry:?} is truncated")]
    ArchiveTruncated { entry: PathBuf },
    /// An archive entry could not be written to the scratch directory.
    #[error("extract oci archive entry {entry:?} to {path}")]
    ExtractEntry {
        entry: PathBuf,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// `oci-layout` or `index.json` could not be read.
    #[error("read {path}")]
    ReadFile {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// `oci-layout` or `index.json` is larger than any sane one.
    #[error("{path} is larger than {limit} bytes")]
    FileTooLarge { path: PathBuf, limit: u64 },
    /// A JSON document does not parse as what it should be.
    #[error("parse {what} {path}")]
    Parse {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    /// `oci-layout` names a version other than 1.0.0.
    #[error("unsupported image layout version {found:?}, want \"1.0.0\"")]
    LayoutVersion { found: String },
    /// A descriptor or diff_id holds something other than a sha256 digest.
    #[error("{what} has an invalid digest")]
    InvalidDigest {
        what: &'static str,
        #[source]
        source: DigestError,
    },
    /// A manifest, index or config descriptor declares a huge size.
    #[error("{what} blob {digest} is {size} bytes, more than the {limit} byte limit")]
    BlobTooLarge { what: &'static str, digest: Digest, size: u64, limit: u64 },
    /// A blob is missing or unreadable.
    #[error("open {what} blob {path}")]
    OpenBlob {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// A blob path holds a symlink, directory, FIFO or similar.
    #[error("{what} blob {path} is not a regular file")]
    BlobNotFile { what: &'static str, path: PathBuf },
    /// A blob's size differs from its descriptor's.
    #[error("{what} blob {digest} is {actual} bytes, its descriptor says {expected}")]
    BlobSize { what: &'static str, digest: Digest, expected: u64, actual: u64 },
    /// A blob's sha256 differs from its descriptor's.
    #[error("{what} blob hashes to {actual}, its descriptor says {expected}")]
    BlobDigest { what: &'static str, expected: Digest, actual: Digest },
    /// `index.json` lists no manifests.
    #[error("index.json lists no manifests")]
    NoManifest,
    /// No manifest carries the requested tag.
    #[error("no manifest in index.json is tagged {tag:?} (tags: {available:?})")]
    TagNotFound { tag: String, available: Vec<String> },
    /// Several manifests could be meant and nothing picks one.
    #[error("index lists {count} manifests and none is for {platform}; choose one by tag (PATH:TAG): {tags:?}")]
    Ambiguous { count: usize, platform: String, tags: Vec<String> },
    /// A `docker save` archive holds several images and nothing picks one.
    #[error("manifest.json lists {count} images{what}; choose one by tag (PATH:TAG or NAME:TAG): {tags:?}")]
    AmbiguousArchive { count: usize, what: String, tags: Vec<String> },
    /// An image index has no manifest for this host's platform.
    #[error("image index has no manifest for {platform}")]
    NoPlatform { platform: String },
    /// Image indexes nest deeper than `MAX_DEPTH`.
    #[error("image indexes nest deeper than {MAX_DEPTH} levels")]
    TooDeep,
    /// A descriptor or document has a media type this reader does not know.
    #[error("unsupported {what} media type {media_type:?}")]
    MediaType { what: &'static str, media_type: String },
    /// A descriptor and the blob it points to disagree on the media type.
    #[error("descriptor says media type {descriptor:?} but the blob says {blob:?}")]
    MediaTypeMismatch { descriptor: String, blob: String },
    /// A manifest with a schema version other than 2 (Docker schema 1).
    #[error("unsupported manifest schema version {version}")]
    SchemaVersion { version: u64 },
    /// The config has no `rootfs` or its type is not `layers`.
    #[error("config rootfs type is {found:?}, want \"layers\"")]
    RootfsType { found: String },
    /// The manifest and the config disagree on the number of layers.
    #[error("manifest lists {layers} layers but the config lists {diff_ids} diff_ids")]
    LayerCount { layers: usize, diff_ids: usize },
}

impl LayoutError {
    /// Whether the fault is this host's (a local read or write failed), not
    /// the image's: the daemon answers 500 for these and 400 for the rest.
    /// A missing blob, a symlink where a blob should be, or a malformed tar
    /// is the image's fault.
    pub fn is_io(&self) -> bool {
        let host = |e: &io::Error| {
            e.raw_os_error()
                .is_some_and(|n| !matches!(n, libc::ENOENT | libc::ELOOP | libc::ENOTDIR | libc::EISDIR | libc::EEXIST))
        };
        match self {
            LayoutError::Scratch { .. } => true,
            LayoutError::Inspect { source, .. }
            | LayoutError::ReadArchive { source, .. }
            | LayoutError::ExtractEntry { source, .. }
            | LayoutError::ReadFile { source, .. }
            | LayoutError::OpenBlob { source, .. } => host(source),
            _ => false,
        }
    }
}

// --- wire formats ---
//
// Layouts, indexes, manifests, configs and descriptors are oci-spec's types
// (unknown fields ignored; a descriptor without the media type the spec
// requires does not parse). Only the probe below is ours: a document's own
// media type, checked against its descriptor's before it is parsed as one.

use oci_spec::image::{Descriptor, ImageConfiguration, ImageIndex as Index, ImageManifest as Manifest, OciLayout};

/// A document's own media type, if it names one.
#[derive(Debug, Deserialize)]
struct Probe {
    #[serde(rename = "mediaType")]
    media_type: Option<String>,
}

// --- entry points ---

/// Opens an image layout directory, or extracts an OCI archive file into the
/// empty directory `scratch` and opens that. `tag` picks the manifest whose
/// `org.opencontainers.image.ref.name` annotation equals it; without a tag
/// `index.json` must hold one manifest (or one for this host's platform).
pub fn open(path: &Path, scratch: &Path, tag: Option<&str>) -> Result<ImageSource, LayoutError> {
    let meta = fs::metadata(path).map_err(|source| LayoutError::Inspect { path: path.to_owned(), source })?;
    if meta.is_dir() {
        open_dir(path, tag)
    } else if meta.is_file() {
        extract_archive(path, scratch)?;
        // `docker save` before Docker 25: no index.json, a manifest.json.
        if !scratch.join("index.json").exists() && scratch.join("manifest.json").exists() {
            return open_docker_archive(scratch, tag);
        }
        open_dir(scratch, tag)
    } else {
        Err(LayoutError::NotDirOrFile { path: path.to_owned() })
    }
}

/// Reads an image layout directory (see `open`).
pub fn open_dir(root: &Path, tag: Option<&str>) -> Result<ImageSource, LayoutError> {
    open_dir_lacking(root, tag, &|_| false)
}

/// Reads an image layout directory in which the blobs of layers whose
/// diff_id satisfies `have` may be missing (a pull fetches only the layers
/// a host lacks). Their `LayerSource::blob_path` then names no file.
pub fn open_dir_lacking(
    root: &Path,
    tag: Option<&str>,
    have: &dyn Fn(&Digest) -> bool,
) -> Result<ImageSource, LayoutError> {
    let layout_path = root.join("oci-layout");
    let layout: OciLayout = parse("oci-layout", &layout_path, &read_small(&layout_path)?)?;
    if layout.image_layout_version() != "1.0.0" {
        return Err(LayoutError::LayoutVersion { found: layout.image_layout_version().clone() });
    }
    let index_path = root.join("index.json");
    let index: Index = parse("index.json", &index_path, &read_small(&index_path)?)?;
    let chosen = pick_tagged(&index, tag)?;
    let (manifest_digest, manifest_json, manifest) = resolve(root, chosen, 0)?;

    let config_desc = manifest.config();
    let mt = config_desc.media_type().to_string();
    if mt != MEDIA_OCI_CONFIG && mt != MEDIA_DOCKER_CONFIG {
        return Err(LayoutError::MediaType { what: "config", media_type: mt });
    }
    let (config_digest, config_json) = read_blob(root, config_desc, "config")?;
    let file: ImageConfiguration = parse("config", &blob_path(root, &config_digest), &config_json)?;
    let diff_ids = diff_ids(file.rootfs(), manifest.layers().len())?;
    let layers = manifest
        .layers()
        .iter()
        .zip(&diff_ids)
        .map(|(desc, diff_id)| layer_source(root, desc, diff_id, have))
        .collect::<Result<Vec<_>, _>>()?;

    Ok(ImageSource {
        manifest_digest,
        manifest_json,
        config_digest,
        config: image_config(file.config().as_ref()),
        config_json,
        layers,
    })
}

/// Write the root of an image layout in `dir`: `oci-layout` and an
/// `index.json` listing `manifests` (the blobs are the caller's).
pub fn write_root(dir: &Path, manifests: Vec<Descriptor>) -> io::Result<()> {
    let layout =
        oci_spec::image::OciLayoutBuilder::default().image_layout_version("1.0.0").build().map_err(io::Error::other)?;
    let index = oci_spec::image::ImageIndexBuilder::default()
        .schema_version(oci_spec::image::SCHEMA_VERSION)
        .media_type(oci_spec::image::MediaType::ImageIndex)
        .manifests(manifests)
        .build()
        .map_err(io::Error::other)?;
    fs::write(dir.join("oci-layout"), crate::oci::canonical_json(&layout)?)?;
    fs::write(dir.join("index.json"), crate::oci::canonical_json(&index)?)
}

/// A config's `rootfs.diff_ids`, which must list `layers` layers.
fn diff_ids(rootfs: &oci_spec::image::RootFs, layers: usize) -> Result<Vec<String>, LayoutError> {
    if rootfs.typ() != "layers" {
        return Err(LayoutError::RootfsType { found: rootfs.typ().clone() });
    }
    let diff_ids = rootfs.diff_ids().clone();
    if diff_ids.len() != layers {
        return Err(LayoutError::LayerCount { layers, diff_ids: diff_ids.len() });
    }
    Ok(diff_ids)
}

/// One image of a `docker save` archive's `manifest.json` (the format
/// before Docker 25, which also writes an OCI layout beside it).
#[derive(Debug, Deserialize)]
struct DockerSaved {
    #[serde(rename = "Config")]
    config: String,
    #[serde(rename = "RepoTags", default)]
    repo_tags: Option<Vec<String>>,
    /// Paths of the layers' uncompressed tars, bottom first.
    #[serde(rename = "Layers")]
    layers: Vec<String>,
}

/// Reads an extracted `docker save` archive of the old format: the image
/// whose `RepoTags` has `tag` (a whole `NAME:TAG`, or the tag alone if
/// just one image has it), or the only one. Its layers are uncompressed
/// tars whose digests are their diff_ids (the unpacker checks both); the
/// manifest, which the archive lacks, is made from the config and layers.
fn open_docker_archive(root: &Path, tag: Option<&str>) -> Result<ImageSource, LayoutError> {
    let list_path = root.join("manifest.json");
    let list: Vec<DockerSaved> = parse("manifest.json", &list_path, &read_small(&list_path)?)?;
    let tags: Vec<String> = list.iter().flat_map(|m| m.repo_tags.clone().unwrap_or_default()).collect();
    let has = |m: &DockerSaved, f: &dyn Fn(&str) -> bool| m.repo_tags.iter().flatten().any(|t| f(t));
    let chosen = match tag {
        Some(t) => {
            let whole: Vec<&DockerSaved> = list.iter().filter(|m| has(m, &|rt| rt == t)).collect();
            let by_tag: Vec<&DockerSaved> =
                list.iter().filter(|m| has(m, &|rt| rt.rsplit_once(':').is_some_and(|(_, x)| x == t))).collect();
            match (whole.as_slice(), by_tag.as_slice()) {
                ([m, ..], _) | ([], [m]) => *m,
                ([], []) => return Err(LayoutError::TagNotFound { tag: t.to_owned(), available: tags }),
                ([], many) => {
                    let what = format!(" tagged {t}");
                    return Err(LayoutError::AmbiguousArchive { count: many.len(), what, tags });
                }
            }
        }
        None => match list.as_slice() {
            [one] => one,
            [] => return Err(LayoutError::NoManifest),
            many => return Err(LayoutError::AmbiguousArchive { count: many.len(), what: String::new(), tags }),
        },
    };
    let within = |rel: &str| -> Result<PathBuf, LayoutError> {
        let comps = tarpath::components(rel.as_bytes())
            .map_err(|problem| LayoutError::ArchivePath { entry: rel.into(), problem })?;
        Ok(comps.iter().fold(root.to_path_buf(), |p, c| p.join(OsStr::from_bytes(c))))
    };
    let config_path = within(&chosen.config)?;
    let config_json = read_small(&config_path)?;
    let config_digest = Digest::sha256(&config_json);
    let file: ImageConfiguration = parse("config", &config_path, &config_json)?;
    let diff_ids = diff_ids(file.rootfs(), chosen.layers.len())?;
    let tar_type = "application/vnd.oci.image.layer.v1.tar";
    let mut layers = Vec::with_capacity(diff_ids.len());
    for (rel, diff_id) in chosen.layers.iter().zip(&diff_ids) {
        let blob_path = within(rel)?;
        let diff_id = parse_digest(diff_id, "diff_id")?;
        let meta = fs::symlink_metadata(&blob_path).map_err(|source| LayoutError::OpenBlob {
            what: "layer",
            path: blob_path.clone(),
            source,
        })?;
        if !meta.is_file() {
            return Err(LayoutError::BlobNotFile { what: "layer", path: blob_path });
        }
        let (digest, size) = (diff_id.clone(), meta.len());
        layers.push(LayerSource {
            blob_path,
            digest,
            size,
            media_type: tar_type.into(),
            diff_id,
            compression: Compression::None,
        });
    }
    let manifest = super::image_manifest(
        super::descriptor(MEDIA_OCI_CONFIG, &config_digest, config_json.len() as u64),
        layers.iter().map(|l| super::descriptor(tar_type, &l.digest, l.size)).collect(),
    );
    let manifest_json = crate::oci::canonical_json(&manifest).map_err(|source| LayoutError::Parse {
        what: "manifest",
        path: list_path.clone(),
        source,
    })?;
    Ok(ImageSource {
        manifest_digest: Digest::sha256(&manifest_json),
        manifest_json,
        config_digest,
        config: image_config(file.config().as_ref()),
        config_json,
        layers,
    })
}

/// Extracts an OCI archive into the empty directory `scratch`. Only regular
/// files and directories are written (an image layout needs nothing else),
/// with names checked lexically; since no symlink is ever created, plain
/// path-based writes below `scratch` cannot leave it.
pub fn extract_archive(archive: &Path, scratch: &Path) -> Result<(), LayoutError> {
    let scratch_err = |source| LayoutError::Scratch { path: scratch.to_owned(), source };
    if fs::read_dir(scratch).map_err(scratch_err)?.next().is_some() {
        return Err(LayoutError::ScratchNotEmpty { path: scratch.to_owned() });
    }
    let read_err = |source| LayoutError::ReadArchive { path: archive.to_owned(), source };
    let file = File::open(archive).map_err(read_err)?;
    let state = MeterState::default();
    let mut tar = tar::Archive::new(Meter::new(BufReader::new(file), &state));
    state.limit_headers();
    for entry in tar.entries().map_err(read_err)? {
        let mut entry = entry.map_err(|source| {
            if state.over_budget() {
                LayoutError::ArchiveHeaderTooLarge { path: archive.to_owned() }
            } else {
                read_err(source)
            }
        })?;
        state.unlimited();
        extract_entry(&mut entry, scratch)?;
        state.limit_headers();
    }
    Ok(())
}

fn extract_entry<R: Read>(entry: &mut tar::Entry<'_, R>, scratch: &Path) -> Result<(), LayoutError> {
    let raw = entry.path_bytes().into_owned();
    let shown = tarpath::shown(&raw);
    let kind = entry.header().entry_type();
    if kind.is_pax_global_extensions() {
        return Ok(());
    }
    let comps =
        tarpath::components(&raw).map_err(|problem| LayoutError::ArchivePath { entry: shown.clone(), problem })?;
    let rel: PathBuf = comps.iter().map(|c| OsStr::from_bytes(c)).collect();
    let path = scratch.join(rel);
    let write_err = |source| LayoutError::ExtractEntry { entry: shown.clone(), path: path.clone(), source };
    match kind {
        tar::EntryType::Directory => fs::create_dir_all(&path).map_err(write_err),
        tar::EntryType::Regular | tar::EntryType::Continuous => {
            if comps.is_empty() {
                return Err(LayoutError::ArchivePath { entry: shown, problem: PathError::Empty });
            }
            if let Some(parent) = path.parent() {
                fs::create_dir_all(parent).map_err(write_err)?;
            }
            let mut file =
                OpenOptions::new().write(true).create_new(true).mode(0o644).open(&path).map_err(write_err)?;
            let n = io::copy(entry, &mut file).map_err(write_err)?;
            if n != entry.size() {
                return Err(LayoutError::ArchiveTruncated { entry: shown });
            }
            Ok(())
        }
        other => Err(LayoutError::ArchiveEntryType { entry: shown, kind: tarpath::kind_name(other) }),
    }
}

// --- manifest selection ---

/// The `os/architecture` this host runs, in OCI platform terms.
fn host_platform() -> (&'static str, &'static str) {
    let arch = match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        "x86" => "386",
        other => other,
    };
    ("linux", arch)
}

/// Picks the descriptor in `index.json`: by tag if given, then as in `pick`.
fn pick_tagged<'a>(index: &'a Index, tag: Option<&str>) -> Result<&'a Descriptor, LayoutError> {
    let Some(tag) = tag else {
        return pick(index.manifests().iter().collect()).map_err(|e| match e {
            LayoutError::Ambiguous { count, platform, .. } => {
                LayoutError::Ambiguous { count, platform, tags: tags(index) }
            }
            e => e,
        });
    };
    let tagged: Vec<&Descriptor> = index.manifests().iter().filter(|d| ref_name(d) == Some(tag)).collect();
    if tagged.is_empty() {
        return Err(LayoutError::TagNotFound { tag: tag.to_owned(), available: tags(index) });
    }
    pick(tagged)
}

/// The tags `index.json` names, in its order.
fn tags(index: &Index) -> Vec<String> {
    index.manifests().iter().filter_map(|d| ref_name(d).map(str::to_owned)).collect()
}

/// A descriptor's tag (its `org.opencontainers.image.ref.name`).
fn ref_name(d: &Descriptor) -> Option<&str> {
    d.annotations().as_ref()?.get(REF_NAME).map(String::as_str)
}

/// Picks one descriptor: the first whose platform is this host's; else the
/// only one without a platform. A descriptor for another platform (or an
/// attestation, `unknown/unknown`) is never picked.
fn pick(candidates: Vec<&Descriptor>) -> Result<&Descriptor, LayoutError> {
    let (os, arch) = host_platform();
    if let Some(d) = candidates.iter().find(|d| {
        d.platform().as_ref().is_some_and(|p| p.os().to_string() == os && p.architecture().to_string() == arch)
    }) {
        return Ok(d);
    }
    let unplatformed: Vec<&Descriptor> = candidates.iter().copied().filter(|d| d.platform().is_none()).collect();
    match unplatformed.as_slice() {
        [only] => Ok(only),
        [] if candidates.is_empty() => Err(LayoutError::NoManifest),
        [] => Err(LayoutError::NoPlatform { platform: format!("{os}/{arch}") }),
        many => Err(LayoutError::Ambiguous { count: many.len(), platform: format!("{os}/{arch}"), tags: Vec::new() }),
    }
}

/// Whether a media type names an index or a manifest.
enum DocKind {
    Index,
    Manifest,
}

/// Follows `desc` through nested image indexes down to a manifest.
fn resolve(root: &Path, desc: &Descriptor, depth: usize) -> Result<(Digest, Vec<u8>, Manifest), LayoutError> {
    if depth > MAX_DEPTH {
        return Err(LayoutError::TooDeep);
    }
    let (digest, bytes) = read_blob(root, desc, "manifest")?;
    let path = blob_path(root, &digest);
    let probe: Probe = parse("manifest", &path, &bytes)?;
    let described = desc.media_type().to_string();
    if let Some(b) = probe.media_type.as_ref().filter(|b| **b != described) {
        return Err(LayoutError::MediaTypeMismatch { descriptor: described, blob: b.clone() });
    }
    let kind = match described.as_str() {
        MEDIA_OCI_INDEX | MEDIA_DOCKER_LIST => DocKind::Index,
        MEDIA_OCI_MANIFEST | MEDIA_DOCKER_MANIFEST => DocKind::Manifest,
        _ => return Err(LayoutError::MediaType { what: "manifest", media_type: described }),
    };
    match kind {
        DocKind::Index => {
            let index: Index = parse("image index", &path, &bytes)?;
            let child = pick(index.manifests().iter().collect())?;
            resolve(root, child, depth + 1)
        }
        DocKind::Manifest => {
            let manifest: Manifest = parse("manifest", &path, &bytes)?;
            if manifest.schema_version() != 2 {
                return Err(LayoutError::SchemaVersion { version: manifest.schema_version().into() });
            }
            Ok((digest, bytes, manifest))
        }
    }
}

fn image_config(c: Option<&oci_spec::image::Config>) -> ImageConfig {
    let Some(c) = c else {
        return ImageConfig::default();
    };
    let non_empty = |s: &Option<String>| s.clone().filter(|s| !s.is_empty());
    ImageConfig {
        env: c.env().clone().unwrap_or_default(),
        working_dir: non_empty(c.working_dir()),
        user: non_empty(c.user()),
        entrypoint: c.entrypoint().clone().unwrap_or_default(),
        cmd: c.cmd().clone().unwrap_or_default(),
    }
}

fn layer_source(
    root: &Path,
    desc: &Descriptor,
    diff_id: &str,
    have: &dyn Fn(&Digest) -> bool,
) -> Result<LayerSource, LayoutError> {
    let digest = parse_digest(desc.digest().as_ref(), "layer descriptor")?;
    let diff_id = parse_digest(diff_id, "config diff_id")?;
    let media_type = desc.media_type().to_string();
    let compression = Compression::from_media_type(&media_type)
        .ok_or_else(|| LayoutError::MediaType { what: "layer", media_type: media_type.clone() })?;
    let path = blob_path(root, &digest);
    if have(&diff_id) && fs::symlink_metadata(&path).is_err() {
        return Ok(LayerSource { blob_path: path, digest, size: desc.size(), media_type, diff_id, compression });
    }
    let meta = fs::symlink_metadata(&path).map_err(|source| LayoutError::OpenBlob {
        what: "layer",
        path: path.clone(),
        source,
    })?;
    if !meta.is_file() {
        return Err(LayoutError::BlobNotFile { what: "layer", path });
    }
    if meta.len() != desc.size() {
        return Err(LayoutError::BlobSize { what: "layer", digest, expected: desc.size(), actual: meta.len() });
    }
    Ok(LayerSource { blob_path: path, digest, size: desc.size(), media_type, diff_id, compression })
}

// --- blobs and small files ---

fn parse_digest(s: &str, what: &'static str) -> Result<Digest, LayoutError> {
    s.parse().map_err(|source| LayoutError::InvalidDigest { what, source })
}

/// `blobs/sha256/<hex>`; the hex is validated, so the path stays in `blobs`.
fn blob_path(root: &Path, digest: &Digest) -> PathBuf {
    root.join("blobs").join("sha256").join(digest.hex())
}

/// Reads a small blob and checks it against its descriptor. The blob is
/// opened without following a final symlink and non-blocking, so a FIFO
/// planted in a layout cannot hang the reader, and must be a regular file.
fn read_blob(root: &Path, desc: &Descriptor, what: &'static str) -> Result<(Digest, Vec<u8>), LayoutError> {
    let digest = parse_digest(desc.digest().as_ref(), what)?;
    let size = desc.size();
    if size > MAX_JSON {
        return Err(LayoutError::BlobTooLarge { what, digest, size, limit: MAX_JSON });
    }
    let path = blob_path(root, &digest);
    let open_err = |source| LayoutError::OpenBlob { what, path: path.clone(), source };
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(&path)
        .map_err(open_err)?;
    if !file.metadata().map_err(open_err)?.is_file() {
        return Err(LayoutError::BlobNotFile { what, path });
    }
    let mut data = Vec::new();
    file.take(size + 1).read_to_end(&mut data).map_err(open_err)?;
    if data.len() as u64 != size {
        return Err(LayoutError::BlobSize { what, digest, expected: size, actual: data.len() as u64 });
    }
    let actual = Digest::sha256(&data);
    if actual != digest {
        return Err(LayoutError::BlobDigest { what, expected: digest, actual });
    }
    Ok((digest, data))
}

/// Reads `oci-layout` or `index.json`, refusing anything over `MAX_JSON`.
/// Like blobs, they are not read through a final symlink: a layout handed
/// to the daemon must not make it read (or report the size of) other files.
fn read_small(path: &Path) -> Result<Vec<u8>, LayoutError> {
    let err = |source| LayoutError::ReadFile { path: path.to_owned(), source };
    let file =
        OpenOptions::new().read(true).custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK).open(path).map_err(err)?;
    let mut data = Vec::new();
    file.take(MAX_JSON + 1).read_to_end(&mut data).map_err(err)?;
    if data.len() as u64 > MAX_JSON {
        return Err(LayoutError::FileTooLarge { path: path.to_owned(), limit: MAX_JSON });
    }
    Ok(data)
}

fn parse<'de, T: Deserialize<'de>>(what: &'static str, path: &Path, bytes: &'de [u8]) -> Result<T, LayoutError> {
    serde_json::from_slice(bytes).map_err(|source| LayoutError::Parse { what, path: path.to_owned(), source })
}

#[cfg(test)]
mod tests;
