//! The daemon: owns the store, the database, the live sandboxes and the
//! execution pool's bound; every API operation is a method here.
//!
//! Start-up order: lock the root (one daemon per root), open the database
//! (migrations), re-adopt live sandboxes, clean up those that died, then
//! sweep `tmp/` and directories the database does not know.
//!
//! Three floors (docs/architecture.md, checked by tests/imports.rs): the
//! steps verbs share (`lookup`, `snapshots`, `hydrate`, `launch`, `ready`,
//! `warm`, `capture`, `seal`, `lineage`, `gc`'s collector, ...), one file
//! per verb above them (`create`, `exec`, `checkpoint`, `resume`, `fork`,
//! ...), and the drivers on top (`host`, `lifetime`, `retention`,
//! `metrics`). This file is the composition root: the `Daemon` holds every
//! part's state.

pub mod baseline;
pub mod capture;
pub mod checkpoint;
pub mod copy;
mod create;
pub mod diff;
pub mod distribution;
mod exec;
pub mod execlog;
pub mod export;
pub mod fleet;
pub mod fork;
pub mod gc;
pub mod host;
pub mod hydrate;
mod images;
mod launch;
pub mod lifetime;
pub mod limits;
pub mod lineage;
pub mod lineages;
pub mod logs;
pub mod lookup;
pub mod metrics;
pub mod network;
mod pause;
pub mod processes;
pub mod publish;
pub mod pull;
pub mod push;
pub mod ready;
pub mod requests;
pub mod results;
pub mod resume;
pub mod retention;
pub mod rollback;
pub mod seal;
pub mod secrets;
pub mod snapshot_rm;
pub mod snapshots;
pub mod suspend;
pub mod teardown;
pub mod telemetry;
mod warm;

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};

pub use create::CreateError;
pub(crate) use lookup::image_info;
use nix::fcntl::{Flock, FlockArg};

pub use images::{ImageOpError, ImportError};
pub use launch::{LaunchError, LaunchSpec};
pub use snapshots::Base;

pub use lookup::{sandbox_info, SandboxOpError};

use crate::catalog::{Db, DbError, SandboxState};
use crate::error::{Classify, ErrorKind};
use crate::ids::{ImageName, SandboxId};
use crate::sandbox::{self, Runtime, Sandbox};
use crate::store::{Store, StoreError};

// ---- what each operation can fail with (issue 18.2: one enum per
// operation, its doc comments the messages; `Classify` gives the kind) ----

/// Why a collection failed (what it could not remove stays for the next).
#[derive(Debug, thiserror::Error, displaydoc::Display)]
pub enum CollectError {
    /// collect layers and blobs: {0}
    Store(#[from] StoreError),
    /// {0}
    Db(#[from] DbError),
}

impl Classify for CollectError {
    fn kind(&self) -> ErrorKind {
        match self {
            CollectError::Store(_) => ErrorKind::of_host_failure(self),
            CollectError::Db(e) => e.kind(),
        }
    }
}

/// How [`Daemon::exec_with`] starts a buffered exec and waits for it
/// (the sandbox, the request with the daemon's settings, its input).
pub type RunExec<'a> =
    dyn FnMut(&Sandbox, &sandbox::ExecRequest, Vec<u8>) -> Result<sandbox::ExecOutput, sandbox::SandboxError> + 'a;

#[derive(Debug, Clone)]
pub struct DaemonConfig {
    pub root: PathBuf,
    pub socket: PathBuf,
    /// The group that may use the API socket (besides root); the socket is
    /// `root:<group>` mode 0660 and every connection's peer is checked.
    pub socket_gid: Option<u32>,
    /// Cap on live sandboxes; `None` sizes it from host memory.
    pub max_sandboxes: Option<usize>,
    /// Parent cgroup name; must be named for Strata.
    pub cgroup_parent: String,
    /// Path of `strata-shim`; `None` means next to the running executable.
    pub shim: Option<PathBuf>,
    /// Shims kept started (namespaces, cgroup, connection) ahead of `create`.
    pub warm_pool: usize,
    /// A snapshot whose layer chain would be longer than this is compacted
    /// into one layer when it is sealed.
    pub compact_depth: usize,
    /// How long superseded, retired and failed snapshots are kept.
    pub retention: std::time::Duration,
    /// An active lineage neither captured nor restored for this long is
    /// retired by the collector.
    pub stale_after: std::time::Duration,
    /// First host id of the user namespace ranges (`--userns`).
    pub userns_base: u32,
    /// Limits of sandboxes that ask for none, and the most they may ask for.
    pub limit_policy: crate::sandbox::cgroups::LimitPolicy,
    /// What happens at a sandbox's deadline when its create does not say.
    pub on_timeout: crate::model::OnTimeout,
    /// Ready pools: sandboxes of these images kept started (`ready.rs`).
    pub pools: Vec<(ImageName, usize)>,
    /// How many bytes of each command's output (stdout and stderr
    /// together) its exec record keeps.
    pub keep_output: usize,
    /// A PostgreSQL catalog (`postgres://...`) instead of `ROOT/strata.db`.
    pub database: Option<String>,
    /// This host's id in the catalog (`host.rs`).
    pub host_id: String,
    /// How often it heartbeats, and how long its row stays alive without
    /// one (then other hosts mark it down).
    pub heartbeat: std::time::Duration,
    pub host_deadline: std::time::Duration,
    /// The fleet registry distributed snapshots are published to.
    pub registry: Option<distribution::FleetRegistry>,
    /// Sandbox networking (`--network on`); `None`: every sandbox has
    /// loopback only and `egress` is refused.
    pub network: Option<crate::net::NetConfig>,
}

/// Open the catalog `cfg` names (a connection of its own each call).
pub(crate) fn open_catalog(cfg: &DaemonConfig) -> Result<Db, DbError> {
    match &cfg.database {
        Some(url) => {
            // A host frozen inside a transaction holds every host's
            // writes, their heartbeats too: its session ends well before
            // a host that waited for it could pass its own deadline
            // (its last beat at most one interval old, then this wait);
            // never under a second (a deadline barely above the heartbeat).
            let db = Db::open_postgres(url)?;
            let limit = (cfg.host_deadline.saturating_sub(cfg.heartbeat) / 2).max(std::time::Duration::from_secs(1));
            db.end_idle_transactions_after(limit)?;
            Ok(db)
        }
        None => Db::open(&cfg.root.join("strata.db")),
    }
}

/// See [`Daemon::sealing`].
#[derive(Debug, Default)]
pub(crate) struct Sealing {
    pub(crate) cgroup: Option<String>,
    pub(crate) stopped: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error("another strata daemon (pid {pid}) is already running on root {root}")]
    AlreadyRunning { root: PathBuf, pid: String },
    #[error("lock root {0}")]
    Lock(PathBuf, #[source] std::io::Error),
    #[error("host id {0:?} must be 1-64 chars of [A-Za-z0-9._-], not starting with . or - (--host-id)")]
    HostId(String),
    #[error("cgroup parent {0:?} must start with \"strata\" and be one path component of [A-Za-z0-9._-]")]
    CgroupParent(String),
    #[error("strata-shim not found at {0} (build the workspace, or pass --shim)")]
    NoShim(PathBuf),
    #[error("prepare the shim")]
    Shim(#[from] crate::sandbox::ShimExeError),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Db(#[from] DbError),
    #[error("set up sandbox networking (or start with --network off)")]
    Network(#[from] crate::net::NetError),
}

/// Live sandboxes plus slots reserved by creates in flight, under one lock so
/// the pool bound is exact.
#[derive(Default)]
pub(crate) struct Pool {
    pub(crate) live: HashMap<SandboxId, Arc<Sandbox>>,
    /// Slots held by launches in flight.
    pub(crate) reserved: usize,
    /// Sandboxes removed from the API whose teardown is still running
    /// (see `teardown`): each keeps its slot, and the layers it mounts.
    pub(crate) removing: HashMap<SandboxId, Arc<Sandbox>>,
    /// Snapshots that resumes, forks and rollbacks in flight start from (a
    /// count each): removal is refused for them, as for live users.
    pub(crate) pinned: HashMap<String, usize>,
    /// Snapshots being removed: new pins on them are refused.
    pub(crate) doomed: std::collections::HashSet<String>,
    /// Where the search for a free user namespace range starts next.
    pub(crate) next_userns: u32,
    /// Ids chosen by creates in flight.
    pub(crate) claimed: std::collections::HashSet<SandboxId>,
    /// Launches waiting for a slot (`wait`), by ticket, first come first.
    pub(crate) queue: std::collections::VecDeque<u64>,
    pub(crate) next_ticket: u64,
    /// Why new work is refused (`strata drain`), while the host drains.
    pub(crate) draining: Option<String>,
    /// Counts this daemon's own drain changes, so that a heartbeat whose
    /// catalog read began before one does not undo it with the older value.
    pub(crate) drain_changes: u64,
}

impl Pool {
    /// Slots taken: live sandboxes, launches in flight, removals under way.
    pub(crate) fn used(&self) -> usize {
        self.live.len() + self.reserved + self.removing.len()
    }

    /// Every sandbox of this host whose mounts may still exist: the live
    /// ones and those being torn down.
    pub(crate) fn mounting(&self) -> impl Iterator<Item = &Arc<Sandbox>> {
        self.live.values().chain(self.removing.values())
    }
}

pub struct Daemon {
    pub cfg: DaemonConfig,
    /// This daemon, for the threads a verb leaves running (a process's
    /// waiter): set by [`Daemon::start_background`].
    me: std::sync::OnceLock<std::sync::Weak<Daemon>>,
    warm: warm::WarmPool,
    pub(crate) ready: ready::ReadyPools,
    teardown: teardown::Teardowns,
    exec_log: execlog::ExecLog,
    /// Snapshot ids whose blob the background writer must produce.
    blobs: Mutex<Option<std::sync::mpsc::Sender<String>>>,
    /// The sandbox cgroup whose capture cgroup the seal under way made
    /// (`seal_blob`), for shutdown to end it; no new seal starts after.
    pub(crate) sealing: Mutex<Sealing>,
    pub(crate) rt: Runtime,
    pub(crate) db: Mutex<Db>,
    /// Each lineage's secret env on this host (`secrets.rs`).
    pub(crate) secrets: secrets::Secrets,
    pub(crate) pool: Mutex<Pool>,
    /// Signalled when a slot may have come free (a sandbox went, a launch
    /// failed, a waiter left the queue).
    pub(crate) slots: std::sync::Condvar,
    max_sandboxes: usize,
    host_cpus: usize,
    pub(crate) import_lock: Mutex<()>,
    /// Held by a drain request from its catalog write until it takes
    /// effect, so that two requests take effect in the order written.
    pub(crate) drain_lock: Mutex<()>,
    /// Pulled layers being unpacked now (see `distribution::hydrate_layer`),
    /// and the condition their waiters wait on.
    pub(crate) hydrating: Mutex<std::collections::HashSet<String>>,
    pub(crate) hydrated: std::sync::Condvar,
    /// Layer ids the background hydrator must unpack.
    pub(crate) hydrator: Mutex<Option<std::sync::mpsc::Sender<String>>>,
    /// Set when [`Daemon::shutdown`] begins: the reaper acts no more.
    pub(crate) stopping: std::sync::atomic::AtomicBool,
    /// The heartbeat thread (`host.rs`), joined at shutdown.
    pub(crate) heartbeat: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// Held while layers are brought from the fleet registry (`fleet.rs`).
    pub(crate) fleet_fetch: Mutex<()>,
    /// Background publications (`fleet.rs`): in flight (`None`) or failed.
    pub(crate) publishing: Mutex<HashMap<String, Option<String>>>,
    pub(crate) publisher: Mutex<Option<std::sync::mpsc::Sender<fleet::PublisherJob>>>,
    /// A thread removes sandboxes whose rows another host marked stopped
    /// (`host.rs`).
    pub(crate) removing_stopped: std::sync::atomic::AtomicBool,
    /// Each up host's layers as of its last heartbeat, read at most once
    /// a second (a snapshot's `hosts`).
    pub(crate) host_layers: Mutex<Option<(std::time::Instant, fleet::HostLayers)>>,
    /// Sandbox networking, if on.
    pub(crate) net: Option<Arc<crate::net::Network>>,
    /// Each live sandbox's recent metrics (`metrics.rs`).
    pub(crate) metrics: metrics::History,
    /// The daemon's Prometheus metrics (`telemetry.rs`).
    pub telemetry: telemetry::Telemetry,
    _lock: Flock<File>,
}

/// Start one of the daemon's background threads, named `name`. A thread
/// that cannot start is logged with what the daemon does without it
/// (`without`), and the daemon goes on.
pub(crate) fn background(
    name: &str,
    without: &str,
    body: impl FnOnce() + Send + 'static,
) -> Option<std::thread::JoinHandle<()>> {
    match std::thread::Builder::new().name(name.into()).spawn(body) {
        Ok(h) => Some(h),
        Err(e) => {
            tracing::error!("start the {name} thread: {e}; {without}");
            None
        }
    }
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The longest a launch may queue for a slot (`wait`, seconds).
pub const MAX_WAIT_SECS: u64 = 3600;

/// The host's memory, in bytes (0 if /proc/meminfo cannot be read).
pub fn memory_total() -> u64 {
    use procfs::Current;
    procfs::Meminfo::current().map(|m| m.mem_total).unwrap_or(0)
}

/// The CPUs this process may run on.
pub fn cpu_count() -> u64 {
    std::thread::available_parallelism().map_or(1, |n| n.get() as u64)
}

/// Default pool size: one sandbox per 128 MiB of host memory, at least 1.
pub fn default_max_sandboxes() -> usize {
    // Unreadable (0): sized as for 1 GiB.
    let bytes = Some(memory_total()).filter(|b| *b > 0).unwrap_or(1 << 30);
    ((bytes >> 27) as usize).clamp(1, 4096)
}

impl Daemon {
    pub fn open(cfg: DaemonConfig) -> Result<Daemon, DaemonError> {
        let p = &cfg.cgroup_parent;
        if !p.starts_with("strata") || !p.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
        {
            return Err(DaemonError::CgroupParent(p.clone()));
        }
        let shim_exe = match &cfg.shim {
            Some(p) => p.clone(),
            None => std::env::current_exe()
                .ok()
                .and_then(|e| e.parent().map(|d| d.join("strata-shim")))
                .unwrap_or_else(|| PathBuf::from("strata-shim")),
        };
        if !shim_exe.is_file() {
            return Err(DaemonError::NoShim(shim_exe));
        }
        std::fs::create_dir_all(&cfg.root).map_err(|e| DaemonError::Lock(cfg.root.clone(), e))?;
        let lock_path = cfg.root.join("daemon.lock");
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .open(&lock_path)
            .map_err(|e| DaemonError::Lock(lock_path.clone(), e))?;
        let flock = match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
            Ok(f) => f,
            Err((_, nix::Error::EWOULDBLOCK)) => {
                let pid = std::fs::read_to_string(&lock_path).unwrap_or_default().trim().to_string();
                return Err(DaemonError::AlreadyRunning { root: cfg.root.clone(), pid });
            }
            Err((_, e)) => return Err(DaemonError::Lock(lock_path, e.into())),
        };
        {
            use std::io::{Seek, Write};
            let mut f: &File = &flock;
            let _ = f.set_len(0);
            let _ = f.seek(std::io::SeekFrom::Start(0));
            let _ = write!(f, "{}", std::process::id());
        }
        let store = Store::open(&cfg.root)?;
        if !host::valid_host_id(&cfg.host_id) {
            return Err(DaemonError::HostId(cfg.host_id.clone()));
        }
        let mut db = open_catalog(&cfg)?;
        // Registered before anything is adopted: a daemon adopts, forgets
        // and fails only its own host's rows.
        let registered = db.register_host(&crate::catalog::HostClaim {
            id: &cfg.host_id,
            machine: &host::machine_id(),
            root: &store.root().display().to_string(),
            version: env!("CARGO_PKG_VERSION"),
            info: "{}",
            deadline_ms: cfg.host_deadline.as_millis() as i64,
        })?;
        let shim = crate::sandbox::ShimExe::install(&shim_exe, &cfg.root.join("shim"))?;
        let rt = Runtime { store, shim: std::sync::Arc::new(shim), cgroup_parent: cfg.cgroup_parent.clone() };
        let max_sandboxes = cfg.max_sandboxes.unwrap_or_else(default_max_sandboxes);
        let net = cfg.network.clone().map(crate::net::Network::start).transpose()?;
        let host_cpus = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
        let d = Daemon {
            me: Default::default(),
            secrets: secrets::Secrets::new(&cfg.root),
            cfg,
            warm: warm::WarmPool::default(),
            ready: Default::default(),
            teardown: Default::default(),
            exec_log: Default::default(),
            blobs: Mutex::new(None),
            sealing: Mutex::new(Sealing::default()),
            rt,
            db: Mutex::new(db),
            pool: Mutex::new(Pool { draining: registered.drain, ..Pool::default() }),
            slots: std::sync::Condvar::new(),
            max_sandboxes,
            host_cpus,
            import_lock: Mutex::new(()),
            drain_lock: Mutex::new(()),
            hydrating: Mutex::new(Default::default()),
            hydrated: std::sync::Condvar::new(),
            hydrator: Mutex::new(None),
            stopping: Default::default(),
            heartbeat: Mutex::new(None),
            fleet_fetch: Mutex::new(()),
            publishing: Mutex::new(HashMap::new()),
            publisher: Mutex::new(None),
            removing_stopped: Default::default(),
            host_layers: Mutex::new(None),
            net,
            metrics: metrics::History::default(),
            telemetry: telemetry::Telemetry::default(),
            _lock: flock,
        };
        d.recover()?;
        Ok(d)
    }

    /// Re-adopt sandboxes whose shim is alive; clean up the rest; sweep.
    fn recover(&self) -> Result<(), DaemonError> {
        lock(&self.db).forget_unsettled_keys()?;
        let failed = lock(&self.db).fail_interrupted_captures()?;
        if failed > 0 {
            tracing::warn!("{failed} capture(s) interrupted by the last stop are failed");
        }
        let rows = lock(&self.db).list_sandboxes()?;
        for row in rows {
            let adopted = match row.state {
                SandboxState::Running | SandboxState::Paused => match self.defaults_for(&row.image_id, &row.spec) {
                    Ok(d) => sandbox::adopt(&self.rt, &row, d).map_err(|e| crate::error::chain(&e)),
                    Err(e) => Err(crate::error::chain(&e)),
                },
                _ => Err("sandbox was not running".to_string()),
            };
            match adopted {
                Ok(mut sb) => {
                    tracing::info!("re-adopted sandbox {} (shim pid {})", row.id, sb.shim_pid);
                    self.renetwork(&mut sb);
                    lock(&self.pool).live.insert(row.id.clone(), Arc::new(sb));
                }
                Err(e) => {
                    tracing::warn!("sandbox {} cannot be re-adopted ({}); removing it", row.id, e);
                    if let Err(e) = sandbox::reap_orphan(&self.rt, &row) {
                        tracing::error!("clean up sandbox {}: {}", row.id, crate::error::chain(&e));
                        continue;
                    }
                    lock(&self.db).delete_sandbox(&row.id)?;
                }
            }
        }
        let known_sandboxes: HashSet<String> =
            lock(&self.db).list_sandboxes()?.into_iter().map(|r| r.id.to_string()).collect();
        // Sandbox dirs without a row belong to warm shims (or a create cut
        // short) of a daemon that was killed: end their processes (they are
        // in our own cgroup) and remove their cgroups before the file sweep.
        let dir = self.rt.store.root().join("sandboxes");
        for entry in
            std::fs::read_dir(&dir).map_err(|source| StoreError::Io { step: "read", path: dir.clone(), source })?
        {
            let Ok(entry) = entry else { continue };
            let Ok(id) = entry.file_name().to_string_lossy().parse::<SandboxId>() else { continue };
            if known_sandboxes.contains(id.as_str()) {
                continue;
            }
            let cg = crate::sandbox::cgroups::SandboxCgroup::load(&self.rt.cgroup_path(&id));
            for pid in cg.procs() {
                let _ =
                    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), nix::sys::signal::Signal::SIGKILL);
            }
            if let Err(e) = cg.remove(std::time::Duration::from_secs(5)) {
                tracing::warn!("sweep cgroup of {id}: {}", crate::error::chain(&e));
            }
            if let Err(e) = crate::sandbox::remove_capture_cgroup(cg.path(), std::time::Duration::from_secs(5)) {
                tracing::warn!("sweep capture cgroup of {id}: {}", crate::error::chain(&e));
            }
        }
        self.rt.store.sweep(&known_sandboxes)?;
        // Removals a stop left half-way go on (their files first, then rows).
        let deleting = lock(&self.db).deleting_snapshots()?;
        for id in deleting {
            match self.finish_removal(&id) {
                Ok(()) => tracing::info!("finished removing snapshot {id}"),
                Err(e) => tracing::warn!("finish removing snapshot {id}: {}", crate::error::chain(&e)),
            }
        }
        // Layers and blobs no row lists (an operation cut short): no lease
        // outlives the daemon that took it.
        // What cannot be removed stays for the next collection: the daemon
        // starts anyway.
        if let Err(e) = self.collect(crate::store::Scope::Everything, []) {
            tracing::warn!("collect at start: {}", crate::error::chain(&e));
        }
        Ok(())
    }

    /// Give an adopted `egress` sandbox its network again (the start
    /// removed every link and rule an earlier daemon left): the same
    /// address if it is free and in the range, and its policy. A sandbox
    /// that cannot have one keeps running without.
    fn renetwork(&self, sb: &mut Sandbox) {
        if sb.spec.network.mode != crate::net::NetworkMode::Egress {
            return;
        }
        let Some(net) = &self.net else {
            tracing::warn!("sandbox {} had a network, but this daemon runs with --network off: it has none now", sb.id);
            return;
        };
        let attached = net.reserve(sb.spec.network.address).and_then(|slot| {
            // Its resolv.conf names the gateway of the address it had: any
            // other would leave it resolving through nothing.
            if Some(slot.address()) != sb.spec.network.address {
                return Ok(false);
            }
            sb.attach_network(net, crate::net::Slot::Reserved(slot)).map(|()| true)
        });
        match attached {
            Ok(true) => {}
            Ok(false) => tracing::warn!(
                "sandbox {} keeps running without its network: its address {:?} is not in {} now",
                sb.id,
                sb.spec.network.address,
                net.config().range
            ),
            Err(e) => {
                tracing::warn!("sandbox {} keeps running without its network: {}", sb.id, crate::error::chain(&e))
            }
        }
    }

    pub fn max_sandboxes(&self) -> usize {
        self.max_sandboxes
    }

    // ---- images ----

    /// Start every background thread (each file's `start_*`), in this
    /// order: the warm pool and teardown first (launches and removals use
    /// them at once), then the writers of what operations leave behind
    /// (blobs, exec records, pulled layers), the reaper and the metrics
    /// sampler, the ready pools, the periodic `gc` (every `gc_interval`;
    /// never if zero), and last the heartbeat and the publisher, which
    /// speak for this host to the fleet.
    pub fn start_background(self: &Arc<Self>, gc_interval: std::time::Duration) {
        let _ = self.me.set(Arc::downgrade(self));
        self.start_warm_pool();
        self.start_teardown();
        self.start_blob_writer();
        self.start_exec_log();
        self.start_hydrator();
        self.start_reaper();
        self.start_metrics();
        self.start_ready_pools();
        self.start_gc(gc_interval, self.cfg.retention, self.cfg.stale_after);
        self.start_heartbeat();
        self.start_publisher();
    }

    /// Start the background blob writer (suspended sandboxes' snapshots)
    /// and queue the blobs a previous daemon left pending.
    pub fn start_blob_writer(self: &Arc<Self>) {
        let (tx, rx) = std::sync::mpsc::channel::<String>();
        let d = self.clone();
        let spawned =
            background("blob-writer", "the blobs of suspended sandboxes are written at the next start", move || {
                let _ = strata_shim::sys::set_thread_nice(10);
                for id in rx {
                    if let Err(e) = d.seal_blob(&id) {
                        tracing::error!("write blob of snapshot {id}: {}", crate::error::chain(&e));
                    }
                }
            });
        if spawned.is_none() {
            return;
        }
        if let Ok(pending) = lock(&self.db).pending_blobs() {
            for id in pending {
                let _ = tx.send(id);
            }
        }
        *lock(&self.blobs) = Some(tx);
    }

    pub(crate) fn queue_blob(&self, id: &str) {
        if let Some(tx) = lock(&self.blobs).as_ref() {
            let _ = tx.send(id.to_string());
        }
    }

    /// Stop refilling and tear down every warm shim. Live sandboxes keep
    /// running; the next daemon re-adopts them.
    pub fn shutdown(&self) {
        self.stopping.store(true, std::sync::atomic::Ordering::Release);
        self.stop_exec_log();
        self.stop_teardown();
        self.drop_ready(None);
        {
            // End the seal under way (its worker is killed; the snapshot
            // stays pending for the next start) and start no other.
            let mut sealing = lock(&self.sealing);
            sealing.stopped = true;
            if let Some(cg) = sealing.cgroup.take() {
                if let Err(e) = crate::sandbox::remove_capture_cgroup(&cg, std::time::Duration::from_secs(5)) {
                    tracing::warn!("remove capture cgroup beside {cg}: {}", crate::error::chain(&e));
                }
            }
        }
        self.stop_warm_pool();
        // Leave no empty parent cgroup behind; with live sandboxes it is
        // not empty and stays (they are re-adopted at the next start).
        if lock(&self.pool).live.is_empty() {
            let _ =
                crate::sandbox::cgroups::SandboxCgroup::load(&self.cfg.cgroup_parent).remove(std::time::Duration::ZERO);
        }
        // Last: no heartbeat may follow the row's "stopped".
        if let Some(h) = lock(&self.heartbeat).take() {
            let _ = h.join();
        }
        if let Err(e) = lock(&self.db).host_stopped() {
            tracing::warn!("record this host's stop: {}", crate::error::chain(&e));
        }
        // Sandboxes that outlive the daemon have no network until the next
        // start: nothing would enforce their policy meanwhile.
        if let Some(net) = &self.net {
            net.stop();
        }
    }

    /// Remove a sandbox and return once all of it is gone: processes,
    /// cgroups, mounts, files and row. A failure leaves it live, for a
    /// later removal to try again (every step can be repeated).
    pub fn remove_sandbox_now(&self, id: &str) -> Result<(), SandboxOpError> {
        let sb = self.sandbox(id)?;
        if !sb.begin_stop() {
            return Err(SandboxOpError::BeingRemoved(sb.id.clone()));
        }
        let removed = lock(&self.db).set_sandbox_state(&sb.id, SandboxState::Stopped).map_err(SandboxOpError::from);
        let removed = removed.and_then(|()| {
            if crate::failpoint::fails("rm:destroy") {
                return Err(SandboxOpError::Invalid("failpoint rm:destroy".into()));
            }
            sb.destroy(&self.rt.store).map_err(SandboxOpError::from)
        });
        if let Err(e) = removed {
            sb.end_stop();
            // Its row as it was: a row left stopped is a removal another
            // host asked for, which the heartbeat carries out.
            let state = match sb.run_state() {
                sandbox::RunState::Paused => SandboxState::Paused,
                _ => SandboxState::Running,
            };
            if let Err(db) = lock(&self.db).unstop_sandbox(&sb.id, state) {
                tracing::warn!(
                    "sandbox {}: restore its row after a failed removal: {}",
                    sb.id,
                    crate::error::chain(&db)
                );
            }
            return Err(e);
        }
        lock(&self.db).delete_sandbox(&sb.id)?;
        lock(&self.pool).live.remove(&sb.id);
        self.slots.notify_all();
        Ok(())
    }

    /// Remove a sandbox: return once it can run nothing more (its PID 1
    /// is sent SIGKILL) and its row is gone; its processes, cgroups and
    /// files go on the teardown thread (see [`teardown`]).
    pub fn remove_sandbox(&self, id: &str) -> Result<(), SandboxOpError> {
        let sb = self.sandbox(id)?;
        if !sb.begin_stop() {
            return Err(SandboxOpError::BeingRemoved(sb.id.clone()));
        }
        if let Err(e) = lock(&self.db).delete_sandbox(&sb.id) {
            sb.end_stop();
            return Err(e.into());
        }
        sb.kill();
        {
            let mut pool = lock(&self.pool);
            pool.live.remove(&sb.id);
            pool.removing.insert(sb.id.clone(), sb.clone());
        }
        self.tear_down(Arc::clone(&sb));
        Ok(())
    }
}
