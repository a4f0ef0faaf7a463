//! The host as a scheduler sees it: capacity (`GET /v1/info`), drain, and
//! its place in the fleet (`GET /v1/hosts`). A draining host starts no new
//! sandbox (create, resume, fork, a lineage's resume answer 409 with the
//! reason) while running ones go on (exec, checkpoint, suspend, rollback,
//! rm).
//!
//! Every daemon registers a row in the catalog (`catalog/hosts.rs`) under its
//! host id and heartbeats it on its own connection (so a long operation
//! holding the daemon's connection never makes it late). Each heartbeat
//! also marks other hosts past their deadline down and logs their
//! sandboxes as lost, and takes up a drain set from another host. On
//! PostgreSQL a host frozen inside a transaction would hold every host's
//! writes (the writer lock, `catalog/sql.rs`), heartbeats too: its session
//! ends after half of (deadline - heartbeat) idle inside one
//! ([`crate::catalog::Db::end_idle_transactions_after`], set by `open_catalog`).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use crate::catalog::{Db, DbError, HostRow};
use crate::daemon::{lock, memory_total, Daemon, SandboxOpError};
use crate::error::{Classify, ErrorKind};
use crate::types::{DrainRequest, HostEntry, HostInfo};

/// Why a host operation failed.
#[derive(Debug, thiserror::Error, displaydoc::Display)]
pub enum HostError {
    /// no host {0:?} in the catalog (`strata hosts` lists them)
    NotFound(String),
    /// {0}
    Db(#[from] DbError),
}

impl Classify for HostError {
    fn kind(&self) -> ErrorKind {
        match self {
            HostError::NotFound(_) => ErrorKind::NotFound,
            HostError::Db(e) => e.kind(),
        }
    }
}

/// A host id: 1-64 chars of `[A-Za-z0-9._-]`, not starting with `.` or `-`.
pub fn valid_host_id(id: &str) -> bool {
    crate::ids::valid_work_context(id)
}

/// This machine's id (`/etc/machine-id`), else its hostname.
pub fn machine_id() -> String {
    std::fs::read_to_string("/etc/machine-id")
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(hostname)
}

pub fn hostname() -> String {
    nix::unistd::gethostname().map(|h| h.to_string_lossy().into_owned()).unwrap_or_default()
}

fn entry(h: HostRow) -> HostEntry {
    let (state, reason) = match (h.state.why_not_up(), h.drain) {
        (Some(why), _) => ("down", Some(why.to_string())),
        (None, Some(why)) => ("draining", Some(why)),
        (None, None) => ("ready", None),
    };
    HostEntry {
        id: h.id,
        state: state.into(),
        reason,
        version: h.version,
        machine: h.machine,
        root: h.root,
        started_at_ms: h.started_at,
        heartbeat_at_ms: h.heartbeat_at,
        deadline_at_ms: h.deadline_at,
        sandboxes: h.sandboxes,
        capacity: serde_json::from_str(&h.info).ok(),
    }
}

impl Daemon {
    pub fn host_info(&self) -> Result<HostInfo, DbError> {
        let images = lock(&self.db).list_images()?;
        Ok(self.capacity(images.into_iter().map(|i| i.name.to_string()).collect()))
    }

    /// What `host_info` says, given the images the catalog lists.
    fn capacity(&self, images: Vec<String>) -> HostInfo {
        let (live, used, removing, waiting, draining) = {
            let pool = lock(&self.pool);
            let live: Vec<_> = pool.live.values().cloned().collect();
            (live, pool.used(), pool.removing.len(), pool.queue.len(), pool.draining.clone())
        };
        let memory_allocated = live.iter().filter_map(|s| s.limits().memory).sum();
        // A fold from 0.0: an empty float `sum` is -0.0, which JSON shows as such.
        let cpus_allocated = live.iter().filter_map(|s| s.limits().cpus).fold(0.0, |a, c| a + c);
        let memory_total = memory_total();
        let (store_used_bytes, store_free_bytes) = nix::sys::statvfs::statvfs(self.rt.store.root())
            .map(|v| {
                let f = v.fragment_size();
                ((v.blocks() - v.blocks_free()) * f, v.blocks_available() * f)
            })
            .unwrap_or((0, 0));
        let mut layers: Vec<String> = std::fs::read_dir(self.rt.store.layers_dir())
            .map(|rd| rd.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect())
            .unwrap_or_default();
        layers.sort();
        HostInfo {
            version: env!("CARGO_PKG_VERSION").into(),
            host_id: self.cfg.host_id.clone(),
            state: if draining.is_some() { "draining" } else { "ready" }.into(),
            draining_reason: draining,
            slots_used: used,
            slots_removing: removing,
            slots_max: self.max_sandboxes,
            slots_waiting: waiting,
            memory_allocated,
            memory_total,
            cpus_allocated,
            cpus_total: self.host_cpus,
            store_used_bytes,
            store_free_bytes,
            images,
            layers,
            ready: self.ready_counts().into_iter().collect(),
        }
    }

    /// Start draining (`Some`) or stop (`None`); launches waiting for a
    /// slot are refused too. Kept in the catalog (it outlives a restart).
    pub fn drain(&self, req: Option<DrainRequest>) -> Result<HostInfo, DbError> {
        let why = req.map(|r| r.reason.unwrap_or_else(|| "drained by request".into()));
        let serial = lock(&self.drain_lock);
        lock(&self.db).set_host_drain(&self.cfg.host_id, why.as_deref())?;
        let changed = lock(&self.pool).drain_by_request(why);
        drop(serial);
        self.drain_changed(changed);
        self.host_info()
    }

    /// Waiters for a slot look again: a drain refuses them.
    fn drain_changed(&self, changed: bool) {
        if changed {
            self.slots.notify_all();
        }
    }

    /// Every host in the catalog.
    pub fn hosts(&self) -> Result<Vec<HostEntry>, DbError> {
        Ok(lock(&self.db).list_hosts()?.into_iter().map(entry).collect())
    }

    pub fn host(&self, id: &str) -> Result<HostEntry, HostError> {
        lock(&self.db).host(id)?.map(entry).ok_or_else(|| HostError::NotFound(id.into()))
    }

    /// Drain host `id` (`Some`) or end its drain: this host at once,
    /// another at its next heartbeat.
    pub fn drain_host(&self, id: &str, req: Option<DrainRequest>) -> Result<HostEntry, HostError> {
        if id == self.cfg.host_id {
            self.drain(req)?;
            return self.host(id);
        }
        let why = req.map(|r| r.reason.unwrap_or_else(|| format!("drained by request through {}", self.cfg.host_id)));
        lock(&self.db).set_host_drain(id, why.as_deref())?.map(entry).ok_or_else(|| HostError::NotFound(id.into()))
    }

    /// Heartbeat every `--heartbeat` on a thread of its own (joined at
    /// shutdown, before the row says the host stopped).
    pub fn start_heartbeat(self: &Arc<Self>) {
        let d = self.clone();
        let spawned = super::background("heartbeat", "this host is marked down once its deadline passes", move || {
            let db = match crate::daemon::open_catalog(&d.cfg) {
                Ok(db) => db.for_host(&d.cfg.host_id),
                Err(e) => {
                    tracing::error!("heartbeat connection: {}", crate::error::chain(&e));
                    return;
                }
            };
            loop {
                d.beat(&db);
                if d.sleep_unless_stopping(d.cfg.heartbeat) {
                    return;
                }
            }
        });
        *lock(&self.heartbeat) = spawned;
    }

    /// One heartbeat: renew this host's row, take up its drain, and mark
    /// hosts past their deadline down.
    fn beat(self: &Arc<Self>, db: &Db) {
        let images = match db.list_images() {
            Ok(i) => i.into_iter().map(|i| i.name.to_string()).collect(),
            Err(e) => {
                tracing::warn!("heartbeat: {}", crate::error::chain(&e));
                Vec::new()
            }
        };
        let info = serde_json::to_string(&self.capacity(images)).unwrap_or_else(|_| "{}".into());
        let seen = lock(&self.pool).drain_changes;
        match db.heartbeat(&info, self.cfg.host_deadline.as_millis() as i64) {
            Ok(beat) => {
                if let crate::catalog::HostState::Down(why) = beat.was {
                    tracing::warn!(
                        "this host had been marked down ({why}); it is up again (its sandboxes' checkpoints are \
                         fenced where their lineages moved on meanwhile)"
                    );
                }
                let changed = lock(&self.pool).drain_from_catalog(beat.drain, seen);
                self.drain_changed(changed);
            }
            Err(e) => tracing::error!("heartbeat: {}", crate::error::chain(&e)),
        }
        self.remove_stopped(db);
        match db.mark_hosts_down() {
            Ok(down) => {
                for h in down {
                    tracing::warn!(
                        "host {} is down: no heartbeat since {} (unix ms); its sandboxes are lost: [{}]",
                        h.id,
                        h.heartbeat_at,
                        h.sandboxes.join(", ")
                    );
                }
            }
            Err(e) => tracing::error!("mark hosts down: {}", crate::error::chain(&e)),
        }
    }

    /// Remove the sandboxes running here whose rows another host marked
    /// stopped while this one was down ([`Db::stop_lost_sandbox`]: an E2B
    /// kill). Looked at on every heartbeat, not only the first after being
    /// down, so that a mark written as this host came back is seen too;
    /// this host's own removals in progress (their rows stopped while they
    /// run) are passed over. On a thread of its own: a removal may wait for
    /// a pause to finish, and the heartbeat must not.
    fn remove_stopped(self: &Arc<Self>, db: &Db) {
        let ids = match db.stopped_sandboxes() {
            Ok(ids) => ids,
            Err(e) => return tracing::warn!("heartbeat: {}", crate::error::chain(&e)),
        };
        let ids: Vec<_> = {
            let pool = lock(&self.pool);
            ids.into_iter().filter(|id| pool.live.contains_key(id)).collect()
        };
        if ids.is_empty() || self.removing_stopped.swap(true, Ordering::AcqRel) {
            return;
        }
        let d = self.clone();
        let spawned = super::background("remove-stopped", "the next heartbeat tries again", move || {
            for id in ids {
                match d.remove_sandbox(id.as_str()) {
                    Ok(()) => tracing::warn!("removed sandbox {id}: another host removed it while this host was down"),
                    Err(SandboxOpError::NotFound(_) | SandboxOpError::BeingRemoved(_)) => {}
                    Err(e) => {
                        tracing::warn!("remove sandbox {id} (stopped by another host): {}", crate::error::chain(&e))
                    }
                }
            }
            d.removing_stopped.store(false, Ordering::Release);
        });
        if spawned.is_none() {
            self.removing_stopped.store(false, Ordering::Release);
        }
    }

    /// Sleep `d`, waking early when the daemon stops: whether it stops.
    fn sleep_unless_stopping(&self, d: Duration) -> bool {
        let end = std::time::Instant::now() + d;
        loop {
            if self.stopping.load(std::sync::atomic::Ordering::Acquire) {
                return true;
            }
            let left = end.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return false;
            }
            std::thread::sleep(left.min(Duration::from_millis(50)));
        }
    }
}

impl super::Pool {
    /// A drain (`Some`) or its end asked of this daemon, already written
    /// to the catalog. Says whether it changed anything.
    fn drain_by_request(&mut self, why: Option<String>) -> bool {
        self.drain_changes += 1;
        self.set_drain(why)
    }

    /// The catalog's drain as a heartbeat read it, the heartbeat having
    /// begun when `drain_changes` was `seen`. If this daemon's drain
    /// changed since, the value read may be older than that change (the
    /// heartbeat's read, then the request's write and its taking effect,
    /// then this): left to the next heartbeat.
    fn drain_from_catalog(&mut self, why: Option<String>, seen: u64) -> bool {
        self.drain_changes == seen && self.set_drain(why)
    }

    fn set_drain(&mut self, why: Option<String>) -> bool {
        if self.draining == why {
            return false;
        }
        match &why {
            Some(why) => tracing::info!("draining: {why}"),
            None => tracing::info!("drain ended: ready"),
        }
        self.draining = why;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::super::Pool;

    #[test]
    fn a_heartbeat_that_read_before_a_drain_does_not_undo_it() {
        let mut pool = Pool::default();
        // The heartbeat begins and reads "not drained"; meanwhile a drain
        // is written and taken up; then the heartbeat's value arrives.
        let seen = pool.drain_changes;
        assert!(pool.drain_by_request(Some("upgrade".into())));
        assert!(!pool.drain_from_catalog(None, seen));
        assert_eq!(pool.draining.as_deref(), Some("upgrade"));
        // The same for the drain's end.
        let seen = pool.drain_changes;
        assert!(pool.drain_by_request(None));
        assert!(!pool.drain_from_catalog(Some("upgrade".into()), seen));
        assert_eq!(pool.draining, None);
        // A heartbeat with nothing in between takes up what it read (a
        // drain asked through another host).
        let seen = pool.drain_changes;
        assert!(pool.drain_from_catalog(Some("through b".into()), seen));
        assert_eq!(pool.draining.as_deref(), Some("through b"));
        assert!(!pool.drain_from_catalog(Some("through b".into()), seen));
    }
}
