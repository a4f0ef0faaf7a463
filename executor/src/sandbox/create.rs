//! Creating a sandbox, and re-adopting one after a daemon restart.
//!
//! Order (each step undone on failure, in reverse):
//! 1. private dirs `sandboxes/<id>/{upper,work,rootfs}`;
//! 2. the cgroup with its limits;
//! 3. a listening socket at `shim.sock`, then `clone3` of `strata-shim` into
//!    new mount/PID/UTS/IPC/net namespaces with the listener at fd 3;
//! 4. the shim's pid into the cgroup — before it gets its spec, so every
//!    process it ever forks is accounted there;
//! 5. connect, send the [`SetupSpec`], wait for `Ready`.

use std::ffi::CString;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use nix::sys::socket::{bind, listen, socket, AddressFamily, Backlog, SockFlag, SockType, UnixAddr};
use strata_shim::proto::{ExtraMount, SetupSpec};
use strata_shim::sys;

use super::{destroy, process_start_time, ExecDefaults, Sandbox, SandboxError};
use crate::catalog::SandboxRow;
use crate::ids::SandboxId;
use crate::sandbox::cgroups::{Join, SandboxCgroup};
use crate::sandbox::shim_client::{self, ShimClient, ShimError};
use crate::spec::SandboxSpec;
use crate::store::{Store, StoreError};

/// How long a shim may take to set a sandbox up or answer after a restart.
const SETUP_TIMEOUT: Duration = Duration::from_secs(10);

/// What creating sandboxes needs from the daemon.
pub struct Runtime {
    pub store: Store,
    /// The shim, run from a read-only overlay no sandbox can change.
    pub shim: std::sync::Arc<super::ShimExe>,
    /// Parent cgroup, named for Strata (e.g. `strata`).
    pub cgroup_parent: String,
}

impl Runtime {
    pub fn cgroup_path(&self, id: &SandboxId) -> String {
        format!("{}/{}", self.cgroup_parent, id)
    }

    /// Layer `fs` dirs of a chain (bottom first), topmost first as
    /// overlay's lowerdir wants them. A layer in it twice (layers are named
    /// by content: two checkpoints with nothing changed between them, or an
    /// image's empty layers) would make overlay refuse the mount (ELOOP, a
    /// lower dir used twice), so only its topmost place is kept: the same
    /// layer above decides every path the one below touches (its files,
    /// whiteouts and opaque directories again), and a path it does not
    /// touch was not the lower copy's either.
    pub fn lowers(&self, layers: &[crate::ids::LayerId]) -> Vec<PathBuf> {
        let mut seen = std::collections::HashSet::new();
        layers.iter().rev().filter(|l| seen.insert(*l)).map(|hex| Store::lower_rel(hex)).collect()
    }
}

fn io(step: &'static str) -> impl FnOnce(std::io::Error) -> SandboxError {
    move |source| SandboxError::Io { step, source }
}

fn nix_io(step: &'static str) -> impl FnOnce(nix::Error) -> SandboxError {
    move |e| SandboxError::Io { step, source: e.into() }
}

/// A shim started in fresh namespaces inside its own (not yet limited)
/// cgroup, connected and waiting for its [`SetupSpec`]. The daemon keeps a
/// few of these warm so that `create` pays only for the sandbox's mounts.
/// Dropping one that was never started tears it down.
pub struct Prepared {
    pub id: SandboxId,
    parts: Option<PreparedParts>,
    store: Store,
}

struct PreparedParts {
    dirs: crate::store::SandboxDirs,
    cgroup: Option<SandboxCgroup>,
    shim: Option<(i32, OwnedFd)>,
    conn: Option<OwnedFd>,
}

impl Prepared {
    /// Its shim's pidfd (while it has one): what a warm shim's network is
    /// wired into ahead of its create.
    pub fn pidfd(&self) -> Option<&OwnedFd> {
        self.parts.as_ref()?.shim.as_ref().map(|(_, fd)| fd)
    }

    /// Whether its shim still runs and its connection is open: a warm shim
    /// can die while it waits (killed, out of memory, a failed exec), and
    /// one handed out dead failed the create it was given to.
    pub fn is_alive(&self) -> bool {
        use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
        let Some(p) = &self.parts else { return false };
        let (Some((_, pidfd)), Some(conn)) = (&p.shim, &p.conn) else { return false };
        // A pidfd is readable once its process has exited; a connection
        // whose peer is gone reports a hang-up.
        let mut fds = [PollFd::new(pidfd.as_fd(), PollFlags::POLLIN), PollFd::new(conn.as_fd(), PollFlags::POLLIN)];
        match poll(&mut fds, PollTimeout::ZERO) {
            Ok(0) => true,
            Ok(_) => !fds.iter().any(|f| {
                f.revents().is_some_and(|r| r.intersects(PollFlags::POLLIN | PollFlags::POLLHUP | PollFlags::POLLERR))
            }),
            Err(_) => false,
        }
    }
}

impl Drop for Prepared {
    fn drop(&mut self) {
        let Some(mut p) = self.parts.take() else { return };
        let id = &self.id;
        if let Some((pid, pidfd)) = p.shim.take() {
            if let Err(e) = destroy::kill_and_reap(pid, pidfd.as_fd()) {
                tracing::error!("discard prepared sandbox {id}: {}", crate::error::chain(&e));
            }
        }
        if let Some(cg) = p.cgroup.take() {
            if let Err(e) = cg.remove(Duration::from_secs(5)) {
                tracing::error!("discard prepared sandbox {id}: {}", crate::error::chain(&e));
            }
        }
        if let Err(e) = self.store.discard_sandbox(id) {
            tracing::error!("discard prepared sandbox {id}: {}", crate::error::chain(&e));
        }
    }
}

/// A failed setup. When the shim reported its failure, its chain is the
/// error; otherwise (it exited before answering, or did not answer) the
/// last line it wrote to its log says why.
fn setup_error(log: &Path, source: ShimError) -> SandboxError {
    let said = match source {
        ShimError::SetupFailed(_) => String::new(),
        _ => log_tail(log),
    };
    SandboxError::Setup { said, source }
}

/// The last non-empty line of a shim's log (its last 4 KiB read).
fn log_tail(log: &Path) -> String {
    use std::io::{Read, Seek, SeekFrom};
    let mut buf = Vec::new();
    if let Ok(mut f) = std::fs::File::open(log) {
        let _ = f.seek(SeekFrom::End(-4096)).or_else(|_| f.rewind().map(|()| 0));
        let _ = f.take(4096).read_to_end(&mut buf);
    }
    let text = String::from_utf8_lossy(&buf);
    text.lines().rev().map(str::trim).find(|l| !l.is_empty()).unwrap_or_default().to_string()
}

/// `strata-shim ID [ROOT]`: with the sandbox's root mount point the shim
/// builds its /proc, /dev and /sys there before it is handed its spec
/// (`setup::stage` in the shim; not with a user namespace, where that path
/// is closed to it).
fn shim_argv(id: &SandboxId, stage_at: Option<&Path>) -> Vec<CString> {
    let mut argv = vec![CString::new("strata-shim").unwrap_or_default(), CString::new(id.as_str()).unwrap_or_default()];
    if let Some(at) = stage_at.and_then(|p| CString::new(p.as_os_str().as_encoded_bytes()).ok()) {
        argv.push(at);
    }
    argv
}

/// The network namespace at `path`, opened to be joined: an absolute path
/// whose file is a network namespace (nsfs says so), such as
/// `/var/run/netns/NAME` or `/proc/PID/ns/net`.
pub fn open_netns(path: &Path) -> Result<std::fs::File, SandboxError> {
    let bad = |why: String| SandboxError::Netns { path: path.to_path_buf(), why };
    if !path.is_absolute() {
        return Err(bad("must be an absolute path".into()));
    }
    let f = std::fs::File::open(path).map_err(|e| bad(e.to_string()))?;
    match sys::is_network_namespace(f.as_fd()) {
        Ok(true) => Ok(f),
        Ok(false) => Err(bad("is not a network namespace".into())),
        Err(e) => Err(bad(e.to_string())),
    }
}

/// Steps 1-4 (and the connection of step 5): everything that does not
/// depend on the image or the limits.
/// With a disk cap the sandbox's disk is made and mounted first; with a
/// user namespace map the shim is cloned into a new user namespace too; with
/// `netns` it joins that network namespace instead of making its own.
pub fn prepare(
    rt: &Runtime,
    id: &SandboxId,
    disk: Option<u64>,
    userns: Option<crate::spec::UsernsMap>,
    netns: Option<&std::fs::File>,
) -> Result<Prepared, SandboxError> {
    let mut t = super::Phases::start("prepare");
    let dirs = rt.store.prepare_sandbox(id, disk, userns.is_some()).map_err(SandboxError::Dirs)?;
    let mut prep = Prepared {
        id: id.clone(),
        parts: Some(PreparedParts { dirs: dirs.clone(), cgroup: None, shim: None, conn: None }),
        store: rt.store.clone(),
    };
    let parts = prep.parts.as_mut().ok_or(SandboxError::Dead(id.clone()))?;
    t.mark("dirs");

    parts.cgroup = Some(SandboxCgroup::create(&rt.cgroup_path(id), &Default::default()).map_err(SandboxError::Cgroup)?);
    t.mark("cgroup");

    let listener = socket(AddressFamily::Unix, SockType::SeqPacket, SockFlag::SOCK_CLOEXEC, None)
        .map_err(nix_io("create shim socket"))?;
    let addr = UnixAddr::new(&dirs.socket).map_err(nix_io("shim socket path"))?;
    bind(listener.as_raw_fd(), &addr).map_err(nix_io("bind shim socket"))?;
    listen(&listener, Backlog::new(8).map_err(nix_io("listen"))?).map_err(nix_io("listen on shim socket"))?;

    let log = std::fs::OpenOptions::new().create(true).append(true).open(&dirs.log).map_err(io("open shim log"))?;
    let devnull = std::fs::File::open("/dev/null").map_err(io("open /dev/null"))?;
    // Born in its cgroup (see `Join`); with a user namespace on v1 (kept
    // simple), or where it cannot be, moved there by pid below.
    let join = match &parts.cgroup {
        Some(cg) => cg.join().map_err(SandboxError::Cgroup)?,
        None => Join::ByPid,
    };
    let (cgroup_tasks, cgroup_dir) = match (&join, &userns) {
        (Join::Tasks(files), None) => {
            let files = files.iter().map(|t| CString::new(t.as_os_str().as_encoded_bytes()));
            (files.collect::<Result<_, _>>().unwrap_or_default(), None)
        }
        (Join::Dir(dir), _) => (Vec::new(), Some(dir.as_fd())),
        _ => (Vec::new(), None),
    };
    let mut plan = sys::SpawnPlan {
        argv: shim_argv(id, userns.is_none().then_some(dirs.rootfs.as_path())),
        envp: vec![CString::new("PATH=/usr/sbin:/usr/bin:/sbin:/bin").unwrap_or_default()],
        exe: rt.shim.fd(),
        listener,
        log: log.into(),
        devnull: devnull.into(),
        userns_gate: None,
        cgroup_dir,
        cgroup_tasks,
        netns: netns.map(|f| f.as_fd()),
    };
    let joins = !plan.cgroup_tasks.is_empty() || plan.cgroup_dir.is_some();
    let gate = match userns {
        Some(_) => {
            let (r, w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(nix_io("create userns gate pipe"))?;
            plan.userns_gate = Some(r);
            Some(w)
        }
        None => None,
    };
    let mut namespaces = sys::SANDBOX_NAMESPACES | if userns.is_some() { libc::CLONE_NEWUSER as u64 } else { 0 };
    if netns.is_some() {
        namespaces &= !(libc::CLONE_NEWNET as u64);
    }
    let spawned = sys::spawn_in_namespaces(&plan, namespaces)
        .map_err(|source| SandboxError::Spawn { exe: rt.shim.source.clone(), source })?;
    drop(plan);
    let pid = spawned.pid;
    parts.shim = Some((pid, spawned.pidfd));
    t.mark("spawn");

    if let (Some(cg), false) = (&parts.cgroup, joins) {
        cg.add(pid as u32).map_err(SandboxError::Cgroup)?;
        t.mark("cgroup_add");
    }
    // In a user namespace the shim waits until its maps are written (and,
    // as above, it is in its cgroup) before it execs.
    if let (Some(map), Some(gate)) = (&userns, gate) {
        crate::sandbox::userns::write_maps(pid, map).map_err(SandboxError::Userns)?;
        nix::unistd::write(&gate, &[1]).map_err(nix_io("open the userns gate"))?;
        t.mark("userns");
    }

    parts.conn = Some(shim_client::connect_path(&dirs.socket).map_err(|source| setup_error(&dirs.log, source))?);
    t.mark("connect");
    t.log(id);
    Ok(prep)
}

/// Steps 4b-5: apply the limits and hand the shim its spec.
pub fn start(
    rt: &Runtime,
    mut prep: Prepared,
    spec: &SandboxSpec,
    defaults: ExecDefaults,
) -> Result<Sandbox, SandboxError> {
    let mut t = super::Phases::start("start");
    let id = prep.id.clone();
    let parts = prep.parts.as_mut().ok_or(SandboxError::Dead(id.clone()))?;
    let (Some(cgroup), Some(conn)) = (parts.cgroup.as_ref(), parts.conn.as_ref()) else {
        return Err(SandboxError::Dead(id));
    };
    cgroup.apply(&spec.limits).map_err(SandboxError::Cgroup)?;
    t.mark("limits");
    let dirs = &parts.dirs;
    // In a user namespace the daemon builds the root (idmapped layers).
    let root_tree = match (&spec.userns, &parts.shim) {
        (Some(map), Some((pid, _))) => Some(
            crate::sandbox::userns::root_tree(*pid, map, &rt.store.layers_dir(), &rt.lowers(&spec.layers), dirs)
                .map_err(SandboxError::Userns)?,
        ),
        _ => None,
    };
    let setup = SetupSpec {
        rootfs: dirs.rootfs.clone(),
        layers_dir: rt.store.layers_dir(),
        lowers: rt.lowers(&spec.layers),
        upper: dirs.upper.clone(),
        work: dirs.work.clone(),
        hostname: spec.hostname.clone(),
        workdir: defaults.cwd.clone(),
        mounts: spec
            .mounts
            .iter()
            .map(|m| match m {
                crate::spec::MountDecl::Scratch { path, size } => {
                    Ok(ExtraMount::Scratch { path: path.clone(), size: *size })
                }
                crate::spec::MountDecl::Cache { name, path } => Ok(ExtraMount::Cache {
                    source: rt.store.cache_dir(name).map_err(SandboxError::Dirs)?,
                    path: path.clone(),
                }),
            })
            .collect::<Result<_, SandboxError>>()?,
        seccomp: !spec.seccomp_unconfined,
        userns: root_tree.is_some(),
        resolv_conf: match (spec.network.mode, spec.network.address) {
            (crate::net::NetworkMode::Egress, Some(a)) => {
                Some(crate::net::Network::resolv_conf(crate::net::gateway_of(a)))
            }
            _ => None,
        },
        root_dir: spec.root_dir.clone(),
    };
    let fds: Vec<i32> = root_tree.iter().map(|t| t.as_raw_fd()).collect();
    // A warm shim has the refill thread's nice 19. Woken by its setup at
    // that weight, it would wait behind every busy thread of a loaded host:
    // back to normal before it is woken (it also does so itself, a step
    // later, for an older daemon).
    if let Some((pid, _)) = &parts.shim {
        let _ = sys::set_nice(*pid, 0);
    }
    let features =
        shim_client::setup(conn, &setup, &fds, SETUP_TIMEOUT).map_err(|source| setup_error(&dirs.log, source))?;
    t.mark("shim_setup");
    t.log(&id);

    let mut parts = prep.parts.take().ok_or(SandboxError::Dead(id.clone()))?;
    let (Some((pid, pidfd)), Some(cgroup), Some(conn)) = (parts.shim.take(), parts.cgroup.take(), parts.conn.take())
    else {
        return Err(SandboxError::Dead(id));
    };
    Ok(Sandbox {
        id,
        spec: spec.clone(),
        defaults,
        created_at: crate::catalog::now(),
        shim_pid: pid,
        shim: ShimClient::start(conn, Some(&features)),
        pidfd,
        cgroup,
        state: std::sync::Mutex::new(super::RunState::Running),
        next_exec: AtomicU64::new(1),
        gone: super::Gone::default(),
        capture_cg: Default::default(),
        activity: super::activity::Activity::new(spec.lifetime),
        limits: std::sync::Mutex::new(spec.limits),
        procs: Default::default(),
        net: None,
    })
}

impl Sandbox {
    /// Give a started, unused sandbox (a ready pool's) the spec a create
    /// asked for: its limits applied to its cgroup, its env, lineage and
    /// lifetime taken; its hostname, mounts and chain must already be the
    /// spec's.
    pub fn claim(&mut self, spec: SandboxSpec, defaults: ExecDefaults) -> Result<(), SandboxError> {
        self.cgroup.apply(&spec.limits).map_err(SandboxError::Cgroup)?;
        self.activity = super::activity::Activity::new(spec.lifetime);
        self.limits = std::sync::Mutex::new(spec.limits);
        self.spec = spec;
        self.defaults = defaults;
        self.created_at = crate::catalog::now();
        Ok(())
    }
}

/// Create a sandbox from scratch (no warm shim available).
pub fn create(
    rt: &Runtime,
    id: &SandboxId,
    spec: &SandboxSpec,
    defaults: ExecDefaults,
) -> Result<Sandbox, SandboxError> {
    let netns = spec.netns.as_deref().map(open_netns).transpose()?;
    start(rt, prepare(rt, id, spec.limits.disk, spec.userns, netns.as_ref())?, spec, defaults)
}

#[derive(Debug, thiserror::Error)]
pub enum AdoptError {
    #[error("shim pid {0:?} is gone or was replaced by another process")]
    ShimGone(Option<i32>),
    #[error("open pidfd of shim {pid}")]
    Pidfd {
        pid: i32,
        #[source]
        source: nix::Error,
    },
    #[error("reconnect to shim")]
    Reconnect(#[source] crate::sandbox::shim_client::ShimError),
}

/// Take a running sandbox back after a daemon restart. The shim was never
/// told anything: it kept running its commands and listening on its socket.
pub fn adopt(rt: &Runtime, row: &SandboxRow, defaults: ExecDefaults) -> Result<Sandbox, AdoptError> {
    let pid = row.shim_pid.ok_or(AdoptError::ShimGone(None))?;
    // pid + start time identify the process; a reused pid has another start time.
    if row.shim_start.is_none() || process_start_time(pid) != row.shim_start {
        return Err(AdoptError::ShimGone(Some(pid)));
    }
    let pidfd = sys::pidfd_open(pid).map_err(|source| AdoptError::Pidfd { pid, source })?;
    let dirs = rt.store.sandbox_dirs(&row.id);
    let paused = row.state == crate::catalog::SandboxState::Paused;
    let cgroup = SandboxCgroup::load(&row.spec.cgroup);
    if !paused {
        // A daemon killed in the middle of a checkpoint left the sandbox
        // frozen; it was not paused by anyone, so thaw it (idempotent).
        let _ = cgroup.thaw();
    }
    let (shim, running) = ShimClient::reconnect(&dirs.socket, SETUP_TIMEOUT, paused).map_err(AdoptError::Reconnect)?;
    Ok(Sandbox {
        id: row.id.clone(),
        spec: row.spec.clone(),
        defaults,
        created_at: row.created_at,
        shim_pid: pid,
        shim,
        pidfd,
        cgroup,
        state: std::sync::Mutex::new(if paused { super::RunState::Paused } else { super::RunState::Running }),
        next_exec: AtomicU64::new(adopted_exec_ids(&running)),
        gone: super::Gone::default(),
        capture_cg: Default::default(),
        activity: super::activity::Activity::new(row.spec.lifetime),
        limits: std::sync::Mutex::new(row.spec.limits),
        procs: Default::default(),
        net: None,
    })
}

/// The first exec id an adopting daemon gives: past every id the shim
/// still runs (commands kept across restarts keep theirs, see
/// `Sandbox::reattach`), and past what earlier daemons gave, which a
/// paused shim cannot tell yet (its `Hello` waits for the thaw): 2^32
/// and up, counted from the clock in seconds times 2^20 (a daemon
/// restarted within the second, or one that gave more than a million ids
/// a second, relies on the shim's list).
fn adopted_exec_ids(running: &[u64]) -> u64 {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let floor = (1u64 << 32).max(secs << 20);
    running.iter().map(|id| id + 1).fold(floor, u64::max)
}

/// Clean up what a sandbox that cannot be adopted left behind: kill its shim
/// if it is still the same process, remove its cgroup and directories.
pub fn reap_orphan(rt: &Runtime, row: &SandboxRow) -> Result<(), SandboxError> {
    if let (Some(pid), Some(start)) = (row.shim_pid, row.shim_start) {
        if process_start_time(pid) == Some(start) {
            if let Ok(pidfd) = sys::pidfd_open(pid) {
                // A paused sandbox's tasks act on SIGKILL only once thawed.
                let _ = sys::pidfd_send_signal(pidfd.as_fd(), libc::SIGKILL);
                let _ = SandboxCgroup::load(&row.spec.cgroup).thaw();
                destroy::kill_and_reap(pid, pidfd.as_fd())?;
            }
        }
    }
    SandboxCgroup::load(&row.spec.cgroup).remove(Duration::from_secs(5)).map_err(SandboxError::Cgroup)?;
    super::remove_capture_cgroup(&row.spec.cgroup, Duration::from_secs(5)).map_err(SandboxError::Cgroup)?;
    rt.store.remove_sandbox(&row.id).map_err(SandboxError::Remove)?;
    Ok(())
}

impl From<StoreError> for SandboxError {
    fn from(e: StoreError) -> Self {
        SandboxError::Remove(e)
    }
}
