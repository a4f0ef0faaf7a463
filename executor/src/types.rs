//! Request and response bodies of the HTTP API (docs/openapi.yaml). Requests
//! reject unknown fields so a typo is a 400, not a silently ignored option.

use serde::{Deserialize, Serialize};

use crate::ids::{LayerId, SnapshotId};
use crate::spec::Limits;

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ImportRequest {
    /// Path on the daemon's host of an OCI layout directory or archive.
    pub path: String,
    /// `NAME[:TAG]`.
    pub name: String,
    /// Which manifest of the layout's `index.json` to import: the one
    /// whose `org.opencontainers.image.ref.name` is this (needed when it
    /// lists several).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tag: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ImageInfo {
    pub name: String,
    pub manifest_digest: String,
    pub config_digest: String,
    /// diff_ids, bottom layer first.
    pub layers: Vec<String>,
    pub created_at: i64,
}

/// The settings every way of starting a sandbox takes (create, resume,
/// fork), written once here: each request type is its own fields plus
/// these, as one flat object. (serde's `flatten` would give one struct to
/// embed, but it cannot be used with `deny_unknown_fields`, which every
/// request keeps: a misspelt field is a 400, not a default.)
macro_rules! launch_request {
    ($(#[$attr:meta])* pub struct $name:ident { $($own:tt)* }) => {
        launch_request! { @shared $(#[$attr])* $name { $($own)* }
            memory: Option<u64>,
            pids: Option<u64>,
            cpus: Option<f64>,
            /// Cap on what the sandbox writes (its own filesystem of this size).
            disk: Option<u64>,
            env: Vec<String>,
            /// `KEY=VALUE`s its commands get as env that are never written to the
            /// catalog, an exec record or an artifact: held in memory and in a
            /// root-only file of its lineage (`ROOT/secrets/`), where a resume of
            /// the lineage on this host finds them unless it names its own.
            /// `GET` shows their names only.
            secret_env: Vec<String>,
            hostname: Option<String>,
            /// The sandbox's id (16 lowercase hex characters), chosen by the
            /// caller; 409 if taken. Default: a random one.
            id: Option<String>,
            /// Seconds to queue for a slot when the host is at `--max-sandboxes`
            /// (first come, first served; 429 after). Default: 429 at once.
            wait: Option<u64>,
            /// Scratch tmpfs mounts, `PATH[:SIZE]` (default 64 MiB); never captured.
            scratch: Vec<String>,
            /// Named host cache dirs, `NAME:PATH`, shared by sandboxes that name
            /// them; never captured.
            cache: Vec<String>,
            /// `default` (the seccomp filter) or `unconfined` (none).
            seccomp: Option<String>,
            /// Run in its own user namespace: root inside is an unprivileged
            /// host id. Unset: as the chain it starts from was captured (a
            /// chain captured in one runs only in one; a bare image: no).
            userns: Option<bool>,
            /// Seconds until it is removed or suspended (`on_timeout`); renewable
            /// (`POST /v1/sandboxes/{id}/timeout`). Default: none.
            timeout: Option<u64>,
            /// `remove` (default: the daemon's `--on-timeout`) or `suspend` (into
            /// its lineage).
            on_timeout: Option<crate::model::OnTimeout>,
            /// Seconds with no exec running, no attached session and no API call
            /// naming it, after which it is suspended into its lineage.
            idle_timeout: Option<u64>,
            /// Its network. Absent: a create's has loopback only; a resume or
            /// fork has what the snapshot's sandbox had.
            network: Option<NetworkRequest>,
            /// A network namespace to join instead of one of its own: a path
            /// such as `/var/run/netns/NAME` or `/proc/PID/ns/net` (a pod's,
            /// made by CNI). Strata adds nothing to it (no veth, no policy);
            /// not with an `egress` network or a user namespace.
            netns: Option<String>,
        }
    };
    (@shared $(#[$attr:meta])* $name:ident { $($own:tt)* } $($(#[$doc:meta])* $field:ident: $ty:ty,)*) => {
        $(#[$attr])*
        #[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Default)]
        #[serde(deny_unknown_fields)]
        pub struct $name {
            $($own)*
            $($(#[$doc])* #[serde(default)] pub $field: $ty,)*
        }

        impl $name {
            /// The launch settings it holds (a [`LaunchRequest`]'s own
            /// `count` is not one: `None`).
            pub fn into_launch(self) -> LaunchRequest {
                LaunchRequest { $($field: self.$field,)* count: None }
            }
        }
    };
}

launch_request! {
    /// `POST /v1/sandboxes`.
    pub struct CreateRequest {
        /// The image to run on; with `rootfs`, the image whose config its
        /// commands get (default: none, the empty `strata/rootfs:v1`).
        #[serde(default)]
        pub image: String,
        /// A host directory to run on as it is, instead of the image's layers
        /// (containerd's mounted rootfs): an absolute path to a directory.
        /// What the sandbox writes goes there; it cannot be checkpointed,
        /// suspended, rolled back or published (409).
        #[serde(default)]
        pub rootfs: Option<String>,
        /// The lineage to work for: a new one with this id (1-64 chars of
        /// `[A-Za-z0-9._-]`), or a new one with a random id if absent.
        #[serde(default)]
        pub work_context: Option<String>,
        /// Start from the ready baseline `OWNER/REPO@REF` of this image instead
        /// of the bare image.
        #[serde(default)]
        pub baseline: Option<String>,
    }
}

/// A sandbox's network as a create, resume or fork asks for it, and the
/// body of `PUT /v1/sandboxes/{id}/network` (`mode` left out there).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Default)]
#[serde(deny_unknown_fields)]
pub struct NetworkRequest {
    /// `none` or `egress` (the default when a network is given).
    #[serde(default)]
    pub mode: Option<crate::net::NetworkMode>,
    /// CIDRs, addresses and domain names (`*.` wildcards) it may reach;
    /// an allowed destination wins over a denied one.
    #[serde(default)]
    pub allow_out: Vec<String>,
    /// CIDRs and addresses it may not reach (`0.0.0.0/0`: all but those allowed).
    #[serde(default)]
    pub deny_out: Vec<String>,
}

/// `POST /v1/sandboxes/{id}/processes`: a command with the caller's stdio.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Default)]
#[serde(deny_unknown_fields)]
pub struct ProcessRequest {
    pub argv: Vec<String>,
    /// `KEY=VALUE`s over the sandbox's env.
    #[serde(default)]
    pub env: Vec<String>,
    #[serde(default)]
    pub cwd: Option<String>,
    /// `UID[:GID]`, numeric, inside the sandbox.
    #[serde(default)]
    pub user: Option<String>,
    /// Absolute host paths of files or FIFOs (the other end open) for its
    /// stdin, stdout and stderr; absent or empty: /dev/null.
    #[serde(default)]
    pub stdin: Option<String>,
    #[serde(default)]
    pub stdout: Option<String>,
    #[serde(default)]
    pub stderr: Option<String>,
}

/// A process of `/v1/sandboxes/{id}/processes`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ProcessInfo {
    /// Its id in the sandbox (the path's `{n}`).
    pub id: u64,
    /// Its pid in the sandbox's PID namespace.
    pub pid: i32,
    /// Its pid on the host.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_pid: Option<i32>,
    pub argv: Vec<String>,
    /// Unix ms.
    pub started_at: i64,
    pub running: bool,
    /// Once it ended: its exit code, or 128 + the signal that killed it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    /// The signal that killed it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signal: Option<i32>,
    /// Unix ms.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exited_at: Option<i64>,
}

/// `POST /v1/sandboxes/{id}/processes/{n}/signal`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct SignalRequest {
    /// 1-64, e.g. 15 (SIGTERM) or 9 (SIGKILL).
    pub signal: i32,
    /// To its process group (what it started too), not it alone.
    #[serde(default)]
    pub group: bool,
}

/// The body of `PUT /v1/sandboxes/{id}/limits`: each limit given
/// replaces the sandbox's, `null` gives it the daemon's default again
/// (`--default-pids`, `--default-memory`; none for cpus), one left out
/// stays as it is.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Default)]
#[serde(deny_unknown_fields)]
pub struct LimitsRequest {
    /// Bytes.
    #[serde(default, deserialize_with = "given", skip_serializing_if = "Option::is_none")]
    pub memory: Option<Option<u64>>,
    #[serde(default, deserialize_with = "given", skip_serializing_if = "Option::is_none")]
    pub pids: Option<Option<u64>>,
    /// CPUs, e.g. 0.5.
    #[serde(default, deserialize_with = "given", skip_serializing_if = "Option::is_none")]
    pub cpus: Option<Option<f64>>,
    /// Refused: a disk cap is the size of the sandbox's own file system,
    /// fixed when it starts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk: Option<serde_json::Value>,
}

/// A field that is present (`Some`), as `null` (`Some(None)`) or a value.
fn given<'de, D: serde::Deserializer<'de>, T: Deserialize<'de>>(d: D) -> Result<Option<Option<T>>, D::Error> {
    Option::<T>::deserialize(d).map(Some)
}

impl LimitsRequest {
    /// `now` with this request's changes; unset ones are left for the
    /// daemon's defaults to fill.
    pub fn over(&self, now: crate::spec::Limits) -> crate::spec::Limits {
        crate::spec::Limits {
            memory: self.memory.unwrap_or(now.memory),
            pids: self.pids.unwrap_or(now.pids),
            cpus: self.cpus.unwrap_or(now.cpus),
            disk: now.disk,
        }
    }
}

/// A sandbox's use at one moment (`GET /v1/sandboxes/{id}/metrics`,
/// `strata stats`; E2B's `SandboxMetric` is made of it).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct SandboxMetrics {
    /// When it was taken (unix ms).
    pub timestamp: i64,
    /// CPUs it may use: its `cpus` limit rounded up, else the host's.
    pub cpu_count: u64,
    /// Of those CPUs, the share it used since the sample before (at most
    /// 5 s before; since its start for the first), 0-100.
    pub cpu_used_pct: f64,
    /// CPU time its processes used since it started.
    pub cpu_usage_ns: u64,
    /// Memory charged to it, less the inactive page cache.
    pub mem_used: u64,
    /// The page cache charged to it.
    pub mem_cache: u64,
    /// Its `memory` limit, else the host's memory.
    pub mem_total: u64,
    /// Used and total bytes of the filesystem its writes go to: its own
    /// sized one with a `disk` limit, else the daemon's (what `df /` shows
    /// inside it).
    pub disk_used: u64,
    pub disk_total: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct SandboxInfo {
    pub id: String,
    pub image: String,
    /// `running`, `paused`, `stopping`, or `exited` if its init process is gone.
    pub state: String,
    pub limits: Limits,
    pub hostname: String,
    pub created_at: i64,
    pub shim_pid: i32,
    pub cgroup: String,
    /// Scratch and cache mounts.
    pub mounts: Vec<crate::spec::MountDecl>,
    /// Its user namespace's host range, if it has one (`--userns`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub userns: Option<crate::spec::UsernsMap>,
    /// The lineage its checkpoints append to.
    #[serde(default)]
    pub work_context: Option<String>,
    /// How it was started: the restore ladder's rung and the snapshot used.
    #[serde(default)]
    pub restored: Option<crate::spec::Restored>,
    /// `default` or `unconfined`.
    #[serde(default)]
    pub seccomp: String,
    /// Its deadline (unix ms), what happens then, and its idle timeout.
    #[serde(default)]
    pub lifetime: crate::spec::Lifetime,
    /// Its network mode, egress policy and address.
    #[serde(default)]
    pub network: crate::net::NetworkSpec,
    /// The network namespace it joined (`netns`), if it has none of its own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub netns: Option<std::path::PathBuf>,
    /// The names of its `secret_env` (never their values).
    #[serde(default)]
    pub secret_env: Vec<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Default)]
#[serde(deny_unknown_fields)]
pub struct ExecRequestBody {
    pub argv: Vec<String>,
    #[serde(default)]
    pub env: Vec<String>,
    #[serde(default)]
    pub cwd: Option<String>,
    /// `UID[:GID]`, numeric.
    #[serde(default)]
    pub user: Option<String>,
    /// Seconds; the command's process group is killed when it passes.
    #[serde(default)]
    pub timeout: Option<f64>,
    /// Buffered form only: bytes fed to the command's stdin.
    #[serde(default)]
    pub stdin: Option<String>,
    /// Attached form only: allocate a pseudo-terminal.
    #[serde(default)]
    pub tty: bool,
    /// Attached form with tty: initial window size.
    #[serde(default)]
    pub rows: Option<u16>,
    #[serde(default)]
    pub cols: Option<u16>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ExecResult {
    /// Shell convention: the exit code, or 128 + signal.
    pub exit_code: i32,
    /// The signal that killed the command, if one did.
    pub signal: Option<i32>,
    pub stdout: String,
    pub stderr: String,
    pub duration_ms: f64,
    pub timed_out: bool,
    /// Output past the buffered limit was dropped.
    pub truncated: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ErrorDetail {
    pub code: String,
    pub message: String,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct VersionInfo {
    pub version: String,
    pub api: String,
    pub cgroup: String,
}

/// `GET /v1/info`: what a scheduler places work by.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct HostInfo {
    pub version: String,
    /// The host's id in the catalog (`--host-id`, default the hostname).
    pub host_id: String,
    /// `ready`, or `draining` (no new sandbox starts; running ones go on).
    pub state: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub draining_reason: Option<String>,
    /// Live sandboxes, launches in flight and removals still tearing
    /// down, against `--max-sandboxes`.
    pub slots_used: usize,
    /// Of those, removed sandboxes whose teardown has not finished. One
    /// that stays is failing its teardown, which is retried (the daemon's
    /// log says why).
    #[serde(default)]
    pub slots_removing: usize,
    pub slots_max: usize,
    /// Launches queued for a slot (`wait`).
    pub slots_waiting: usize,
    /// The sum of live sandboxes' memory limits, and the host's memory.
    pub memory_allocated: u64,
    pub memory_total: u64,
    /// The sum of live sandboxes' CPU limits, and the host's CPUs.
    pub cpus_allocated: f64,
    pub cpus_total: usize,
    /// The store's file system: bytes in use and free (to unprivileged
    /// users, as `df` shows them).
    pub store_used_bytes: u64,
    pub store_free_bytes: u64,
    /// Images by name, and every layer id held (hydrated) here.
    pub images: Vec<String>,
    pub layers: Vec<String>,
    /// Sandboxes ready now in the ready pools (`--pool`), by image.
    #[serde(default)]
    pub ready: std::collections::BTreeMap<String, usize>,
}

/// `GET /v1/hosts`: a host sharing the catalog, as its row says.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct HostEntry {
    pub id: String,
    /// `ready`, `draining` (no new sandbox starts there) or `down` (stopped,
    /// or past its heartbeat deadline).
    pub state: String,
    /// Why it drains, or why it is down.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    pub version: String,
    /// Its machine (`/etc/machine-id`) and root directory.
    pub machine: String,
    pub root: String,
    /// Unix milliseconds: when it started, its last heartbeat, and when it
    /// counts as down without another.
    pub started_at_ms: i64,
    pub heartbeat_at_ms: i64,
    pub deadline_at_ms: i64,
    /// The sandboxes the catalog places there (lost, when it is down).
    pub sandboxes: Vec<String>,
    /// Its capacity at the last heartbeat (as `GET /v1/info` there).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity: Option<HostInfo>,
}

/// `POST /v1/drain`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Default)]
#[serde(deny_unknown_fields)]
pub struct DrainRequest {
    /// Said in every refusal (default: "drained by request").
    #[serde(default)]
    pub reason: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Default)]
#[serde(deny_unknown_fields)]
pub struct CheckpointRequest {
    /// `zstd` (default) or `gzip`.
    #[serde(default)]
    pub compression: Option<crate::store::BlobCompression>,
    /// Capture the whole upper (every change since the sandbox started,
    /// over its base) even after a checkpoint, instead of what changed
    /// since: a snapshot that keeps none of the sandbox's earlier ones.
    #[serde(default)]
    pub whole: bool,
    /// `local` (default) or `distributed`: also published to the fleet
    /// registry before the answer.
    #[serde(rename = "type", default)]
    pub kind: crate::model::SnapshotType,
    /// With `distributed`: answer once the snapshot is made, and publish
    /// it in the background (`publishing` until done).
    #[serde(rename = "async", default)]
    pub background: bool,
}

launch_request! {
    /// Per-sandbox settings of a resume or a fork.
    pub struct LaunchRequest {
        /// Fork only: how many sandboxes (1-64).
        #[serde(default)]
        pub count: Option<u32>,
    }
}

/// `POST /v1/sandboxes/{id}/timeout`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TimeoutRequest {
    /// Seconds from now.
    pub timeout: u64,
    /// Unset: as before.
    #[serde(default)]
    pub on_timeout: Option<crate::model::OnTimeout>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct SnapshotInfo {
    pub id: SnapshotId,
    /// `checkpoint` or `baseline`.
    pub class: crate::model::SnapshotClass,
    /// `ready` (its lineage's head), `superseded` (an older checkpoint of
    /// it), `retired` (its lineage is retired), ...
    pub state: crate::model::SnapshotState,
    /// True while a suspended sandbox's layer is hashed, synced and
    /// compressed (resume and fork work meanwhile).
    pub sealing: bool,
    /// A pulled layer of its chain is still being unpacked; a launch from
    /// it waits for that.
    #[serde(default)]
    pub hydrating: bool,
    /// A checkpoint's lineage, its place in it and the head it replaced.
    pub work_context: Option<String>,
    pub sequence: Option<i64>,
    pub predecessor: Option<SnapshotId>,
    /// A baseline's key, commit and validation evidence.
    #[serde(default)]
    pub baseline: Option<crate::records::Baseline>,
    pub image: String,
    pub parent: Option<SnapshotId>,
    /// The whole chain a resume mounts, bottom first (`sha256:<hex>`
    /// diff_ids; `None` for a layer still sealing).
    pub layers: Vec<Option<String>>,
    /// The local id of its own delta layer (its directory under `layers/`).
    pub layer: LayerId,
    /// `sha256:<hex>` of its own delta layer; `None` while sealing.
    pub diff_id: Option<String>,
    pub blob_digest: String,
    pub blob_size: u64,
    pub compression: crate::model::BlobCompression,
    pub source_sandbox: String,
    pub created_at: i64,
    /// Capture statistics: entries, bytes, whiteouts, opaque_dirs,
    /// hardlinks, tar_bytes; timings in ms (frozen_ms, blob_ms, total_ms,
    /// seal_ms).
    pub info: crate::records::SnapshotMeta,
    /// What it costs the store: its own layer unpacked, and its whole
    /// chain's layers and blobs (a resume mounts the chain).
    #[serde(default)]
    pub bytes: SnapshotBytes,
    /// Kept by gc whatever its age, until released.
    #[serde(default)]
    pub retained: bool,
    #[serde(default)]
    pub labels: std::collections::BTreeMap<String, String>,
    /// `local`, or `distributed` (published to the fleet registry).
    #[serde(rename = "type", default)]
    pub kind: crate::model::SnapshotType,
    /// The host that made it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    /// Its reference in the fleet registry, once published.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub registry: Option<String>,
    /// An `async` publication is under way (this host's daemon), or why
    /// the last one failed (it stays local; `promote` retries).
    #[serde(default)]
    pub publishing: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub publish_error: Option<String>,
    /// Hosts up whose last heartbeat listed every layer of its chain
    /// (they restore it without fetching).
    #[serde(default)]
    pub hosts: Vec<String>,
}

/// A snapshot's bytes in the store.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct SnapshotBytes {
    /// Its own layer, unpacked (0 while a suspend's layer is sealing).
    pub layer: u64,
    /// Its own blob (compressed).
    pub blob: u64,
    /// Its layer chain above the image (itself included): layers unpacked, blobs.
    pub chain_layers: u64,
    pub chain_blobs: u64,
}

/// `GET /v1/df`: the store's use by images, snapshots and sandboxes, and
/// what `gc` would reclaim now.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct DiskUsage {
    pub images: Usage,
    pub snapshots: Usage,
    /// Live sandboxes: their uppers (what they wrote), as allocated on disk.
    pub sandboxes: Usage,
    /// What a `gc` with the daemon's retention would delete now, and the
    /// bytes only those snapshots hold (their layers unpacked and blobs).
    pub reclaimable: Reclaimable,
    /// The file system the store is on.
    pub store_used_bytes: u64,
    pub store_free_bytes: u64,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct Usage {
    pub count: u64,
    /// Unpacked layers (or, for sandboxes, uppers), counted once.
    pub layer_bytes: u64,
    /// Compressed blobs, counted once.
    pub blob_bytes: u64,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct Reclaimable {
    pub snapshots: Vec<SnapshotId>,
    pub bytes: u64,
}

/// `POST /v1/snapshots/{id}/evaluate`: run a command against the
/// snapshot in a throwaway sandbox and record what it found.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Default)]
#[serde(deny_unknown_fields)]
pub struct EvaluateRequest {
    /// What is evaluated (`tests`, `reward`): 1-128 characters of
    /// `[A-Za-z0-9._:/-]`.
    pub name: String,
    /// Its version, in the same characters.
    pub version: String,
    pub argv: Vec<String>,
    /// `KEY=VALUE` for the command (besides `STRATA_RESULT`).
    #[serde(default)]
    pub env: Vec<String>,
    /// Seconds the command may run (default 600, at most 86400); then it
    /// is killed and recorded as timed out.
    #[serde(default)]
    pub timeout: Option<u64>,
    /// Run it even if this snapshot has a record of this name and version.
    #[serde(default)]
    pub again: bool,
}

/// `POST /v1/snapshots/{id}/labels`: set labels (a value) or remove them
/// (`null`); the others are kept.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Default)]
#[serde(deny_unknown_fields)]
pub struct LabelRequest {
    pub labels: std::collections::BTreeMap<String, Option<String>>,
}

/// Where a snapshot came from.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Provenance {
    pub image: String,
    pub image_manifest_digest: String,
    pub image_config_digest: String,
    /// Its ancestors, nearest first.
    pub parents: Vec<SnapshotId>,
    pub source_sandbox: String,
    /// The host that holds this record (its hostname), and whether the
    /// snapshot was captured here or pulled (`pulled_from`).
    pub host: String,
    pub pulled_from: Option<String>,
    /// This Strata's version.
    pub strata_version: String,
}

/// `GET /v1/snapshots/{id}/result`: everything recorded of a sealed
/// snapshot, in one document.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct SealedResult {
    pub snapshot: SnapshotInfo,
    /// Its chain, root first (the snapshot last).
    pub chain: Vec<SnapshotId>,
    pub provenance: Provenance,
    /// Its exec log, with output.
    pub logs: Vec<crate::records::ExecRecord>,
    pub evaluations: Vec<crate::records::Evaluation>,
    pub labels: std::collections::BTreeMap<String, String>,
    pub retained: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ExportRequest {
    /// Absolute path of a new directory on the daemon's host.
    pub path: String,
    #[serde(default)]
    pub compression: Option<crate::store::BlobCompression>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RollbackRequest {
    /// A snapshot of the sandbox's own lineage.
    pub to: String,
}

/// A lineage (work context) as `GET /v1/lineages` lists it: where it
/// began, its head and the live sandbox working in it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct LineageSummary {
    pub id: String,
    /// `active`; or ended: `retired`, or closed as `completed`,
    /// `cancelled` or `failed`.
    pub state: crate::model::LineageState,
    pub image: String,
    /// `image`, `baseline` or `fork`, and the snapshot for the latter two.
    pub start_kind: crate::model::StartKind,
    pub start: Option<SnapshotId>,
    /// Its head and the head's sequence number (0: no checkpoint yet).
    pub head: Option<SnapshotId>,
    pub head_seq: i64,
    /// The live sandbox working in it (at most one, fleet-wide).
    pub holder: Option<crate::records::Holder>,
    pub created_at: i64,
    pub used_at: i64,
    /// When it ended (retired or closed).
    pub retired_at: Option<i64>,
}

/// A lineage with its checkpoints and every activation
/// (`GET /v1/lineages/{id}`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct LineageInfo {
    #[serde(flatten)]
    pub lineage: LineageSummary,
    /// Its checkpoints, in append order.
    pub checkpoints: Vec<SnapshotInfo>,
    pub restores: Vec<crate::records::RestoreRow>,
}

/// `POST /v1/lineages/{id}/close`: how the lineage's work ended.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct CloseLineageRequest {
    /// `completed`, `cancelled` or `failed`.
    pub outcome: crate::model::LineageState,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Default)]
#[serde(deny_unknown_fields)]
pub struct GcRequest {
    /// Keep snapshots out of restore position this long (default: the
    /// daemon's `--retention`).
    #[serde(default)]
    pub retention_secs: Option<u64>,
    /// Retire lineages idle this long (default: the daemon's `--stale-after`).
    #[serde(default)]
    pub stale_after_secs: Option<u64>,
}

/// Where and how to reach a registry, for push and pull.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Default)]
#[serde(deny_unknown_fields)]
pub struct RegistryRequest {
    /// `[registry[:port]/]repository[:tag][@sha256:...]`.
    pub reference: String,
    /// Speak plain HTTP (a local test registry).
    #[serde(default)]
    pub insecure: bool,
    /// Basic-auth credentials (also sent to a bearer-token endpoint).
    #[serde(default)]
    pub username: Option<String>,
    #[serde(default)]
    pub password: Option<String>,
    /// Image pull only: the local name (default: repository:tag).
    #[serde(default)]
    pub name: Option<String>,
    /// Stream progress as JSON lines before the result.
    #[serde(default)]
    pub progress: bool,
}

/// What a push sent.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct PushResult {
    pub reference: String,
    pub manifest_digest: String,
    /// Blobs in the manifest (config included).
    pub blobs: usize,
    pub uploaded_blobs: usize,
    pub uploaded_bytes: u64,
    /// Blobs the repository had already (HEAD) or mounted from another.
    pub present_blobs: usize,
    pub mounted_blobs: usize,
}

/// What a pull fetched and recorded.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct PullResult {
    pub reference: String,
    pub manifest_digest: String,
    pub image: ImageInfo,
    /// The recreated snapshot (snapshot pull only).
    #[serde(default)]
    pub snapshot: Option<SnapshotInfo>,
    pub fetched_blobs: usize,
    /// Bytes of layer and config blobs downloaded (manifests not counted).
    pub fetched_bytes: u64,
    /// Layers this host had already (not fetched).
    pub reused_layers: usize,
}

/// One progress line of a streamed push or pull.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Progress {
    /// `fetch`, `reuse`, `verify` (a diff_id), `unpack`, `upload`, `present`, `mount`.
    pub action: String,
    pub digest: String,
    pub size: u64,
    /// Bytes done so far (fetch).
    pub done: u64,
}

/// What one `gc` did.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct GcReport {
    /// Lineages retired as stale.
    pub retired: Vec<String>,
    /// Snapshots deleted.
    pub deleted: Vec<String>,
    /// Snapshots past retention kept because something uses them, with why.
    pub kept: Vec<(String, String)>,
    /// Layers and blobs the collector removed (no row listed them and no
    /// operation leased them).
    #[serde(default)]
    pub collected: usize,
}

/// `DELETE /v1/sandboxes/{id}` (202) of a sandbox whose host is down and
/// not because it stopped: the fleet forgets it, and that host removes it
/// once it is back.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct RemovalDeferred {
    pub id: String,
    pub host: String,
    /// Why the catalog has that host down.
    pub host_down: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_launch_requests_take_the_shared_settings_and_refuse_a_misspelt_one() {
        let shared = serde_json::json!({
            "memory": 1, "pids": 2, "cpus": 0.5, "disk": 3, "env": ["A=1"], "secret_env": ["S=2"],
            "hostname": "h", "id": "0123456789abcdef", "wait": 4, "scratch": ["/s"], "cache": ["c:/c"],
            "seccomp": "default", "userns": true, "timeout": 5, "on_timeout": "suspend", "idle_timeout": 6,
            "network": {"mode": "egress"},
        });
        let mut create = shared.clone();
        create["image"] = "busybox".into();
        create["work_context"] = "task".into();
        let create: CreateRequest = serde_json::from_value(create).unwrap();
        let mut launch = shared.clone();
        launch["count"] = 2.into();
        let launch: LaunchRequest = serde_json::from_value(launch).unwrap();
        // What a create carries into its launch is what a resume gives.
        assert_eq!(create.into_launch(), LaunchRequest { count: None, ..launch.clone() });
        assert_eq!((launch.memory, launch.count, launch.idle_timeout), (Some(1), Some(2), Some(6)));
        for bad in ["memroy", "count"] {
            let mut body = shared.clone();
            body["image"] = "busybox".into();
            body[bad] = 1.into();
            let err = serde_json::from_value::<CreateRequest>(body).unwrap_err().to_string();
            assert!(err.contains(&format!("unknown field `{bad}`")), "{err}");
        }
        let err = serde_json::from_value::<LaunchRequest>(serde_json::json!({"image": "x"})).unwrap_err();
        assert!(err.to_string().contains("unknown field `image`"), "{err}");
    }
}
