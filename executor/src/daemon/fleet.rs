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

use crate::catalog::{DbError, HostState};
use crate::daemon::{lock, Daemon};
use crate::error::{Classify, ErrorKind};
use crate::model::SnapshotType;
use crate::registry::Client;
use crate::types::{RegistryRequest, SnapshotInfo};

/// Each up host and the layers its last heartbeat listed.
pub(crate) type HostLayers = Vec<(String, std::collections::HashSet<String>)>;

/// Why a snapshot could not be published or brought to this host.
#[derive(Debug, thiserror::Error, displaydoc::Display)]
pub enum FleetError {
    /// no fleet registry: start the daemon with --registry HOST:PORT/REPOSITORY
    NoRegistry,
    /// async applies to distributed snapshots only
    AsyncLocal,
    /// snapshot {snapshot} was made ({kind}) but not published to {registry}: {why}; `strata snapshot promote {snapshot}` retries
    Publish { snapshot: String, kind: &'static str, registry: String, why: String },
    /// {0}
    Lookup(#[from] Box<crate::daemon::lookup::SnapshotLookupError>),
    /// {0}
    Db(#[from] DbError),
}

impl Classify for FleetError {
    fn kind(&self) -> ErrorKind {
        match self {
            FleetError::NoRegistry => ErrorKind::Conflict,
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
        let spawned = super::background(
            "publisher",
            "snapshots are not published in the background, nor manifests deleted",
            move || {
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
            },
        );
        if spawned.is_some() {
            *lock(&self.publisher) = Some(tx);
        }
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
    pub fn sandbox_placement(&self, id: &str) -> Result<Option<(String, HostState)>, DbError> {
        let place = lock(&self.db).sandbox_place(id)?;
        let Some((Some(host), state)) = place else { return Ok(None) };
        if host == self.cfg.host_id || state == crate::catalog::SandboxState::Stopped {
            return Ok(None);
        }
        // A host with no row (removed meanwhile) is taken as up: ask it.
        let state = lock(&self.db).host(&host)?.map_or(HostState::Up, |h| h.state);
        Ok(Some((host, state)))
    }

    /// Forget sandbox `id`, which runs on a host the catalog has down and
    /// not because it stopped (lost to the fleet): its row is marked
    /// stopped, which that host carries out once back (at its start, or
    /// its next heartbeat if it never stopped: [`Db::stop_lost_sandbox`]).
    /// `Some((host, why it is down))` when marked; `None`, and nothing
    /// changed, for any other sandbox (this host's, one whose host is up
    /// or stopped, or came back meanwhile, or no such row).
    pub fn stop_lost_sandbox(&self, id: &str) -> Result<Option<(String, String)>, DbError> {
        let Some((host, HostState::Down(why))) = self.sandbox_placement(id)? else { return Ok(None) };
        if !lock(&self.db).stop_lost_sandbox(id, &host)? {
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
}
