//! A live sandbox: its shim, pidfd and cgroup, and the verbs on it, one per
//! file: `create`, `exec`, `destroy` (and `adopt` after a daemon restart).
//!
//! Owns the process side of a sandbox. Does not own metadata (the daemon
//! writes rows) or layer contents (the store).

mod activity;
pub mod cgroups;
mod checkpoint;
pub mod copy;
mod create;
mod destroy;
mod exec;
mod files;
mod freeze;
mod precopy;
mod procs;
pub mod shim_client;
mod shim_exe;
pub mod userns;

pub use activity::{Busy, Due, InUse};
pub use checkpoint::{
    prepared_in, speculate, Ahead, Capture, EndOnDrop, Segment, Speculation, TarFollower, TarProgress,
};
pub use create::{adopt, create, open_netns, prepare, reap_orphan, start, AdoptError, Prepared, Runtime};
pub use exec::{BufferedExec, ExecOutput, ExecRequest, ExecSummary, Spawned, SpawnedOutput, Waited};
pub use files::{read_file, ReadFileError};
pub use precopy::{PreCopy, Precopied, Precopier};
pub use procs::{Forget, Proc, ProcEnd, MAX_PROCESSES};
pub use shim_exe::{ShimExe, ShimExeError};

use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::sync::atomic::AtomicU64;

use crate::error::ErrorKind;
use crate::ids::SandboxId;
use crate::oci::ImageConfig;
use crate::sandbox::cgroups::{CgroupError, SandboxCgroup};
use crate::sandbox::shim_client::{ShimClient, ShimError};
use crate::spec::SandboxSpec;
use crate::store::StoreError;

#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    #[error("prepare sandbox directories")]
    Dirs(#[source] StoreError),
    #[error("create cgroup")]
    Cgroup(#[source] CgroupError),
    #[error("{step}")]
    Io {
        step: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("start strata-shim {exe}")]
    Spawn {
        exe: PathBuf,
        #[source]
        source: nix::Error,
    },
    /// `said`: the last line of the shim's log when the shim failed
    /// without reporting why (it died, or did not answer); the log itself
    /// goes with the sandbox's directories.
    #[error("set up the sandbox{}", log_ends(said))]
    Setup {
        said: String,
        #[source]
        source: ShimError,
    },
    #[error("sandbox {0} is being removed")]
    Stopping(SandboxId),
    #[error("sandbox {0} was used again: its idle suspend is dropped")]
    UsedAgain(SandboxId),
    #[error("sandbox {id} is {state}: {action} refused")]
    State { id: SandboxId, state: RunState, action: &'static str },
    #[error("freeze or thaw sandbox")]
    Freezer(#[source] CgroupError),
    #[error("capture the sandbox's changes")]
    Capture(#[source] crate::store::diff::DiffError),
    #[error("sandbox {0} has no running init process (its shim exited); remove it")]
    Dead(SandboxId),
    #[error("invalid exec request: {0}")]
    BadExec(String),
    #[error("start command")]
    Exec(#[source] ShimError),
    #[error("stop shim pid {pid}")]
    Kill {
        pid: i32,
        #[source]
        source: nix::Error,
    },
    #[error("shim pid {pid} did not exit within {secs}s of SIGKILL")]
    KillTimeout { pid: i32, secs: u64 },
    #[error("remove sandbox files")]
    Remove(#[source] StoreError),
    #[error("user namespace")]
    Userns(#[source] crate::sandbox::userns::UsernsError),
    #[error("netns {path}: {why}")]
    Netns { path: PathBuf, why: String },
    #[error("sandbox {0} runs on a host directory (rootfs): it has no layers of Strata's to {1}")]
    HostRoot(SandboxId, &'static str),
}

/// What [`SandboxError::Setup`] adds: the last line of the shim's log.
fn log_ends(said: &str) -> String {
    if said.is_empty() {
        String::new()
    } else {
        format!(" (the shim's log ends: {said})")
    }
}

impl crate::error::Classify for SandboxError {
    fn kind(&self) -> ErrorKind {
        match self {
            SandboxError::Stopping(_)
            | SandboxError::UsedAgain(_)
            | SandboxError::Dead(_)
            | SandboxError::State { .. }
            | SandboxError::HostRoot(..) => ErrorKind::Conflict,
            SandboxError::BadExec(_) | SandboxError::Netns { .. } => ErrorKind::InvalidArgument,
            SandboxError::Capture(e) if e.is_content() => ErrorKind::Conflict,
            _ => ErrorKind::of_host_failure(self),
        }
    }
}

/// What every exec in a sandbox starts from, derived from the image config
/// and the create request.
#[derive(Debug, Clone, PartialEq)]
pub struct ExecDefaults {
    pub env: Vec<String>,
    pub cwd: String,
    pub uid: u32,
    pub gid: u32,
    /// Whether the image's config names a `User` (E2B's default user
    /// follows it then) and a `WorkingDir` other than `/` (E2B's default
    /// cwd follows it).
    pub image_user: bool,
    pub image_cwd: bool,
}

pub const DEFAULT_PATH: &str = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// Overlay `over` onto `base` by variable name (`K=V`; later wins).
pub fn merge_env(base: &[String], over: &[String]) -> Vec<String> {
    let mut out: Vec<String> = base.to_vec();
    for kv in over {
        let key = kv.split('=').next().unwrap_or(kv);
        out.retain(|e| e.split('=').next() != Some(key));
        out.push(kv.clone());
    }
    out
}

/// Parse `UID[:GID]` (numeric), or a name looked up with `lookup`.
pub fn parse_user(user: &str, lookup: impl Fn(&str) -> Option<(u32, u32)>) -> Result<(u32, u32), String> {
    if user.is_empty() {
        return Ok((0, 0));
    }
    let (u, g) = match user.split_once(':') {
        Some((u, g)) => (u, Some(g)),
        None => (user, None),
    };
    let (uid, default_gid) = match u.parse::<u32>() {
        Ok(uid) => (uid, lookup(u).map(|(_, g)| g).unwrap_or(uid)),
        Err(_) => lookup(u).ok_or_else(|| format!("user {u:?} not found in the image's /etc/passwd"))?,
    };
    let gid = match g {
        None => default_gid,
        Some(g) => g.parse::<u32>().map_err(|_| format!("group {g:?} must be numeric"))?,
    };
    Ok((uid, gid))
}

/// Find `name` (or a numeric uid) in the topmost layer that has an
/// `etc/passwd`. `layers` are layer `fs` dirs, topmost first.
pub fn passwd_lookup(layers: &[PathBuf], name: &str) -> Option<(u32, u32)> {
    // Read on the host from the image's layer trees: never through a
    // symlink the image planted (`etc/passwd -> /etc/shadow`), never a FIFO.
    let bytes = layers.iter().find_map(|l| crate::oci::read_in_tree(l, &["etc", "passwd"], 4 << 20))?;
    let text = String::from_utf8_lossy(&bytes);
    text.lines().find_map(|line| {
        let f: Vec<&str> = line.split(':').collect();
        if f.len() >= 4 && (f[0] == name || f[2] == name) {
            Some((f[2].parse().ok()?, f[3].parse().ok()?))
        } else {
            None
        }
    })
}

impl ExecDefaults {
    pub fn new(config: &ImageConfig, create_env: &[String], layers: &[PathBuf]) -> Result<ExecDefaults, String> {
        let base = if config.env.iter().any(|e| e.starts_with("PATH=")) {
            config.env.clone()
        } else {
            merge_env(&[DEFAULT_PATH.to_string()], &config.env)
        };
        let env = merge_env(&base, create_env);
        // `/` is what a config without one means too (and what many
        // image builders write for it).
        let image_cwd = config.working_dir.as_deref().is_some_and(|w| !w.is_empty() && w != "/");
        let cwd = config.working_dir.clone().filter(|w| !w.is_empty()).unwrap_or_else(|| "/".into());
        let user = config.user.as_deref().unwrap_or("");
        let (uid, gid) = parse_user(user, |n| passwd_lookup(layers, n))?;
        Ok(ExecDefaults { env, cwd, uid, gid, image_user: !user.is_empty(), image_cwd })
    }
}

/// The in-memory lifecycle of a live sandbox; every change goes through
/// [`RunState::next`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RunState {
    Running,
    /// Frozen in place (cgroup freezer): a temporal snapshot, nothing written.
    Paused,
    /// Being removed; nothing new may start.
    Stopping,
    /// Its upper is being captured: frozen, execs refused. `was_paused`
    /// says which state it returns to.
    Capturing {
        was_paused: bool,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunEvent {
    Pause,
    Unpause,
    Stop,
    /// Removal failed; the sandbox is usable again (and thawed).
    StopFailed,
    Capture,
    Captured,
}

impl std::fmt::Display for RunState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            RunState::Running => "running",
            RunState::Paused => "paused",
            RunState::Stopping => "stopping",
            RunState::Capturing { .. } => "checkpointing",
        })
    }
}

impl RunState {
    /// The state after `ev`, or `None` if `ev` is not allowed now.
    pub fn next(self, ev: RunEvent) -> Option<RunState> {
        use RunEvent::*;
        use RunState::*;
        match (self, ev) {
            (Running, Pause) => Some(Paused),
            (Paused, Unpause) => Some(Running),
            (Running | Paused, Stop) => Some(Stopping),
            (Stopping, StopFailed) => Some(Running),
            (Running, Capture) => Some(Capturing { was_paused: false }),
            (Paused, Capture) => Some(Capturing { was_paused: true }),
            (Capturing { was_paused: false }, Captured) => Some(Running),
            (Capturing { was_paused: true }, Captured) => Some(Paused),
            _ => None,
        }
    }
}

/// A live sandbox.
pub struct Sandbox {
    pub id: SandboxId,
    pub spec: SandboxSpec,
    pub defaults: ExecDefaults,
    pub created_at: i64,
    pub shim_pid: i32,
    shim: ShimClient,
    pidfd: OwnedFd,
    cgroup: SandboxCgroup,
    state: std::sync::Mutex<RunState>,
    next_exec: AtomicU64,
    /// Set while it is being removed or suspended: work the daemon does on
    /// its behalf (a checkpoint's copies, compression, hydration) stops.
    gone: Gone,
    /// Its capture cgroup (`crate::worker`), once made; its lock orders
    /// placing a worker there against removing it.
    capture_cg: std::sync::Mutex<Option<SandboxCgroup>>,
    /// Its lifetime and use, for the daemon's reaper.
    activity: activity::Activity,
    /// Its cgroup limits as they are now: `spec.limits` until a live
    /// change (`PUT /v1/sandboxes/{id}/limits`) replaces them.
    limits: std::sync::Mutex<crate::spec::Limits>,
    /// Its processes started with the caller's stdio (`procs.rs`).
    procs: std::sync::Mutex<std::collections::BTreeMap<u64, std::sync::Arc<Proc>>>,
    /// Its veth, nft rules and resolver (`egress`), undone when its
    /// processes are stopped.
    net: Option<crate::net::Attachment>,
}

impl Sandbox {
    /// Give it the network its spec asks for, in the slot reserved for it.
    pub fn attach_network(
        &mut self,
        net: &std::sync::Arc<crate::net::Network>,
        slot: crate::net::Slot,
    ) -> Result<(), crate::net::NetError> {
        self.net = Some(net.attach(slot, &self.pidfd, &self.spec.network.policy)?);
        Ok(())
    }

    /// Refuse `action` (a checkpoint, suspend, diff, publish) on a sandbox
    /// whose root is a host directory: there is no upper of ours to read.
    pub fn own_layers(&self, action: &'static str) -> Result<(), SandboxError> {
        match self.spec.root_dir {
            Some(_) => Err(SandboxError::HostRoot(self.id.clone(), action)),
            None => Ok(()),
        }
    }

    /// Its limits as they are now (a live change included).
    pub fn limits(&self) -> crate::spec::Limits {
        *self.limits.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Replace its cgroup limits live (the disk cap stays: it is the size
    /// of its file system). Every limit is written, an unset one lifted; if
    /// one is refused (a memory limit below what it uses, on v1), the old
    /// ones are written back and the error returned.
    pub fn set_limits(&self, new: crate::spec::Limits) -> Result<crate::spec::Limits, CgroupError> {
        let mut now = self.limits.lock().unwrap_or_else(|e| e.into_inner());
        let new = crate::spec::Limits { disk: now.disk, ..new };
        if let Err(e) = self.cgroup.set(&new) {
            let _ = self.cgroup.set(&now);
            return Err(e);
        }
        let old = std::mem::replace(&mut *now, new);
        Ok(old)
    }

    pub fn network(&self) -> Option<&crate::net::Attachment> {
        self.net.as_ref()
    }

    /// Its network spec as it is now (a live policy change included).
    pub fn network_spec(&self) -> crate::net::NetworkSpec {
        let mut spec = self.spec.network.clone();
        if let Some(a) = &self.net {
            spec.policy = a.policy();
            spec.address = Some(a.address());
        }
        spec
    }

    /// Its network as a snapshot keeps it: mode and policy, no address (a
    /// sandbox started from it gets its own).
    pub fn network_kept(&self) -> crate::net::NetworkSpec {
        crate::net::NetworkSpec { address: None, ..self.network_spec() }
    }

    /// A TCP connection to its `127.0.0.1:port`, made inside its network
    /// namespace (a server on its loopback is reached too).
    pub fn connect_port(&self, port: u16, timeout: std::time::Duration) -> std::io::Result<std::net::TcpStream> {
        crate::net::connect_in(&self.pidfd, port, timeout)
    }
}

/// The capture cgroup beside sandbox cgroup `cg` (see
/// [`Sandbox::capture_join`]).
fn capture_cgroup_of(cg: &str) -> String {
    format!("{cg}.capture")
}

/// Make (or take) the capture cgroup beside sandbox cgroup `cg`, with the
/// sandbox's CPU quota `cpus`.
pub fn capture_cgroup(cg: &str, cpus: Option<f64>) -> Result<SandboxCgroup, CgroupError> {
    let limits = crate::spec::Limits { cpus, pids: Some(CAPTURE_PIDS), ..Default::default() };
    SandboxCgroup::create_work(&capture_cgroup_of(cg), &limits)
}

/// Remove the capture cgroup beside sandbox cgroup `cg`, if there is one:
/// kill the workers still in it (the daemon's own, of a capture told to
/// stop, or left by a daemon killed meanwhile), wait up to `budget`.
/// Killed at every look, not once: a worker started just before the
/// sandbox began to go joins the cgroup by itself (v1) and may come in
/// after the first.
pub fn remove_capture_cgroup(cg: &str, budget: std::time::Duration) -> Result<(), CgroupError> {
    SandboxCgroup::load(&capture_cgroup_of(cg)).kill_and_remove(budget)
}

/// Capture workers a sandbox may run at once (`crate::worker`): two per
/// capture (compression, hydration), a few captures.
const CAPTURE_PIDS: u64 = 16;

/// Whether a sandbox is going away (see [`Sandbox::gone`]); shared with
/// the readers and writers of its captures, which check it as they go.
#[derive(Debug, Clone, Default)]
pub struct Gone(std::sync::Arc<std::sync::atomic::AtomicBool>);

impl Gone {
    pub fn is_set(&self) -> bool {
        self.0.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn set(&self, gone: bool) {
        self.0.store(gone, std::sync::atomic::Ordering::Relaxed)
    }

    /// An error once it is set (for I/O loops: the work is abandoned).
    pub fn check(&self) -> std::io::Result<()> {
        match self.is_set() {
            true => Err(std::io::Error::other(GoneError)),
            false => Ok(()),
        }
    }
}

/// A reader that fails once its sandbox is going away.
pub struct Until<R> {
    inner: R,
    gone: Gone,
}

impl<R> Until<R> {
    pub fn new(inner: R, gone: &Gone) -> Until<R> {
        Until { inner, gone: gone.clone() }
    }
}

impl<R: std::io::Read> std::io::Read for Until<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.gone.check()?;
        self.inner.read(buf)
    }
}

/// The error [`Gone::check`] returns.
#[derive(Debug, thiserror::Error)]
#[error("the sandbox is being removed or suspended")]
pub struct GoneError;

impl Sandbox {
    /// Set from the moment its removal (or suspend) begins until that fails.
    pub fn gone(&self) -> &Gone {
        &self.gone
    }

    /// Its directories; with a disk cap or a user namespace, the upper and
    /// work dirs are under `rw/`.
    pub fn dirs(&self, store: &crate::store::Store) -> crate::store::SandboxDirs {
        let dirs = store.sandbox_dirs(&self.id);
        if self.spec.limits.disk.is_some() || self.spec.userns.is_some() {
            dirs.with_rw()
        } else {
            dirs
        }
    }

    pub fn cgroup_path(&self) -> &str {
        self.cgroup.path()
    }

    /// What its cgroup has used ([`crate::sandbox::cgroups::SandboxCgroup::usage`]).
    pub fn usage(&self) -> crate::sandbox::cgroups::Usage {
        self.cgroup.usage()
    }

    /// Where its capture workers run (`crate::worker`): beside its own
    /// cgroup (which a capture freezes), with its CPU quota.
    pub fn capture_cgroup_path(&self) -> String {
        capture_cgroup_of(self.cgroup.path())
    }

    /// Make the capture cgroup if need be; how a capture worker is born
    /// in it (`Join`). A worker that joins does so after this check that
    /// the sandbox is not going away:
    /// a removal meanwhile takes the cgroup, and the join fails, or the
    /// worker is killed with the sandbox's other workers.
    pub fn capture_join(&self) -> Result<crate::sandbox::cgroups::Join, SandboxError> {
        self.with_capture_cgroup(|cg| cg.join().map_err(SandboxError::Cgroup))
    }

    /// Put a capture worker (`pid`) of this sandbox in its capture cgroup.
    pub fn place_worker(&self, pid: u32) -> Result<(), SandboxError> {
        self.with_capture_cgroup(|cg| cg.add(pid).map_err(SandboxError::Cgroup))
    }

    /// Run `f` on the capture cgroup, made on first use, under its lock;
    /// refused once the sandbox is going away, so that nothing is placed
    /// (or made) after its removal took the cgroup.
    fn with_capture_cgroup<R>(
        &self,
        f: impl FnOnce(&SandboxCgroup) -> Result<R, SandboxError>,
    ) -> Result<R, SandboxError> {
        let mut cg = self.capture_cg.lock().unwrap_or_else(|p| p.into_inner());
        if self.gone.is_set() {
            return Err(SandboxError::Stopping(self.id.clone()));
        }
        if cg.is_none() {
            *cg = Some(capture_cgroup(self.cgroup.path(), self.limits().cpus).map_err(SandboxError::Cgroup)?);
        }
        match cg.as_ref() {
            Some(cg) => f(cg),
            None => Err(SandboxError::Stopping(self.id.clone())),
        }
    }

    /// Remove its capture cgroup (made by this daemon or an earlier one),
    /// once the workers in it are gone. Call after [`Sandbox::begin_stop`].
    fn remove_capture_cgroup(&self, budget: std::time::Duration) -> Result<(), SandboxError> {
        let mut cg = self.capture_cg.lock().unwrap_or_else(|p| p.into_inner());
        cg.take();
        remove_capture_cgroup(self.cgroup.path(), budget).map_err(SandboxError::Cgroup)
    }

    pub fn is_alive(&self) -> bool {
        self.shim.is_alive()
    }

    pub fn run_state(&self) -> RunState {
        *self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// [`Sandbox::run_state`] unless a transition holds it (a pause holds
    /// it while the cgroup freezes): then None, at once.
    pub fn try_run_state(&self) -> Option<RunState> {
        match self.state.try_lock() {
            Ok(st) => Some(*st),
            Err(std::sync::TryLockError::Poisoned(p)) => Some(*p.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => None,
        }
    }

    /// Apply `ev` under the state lock; `during` runs with the lock held and
    /// must succeed for the transition to happen.
    fn transition(
        &self,
        ev: RunEvent,
        action: &'static str,
        during: impl FnOnce() -> Result<(), SandboxError>,
    ) -> Result<RunState, SandboxError> {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let next = st.next(ev).ok_or_else(|| SandboxError::State { id: self.id.clone(), state: *st, action })?;
        during()?;
        *st = next;
        Ok(next)
    }
}

/// Per-phase timings of one operation, logged at debug level
/// (`STRATA_LOG=strata=debug`) so benchmarks can say where time goes.
pub(crate) struct Phases {
    what: &'static str,
    last: std::time::Instant,
    marks: Vec<(&'static str, std::time::Duration)>,
}

impl Phases {
    pub(crate) fn start(what: &'static str) -> Phases {
        Phases { what, last: std::time::Instant::now(), marks: Vec::new() }
    }

    pub(crate) fn mark(&mut self, phase: &'static str) {
        let now = std::time::Instant::now();
        self.marks.push((phase, now - self.last));
        self.last = now;
    }

    pub(crate) fn log(&self, id: &SandboxId) {
        if tracing::enabled!(tracing::Level::DEBUG) {
            let parts: Vec<String> =
                self.marks.iter().map(|(p, d)| format!("{p}={:.3}ms", d.as_secs_f64() * 1000.0)).collect();
            tracing::debug!("{} {id}: {}", self.what, parts.join(" "));
        }
    }
}

/// Start time of a process in clock ticks since boot (field 22 of
/// /proc/PID/stat): with the pid, an identity that survives pid reuse.
pub fn process_start_time(pid: i32) -> Option<u64> {
    procfs::process::Process::new(pid).and_then(|p| p.stat()).ok().map(|s| s.starttime)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn run_state_transitions() {
        use RunEvent::*;
        use RunState::*;
        assert_eq!(Running.next(Pause), Some(Paused));
        assert_eq!(Paused.next(Pause), None, "pausing twice is refused");
        assert_eq!(Running.next(Unpause), None);
        assert_eq!(Paused.next(Unpause), Some(Running));
        assert_eq!(Paused.next(Stop), Some(Stopping));
        assert_eq!(Stopping.next(Stop), None, "one removal at a time");
        assert_eq!(Stopping.next(Pause), None);
        assert_eq!(Stopping.next(StopFailed), Some(Running));
        assert_eq!(Running.next(Capture), Some(Capturing { was_paused: false }));
        assert_eq!(Capturing { was_paused: false }.next(Captured), Some(Running));
        assert_eq!(Paused.next(Capture).and_then(|s| s.next(Captured)), Some(Paused), "a paused sandbox stays paused");
        assert_eq!(Capturing { was_paused: false }.next(Stop), None, "no removal mid-capture");
        assert_eq!(Capturing { was_paused: false }.next(Capture), None);
    }

    #[test]
    fn env_merge_overrides_by_key() {
        let base = vec!["PATH=/bin".to_string(), "A=1".to_string()];
        let got = merge_env(&base, &["A=2".into(), "B=3".into()]);
        assert_eq!(got, vec!["PATH=/bin", "A=2", "B=3"]);
    }

    #[test]
    fn users_parse() {
        let lookup = |n: &str| (n == "nobody" || n == "65534").then_some((65534, 65533));
        assert_eq!(parse_user("", lookup), Ok((0, 0)));
        assert_eq!(parse_user("1000", lookup), Ok((1000, 1000)));
        assert_eq!(parse_user("1000:5", lookup), Ok((1000, 5)));
        assert_eq!(parse_user("nobody", lookup), Ok((65534, 65533)));
        assert_eq!(parse_user("65534", lookup), Ok((65534, 65533)));
        assert!(parse_user("ghost", lookup).is_err());
        assert!(parse_user("1:x", lookup).is_err());
    }

    #[test]
    fn passwd_from_topmost_layer() {
        let t = tempfile::tempdir().unwrap();
        let (top, bottom) = (t.path().join("top"), t.path().join("bottom"));
        std::fs::create_dir_all(bottom.join("etc")).unwrap();
        std::fs::create_dir_all(&top).unwrap();
        std::fs::write(bottom.join("etc/passwd"), "root:x:0:0::/root:/bin/sh\napp:x:100:101::/:/bin/sh\n").unwrap();
        assert_eq!(passwd_lookup(&[top, bottom], "app"), Some((100, 101)));
    }

    #[test]
    fn passwd_is_never_read_through_a_symlink_or_from_a_fifo() {
        let t = tempfile::tempdir().unwrap();
        let host = t.path().join("host");
        std::fs::create_dir_all(host.join("etc")).unwrap();
        std::fs::write(host.join("etc/passwd"), "app:x:7:7::/:/bin/sh\n").unwrap();
        // A layer whose etc is a symlink out, one whose passwd is, one FIFO.
        let (a, b, c) = (t.path().join("a"), t.path().join("b"), t.path().join("c"));
        std::fs::create_dir_all(&a).unwrap();
        std::os::unix::fs::symlink(host.join("etc"), a.join("etc")).unwrap();
        std::fs::create_dir_all(b.join("etc")).unwrap();
        std::os::unix::fs::symlink(host.join("etc/passwd"), b.join("etc/passwd")).unwrap();
        std::fs::create_dir_all(c.join("etc")).unwrap();
        nix::unistd::mkfifo(&c.join("etc/passwd"), nix::sys::stat::Mode::from_bits_truncate(0o644)).unwrap();
        for layer in [a, b, c] {
            assert_eq!(passwd_lookup(std::slice::from_ref(&layer), "app"), None, "{}", layer.display());
        }
    }

    #[test]
    fn defaults_from_image_config() {
        let cfg = ImageConfig { env: vec!["A=1".into()], working_dir: Some("/w".into()), ..Default::default() };
        let d = ExecDefaults::new(&cfg, &["B=2".into()], &[]).unwrap();
        assert_eq!(d.env, vec![DEFAULT_PATH.to_string(), "A=1".into(), "B=2".into()]);
        assert_eq!((d.cwd.as_str(), d.uid, d.gid), ("/w", 0, 0));
        assert!(d.image_cwd && !d.image_user, "a WorkingDir, no User: {d:?}");
        let cfg = ImageConfig { user: Some("0:0".into()), ..Default::default() };
        let d = ExecDefaults::new(&cfg, &[], &[]).unwrap();
        assert!(d.image_user && !d.image_cwd && d.cwd == "/", "{d:?}");
    }

    #[test]
    fn start_time_of_self() {
        assert!(process_start_time(std::process::id() as i32).is_some());
        assert!(process_start_time(-5).is_none());
    }
}
