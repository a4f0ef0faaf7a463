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

use crate::daemon::Daemon;
use crate::db::{Baseline, LayerRow, PulledImage, PulledSnapshot, SnapshotRow, Unhydrated};
use crate::error::Classify;
use crate::error::ErrorKind;
use crate::ids::{ImageName, LayerId, SnapshotId};
use crate::oci::{self, Compression, Digest, ImageConfig};
use crate::registry::{Client, Credentials, Pushed, Reference, RegistryError};
use crate::store::{BlobCompression, StoreError};
use crate::types::{Progress, PullResult, PushResult, RegistryRequest};

/// The config label that makes an image a Strata snapshot.
pub const CHAIN_LABEL: &str = "dev.strata.chain";
/// Largest config accepted from a registry.
const MAX_CONFIG: u64 = 8 << 20;
/// Largest records blob accepted from a registry, and its JSON unpacked.
const MAX_RECORDS: u64 = 256 << 20;
const MAX_RECORDS_JSON: u64 = 1 << 30;
/// How long a push waits for a suspended snapshot's blob to be sealed.
const SEAL_WAIT: Duration = Duration::from_secs(1800);

fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Why a push, a pull or the hydration of a pulled layer failed.
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
    Snapshot(#[from] crate::daemon::snapshots::SnapshotLookupError),
    /// {0}
    Db(#[from] crate::db::DbError),
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
            T::Snapshot(e) => e.kind(),
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
struct ChainMeta {
    version: u32,
    image: ImageMeta,
    /// Root first; one per layer after the image's.
    snapshots: Vec<SnapshotMeta>,
    /// The blob holding the chain's logs and evaluations (`ChainRecords`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    records: Option<RecordsRef>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct RecordsRef {
    digest: Digest,
    size: u64,
}

/// What a pushed chain carries besides its layers: per snapshot (as in
/// the label, root first), its exec log with output and its evaluations.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct ChainRecords {
    snapshots: Vec<SnapshotRecords>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct SnapshotRecords {
    id: SnapshotId,
    /// The first `inherited` records of `log` are its ancestors' (the
    /// root of a pushed chain whose parents are not pushed: compacted).
    inherited: usize,
    log: Vec<crate::db::ExecRecord>,
    evaluations: Vec<crate::db::Evaluation>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct ImageMeta {
    name: String,
    manifest_digest: Digest,
    config_digest: Digest,
    config: ImageConfig,
    layers: usize,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct SnapshotMeta {
    id: SnapshotId,
    parent_id: Option<SnapshotId>,
    class: crate::model::SnapshotClass,
    work_context: Option<String>,
    /// How its lineage began (`image`, `baseline`, `fork`) and from what.
    start_kind: Option<crate::model::StartKind>,
    start_id: Option<SnapshotId>,
    sequence: Option<i64>,
    predecessor_id: Option<SnapshotId>,
    baseline: Option<Baseline>,
    source_sandbox: String,
    info: serde_json::Value,
    created_at: i64,
}

/// A layer blob to push.
struct PushBlob {
    path: PathBuf,
    digest: Digest,
    size: u64,
    media_type: &'static str,
    diff_id: String,
}

fn media_type(c: Compression) -> &'static str {
    match c {
        Compression::None => "application/vnd.oci.image.layer.v1.tar",
        Compression::Gzip => "application/vnd.oci.image.layer.v1.tar+gzip",
        Compression::Zstd => "application/vnd.oci.image.layer.v1.tar+zstd",
    }
}

/// A stored image blob's compression, from its first bytes.
fn sniff(path: &Path) -> std::io::Result<Compression> {
    let mut head = [0u8; 4];
    let mut f = std::fs::File::open(path)?;
    let n = f.read(&mut head)?;
    Ok(match &head[..n] {
        [0x1f, 0x8b, ..] => Compression::Gzip,
        [0x28, 0xb5, 0x2f, 0xfd] => Compression::Zstd,
        _ => Compression::None,
    })
}

fn client(req: &RegistryRequest, reference: &Reference) -> Result<Client, TransferError> {
    let credentials = match (&req.username, &req.password) {
        (Some(u), Some(p)) => Some(Credentials { username: u.clone(), password: p.clone() }),
        (None, None) => None,
        _ => return Err(invalid("give both username and password, or neither")),
    };
    Ok(Client::new(&reference.registry, req.insecure, credentials))
}

fn parse_reference(s: &str) -> Result<Reference, TransferError> {
    Ok(Reference::parse(s)?)
}

// --- documents read back from a registry: oci-spec's types ---

use oci_spec::image::{ImageConfiguration, ImageIndex, ImageManifest};

fn parse_digest(s: &str, what: &str) -> Result<Digest, TransferError> {
    s.parse().map_err(|e| invalid(format!("{what}: {e}")))
}

impl Daemon {
    // ---- push ----

    /// Push snapshot `id` (its image's layers and its layer chain) to
    /// `req.reference`. Blobs the repository has are not sent again, so a
    /// push that failed half-way is resumed by running it again.
    pub fn push_snapshot(
        &self,
        id: &str,
        req: &RegistryRequest,
        progress: &mut dyn FnMut(Progress),
    ) -> Result<PushResult, TransferError> {
        let reference = parse_reference(&req.reference)?;
        let Some(tag) = reference.tag.clone().filter(|_| reference.digest.is_none()) else {
            return Err(invalid("a push needs a tag, not a digest (the registry computes the digest)"));
        };
        let row = self.snapshot_row(id)?;
        crate::daemon::snapshots::restorable(&row)?;
        let _pin = self.pin_snapshot(&row.id)?;
        let (image, chain) = self.sealed_chain(&row)?;
        let client = client(req, &reference)?;
        let work = self.rt.store.new_tmp("push").map_err(store_err)?;
        let result = (|| {
            let blobs = self.push_blobs(&image, &chain, &work)?;
            let repo = &reference.repository;
            let mut result = PushResult {
                reference: reference.to_string(),
                manifest_digest: String::new(),
                blobs: blobs.len() + 1,
                uploaded_blobs: 0,
                uploaded_bytes: 0,
                present_blobs: 0,
                mounted_blobs: 0,
            };
            // A chain pulled from this registry: its blobs are mounted from
            // the repository it came from instead of uploaded again.
            let mount_from = chain.iter().rev().find_map(|s| {
                let r = Reference::parse(s.info["pulled_from"].as_str()?).ok()?;
                (r.registry == reference.registry).then_some(r.repository)
            });
            for b in &blobs {
                let outcome = client.push_blob(repo, &b.digest, &b.path, b.size, mount_from.as_deref())?;
                crate::failpoint::hit("push.blob-sent");
                let action = match outcome {
                    Pushed::Present => {
                        result.present_blobs += 1;
                        "present"
                    }
                    Pushed::Mounted => {
                        result.mounted_blobs += 1;
                        "mount"
                    }
                    Pushed::Uploaded => {
                        result.uploaded_blobs += 1;
                        result.uploaded_bytes += b.size;
                        "upload"
                    }
                };
                progress(Progress { action: action.into(), digest: b.digest.to_string(), size: b.size, done: b.size });
            }
            // A small document pushed as a blob (the records, the config), tallied.
            let mut push_doc = |bytes: &[u8]| -> Result<Digest, TransferError> {
                let digest = Digest::sha256(bytes);
                if client.push_bytes(repo, &digest, bytes)? == Pushed::Uploaded {
                    result.uploaded_blobs += 1;
                    result.uploaded_bytes += bytes.len() as u64;
                } else {
                    result.present_blobs += 1;
                }
                Ok(digest)
            };
            let mut meta = self.chain_meta(&image, &chain)?;
            let records = self.chain_records(&chain)?;
            let records_digest = push_doc(&records)?;
            meta.records = Some(RecordsRef { digest: records_digest, size: records.len() as u64 });
            let mut labels = std::collections::HashMap::new();
            labels.insert(CHAIN_LABEL.to_string(), serde_json::to_string(&meta)?);
            labels.insert("dev.strata.snapshot".into(), row.id.to_string());
            let diff_ids: Vec<String> = blobs.iter().map(|b| format!("sha256:{}", b.diff_id)).collect();
            let config = crate::export::config_document(&image, &diff_ids, labels);
            let config_bytes = crate::oci::canonical_json(&config)?;
            let config_digest = push_doc(&config_bytes)?;
            let layers = blobs.iter().map(|b| oci::descriptor(b.media_type, &b.digest, b.size)).collect();
            let config_desc = oci::descriptor(oci::layout::MEDIA_OCI_CONFIG, &config_digest, config_bytes.len() as u64);
            let manifest =
                crate::export::manifest_document(config_desc, layers, crate::export::chain_annotations(&image, &chain));
            let manifest_bytes = crate::oci::canonical_json(&manifest)?;
            client.put_manifest(repo, &tag, oci::layout::MEDIA_OCI_MANIFEST, &manifest_bytes)?;
            result.manifest_digest = Digest::sha256(&manifest_bytes).to_string();
            tracing::info!("pushed snapshot {} to {} ({})", row.id, result.reference, result.manifest_digest);
            Ok(result)
        })();
        let _ = crate::store::remove_tree(&work);
        result
    }

    /// The snapshot's image and layer chain once every blob of the chain is
    /// sealed (a suspend seals in the background).
    fn sealed_chain(&self, row: &SnapshotRow) -> Result<(crate::db::ImageRow, Vec<SnapshotRow>), TransferError> {
        let started = Instant::now();
        loop {
            let (image, chain, pending) = {
                let db = lock(&self.db);
                let image = db
                    .image_by_id(row.image_id)?
                    .ok_or_else(|| TransferError::Missing("snapshot's image row is missing"))?;
                let chain = db.snapshot_layer_chain(&row.id)?;
                if let Some((s, why)) = chain.iter().find_map(|s| Some((s, s.info.get("seal_error")?.as_str()?))) {
                    return Err(TransferError::NoBlob { id: s.id.clone(), why: why.to_string() });
                }
                let mut pending = false;
                for s in &chain {
                    pending |= db.blob_pending(&s.id)?;
                }
                (image, chain, pending)
            };
            if !pending {
                return Ok((image, chain));
            }
            if started.elapsed() > SEAL_WAIT {
                return Err(TransferError::Sealing(row.id.clone()));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The blobs of the image's layers and the chain, bottom first. An image
    /// imported before imports kept blobs is serialised again (its diff_ids
    /// then differ from the image's).
    fn push_blobs(
        &self,
        image: &crate::db::ImageRow,
        chain: &[SnapshotRow],
        work: &Path,
    ) -> Result<Vec<PushBlob>, TransferError> {
        let store = &self.rt.store;
        let mut out = Vec::new();
        for (layer, blob) in image.layers.iter().zip(&image.blobs) {
            let digest = blob.clone();
            let path = store.blob_path(digest.hex());
            if path.is_file() {
                let size = path.metadata()?.len();
                let c = sniff(&path)?;
                out.push(PushBlob { path, digest, size, media_type: media_type(c), diff_id: layer.to_string() });
            } else {
                let s = crate::export::serialise_layer(store, layer, work, BlobCompression::Zstd)?;
                let digest = parse_digest(&format!("sha256:{}", s.digest_hex), "serialised layer")?;
                out.push(PushBlob {
                    path: s.path,
                    digest,
                    size: s.size,
                    media_type: media_type(Compression::Zstd),
                    diff_id: s.diff_id,
                });
            }
        }
        for s in chain {
            let digest = s.blob_digest.clone().ok_or_else(|| TransferError::Sealing(s.id.clone()))?;
            let c = layer_compression(s.compression);
            let diff_id = s
                .diff_id
                .as_ref()
                .map(|d| d.hex().to_string())
                .ok_or_else(|| TransferError::Missing("sealed snapshot without diff_id"))?;
            out.push(PushBlob {
                path: store.blob_path(digest.hex()),
                digest,
                size: s.blob_size,
                media_type: media_type(c),
                diff_id,
            });
        }
        Ok(out)
    }

    fn chain_meta(&self, image: &crate::db::ImageRow, chain: &[SnapshotRow]) -> Result<ChainMeta, TransferError> {
        let db = lock(&self.db);
        let mut snapshots = Vec::new();
        for s in chain {
            let wc = match &s.work_context {
                Some(w) => db.work_context(w)?,
                None => None,
            };
            snapshots.push(SnapshotMeta {
                id: s.id.clone(),
                parent_id: s.parent_id.clone(),
                class: s.class,
                work_context: s.work_context.clone(),
                start_kind: wc.as_ref().map(|w| w.start_kind),
                start_id: wc.and_then(|w| w.start_id),
                sequence: s.sequence,
                predecessor_id: s.predecessor_id.clone(),
                baseline: s.baseline.clone(),
                source_sandbox: s.source_sandbox.clone(),
                info: s.info.clone(),
                created_at: s.created_at,
            });
        }
        Ok(ChainMeta {
            version: 1,
            image: ImageMeta {
                name: image.name.clone(),
                manifest_digest: image.manifest_digest.clone(),
                config_digest: image.config_digest.clone(),
                config: image.config.clone(),
                layers: image.layers.len(),
            },
            snapshots,
            records: None,
        })
    }

    /// The chain's logs and evaluations, as the records blob holds them.
    fn chain_records(&self, chain: &[SnapshotRow]) -> Result<Vec<u8>, TransferError> {
        let db = lock(&self.db);
        let mut out = ChainRecords::default();
        for (i, s) in chain.iter().enumerate() {
            let mut log = Vec::new();
            if i == 0 {
                if let Some(p) = &s.parent_id {
                    log = crate::daemon::snapshots::snapshot_log(&db, p, true)?;
                }
            }
            let inherited = log.len();
            log.extend(crate::daemon::snapshots::own_log(&db, s, true)?);
            // Ids are this host's: they mean nothing elsewhere.
            log.iter_mut().for_each(|r| r.id = 0);
            let mut evaluations = db.evaluations(&s.id)?;
            evaluations.iter_mut().for_each(|e| e.id = 0);
            out.snapshots.push(SnapshotRecords { id: s.id.clone(), inherited, log, evaluations });
        }
        drop(db);
        let pack = |out: &ChainRecords| -> Result<Vec<u8>, TransferError> {
            let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
            serde_json::to_writer(&mut gz, out)?;
            Ok(gz.finish()?)
        };
        let packed = pack(&out)?;
        if packed.len() as u64 <= MAX_RECORDS {
            return Ok(packed);
        }
        // Too large for a pull to take: the commands' output stays here.
        tracing::warn!("records of {} bytes: pushing the exec log without its output", packed.len());
        for s in &mut out.snapshots {
            s.log.iter_mut().for_each(|r| r.output = None);
        }
        pack(&out)
    }

    /// Fetch and read a chain's records blob (checked against its digest
    /// and size, unpacked within a bound).
    fn fetch_records(&self, client: &Client, repo: &str, r: &RecordsRef) -> Result<ChainRecords, TransferError> {
        if r.size > MAX_RECORDS {
            return Err(invalid(format!("records blob {} of {} bytes is over the limit", r.digest, r.size)));
        }
        let mut gz = Vec::new();
        client.get_blob(repo, &r.digest, r.size, &mut gz, &mut |_| {})?;
        let mut json = Vec::new();
        flate2::read::GzDecoder::new(&gz[..])
            .take(MAX_RECORDS_JSON + 1)
            .read_to_end(&mut json)
            .map_err(|e| upstream(client, format!("records blob {} is not gzip: {e}", r.digest)))?;
        if json.len() as u64 > MAX_RECORDS_JSON {
            return Err(invalid(format!("records blob {} unpacks to more than {MAX_RECORDS_JSON} bytes", r.digest)));
        }
        serde_json::from_slice(&json)
            .map_err(|e| upstream(client, format!("records blob {} is not valid: {e}", r.digest)))
    }

    // ---- pull ----

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
    fn fetch_layers(
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

    /// Pull an image from a registry; only layers the host lacks are fetched.
    pub fn pull_image(
        &self,
        req: &RegistryRequest,
        progress: &mut dyn FnMut(Progress),
    ) -> Result<PullResult, TransferError> {
        let reference = parse_reference(&req.reference)?;
        let name = match &req.name {
            Some(n) => n.clone(),
            None => match (&reference.tag, &reference.digest) {
                (Some(t), _) => format!("{}:{t}", reference.repository),
                (None, Some(d)) => format!("{}:{}", reference.repository, &d.hex()[..12]),
                (None, None) => reference.repository.clone(),
            },
        };
        let name: ImageName = name.parse()?;
        if lock(&self.db).image_by_name(&name)?.is_some() {
            return Err(TransferError::ImageExists(name));
        }
        let client = client(req, &reference)?;
        let _serial = lock(&self.import_lock);
        let work = self.rt.store.new_tmp("pull").map_err(store_err)?;
        // The layers found here (not fetched) are leased until the import
        // has listed them, as is all it puts in place.
        let result = self.leased(|lease| {
            let mut config_bytes = 0;
            let docs = self.fetch_documents(&client, &reference, &mut config_bytes)?;
            if docs.labels.contains_key(CHAIN_LABEL) {
                tracing::info!("{reference} is a Strata snapshot; pulling it as a plain image");
            }
            // An OCI layout of what was fetched, so the import checks it
            // exactly as it checks a layout on disk.
            let layout = work.join("layout");
            let blobs = layout.join("blobs/sha256");
            std::fs::create_dir_all(&blobs).map_err(host_io)?;
            let write = |name: &str, bytes: &[u8]| {
                std::fs::write(blobs.join(name), bytes)
                    .map_err(|e| store_err(StoreError::Io { step: "write", path: blobs.join(name), source: e }))
            };
            write(docs.digest.hex(), &docs.manifest)?;
            write(docs.config_digest.hex(), &docs.config)?;
            // index.json points at what the reference named.
            let top = match &docs.index {
                Some((d, bytes, mt, _)) => {
                    write(d.hex(), bytes)?;
                    oci::descriptor(mt, d, bytes.len() as u64)
                }
                None => oci::descriptor(oci::layout::MEDIA_OCI_MANIFEST, &docs.digest, docs.manifest.len() as u64),
            };
            oci::layout::write_root(&layout, vec![top]).map_err(host_io)?;
            for l in &docs.layers {
                lease.layer(l.diff_id.hex());
            }
            let mut tally = Tally { blobs: 1, bytes: config_bytes, reused: 0 };
            let paths =
                self.fetch_layers(&client, &reference.repository, &docs.layers, &blobs, &mut tally, progress)?;
            // A blob the host has but the layout lacks: link it in.
            for (l, p) in docs.layers.iter().zip(&paths) {
                let stored = self.rt.store.blob_path(l.digest.hex());
                let dst = blobs.join(l.digest.hex());
                if p.is_none() && stored.is_file() && !dst.exists() {
                    std::fs::copy(&stored, &dst).map_err(host_io)?;
                }
            }
            let have = |d: &Digest| lock(&self.db).layer_exists(d.hex()).unwrap_or(false);
            let src = oci::layout::open_dir_lacking(&layout, None, &have)
                .map_err(|e| upstream(&client, format!("{reference}: {}", crate::error::chain(&e))))?;
            let row = crate::image::import_source(&self.rt.store, &self.db, &src, &name, &work, lease)?;
            Ok(PullResult {
                reference: reference.to_string(),
                manifest_digest: docs.digest.to_string(),
                image: crate::daemon::image_info(&row),
                snapshot: None,
                fetched_blobs: tally.blobs,
                fetched_bytes: tally.bytes,
                reused_layers: tally.reused,
            })
        });
        let _ = crate::store::remove_tree(&work);
        result
    }

    /// Pull a snapshot pushed by `push_snapshot` (on any host) and recreate
    /// it here with the same ids and digests.
    pub fn pull_snapshot(
        &self,
        req: &RegistryRequest,
        progress: &mut dyn FnMut(Progress),
    ) -> Result<PullResult, TransferError> {
        let reference = parse_reference(&req.reference)?;
        if req.name.is_some() {
            return Err(invalid("name applies to image pull only"));
        }
        let client = client(req, &reference)?;
        let _serial = lock(&self.import_lock);
        let work = self.rt.store.new_tmp("pull").map_err(store_err)?;
        let result = self.leased(|lease| {
            let mut config_bytes = 0;
            let docs = self.fetch_documents(&client, &reference, &mut config_bytes)?;
            let meta: ChainMeta = match docs.labels.get(CHAIN_LABEL) {
                Some(m) => serde_json::from_str(m).map_err(|e| invalid(format!("{reference}: bad {CHAIN_LABEL} label: {e}")))?,
                None => {
                    return Err(invalid(format!(
                        "{reference} is not a Strata snapshot (its config has no {CHAIN_LABEL} label); use `strata image pull`"
                    )))
                }
            };
            let n_image = meta.image.layers;
            if meta.version != 1 || n_image + meta.snapshots.len() != docs.layers.len() || meta.snapshots.is_empty() {
                return Err(invalid(format!(
                    "{reference}: the {CHAIN_LABEL} label names {} + {} layers, the manifest has {}",
                    n_image,
                    meta.snapshots.len(),
                    docs.layers.len()
                )));
            }
            let mut records = match &meta.records {
                Some(r) => self.fetch_records(&client, &reference.repository, r)?,
                None => ChainRecords::default(),
            };
            if !records.snapshots.is_empty()
                && (records.snapshots.len() != meta.snapshots.len()
                    || records.snapshots.iter().zip(&meta.snapshots).any(|(r, m)| r.id != m.id)
                    || records.snapshots.iter().any(|r| r.inherited > r.log.len()))
            {
                return Err(invalid(format!("{reference}: its records blob does not match its chain")));
            }
            let compressions: Vec<BlobCompression> = docs.layers[n_image..]
                .iter()
                .map(|l| blob_compression(l.compression))
                .collect::<Option<_>>()
                .ok_or_else(|| invalid(format!("{reference}: snapshot layers must be compressed (zstd or gzip)")))?;
            for s in &meta.snapshots {
                s.id.parse::<crate::ids::SandboxId>().map_err(|_| invalid(format!("bad snapshot id {:?}", s.id)))?;
                if s.work_context.as_ref().is_some_and(|w| !crate::daemon::lineage::valid_work_context(w)) {
                    return Err(invalid(format!("bad work context of snapshot {}", s.id)));
                }
            }
            // The layers this pull finds here are leased until its rows are
            // in, as are those it commits.
            for l in &docs.layers {
                lease.layer(l.diff_id.hex());
            }
            let mut tally = Tally { blobs: 1, bytes: config_bytes, reused: 0 };
            let paths = self.fetch_layers(&client, &reference.repository, &docs.layers, &work, &mut tally, progress)?;
            // The image's layers the host lacks are unpacked now (a plain
            // create from the image must find them); the snapshots' layers
            // are checked (blob digest while fetched, diff_id here) and
            // recorded, and unpacked in the background or by the first
            // launch that needs them.
            let store = &self.rt.store;
            let mut rows = Vec::new();
            let mut fresh = Vec::new();
            let mut unhydrated = Vec::new();
            for (i, (l, p)) in docs.layers.iter().zip(&paths).enumerate() {
                let hex = l.diff_id.hex().to_string();
                let mut row = LayerRow::content(LayerId::from(&l.diff_id), 0, 0);
                let have = lock(&self.db).layer_exists(&hex)? && store.layer_dir(&hex).join("fs").is_dir();
                let seen = fresh.iter().any(|(h, _): &(String, PathBuf)| *h == hex)
                    || unhydrated.iter().any(|u: &Unhydrated| u.layer_id == *hex);
                if !have && !seen {
                    let blob = p.clone().unwrap_or_else(|| {
                        paths
                            .iter()
                            .flatten()
                            .find(|q| q.ends_with(l.digest.hex()))
                            .cloned()
                            .unwrap_or_else(|| store.blob_path(l.digest.hex()))
                    });
                    if i >= n_image {
                        progress(Progress {
                            action: "verify".into(),
                            digest: l.digest.to_string(),
                            size: l.size,
                            done: 0,
                        });
                        check_diff_id(&blob, l).map_err(|e| upstream(&client, e.to_string()))?;
                        unhydrated.push(Unhydrated {
                            layer_id: row.id.clone(),
                            blob_digest: l.digest.clone(),
                            compression: compressions[i - n_image],
                            error: None,
                        });
                    } else {
                        let dir = work.join(format!("layer-{i}"));
                        let fs = dir.join("fs");
                        std::fs::create_dir_all(&fs).map_err(host_io)?;
                        progress(Progress {
                            action: "unpack".into(),
                            digest: l.digest.to_string(),
                            size: l.size,
                            done: 0,
                        });
                        let stats =
                            oci::unpack_layer(&layer_source(&blob, l), &fs).map_err(|source| TransferError::Layer {
                                digest: l.digest.clone(),
                                registry: client.registry().to_string(),
                                source: Box::new(source),
                            })?;
                        row.size = stats.bytes;
                        row.entries = stats.entries;
                        fresh.push((hex, dir));
                    }
                }
                rows.push(row);
            }
            // Move layers and blobs into place, then record in one go.
            for (hex, dir) in &fresh {
                store.commit_layer(dir, hex, true, lease).map_err(store_err)?;
            }
            for (l, p) in docs.layers.iter().zip(&paths) {
                if let Some(p) = p {
                    store.adopt_blob(p, l.digest.hex(), true, lease).map_err(store_err)?;
                }
            }
            let name: ImageName = meta.image.name.parse()?;
            let image = PulledImage {
                name,
                manifest_digest: meta.image.manifest_digest.clone(),
                config_digest: meta.image.config_digest.clone(),
                config: meta.image.config.clone(),
                layers: rows[..n_image]
                    .iter()
                    .cloned()
                    .zip(docs.layers[..n_image].iter().map(|l| l.digest.clone()))
                    .collect(),
            };
            let mut snaps: Vec<PulledSnapshot> = meta
                .snapshots
                .iter()
                .zip(&docs.layers[n_image..])
                .zip(&rows[n_image..])
                .enumerate()
                .map(|(k, ((m, l), layer))| {
                    let mut info = m.info.clone();
                    if let Some(o) = info.as_object_mut() {
                        o.insert("pulled_from".into(), serde_json::Value::String(reference.to_string()));
                    }
                    PulledSnapshot {
                        row: SnapshotRow {
                            id: m.id.clone(),
                            image_id: 0,
                            parent_id: m.parent_id.clone(),
                            class: m.class,
                            // Set when it is recorded (`record_pulled`).
                            state: crate::model::SnapshotState::Superseded,
                            work_context: m.work_context.clone(),
                            sequence: m.sequence,
                            predecessor_id: m.predecessor_id.clone(),
                            baseline: m.baseline.clone(),
                            layer: layer.id.clone(),
                            diff_id: layer.diff_id.clone(),
                            blob_digest: Some(l.digest.clone()),
                            blob_size: l.size,
                            compression: compressions[k],
                            source_sandbox: m.source_sandbox.clone(),
                            info,
                            created_at: m.created_at,
                        },
                        layer: layer.clone(),
                        start_kind: m.start_kind.unwrap_or(crate::model::StartKind::Image),
                        start_id: m.start_id.clone(),
                        log: records.snapshots.get_mut(k).map(|r| std::mem::take(&mut r.log)).unwrap_or_default(),
                        inherited: records.snapshots.get(k).map_or(0, |r| r.inherited),
                        evaluations: records
                            .snapshots
                            .get_mut(k)
                            .map(|r| std::mem::take(&mut r.evaluations))
                            .unwrap_or_default(),
                    }
                })
                .collect();
            let recorded = lock(&self.db).record_pull(&image, &mut snaps, &unhydrated)?;
            let image_id = recorded.map_err(|c| TransferError::Conflict(c.to_string()))?;
            // Pulled baselines serve new work only once checked here.
            for p in snaps.iter().filter(|p| p.row.baseline.is_some()) {
                let unchecked = lock(&self.db).snapshot(&p.row.id)?.is_some_and(|r| {
                    r.info["ineligible"] == crate::db::PULLED_UNCHECKED
                });
                if unchecked {
                    self.admit_pulled_baseline(&p.row.id);
                }
            }
            let top = &snaps[snaps.len() - 1].row.id;
            let db = lock(&self.db);
            let image = db
                .image_by_id(image_id)?
                .ok_or_else(|| TransferError::Missing("pulled image row is missing"))?;
            let top =
                db.snapshot(top)?.ok_or_else(|| TransferError::Missing("pulled snapshot row is missing"))?;
            let snapshot = self.snapshot_info_locked(&db, &top)?;
            drop(db);
            for u in &unhydrated {
                self.queue_hydration(&u.layer_id);
            }
            tracing::info!("pulled snapshot {} from {reference} ({} bytes fetched)", top.id, tally.bytes);
            Ok(PullResult {
                reference: reference.to_string(),
                manifest_digest: docs.digest.to_string(),
                image: crate::daemon::image_info(&image),
                snapshot: Some(snapshot),
                fetched_blobs: tally.blobs,
                fetched_bytes: tally.bytes,
                reused_layers: tally.reused,
            })
        });
        // Nothing partial: what this pull moved in that no row lists is
        // the collector's once its lease ends.
        let _ = crate::store::remove_tree(&work);
        result
    }
}

fn upstream(client: &Client, what: String) -> TransferError {
    TransferError::Upstream { registry: client.registry().to_string(), what }
}

/// What a pull fetched (the config counts as one blob) and reused.
struct Tally {
    blobs: usize,
    bytes: u64,
    reused: usize,
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
    digest: Digest,
    manifest: Vec<u8>,
    /// The index the reference named, if any: digest, bytes, media type, size.
    index: Option<(Digest, Vec<u8>, String, u64)>,
    config_digest: Digest,
    config: Vec<u8>,
    pub(crate) layers: Vec<WireLayer>,
    labels: std::collections::HashMap<String, String>,
}

/// How a snapshot blob of this compression is read.
fn layer_compression(c: BlobCompression) -> Compression {
    match c {
        BlobCompression::Gzip => Compression::Gzip,
        BlobCompression::Zstd => Compression::Zstd,
    }
}

/// A snapshot layer's compression as a snapshot records it; none for an
/// uncompressed one (snapshot blobs are always compressed).
fn blob_compression(c: Compression) -> Option<BlobCompression> {
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
fn check_diff_id(path: &Path, l: &WireLayer) -> Result<(), String> {
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

impl Daemon {
    /// Start the background hydrator (pulled layers' trees) and queue the
    /// layers a previous daemon left unhydrated.
    pub fn start_hydrator(self: &std::sync::Arc<Self>) {
        let (tx, rx) = std::sync::mpsc::channel::<String>();
        let d = self.clone();
        let spawned = std::thread::Builder::new().name("hydrator".into()).spawn(move || {
            let _ = strata_shim::sys::set_thread_nice(10);
            for id in rx {
                if let Err(e) = d.hydrate_layer(&id) {
                    tracing::error!("hydrate layer {id}: {}", crate::error::chain(&e));
                }
            }
        });
        if let Err(e) = spawned {
            tracing::error!("start hydrator: {e}");
            return;
        }
        if let Ok(pending) = lock(&self.db).unhydrated_layers_with(false) {
            for id in pending {
                let _ = tx.send(id.to_string());
            }
        }
        *lock(&self.hydrator) = Some(tx);
    }

    fn queue_hydration(&self, id: &str) {
        if let Some(tx) = lock(&self.hydrator).as_ref() {
            let _ = tx.send(id.to_string());
        }
    }

    /// Make sure layer `id`'s tree is in place: unpack it now if a pull
    /// left it to be hydrated, or wait for the unpack in progress. A layer
    /// whose unpack failed is refused with the reason.
    pub(crate) fn hydrate_layer(&self, id: &str) -> Result<(), TransferError> {
        let mut busy = lock(&self.hydrating);
        while busy.contains(id) {
            busy = self.hydrated.wait(busy).unwrap_or_else(|p| p.into_inner());
        }
        let Some(u) = lock(&self.db).unhydrated(id)? else { return Ok(()) };
        if let Some(e) = &u.error {
            return Err(TransferError::Unpackable { layer: id.to_string(), why: e.clone() });
        }
        busy.insert(id.to_string());
        drop(busy);
        let r = self.unpack_pulled(&u);
        lock(&self.hydrating).remove(id);
        self.hydrated.notify_all();
        r
    }

    fn unpack_pulled(&self, u: &Unhydrated) -> Result<(), TransferError> {
        let store = &self.rt.store;
        let digest = u.blob_digest.clone();
        let diff_id = parse_digest(&format!("sha256:{}", u.layer_id), "pulled layer")?;
        let compression = layer_compression(u.compression);
        let blob = store.blob_path(digest.hex());
        if store.layer_dir(&u.layer_id).join("fs").is_dir() {
            // Unpacked before a crash, not yet recorded.
            lock(&self.db).hydrated(&u.layer_id, 0, 0)?;
            return Ok(());
        }
        let size = blob.metadata()?.len();
        crate::failpoint::hit("hydrate:unpack");
        let work = store.new_tmp("hydrate").map_err(store_err)?;
        let result = self.leased(|lease| {
            let dir = work.join("layer");
            std::fs::create_dir_all(dir.join("fs")).map_err(host_io)?;
            let l = WireLayer { digest, size, media_type: media_type(compression).into(), compression, diff_id };
            let stats = match oci::unpack_layer(&layer_source(&blob, &l), &dir.join("fs")) {
                Ok(s) => s,
                Err(e) if e.is_io() => return Err(TransferError::Unpack(Box::new(e))),
                Err(e) => {
                    let why = crate::error::chain(&e);
                    lock(&self.db).hydration_failed(&u.layer_id, &why)?;
                    return Err(TransferError::Unpackable { layer: u.layer_id.to_string(), why });
                }
            };
            store.commit_layer(&dir, &u.layer_id, true, lease).map_err(store_err)?;
            // False if its snapshot was removed meanwhile: the layer is
            // then the collector's.
            lock(&self.db).hydrated(&u.layer_id, stats.bytes, stats.entries)?;
            tracing::info!("hydrated pulled layer {} ({} entries)", u.layer_id, stats.entries);
            Ok(())
        });
        let _ = crate::store::remove_tree(&work);
        result
    }
}
