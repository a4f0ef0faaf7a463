//! Hydration: a pulled layer's blob unpacked into the store, once per host,
//! by the background hydrator or by the first launch that needs it; and
//! the layers of a snapshot made on another host, brought from the fleet
//! registry it was published to (`fleet.rs`).

use super::distribution::FleetRegistry;
use super::distribution::{
    host_io, invalid, layer_compression, layer_source, media_type, store_err, TransferError, WireLayer,
};
use super::lock;
use crate::catalog::{DbError, Unhydrated};
use crate::daemon::Daemon;
use crate::error::{Classify, ErrorKind};
use crate::ids::LayerId;
use crate::oci::{self};
use crate::registry::{Client, Reference};
use crate::store::StoreError;

/// Why a layer a launch needs could not be made present on this host:
/// a pulled layer not unpacked, or layers brought from the fleet registry.
#[derive(Debug, thiserror::Error, displaydoc::Display)]
pub enum HydrateError {
    /// pulled layer {layer} cannot be unpacked: {why}
    Unpackable { layer: String, why: String },
    /// {0}
    Unpack(#[source] Box<oci::UnpackError>),
    /// snapshot {snapshot} cannot be brought to this host: its layers {layers:?} are not here; tried: {tried}
    Unavailable { snapshot: String, layers: Vec<String>, tried: String },
    /// layer id {0} is not a digest
    LayerId(String),
    /// {0}
    Io(#[from] std::io::Error),
    /// {0}
    Store(#[from] StoreError),
    /// {0}
    Db(#[from] DbError),
}

impl Classify for HydrateError {
    fn kind(&self) -> ErrorKind {
        match self {
            HydrateError::Unpackable { .. } => ErrorKind::InvalidArgument,
            HydrateError::Unavailable { .. } => ErrorKind::Conflict,
            HydrateError::LayerId(_) => ErrorKind::Internal,
            HydrateError::Db(e) => e.kind(),
            _ => ErrorKind::of_host_failure(self),
        }
    }
}

impl HydrateError {
    /// Whether a lineage's ladder passes the rung that needed the layer
    /// (the layer cannot be had), rather than failing (the catalog did).
    pub(crate) fn passes_rung(&self) -> bool {
        !matches!(self, HydrateError::Db(_))
    }
}

/// Where the time of bringing layers went (logged; scripts/bench-fleet.sh
/// reads it).
#[derive(Default)]
struct Spent {
    bytes: u64,
    manifest: std::time::Duration,
    fetch: std::time::Duration,
    unpack: std::time::Duration,
    commit: std::time::Duration,
}

/// A layer to bring: its id here, and what the catalog says it is.
struct Wanted {
    layer: LayerId,
    blob: crate::oci::Digest,
    diff_id: crate::oci::Digest,
}

impl Daemon {
    /// Start the background hydrator (pulled layers' trees) and queue the
    /// layers a previous daemon left unhydrated.
    pub fn start_hydrator(self: &std::sync::Arc<Self>) {
        let (tx, rx) = std::sync::mpsc::channel::<String>();
        let d = self.clone();
        let spawned = super::background(
            "hydrator",
            "pulled layers are unpacked by the first launch that needs them",
            move || {
                let _ = strata_shim::sys::set_thread_nice(10);
                for id in rx {
                    if let Err(e) = d.hydrate_layer(&id) {
                        tracing::error!("hydrate layer {id}: {}", crate::error::chain(&e));
                    }
                }
            },
        );
        if spawned.is_none() {
            return;
        }
        if let Ok(pending) = lock(&self.db).unhydrated_layers_with(false) {
            for id in pending {
                let _ = tx.send(id.to_string());
            }
        }
        *lock(&self.hydrator) = Some(tx);
    }

    pub(crate) fn queue_hydration(&self, id: &str) {
        if let Some(tx) = lock(&self.hydrator).as_ref() {
            let _ = tx.send(id.to_string());
        }
    }

    /// Make sure layer `id`'s tree is in place: unpack it now if a pull
    /// left it to be hydrated, or wait for the unpack in progress. A layer
    /// whose unpack failed is refused with the reason.
    pub(crate) fn hydrate_layer(&self, id: &str) -> Result<(), HydrateError> {
        let mut busy = lock(&self.hydrating);
        while busy.contains(id) {
            busy = self.hydrated.wait(busy).unwrap_or_else(|p| p.into_inner());
        }
        let Some(u) = lock(&self.db).unhydrated(id)? else { return Ok(()) };
        if let Some(e) = &u.error {
            return Err(HydrateError::Unpackable { layer: id.to_string(), why: e.clone() });
        }
        busy.insert(id.to_string());
        drop(busy);
        let r = self.unpack_pulled(&u);
        lock(&self.hydrating).remove(id);
        self.hydrated.notify_all();
        r
    }

    fn unpack_pulled(&self, u: &Unhydrated) -> Result<(), HydrateError> {
        let store = &self.rt.store;
        let digest = u.blob_digest.clone();
        let diff_id =
            format!("sha256:{}", u.layer_id).parse().map_err(|_| HydrateError::LayerId(u.layer_id.to_string()))?;
        let compression = layer_compression(u.compression);
        let blob = store.blob_path(digest.hex());
        if store.layer_dir(&u.layer_id).join("fs").is_dir() {
            // Unpacked before a crash, not yet recorded.
            lock(&self.db).hydrated(&u.layer_id, 0, 0)?;
            return Ok(());
        }
        let size = blob.metadata()?.len();
        crate::failpoint::hit("hydrate:unpack");
        let work = store.new_tmp("hydrate")?;
        let result = self.leased(|lease| {
            let dir = work.join("layer");
            std::fs::create_dir_all(dir.join("fs"))?;
            let l = WireLayer { digest, size, media_type: media_type(compression).into(), compression, diff_id };
            let stats = match oci::unpack_layer(&layer_source(&blob, &l), &dir.join("fs")) {
                Ok(s) => s,
                Err(e) if e.is_io() => return Err(HydrateError::Unpack(Box::new(e))),
                Err(e) => {
                    let why = crate::error::chain(&e);
                    lock(&self.db).hydration_failed(&u.layer_id, &why)?;
                    return Err(HydrateError::Unpackable { layer: u.layer_id.to_string(), why });
                }
            };
            store.commit_layer(&dir, &u.layer_id, true, lease)?;
            // False if its snapshot was removed meanwhile: the layer is
            // then the collector's.
            lock(&self.db).hydrated(&u.layer_id, stats.bytes, stats.entries)?;
            tracing::info!("hydrated pulled layer {} ({} entries)", u.layer_id, stats.entries);
            Ok(())
        });
        let _ = crate::store::remove_tree(&work);
        result
    }

    /// Bring the layers of `snapshot`'s chain (`layers`, its image's
    /// included) that this host lacks from the fleet registry, where the
    /// snapshot is published. The error names the snapshot, the missing
    /// layers and the places tried; nothing partial stays.
    pub(crate) fn bring_layers(&self, snapshot: &str, layers: &[LayerId]) -> Result<(), HydrateError> {
        let store = &self.rt.store;
        let started = std::time::Instant::now();
        let present = |l: &LayerId| store.layer_dir(l.as_str()).join("fs").is_dir();
        if layers.iter().all(present) {
            return Ok(());
        }
        let _one = lock(&self.fleet_fetch);
        let missing: Vec<LayerId> = layers.iter().filter(|l| !present(l)).cloned().collect();
        if missing.is_empty() {
            return Ok(());
        }
        let place = lock(&self.db).snapshot_place(snapshot)?.unwrap_or_default();
        let mut tried = Vec::new();
        if let Some(h) = place.host.as_deref().filter(|h| *h != self.cfg.host_id) {
            let state = match lock(&self.db).host(h)? {
                Some(row) if !row.state.is_up() => format!("down: {}", row.state.why_not_up().unwrap_or_default()),
                Some(_) => "up".to_string(),
                None => "not in the catalog".to_string(),
            };
            tried.push(format!("host {h}, which made it ({state}; hosts never read each other's files)"));
        }
        let unavailable = |tried: Vec<String>| HydrateError::Unavailable {
            snapshot: snapshot.to_string(),
            layers: missing.iter().map(ToString::to_string).collect(),
            tried: tried.join("; "),
        };
        let Some(fleet) = &self.cfg.registry else {
            tried.push("no fleet registry on this host (--registry)".into());
            return Err(unavailable(tried));
        };
        let Some(reference) = place.published else {
            tried.push(format!(
                "registry {fleet}: not published there (a local snapshot: `strata snapshot promote {snapshot}` on {})",
                place.host.as_deref().unwrap_or("its host")
            ));
            return Err(unavailable(tried));
        };
        let mut wanted = Vec::new();
        for l in &missing {
            match lock(&self.db).layer_source(l.as_str())? {
                Some((blob, diff_id)) => wanted.push(Wanted { layer: l.clone(), blob, diff_id }),
                None => {
                    tried.push(format!("the catalog: layer {l} has no sealed blob recorded"));
                    return Err(unavailable(tried));
                }
            }
        }
        let catalog = started.elapsed();
        match self.fetch_layers_from(fleet, &reference, &wanted) {
            Ok(spent) => {
                let ms = |d: std::time::Duration| d.as_millis();
                tracing::info!(
                    "brought {} layer(s) of snapshot {snapshot} from {reference} ({} bytes; catalog {} ms, manifest {} \
                     ms, fetch {} ms, unpack {} ms, commit {} ms)",
                    wanted.len(),
                    spent.bytes,
                    ms(catalog),
                    ms(spent.manifest),
                    ms(spent.fetch),
                    ms(spent.unpack),
                    ms(spent.commit)
                );
                Ok(())
            }
            Err(e) => {
                tried.push(format!("registry {reference}: {}", crate::error::chain(&e)));
                Err(unavailable(tried))
            }
        }
    }

    /// Fetch, check and unpack every wanted layer under `tmp/`, then
    /// commit them all (and keep their blobs, for this host's own pushes).
    fn fetch_layers_from(
        &self,
        fleet: &FleetRegistry,
        reference: &str,
        wanted: &[Wanted],
    ) -> Result<Spent, TransferError> {
        let reference = Reference::parse(reference)?;
        let client = Client::new(&reference.registry, fleet.insecure, None);
        let store = &self.rt.store;
        let work = store.new_tmp("fleet").map_err(store_err)?;
        let result = self.leased(|lease| {
            let mut spent = Spent::default();
            let mut clock = std::time::Instant::now();
            let mut lap = |into: &mut std::time::Duration| {
                *into += clock.elapsed();
                clock = std::time::Instant::now();
            };
            let docs = self.fetch_documents(&client, &reference, &mut spent.bytes)?;
            lap(&mut spent.manifest);
            let mut ready = Vec::new();
            for (i, w) in wanted.iter().enumerate() {
                let Some(wire) = docs.layers.iter().find(|l| l.digest == w.blob) else {
                    return Err(invalid(format!("its manifest does not list blob {} (layer {})", w.blob, w.layer)));
                };
                // The catalog's diff_id, not the registry's, is what the
                // unpack checks the tar against.
                let wire = WireLayer { diff_id: w.diff_id.clone(), ..wire.clone() };
                let blob = work.join(w.blob.hex());
                if !blob.exists() {
                    let mut f =
                        std::io::BufWriter::with_capacity(1 << 20, std::fs::File::create(&blob).map_err(host_io)?);
                    client.get_blob(&reference.repository, &wire.digest, wire.size, &mut f, &mut |_| {})?;
                    std::io::Write::flush(&mut f).map_err(host_io)?;
                    spent.bytes += wire.size;
                }
                lap(&mut spent.fetch);
                let dir = work.join(format!("layer-{i}"));
                std::fs::create_dir_all(dir.join("fs")).map_err(host_io)?;
                crate::oci::unpack_layer(&layer_source(&blob, &wire), &dir.join("fs")).map_err(|source| {
                    TransferError::Layer {
                        digest: wire.digest.clone(),
                        registry: client.registry().to_string(),
                        source: Box::new(source),
                    }
                })?;
                lap(&mut spent.unpack);
                ready.push((w, dir, blob));
            }
            for (w, dir, blob) in &ready {
                lease.layer(w.layer.as_str());
                store.commit_layer(dir, w.layer.as_str(), true, lease).map_err(store_err)?;
                if blob.exists() {
                    store.adopt_blob(blob, w.blob.hex(), true, lease).map_err(store_err)?;
                }
            }
            lap(&mut spent.commit);
            Ok(spent)
        });
        let _ = crate::store::remove_tree(&work);
        result
    }
}
