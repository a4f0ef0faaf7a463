//! Ready pools (`--pool IMAGE=N`): N sandboxes of an image kept fully
//! started in the background (shim, namespaces, cgroup, overlay mounted,
//! root pivoted, nothing run), so that a create of that image only applies
//! its limits and env, records the sandbox and answers: none of the clone,
//! mount and pivot is on the request path.
//!
//! What a ready sandbox cannot take (such a create starts a fresh one, with
//! the same result): a hostname (set in its UTS namespace at start), scratch
//! or cache mounts (mounted at start), `--disk` and `--userns` (they shape
//! the root), a chosen id, `seccomp: unconfined` (installed at start), and
//! a baseline (another chain). Its hostname is its id's first 12
//! characters, as a fresh create's is.
//!
//! Refilling never competes with a request: the refill thread (nice 19)
//! starts a sandbox only when no API request has been in flight for
//! [`QUIET`]. Ready sandboxes have no database row: a daemon that stops
//! removes them, and one killed leaves them to the next start's sweep.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use crate::daemon::{lock, Daemon, LaunchError, LaunchSpec};
use crate::ids::{ImageName, SandboxId};
use crate::model::Rung;
use crate::sandbox::Sandbox;
use crate::spec::{Restored, SandboxSpec};

/// How long no request may have been in flight before a refill starts.
const QUIET: Duration = Duration::from_millis(20);

#[derive(Default)]
pub(crate) struct ReadyPools {
    /// Ready sandboxes by image.
    ready: Mutex<HashMap<ImageName, Vec<Sandbox>>>,
    wake: Condvar,
    stop: AtomicBool,
    /// API requests being served now (see [`Daemon::request_started`]).
    in_flight: AtomicUsize,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

/// An API request in flight, until dropped.
pub struct InFlight<'a>(&'a ReadyPools);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

impl LaunchSpec {
    /// Whether a ready sandbox can serve it (see the module's comment).
    fn fits_ready(&self) -> bool {
        self.id.is_none()
            && self.hostname.is_none()
            && self.mounts.is_empty()
            && !self.seccomp_unconfined
            && self.userns != Some(true)
            && self.limits.disk.is_none()
            && self.netns.is_none()
            && self.root_dir.is_none()
            // A ready sandbox was set up without a network (its
            // resolv.conf is bound at setup).
            && self.network.as_ref().is_none_or(|n| n.mode == crate::net::NetworkMode::None)
    }
}

impl Daemon {
    /// Count an API request in flight (refills wait for none).
    pub fn request_started(&self) -> InFlight<'_> {
        self.ready.in_flight.fetch_add(1, Ordering::AcqRel);
        InFlight(&self.ready)
    }

    /// How many sandboxes are ready now, by image.
    pub fn ready_counts(&self) -> HashMap<String, usize> {
        lock(&self.ready.ready).iter().map(|(k, v)| (k.to_string(), v.len())).collect()
    }

    /// Start the refill thread for `cfg.pools`.
    pub fn start_ready_pools(self: &Arc<Self>) {
        if self.cfg.pools.is_empty() {
            return;
        }
        let d = self.clone();
        let spawned = super::background("ready-pools", "the ready pools stay empty", move || {
            let _ = strata_shim::sys::set_thread_nice(19);
            let mut failed_at: HashMap<ImageName, std::time::Instant> = HashMap::new();
            loop {
                // The first image below its target (skipping one that
                // failed in the last second).
                let next = {
                    let mut ready = lock(&d.ready.ready);
                    loop {
                        if d.ready.stop.load(Ordering::Acquire) {
                            return;
                        }
                        // A draining host starts nothing, ready sandboxes
                        // included.
                        let draining = lock(&d.pool).draining.is_some();
                        let short = d.cfg.pools.iter().filter(|_| !draining).find(|(name, n)| {
                            ready.get(name).map_or(0, Vec::len) < *n
                                && failed_at.get(name).is_none_or(|t| t.elapsed() > Duration::from_secs(1))
                        });
                        if let Some((name, _)) = short {
                            break name.clone();
                        }
                        ready = d
                            .ready
                            .wake
                            .wait_timeout(ready, Duration::from_secs(1))
                            .map(|(g, _)| g)
                            .unwrap_or_else(|p| p.into_inner().0);
                    }
                };
                // Never beside a request: wait for a quiet moment.
                let mut quiet_since = std::time::Instant::now();
                while quiet_since.elapsed() < QUIET {
                    if d.ready.stop.load(Ordering::Acquire) {
                        return;
                    }
                    if d.ready.in_flight.load(Ordering::Acquire) > 0 {
                        quiet_since = std::time::Instant::now();
                    }
                    std::thread::sleep(Duration::from_millis(2));
                }
                if let Err(e) = d.refill(&next) {
                    tracing::warn!("ready pool {next}: {}", crate::error::chain(&e));
                    failed_at.insert(next, std::time::Instant::now());
                }
            }
        });
        *lock(&self.ready.thread) = spawned;
    }

    /// Add one sandbox to `name`'s pool. Its layers are leased while it
    /// starts (the collector skips only the layers of sandboxes in the
    /// pool); once in the pool, `image rm` removes it before it collects.
    /// An image removed (or imported again with other layers) meanwhile
    /// is seen after it is added: `image rm` drops the pool's sandboxes
    /// after its row goes, so a sandbox added before that check is
    /// dropped by one of the two, and none is kept for a gone image.
    fn refill(&self, name: &ImageName) -> Result<(), LaunchError> {
        self.leased(|lease| {
            let image = lock(&self.db).image_by_name(name)?.ok_or(LaunchError::NoImageRow)?;
            for l in &image.layers {
                lease.layer(l.as_str());
            }
            let sb = self.ready_sandbox(&image)?;
            crate::failpoint::hit("ready:started");
            let id = sb.id.clone();
            {
                let mut ready = lock(&self.ready.ready);
                // Stopping or draining since the refill began: not added.
                if self.ready.stop.load(Ordering::Acquire) || lock(&self.pool).draining.is_some() {
                    drop(ready);
                    discard(self, &sb);
                    return Ok(());
                }
                ready.entry(name.clone()).or_default().push(sb);
            }
            // Not known to be the same image still (a catalog error counts
            // as no): taken out again, unless a create took it meanwhile
            // (as any create may race an `image rm`).
            let now = lock(&self.db).image_by_name(name);
            if !matches!(now, Ok(Some(ref now)) if now.layers == image.layers) {
                let taken = {
                    let mut ready = lock(&self.ready.ready);
                    let list = ready.get_mut(name);
                    list.and_then(|l| l.iter().position(|s| s.id == id).map(|i| l.swap_remove(i)))
                };
                if let Some(sb) = taken {
                    discard(self, &sb);
                    tracing::info!("ready pool {name}: the image was removed as a sandbox started for it; not kept");
                }
                now?;
            }
            Ok(())
        })
    }

    /// Start one sandbox of `image` for its pool: default limits, no env,
    /// no lineage; no row.
    fn ready_sandbox(&self, image: &crate::catalog::ImageRow) -> Result<Sandbox, LaunchError> {
        let id = SandboxId::random();
        let spec = SandboxSpec {
            image: image.name.clone(),
            layers: image.layers.clone(),
            snapshot: None,
            work_context: None,
            observed_head: None,
            restored: Some(Restored { rung: Rung::Image, snapshot: None }),
            limits: self.cfg.limit_policy.settle(Default::default())?,
            env: Vec::new(),
            hostname: id.as_str()[..12].to_string(),
            cgroup: self.rt.cgroup_path(&id),
            mounts: Vec::new(),
            seccomp_unconfined: false,
            userns: None,
            lifetime: Default::default(),
            log_from: 0,
            network: Default::default(),
            netns: None,
            root_dir: None,
            secret_names: Vec::new(),
        };
        let defaults = self.exec_defaults(image, &spec, &[])?;
        Ok(crate::sandbox::create(&self.rt, &id, &spec, defaults)?)
    }

    /// A ready sandbox of `image` for `launch`, if one fits; the refill
    /// thread is woken to replace it.
    pub(crate) fn take_ready(&self, image: &ImageName, launch: &LaunchSpec) -> Option<Sandbox> {
        if !launch.fits_ready() {
            return None;
        }
        let mut ready = lock(&self.ready.ready);
        let list = ready.get_mut(image)?;
        loop {
            let sb = list.pop()?;
            self.ready.wake.notify_one();
            if sb.is_alive() {
                return Some(sb);
            }
            tracing::warn!("ready pool: sandbox {} is gone; not used", sb.id);
            discard(self, &sb);
        }
    }

    /// Remove the ready sandboxes of `image` (it is being removed), or of
    /// every image (`None`: the daemon stops).
    pub(crate) fn drop_ready(&self, image: Option<&ImageName>) {
        if image.is_none() {
            {
                let _ready = lock(&self.ready.ready);
                self.ready.stop.store(true, Ordering::Release);
            }
            self.ready.wake.notify_all();
            if let Some(h) = lock(&self.ready.thread).take() {
                let _ = h.join();
            }
        }
        let gone: Vec<Sandbox> = {
            let mut ready = lock(&self.ready.ready);
            match image {
                Some(i) => ready.remove(i).unwrap_or_default(),
                None => ready.drain().flat_map(|(_, v)| v).collect(),
            }
        };
        for sb in gone {
            discard(self, &sb);
        }
    }

    /// Whether a launch on `base` can take a ready sandbox (the image's
    /// own chain), and if one is there, that one.
    pub(crate) fn take_ready_for(&self, base: &crate::daemon::Base, launch: &LaunchSpec) -> Option<Sandbox> {
        if base.snapshot.is_some() || base.layers != base.image.layers || self.cfg.pools.is_empty() {
            return None;
        }
        let sb = self.take_ready(&base.image.name.parse().ok()?, launch)?;
        // An image removed and imported again under its name: the old
        // one's sandbox is not this image's.
        if sb.spec.layers != base.layers {
            discard(self, &sb);
            return None;
        }
        Some(sb)
    }

    /// Make a ready sandbox the one `launch` asked for: its limits, env,
    /// lineage and lifetime, then its row.
    pub(crate) fn claim_ready(
        &self,
        mut sb: Sandbox,
        base: &crate::daemon::Base,
        launch: LaunchSpec,
    ) -> Result<Arc<Sandbox>, LaunchError> {
        let mut spec = sb.spec.clone();
        spec.limits = launch.limits;
        spec.env = launch.env;
        spec.work_context = Some(base.work_context.clone());
        spec.observed_head = base.observed_head.clone();
        spec.restored = Some(Restored { rung: base.rung, snapshot: None });
        spec.lifetime = launch.lifetime;
        let claimed = self.secrets_for(&base.work_context, &launch.secret_env).and_then(|secrets| {
            spec.secret_names = super::secrets::names(&secrets);
            self.exec_defaults(&base.image, &spec, &secrets)
        });
        let claimed = claimed.and_then(|defaults| sb.claim(spec, defaults).map_err(LaunchError::from));
        if let Err(e) = claimed {
            discard(self, &sb);
            return Err(e);
        }
        let start = crate::sandbox::process_start_time(sb.shim_pid).unwrap_or(0);
        let recorded = lock(&self.db).activate_sandbox(
            &sb.id,
            base.image.id,
            &sb.spec,
            sb.shim_pid,
            start,
            base.rung,
            None,
            &base.fell,
        );
        if let Err(e) = recorded {
            discard(self, &sb);
            return Err(e.into());
        }
        self.keep_secrets(&base.work_context, &launch.secret_env);
        tracing::info!("sandbox {}: from the ready pool of {}", sb.id, base.image.name);
        Ok(Arc::new(sb))
    }
}

/// Remove a ready sandbox (never recorded).
fn discard(d: &Daemon, sb: &Sandbox) {
    sb.begin_stop();
    if let Err(e) = sb.destroy(&d.rt.store) {
        tracing::warn!("remove ready sandbox {}: {}", sb.id, crate::error::chain(&e));
    }
}
