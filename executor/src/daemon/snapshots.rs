//! Snapshot rows as the API shows them (list, inspect), the check that one
//! can be restored, and what a resume or fork starts from: its image and
//! whole chain, its layers hydrated or brought from the fleet registry.

use super::lookup::{restorable, SnapshotLookupError};
use crate::catalog::SnapshotRow;
use crate::daemon::{lock, Daemon};
use crate::ids::SnapshotId;
use crate::model::{Rung, SnapshotType};
use crate::types::SnapshotInfo;

/// What a sandbox starts from: an image and a layer chain (the image's
/// layers, plus a snapshot chain when resuming or forking).
pub struct Base {
    pub image: crate::catalog::ImageRow,
    pub layers: Vec<crate::ids::LayerId>,
    pub snapshot: Option<SnapshotId>,
    /// The lineage the sandbox will work for, and the head it observes.
    pub work_context: String,
    pub observed_head: Option<SnapshotId>,
    /// How it was chosen (recorded as the restore's rung).
    pub rung: crate::model::Rung,
    /// Why the rungs above it could not be restored (recorded with it).
    pub fell: Vec<String>,
    /// A snapshot of its chain was captured in a user namespace: it runs
    /// only in one (see [`Daemon::launch`]).
    pub captured_in_userns: bool,
    /// The network of the sandbox the snapshot was taken of: a resume or
    /// fork that names none gets its mode and policy (and an address of
    /// its own).
    pub network: Option<crate::net::NetworkSpec>,
}

/// Most sandboxes one fork may start.
pub const MAX_FORK: u32 = 64;

/// Mark a snapshot captured in a user namespace: its chain then runs only
/// in one (`Daemon::settle_userns`).
impl Daemon {
    pub(crate) fn snapshot_info_locked(
        &self,
        db: &crate::catalog::Db,
        row: &SnapshotRow,
    ) -> Result<SnapshotInfo, SnapshotLookupError> {
        let image = db.image_by_id(row.image_id)?.ok_or(SnapshotLookupError::NoImageRow)?;
        let chain = db.snapshot_layer_chain(&row.id)?;
        let place = db.snapshot_place(row.id.as_str())?.unwrap_or_default();
        let chain_layers: Vec<String> =
            image.layers.iter().map(ToString::to_string).chain(chain.iter().map(|s| s.layer.to_string())).collect();
        let hosts = self.hosts_holding(db, &chain_layers);
        let publish_state = lock(&self.publishing).get(row.id.as_str()).cloned();
        let digest = |h: &str| format!("sha256:{h}");
        let layers = image
            .layers
            .iter()
            .map(|h| Some(digest(h)))
            .chain(chain.iter().map(|s| s.diff_id.as_ref().map(ToString::to_string)));
        Ok(SnapshotInfo {
            id: row.id.clone(),
            class: row.class,
            state: row.state,
            sealing: db.blob_pending(&row.id)?,
            hydrating: chain
                .iter()
                .map(|s| db.unhydrated(&s.layer))
                .collect::<Result<Vec<_>, _>>()?
                .iter()
                .any(Option::is_some),
            work_context: row.work_context.clone(),
            sequence: row.sequence,
            predecessor: row.predecessor_id.clone(),
            baseline: row.baseline.clone(),
            image: image.name,
            parent: row.parent_id.clone(),
            layers: layers.collect(),
            layer: row.layer.clone(),
            diff_id: row.diff_id.as_ref().map(ToString::to_string),
            blob_digest: row.blob_digest.as_ref().map(ToString::to_string).unwrap_or_default(),
            blob_size: row.blob_size,
            compression: row.compression,
            source_sandbox: row.source_sandbox.clone(),
            created_at: row.created_at,
            info: row.info.clone(),
            bytes: crate::types::SnapshotBytes {
                layer: db.layer_size(row.layer.as_str())?,
                blob: row.blob_size,
                chain_layers: chain.iter().map(|s| db.layer_size(s.layer.as_str())).sum::<Result<u64, _>>()?,
                chain_blobs: chain.iter().map(|s| s.blob_size).sum(),
            },
            retained: db.retained(&row.id)?,
            labels: db.labels(&row.id)?,
            kind: if place.published.is_some() { SnapshotType::Distributed } else { SnapshotType::Local },
            host: place.host,
            registry: place.published,
            publishing: matches!(publish_state, Some(None)),
            publish_error: publish_state.flatten(),
            hosts,
        })
    }

    pub fn list_snapshots(&self) -> Result<Vec<SnapshotInfo>, SnapshotLookupError> {
        let db = lock(&self.db);
        db.list_snapshots()?.iter().map(|r| self.snapshot_info_locked(&db, r)).collect()
    }

    /// Row and pending mark read under one lock: a seal committing between
    /// them would show "not sealing" with no blob yet.
    pub fn get_snapshot(&self, id: &str) -> Result<SnapshotInfo, SnapshotLookupError> {
        let db = lock(&self.db);
        let row = self.snapshot_row_in(&db, id)?;
        self.snapshot_info_locked(&db, &row)
    }

    /// What a resume or fork of `row` starts from: its image and whole chain.
    pub(crate) fn snapshot_base(&self, row: &SnapshotRow) -> Result<Base, SnapshotLookupError> {
        restorable(row)?;
        let db = lock(&self.db);
        let image = db.image_by_id(row.image_id)?.ok_or(SnapshotLookupError::NoImageRow)?;
        let mut layers = image.layers.clone();
        let chain = db.snapshot_layer_chain(&row.id)?;
        // The chain ends at the nearest compacted snapshot, whose sandbox
        // ran on everything below it: marked if anything below was.
        let captured_in_userns = chain.iter().any(|s| s.info.userns);
        layers.extend(chain.into_iter().map(|s| s.layer));
        // A pulled chain may not be unpacked yet (one query; usually none is
        // waiting, and launches stay free of per-layer lookups).
        let waiting = db.unhydrated_layers_with(true)?;
        drop(db);
        for l in layers.iter().filter(|l| waiting.contains(l)) {
            self.hydrate_layer(l).map_err(|e| SnapshotLookupError::Hydrate(Box::new(e)))?;
        }
        // Layers this host lacks come from the fleet registry when the
        // snapshot was made elsewhere (or a registry could have them); a
        // snapshot of this host's missing a layer is left to the callers
        // (the ladder passes that rung).
        let store = &self.rt.store;
        if layers.iter().any(|l| !store.layer_dir(l.as_str()).join("fs").is_dir()) {
            let place = lock(&self.db).snapshot_place(row.id.as_str())?.unwrap_or_default();
            let made_here = place.host.as_deref().is_none_or(|h| h == self.cfg.host_id);
            if self.cfg.registry.is_some() || !made_here {
                self.bring_layers(row.id.as_str(), &layers).map_err(|e| SnapshotLookupError::Hydrate(Box::new(e)))?;
            }
        }
        Ok(Base {
            image,
            layers,
            snapshot: Some(row.id.clone()),
            work_context: String::new(),
            observed_head: None,
            rung: Rung::Snapshot,
            captured_in_userns,
            fell: Vec::new(),
            network: row.info.network.clone(),
        })
    }

    /// The hosts up whose last heartbeat listed every one of `layers`.
    pub(crate) fn hosts_holding(&self, db: &crate::catalog::Db, layers: &[String]) -> Vec<String> {
        let mut cache = lock(&self.host_layers);
        let fresh = cache.as_ref().is_some_and(|(at, _)| at.elapsed() < std::time::Duration::from_secs(1));
        if !fresh {
            let hosts = db
                .list_hosts()
                .unwrap_or_default()
                .into_iter()
                .filter(|h| h.state.is_up())
                .map(|h| {
                    let held = serde_json::from_str::<crate::types::HostInfo>(&h.info)
                        .map(|i| i.layers.into_iter().collect())
                        .unwrap_or_default();
                    (h.id, held)
                })
                .collect();
            *cache = Some((std::time::Instant::now(), hosts));
        }
        let Some((_, hosts)) = cache.as_ref() else { return Vec::new() };
        hosts.iter().filter(|(_, held)| layers.iter().all(|l| held.contains(l))).map(|(h, _)| h.clone()).collect()
    }
}
