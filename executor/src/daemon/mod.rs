//! The daemon: owns the store, the database, the live sandboxes and the
//! execution pool's bound; every API operation is a method here.
//!
//! Start-up order: lock the root (one daemon per root), open the database
//! (migrations), re-adopt live sandboxes, clean up those that died, then
//! sweep `tmp/` and directories the database does not know.
//!
//! The verbs live in files of their own: `snapshots` (checkpoint, suspend,
//! resume, fork, rollback, diff, logs, export, snapshot rm), `lineage`,
//! `baseline`, `distribution` (push and pull), `gc` (retention and the
//! collector); `copy.rs` at the crate root holds `cp`. Background work
//! has files too: `warm` (the warm pool, plain and wired shims),
//! `teardown`, `execlog`, `ready` (ready pools).

pub mod baseline;
pub mod distribution;
mod execlog;
pub mod fleet;
pub mod gc;
pub mod host;
pub mod lifetime;
pub mod lineage;
pub mod metrics;
pub mod network;
pub mod ready;
pub mod requests;
pub mod results;
pub mod secrets;
pub mod snapshots;
pub mod teardown;
pub mod telemetry;
mod warm;

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};

use nix::fcntl::{Flock, FlockArg};

use crate::cgroups::Limits;
use crate::db::{Db, DbError, ImageRow, SandboxState};
use crate::error::{Classify, ErrorKind};
use crate::ids::{ImageName, LayerId, SandboxId, SnapshotId};
use crate::image;
use crate::sandbox::{self, ExecDefaults, Runtime, Sandbox};
use crate::spec::{MountDecl, SandboxSpec};
use crate::store::{Store, StoreError};
use crate::types::{CreateRequest, ImageInfo, SandboxInfo};

// ---- what each operation can fail with (issue 18.2: one enum per
// operation, its doc comments the messages; `Classify` gives the kind) ----

/// Why `import_image` failed.
#[derive(Debug, thiserror::Error, displaydoc::Display)]
pub enum ImportError {
    /// {0}
    Name(#[from] crate::ids::BadImageName),
    /// path must be absolute (it is read by the daemon)
    Relative,
    /// {0} does not exist
    Missing(String),
    /// {0}
    Import(#[from] image::ImageError),
}

impl Classify for ImportError {
    fn kind(&self) -> ErrorKind {
        match self {
            ImportError::Name(_) | ImportError::Relative | ImportError::Missing(_) => ErrorKind::InvalidArgument,
            ImportError::Import(e) => e.kind(),
        }
    }
}

/// Why `get_image` or `remove_image` failed.
#[derive(Debug, thiserror::Error, displaydoc::Display)]
pub enum ImageOpError {
    /// {0}
    Name(#[from] crate::ids::BadImageName),
    /// image {0} not found
    NotFound(ImageName),
    /// {0}
    Image(#[from] image::ImageError),
    /// {0}
    Db(#[from] DbError),
    /// {0}
    Collect(#[from] CollectError),
}

impl Classify for ImageOpError {
    fn kind(&self) -> ErrorKind {
        match self {
            ImageOpError::Name(_) => ErrorKind::InvalidArgument,
            ImageOpError::NotFound(_) => ErrorKind::NotFound,
            ImageOpError::Image(e) => e.kind(),
            ImageOpError::Db(e) => e.kind(),
            ImageOpError::Collect(e) => e.kind(),
        }
    }
}

/// Why a sandbox could not be started (create, and the launches of
/// resume, fork, rollback and a lineage's resume).
#[derive(Debug, thiserror::Error, displaydoc::Display)]
pub enum LaunchError {
    /// seccomp {0:?} must be "default" or "unconfined"
    Seccomp(String),
    /// {0}
    Limits(#[from] crate::cgroups::LimitsError),
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

/// Why `create_sandbox` failed.
#[derive(Debug, thiserror::Error, displaydoc::Display)]
pub enum CreateError {
    /// {0}
    Name(#[from] crate::ids::BadImageName),
    /// image {0} not found
    NoImage(ImageName),
    /// {0}
    Launch(#[from] LaunchError),
    /// {0}
    Lineage(#[from] lineage::LineageError),
    /// {0}
    Baseline(#[from] baseline::BaselineError),
    /// {0}
    Db(#[from] DbError),
}

impl Classify for CreateError {
    fn kind(&self) -> ErrorKind {
        match self {
            CreateError::Name(_) => ErrorKind::InvalidArgument,
            CreateError::NoImage(_) => ErrorKind::NotFound,
            CreateError::Launch(e) => e.kind(),
            CreateError::Lineage(e) => e.kind(),
            CreateError::Baseline(e) => e.kind(),
            CreateError::Db(e) => e.kind(),
        }
    }
}

/// How [`Daemon::exec_with`] starts a buffered exec and waits for it
/// (the sandbox, the request with the daemon's settings, its input).
pub type RunExec<'a> =
    dyn FnMut(&Sandbox, &sandbox::ExecRequest, Vec<u8>) -> Result<sandbox::ExecOutput, sandbox::SandboxError> + 'a;

/// Why an operation on a live sandbox (look-up, pause, unpause, exec,
/// remove) failed.
#[derive(Debug, thiserror::Error, displaydoc::Display)]
pub enum SandboxOpError {
    /// sandbox {0} not found
    NotFound(String),
    /// sandbox {0} is already being removed
    BeingRemoved(SandboxId),
    /// sandbox {0} is past its deadline or idle timeout and going (removed or suspended); too late to renew
    Expiring(SandboxId),
    /// {0}
    Invalid(String),
    /// {0}
    Sandbox(#[from] sandbox::SandboxError),
    /// {0}
    Db(#[from] DbError),
}

impl Classify for SandboxOpError {
    fn kind(&self) -> ErrorKind {
        match self {
            SandboxOpError::NotFound(_) => ErrorKind::NotFound,
            SandboxOpError::BeingRemoved(_) | SandboxOpError::Expiring(_) => ErrorKind::Conflict,
            SandboxOpError::Invalid(_) => ErrorKind::InvalidArgument,
            SandboxOpError::Sandbox(e) => e.kind(),
            SandboxOpError::Db(e) => e.kind(),
        }
    }
}

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
    pub limit_policy: crate::cgroups::LimitPolicy,
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
    pub registry: Option<fleet::FleetRegistry>,
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

/// What a sandbox starts from: an image and a layer chain (the image's
/// layers, plus a snapshot chain when resuming or forking).
pub struct Base {
    pub image: ImageRow,
    pub layers: Vec<LayerId>,
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
    pub userns_map: Option<crate::userns::UsernsMap>,
    /// The network asked for; `None`: the base's (else none).
    pub network: Option<crate::net::NetworkSpec>,
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

/// A pin on a snapshot for as long as a launch from it is in flight (see
/// [`Pool::pinned`]); unpinned on drop.
pub(crate) struct SnapshotPin<'d> {
    daemon: &'d Daemon,
    id: String,
}

impl Daemon {
    /// Pin `id` against removal; refused if it is being removed.
    pub(crate) fn pin_snapshot(&self, id: &SnapshotId) -> Result<SnapshotPin<'_>, snapshots::SnapshotLookupError> {
        let mut pool = lock(&self.pool);
        if pool.doomed.contains(id.as_str()) {
            return Err(snapshots::SnapshotLookupError::BeingRemoved(id.clone()));
        }
        *pool.pinned.entry(id.to_string()).or_default() += 1;
        Ok(SnapshotPin { daemon: self, id: id.to_string() })
    }
}

impl Drop for SnapshotPin<'_> {
    fn drop(&mut self) {
        let mut pool = lock(&self.daemon.pool);
        if let Some(n) = pool.pinned.get_mut(&self.id) {
            *n -= 1;
            if *n == 0 {
                pool.pinned.remove(&self.id);
            }
        }
    }
}

pub struct Daemon {
    pub cfg: DaemonConfig,
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

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The longest a launch may queue for a slot (`wait`, seconds).
pub const MAX_WAIT_SECS: u64 = 3600;

/// Default pool size: one sandbox per 128 MiB of host memory, at least 1.
pub fn default_max_sandboxes() -> usize {
    use procfs::Current;
    let bytes = procfs::Meminfo::current().map(|m| m.mem_total).unwrap_or(1 << 30);
    ((bytes >> 27) as usize).clamp(1, 4096)
}

fn valid_hostname(h: &str) -> bool {
    !h.is_empty()
        && h.len() <= 63
        && h.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.')
        && !h.starts_with(['-', '.'])
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
        let registered = db.register_host(&crate::db::HostClaim {
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
            let cg = crate::cgroups::SandboxCgroup::load(&self.rt.cgroup_path(&id));
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

    /// An adopted sandbox's defaults: its secrets from its lineage's file.
    /// A launch's secret env: what it names, else what this host keeps of
    /// its lineage.
    pub(crate) fn secrets_for(&self, work_context: &str, given: &[String]) -> Result<Vec<String>, LaunchError> {
        if given.is_empty() {
            return Ok(self.secrets.read(work_context).map_err(LaunchError::Secrets)?.unwrap_or_default());
        }
        Ok(given.to_vec())
    }

    /// A launch that named secret env was recorded: they are its lineage's
    /// now (a launch that failed changed nothing). A write that fails
    /// leaves the sandbox running with them, but a restart or a later
    /// resume would not find them: said in the log.
    pub(crate) fn keep_secrets(&self, work_context: &str, given: &[String]) {
        if given.is_empty() {
            return;
        }
        if let Err(e) = self.secrets.write(work_context, given) {
            tracing::error!("lineage {work_context}: keep its secret env: {e} (a restart or resume will lack it)");
        }
    }

    /// A lineage ended: this host's copy of its secrets goes.
    pub(crate) fn forget_secrets(&self, work_context: &str) {
        if let Err(e) = self.secrets.remove(work_context) {
            tracing::warn!("lineage {work_context}: remove its secret env: {e}");
        }
    }

    fn defaults_for(&self, image_id: &i64, spec: &SandboxSpec) -> Result<ExecDefaults, LaunchError> {
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
    fn exec_defaults(
        &self,
        image: &ImageRow,
        spec: &SandboxSpec,
        secrets: &[String],
    ) -> Result<ExecDefaults, LaunchError> {
        let layers: Vec<PathBuf> = image.layers.iter().rev().map(|h| self.rt.store.layer_dir(h).join("fs")).collect();
        ExecDefaults::new(&image.config, &[&spec.env[..], secrets].concat(), &layers).map_err(LaunchError::Defaults)
    }

    pub fn max_sandboxes(&self) -> usize {
        self.max_sandboxes
    }

    // ---- images ----

    pub fn import_image(&self, path: &str, tag: Option<&str>, name: &str) -> Result<ImageInfo, ImportError> {
        let name: ImageName = name.parse()?;
        let path = PathBuf::from(path);
        if !path.is_absolute() {
            return Err(ImportError::Relative);
        }
        if !path.exists() {
            return Err(ImportError::Missing(path.display().to_string()));
        }
        let _serial = lock(&self.import_lock);
        let row = self.leased(|lease| image::import(&self.rt.store, &self.db, &path, tag, &name, lease))?;
        Ok(image_info(&row))
    }

    pub fn list_images(&self) -> Result<Vec<ImageInfo>, DbError> {
        Ok(lock(&self.db).list_images()?.iter().map(image_info).collect())
    }

    pub fn get_image(&self, name: &str) -> Result<ImageInfo, ImageOpError> {
        let name: ImageName = name.parse()?;
        let row = lock(&self.db).image_by_name(&name)?;
        row.map(|r| image_info(&r)).ok_or(ImageOpError::NotFound(name))
    }

    pub fn remove_image(&self, name: &str) -> Result<(), ImageOpError> {
        let name: ImageName = name.parse()?;
        let _serial = lock(&self.import_lock);
        let unlisted = image::remove(&self.db, &name)?;
        // Its ready sandboxes go with it (they hold its layers).
        self.drop_ready(Some(&name));
        self.collect(crate::store::Scope::Released, unlisted)?;
        Ok(())
    }

    // ---- sandboxes ----

    pub fn create_sandbox(&self, req: CreateRequest) -> Result<SandboxInfo, CreateError> {
        // Validate everything before reserving anything.
        let name: ImageName = req.image.parse()?;
        let launch = crate::types::LaunchRequest {
            memory: req.memory,
            pids: req.pids,
            cpus: req.cpus,
            disk: req.disk,
            env: req.env,
            secret_env: req.secret_env,
            hostname: req.hostname,
            count: None,
            scratch: req.scratch,
            cache: req.cache,
            seccomp: req.seccomp,
            userns: req.userns,
            timeout: req.timeout,
            on_timeout: req.on_timeout,
            idle_timeout: req.idle_timeout,
            id: req.id,
            wait: req.wait,
            network: req.network,
        };
        if let Some(key) = &req.baseline {
            return Ok(self.create_from_baseline(key, &req.image, req.work_context.as_deref(), launch)?);
        }
        let launch = self.launch_spec(launch)?;
        let image = lock(&self.db).image_by_name(&name)?.ok_or(CreateError::NoImage(name))?;
        let wc = self.new_lineage(req.work_context.as_deref(), image.id, crate::model::StartKind::Image, None)?;
        let base = Base {
            layers: image.layers.clone(),
            image,
            snapshot: None,
            work_context: wc.clone(),
            observed_head: None,
            rung: crate::model::Rung::Image,
            captured_in_userns: false,
            fell: Vec::new(),
            network: None,
        };
        match self.launch(&base, launch) {
            Ok(sb) => Ok(sandbox_info(&sb)),
            Err(e) => {
                let _ = lock(&self.db).delete_unused_work_context(&wc);
                Err(e.into())
            }
        }
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
        } = req;
        if wait.is_some_and(|w| w > MAX_WAIT_SECS) {
            return Err(LaunchError::Wait(MAX_WAIT_SECS));
        }
        let wait = wait.map(std::time::Duration::from_secs);
        if id.is_some() && count.is_some_and(|c| c > 1) {
            return Err(LaunchError::IdWithCount);
        }
        let id = id.map(|i| i.parse::<SandboxId>().map_err(|_| LaunchError::BadId(i))).transpose()?;
        let lifetime = lifetime::lifetime(timeout, on_timeout, idle_timeout, self.cfg.on_timeout)
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
                if matches!(e, LaunchError::Db(DbError::LineageHeld { .. })) {
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
        let cold = fixed_id.is_some() || launch.limits.disk.is_some() || userns;
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
    fn alloc_userns(&self) -> Result<crate::userns::UsernsMap, LaunchError> {
        let base = self.cfg.userns_base;
        let slots = crate::userns::slots(base).max(1);
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
            if let Some(map) = crate::userns::range(base, slot) {
                let (start, end) = (u64::from(map.host_id), u64::from(map.host_id) + u64::from(map.size));
                if !used.iter().any(|&(s, e)| start < e && s < end) {
                    return Ok(map);
                }
            }
        }
        Err(LaunchError::NoUsernsRange)
    }

    /// Start the background blob writer (suspended sandboxes' snapshots)
    /// and queue the blobs a previous daemon left pending.
    pub fn start_blob_writer(self: &Arc<Self>) {
        let (tx, rx) = std::sync::mpsc::channel::<String>();
        let d = self.clone();
        let spawned = std::thread::Builder::new().name("blob-writer".into()).spawn(move || {
            let _ = strata_shim::sys::set_thread_nice(10);
            for id in rx {
                if let Err(e) = d.seal_blob(&id) {
                    tracing::error!("write blob of snapshot {id}: {}", crate::error::chain(&e));
                }
            }
        });
        if let Err(e) = spawned {
            tracing::error!("start blob writer: {e}");
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
            let _ = crate::cgroups::SandboxCgroup::load(&self.cfg.cgroup_parent).remove(std::time::Duration::ZERO);
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

    /// Run a command in a sandbox to completion, its output buffered, and
    /// log it.
    pub fn exec(
        &self,
        sb: &Sandbox,
        req: &sandbox::ExecRequest,
        stdin: Vec<u8>,
    ) -> Result<sandbox::ExecOutput, SandboxOpError> {
        self.exec_with(sb, req, stdin, &mut |sb, req, stdin| sb.exec_buffered(req, stdin))
    }

    /// [`Daemon::exec`], the command started and waited for by `run` (the
    /// API's server waits on its async worker for a while before it hands
    /// the worker's other tasks to another thread: `api::serve`).
    pub fn exec_with(
        &self,
        sb: &Sandbox,
        req: &sandbox::ExecRequest,
        stdin: Vec<u8>,
        run: &mut RunExec<'_>,
    ) -> Result<sandbox::ExecOutput, SandboxOpError> {
        let _busy = sb.busy();
        let req = &sandbox::ExecRequest { keep_output: self.cfg.keep_output, ..req.clone() };
        let out = run(sb, req, stdin)?;
        self.record_exec(sb, req, &out.summary);
        Ok(out)
    }

    /// Run a command in a sandbox attached to `conn` (the exec stream
    /// protocol); `started` is called once it runs, before any frame. The
    /// command is logged when it ends, before its exit frame is sent.
    pub fn exec_attached(
        &self,
        sb: &Arc<Sandbox>,
        req: &sandbox::ExecRequest,
        conn: std::os::unix::net::UnixStream,
        started: impl FnOnce(&mut std::os::unix::net::UnixStream) -> std::io::Result<()>,
    ) -> Result<(), SandboxOpError> {
        let _busy = sb.busy();
        let req = &sandbox::ExecRequest { keep_output: self.cfg.keep_output, ..req.clone() };
        sb.exec_attached(req, conn, started, &mut |summary| self.record_exec(sb, req, summary))?;
        Ok(())
    }

    /// Follow a command [`Sandbox::spawn`] left running (E2B's processes):
    /// its output to `sink` until it ends (or `timeout` kills it), then
    /// log it. The sandbox counts as busy meanwhile.
    pub fn follow(
        &self,
        sb: &Sandbox,
        req: &sandbox::ExecRequest,
        output: sandbox::SpawnedOutput,
        timeout: Option<std::time::Duration>,
        sink: &mut dyn FnMut(crate::stream::FrameKind, &[u8]),
    ) -> Result<(strata_shim::proto::ExitStatus, bool), SandboxOpError> {
        let _busy = sb.busy();
        let (started_at, start) = (std::time::SystemTime::now(), std::time::Instant::now());
        let (mut kept, mut output_bytes) = (crate::model::KeptOutput::default(), 0u64);
        let (status, timed_out) = sb.follow(output, timeout, &mut |kind, data| {
            output_bytes += data.len() as u64;
            kept.keep(self.cfg.keep_output, kind == crate::stream::FrameKind::Stdout, data);
            sink(kind, data);
            true
        })?;
        let summary = sandbox::ExecSummary { status, started_at, duration: start.elapsed(), output_bytes, kept };
        self.record_exec(sb, req, &summary);
        Ok((status, timed_out))
    }

    /// A live sandbox of this host by id, not marked in use (for the
    /// daemon's own work on it, which must not count as activity).
    pub fn live_sandbox(&self, id: &str) -> Option<Arc<Sandbox>> {
        let id: SandboxId = id.parse().ok()?;
        lock(&self.pool).live.get(&id).cloned()
    }

    /// A live sandbox by id, in use until the handle is dropped: no idle
    /// suspend cuts into the call that looked it up, and its idle timeout
    /// starts again when the call ends.
    pub fn sandbox(&self, id: &str) -> Result<sandbox::InUse, SandboxOpError> {
        let id: SandboxId = id.parse().map_err(|_| SandboxOpError::NotFound(format!("{id:?}")))?;
        let sb = lock(&self.pool).live.get(&id).cloned().ok_or_else(|| SandboxOpError::NotFound(id.to_string()))?;
        Ok(sandbox::InUse::new(sb))
    }

    pub fn list_sandboxes(&self) -> Vec<SandboxInfo> {
        // Clone the handles first: a sandbox's state lock may be held by a
        // slow freeze, and the pool lock must not wait on it.
        let live: Vec<Arc<Sandbox>> = lock(&self.pool).live.values().cloned().collect();
        let mut v: Vec<SandboxInfo> = live.iter().map(|s| sandbox_info(s)).collect();
        v.sort_by(|a, b| (a.created_at, &a.id).cmp(&(b.created_at, &b.id)));
        v
    }

    /// Freeze every process of a sandbox in place (temporal snapshot).
    pub fn pause_sandbox(&self, id: &str) -> Result<(), SandboxOpError> {
        let sb = self.sandbox(id)?;
        sb.pause()?;
        lock(&self.db).set_sandbox_state(&sb.id, SandboxState::Paused)?;
        Ok(())
    }

    pub fn unpause_sandbox(&self, id: &str) -> Result<(), SandboxOpError> {
        let sb = self.sandbox(id)?;
        sb.unpause()?;
        lock(&self.db).set_sandbox_state(&sb.id, SandboxState::Running)?;
        Ok(())
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

pub(crate) fn image_info(r: &ImageRow) -> ImageInfo {
    ImageInfo {
        name: r.name.clone(),
        manifest_digest: r.manifest_digest.to_string(),
        config_digest: r.config_digest.to_string(),
        layers: r.layers.iter().map(|h| format!("sha256:{h}")).collect(),
        created_at: r.created_at,
    }
}

pub fn sandbox_info(s: &Sandbox) -> SandboxInfo {
    SandboxInfo {
        id: s.id.to_string(),
        image: s.spec.image.clone(),
        state: if s.is_alive() { s.run_state().to_string() } else { "exited".to_string() },
        limits: s.spec.limits,
        hostname: s.spec.hostname.clone(),
        created_at: s.created_at,
        shim_pid: s.shim_pid,
        cgroup: s.cgroup_path().to_string(),
        mounts: s.spec.mounts.clone(),
        userns: s.spec.userns,
        work_context: s.spec.work_context.clone(),
        restored: s.spec.restored.clone(),
        seccomp: if s.spec.seccomp_unconfined { "unconfined" } else { "default" }.into(),
        lifetime: s.lifetime(),
        network: s.network_spec(),
        secret_env: s.spec.secret_names.clone(),
    }
}
