//! Snapshots and images through an OCI registry: `image pull`, `snapshot
//! push` and `snapshot pull`.
//!
//! A pushed snapshot is an ordinary OCI image: its image's layers, then one
//! layer per snapshot of its layer chain (the blobs as sealed, never
//! recaptured), and a config whose `dev.strata.chain` label carries the
//! chain's metadata (ids, class, lineage and sequence, baseline key,
//! provenance). A pull on another host fetches only the blobs it lacks,
//! verifies every digest and diff_id, unpacks under `tmp/`, and records
//! image, layers, lineages and snapshots in one transaction with the same
//! ids: all or nothing.
//!
//! The chain's exec logs (with output) and evaluations travel as one more
//! blob, gzip'd JSON, named by digest in the label (`records`): not a
//! layer, so other tools see an ordinary image. A registry's garbage
//! collector that keeps only blobs a manifest lists would drop it; a pull
//! then fails naming it.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::catalog::Baseline;
use crate::daemon::Daemon;
use crate::error::Classify;
use crate::error::ErrorKind;
use crate::ids::{ImageName, SnapshotId};
use crate::oci::{self, Compression, Digest, ImageConfig};
use crate::registry::{Client, Credentials, Reference, RegistryError};
use crate::store::{BlobCompression, StoreError};
use crate::types::{Progress, RegistryRequest};

/// The config label that makes an image a Strata snapshot.
pub const CHAIN_LABEL: &str = "dev.strata.chain";

/// Largest config accepted from a registry.
pub(crate) const MAX_CONFIG: u64 = 8 << 20;

/// Largest records blob accepted from a registry, and its JSON unpacked.
pub(crate) const MAX_RECORDS: u64 = 256 << 20;

pub(crate) const MAX_RECORDS_JSON: u64 = 1 << 30;

/// How long a push waits for a suspended snapshot's blob to be sealed.
pub(crate) const SEAL_WAIT: Duration = Duration::from_secs(1800);

pub(crate) fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Why moving a snapshot or image to or from a registry failed (push,
/// pull, fetching layers from the fleet registry).
#[derive(Debug, thiserror::Error, displaydoc::Display)]
pub enum TransferError {
    /// {0}
    Invalid(String),
    /// registry {registry}: {what}
    Upstream { registry: String, what: String },
    /// {0}
    Registry(#[from] RegistryError),
    /// {0}
    Reference(#[from] crate::registry::ReferenceError),
    /// {0}
    ImageName(#[from] crate::ids::BadImageName),
    /// image {0} already exists
    ImageExists(ImageName),
    /// snapshot {id} has no blob and never will: {why}
    NoBlob { id: SnapshotId, why: String },
    /// snapshot {0} is still sealing; retry
    Sealing(SnapshotId),
    /// {0}
    Conflict(String),
    /// pulled layer {layer} cannot be unpacked: {why}
    Unpackable { layer: String, why: String },
    /// layer {digest} from {registry}: {source}
    Layer { digest: Digest, registry: String, source: Box<oci::UnpackError> },
    /// {0}
    Unpack(#[source] Box<oci::UnpackError>),
    /// {0}
    Missing(&'static str),
    /// {0}
    Json(#[from] serde_json::Error),
    /// {0}
    Io(#[from] std::io::Error),
    /// {0}
    Store(#[from] StoreError),
    /// {0}
    Export(#[from] crate::export::ExportError),
    /// {0}
    Image(#[from] crate::image::ImageError),
    /// {0}
    Db(#[from] crate::catalog::DbError),
}

impl Classify for TransferError {
    fn kind(&self) -> ErrorKind {
        use TransferError as T;
        match self {
            T::Invalid(_) | T::ImageName(_) | T::Reference(_) | T::Unpackable { .. } => ErrorKind::InvalidArgument,
            T::Upstream { .. } => ErrorKind::Upstream,
            T::Layer { source, .. } if !source.is_io() => ErrorKind::Upstream,
            T::Registry(e) => e.kind(),
            T::ImageExists(_) | T::NoBlob { .. } | T::Sealing(_) | T::Conflict(_) => ErrorKind::Conflict,
            T::Missing(_) => ErrorKind::Internal,
            T::Image(e) => e.kind(),
            T::Db(e) => e.kind(),
            _ => ErrorKind::of_host_failure(self),
        }
    }
}

pub(crate) fn store_err(e: StoreError) -> TransferError {
    TransferError::Store(e)
}

/// A host file-system failure: 507 when the store is full, else 500.
pub(crate) fn host_io(e: std::io::Error) -> TransferError {
    TransferError::Io(e)
}

pub(crate) fn invalid(msg: impl Into<String>) -> TransferError {
    TransferError::Invalid(msg.into())
}

/// The chain's metadata, as the `dev.strata.chain` label's JSON.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct ChainMeta {
    pub(crate) version: u32,
    pub(crate) image: ImageMeta,
    /// Root first; one per layer after the image's.
    pub(crate) snapshots: Vec<SnapshotMeta>,
    /// The blob holding the chain's logs and evaluations (`ChainRecords`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) records: Option<RecordsRef>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct RecordsRef {
    pub(crate) digest: Digest,
    pub(crate) size: u64,
}

/// What a pushed chain carries besides its layers: per snapshot (as in
/// the label, root first), its exec log with output and its evaluations.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub(crate) struct ChainRecords {
    pub(crate) snapshots: Vec<SnapshotRecords>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct SnapshotRecords {
    pub(crate) id: SnapshotId,
    /// The first `inherited` records of `log` are its ancestors' (the
    /// root of a pushed chain whose parents are not pushed: compacted).
    pub(crate) inherited: usize,
    pub(crate) log: Vec<crate::catalog::ExecRecord>,
    pub(crate) evaluations: Vec<crate::catalog::Evaluation>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct ImageMeta {
    pub(crate) name: String,
    pub(crate) manifest_digest: Digest,
    pub(crate) config_digest: Digest,
    pub(crate) config: ImageConfig,
    pub(crate) layers: usize,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct SnapshotMeta {
    pub(crate) id: SnapshotId,
    pub(crate) parent_id: Option<SnapshotId>,
    pub(crate) class: crate::model::SnapshotClass,
    pub(crate) work_context: Option<String>,
    /// How its lineage began (`image`, `baseline`, `fork`) and from what.
    pub(crate) start_kind: Option<crate::model::StartKind>,
    pub(crate) start_id: Option<SnapshotId>,
    pub(crate) sequence: Option<i64>,
    pub(crate) predecessor_id: Option<SnapshotId>,
    pub(crate) baseline: Option<Baseline>,
    pub(crate) source_sandbox: String,
    pub(crate) info: crate::records::SnapshotMeta,
    pub(crate) created_at: i64,
}

pub(crate) fn media_type(c: Compression) -> &'static str {
    match c {
        Compression::None => "application/vnd.oci.image.layer.v1.tar",
        Compression::Gzip => "application/vnd.oci.image.layer.v1.tar+gzip",
        Compression::Zstd => "application/vnd.oci.image.layer.v1.tar+zstd",
    }
}

/// A stored image blob's compression, from its first bytes.
pub(crate) fn sniff(path: &Path) -> std::io::Result<Compression> {
    let mut head = [0u8; 4];
    let mut f = std::fs::File::open(path)?;
    let n = f.read(&mut head)?;
    Ok(match &head[..n] {
        [0x1f, 0x8b, ..] => Compression::Gzip,
        [0x28, 0xb5, 0x2f, 0xfd] => Compression::Zstd,
        _ => Compression::None,
    })
}

pub(crate) fn client(req: &RegistryRequest, reference: &Reference) -> Result<Client, TransferError> {
    let credentials = match (&req.username, &req.password) {
        (Some(u), Some(p)) => Some(Credentials { username: u.clone(), password: p.clone() }),
        (None, None) => None,
        _ => return Err(invalid("give both username and password, or neither")),
    };
    Ok(Client::new(&reference.registry, req.insecure, credentials))
}

pub(crate) fn parse_reference(s: &str) -> Result<Reference, TransferError> {
    Ok(Reference::parse(s)?)
}

// --- documents read back from a registry: oci-spec's types ---

use oci_spec::image::{ImageConfiguration, ImageIndex, ImageManifest};

pub(crate) fn parse_digest(s: &str, what: &str) -> Result<Digest, TransferError> {
    s.parse().map_err(|e| invalid(format!("{what}: {e}")))
}

/// The registry a fleet publishes distributed snapshots to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FleetRegistry {
    /// `HOST:PORT`.
    pub registry: String,
    pub repository: String,
    /// Plain HTTP (a registry on loopback).
    pub insecure: bool,
}

impl FleetRegistry {
    /// `HOST[:PORT]/REPOSITORY`, no tag or digest.
    pub fn parse(s: &str, insecure: bool) -> Result<FleetRegistry, String> {
        let r = Reference::parse(s).map_err(|e| e.to_string())?;
        let tagged = s.rsplit('/').next().is_some_and(|last| last.contains([':', '@']));
        if tagged || r.digest.is_some() || !s.starts_with(&format!("{}/", r.registry)) {
            return Err(format!("{s:?}: expected HOST[:PORT]/REPOSITORY (no tag, no digest)"));
        }
        Ok(FleetRegistry { registry: r.registry, repository: r.repository, insecure })
    }

    /// Where snapshot `id` is published.
    pub fn reference(&self, id: &str) -> String {
        format!("{}/{}:{id}", self.registry, self.repository)
    }
}

impl std::fmt::Display for FleetRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.registry, self.repository)
    }
}

impl Daemon {
    /// Fetch the manifest and config at `reference`: the manifest's digest,
    /// its layers, the config's diff_ids and labels.
    pub(crate) fn fetch_documents(
        &self,
        client: &Client,
        reference: &Reference,
        fetched: &mut u64,
    ) -> Result<Documents, TransferError> {
        let repo = &reference.repository;
        let (_, mut bytes, mut digest) = client.get_manifest(repo, &reference.manifest_ref())?;
        let json = |bytes: &[u8], what: &dyn std::fmt::Display| {
            serde_json::from_slice::<serde_json::Value>(bytes)
                .map_err(|e| upstream(client, format!("manifest {what} is not valid JSON: {e}")))
        };
        let mut doc = json(&bytes, reference)?;
        let mut index = None;
        if doc.get("manifests").and_then(|m| m.as_array()).is_some_and(|m| !m.is_empty()) {
            // An image index: this host's platform.
            let parsed: ImageIndex =
                serde_json::from_value(doc).map_err(|e| invalid(format!("{reference} is not an image index: {e}")))?;
            let arch = crate::export::oci_arch();
            let manifests = parsed.manifests();
            let chosen = manifests
                .iter()
                .find(|d| {
                    d.platform()
                        .as_ref()
                        .is_some_and(|p| p.os() == &oci_spec::image::Os::Linux && p.architecture().to_string() == arch)
                })
                .or(if manifests.len() == 1 { manifests.first() } else { None })
                .ok_or_else(|| invalid(format!("{reference} has no manifest for linux/{arch}")))?;
            let child = parse_digest(chosen.digest().as_ref(), "index entry")?;
            index = Some((digest.clone(), bytes.clone(), chosen.media_type().to_string(), chosen.size()));
            (_, bytes, digest) = client.get_manifest(repo, child.as_str())?;
            if digest != child {
                return Err(upstream(client, format!("manifest {child} came back as {digest}")));
            }
            doc = json(&bytes, &child)?;
        }
        let parsed: ImageManifest =
            serde_json::from_value(doc).map_err(|e| invalid(format!("{reference} is not an image manifest: {e}")))?;
        let config_desc = parsed.config();
        if config_desc.size() > MAX_CONFIG {
            return Err(invalid(format!("{reference}: config of {} bytes is over the limit", config_desc.size())));
        }
        let config_digest = parse_digest(config_desc.digest().as_ref(), "config descriptor")?;
        let mut config = Vec::new();
        client.get_blob(repo, &config_digest, config_desc.size(), &mut config, &mut |_| {})?;
        *fetched += config.len() as u64;
        let cfg: ImageConfiguration = serde_json::from_slice(&config)
            .map_err(|e| upstream(client, format!("config {config_digest} is not an image config: {e}")))?;
        let diff_ids = cfg.rootfs().diff_ids();
        if diff_ids.len() != parsed.layers().len() {
            return Err(upstream(
                client,
                format!(
                    "manifest {digest} has {} layers but its config {} diff_ids",
                    parsed.layers().len(),
                    diff_ids.len()
                ),
            ));
        }
        let mut layers = Vec::new();
        for (d, diff) in parsed.layers().iter().zip(diff_ids) {
            let media_type = d.media_type().to_string();
            let compression = Compression::from_media_type(&media_type)
                .ok_or_else(|| invalid(format!("layer {} has media type {media_type:?}", d.digest())))?;
            layers.push(WireLayer {
                digest: parse_digest(d.digest().as_ref(), "layer descriptor")?,
                size: d.size(),
                media_type,
                compression,
                diff_id: parse_digest(diff, "config diff_id")?,
            });
        }
        let labels = cfg.config().as_ref().and_then(|c| c.labels().clone()).unwrap_or_default();
        Ok(Documents { digest, manifest: bytes, index, config_digest, config, layers, labels })
    }

    /// Download the blobs of the layers this host lacks into `work`:
    /// returns, per layer, the downloaded file (none if not fetched).
    pub(crate) fn fetch_layers(
        &self,
        client: &Client,
        repo: &str,
        layers: &[WireLayer],
        work: &Path,
        tally: &mut Tally,
        progress: &mut dyn FnMut(Progress),
    ) -> Result<Vec<Option<PathBuf>>, TransferError> {
        let store = &self.rt.store;
        let mut out = Vec::new();
        for l in layers {
            let hex = l.diff_id.hex();
            let have_layer = lock(&self.db).layer_exists(hex)? && store.layer_dir(hex).join("fs").is_dir();
            let have_blob = store.blob_path(l.digest.hex()).is_file();
            if have_layer {
                tally.reused += 1;
                progress(Progress { action: "reuse".into(), digest: l.digest.to_string(), size: l.size, done: 0 });
            }
            // A layer the host has is not fetched (even if its blob is not
            // kept here); nor is a blob the store has, or one fetched above.
            if have_layer || have_blob || out.iter().flatten().any(|p: &PathBuf| p.ends_with(l.digest.hex())) {
                out.push(None);
                continue;
            }
            let path = work.join(l.digest.hex());
            let file = std::fs::File::create(&path)
                .map_err(|e| store_err(StoreError::Io { step: "create", path: path.clone(), source: e }))?;
            let mut w = std::io::BufWriter::with_capacity(1 << 20, file);
            let mut done = 0u64;
            let mut last = Instant::now();
            let digest = l.digest.to_string();
            client.get_blob(repo, &l.digest, l.size, &mut w, &mut |n| {
                done += n;
                if last.elapsed() > Duration::from_millis(200) || done == l.size {
                    last = Instant::now();
                    progress(Progress { action: "fetch".into(), digest: digest.clone(), size: l.size, done });
                }
            })?;
            std::io::Write::flush(&mut w)
                .map_err(|e| store_err(StoreError::Io { step: "write", path: path.clone(), source: e }))?;
            tally.blobs += 1;
            tally.bytes += l.size;
            out.push(Some(path));
        }
        Ok(out)
    }
}

pub(crate) fn upstream(client: &Client, what: String) -> TransferError {
    TransferError::Upstream { registry: client.registry().to_string(), what }
}

/// What a pull fetched (the config counts as one blob) and reused.
pub(crate) struct Tally {
    pub(crate) blobs: usize,
    pub(crate) bytes: u64,
    pub(crate) reused: usize,
}

#[derive(Clone)]
pub(crate) struct WireLayer {
    pub(crate) digest: Digest,
    pub(crate) size: u64,
    pub(crate) media_type: String,
    pub(crate) compression: Compression,
    pub(crate) diff_id: Digest,
}

/// The documents of a fetched reference.
pub(crate) struct Documents {
    /// The image manifest's digest and bytes.
    pub(crate) digest: Digest,
    pub(crate) manifest: Vec<u8>,
    /// The index the reference named, if any: digest, bytes, media type, size.
    pub(crate) index: Option<(Digest, Vec<u8>, String, u64)>,
    pub(crate) config_digest: Digest,
    pub(crate) config: Vec<u8>,
    pub(crate) layers: Vec<WireLayer>,
    pub(crate) labels: std::collections::HashMap<String, String>,
}

/// How a snapshot blob of this compression is read.
pub(crate) fn layer_compression(c: BlobCompression) -> Compression {
    match c {
        BlobCompression::Gzip => Compression::Gzip,
        BlobCompression::Zstd => Compression::Zstd,
    }
}

/// A snapshot layer's compression as a snapshot records it; none for an
/// uncompressed one (snapshot blobs are always compressed).
pub(crate) fn blob_compression(c: Compression) -> Option<BlobCompression> {
    match c {
        Compression::Gzip => Some(BlobCompression::Gzip),
        Compression::Zstd => Some(BlobCompression::Zstd),
        Compression::None => None,
    }
}

pub(crate) fn layer_source(blob: &Path, l: &WireLayer) -> oci::LayerSource {
    oci::LayerSource {
        blob_path: blob.to_path_buf(),
        digest: l.digest.clone(),
        size: l.size,
        media_type: l.media_type.clone(),
        diff_id: l.diff_id.clone(),
        compression: l.compression,
    }
}

/// Decompress the blob at `path` and check that the tar's sha256 is the
/// layer's diff_id (without unpacking it).
pub(crate) fn check_diff_id(path: &Path, l: &WireLayer) -> Result<(), String> {
    use sha2::Digest as _;
    let f = std::fs::File::open(path).map_err(|e| format!("open blob {}: {e}", l.digest))?;
    let r = std::io::BufReader::with_capacity(1 << 20, f);
    let mut stream: Box<dyn Read> = match l.compression {
        Compression::Gzip => Box::new(flate2::read::MultiGzDecoder::new(r)),
        Compression::Zstd => {
            Box::new(zstd::Decoder::with_buffer(r).map_err(|e| format!("decompress blob {}: {e}", l.digest))?)
        }
        Compression::None => Box::new(r),
    };
    let mut hasher = sha2::Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        match stream.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => hasher.update(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(format!("decompress blob {}: {e}", l.digest)),
        }
    }
    let actual = Digest::from_hasher(hasher);
    if actual != l.diff_id {
        return Err(format!("layer {} unpacks to diff_id {actual}, its config says {}", l.digest, l.diff_id));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::FleetRegistry;

    #[test]
    fn a_fleet_registry_is_a_host_and_a_repository_only() {
        let r = FleetRegistry::parse("127.0.0.1:5000/strata/fleet", true).unwrap();
        assert_eq!((r.registry.as_str(), r.repository.as_str(), r.insecure), ("127.0.0.1:5000", "strata/fleet", true));
        assert_eq!(r.reference("0123456789abcdef"), "127.0.0.1:5000/strata/fleet:0123456789abcdef");
        assert_eq!(r.to_string(), "127.0.0.1:5000/strata/fleet");
        let digest = format!("127.0.0.1:5000/fleet@sha256:{}", "0".repeat(64));
        for bad in ["127.0.0.1:5000/fleet:v1", digest.as_str(), "fleet", "", "127.0.0.1:5000/"] {
            assert!(FleetRegistry::parse(bad, false).is_err(), "{bad:?} was taken");
        }
    }
}
