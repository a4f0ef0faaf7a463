//! Snapshot operations of the daemon: checkpoint (seal a running sandbox's
//! delta), suspend (seal a stopped sandbox's upper by moving it), resume and
//! fork (start sandboxes on a snapshot's chain), and list/inspect/remove.
//!
//! A checkpoint is, in order: pre-copy (the upper's large files, copied
//! while the sandbox runs, see `sandbox/precopy.rs`), capture (frozen: upper
//! → tar, referring to the copies still current, see
//! `sandbox/checkpoint.rs`; a thread compresses the tar into
//! `blobs/sha256/<digest>` as it is written), then, with the sandbox running
//! again, hydrate the tar into `tmp/` with the same per-entry checks imports
//! use (hashing it: the diff_id; the copies are linked in), rename it to
//! `layers/<diff_id>`, make layer and blob durable with one syncfs, and
//! record layer + snapshot in one transaction. Any failure removes what
//! this checkpoint made; `tmp/` is swept at start for a daemon killed
//! mid-way, and layer and blob files the database does not list are swept
//! too.
//!
//! A sandbox's upper holds everything it changed since it started. Its
//! first checkpoint is that upper as one layer on top of the snapshot it
//! started from (or its image). Each later one is incremental: a layer of
//! what changed since the sandbox's last checkpoint, whose parent that
//! checkpoint is (`diff.rs`, `stamps.rs`: what each capture saw of the
//! upper is kept next to the sandbox and used while it describes this
//! upper, on this base, and names a checkpoint still there). A rollback
//! starts a new upper on the snapshot rolled back to, so the checkpoint
//! after it is on top of that snapshot.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use crate::daemon::{lock, sandbox_info, Base, Daemon};
use crate::db::{LayerRow, SnapshotRow};
use crate::error::{Classify, ErrorKind};
use crate::ids::{LayerId, SandboxId, SnapshotId};
use crate::model::{Rung, SnapshotClass, SnapshotState, SnapshotType, StartKind};
use crate::oci;
use crate::sandbox::Until;
use crate::store::{remove_tree, BlobCompression, Lease, Resource, Scope, StoreError};
use crate::types::{LaunchRequest, SandboxInfo, SnapshotInfo};

/// A chain folded into one layer by `compact_if_deep`.
struct Compacted {
    /// `<dir>/fs` is the layer's tree.
    dir: std::path::PathBuf,
    diff_id: String,
    stats: crate::diff::DeltaStats,
    tar: Option<std::path::PathBuf>,
}

/// A checkpoint's layer, in place under `layers/`.
struct Sealed {
    diff_id: String,
    /// The layer's tar (for its blob).
    tar: std::path::PathBuf,
    stats: crate::diff::DeltaStats,
    frozen: std::time::Duration,
    size: u64,
    entries: u64,
    compacted: bool,
}

/// A checkpoint being captured: of which sandbox, under which id, over
/// which earlier checkpoint (and what its capture saw) if incremental,
/// working in `work`, since when.
#[derive(Clone, Copy)]
struct Capturing<'a> {
    sb: &'a crate::sandbox::Sandbox,
    id: &'a SnapshotId,
    since: Option<&'a (SnapshotRow, crate::stamps::Stamps)>,
    work: &'a Path,
    started: Instant,
}

/// Most sandboxes one fork may start.
pub const MAX_FORK: u32 = 64;

/// Put a delta's statistics into a snapshot's info.
pub(crate) fn merge_stats(info: &mut serde_json::Value, stats: &crate::diff::DeltaStats) {
    for (k, v) in [
        ("entries", stats.entries),
        ("bytes", stats.bytes),
        ("whiteouts", stats.whiteouts),
        ("opaque_dirs", stats.opaque_dirs),
        ("hardlinks", stats.hardlinks),
        ("tar_bytes", stats.tar_bytes),
    ] {
        info[k] = serde_json::json!(v);
    }
}

/// Put a stopped sandbox's upper at `work/fs`: moved (no data read), or
/// copied through its delta tar (streamed through a pipe, never on disk)
/// with the same checks as a checkpoint when it is on its own disk
/// (`--disk`, another file system) or when `copy` says a move is unsafe
/// (`MountDecl::passes_descriptors`). With `since` (what the sandbox's
/// last checkpoint saw), only what changed since is kept: a moved upper is
/// pruned in place (`stamps::prune`), a copy is of the increment. Returns
/// whether it was moved (and must be given back on failure).
fn move_or_copy_upper(
    upper: &Path,
    work: &Path,
    copy: bool,
    since: Option<&crate::stamps::Stamps>,
) -> Result<bool, CaptureError> {
    let fs_dir = work.join("fs");
    let io = |step| move |source| CaptureError::Io { step, source };
    if !copy {
        match std::fs::rename(upper, &fs_dir) {
            Ok(()) => {
                let Some(since) = since else { return Ok(true) };
                // Refused before it removed anything: the upper goes back.
                return match crate::stamps::prune(&fs_dir, since) {
                    Ok(p) => {
                        if p.failed > 0 {
                            tracing::warn!("{}: {} unchanged entries could not be pruned", upper.display(), p.failed);
                        }
                        Ok(true)
                    }
                    Err(e) => {
                        if let Err(back) = std::fs::rename(&fs_dir, upper) {
                            tracing::error!("give {} back: {back}", upper.display());
                        }
                        Err(io("keep only what changed since the last checkpoint")(e))
                    }
                };
            }
            Err(e) if e.raw_os_error() == Some(libc::EXDEV) => {}
            Err(e) => return Err(io("move the upper")(e)),
        }
    }
    std::fs::create_dir(&fs_dir).map_err(io("create the layer"))?;
    let (r, w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(|e| io("make a pipe")(e.into()))?;
    let (written, unpacked) = std::thread::scope(|s| {
        let writer = s.spawn(move || {
            let mut w = std::io::BufWriter::with_capacity(1 << 20, std::fs::File::from(w));
            crate::diff::write_delta_since(upper, &mut w, since).map_err(std::io::Error::other)?;
            std::io::Write::flush(&mut w)
        });
        let unpacked = oci::unpack_own_stream(std::fs::File::from(r), &fs_dir);
        (writer.join().unwrap_or_else(|_| Err(std::io::Error::other("the tar writer panicked"))), unpacked)
    });
    match (written, unpacked) {
        (Ok(()), Ok(_)) => Ok(false),
        // The unpacker refused an entry and stopped reading: the writer's
        // broken pipe is only the echo of that.
        (Err(e), Err(u)) if broken_pipe(&e) => Err(CaptureError::Unsealable(u)),
        (Err(e), _) => Err(io("copy the upper")(e)),
        (Ok(()), Err(u)) => Err(CaptureError::Unsealable(u)),
    }
}

/// A delta writer's error that is a write to a closed pipe.
fn broken_pipe(e: &std::io::Error) -> bool {
    let inner = e.get_ref().and_then(|d| d.downcast_ref::<crate::diff::DiffError>());
    match inner {
        Some(crate::diff::DiffError::Write { source, .. }) => source.kind() == std::io::ErrorKind::BrokenPipe,
        _ => e.kind() == std::io::ErrorKind::BrokenPipe,
    }
}

/// Why a capture (`checkpoint`, `suspend`, a baseline's publish) or the
/// seal of a suspended snapshot failed.
#[derive(Debug, thiserror::Error, displaydoc::Display)]
pub enum CaptureError {
    /// {0}
    Sandbox(#[from] crate::daemon::SandboxOpError),
    /// {0}
    Live(#[from] crate::sandbox::SandboxError),
    /// the sandbox's changes cannot be sealed: {0}
    Unsealable(#[source] oci::UnpackError),
    /// the sandbox's changes cannot be sealed: {0}
    UnsealableContent(String),
    /// {0}
    Worker(#[source] crate::worker::WorkerError),
    /// sandbox {0} was removed (or suspended) during its checkpoint
    RemovedMeanwhile(SandboxId),
    /// {what} refused: {fence}
    Fenced { what: &'static str, fence: crate::db::Fence },
    /// sandbox {0} is not running or paused
    NotSuspendable(SandboxId),
    /// the blob thread panicked
    Panicked,
    /// the sandbox's image row is missing
    NoImageRow,
    /// {0}
    ImageName(#[from] crate::ids::BadImageName),
    /// the capture has no diff_id
    NoDiffId,
    /// {0}
    LayerId(#[from] crate::ids::BadLayerId),
    /// {0}
    Store(#[from] StoreError),
    /// {step}: {source}
    Io { step: &'static str, source: std::io::Error },
    /// {0}
    Diff(#[from] crate::diff::DiffError),
    /// {0}
    Cgroup(#[from] crate::cgroups::CgroupError),
    /// {0}
    Db(#[from] crate::db::DbError),
    /// {0}
    Lookup(#[from] SnapshotLookupError),
    /// {0}
    Lineage(#[from] crate::daemon::lineage::LineageError),
    /// the daemon is stopping
    Stopping,
    /// {0}
    Digest(#[from] crate::oci::DigestError),
    /// snapshot {id} cannot be sealed: {message}
    SealFailed { id: String, message: String },
    /// snapshot {id}: layer serialises to {hex}, not its diff_id {diff_id:?}
    DiffIdMismatch { id: String, hex: String, diff_id: Option<String> },
}

impl Classify for CaptureError {
    fn kind(&self) -> ErrorKind {
        use CaptureError as C;
        match self {
            C::Sandbox(e) => e.kind(),
            C::Live(e) => e.kind(),
            // What the sandbox left there (an escaping symlink, say) is a
            // conflict; a host failure is 500/507.
            C::Unsealable(e) if !e.is_io() => ErrorKind::Conflict,
            C::UnsealableContent(_) | C::RemovedMeanwhile(_) | C::Fenced { .. } | C::NotSuspendable(_) => {
                ErrorKind::Conflict
            }
            C::Stopping | C::SealFailed { .. } => ErrorKind::Conflict,
            C::Worker(e) => match e.errno() {
                Some(libc::ENOSPC) | Some(libc::EDQUOT) => ErrorKind::NoSpace,
                _ => ErrorKind::Internal,
            },
            C::ImageName(_) => ErrorKind::InvalidArgument,
            C::Db(e) => e.kind(),
            C::Lookup(e) => e.kind(),
            C::Lineage(e) => e.kind(),
            _ => ErrorKind::of_host_failure(self),
        }
    }
}

/// A capture worker's failure (`worker.rs`): what the sandbox left there
/// is the sandbox's (a conflict), anything else the host's.
pub(crate) fn worker_err(e: crate::worker::WorkerError) -> CaptureError {
    match e {
        crate::worker::WorkerError::Failed(f) if f.content => CaptureError::UnsealableContent(f.message),
        e => CaptureError::Worker(e),
    }
}

/// Unpack a captured tar into `work/layer/fs`, in a worker (`place`d in
/// the sandbox's capture cgroup), with the same per-entry checks as image
/// layers. Returns `work/layer`, what was unpacked, the tar's sha256 hex
/// (its diff_id) and the worker's CPU time.
fn unpack_capture(
    cap: &crate::sandbox::Capture,
    work: &Path,
    place: crate::worker::Place<'_>,
    gone: &crate::sandbox::Gone,
) -> Result<((std::path::PathBuf, oci::UnpackStats), String, std::time::Duration), CaptureError> {
    let layer_dir = work.join("layer");
    let fs_dir = layer_dir.join("fs");
    std::fs::create_dir_all(&fs_dir).map_err(|source| CaptureError::Io { step: "create the layer", source })?;
    let (unpacked, diff_id, cpu) =
        crate::worker::unpack(&cap.tar, &cap.segments, &fs_dir, place, gone).map_err(worker_err)?;
    Ok(((layer_dir, unpacked), diff_id, cpu))
}

/// A capture abandoned because its sandbox went away (removed or
/// suspended) while it ran.
fn removed_meanwhile(sb: &crate::sandbox::Sandbox) -> CaptureError {
    CaptureError::RemovedMeanwhile(sb.id.clone())
}

/// Mark a snapshot captured in a user namespace: its chain then runs only
/// in one (`Daemon::settle_userns`).
/// Whether a snapshot's files can be read (resumed, forked, exported,
/// pushed, diffed): not while it is being captured or removed, nor after a
/// capture that failed (it holds nothing). A suspend whose seal failed
/// still holds its files and is restorable by id.
pub(crate) fn restorable(row: &SnapshotRow) -> Result<(), SnapshotLookupError> {
    let why = match row.state {
        SnapshotState::Capturing => "is still being captured",
        SnapshotState::Deleting => return Err(SnapshotLookupError::BeingRemoved(row.id.clone())),
        SnapshotState::Failed if row.info.get("capture_error").is_some() => "is a capture that failed",
        _ => return Ok(()),
    };
    let reason = row.info["capture_error"].as_str().map(|e| format!(" ({e})")).unwrap_or_default();
    Err(SnapshotLookupError::NotRestorable(format!("snapshot {} {why}{reason}", row.id)))
}

/// A snapshot's sealed exec log: its chain's segments, root first.
pub(crate) fn snapshot_log(
    db: &crate::db::Db,
    id: &str,
    output: bool,
) -> Result<Vec<crate::db::ExecRecord>, crate::db::DbError> {
    let mut out = Vec::new();
    for s in db.snapshot_chain(id)? {
        out.extend(own_log(db, &s, output)?);
    }
    Ok(out)
}

/// The exec records a snapshot seals itself (its segment of the log):
/// its source sandbox's records with ids in `(log_from, log_upto]`; for a
/// pulled snapshot, the records its pull inserted, whatever sandbox ran
/// them (`log_pulled`). None for a snapshot that records no log.
pub(crate) fn own_log(
    db: &crate::db::Db,
    s: &SnapshotRow,
    output: bool,
) -> Result<Vec<crate::db::ExecRecord>, crate::db::DbError> {
    let (from, upto) = (s.info["log_from"].as_i64().unwrap_or(0), s.info["log_upto"].as_i64().unwrap_or(0));
    let sandbox = (s.info["log_pulled"] != true).then_some(s.source_sandbox.as_str());
    db.exec_records(sandbox, from, Some(upto), output)
}

pub(crate) fn mark_userns(info: &mut serde_json::Value, sb: &crate::sandbox::Sandbox) {
    if sb.spec.userns.is_some() {
        info["userns"] = serde_json::Value::Bool(true);
    }
}

/// A checkpoint or suspend keeps its sandbox's network (mode and policy: a
/// sandbox started from it gets an address of its own). A baseline does
/// not: it is a repository's state, and new work from it starts with the
/// network its create asks for, not the publisher's.
fn mark_network(info: &mut serde_json::Value, sb: &crate::sandbox::Sandbox) {
    if sb.spec.network.mode != crate::net::NetworkMode::None {
        info["network"] = serde_json::to_value(sb.network_kept()).unwrap_or_default();
    }
}

/// The layer id of a tar this daemon hashed (a worker's report of it is
/// checked like any other input).
fn own_layer_id(diff_id_hex: &str) -> Result<LayerId, CaptureError> {
    Ok(LayerId::content(diff_id_hex)?)
}

fn store_err(e: StoreError) -> CaptureError {
    CaptureError::Store(e)
}

/// Why a snapshot could not be found, listed or shown: the look-up that
/// every operation on a snapshot starts with.
#[derive(Debug, thiserror::Error, displaydoc::Display)]
pub enum SnapshotLookupError {
    /// snapshot {0} not found
    NotFound(String),
    /// snapshot {0} is being removed
    BeingRemoved(SnapshotId),
    /// snapshot's image row is missing
    NoImageRow,
    /// {0}
    NotRestorable(String),
    /// {0}
    Db(#[from] crate::db::DbError),
    /// {0}
    Hydrate(Box<crate::daemon::distribution::TransferError>),
    /// {0}
    Fleet(Box<crate::daemon::fleet::FleetError>),
}

impl Classify for SnapshotLookupError {
    fn kind(&self) -> ErrorKind {
        match self {
            SnapshotLookupError::NotFound(_) | SnapshotLookupError::BeingRemoved(_) => ErrorKind::NotFound,
            SnapshotLookupError::NoImageRow => ErrorKind::Internal,
            SnapshotLookupError::NotRestorable(_) => ErrorKind::Conflict,
            SnapshotLookupError::Db(e) => e.kind(),
            SnapshotLookupError::Hydrate(e) => e.kind(),
            SnapshotLookupError::Fleet(e) => e.kind(),
        }
    }
}

/// Why `resume` or `fork` of a snapshot failed.
#[derive(Debug, thiserror::Error, displaydoc::Display)]
pub enum ResumeError {
    /// count is for fork
    Count,
    /// count must be 1-{max}, got {count}
    BadCount { count: u32, max: u32 },
    /// a hostname can only be given to a fork of count 1
    HostnameForMany,
    /// fork of {count} refused: {free} of {max} sandbox slots free (--max-sandboxes)
    NoRoom { count: u32, free: usize, max: usize },
    /// {0}
    Snapshot(#[from] SnapshotLookupError),
    /// {0}
    Launch(#[from] crate::daemon::LaunchError),
    /// {0}
    Lineage(#[from] crate::daemon::lineage::LineageError),
}

impl Classify for ResumeError {
    fn kind(&self) -> ErrorKind {
        match self {
            ResumeError::Count | ResumeError::BadCount { .. } | ResumeError::HostnameForMany => {
                ErrorKind::InvalidArgument
            }
            ResumeError::NoRoom { .. } => ErrorKind::LimitReached,
            ResumeError::Snapshot(e) => e.kind(),
            ResumeError::Launch(e) => e.kind(),
            ResumeError::Lineage(e) => e.kind(),
        }
    }
}

/// Why `snapshot export` failed.
#[derive(Debug, thiserror::Error, displaydoc::Display)]
pub enum SnapshotExportError {
    /// {0}
    Snapshot(#[from] SnapshotLookupError),
    /// {0}
    Export(#[from] crate::export::ExportError),
    /// {0}
    Db(#[from] crate::db::DbError),
}

impl Classify for SnapshotExportError {
    fn kind(&self) -> ErrorKind {
        match self {
            SnapshotExportError::Snapshot(e) => e.kind(),
            SnapshotExportError::Export(crate::export::ExportError::Relative(_)) => ErrorKind::InvalidArgument,
            SnapshotExportError::Export(crate::export::ExportError::Exists(_)) => ErrorKind::Conflict,
            SnapshotExportError::Export(_) => ErrorKind::of_host_failure(self),
            SnapshotExportError::Db(e) => e.kind(),
        }
    }
}

/// Why `snapshot diff` failed.
#[derive(Debug, thiserror::Error, displaydoc::Display)]
pub enum SnapshotDiffError {
    /// {0}
    Snapshot(#[from] SnapshotLookupError),
    /// {0}
    Diff(#[from] crate::diff::DiffError),
}

impl Classify for SnapshotDiffError {
    fn kind(&self) -> ErrorKind {
        match self {
            SnapshotDiffError::Snapshot(e) => e.kind(),
            SnapshotDiffError::Diff(_) => ErrorKind::of_host_failure(self),
        }
    }
}

/// Why `snapshot rm` failed.
#[derive(Debug, thiserror::Error, displaydoc::Display)]
pub enum RemoveSnapshotError {
    /// {0}
    Snapshot(#[from] SnapshotLookupError),
    /// snapshot {id} is used by sandboxes {users:?}; remove them first
    UsedBy { id: SnapshotId, users: Vec<String> },
    /// snapshot {0} is in use by an operation in flight (resume, fork, rollback, sealing); retry
    InFlight(SnapshotId),
    /// snapshot {id} is still needed by {children:?} (child snapshots, the lineage it heads, sandboxes of other hosts); remove them first
    HasChildren { id: SnapshotId, children: Vec<String> },
    /// {0}
    Db(#[from] crate::db::DbError),
    /// {0}
    Collect(#[from] crate::daemon::CollectError),
}

impl Classify for RemoveSnapshotError {
    fn kind(&self) -> ErrorKind {
        match self {
            RemoveSnapshotError::Snapshot(e) => e.kind(),
            RemoveSnapshotError::Db(e) => e.kind(),
            RemoveSnapshotError::Collect(e) => e.kind(),
            _ => ErrorKind::Conflict,
        }
    }
}

/// Why `rollback` failed.
#[derive(Debug, thiserror::Error, displaydoc::Display)]
pub enum RollbackError {
    /// {0}
    Sandbox(#[from] crate::daemon::SandboxOpError),
    /// {0}
    Snapshot(#[from] SnapshotLookupError),
    /// snapshot {snapshot} is not in sandbox {sandbox}'s lineage (neither its base nor its own checkpoint)
    NotInLineage { snapshot: SnapshotId, sandbox: SandboxId },
    /// sandbox {sandbox} is {state}: rollback refused
    Stopping { sandbox: SandboxId, state: crate::sandbox::RunState },
    /// {0}
    Stop(#[from] crate::sandbox::SandboxError),
    /// {0}
    Launch(#[from] crate::daemon::LaunchError),
    /// {0}
    Db(#[from] crate::db::DbError),
}

impl Classify for RollbackError {
    fn kind(&self) -> ErrorKind {
        match self {
            RollbackError::Sandbox(e) => e.kind(),
            RollbackError::Snapshot(e) => e.kind(),
            RollbackError::NotInLineage { .. } | RollbackError::Stopping { .. } => ErrorKind::Conflict,
            RollbackError::Stop(e) => e.kind(),
            RollbackError::Launch(e) => e.kind(),
            RollbackError::Db(e) => e.kind(),
        }
    }
}

impl Daemon {
    /// Seal the sandbox's current changes as a snapshot; it keeps running.
    /// What changed since its last checkpoint, over that one, unless
    /// `whole` (or there is none): then every change since it started.
    pub fn checkpoint(
        &self,
        id: &str,
        compression: BlobCompression,
        whole: bool,
    ) -> Result<SnapshotInfo, CaptureError> {
        let sb = self.sandbox(id)?;
        let started = Instant::now();
        // Refused before any row while it cannot be captured (stopping, or
        // in another capture); the capture checks again as it freezes.
        let state = sb.run_state();
        if state.next(crate::sandbox::RunEvent::Capture).is_none() {
            let refused = crate::sandbox::SandboxError::State { id: sb.id.clone(), state, action: "checkpoint" };
            return Err(refused.into());
        }
        // Incremental over the sandbox's last checkpoint, if that is still
        // there and what was recorded of it still holds.
        let since = if whole { None } else { self.last_capture(&sb) };
        let parent = since.as_ref().map(|(row, _)| row.id.clone()).or_else(|| sb.spec.snapshot.clone());
        // A row from now on (`capturing`: listed, never restorable), fenced
        // as its append will be: a sandbox fenced out of its lineage fails
        // before any work.
        let capture = {
            let mut db = lock(&self.db);
            let image = db.image_by_name(&sb.spec.image.parse()?)?.ok_or(CaptureError::NoImageRow)?;
            match db.begin_capture(&sb.id, image.id, parent.clone())? {
                Ok(id) => id,
                Err(fence) => return Err(CaptureError::Fenced { what: "checkpoint", fence }),
            }
        };
        crate::failpoint::hit("checkpoint:begun");
        let work = self.rt.store.new_tmp("checkpoint").map_err(store_err);
        // Appended to the sandbox's lineage, fenced on the head it observed.
        let append = |db: &mut crate::db::Db, row: &mut SnapshotRow, layer: &LayerRow| match db
            .append_checkpoint(&sb.id, row, layer, false, false)?
        {
            Ok(()) => Ok(()),
            Err(fence) => Err(CaptureError::Fenced { what: "checkpoint", fence }),
        };
        let result = work.and_then(|work| {
            let r = self.leased(|lease| {
                let cap = Capturing { sb: &sb, id: &capture, since: since.as_ref(), work: &work, started };
                self.capture_in(&cap, compression, &append, lease)
            });
            let _ = remove_tree(&work);
            r
        });
        // Whatever failed once the sandbox went away failed because it did.
        let result = result.map_err(|e| if sb.gone().is_set() { removed_meanwhile(&sb) } else { e });
        if let Err(e) = &result {
            if let Err(db) = lock(&self.db).capture_failed(capture.as_str(), &crate::error::chain(e)) {
                tracing::warn!("checkpoint {capture}: {}", crate::error::chain(&db));
            }
        }
        result
    }

    /// The sandbox's last checkpoint and what its capture saw of the
    /// upper, if a checkpoint now can be an increment over it: the stamps
    /// describe this upper on this base, and name a checkpoint of this
    /// sandbox that is still restorable. Else (none yet, a rollback, the
    /// checkpoint removed, the record unreadable) the capture is whole.
    fn last_capture(&self, sb: &crate::sandbox::Sandbox) -> Option<(SnapshotRow, crate::stamps::Stamps)> {
        use std::os::unix::fs::MetadataExt;
        let dirs = sb.dirs(&self.rt.store);
        let (origin, stamps) = match crate::stamps::Stamps::load(&dirs.dir.join("stamps")) {
            Ok(found) => found?,
            Err(e) => {
                tracing::warn!("sandbox {}: what its last checkpoint saw is unreadable ({e}); capturing whole", sb.id);
                return None;
            }
        };
        let upper = std::fs::symlink_metadata(&dirs.upper).ok()?;
        if origin.upper != (upper.dev(), upper.ino()) || origin.base != sb.spec.snapshot.as_deref().unwrap_or("") {
            return None;
        }
        let row = lock(&self.db).snapshot(&origin.snapshot).ok()??;
        (row.source_sandbox == sb.id.as_str() && restorable(&row).is_ok()).then_some((row, stamps))
    }

    /// Keep what a checkpoint's capture saw, for the next to be an
    /// increment over it (best effort: without it the next is whole).
    fn keep_stamps(&self, sb: &crate::sandbox::Sandbox, snapshot: &SnapshotId, stamps: &crate::stamps::Stamps) {
        use std::os::unix::fs::MetadataExt;
        let dirs = sb.dirs(&self.rt.store);
        let kept = std::fs::symlink_metadata(&dirs.upper).and_then(|upper| {
            let origin = crate::stamps::Origin {
                snapshot: snapshot.to_string(),
                base: sb.spec.snapshot.clone().map(|s| s.to_string()).unwrap_or_default(),
                upper: (upper.dev(), upper.ino()),
            };
            stamps.save(&origin, &dirs.dir.join("stamps"))
        });
        if let Err(e) = kept {
            tracing::warn!("sandbox {}: keep what checkpoint {snapshot} saw: {e}; the next is whole", sb.id);
        }
    }

    /// Capture a running sandbox's changes as a snapshot and hand the row
    /// and its layer to `record`, which writes them to the database (a
    /// checkpoint's fenced append). What it puts in place is held by
    /// `lease`; if `record` refuses, what no row lists is the collector's
    /// once the lease ends.
    fn capture_in(
        &self,
        cap: &Capturing<'_>,
        compression: BlobCompression,
        record: &dyn Fn(&mut crate::db::Db, &mut SnapshotRow, &LayerRow) -> Result<(), CaptureError>,
        lease: &Lease,
    ) -> Result<SnapshotInfo, CaptureError> {
        let Capturing { sb, id, since, work, started } = *cap;
        let parent = since.map(|(row, _)| row.id.clone()).or_else(|| sb.spec.snapshot.clone());
        let stamps_since = since.map(|(_, stamps)| stamps);
        let store = &self.rt.store;
        let dirs = sb.dirs(store);
        let tar = work.join("layer.tar");
        let ahead = work.join("ahead.tar");
        // Where copies can be proven current (`precopy.rs`), the capture is
        // written ahead while the sandbox runs, and a thread compresses it
        // meanwhile; the frozen capture refers to the copies still current
        // and, if it wrote the same tar, that blob is the snapshot's
        // (`checkpoint.rs`); else the frozen tar is compressed after the
        // thaw. Where nothing could be written ahead to confirm (another
        // file system; a large file that could not be copied), a thread
        // compresses the frozen capture's tar while it is written, so that
        // the frozen capture only copies. A snapshot that compacts its
        // chain gets the compacted layer's blob, written after the fold.
        // The hydration hashes the tar (diff_id). Nothing is written ahead
        // for a sandbox whose capture will be refused (stopping, or in a
        // capture; best effort: two concurrent checkpoints both may).
        let deep = self.needs_compaction(parent.as_deref())?;
        let capturable = sb.run_state().next(crate::sandbox::RunEvent::Capture).is_some();
        let copier = (!deep && capturable)
            .then(|| crate::sandbox::Precopier::new(&dirs.upper, &work.join("pre")))
            .and_then(|r| r.map_err(|e| tracing::warn!("pre-copy of sandbox {}: {e}", sb.id)).ok().flatten());
        // How far the tar written ahead is (its follower makes the blob).
        let written = Arc::new(crate::sandbox::TarProgress::default());
        // Compression and hydration run in workers charged to the sandbox
        // (`worker.rs`); their CPU time, in microseconds.
        let worker_cpu = std::sync::atomic::AtomicU64::new(0);
        let place: crate::worker::Place<'_> = sb;
        let spent = |cpu: std::time::Duration| {
            worker_cpu.fetch_add(cpu.as_micros() as u64, std::sync::atomic::Ordering::Relaxed);
        };
        // Made durable with the layer, by one syncfs before the row.
        let blob_of = |input: &mut dyn std::io::Read| {
            let tmp = store.new_blob_path();
            match crate::worker::compress(input, compression, &tmp, false, place, sb.gone()) {
                Ok(((hex, size), cpu)) => {
                    spent(cpu);
                    store.place_blob(&tmp, &hex, lease).map(|()| (hex, size)).map_err(store_err)
                }
                Err(e) => {
                    let _ = std::fs::remove_file(&tmp);
                    Err(worker_err(e))
                }
            }
        };
        let compress = |follow: Until<crate::sandbox::TarFollower>| {
            let mut follow = std::io::BufReader::with_capacity(1 << 20, follow);
            (blob_of(&mut follow), started.elapsed())
        };
        // Stop the follower of the tar written ahead; its blob, if it made
        // one, is left to the collector.
        let give_up = |follower: Option<std::thread::ScopedJoinHandle<'_, _>>| {
            written.cancel();
            if let Some(h) = follower {
                let _ = h.join();
            }
        };
        let (unpacked, follower, spec) = std::thread::scope(|s| {
            // Should anything here panic, the followers stop (the scope
            // joins them before the panic goes on).
            let _ends = written.end_on_drop();
            let mut follower = copier.is_some().then(|| {
                let follow = Until::new(crate::sandbox::TarFollower::new(&ahead, written.clone()), sb.gone());
                s.spawn(move || compress(follow))
            });
            let spec = copier
                .map(|c| crate::sandbox::speculate(&dirs.upper, &ahead, c, written.clone(), sb.gone(), stamps_since));
            let confirmable = spec.as_ref().is_some_and(|s| s.ahead.is_ok());
            if spec.is_some() && !confirmable {
                // Nothing written ahead to confirm.
                give_up(follower.take());
            }
            // Else a thread compresses the frozen tar as it is written.
            let live = (follower.is_none() && !deep).then(|| {
                let live = Arc::new(crate::sandbox::TarProgress::default());
                let follow = Until::new(crate::sandbox::TarFollower::new(&tar, live.clone()), sb.gone());
                follower = Some(s.spawn(move || compress(follow)));
                live
            });
            let _live_ends = live.as_ref().map(|l| l.end_on_drop());
            let cap = sb.capture(&dirs.upper, &tar, live.clone(), spec.as_ref(), stamps_since);
            if let Some(live) = &live {
                live.end(cap.is_ok());
            }
            if let (Ok(cap), Some(spec)) = (&cap, &spec) {
                spec.pre.remove_unused(cap.segments.iter().map(|s| &*s.copy.path));
            }
            let same = cap.as_ref().is_ok_and(|c| c.same_as_ahead);
            if confirmable && !same {
                // Written ahead in vain: the frozen tar is compressed.
                give_up(follower.take());
                if let Ok(cap) = &cap {
                    let follow = crate::sandbox::TarFollower::finished(cap).map(|f| Until::new(f, sb.gone()));
                    let path = cap.tar.clone();
                    follower = Some(s.spawn(move || match follow {
                        Ok(follow) => compress(follow),
                        Err(source) => (
                            Err(store_err(StoreError::Io { step: "read checkpoint tar", path, source })),
                            started.elapsed(),
                        ),
                    }));
                }
            }
            crate::failpoint::hit("checkpoint:captured");
            // Hydrate while the blob is being finished.
            let unpacked = cap.map_err(CaptureError::from).and_then(|mut cap| {
                let (u, diff_id, cpu) = unpack_capture(&cap, work, place, sb.gone())?;
                spent(cpu);
                cap.diff_id.get_or_insert(diff_id);
                Ok((cap, u))
            });
            // Why the blob made ahead was not the snapshot's, if one was.
            let spec = spec.map(|s| {
                let missed = match (s.ahead, same) {
                    (Err(e), _) => Some(e),
                    (Ok(_), false) => Some("the frozen tar is not the one written ahead: files changed".to_string()),
                    (Ok(_), true) => None,
                };
                (s.pre, missed)
            });
            (unpacked, follower.map(|h| h.join()), spec)
        });
        let follower = follower.map(|joined| match joined {
            Ok((r, at)) => r.map(|(hex, size)| (hex, size, at)),
            Err(_) => Err(CaptureError::Panicked),
        });
        let reused: u64 = match &unpacked {
            Ok((cap, _)) => cap.segments.iter().map(|s| s.len).sum(),
            Err(_) => 0,
        };
        let (sealed, blob, stamps) = match (unpacked, follower) {
            (Ok((mut cap, layer)), blob) => {
                let stamps = std::mem::take(&mut cap.stamps);
                let blob = blob.transpose()?;
                (self.finish_capture(parent.as_deref(), cap, layer, work, lease)?, blob, stamps)
            }
            (Err(e), _) => return Err(e),
        };
        crate::failpoint::hit("checkpoint:layer-committed");
        let blob = match blob {
            Some(b) => Ok(b),
            None => std::fs::File::open(&sealed.tar)
                .map_err(|source| {
                    store_err(StoreError::Io { step: "read checkpoint tar", path: sealed.tar.clone(), source })
                })
                .and_then(|tar| blob_of(&mut Until::new(tar, sb.gone())))
                .map(|(hex, size)| (hex, size, started.elapsed())),
        };
        let (blob_hex, blob_size, blob_at) = blob?;
        if crate::failpoint::fails("checkpoint:record") {
            return Err(CaptureError::UnsealableContent("failpoint checkpoint:record".into()));
        }

        let looked_up = (|| {
            let log_upto = self.last_exec_record(sb.id.as_str())?;
            let image = lock(&self.db).image_by_name(&sb.spec.image.parse()?)?.ok_or(CaptureError::NoImageRow)?;
            Ok::<_, CaptureError>((image, log_upto))
        })();
        let (image, log_upto) = looked_up?;
        let stats = &sealed.stats;
        let mut info = serde_json::json!({
            "frozen_ms": sealed.frozen.as_secs_f64() * 1000.0,
            "blob_ms": blob_at.as_secs_f64() * 1000.0,
            "total_ms": started.elapsed().as_secs_f64() * 1000.0,
            "precopy_ms": spec.as_ref().map_or(0.0, |(p, _)| p.took.as_secs_f64() * 1000.0),
            "precopied_bytes": spec.as_ref().map_or(0, |(p, _)| p.bytes),
            "blob_ahead": spec.as_ref().is_some_and(|(_, missed)| missed.is_none()),
            "ahead_missed": spec.as_ref().and_then(|(_, missed)| missed.clone()),
            "reused_bytes": reused,
            // An increment's log starts where its parent's ended.
            "log_from": since.map_or(sb.spec.log_from, |(row, _)| row.info["log_upto"].as_i64().unwrap_or(0)),
            "log_upto": log_upto,
            "incremental": since.is_some(),
            "compacted": sealed.compacted,
            "worker_cpu_ms": worker_cpu.load(std::sync::atomic::Ordering::Relaxed) as f64 / 1000.0,
        });
        merge_stats(&mut info, stats);
        mark_userns(&mut info, sb);
        mark_network(&mut info, sb);
        let layer = LayerRow::content(own_layer_id(&sealed.diff_id)?, sealed.size, sealed.entries);
        let mut row = SnapshotRow::new(image.id, parent.clone(), &layer, &sb.id, info);
        row.id = id.clone();
        (row.blob_digest, row.blob_size, row.compression) =
            (Some(format!("sha256:{blob_hex}").parse()?), blob_size, compression);
        self.telemetry.captured(blob_size);
        // Layer and blob are on disk before any row names them. The tars
        // are spent: deleted first, so the sync does not write them out.
        for spent in [&tar, &ahead, &sealed.tar] {
            let _ = std::fs::remove_file(spent);
        }
        let checked = store.sync().map_err(store_err).and_then(|()| {
            if sb.gone().is_set() {
                Err(removed_meanwhile(sb))
            } else {
                Ok(())
            }
        });
        // Until layer and blob are durable: all the checkpoint but the row.
        row.info["total_ms"] = (started.elapsed().as_secs_f64() * 1000.0).into();
        let mut db = lock(&self.db);
        // Refused: what this capture made is the collector's once the
        // lease ends; the sandbox runs on.
        checked.and_then(|()| record(&mut db, &mut row, &layer))?;
        drop(db);
        self.keep_stamps(sb, &row.id, &stamps);
        crate::failpoint::hit("checkpoint:appended");
        let info = self.snapshot_info_locked(&lock(&self.db), &row)?;
        tracing::info!(
            "checkpoint {} of sandbox {}: {} entries, frozen {:.1} ms",
            row.id,
            sb.id,
            stats.entries,
            sealed.frozen.as_secs_f64() * 1000.0
        );
        Ok(info)
    }

    /// Put an unpacked capture in place under `layers/<diff_id>` (or reuse
    /// an identical layer), folding the chain first if it is too deep.
    /// The layer is held by `lease`.
    fn finish_capture(
        &self,
        parent: Option<&str>,
        cap: crate::sandbox::Capture,
        (layer_dir, unpacked): (std::path::PathBuf, oci::UnpackStats),
        work: &Path,
        lease: &Lease,
    ) -> Result<Sealed, CaptureError> {
        let diff_id = cap.diff_id.ok_or(CaptureError::NoDiffId)?;
        let mut sealed = Sealed {
            diff_id,
            tar: cap.tar,
            stats: cap.stats,
            frozen: cap.frozen,
            size: unpacked.bytes,
            entries: unpacked.entries,
            compacted: false,
        };
        let mut layer_dir = layer_dir;
        if let Some(c) = self.compact_if_deep(parent, parent, &layer_dir.join("fs"), work, true)? {
            (layer_dir, sealed.size, sealed.entries) = (c.dir, c.stats.bytes, c.stats.entries);
            sealed.diff_id = c.diff_id;
            sealed.tar = c.tar.unwrap_or(sealed.tar);
            sealed.stats = c.stats;
            sealed.compacted = true;
        }
        // Synced with the blob, before the row is written (capture_in).
        self.rt.store.commit_layer(&layer_dir, &sealed.diff_id, false, lease).map_err(store_err)?;
        Ok(sealed)
    }

    pub(crate) fn snapshot_info_locked(
        &self,
        db: &crate::db::Db,
        row: &SnapshotRow,
    ) -> Result<SnapshotInfo, SnapshotLookupError> {
        let image = db.image_by_id(row.image_id)?.ok_or(SnapshotLookupError::NoImageRow)?;
        let chain = db.snapshot_layer_chain(&row.id)?;
        let place = db.snapshot_place(row.id.as_str())?.unwrap_or_default();
        let chain_layers: Vec<String> =
            image.layers.iter().map(ToString::to_string).chain(chain.iter().map(|s| s.layer.to_string())).collect();
        let hosts = self.hosts_holding(db, &chain_layers);
        let publish_state = lock(&self.publishing).get(row.id.as_str()).cloned();
        let digest = |h: &str| format!("sha256:{h}");
        let layers = image
            .layers
            .iter()
            .map(|h| Some(digest(h)))
            .chain(chain.iter().map(|s| s.diff_id.as_ref().map(ToString::to_string)));
        Ok(SnapshotInfo {
            id: row.id.clone(),
            class: row.class,
            state: row.state,
            sealing: db.blob_pending(&row.id)?,
            hydrating: chain
                .iter()
                .map(|s| db.unhydrated(&s.layer))
                .collect::<Result<Vec<_>, _>>()?
                .iter()
                .any(Option::is_some),
            work_context: row.work_context.clone(),
            sequence: row.sequence,
            predecessor: row.predecessor_id.clone(),
            baseline: row.baseline.clone(),
            image: image.name,
            parent: row.parent_id.clone(),
            layers: layers.collect(),
            layer: row.layer.clone(),
            diff_id: row.diff_id.as_ref().map(ToString::to_string),
            blob_digest: row.blob_digest.as_ref().map(ToString::to_string).unwrap_or_default(),
            blob_size: row.blob_size,
            compression: row.compression,
            source_sandbox: row.source_sandbox.clone(),
            created_at: row.created_at,
            info: row.info.clone(),
            bytes: crate::types::SnapshotBytes {
                layer: db.layer_size(row.layer.as_str())?,
                blob: row.blob_size,
                chain_layers: chain.iter().map(|s| db.layer_size(s.layer.as_str())).sum::<Result<u64, _>>()?,
                chain_blobs: chain.iter().map(|s| s.blob_size).sum(),
            },
            retained: db.retained(&row.id)?,
            labels: db.labels(&row.id)?,
            kind: if place.published.is_some() { SnapshotType::Distributed } else { SnapshotType::Local },
            host: place.host,
            registry: place.published,
            publishing: matches!(publish_state, Some(None)),
            publish_error: publish_state.flatten(),
            hosts,
        })
    }

    pub(crate) fn snapshot_row(&self, id: &str) -> Result<SnapshotRow, SnapshotLookupError> {
        self.snapshot_row_in(&lock(&self.db), id)
    }

    pub(crate) fn snapshot_row_in(&self, db: &crate::db::Db, id: &str) -> Result<SnapshotRow, SnapshotLookupError> {
        let not_found = || SnapshotLookupError::NotFound(format!("{id:?}"));
        let id: SnapshotId = id.parse().map_err(|_| not_found())?;
        db.snapshot(id.as_str())?.ok_or_else(not_found)
    }

    pub fn list_snapshots(&self) -> Result<Vec<SnapshotInfo>, SnapshotLookupError> {
        let db = lock(&self.db);
        db.list_snapshots()?.iter().map(|r| self.snapshot_info_locked(&db, r)).collect()
    }

    /// Row and pending mark read under one lock: a seal committing between
    /// them would show "not sealing" with no blob yet.
    pub fn get_snapshot(&self, id: &str) -> Result<SnapshotInfo, SnapshotLookupError> {
        let db = lock(&self.db);
        let row = self.snapshot_row_in(&db, id)?;
        self.snapshot_info_locked(&db, &row)
    }

    /// What a resume or fork of `row` starts from: its image and whole chain.
    pub(crate) fn snapshot_base(&self, row: &SnapshotRow) -> Result<Base, SnapshotLookupError> {
        restorable(row)?;
        let db = lock(&self.db);
        let image = db.image_by_id(row.image_id)?.ok_or(SnapshotLookupError::NoImageRow)?;
        let mut layers = image.layers.clone();
        let chain = db.snapshot_layer_chain(&row.id)?;
        // The chain ends at the nearest compacted snapshot, whose sandbox
        // ran on everything below it: marked if anything below was.
        let captured_in_userns = chain.iter().any(|s| s.info["userns"] == true);
        layers.extend(chain.into_iter().map(|s| s.layer));
        // A pulled chain may not be unpacked yet (one query; usually none is
        // waiting, and launches stay free of per-layer lookups).
        let waiting = db.unhydrated_layers_with(true)?;
        drop(db);
        for l in layers.iter().filter(|l| waiting.contains(l)) {
            self.hydrate_layer(l).map_err(|e| SnapshotLookupError::Hydrate(Box::new(e)))?;
        }
        // Layers this host lacks come from the fleet registry when the
        // snapshot was made elsewhere (or a registry could have them); a
        // snapshot of this host's missing a layer is left to the callers
        // (the ladder passes that rung).
        let store = &self.rt.store;
        if layers.iter().any(|l| !store.layer_dir(l.as_str()).join("fs").is_dir()) {
            let place = lock(&self.db).snapshot_place(row.id.as_str())?.unwrap_or_default();
            let made_here = place.host.as_deref().is_none_or(|h| h == self.cfg.host_id);
            if self.cfg.registry.is_some() || !made_here {
                self.bring_layers(row.id.as_str(), &layers).map_err(|e| SnapshotLookupError::Fleet(Box::new(e)))?;
            }
        }
        Ok(Base {
            image,
            layers,
            snapshot: Some(row.id.clone()),
            work_context: String::new(),
            observed_head: None,
            rung: Rung::Snapshot,
            captured_in_userns,
            fell: Vec::new(),
            network: serde_json::from_value::<crate::net::NetworkSpec>(row.info["network"].clone()).ok(),
        })
    }

    /// Start a sandbox whose files are exactly the snapshot's.
    pub fn resume(&self, id: &str, req: LaunchRequest) -> Result<SandboxInfo, ResumeError> {
        if req.count.is_some() {
            return Err(ResumeError::Count);
        }
        let launch = self.launch_spec(req)?;
        let row = self.snapshot_row(id)?;
        // A checkpoint continues its own lineage: refused before the
        // snapshot is pinned (a removal racing a refused resume is not
        // refused for it) and before any layer is fetched, if the lineage
        // has ended or another sandbox holds it.
        restorable(&row)?;
        let lineage = match row.class {
            SnapshotClass::Baseline => None,
            _ => Some(self.eligible_lineage(&row).and_then(|wc| self.lineage_free(&wc.id).map(|()| wc))?),
        };
        let _pin = self.pin_snapshot(&row.id)?;
        let mut base = self.snapshot_base(&row)?;
        let Some(wc) = lineage else {
            // New work from a baseline: a lineage of its own.
            let wc = self.new_lineage(None, base.image.id, StartKind::Baseline, Some(&row.id))?;
            (base.work_context, base.observed_head, base.rung) = (wc.clone(), None, Rung::Baseline);
            return Ok(self.launch(&base, launch).map(|sb| sandbox_info(&sb)).inspect_err(|_| {
                let _ = lock(&self.db).delete_unused_work_context(&wc);
            })?);
        };
        // Fenced on the lineage's head as it was read above.
        (base.work_context, base.observed_head) = (wc.id, wc.head_id);
        Ok(sandbox_info(&*self.launch(&base, launch)?))
    }

    /// Start `count` independent sandboxes on one snapshot. No file data is
    /// copied: they share its layers and each gets its own empty upper. All
    /// or nothing: if one cannot start, the others are removed.
    pub fn fork(&self, id: &str, req: LaunchRequest) -> Result<Vec<SandboxInfo>, ResumeError> {
        let count = req.count.unwrap_or(1);
        if !(1..=MAX_FORK).contains(&count) {
            return Err(ResumeError::BadCount { count, max: MAX_FORK });
        }
        if req.hostname.is_some() && count > 1 {
            return Err(ResumeError::HostnameForMany);
        }
        // Validate once, before anything is reserved or started.
        let launch = self.launch_spec(req)?;
        let row = self.snapshot_row(id)?;
        let _pin = self.pin_snapshot(&row.id)?;
        let base = self.snapshot_base(&row)?;
        {
            let pool = lock(&self.pool);
            // Slots removals still hold are not counted: they come free in
            // moments, and each launch below waits for its own.
            let free = self.max_sandboxes().saturating_sub(pool.live.len() + pool.reserved);
            if (count as usize) > free {
                return Err(ResumeError::NoRoom { count, free, max: self.max_sandboxes() });
            }
        }
        let (start_kind, rung) = match row.class {
            SnapshotClass::Baseline => (StartKind::Baseline, Rung::Baseline),
            SnapshotClass::Checkpoint => (StartKind::Fork, Rung::Fork),
        };
        if row.class != SnapshotClass::Baseline {
            self.eligible_lineage(&row)?;
        }
        // Each child is an explicit branch: a lineage of its own, whose
        // origin is the snapshot.
        let mut made: Vec<Arc<crate::sandbox::Sandbox>> = Vec::new();
        for _ in 0..count {
            let launched = self
                .new_lineage(None, base.image.id, start_kind, Some(&row.id))
                .map_err(ResumeError::from)
                .and_then(|wc| {
                    let child = Base {
                        work_context: wc.clone(),
                        observed_head: None,
                        rung,
                        image: base.image.clone(),
                        layers: base.layers.clone(),
                        snapshot: base.snapshot.clone(),
                        captured_in_userns: base.captured_in_userns,
                        fell: Vec::new(),
                        network: base.network.clone(),
                    };
                    self.launch(&child, launch.clone()).map_err(ResumeError::from).inspect_err(|_| {
                        let _ = lock(&self.db).delete_unused_work_context(&wc);
                    })
                });
            match launched {
                Ok(sb) => made.push(sb),
                Err(e) => {
                    for sb in made {
                        let _ = self.remove_sandbox(sb.id.as_str());
                    }
                    return Err(e);
                }
            }
        }
        Ok(made.iter().map(|s| sandbox_info(s)).collect())
    }

    fn layer_fs(&self, hexes: &[LayerId]) -> Vec<std::path::PathBuf> {
        hexes.iter().rev().map(|h| self.rt.store.layer_dir(h).join("fs")).collect()
    }

    /// Keep a finished command in the sandbox's exec log.
    pub fn record_exec(
        &self,
        sb: &crate::sandbox::Sandbox,
        req: &crate::sandbox::ExecRequest,
        s: &crate::sandbox::ExecSummary,
    ) {
        self.telemetry.exec(s.duration);
        let rec = crate::db::ExecRecord {
            id: 0,
            sandbox_id: sb.id.to_string(),
            argv: req.argv.clone(),
            cwd: req.cwd.clone().unwrap_or_else(|| sb.defaults.cwd.clone()),
            started_at: s.started_at.duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0),
            duration_ms: s.duration.as_secs_f64() * 1000.0,
            exit_code: s.status.shell_code(),
            output_bytes: s.output_bytes,
            output: Some(s.kept.clone()),
        };
        // A command that ends after its sandbox began to go (removed, or
        // rolled back: the discarded timeline) is not logged (`execlog.rs`).
        self.queue_exec_record(sb, rec);
    }

    /// The exec log of a live sandbox (the log of the snapshot it runs
    /// on, then its own commands since it started or rolled back), or the
    /// log sealed with a snapshot: each snapshot of its chain adds its
    /// source sandbox's records between its `log_from` and `log_upto`.
    /// With `output`, each record carries its output as kept.
    pub fn logs(&self, id: &str, output: bool) -> Result<Vec<crate::db::ExecRecord>, SnapshotLookupError> {
        if let Ok(sb) = self.sandbox(id) {
            self.settle_exec_log();
            let db = lock(&self.db);
            let mut out = match &sb.spec.snapshot {
                Some(s) => snapshot_log(&db, s, output)?,
                None => Vec::new(),
            };
            out.extend(db.exec_records(Some(sb.id.as_str()), sb.spec.log_from, None, output)?);
            return Ok(out);
        }
        let row = self.snapshot_row(id)?;
        Ok(snapshot_log(&lock(&self.db), &row.id, output)?)
    }

    /// Added, changed and deleted paths of a live sandbox's upper.
    pub fn sandbox_diff(&self, id: &str) -> Result<Vec<crate::diff::Change>, crate::daemon::SandboxOpError> {
        let sb = self.sandbox(id)?;
        let upper = sb.dirs(&self.rt.store).upper;
        let lowers = self.layer_fs(&sb.spec.layers);
        Ok(sb.while_frozen("diff", || {
            crate::diff::changes(&upper, &lowers).map_err(crate::sandbox::SandboxError::Capture)
        })?)
    }

    /// Added, changed and deleted paths of a snapshot's own delta.
    pub fn snapshot_diff(&self, id: &str) -> Result<Vec<crate::diff::Change>, SnapshotDiffError> {
        let row = self.snapshot_row(id)?;
        restorable(&row)?;
        let _pin = self.pin_snapshot(&row.id)?;
        let base = self.snapshot_base(&row)?;
        let below = &base.layers[..base.layers.len().saturating_sub(1)];
        let delta = self.rt.store.layer_dir(&row.layer).join("fs");
        Ok(crate::diff::changes(&delta, &self.layer_fs(below))?)
    }

    /// Stop every process of a sandbox, move its upper into the layer store
    /// as the snapshot's layer (no file data is read or copied), release the
    /// sandbox and return the snapshot. Hashing, syncing and compressing the
    /// layer happen in the background (`state` is `sealing` until then);
    /// resume and fork work at once.
    pub fn suspend(&self, id: &str) -> Result<SnapshotInfo, CaptureError> {
        let sb = self.sandbox(id)?;
        self.suspend_sandbox(&sb, None)
    }

    /// [`Daemon::suspend`] of `sb`, or with `idle` (its use count when its
    /// idle timeout was taken) the reaper's idle suspend, dropped
    /// (`UsedAgain`) if the sandbox was used since.
    pub(crate) fn suspend_sandbox(
        &self,
        sb: &crate::sandbox::Sandbox,
        idle: Option<u64>,
    ) -> Result<SnapshotInfo, CaptureError> {
        let started = Instant::now();
        // Refuse before stopping anything if the append would be refused (the
        // append checks again, atomically).
        self.check_fence(&sb.id)?;
        match idle {
            Some(uses) => sb.begin_idle_stop(uses)?,
            None if sb.begin_stop() => {}
            None => return Err(CaptureError::NotSuspendable(sb.id.clone())),
        }
        if let Err(e) = sb.stop() {
            sb.end_stop();
            return Err(e.into());
        }
        match self.leased(|lease| self.seal_upper(sb, started, lease)) {
            Ok(info) => {
                crate::failpoint::hit("suspend:appended");
                lock(&self.pool).live.remove(&sb.id);
                self.slots.notify_all();
                let _ = self.rt.store.discard_sandbox(&sb.id);
                self.queue_blob(&info.id);
                tracing::info!("suspended sandbox {} as snapshot {}", sb.id, info.id);
                Ok(info)
            }
            Err(e) => {
                // Its processes are gone, its upper is back in place: the
                // sandbox is listed as exited and can be removed.
                sb.end_stop();
                Err(e)
            }
        }
    }

    /// Move (or, past --compact-depth, fold) a stopped sandbox's upper into
    /// the layer store and record the snapshot. On error the upper is where
    /// it was.
    fn seal_upper(
        &self,
        sb: &crate::sandbox::Sandbox,
        started: Instant,
        lease: &Lease,
    ) -> Result<SnapshotInfo, CaptureError> {
        let store = &self.rt.store;
        let upper = sb.dirs(store).upper;
        let work = store.new_tmp("suspend").map_err(store_err)?;
        let result = (|| {
            let image_id =
                lock(&self.db).image_by_name(&sb.spec.image.parse()?)?.map(|i| i.id).ok_or(CaptureError::NoImageRow)?;
            // Before the upper moves (nothing may fail between the move and
            // the row but what gives the upper back); the sandbox is
            // stopped, so no exec comes later.
            let log_upto = self.last_exec_record(sb.id.as_str())?;
            let snap_id = SnapshotId::random();
            // After a checkpoint, an increment over it: what the upper holds
            // unchanged since is in that checkpoint's layer already.
            let since = self.last_capture(sb);
            let parent = since.as_ref().map(|(row, _)| row.id.clone()).or_else(|| sb.spec.snapshot.clone());
            // The processes are gone and the overlay with them: the upper is
            // still. A deep chain is folded (that reads the data); otherwise
            // the upper itself becomes the layer, named by the snapshot.
            let compacted =
                self.compact_if_deep(parent.as_deref(), sb.spec.snapshot.as_deref(), &upper, &work, false)?;
            let (layer, layer_src, moved) = match &compacted {
                Some(c) => {
                    (LayerRow::content(own_layer_id(&c.diff_id)?, c.stats.bytes, c.stats.entries), c.dir.clone(), false)
                }
                None => {
                    // Another sandbox may hold descriptors of this upper's
                    // files and directories (passed over a socket in a
                    // shared cache): moved, they would write into the sealed
                    // layer. A copy is new inodes no one holds; the upper
                    // goes with the sandbox's dir.
                    let copy = sb.spec.mounts.iter().any(crate::spec::MountDecl::passes_descriptors);
                    let moved = move_or_copy_upper(&upper, &work, copy, since.as_ref().map(|(_, s)| s))?;
                    let id = LayerId::suspended(&snap_id);
                    (LayerRow { id, diff_id: None, size: 0, entries: 0 }, work.clone(), moved)
                }
            };
            let give_back = || {
                if moved {
                    let _ = std::fs::rename(work.join("fs"), &upper);
                }
            };
            crate::failpoint::hit("suspend:moved");
            // Durable before the row names it: the sandbox's overlay was
            // volatile (`strata_shim::sys::OVERLAY_VOLATILE`), so nothing
            // synced the upper when it was unmounted.
            let new_layer = match store.commit_layer(&layer_src, &layer.id, true, lease) {
                Ok(n) => n,
                Err(e) => {
                    give_back();
                    return Err(store_err(e));
                }
            };
            crate::failpoint::hit("suspend:layer-committed");
            let mut info = serde_json::json!({
                "suspended": true,
                "compacted": compacted.is_some(),
                "total_ms": started.elapsed().as_secs_f64() * 1000.0,
                "log_from": since.as_ref().map_or(sb.spec.log_from, |(row, _)| row.info["log_upto"].as_i64().unwrap_or(0)),
                "log_upto": log_upto,
                "incremental": since.is_some(),
                // For the seal's worker (`seal_blob`): the sandbox's quota.
                "cpus": sb.spec.limits.cpus,
            });
            if let Some(c) = &compacted {
                merge_stats(&mut info, &c.stats);
            }
            mark_userns(&mut info, sb);
            mark_network(&mut info, sb);
            let mut row = SnapshotRow::new(image_id, parent, &layer, &sb.id, info);
            row.id = snap_id; // the id its layer is named by
            let mut db = lock(&self.db);
            let appended = db.append_checkpoint(&sb.id, &mut row, &layer, true, true);
            let inserted = match appended {
                Ok(Ok(())) => Ok(()),
                Ok(Err(fence)) => Err(CaptureError::Fenced { what: "suspend", fence }),
                Err(e) => Err(CaptureError::from(e)),
            };
            if let Err(e) = inserted {
                drop(db);
                if moved && new_layer {
                    // Give the sandbox its upper back rather than lose it
                    // (the layer is named by this snapshot: no one else's);
                    // the empty layer is the collector's. Should that fail,
                    // the upper stays in the layer, leased until the daemon
                    // stops, so the collector leaves it meanwhile.
                    if let Err(err) = std::fs::rename(store.layer_dir(&layer.id).join("fs"), &upper) {
                        tracing::error!("suspend of {}: giving its upper back: {err}", sb.id);
                        let kept = store.lease();
                        kept.layer(&layer.id);
                        std::mem::forget(kept);
                    }
                }
                return Err(e);
            }
            Ok(self.snapshot_info_locked(&db, &row)?)
        })();
        let _ = remove_tree(&work);
        result
    }

    /// Whether a snapshot on top of `parent` would make its layer chain
    /// longer than `--compact-depth`.
    fn needs_compaction(&self, parent: Option<&str>) -> Result<bool, CaptureError> {
        let depth = match parent {
            Some(p) => lock(&self.db).snapshot_layer_chain(p)?.len(),
            None => 0,
        };
        Ok(depth >= self.cfg.compact_depth)
    }

    /// If a snapshot on top of `parent` would make its layer chain longer
    /// than `--compact-depth`, fold `over`'s chain and `delta` (an
    /// overlay-form tree of the changes over `over`: the parent, or for a
    /// whole upper the sandbox's base) into one layer under
    /// `work/compact`. With `want_tar`, also write the layer's tar (for
    /// its blob).
    fn compact_if_deep(
        &self,
        parent: Option<&str>,
        over: Option<&str>,
        delta: &Path,
        work: &Path,
        want_tar: bool,
    ) -> Result<Option<Compacted>, CaptureError> {
        if !self.needs_compaction(parent)? {
            return Ok(None);
        }
        let chain = match over {
            Some(p) => lock(&self.db).snapshot_layer_chain(p)?,
            None => Vec::new(),
        };
        let mut layers: Vec<std::path::PathBuf> =
            chain.iter().map(|s| self.rt.store.layer_dir(&s.layer).join("fs")).collect();
        layers.push(delta.to_path_buf());
        let dir = work.join("compact");
        let fs_dir = dir.join("fs");
        std::fs::create_dir_all(&fs_dir).map_err(|source| CaptureError::Io { step: "create the layer", source })?;
        crate::diff::flatten(&layers, &fs_dir)?;
        let (stats, diff_id, tar) = if want_tar {
            let tar = work.join("compact.tar");
            let f =
                std::fs::File::create(&tar).map_err(|source| CaptureError::Io { step: "create the tar", source })?;
            let mut w = std::io::BufWriter::with_capacity(1 << 20, f);
            let (stats, hex) = crate::diff::write_delta(&fs_dir, &mut w)?;
            std::io::Write::flush(&mut w).map_err(|source| CaptureError::Io { step: "write the tar", source })?;
            (stats, hex, Some(tar))
        } else {
            let (stats, hex) = crate::diff::write_delta(&fs_dir, std::io::sink())?;
            (stats, hex, None)
        };
        tracing::info!("compacted a chain of {} snapshot layers into {diff_id}", layers.len());
        Ok(Some(Compacted { dir, diff_id, stats, tar }))
    }

    /// Seal a suspended snapshot: hash its layer (its diff_id), sync it,
    /// write its blob, record all three and mark it ready. Run by the
    /// daemon's blob thread (and at start for any left sealing).
    pub fn seal_blob(&self, id: &str) -> Result<(), CaptureError> {
        self.leased(|lease| self.seal_blob_leased(id, lease))
    }

    fn seal_blob_leased(&self, id: &str, lease: &Lease) -> Result<(), CaptureError> {
        let Ok(snap) = id.parse::<SnapshotId>() else { return Ok(()) };
        let Ok(_pin) = self.pin_snapshot(&snap) else { return Ok(()) };
        let Some(row) = lock(&self.db).snapshot(id)? else { return Ok(()) };
        if !lock(&self.db).blob_pending(id)? {
            return Ok(());
        }
        crate::failpoint::hit("seal:start");
        let started = Instant::now();
        let store = &self.rt.store;
        let dir = store.layer_dir(&row.layer);
        store.sync_layer(&dir).map_err(store_err)?;
        // One pass, in a worker charged to the sandbox it was (its capture
        // cgroup, with its CPU quota, made again if need be and removed
        // after): serialise the layer straight into the compressor.
        let sandbox_cg = format!("{}/{}", self.cfg.cgroup_parent, row.source_sandbox);
        let cg = {
            // Made and recorded at once, so that shutdown ends it.
            let mut sealing = lock(&self.sealing);
            if sealing.stopped {
                return Err(CaptureError::Stopping);
            }
            let cg = crate::sandbox::capture_cgroup(&sandbox_cg, row.info["cpus"].as_f64())?;
            sealing.cgroup = Some(sandbox_cg.clone());
            cg
        };
        let place: crate::worker::Place<'_> = &cg;
        let tmp = store.new_blob_path();
        let written = if crate::failpoint::fails("seal:write") {
            let message = "failpoint seal:write".to_string();
            Err(crate::worker::WorkerError::Failed(crate::worker::Failed { message, content: true, errno: None }))
        } else {
            crate::worker::seal(&dir.join("fs"), &tmp, place)
        };
        {
            let mut sealing = lock(&self.sealing);
            sealing.cgroup = None;
            if let Err(e) = crate::sandbox::remove_capture_cgroup(&sandbox_cg, std::time::Duration::from_secs(5)) {
                tracing::warn!("remove capture cgroup of {}: {}", row.source_sandbox, crate::error::chain(&e));
            }
        }
        let ((stats, hex, bhex, size), cpu) = match written {
            Ok(w) => w,
            Err(e) => {
                let _ = std::fs::remove_file(&tmp);
                if let crate::worker::WorkerError::Failed(f) = &e {
                    if f.content {
                        let mut info = row.info.clone();
                        info["seal_error"] = serde_json::json!(f.message);
                        lock(&self.db).set_seal_failed(id, &info)?;
                        return Err(CaptureError::SealFailed { id: id.to_string(), message: f.message.clone() });
                    }
                }
                return Err(worker_err(e));
            }
        };
        store.place_blob(&tmp, &bhex, lease).map_err(store_err)?;
        crate::failpoint::hit("seal:blob-written");
        if row.diff_id.as_ref().is_some_and(|d| d.hex() != hex) {
            let diff_id = row.diff_id.as_ref().map(ToString::to_string);
            return Err(CaptureError::DiffIdMismatch { id: id.to_string(), hex, diff_id });
        }
        let mut info = row.info.clone();
        merge_stats(&mut info, &stats);
        info["seal_ms"] = serde_json::json!(started.elapsed().as_secs_f64() * 1000.0);
        info["worker_cpu_ms"] = serde_json::json!(cpu.as_secs_f64() * 1000.0);
        let diff_id = Some(format!("sha256:{hex}").parse()?);
        let layer = LayerRow { id: row.layer.clone(), diff_id, size: stats.bytes, entries: stats.entries };
        lock(&self.db).set_snapshot_blob(id, &format!("sha256:{bhex}"), size, &layer, &info)?;
        // Content known: stored once if another layer holds it (this
        // seal's own pin aside).
        if let Err(e) = self.share_layer(&snap, 1) {
            tracing::warn!("snapshot {id}: sharing its layer: {}", crate::error::chain(&e));
        }
        Ok(())
    }

    /// Discard a sandbox's current changes and continue from a snapshot of
    /// its own lineage (its base chain, or a checkpoint it took). Processes
    /// are restarted fresh; the sandbox keeps its id, limits, env and
    /// hostname. Later checkpoints are children of that snapshot.
    pub fn rollback(&self, id: &str, to: &str) -> Result<SandboxInfo, RollbackError> {
        let sb = self.sandbox(id)?;
        let row = self.snapshot_row(to)?;
        let in_base = match &sb.spec.snapshot {
            Some(base) => lock(&self.db).snapshot_chain(base)?.iter().any(|s| s.id == row.id),
            None => false,
        };
        let (wc, observed) = lock(&self.db).sandbox_lineage(&sb.id)?;
        let own = wc.is_some() && row.work_context == wc;
        if !in_base && !own && row.source_sandbox != sb.id.as_str() {
            return Err(RollbackError::NotInLineage { snapshot: row.id, sandbox: sb.id.clone() });
        }
        let _pin = self.pin_snapshot(&row.id)?;
        let mut base = self.snapshot_base(&row)?;
        // Same lineage, same fence: a rollback does not move the head.
        base.work_context = match wc {
            Some(wc) => wc,
            None => {
                // A sandbox from before lineages: its own lineage, from now.
                let _ = self.new_lineage(Some(sb.id.as_str()), base.image.id, StartKind::Image, None);
                sb.id.to_string()
            }
        };
        base.observed_head = observed;
        base.rung = Rung::Rollback;
        if !sb.begin_stop() {
            return Err(RollbackError::Stopping { sandbox: sb.id.clone(), state: sb.run_state() });
        }
        // Keep the slot: reserve for the replacement before the old one goes.
        lock(&self.pool).reserved += 1;
        let result = (|| {
            if let Err(e) = sb.destroy(&self.rt.store) {
                sb.end_stop();
                return Err(RollbackError::from(e));
            }
            lock(&self.pool).live.remove(&sb.id);
            lock(&self.db).delete_sandbox(&sb.id)?;
            let launch = crate::daemon::LaunchSpec {
                id: None,
                wait: None,
                limits: sb.spec.limits,
                // The rolled-back sandbox keeps its deadline.
                lifetime: sb.lifetime(),
                env: sb.spec.env.clone(),
                // Its lineage's, from this host's file.
                secret_env: Vec::new(),
                hostname: Some(sb.spec.hostname.clone()),
                mounts: sb.spec.mounts.clone(),
                seccomp_unconfined: sb.spec.seccomp_unconfined,
                userns: Some(sb.spec.userns.is_some()),
                userns_map: sb.spec.userns,
                // Its network and policy (its address is given again).
                network: Some(sb.network_kept()),
            };
            Ok(self.launch_reserved(&base, launch, Some(sb.id.clone()))?)
        })();
        let new = self.end_reservation(result)?;
        tracing::info!("rolled sandbox {} back to snapshot {}", new.id, row.id);
        Ok(sandbox_info(&new))
    }

    /// Write the snapshot's whole chain as an OCI image layout at `path`.
    pub fn export_snapshot(
        &self,
        id: &str,
        path: &str,
        compression: BlobCompression,
    ) -> Result<crate::export::Exported, SnapshotExportError> {
        let row = self.snapshot_row(id)?;
        restorable(&row)?;
        let _pin = self.pin_snapshot(&row.id)?;
        let (image, chain) = {
            let db = lock(&self.db);
            let image = db.image_by_id(row.image_id)?.ok_or(SnapshotLookupError::NoImageRow)?;
            (image, db.snapshot_layer_chain(&row.id)?)
        };
        for s in &chain {
            self.hydrate_layer(&s.layer).map_err(|e| SnapshotLookupError::Hydrate(Box::new(e)))?;
        }
        Ok(crate::export::export(&self.rt.store, &image, &chain, Path::new(path), compression)?)
    }

    /// Remove a snapshot; refused while a sandbox, a launch in flight or a
    /// child snapshot uses it.
    pub fn remove_snapshot(&self, id: &str) -> Result<(), RemoveSnapshotError> {
        let row = self.snapshot_row(id)?;
        if row.state == SnapshotState::Capturing {
            return Err(RemoveSnapshotError::InFlight(row.id));
        }
        {
            // A sandbox being torn down still mounts the snapshot's layers:
            // wait for it (a removal stuck past that counts as a user).
            let started_from = |s: &crate::sandbox::Sandbox| s.spec.snapshot.as_deref() == Some(row.id.as_str());
            let mut pool = self.after_removals(started_from);
            let users: Vec<String> = pool.mounting().filter(|s| started_from(s)).map(|s| s.id.to_string()).collect();
            if !users.is_empty() {
                return Err(RemoveSnapshotError::UsedBy { id: row.id, users });
            }
            if pool.pinned.contains_key(row.id.as_str()) || !pool.doomed.insert(row.id.to_string()) {
                return Err(RemoveSnapshotError::InFlight(row.id));
            }
        }
        let r = self.remove_unused_snapshot(&row);
        lock(&self.pool).doomed.remove(row.id.as_str());
        r
    }

    fn remove_unused_snapshot(&self, row: &SnapshotRow) -> Result<(), RemoveSnapshotError> {
        if let Err(children) = lock(&self.db).begin_delete_snapshot(&row.id)? {
            return Err(RemoveSnapshotError::HasChildren { id: row.id.clone(), children });
        }
        self.finish_removal(&row.id)
    }

    /// The rest of a removal, once the snapshot is `deleting` (never
    /// restorable again): the layer and blob it alone holds are removed
    /// (under the database lock, as the collector removes: an operation
    /// that leases or lists them meanwhile keeps them), then its row. Run
    /// again at start-up for a removal a stopped daemon left half-way.
    pub(crate) fn finish_removal(&self, id: &str) -> Result<(), RemoveSnapshotError> {
        crate::failpoint::hit("snapshot-rm:deleting");
        let db = lock(&self.db);
        let (layer, blob) = db.held_only_by(id)?;
        let blob = blob.and_then(|d| d.parse::<oci::Digest>().ok()).map(|d| Resource::Blob(d.hex().to_string()));
        let doomed: std::collections::BTreeSet<Resource> =
            layer.map(Resource::Layer).into_iter().chain(blob.clone()).collect();
        self.rt.store.remove_unleased(db, &doomed).map_err(crate::daemon::CollectError::from)?;
        crate::failpoint::hit("snapshot-rm:files-removed");
        let (orphan, published) = lock(&self.db).finish_delete_snapshot(id)?;
        if published.is_some() {
            self.unpublish();
        }
        // What a lease kept is the collector's once nothing lists it.
        self.collect(Scope::Released, orphan.into_iter().map(Resource::Layer).chain(blob))?;
        Ok(())
    }
}
