//! The bottom layer of checkpoint and suspend: capture a sandbox's upper,
//! seal it as a layer and blob, append it to the lineage through the fence,
//! compact a chain grown deep.
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

use super::lookup::{restorable, SnapshotLookupError};
use crate::catalog::{LayerRow, SnapshotRow};
use crate::daemon::{lock, Daemon};
use crate::error::{Classify, ErrorKind};
use crate::ids::{LayerId, SandboxId, SnapshotId};
use crate::oci;
use crate::sandbox::Until;
use crate::store::{BlobCompression, Lease, StoreError};
use crate::types::SnapshotInfo;

/// A checkpoint being captured: of which sandbox, under which id, over
/// which earlier checkpoint (and what its capture saw) if incremental,
/// working in `work`, since when.
#[derive(Clone, Copy)]
pub(crate) struct Capturing<'a> {
    pub(crate) sb: &'a crate::sandbox::Sandbox,
    pub(crate) id: &'a SnapshotId,
    pub(crate) since: Option<&'a (SnapshotRow, crate::store::stamps::Stamps)>,
    pub(crate) work: &'a Path,
    pub(crate) started: Instant,
}

/// A chain folded into one layer by `compact_if_deep`.
pub(crate) struct Compacted {
    /// `<dir>/fs` is the layer's tree.
    pub(crate) dir: std::path::PathBuf,
    pub(crate) diff_id: String,
    pub(crate) stats: crate::store::diff::DeltaStats,
    pub(crate) tar: Option<std::path::PathBuf>,
}

/// A checkpoint's layer, in place under `layers/`.
pub(crate) struct Sealed {
    pub(crate) diff_id: String,
    /// The layer's tar (for its blob).
    pub(crate) tar: std::path::PathBuf,
    pub(crate) stats: crate::store::diff::DeltaStats,
    pub(crate) frozen: std::time::Duration,
    pub(crate) size: u64,
    pub(crate) entries: u64,
    pub(crate) compacted: bool,
}

/// Put a delta's statistics into a snapshot's info.
pub(crate) fn merge_stats(info: &mut crate::records::SnapshotMeta, stats: &crate::store::diff::DeltaStats) {
    for (k, v) in [
        ("entries", stats.entries),
        ("bytes", stats.bytes),
        ("whiteouts", stats.whiteouts),
        ("opaque_dirs", stats.opaque_dirs),
        ("hardlinks", stats.hardlinks),
        ("tar_bytes", stats.tar_bytes),
    ] {
        info.show(k, v);
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
pub(crate) fn move_or_copy_upper(
    upper: &Path,
    work: &Path,
    copy: bool,
    since: Option<&crate::store::stamps::Stamps>,
) -> Result<bool, CaptureError> {
    let fs_dir = work.join("fs");
    let io = |step| move |source| CaptureError::Io { step, source };
    if !copy {
        match std::fs::rename(upper, &fs_dir) {
            Ok(()) => {
                let Some(since) = since else { return Ok(true) };
                // Refused before it removed anything: the upper goes back.
                return match crate::store::stamps::prune(&fs_dir, since) {
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
            crate::store::diff::write_delta_since(upper, &mut w, since).map_err(std::io::Error::other)?;
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
pub(crate) fn broken_pipe(e: &std::io::Error) -> bool {
    let inner = e.get_ref().and_then(|d| d.downcast_ref::<crate::store::diff::DiffError>());
    match inner {
        Some(crate::store::diff::DiffError::Write { source, .. }) => source.kind() == std::io::ErrorKind::BrokenPipe,
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
    /// checkpoint {0} names no exec log segment: an increment on it cannot continue its log
    NoLogSegment(SnapshotId),
    /// {what} refused: {fence}
    Fenced { what: &'static str, fence: crate::catalog::Fence },
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
    Diff(#[from] crate::store::diff::DiffError),
    /// {0}
    Cgroup(#[from] crate::sandbox::cgroups::CgroupError),
    /// {0}
    Db(#[from] crate::catalog::DbError),
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
            C::NoLogSegment(_) => ErrorKind::Internal,
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
pub(crate) fn unpack_capture(
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
pub(crate) fn removed_meanwhile(sb: &crate::sandbox::Sandbox) -> CaptureError {
    CaptureError::RemovedMeanwhile(sb.id.clone())
}

pub(crate) fn mark_userns(info: &mut crate::records::SnapshotMeta, sb: &crate::sandbox::Sandbox) {
    info.userns = sb.spec.userns.is_some();
}

/// A checkpoint or suspend keeps its sandbox's network (mode and policy: a
/// sandbox started from it gets an address of its own). A baseline does
/// not: it is a repository's state, and new work from it starts with the
/// network its create asks for, not the publisher's.
pub(crate) fn mark_network(info: &mut crate::records::SnapshotMeta, sb: &crate::sandbox::Sandbox) {
    if sb.spec.network.mode != crate::net::NetworkMode::None {
        info.network = Some(sb.network_kept());
    }
}

/// Where the log segment of an increment on `since` (the sandbox's last
/// checkpoint) starts: where that one's ended. A checkpoint that names no
/// segment cannot be continued (its row is not one this daemon wrote).
pub(crate) fn log_from(sb: &crate::sandbox::Sandbox, since: Option<&SnapshotRow>) -> Result<i64, CaptureError> {
    match since {
        None => Ok(sb.spec.log_from),
        Some(row) => row.info.log_upto.ok_or_else(|| CaptureError::NoLogSegment(row.id.clone())),
    }
}

/// The layer id of a tar this daemon hashed (a worker's report of it is
/// checked like any other input).
pub(crate) fn own_layer_id(diff_id_hex: &str) -> Result<LayerId, CaptureError> {
    Ok(LayerId::content(diff_id_hex)?)
}

pub(crate) fn store_err(e: StoreError) -> CaptureError {
    CaptureError::Store(e)
}

impl Daemon {
    /// The sandbox's last checkpoint and what its capture saw of the
    /// upper, if a checkpoint now can be an increment over it: the stamps
    /// describe this upper on this base, and name a checkpoint of this
    /// sandbox that is still restorable. Else (none yet, a rollback, the
    /// checkpoint removed, the record unreadable) the capture is whole.
    pub(crate) fn last_capture(
        &self,
        sb: &crate::sandbox::Sandbox,
    ) -> Option<(SnapshotRow, crate::store::stamps::Stamps)> {
        use std::os::unix::fs::MetadataExt;
        let dirs = sb.dirs(&self.rt.store);
        let (origin, stamps) = match crate::store::stamps::Stamps::load(&dirs.dir.join("stamps")) {
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
    fn keep_stamps(&self, sb: &crate::sandbox::Sandbox, snapshot: &SnapshotId, stamps: &crate::store::stamps::Stamps) {
        use std::os::unix::fs::MetadataExt;
        let dirs = sb.dirs(&self.rt.store);
        let kept = std::fs::symlink_metadata(&dirs.upper).and_then(|upper| {
            let origin = crate::store::stamps::Origin {
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
    pub(crate) fn capture_in(
        &self,
        cap: &Capturing<'_>,
        compression: BlobCompression,
        record: &dyn Fn(&mut crate::catalog::Db, &mut SnapshotRow, &LayerRow) -> Result<(), CaptureError>,
        lease: &Lease,
    ) -> Result<SnapshotInfo, CaptureError> {
        let Capturing { sb, id, since, work, started } = *cap;
        let parent = since.map(|(row, _)| row.id.clone()).or_else(|| sb.spec.snapshot.clone());
        // Checked before the sandbox is frozen or anything is written.
        let from = log_from(sb, since.map(|(row, _)| row))?;
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
        // An increment's log starts where its parent's ended.
        let mut info = crate::records::SnapshotMeta {
            log_from: Some(from),
            log_upto: Some(log_upto),
            compacted: sealed.compacted,
            ..Default::default()
        };
        info.show("frozen_ms", sealed.frozen.as_secs_f64() * 1000.0);
        info.show("blob_ms", blob_at.as_secs_f64() * 1000.0);
        info.show("total_ms", started.elapsed().as_secs_f64() * 1000.0);
        info.show("precopy_ms", spec.as_ref().map_or(0.0, |(p, _)| p.took.as_secs_f64() * 1000.0));
        info.show("precopied_bytes", spec.as_ref().map_or(0, |(p, _)| p.bytes));
        info.show("blob_ahead", spec.as_ref().is_some_and(|(_, missed)| missed.is_none()));
        info.show("ahead_missed", spec.as_ref().and_then(|(_, missed)| missed.clone()));
        info.show("reused_bytes", reused);
        info.show("incremental", since.is_some());
        info.show("worker_cpu_ms", worker_cpu.load(std::sync::atomic::Ordering::Relaxed) as f64 / 1000.0);
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
        row.info.show("total_ms", started.elapsed().as_secs_f64() * 1000.0);
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
}
