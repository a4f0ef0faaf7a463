//! The bottom layer every verb that starts a sandbox shares: a launch's
//! settings checked once ([`LaunchSpec`]), a slot reserved under the cap
//! (or queued for), a ready or warm shim taken or a cold one started, its
//! network attached and its row written with the lineage's activation.

use std::path::PathBuf;
use std::sync::{Arc, MutexGuard};

use crate::catalog::{DbError, ImageRow};
use crate::error::{Classify, ErrorKind};
use crate::ids::SandboxId;

use super::snapshots::Base;
use crate::sandbox::{self, ExecDefaults, Sandbox};
use crate::spec::Limits;
use crate::spec::{MountDecl, SandboxSpec};

use super::{lock, secrets, teardown, Daemon, Pool, MAX_WAIT_SECS};

/// Why a sandbox could not be started (create, and the launches of
/// resume, fork, rollback and a lineage's resume).
#[derive(Debug, thiserror::Error, displaydoc::Display)]
pub enum LaunchError {
    /// seccomp {0:?} must be "default" or "unconfined"
    Seccomp(String),
    /// {0}
    Limits(#[from] crate::sandbox::cgroups::LimitsError),
    /// read the size of the store's file system: {0}
    StoreSize(#[source] nix::Error),
    /// disk cap {cap} bytes is larger than the store's file system ({total} bytes)
    DiskTooLarge { cap: u64, total: u64 },
    /// env entry {0:?} is not KEY=VALUE
    Env(String),
    /// env takes {bytes} bytes encoded; at most {max}
    EnvTooLarge { bytes: usize, max: usize },
    /// hostname {0:?} must be 1-63 chars of [A-Za-z0-9.-]
    Hostname(String),
    /// {0}
    Lifetime(String),
    /// sandbox id {0:?} must be 16 lowercase hex characters
    BadId(String),
    /// sandbox id {0} is taken
    IdTaken(SandboxId),
    /// the host is draining ({0}): it starts no new sandbox
    Draining(String),
    /// a sandbox id names one sandbox: not with count > 1
    IdWithCount,
    /// wait is at most {0} seconds
    Wait(u64),
    /// {0}
    Mount(String),
    /// two mounts at {0}
    TwoMounts(String),
    /// this snapshot's chain was captured in a user namespace: it runs only in one (userns: true)
    UsernsRequired,
    /// cache mounts are not available with userns (a cache's files are owned by host ids)
    CacheWithUserns,
    /// sandbox limit reached: {live} of {max} live (daemon --max-sandboxes)
    Full { live: usize, max: usize },
    /// every user namespace range is in use
    NoUsernsRange,
    /// sandbox's image row is missing
    NoImageRow,
    /// {0}
    Defaults(String),
    /// read or write the lineage's secret env file: {0}
    Secrets(#[source] std::io::Error),
    /// {0}
    Network(crate::net::PolicyError),
    /// this daemon runs with --network off: network egress is not available (ask for network none, or start the daemon with --network on)
    NetworkOff,
    /// network the sandbox: {0}
    Attach(#[from] crate::net::NetError),
    /// a sandbox on a host directory (rootfs) cannot have {0}: the directory is its root as it is
    RootDirWith(&'static str),
    /// a sandbox that joins a network namespace has only what is in it: not with network egress
    NetnsWithEgress,
    /// a sandbox in a user namespace cannot join a network namespace of the host's (its root has no rights there)
    NetnsWithUserns,
    /// {0}
    Sandbox(#[from] sandbox::SandboxError),
    /// {0}
    Db(#[from] DbError),
}

impl Classify for LaunchError {
    fn kind(&self) -> ErrorKind {
        match self {
            LaunchError::Full { .. } | LaunchError::NoUsernsRange => ErrorKind::LimitReached,
            LaunchError::IdTaken(_) | LaunchError::Draining(_) => ErrorKind::Conflict,
            LaunchError::StoreSize(_) | LaunchError::Secrets(_) => ErrorKind::of_host_failure(self),
            LaunchError::NoImageRow => ErrorKind::Internal,
            LaunchError::Sandbox(e) => e.kind(),
            LaunchError::Attach(e) => e.kind(),
            LaunchError::Db(e) => e.kind(),
            _ => ErrorKind::InvalidArgument,
        }
    }
}

/// Validated per-sandbox settings of a create, resume or fork.
#[derive(Clone)]
pub struct LaunchSpec {
    /// The id the caller chose (create's `id`); else a new one.
    pub id: Option<SandboxId>,
    /// How long to queue for a slot when the pool is full (none: 429 at once).
    pub wait: Option<std::time::Duration>,
    pub limits: Limits,
    /// Its deadline and idle timeout.
    pub lifetime: crate::spec::Lifetime,
    pub env: Vec<String>,
    /// Given with the request; none: its lineage's on this host, if kept
    /// (`secrets.rs`).
    pub secret_env: Vec<String>,
    pub hostname: Option<String>,
    pub mounts: Vec<MountDecl>,
    /// `--seccomp unconfined`: no seccomp filter.
    pub seccomp_unconfined: bool,
    /// `--userns`: its own user namespace; `None`: as the base's chain was
    /// captured (resolved by [`Daemon::launch`]).
    pub userns: Option<bool>,
    /// A rollback keeps the host range the sandbox had.
    pub userns_map: Option<crate::spec::UsernsMap>,
    /// The network asked for; `None`: the base's (else none).
    pub network: Option<crate::net::NetworkSpec>,
    /// A network namespace to join (checked to be one when asked for).
    pub netns: Option<std::path::PathBuf>,
    /// A create's `rootfs`: the host directory it runs on.
    pub root_dir: Option<std::path::PathBuf>,
}

fn valid_hostname(h: &str) -> bool {
    !h.is_empty()
        && h.len() <= 63
        && h.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.')
        && !h.starts_with(['-', '.'])
}

impl Daemon {
    /// An adopted sandbox's defaults: its secrets from its lineage's file.
    /// A launch's secret env: what it names, else what this host keeps of
    /// its lineage.
    pub(crate) fn secrets_for(&self, work_context: &str, given: &[String]) -> Result<Vec<String>, LaunchError> {
        if given.is_empty() {
            return Ok(self.secrets.read(work_context).map_err(LaunchError::Secrets)?.unwrap_or_default());
        }
        Ok(given.to_vec())
    }

    pub(crate) fn defaults_for(&self, image_id: &i64, spec: &SandboxSpec) -> Result<ExecDefaults, LaunchError> {
        let image = lock(&self.db).image_by_id(*image_id)?.ok_or(LaunchError::NoImageRow)?;
        let secrets = match (&spec.work_context, spec.secret_names.is_empty()) {
            (Some(wc), false) => self.secrets.read(wc).map_err(LaunchError::Secrets)?.unwrap_or_else(|| {
                // Its lineage ended while it ran (close, retire): adopted
                // without them, said here.
                tracing::warn!(
                    "lineage {wc}: no secret env file; its sandbox's commands run without {:?}",
                    spec.secret_names
                );
                Vec::new()
            }),
            _ => Vec::new(),
        };
        self.exec_defaults(&image, spec, &secrets)
    }

    /// What its commands start with: the image's env, the create's, then
    /// its secrets.
    pub(crate) fn exec_defaults(
        &self,
        image: &ImageRow,
        spec: &SandboxSpec,
        secrets: &[String],
    ) -> Result<ExecDefaults, LaunchError> {
        let layers: Vec<PathBuf> = image.layers.iter().rev().map(|h| self.rt.store.layer_dir(h).join("fs")).collect();
        ExecDefaults::new(&image.config, &[&spec.env[..], secrets].concat(), &layers).map_err(LaunchError::Defaults)
    }

    /// Validate what every way of starting a sandbox takes.
    pub fn launch_spec(&self, req: crate::types::LaunchRequest) -> Result<LaunchSpec, LaunchError> {
        let crate::types::LaunchRequest {
            memory,
            pids,
            cpus,
            disk,
            env,
            secret_env,
            hostname,
            scratch,
            cache,
            seccomp,
            userns,
            timeout,
            on_timeout,
            idle_timeout,
            id,
            count,
            wait,
            network,
            netns,
        } = req;
        if wait.is_some_and(|w| w > MAX_WAIT_SECS) {
            return Err(LaunchError::Wait(MAX_WAIT_SECS));
        }
        let wait = wait.map(std::time::Duration::from_secs);
        if id.is_some() && count.is_some_and(|c| c > 1) {
            return Err(LaunchError::IdWithCount);
        }
        let id = id.map(|i| i.parse::<SandboxId>().map_err(|_| LaunchError::BadId(i))).transpose()?;
        let lifetime = crate::spec::lifetime(timeout, on_timeout, idle_timeout, self.cfg.on_timeout)
            .map_err(LaunchError::Lifetime)?;
        let seccomp_unconfined = match seccomp.as_deref() {
            None | Some("default") => false,
            Some("unconfined") => true,
            Some(other) => return Err(LaunchError::Seccomp(other.to_string())),
        };
        let limits = Limits { memory, pids, cpus, disk };
        limits.validate(self.host_cpus)?;
        let limits = self.cfg.limit_policy.settle(limits)?;
        if let Some(d) = limits.disk {
            // A cap past the store's whole file system caps nothing, and
            // formatting one costs time in proportion to its size.
            let total = nix::sys::statvfs::statvfs(self.rt.store.root())
                .map(|s| s.blocks() * s.fragment_size())
                .map_err(LaunchError::StoreSize)?;
            if d > total {
                return Err(LaunchError::DiskTooLarge { cap: d, total });
            }
        }
        for e in env.iter().chain(&secret_env) {
            if !e.contains('=') || e.starts_with('=') || e.contains('\0') {
                // A secret's value is not repeated in the error.
                let shown =
                    if env.contains(e) { e.clone() } else { format!("{}=...", e.split('=').next().unwrap_or("")) };
                return Err(LaunchError::Env(shown));
            }
        }
        // Every exec carries the sandbox's env to the shim: past this, every
        // exec would fail (it once did, with 500 EMSGSIZE).
        let env_bytes = serde_json::to_vec(&[&env[..], &secret_env[..]].concat()).map_or(usize::MAX, |b| b.len());
        if env_bytes > strata_shim::proto::MAX_SANDBOX_ENV {
            return Err(LaunchError::EnvTooLarge { bytes: env_bytes, max: strata_shim::proto::MAX_SANDBOX_ENV });
        }
        if let Some(h) = &hostname {
            if !valid_hostname(h) {
                return Err(LaunchError::Hostname(h.clone()));
            }
        }
        let mut mounts = Vec::new();
        for s in &scratch {
            mounts.push(MountDecl::parse_scratch(s).map_err(LaunchError::Mount)?);
        }
        for c in &cache {
            mounts.push(MountDecl::parse_cache(c).map_err(LaunchError::Mount)?);
        }
        for (i, m) in mounts.iter().enumerate() {
            if mounts[..i].iter().any(|o| o.path() == m.path()) {
                return Err(LaunchError::TwoMounts(m.path().to_string()));
            }
        }
        Ok(LaunchSpec {
            id,
            wait,
            limits,
            lifetime,
            env,
            secret_env,
            hostname,
            mounts,
            seccomp_unconfined,
            userns,
            userns_map: None,
            network: network.map(|n| self.network_request(n)).transpose()?,
            netns: netns.map(|p| sandbox::open_netns(std::path::Path::new(&p)).map(|_| p.into())).transpose()?,
            root_dir: None,
        })
    }

    /// Check a network the API asked for against this daemon's.
    pub(crate) fn network_request(
        &self,
        req: crate::types::NetworkRequest,
    ) -> Result<crate::net::NetworkSpec, LaunchError> {
        let policy = crate::net::Policy::parse(&req.allow_out, &req.deny_out).map_err(LaunchError::Network)?;
        let mode = req.mode.unwrap_or(crate::net::NetworkMode::Egress);
        if mode == crate::net::NetworkMode::None && policy != crate::net::Policy::default() {
            return Err(LaunchError::Network(crate::net::PolicyError::PolicyWithoutEgress));
        }
        if mode == crate::net::NetworkMode::Egress && self.net.is_none() {
            return Err(LaunchError::NetworkOff);
        }
        Ok(crate::net::NetworkSpec { mode, policy, address: None })
    }

    /// Settle whether a launch on `base` gets a user namespace. What a root
    /// in a user namespace wrote (a setuid-root file, file capabilities,
    /// /etc/ld.so.preload) is host root's once it runs without one, so a
    /// chain with any snapshot captured in one runs only in one.
    fn settle_userns(&self, base: &Base, mut launch: LaunchSpec) -> Result<LaunchSpec, LaunchError> {
        let userns = match (launch.userns, base.captured_in_userns) {
            (Some(false), true) => return Err(LaunchError::UsernsRequired),
            (Some(u), _) => u,
            (None, c) => c,
        };
        if userns && launch.mounts.iter().any(|m| matches!(m, MountDecl::Cache { .. })) {
            // A cache is a host directory owned by host ids: unusable
            // (nobody-owned) in a user namespace until caches are idmapped.
            return Err(LaunchError::CacheWithUserns);
        }
        launch.userns = Some(userns);
        Ok(launch)
    }

    /// Start one sandbox on `base`, within the pool's bound.
    pub(crate) fn launch(&self, base: &Base, launch: LaunchSpec) -> Result<Arc<Sandbox>, LaunchError> {
        let launch = self.settle_userns(base, launch)?;
        // Reserve a slot: past the cap nothing is made (or, with `wait`,
        // the request queues for one, first come first served). A chosen id
        // is claimed with it (two creates cannot both take one).
        let id = launch.id.clone();
        if let Some(id) = &id {
            if lock(&self.db).sandbox_id_seen(id.as_str())? {
                return Err(LaunchError::IdTaken(id.clone()));
            }
        }
        let asked = std::time::Instant::now();
        {
            let mut pool = self.reserve_slot(launch.wait)?;
            if let Some(id) = &id {
                // A removal of that id still tearing down ends in moments
                // (its files and cgroup are named by id): wait for it.
                drop(pool);
                pool = self.after_removals(|s| s.id == *id);
                if pool.live.contains_key(id) || pool.removing.contains_key(id) || !pool.claimed.insert(id.clone()) {
                    pool.reserved -= 1;
                    drop(pool);
                    self.slots.notify_all();
                    return Err(LaunchError::IdTaken(id.clone()));
                }
            }
        }
        // A deadline runs from the start, not from a wait for a slot.
        let mut launch = launch;
        if let Some(d) = launch.lifetime.deadline_ms.as_mut() {
            *d += asked.elapsed().as_millis() as i64;
        }
        let result = match self.take_ready_for(base, &launch) {
            Some(ready) => self.claim_ready(ready, base, launch.clone()).or_else(|e| {
                // The catalog's verdict on the lineage (held by another
                // sandbox, ended meanwhile) holds for a fresh one too.
                if matches!(e, LaunchError::Db(DbError::LineageHeld { .. } | DbError::RetiredMeanwhile(_))) {
                    return Err(e);
                }
                tracing::warn!("ready sandbox not usable ({}); starting a fresh one", crate::error::chain(&e));
                self.launch_reserved(base, launch, id.clone())
            }),
            None => self.launch_reserved(base, launch, id.clone()),
        };
        if let Some(id) = &id {
            lock(&self.pool).claimed.remove(id);
        }
        self.end_reservation(result)
    }

    /// Give back a slot reserved for a launch: to the sandbox it started
    /// (now live), or (it failed) to whoever waits for one.
    pub(crate) fn end_reservation<E>(&self, result: Result<Arc<Sandbox>, E>) -> Result<Arc<Sandbox>, E> {
        let mut pool = lock(&self.pool);
        pool.reserved -= 1;
        match result {
            Ok(sb) => {
                pool.live.insert(sb.id.clone(), sb.clone());
                Ok(sb)
            }
            Err(e) => {
                drop(pool);
                self.slots.notify_all();
                Err(e)
            }
        }
    }

    /// Reserve a slot in the pool (`reserved` + 1), waiting up to `wait`
    /// for one in a first-come-first-served queue; refused while the host
    /// drains. Returns the pool, locked.
    fn reserve_slot(&self, wait: Option<std::time::Duration>) -> Result<MutexGuard<'_, Pool>, LaunchError> {
        let mut pool = lock(&self.pool);
        if let Some(why) = &pool.draining {
            return Err(LaunchError::Draining(why.clone()));
        }
        let full = |p: &Pool| p.used() >= self.max_sandboxes;
        // Nobody waits and there is room: take it.
        if pool.queue.is_empty() && !full(&pool) {
            pool.reserved += 1;
            return Ok(pool);
        }
        let wait = match wait.filter(|w| !w.is_zero()) {
            Some(w) => w,
            // A slot a removal still holds comes free in moments (its
            // teardown): wait for it rather than refuse, when nobody waits
            // ahead and the removals are what fills the host.
            None if pool.queue.is_empty() && pool.live.len() + pool.reserved < self.max_sandboxes => {
                teardown::SLOT_WAIT
            }
            None => return Err(LaunchError::Full { live: pool.used(), max: self.max_sandboxes }),
        };
        let ticket = pool.next_ticket;
        pool.next_ticket += 1;
        pool.queue.push_back(ticket);
        let until = std::time::Instant::now() + wait;
        loop {
            if let Some(why) = pool.draining.clone() {
                pool.queue.retain(|t| *t != ticket);
                drop(pool);
                self.slots.notify_all();
                return Err(LaunchError::Draining(why));
            }
            if pool.queue.front() == Some(&ticket) && !full(&pool) {
                pool.queue.pop_front();
                pool.reserved += 1;
                // The next in line may have room too.
                self.slots.notify_all();
                return Ok(pool);
            }
            let left = until.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                pool.queue.retain(|t| *t != ticket);
                let live = pool.used();
                drop(pool);
                self.slots.notify_all();
                return Err(LaunchError::Full { live, max: self.max_sandboxes });
            }
            pool = self.slots.wait_timeout(pool, left).map(|(g, _)| g).unwrap_or_else(|p| p.into_inner().0);
        }
    }

    /// Start a sandbox in a slot already reserved; with `fixed_id` (a
    /// rollback keeps its sandbox's id) no warm shim is used.
    pub(crate) fn launch_reserved(
        &self,
        base: &Base,
        launch: LaunchSpec,
        fixed_id: Option<SandboxId>,
    ) -> Result<Arc<Sandbox>, LaunchError> {
        // A sandbox with a disk cap needs its disk mounted before its shim
        // is cloned (the shim's mount namespace is a copy of ours); one with
        // a user namespace needs a shim cloned into one.
        let userns = launch.userns == Some(true);
        let cold = fixed_id.is_some()
            || launch.limits.disk.is_some()
            || userns
            || launch.netns.is_some()
            || launch.root_dir.is_some();
        if launch.root_dir.is_some() && (userns || launch.limits.disk.is_some()) {
            return Err(LaunchError::RootDirWith(if userns { "a user namespace" } else { "a disk cap" }));
        }
        // A rollback keeps its sandbox's exec records but starts its log
        // over at the snapshot it went back to.
        let log_from = match &fixed_id {
            Some(id) => self.last_exec_record(id.as_str())?,
            None => 0,
        };
        // Its network: as asked, else as its base's sandbox had it.
        let mut network = launch.network.or_else(|| base.network.clone()).unwrap_or_default();
        let egress = network.mode == crate::net::NetworkMode::Egress;
        if egress && self.net.is_none() {
            return Err(LaunchError::NetworkOff);
        }
        // A joined namespace is the caller's: nothing of Strata's in it.
        if launch.netns.is_some() {
            if egress {
                return Err(LaunchError::NetnsWithEgress);
            }
            if userns {
                return Err(LaunchError::NetnsWithUserns);
            }
        }
        let (warm, wired) = match if cold { None } else { self.take_warm(egress) } {
            Some((p, w)) => (Some(p), w),
            None => (None, None),
        };
        tracing::debug!(
            "create: {} shim",
            match (&warm, &wired) {
                (Some(_), Some(_)) => "warm wired",
                (Some(_), None) => "warm",
                _ => "cold",
            }
        );
        let id = fixed_id.or_else(|| warm.as_ref().map(|w| w.id.clone())).unwrap_or_else(SandboxId::random);
        let hostname = launch.hostname.unwrap_or_else(|| id.as_str()[..12].to_string());
        // An `egress` one gets its slot now (its resolv.conf names it): the
        // warm shim's, wired already, or one reserved here.
        let slot = match (wired, &self.net) {
            (Some(w), _) => Some(crate::net::Slot::Wired(w)),
            (None, Some(net)) if egress => Some(crate::net::Slot::Reserved(net.reserve(None)?)),
            _ => None,
        };
        network.address = slot.as_ref().map(|s| s.address());
        let secrets = self.secrets_for(&base.work_context, &launch.secret_env)?;
        let spec = SandboxSpec {
            image: base.image.name.clone(),
            layers: base.layers.clone(),
            snapshot: base.snapshot.clone(),
            work_context: Some(base.work_context.clone()),
            observed_head: base.observed_head.clone(),
            restored: Some(crate::spec::Restored { rung: base.rung, snapshot: base.snapshot.clone() }),
            limits: launch.limits,
            env: launch.env,
            hostname,
            cgroup: self.rt.cgroup_path(&id),
            mounts: launch.mounts,
            seccomp_unconfined: launch.seccomp_unconfined,
            userns: match (userns, launch.userns_map) {
                (false, _) => None,
                (true, Some(map)) => Some(map),
                (true, None) => Some(self.alloc_userns()?),
            },
            lifetime: launch.lifetime,
            log_from,
            network,
            netns: launch.netns,
            root_dir: launch.root_dir,
            secret_names: secrets::names(&secrets),
        };
        let defaults = self.exec_defaults(&base.image, &spec, &secrets)?;
        let mut sb = match warm {
            Some(prep) => sandbox::start(&self.rt, prep, &spec, defaults),
            None => sandbox::create(&self.rt, &id, &spec, defaults),
        }?;
        if let (Some(net), Some(slot)) = (&self.net, slot) {
            if let Err(e) = sb.attach_network(net, slot) {
                let _ = sb.destroy(&self.rt.store);
                return Err(e.into());
            }
        }
        // One row, written once the sandbox is up. A crash before this leaves
        // a sandbox dir and cgroup without a row: the start-up sweep ends its
        // processes and removes both.
        let start = sandbox::process_start_time(sb.shim_pid).unwrap_or(0);
        let recorded = lock(&self.db).activate_sandbox(
            &id,
            base.image.id,
            &spec,
            sb.shim_pid,
            start,
            base.rung,
            base.snapshot.as_deref(),
            &base.fell,
        );
        if let Err(e) = recorded {
            let _ = sb.destroy(&self.rt.store);
            return Err(e.into());
        }
        self.keep_secrets(&base.work_context, &launch.secret_env);
        Ok(Arc::new(sb))
    }

    /// A host id range no live sandbox uses. Starts where the last search
    /// ended, so launches in flight (not yet live) get different ranges.
    fn alloc_userns(&self) -> Result<crate::spec::UsernsMap, LaunchError> {
        let base = self.cfg.userns_base;
        let slots = crate::sandbox::userns::slots(base).max(1);
        let mut pool = lock(&self.pool);
        // Ranges, not start ids: sandboxes adopted after a restart with
        // another --userns-base may sit across the new slots.
        // A removed sandbox's processes hold their ids until its teardown.
        let used: Vec<(u64, u64)> = pool
            .mounting()
            .filter_map(|s| s.spec.userns)
            .map(|m| (u64::from(m.host_id), u64::from(m.host_id) + u64::from(m.size)))
            .collect();
        for _ in 0..slots {
            let slot = pool.next_userns % slots;
            pool.next_userns = (slot + 1) % slots;
            if let Some(map) = crate::sandbox::userns::range(base, slot) {
                let (start, end) = (u64::from(map.host_id), u64::from(map.host_id) + u64::from(map.size));
                if !used.iter().any(|&(s, e)| start < e && s < end) {
                    return Ok(map);
                }
            }
        }
        Err(LaunchError::NoUsernsRange)
    }
}
