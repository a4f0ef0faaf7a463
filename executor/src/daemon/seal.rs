//! Sealing: a suspended sandbox's moved upper made a layer (hashed, synced,
//! shared with a stored layer of the same content), its blob written in
//! the background, and a chain grown deep compacted into one layer.

use std::path::Path;
use std::time::Instant;

use super::capture::{
    log_from, mark_network, mark_userns, merge_stats, move_or_copy_upper, own_layer_id, store_err, worker_err,
    CaptureError, Compacted,
};
use crate::catalog::{LayerRow, SnapshotRow};
use crate::daemon::{lock, Daemon};
use crate::ids::{LayerId, SnapshotId};
use crate::store::{remove_tree, Lease};
use crate::types::SnapshotInfo;

impl Daemon {
    /// Move (or, past --compact-depth, fold) a stopped sandbox's upper into
    /// the layer store and record the snapshot. On error the upper is where
    /// it was.
    pub(crate) fn seal_upper(
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
            // Checked before anything moves: refused, the upper stays put.
            let from = log_from(sb, since.as_ref().map(|(row, _)| row))?;
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
            let mut info = crate::records::SnapshotMeta {
                log_from: Some(from),
                log_upto: Some(log_upto),
                compacted: compacted.is_some(),
                // For the seal's worker (`seal_blob`): the sandbox's quota.
                cpus: sb.limits().cpus,
                ..Default::default()
            };
            info.show("suspended", true);
            info.show("total_ms", started.elapsed().as_secs_f64() * 1000.0);
            info.show("incremental", since.is_some());
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
    pub(crate) fn needs_compaction(&self, parent: Option<&str>) -> Result<bool, CaptureError> {
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
    pub(crate) fn compact_if_deep(
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
        crate::store::layers::flatten(&layers, &fs_dir)?;
        let (stats, diff_id, tar) = if want_tar {
            let tar = work.join("compact.tar");
            let f =
                std::fs::File::create(&tar).map_err(|source| CaptureError::Io { step: "create the tar", source })?;
            let mut w = std::io::BufWriter::with_capacity(1 << 20, f);
            let (stats, hex) = crate::store::diff::write_delta(&fs_dir, &mut w)?;
            std::io::Write::flush(&mut w).map_err(|source| CaptureError::Io { step: "write the tar", source })?;
            (stats, hex, Some(tar))
        } else {
            let (stats, hex) = crate::store::diff::write_delta(&fs_dir, std::io::sink())?;
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
            let cg = crate::sandbox::capture_cgroup(&sandbox_cg, row.info.cpus)?;
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
                        info.seal_error = Some(f.message.clone());
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
        info.show("seal_ms", started.elapsed().as_secs_f64() * 1000.0);
        info.show("worker_cpu_ms", cpu.as_secs_f64() * 1000.0);
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
}
