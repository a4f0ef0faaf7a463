//! `snapshot push`: a snapshot's sealed chain as an ordinary OCI image (its
//! image's layers, one layer per snapshot, the chain's metadata in the
//! config's `dev.strata.chain` label, its records as one more blob).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::distribution::{
    client, invalid, layer_compression, media_type, parse_digest, parse_reference, sniff, store_err, ChainMeta,
    ChainRecords, ImageMeta, RecordsRef, SnapshotMeta, SnapshotRecords, TransferError, CHAIN_LABEL, MAX_RECORDS,
    SEAL_WAIT,
};
use super::lock;
use super::lookup::{restorable, SnapshotLookupError};
use crate::catalog::SnapshotRow;
use crate::daemon::Daemon;
use crate::error::{Classify, ErrorKind};
use crate::oci::{self, Compression, Digest};
use crate::registry::{Pushed, Reference};
use crate::store::BlobCompression;
use crate::types::{Progress, PushResult, RegistryRequest};

/// Why a push failed: the snapshot (not found, being removed, not
/// restorable) or its transfer.
#[derive(Debug, thiserror::Error, displaydoc::Display)]
pub enum PushError {
    /// {0}
    Snapshot(#[from] SnapshotLookupError),
    /// {0}
    Transfer(#[from] TransferError),
}

impl Classify for PushError {
    fn kind(&self) -> ErrorKind {
        match self {
            PushError::Snapshot(e) => e.kind(),
            PushError::Transfer(e) => e.kind(),
        }
    }
}

/// A layer blob to push.
struct PushBlob {
    path: PathBuf,
    digest: Digest,
    size: u64,
    media_type: &'static str,
    diff_id: String,
}

impl Daemon {
    /// Push snapshot `id` (its image's layers and its layer chain) to
    /// `req.reference`. Blobs the repository has are not sent again, so a
    /// push that failed half-way is resumed by running it again.
    pub fn push_snapshot(
        &self,
        id: &str,
        req: &RegistryRequest,
        progress: &mut dyn FnMut(Progress),
    ) -> Result<PushResult, PushError> {
        let reference = parse_reference(&req.reference)?;
        let Some(tag) = reference.tag.clone().filter(|_| reference.digest.is_none()) else {
            return Err(invalid("a push needs a tag, not a digest (the registry computes the digest)").into());
        };
        let row = self.snapshot_row(id)?;
        restorable(&row)?;
        let _pin = self.pin_snapshot(&row.id)?;
        let (image, chain) = self.sealed_chain(&row)?;
        let client = client(req, &reference)?;
        let work = self.rt.store.new_tmp("push").map_err(store_err)?;
        let result = (|| -> Result<PushResult, TransferError> {
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
                let r = Reference::parse(s.info.pulled_from.as_deref()?).ok()?;
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
        Ok(result?)
    }

    /// The snapshot's image and layer chain once every blob of the chain is
    /// sealed (a suspend seals in the background).
    fn sealed_chain(&self, row: &SnapshotRow) -> Result<(crate::catalog::ImageRow, Vec<SnapshotRow>), TransferError> {
        let started = Instant::now();
        loop {
            let (image, chain, pending) = {
                let db = lock(&self.db);
                let image = db
                    .image_by_id(row.image_id)?
                    .ok_or_else(|| TransferError::Missing("snapshot's image row is missing"))?;
                let chain = db.snapshot_layer_chain(&row.id)?;
                if let Some((s, why)) = chain.iter().find_map(|s| Some((s, s.info.seal_error.as_deref()?))) {
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
        image: &crate::catalog::ImageRow,
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

    fn chain_meta(&self, image: &crate::catalog::ImageRow, chain: &[SnapshotRow]) -> Result<ChainMeta, TransferError> {
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
                    log = crate::daemon::execlog::snapshot_log(&db, p, true)?;
                }
            }
            let inherited = log.len();
            log.extend(crate::daemon::execlog::own_log(&db, s, true)?);
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
}
