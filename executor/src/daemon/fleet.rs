//! Snapshots across a fleet. A `local` snapshot stays on the host that
//! made it; a `distributed` one is also published to the fleet registry
//! (`--registry HOST:PORT/REPOSITORY`), tagged by its id, as `snapshot push`
//! sends it (its image's layers and its chain, blobs as sealed, never
//! recaptured). `checkpoint --type distributed` publishes at once, `snapshot
//! promote` later; with a fleet registry a suspend is distributed (released
//! work must outlive its host).
//!
//! A host asked to launch from a snapshot whose layers it lacks brings them
//! from the registry ([`Daemon::bring_layers`]): the catalog says which blob
//! (digest) and which tar (diff_id) each layer is, the published manifest
//! only how big each blob is. Every blob is fetched and checked against
//! both, and unpacked, before any layer is committed: all or nothing. A
//! host never reads another host's files. One fetch runs at a time on a
//! host; a launch that waited for it finds its layers there.

use crate::catalog::DbError;
use crate::daemon::distribution::{self, TransferError};
use crate::daemon::{lock, Daemon};
use crate::error::{Classify, ErrorKind};
use crate::ids::LayerId;
use crate::model::SnapshotType;
use crate::registry::{Client, Reference};
use crate::types::{RegistryRequest, SnapshotInfo};

/// Each up host and the layers its last heartbeat listed.
pub(crate) type HostLayers = Vec<(String, std::collections::HashSet<String>)>;

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

/// Why a snapshot could not be published or brought to this host.
#[derive(Debug, thiserror::Error, displaydoc::Display)]
pub enum FleetError {
    /// no fleet registry: start the daemon with --registry HOST:PORT/REPOSITORY
    NoRegistry,
    /// async applies to distributed snapshots only
    AsyncLocal,
    /// snapshot {snapshot} was made ({kind}) but not published to {registry}: {why}; `strata snapshot promote {snapshot}` retries
    Publish { snapshot: String, kind: &'static str, registry: String, why: String },
    /// snapshot {snapshot} cannot be brought to this host: its layers {layers:?} are not here; tried: {tried}
    Unavailable { snapshot: String, layers: Vec<String>, tried: String },
    /// {0}
    Lookup(#[from] Box<crate::daemon::snapshots::SnapshotLookupError>),
    /// {0}
    Db(#[from] DbError),
}

impl Classify for FleetError {
    fn kind(&self) -> ErrorKind {
        match self {
            FleetError::NoRegistry | FleetError::Unavailable { .. } => ErrorKind::Conflict,
            FleetError::AsyncLocal => ErrorKind::InvalidArgument,
            FleetError::Publish { .. } => ErrorKind::Upstream,
            FleetError::Lookup(e) => e.kind(),
            FleetError::Db(e) => e.kind(),
        }
    }
}

/// What the publisher thread does to the fleet registry.
pub(crate) enum PublisherJob {
    /// Publish this snapshot (`async`).
    Publish(String),
    /// Delete the manifests queued in the catalog that are due.
    Unpublish,
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
    /// Publish snapshot `id` to the fleet registry (its blobs as sealed:
    /// a suspend's is waited for); nothing is sent twice.
    pub fn promote(&self, id: &str) -> Result<SnapshotInfo, FleetError> {
        let fleet = self.cfg.registry.as_ref().ok_or(FleetError::NoRegistry)?;
        let row = self.snapshot_row(id).map_err(Box::new)?;
        // A failed background publication is forgotten once retried.
        {
            let mut publishing = lock(&self.publishing);
            if matches!(publishing.get(row.id.as_str()), Some(Some(_))) {
                publishing.remove(row.id.as_str());
            }
        }
        let reference = fleet.reference(row.id.as_str());
        if lock(&self.db).snapshot_place(row.id.as_str())?.is_some_and(|p| p.published.as_deref() == Some(&reference)) {
            return self.get_snapshot(id).map_err(|e| FleetError::Lookup(Box::new(e)));
        }
        let req = RegistryRequest {
            reference: reference.clone(),
            insecure: fleet.insecure,
            username: None,
            password: None,
            name: None,
            progress: false,
        };
        self.push_snapshot(row.id.as_str(), &req, &mut |_| {}).map_err(|e| FleetError::Publish {
            snapshot: row.id.to_string(),
            kind: "local",
            registry: fleet.to_string(),
            why: crate::error::chain(&e),
        })?;
        lock(&self.db).set_published(row.id.as_str(), &reference)?;
        tracing::info!("published snapshot {} to {reference}", row.id);
        self.get_snapshot(id).map_err(|e| FleetError::Lookup(Box::new(e)))
    }

    /// Refuse what cannot be published up front, before anything is
    /// captured: a distributed snapshot with no fleet registry, an async
    /// local one.
    pub fn can_publish(&self, kind: SnapshotType, background: bool) -> Result<(), FleetError> {
        match (kind, &self.cfg.registry) {
            (SnapshotType::Local, _) if background => Err(FleetError::AsyncLocal),
            (SnapshotType::Distributed, None) => Err(FleetError::NoRegistry),
            _ => Ok(()),
        }
    }

    /// A snapshot just made: published too when `kind` is distributed, now
    /// (if that fails, the error says it stays local) or, `background`, by
    /// the publisher thread.
    pub fn publish_made(
        &self,
        snap: SnapshotInfo,
        kind: SnapshotType,
        background: bool,
    ) -> Result<SnapshotInfo, FleetError> {
        match (kind, background) {
            (SnapshotType::Local, _) => Ok(snap),
            (SnapshotType::Distributed, false) => self.promote(snap.id.as_str()),
            (SnapshotType::Distributed, true) => {
                lock(&self.publishing).insert(snap.id.to_string(), None);
                match lock(&self.publisher).as_ref() {
                    Some(tx) if tx.send(PublisherJob::Publish(snap.id.to_string())).is_ok() => {}
                    _ => {
                        lock(&self.publishing).remove(snap.id.as_str());
                        return self.promote(snap.id.as_str());
                    }
                }
                self.get_snapshot(snap.id.as_str()).map_err(|e| FleetError::Lookup(Box::new(e)))
            }
        }
    }

    /// The thread that publishes `async` snapshots, one at a time, and
    /// deletes removed snapshots' manifests ([`Daemon::delete_manifests`]:
    /// at its start, when a removal queues one, and every heartbeat
    /// interval for those tried and failed). A publication a stop cuts
    /// short is not retried: the snapshot stays local (`promote`
    /// publishes it); a deletion is (it is in the catalog).
    pub fn start_publisher(self: &std::sync::Arc<Self>) {
        let (tx, rx) = std::sync::mpsc::channel::<PublisherJob>();
        let d = self.clone();
        let spawned = std::thread::Builder::new().name("publisher".into()).spawn(move || {
            d.delete_manifests();
            let mut swept = std::time::Instant::now();
            loop {
                let job = rx.recv_timeout(d.cfg.heartbeat);
                // Failed deletes are tried again however many publications come.
                if matches!(job, Ok(PublisherJob::Unpublish) | Err(_)) || swept.elapsed() >= d.cfg.heartbeat {
                    d.delete_manifests();
                    swept = std::time::Instant::now();
                }
                let id = match job {
                    Ok(PublisherJob::Publish(id)) => id,
                    Ok(PublisherJob::Unpublish) | Err(std::sync::mpsc::RecvTimeoutError::Timeout) => continue,
                    Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break,
                };
                let outcome = d.promote(&id).err().map(|e| crate::error::chain(&e));
                if let Some(why) = &outcome {
                    tracing::warn!("publish snapshot {id}: {why}");
                }
                let mut publishing = lock(&d.publishing);
                match outcome {
                    None => publishing.remove(&id),
                    Some(why) => publishing.insert(id, Some(why)),
                };
            }
        });
        match spawned {
            Ok(_) => *lock(&self.publisher) = Some(tx),
            Err(e) => tracing::error!("start the publisher: {e}"),
        }
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
                .filter(|h| h.down.is_none())
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

    /// Publish a suspend the daemon made by itself (a deadline's, an idle
    /// timeout's, an E2B pause) as [`Daemon::suspend_type`] says; if that
    /// fails the suspend stands and the snapshot stays local, with a
    /// warning (`POST .../suspend` answers the error instead).
    pub fn publish_suspend(&self, snap: SnapshotInfo) {
        let id = snap.id.clone();
        if let Err(e) = self.publish_made(snap, self.suspend_type(), false) {
            tracing::warn!("suspend {id}: stays on this host, not published: {}", crate::error::chain(&e));
        }
    }

    /// A removed snapshot's manifest is queued for deletion (in the
    /// catalog, with the removal): the publisher thread deletes it now.
    /// Without a publisher (a start finishing removals) it waits for the
    /// publisher's start.
    pub(crate) fn unpublish(&self) {
        if let Some(tx) = lock(&self.publisher).as_ref() {
            let _ = tx.send(PublisherJob::Unpublish);
        }
    }

    /// Delete the manifests of removed snapshots queued in the catalog
    /// (`catalog/manifests.rs`) that are due and in this host's fleet registry
    /// (a host of another registry does those). Each is deleted by digest,
    /// which removes every tag of it in the repository; its blobs stay for
    /// the registry's own garbage collection (the manifests of its parents
    /// list most of them). A failure is logged and tried again after a
    /// wait that doubles each time (from twice the heartbeat, at most 10
    /// minutes), counted from the failure; it ends the pass (the others
    /// are the same registry's: tried at the next). The snapshot's removal
    /// stands either way.
    fn delete_manifests(&self) {
        let Some(fleet) = self.cfg.registry.as_ref() else { return };
        let due = match lock(&self.db).due_manifest_deletes(&fleet.reference("")) {
            Ok(due) => due,
            Err(e) => return tracing::warn!("manifests to delete: {}", crate::error::chain(&e)),
        };
        let client = Client::new(&fleet.registry, fleet.insecure, None);
        for m in due {
            let wait = (self.cfg.heartbeat.saturating_mul(2u32.pow(m.attempts.clamp(0, 20) as u32 + 1)))
                .min(std::time::Duration::from_secs(600));
            let next_at = || crate::catalog::now_ms() + wait.as_millis() as i64;
            match lock(&self.db).claim_manifest_delete(&m, next_at()) {
                Ok(true) => {}
                Ok(false) => continue,
                Err(e) => return tracing::warn!("manifests to delete: {}", crate::error::chain(&e)),
            }
            let (id, reference) = (&m.snapshot, &m.reference);
            let tag = reference.rsplit_once(':').map_or(id.as_str(), |(_, tag)| tag);
            let done = match client.delete_manifest(&fleet.repository, tag) {
                Ok(deleted) => {
                    if deleted {
                        tracing::info!("snapshot {id} removed; its manifest {reference} deleted");
                    }
                    lock(&self.db).manifest_deleted(reference)
                }
                Err(e) => {
                    let why = crate::error::chain(&e);
                    tracing::warn!(
                        "snapshot {id} removed; deleting its manifest {reference} failed (attempt {}; again in {} s): \
                         {why}",
                        m.attempts + 1,
                        wait.as_secs()
                    );
                    if let Err(e) = lock(&self.db).manifest_delete_failed(reference, &why, next_at()) {
                        tracing::warn!("manifest {reference}: {}", crate::error::chain(&e));
                    }
                    return;
                }
            };
            if let Err(e) = done {
                tracing::warn!("manifest {reference}: {}", crate::error::chain(&e));
            }
        }
    }

    /// Where another host of the fleet runs sandbox `id`, as the catalog
    /// says (`None`: no row, or this host's).
    pub fn sandbox_elsewhere(&self, id: &str) -> Result<Option<String>, DbError> {
        let place = lock(&self.db).sandbox_place(id)?;
        Ok(place.and_then(|(host, _)| host).filter(|h| *h != self.cfg.host_id))
    }

    /// As [`Daemon::sandbox_elsewhere`], with why that host is down if the
    /// catalog says it is; `None` too for a row marked stopped there (a
    /// sandbox killed while its host was down: gone, to the fleet).
    pub fn sandbox_placement(&self, id: &str) -> Result<Option<(String, Option<String>)>, DbError> {
        let place = lock(&self.db).sandbox_place(id)?;
        let Some((Some(host), state)) = place else { return Ok(None) };
        if host == self.cfg.host_id || state == crate::catalog::SandboxState::Stopped {
            return Ok(None);
        }
        let down = lock(&self.db).host(&host)?.and_then(|h| h.down);
        Ok(Some((host, down)))
    }

    /// Forget sandbox `id`, which runs on a host the catalog has down and
    /// not because it stopped (lost to the fleet): its row is marked
    /// stopped, which that host carries out once back (at its start, or
    /// its next heartbeat if it never stopped: [`Db::stop_lost_sandbox`]).
    /// `Some((host, why it is down))` when marked; `None`, and nothing
    /// changed, for any other sandbox (this host's, one whose host is up
    /// or stopped, or came back meanwhile, or no such row).
    pub fn stop_lost_sandbox(&self, id: &str) -> Result<Option<(String, String)>, DbError> {
        let Some((host, Some(why))) = self.sandbox_placement(id)? else { return Ok(None) };
        if why == "stopped" || !lock(&self.db).stop_lost_sandbox(id, &host)? {
            return Ok(None);
        }
        tracing::warn!("sandbox {id} removed while its host {host} is down ({why}); that host removes it when back");
        Ok(Some((host, why)))
    }

    /// What a suspend makes: distributed whenever there is a fleet
    /// registry (released work must outlive its host).
    pub fn suspend_type(&self) -> SnapshotType {
        if self.cfg.registry.is_some() {
            SnapshotType::Distributed
        } else {
            SnapshotType::Local
        }
    }

    /// Bring the layers of `snapshot`'s chain (`layers`, its image's
    /// included) that this host lacks from the fleet registry, where the
    /// snapshot is published. The error names the snapshot, the missing
    /// layers and the places tried; nothing partial stays.
    pub(crate) fn bring_layers(&self, snapshot: &str, layers: &[LayerId]) -> Result<(), FleetError> {
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
                Some(row) if row.down.is_some() => format!("down: {}", row.down.unwrap_or_default()),
                Some(_) => "up".to_string(),
                None => "not in the catalog".to_string(),
            };
            tried.push(format!("host {h}, which made it ({state}; hosts never read each other's files)"));
        }
        let unavailable = |tried: Vec<String>| FleetError::Unavailable {
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
        let work = store.new_tmp("fleet").map_err(distribution::store_err)?;
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
                    return Err(distribution::invalid(format!(
                        "its manifest does not list blob {} (layer {})",
                        w.blob, w.layer
                    )));
                };
                // The catalog's diff_id, not the registry's, is what the
                // unpack checks the tar against.
                let wire = distribution::WireLayer { diff_id: w.diff_id.clone(), ..wire.clone() };
                let blob = work.join(w.blob.hex());
                if !blob.exists() {
                    let mut f = std::io::BufWriter::with_capacity(
                        1 << 20,
                        std::fs::File::create(&blob).map_err(distribution::host_io)?,
                    );
                    client.get_blob(&reference.repository, &wire.digest, wire.size, &mut f, &mut |_| {})?;
                    std::io::Write::flush(&mut f).map_err(distribution::host_io)?;
                    spent.bytes += wire.size;
                }
                lap(&mut spent.fetch);
                let dir = work.join(format!("layer-{i}"));
                std::fs::create_dir_all(dir.join("fs")).map_err(distribution::host_io)?;
                crate::oci::unpack_layer(&distribution::layer_source(&blob, &wire), &dir.join("fs")).map_err(
                    |source| TransferError::Layer {
                        digest: wire.digest.clone(),
                        registry: client.registry().to_string(),
                        source: Box::new(source),
                    },
                )?;
                lap(&mut spent.unpack);
                ready.push((w, dir, blob));
            }
            for (w, dir, blob) in &ready {
                lease.layer(w.layer.as_str());
                store.commit_layer(dir, w.layer.as_str(), true, lease).map_err(distribution::store_err)?;
                if blob.exists() {
                    store.adopt_blob(blob, w.blob.hex(), true, lease).map_err(distribution::store_err)?;
                }
            }
            lap(&mut spent.commit);
            Ok(spent)
        });
        let _ = crate::store::remove_tree(&work);
        result
    }
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
