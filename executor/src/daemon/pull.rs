//! `image pull` and `snapshot pull`: only the blobs this host lacks, every
//! digest and diff_id checked, unpacked under `tmp/`, and image, layers,
//! lineages and snapshots recorded in one transaction with the same ids.

use std::io::Read;
use std::path::PathBuf;

use super::distribution::{
    blob_compression, check_diff_id, client, host_io, invalid, layer_source, parse_reference, store_err, upstream,
    ChainMeta, ChainRecords, RecordsRef, Tally, TransferError, CHAIN_LABEL, MAX_RECORDS, MAX_RECORDS_JSON,
};
use super::lock;
use crate::catalog::{LayerRow, PulledImage, PulledSnapshot, SnapshotRow, Unhydrated};
use crate::daemon::Daemon;
use crate::ids::{ImageName, LayerId};
use crate::oci::{self, Digest};
use crate::registry::Client;
use crate::store::{BlobCompression, StoreError};
use crate::types::{Progress, PullResult, RegistryRequest};

impl Daemon {
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
                if s.work_context.as_ref().is_some_and(|w| !crate::ids::valid_work_context(w)) {
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
                    info.pulled_from = Some(reference.to_string());
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
                    r.info.ineligible.as_deref() == Some(crate::catalog::PULLED_UNCHECKED)
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
            // Shown from rows just checked to be there: only the catalog
            // can fail it.
            let snapshot = self.snapshot_info_locked(&db, &top).map_err(|e| match e {
                crate::daemon::lookup::SnapshotLookupError::Db(e) => TransferError::Db(e),
                _ => TransferError::Missing("pulled snapshot's image row is missing"),
            })?;
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
