//! Snapshots (`snapshots`): a capture's row from its start, the fenced
//! append of a checkpoint to its lineage, seals, chains, removal, and what
//! gc may collect.

use rusqlite::params;

use super::sql::{Conn, Optional, Row, SqlError};
use super::{
    adopt_lineage_in, delete_layer_if_unused, digest_column, fence, insert_layer, lineage_head_in, now, q,
    sandbox_lineage_in, Baseline, Db, DbError, Fence, LayerRow,
};
use crate::ids::{LayerId, SandboxId, SnapshotId};
use crate::model::{BlobCompression, SnapshotClass, SnapshotState};
use crate::oci::Digest;

/// A sealed snapshot: one delta layer on top of its parent (or its image).
#[derive(Debug, Clone, PartialEq)]
pub struct SnapshotRow {
    pub id: SnapshotId,
    pub image_id: i64,
    /// The snapshot below it in its layer chain (the base it ran on).
    pub parent_id: Option<SnapshotId>,
    /// A checkpoint (of a work context) or a baseline (of a key).
    pub class: SnapshotClass,
    /// Set by the database's lineage rules.
    pub state: SnapshotState,
    /// A checkpoint's lineage, its place in it and the head it replaced.
    pub work_context: Option<String>,
    pub sequence: Option<i64>,
    pub predecessor_id: Option<SnapshotId>,
    /// A baseline's key, commit and validation evidence.
    pub baseline: Option<Baseline>,
    /// The id of its own delta layer (its directory under `layers/`).
    pub layer: LayerId,
    /// That layer's diff_id; `None` while a suspend's layer is sealing.
    pub diff_id: Option<Digest>,
    /// The compressed blob's digest (its file in `blobs/sha256/`); `None`
    /// while a suspend's blob is being sealed (stored as an empty text).
    pub blob_digest: Option<Digest>,
    pub blob_size: u64,
    pub compression: BlobCompression,
    pub source_sandbox: String,
    /// Capture statistics and timings (JSON).
    pub info: crate::records::SnapshotMeta,
    pub created_at: i64,
}

impl SnapshotRow {
    /// A new snapshot of `layer`, taken from sandbox `source` (which ran on
    /// `parent`). Its class, state and lineage or baseline fields are set
    /// when it is recorded (`append_checkpoint`, `publish_baseline`); its
    /// blob fields once the blob is written.
    pub fn new(
        image_id: i64,
        parent_id: Option<SnapshotId>,
        layer: &LayerRow,
        source: &SandboxId,
        info: crate::records::SnapshotMeta,
    ) -> SnapshotRow {
        SnapshotRow {
            id: SnapshotId::random(),
            image_id,
            parent_id,
            class: SnapshotClass::Checkpoint,
            state: SnapshotState::Ready,
            work_context: None,
            sequence: None,
            predecessor_id: None,
            baseline: None,
            layer: layer.id.clone(),
            diff_id: layer.diff_id.clone(),
            blob_digest: None,
            blob_size: 0,
            compression: BlobCompression::Zstd,
            source_sandbox: source.to_string(),
            info,
            created_at: now(),
        }
    }
}

/// Insert a snapshot row as it is (its class, state, lineage and baseline
/// fields set by the caller; the schema's CHECKs keep them consistent).
pub(super) fn insert_snapshot_row(
    tx: &Conn,
    snap: &SnapshotRow,
    info: &str,
    host: Option<&str>,
) -> Result<(), DbError> {
    let b = snap.baseline.as_ref();
    let evidence = b
        .map(|b| serde_json::to_string(&b.evidence))
        .transpose()
        .map_err(|source| DbError::Decode { what: "baseline evidence", source })?;
    tx.execute(
        "INSERT INTO snapshots (id, image_id, parent_id, layer_id, blob_digest, blob_size, compression, class, state, \
         work_context, sequence, predecessor_id, owner, repo, ref, commit_id, evidence, source_sandbox, info, \
         created_at, host) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, ?17, ?18, ?19, \
         ?20, ?21)",
        params![
            snap.id,
            snap.image_id,
            snap.parent_id,
            snap.layer,
            snap.blob_digest.as_ref().map_or("", Digest::as_str),
            snap.blob_size as i64,
            snap.compression,
            snap.class,
            snap.state,
            snap.work_context,
            snap.sequence,
            snap.predecessor_id,
            b.map(|b| &b.owner),
            b.map(|b| &b.repo),
            b.map(|b| &b.git_ref),
            b.map(|b| &b.commit),
            evidence,
            snap.source_sandbox,
            info,
            snap.created_at,
            host
        ],
    )
    .map_err(q("insert snapshot"))?;
    Ok(())
}

impl Db {
    /// Append a checkpoint of sandbox `sandbox` to its lineage, fenced: in
    /// one transaction, check that the lineage's head is still the one the
    /// sandbox observed, record the layer (if new) and the snapshot as the
    /// new ready head (the old head is superseded), and move the sandbox's
    /// observed head to it (or, with `release`, delete the sandbox's row: a
    /// suspend). With `blob_pending`, the blob is still to be written.
    /// `snap`'s lineage fields are filled in here.
    pub fn append_checkpoint(
        &mut self,
        sandbox: &SandboxId,
        snap: &mut SnapshotRow,
        layer: &LayerRow,
        blob_pending: bool,
        release: bool,
    ) -> Result<Result<(), Fence>, DbError> {
        let info =
            serde_json::to_string(&snap.info).map_err(|source| DbError::Decode { what: "snapshot info", source })?;
        let tx = self.conn.transaction(true).map_err(q("begin append"))?;
        let (wc, observed) = sandbox_lineage_in(&tx, sandbox)?;
        let wc = adopt_lineage_in(&tx, sandbox, wc, snap.image_id)?;
        let (head, seq, state) = lineage_head_in(&tx, &wc)?;
        if let Some(fence) = fence(&wc, &observed, &head, state) {
            return Ok(Err(fence));
        }
        insert_layer(&tx, layer)?;
        if let Some(h) = &head {
            tx.execute("UPDATE snapshots SET state = 'superseded', retired_at = ?2 WHERE id = ?1", params![h, now()])
                .map_err(q("supersede head"))?;
        }
        snap.class = SnapshotClass::Checkpoint;
        snap.state = SnapshotState::Ready;
        snap.work_context = Some(wc.clone());
        snap.sequence = Some(seq + 1);
        snap.predecessor_id = head;
        // A capture's row exists since it began (`begin_capture`): it gets
        // its layer, blob, info and place in the lineage now, and its
        // placeholder layer row goes.
        let capturing: Option<String> = tx
            .query_row("SELECT layer_id FROM snapshots WHERE id = ?1 AND state = 'capturing'", params![&snap.id], |r| {
                r.get(0)
            })
            .optional()
            .map_err(q("capturing row"))?;
        match capturing {
            Some(placeholder) => {
                tx.execute(
                    "UPDATE snapshots SET layer_id = ?2, blob_digest = ?3, blob_size = ?4, compression = ?5, \
                     state = 'ready', sequence = ?6, predecessor_id = ?7, info = ?8 WHERE id = ?1",
                    params![
                        snap.id,
                        snap.layer,
                        snap.blob_digest.as_ref().map_or("", Digest::as_str),
                        snap.blob_size as i64,
                        snap.compression,
                        snap.sequence,
                        snap.predecessor_id,
                        info
                    ],
                )
                .map_err(q("complete capture"))?;
                delete_layer_if_unused(&tx, &placeholder)?;
            }
            None => insert_snapshot_row(&tx, snap, &info, self.host.as_deref())?,
        }
        tx.execute(
            "UPDATE work_contexts SET head_id = ?2, head_seq = ?3, used_at = ?4 WHERE id = ?1",
            params![wc, snap.id, seq + 1, now()],
        )
        .map_err(q("advance head"))?;
        if blob_pending {
            tx.execute("INSERT INTO snapshot_blob_pending (snapshot_id) VALUES (?1)", params![&snap.id])
                .map_err(q("mark blob pending"))?;
        }
        if release {
            tx.execute("DELETE FROM e2b_processes WHERE sandbox = ?1", params![sandbox.as_str()])
                .map_err(q("delete its e2b processes"))?;
            tx.execute("DELETE FROM sandboxes WHERE id = ?1", params![sandbox.as_str()])
                .map_err(q("delete sandbox"))?;
        } else {
            tx.execute(
                "UPDATE sandboxes SET spec = json_set(spec, '$.work_context', ?2, '$.observed_head', ?3) WHERE id = ?1",
                params![sandbox.as_str(), wc, snap.id],
            )
            .map_err(q("move observed head"))?;
        }
        tx.commit().map_err(q("commit append"))?;
        Ok(Ok(()))
    }

    /// Begin a checkpoint's capture, fenced as its append will be: `snap`
    /// is recorded `capturing` in the sandbox's lineage (visible, never
    /// restorable, no sequence yet) with a placeholder layer row named by
    /// its id (`s<id>`, no directory); `append_checkpoint` completes it,
    /// `capture_failed` ends it.
    pub fn begin_capture(
        &mut self,
        sandbox: &SandboxId,
        image_id: i64,
        parent: Option<SnapshotId>,
    ) -> Result<Result<SnapshotId, Fence>, DbError> {
        let id = SnapshotId::random();
        let placeholder = LayerRow { id: LayerId::suspended(&id), diff_id: None, size: 0, entries: 0 };
        let mut snap = SnapshotRow::new(image_id, parent, &placeholder, sandbox, Default::default());
        snap.id = id;
        let info = "{}";
        let tx = self.conn.transaction(true).map_err(q("begin capture"))?;
        let (wc, observed) = sandbox_lineage_in(&tx, sandbox)?;
        let wc = adopt_lineage_in(&tx, sandbox, wc, snap.image_id)?;
        let (head, _, state) = lineage_head_in(&tx, &wc)?;
        if let Some(fence) = fence(&wc, &observed, &head, state) {
            return Ok(Err(fence));
        }
        insert_layer(&tx, &placeholder)?;
        snap.state = SnapshotState::Capturing;
        snap.work_context = Some(wc);
        insert_snapshot_row(&tx, &snap, info, self.host.as_deref())?;
        tx.commit().map_err(q("commit begin capture"))?;
        Ok(Ok(snap.id))
    }

    /// A capture that will not complete: `failed`, with why in its info
    /// (`capture_error`). It never had a place in its lineage and holds
    /// nothing: it keeps no parent (so it never keeps its parent from
    /// being removed) and goes with its image; gc takes it after
    /// retention. No-op unless it is still capturing.
    pub fn capture_failed(&self, id: &str, why: &str) -> Result<(), DbError> {
        self.conn
            .execute(
                "UPDATE snapshots SET state = 'failed', retired_at = ?3, parent_id = NULL, \
                 info = json_set(info, '$.capture_error', ?2) WHERE id = ?1 AND state = 'capturing'",
                params![id, why, now()],
            )
            .map_err(q("capture failed"))?;
        Ok(())
    }

    /// At start-up: captures a stopped daemon left half-way are failed.
    pub fn fail_interrupted_captures(&self) -> Result<usize, DbError> {
        self.conn
            .execute(
                "UPDATE snapshots SET state = 'failed', retired_at = ?1, parent_id = NULL, \
                 info = json_set(info, '$.capture_error', 'the daemon stopped during the capture') \
                 WHERE state = 'capturing' AND (CAST(?2 AS TEXT) IS NULL OR host = ?2)",
                params![now(), self.host],
            )
            .map_err(q("fail interrupted captures"))
    }

    pub(super) const SNAP_SELECT: &'static str =
        "SELECT s.id, s.image_id, s.parent_id, s.layer_id, l.diff_id, s.blob_digest, \
         s.blob_size, s.compression, s.source_sandbox, s.info, s.created_at, s.class, s.state, s.work_context, \
         s.sequence, s.predecessor_id, s.owner, s.repo, s.ref, s.commit_id, s.evidence \
         FROM snapshots s JOIN layers l ON l.id = s.layer_id";
    pub(super) fn snapshot_from(r: &Row<'_>) -> Result<(SnapshotRow, String), SqlError> {
        Ok((
            SnapshotRow {
                id: r.get(0)?,
                image_id: r.get(1)?,
                parent_id: r.get(2)?,
                layer: r.get(3)?,
                diff_id: digest_column(r, 4, true)?,
                blob_digest: digest_column(r, 5, false)?,
                blob_size: r.get::<_, i64>(6)? as u64,
                compression: r.get(7)?,
                source_sandbox: r.get(8)?,
                info: Default::default(),
                created_at: r.get(10)?,
                class: r.get(11)?,
                state: r.get(12)?,
                work_context: r.get(13)?,
                sequence: r.get(14)?,
                predecessor_id: r.get(15)?,
                baseline: match (r.get::<_, Option<String>>(16)?, r.get::<_, Option<String>>(20)?) {
                    (Some(owner), Some(evidence)) => Some(Baseline {
                        owner,
                        repo: r.get(17)?,
                        git_ref: r.get(18)?,
                        commit: r.get(19)?,
                        evidence: serde_json::from_str(&evidence).unwrap_or(serde_json::Value::Null),
                    }),
                    _ => None,
                },
            },
            r.get(9)?,
        ))
    }

    pub(super) fn decode_snapshot((mut row, info): (SnapshotRow, String)) -> Result<SnapshotRow, DbError> {
        row.info = crate::records::SnapshotMeta::decode(&info)
            .map_err(|source| DbError::Decode { what: "snapshot info", source })?;
        Ok(row)
    }

    pub fn snapshot(&self, id: &str) -> Result<Option<SnapshotRow>, DbError> {
        let sql = format!("{} WHERE s.id = ?1", Self::SNAP_SELECT);
        let row = self.conn.query_row(&sql, params![id], Self::snapshot_from).optional().map_err(q("get snapshot"))?;
        row.map(Self::decode_snapshot).transpose()
    }

    pub fn list_snapshots(&self) -> Result<Vec<SnapshotRow>, DbError> {
        let sql = format!("{} ORDER BY s.created_at, s.id", Self::SNAP_SELECT);
        let rows: Vec<_> = self.conn.query(&sql, &[], Self::snapshot_from).map_err(q("list snapshots"))?;
        rows.into_iter().map(Self::decode_snapshot).collect()
    }

    /// The blob of a sealing snapshot is written and its layer known: record
    /// both (the layer's diff_id, size and entries; the snapshot's digest,
    /// size and info).
    pub fn set_snapshot_blob(
        &mut self,
        id: &str,
        digest: &str,
        size: u64,
        layer: &LayerRow,
        info: &crate::records::SnapshotMeta,
    ) -> Result<(), DbError> {
        let info = serde_json::to_string(info).map_err(|source| DbError::Decode { what: "snapshot info", source })?;
        let tx = self.conn.transaction(false).map_err(q("begin set blob"))?;
        tx.execute(
            "UPDATE layers SET diff_id = ?2, size = ?3, entries = ?4 WHERE id = ?1",
            params![layer.id, layer.diff_id.as_ref().map(Digest::hex), layer.size as i64, layer.entries as i64],
        )
        .map_err(q("set layer diff_id"))?;
        tx.execute(
            "UPDATE snapshots SET blob_digest = ?2, blob_size = ?3, info = ?4 WHERE id = ?1",
            params![id, digest, size as i64, info],
        )
        .map_err(q("set snapshot blob"))?;
        tx.execute("DELETE FROM snapshot_blob_pending WHERE snapshot_id = ?1", params![id])
            .map_err(q("clear pending"))?;
        tx.commit().map_err(q("commit set blob"))
    }

    /// Sealed suspends whose layer (`s<id>`) another layer holds already
    /// (the same diff_id, fully hydrated): what [`Db::share_layer`] folds.
    pub fn duplicate_suspended_layers(&self) -> Result<Vec<String>, DbError> {
        self.conn
            .query(
                "SELECT s.id FROM snapshots s JOIN layers l ON l.id = s.layer_id \
                 WHERE substr(l.id, 1, 1) = 's' AND l.diff_id IS NOT NULL AND EXISTS ( \
                   SELECT 1 FROM layers o WHERE o.diff_id = l.diff_id AND o.id != l.id \
                   AND o.id NOT IN (SELECT layer_id FROM layer_hydration WHERE host = ?1)) \
                 AND (CAST(?2 AS TEXT) IS NULL OR s.host = ?2) \
                 ORDER BY s.created_at, s.id",
                params![self.hydration_host(), self.host],
                |r| r.get(0),
            )
            .map_err(q("duplicate layers"))
    }

    /// If snapshot `id`'s layer is a sealed suspend's (`s<id>`) and another
    /// layer has the same content (diff_id; one named by it preferred, and
    /// hydrated), the snapshot lists that one instead and the suspend's
    /// row goes. Returns the layer no longer listed (its directory is the
    /// collector's). The caller makes sure nothing mounts or reads it;
    /// `present` says whether a layer's directory is there (a removal
    /// deletes it before its row).
    pub fn share_layer(&mut self, id: &str, present: impl Fn(&str) -> bool) -> Result<Option<String>, DbError> {
        let host = self.hydration_host().to_string();
        let tx = self.conn.transaction(true).map_err(q("begin share"))?;
        let own: Option<(String, String)> = tx
            .query_row(
                "SELECT l.id, l.diff_id FROM snapshots s JOIN layers l ON l.id = s.layer_id \
                 WHERE s.id = ?1 AND substr(l.id, 1, 1) = 's' AND l.diff_id IS NOT NULL",
                params![id],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .optional()
            .map_err(q("snapshot layer"))?;
        let Some((own, diff_id)) = own else { return Ok(None) };
        let candidates: Vec<String> = {
            tx.query(
                "SELECT id FROM layers WHERE diff_id = ?1 AND id != ?2 \
                     AND id NOT IN (SELECT layer_id FROM layer_hydration WHERE host = ?3) \
                     ORDER BY id = diff_id DESC, created_at, id",
                params![&diff_id, &own, &host],
                |r| r.get(0),
            )
            .map_err(q("layers by content"))?
        };
        let other = candidates.into_iter().find(|c| present(c));
        let Some(other) = other else { return Ok(None) };
        tx.execute("UPDATE snapshots SET layer_id = ?2 WHERE layer_id = ?1", params![&own, &other])
            .map_err(q("share layer"))?;
        let gone = delete_layer_if_unused(&tx, &own)?;
        tx.commit().map_err(q("commit share"))?;
        Ok(gone.then_some(own))
    }

    /// A suspended snapshot whose layer cannot be serialised (what the
    /// sandbox left there, e.g. a tree too deep): its blob will never come.
    /// Records why in `info` and takes it off the pending list, so a push
    /// fails at once with the reason instead of waiting.
    /// A snapshot whose blob can never be written (its tree cannot be
    /// sealed: too deep, a device node, a reserved name): `failed`, with
    /// the reason in its info. If it is its lineage's head, the head goes
    /// back to the snapshot it replaced (ready again) or to none (the
    /// lineage's start): a resume of the work context never lands on it,
    /// and a sandbox that observed it is fenced out of the lineage. It can
    /// still be resumed or forked by id.
    pub fn set_seal_failed(&mut self, id: &str, info: &crate::records::SnapshotMeta) -> Result<(), DbError> {
        let info = serde_json::to_string(info).map_err(|source| DbError::Decode { what: "snapshot info", source })?;
        let tx = self.conn.transaction(true).map_err(q("begin seal failed"))?;
        let (wc, predecessor): (Option<String>, Option<String>) = tx
            .query_row("SELECT work_context, predecessor_id FROM snapshots WHERE id = ?1", params![id], |r| {
                Ok((r.get(0)?, r.get(1)?))
            })
            .map_err(q("snapshot of a failed seal"))?;
        tx.execute(
            "UPDATE snapshots SET info = ?2, state = 'failed', retired_at = ?3 WHERE id = ?1",
            params![id, info, now()],
        )
        .map_err(q("set seal error"))?;
        tx.execute("DELETE FROM snapshot_blob_pending WHERE snapshot_id = ?1", params![id])
            .map_err(q("clear pending"))?;
        if let Some(wc) = wc {
            let head: Option<String> = tx
                .query_row("SELECT head_id FROM work_contexts WHERE id = ?1", params![&wc], |r| r.get(0))
                .optional()
                .map_err(q("lineage head"))?
                .flatten();
            if head.as_deref() == Some(id) {
                let back = match &predecessor {
                    Some(p) => {
                        let n = tx
                            .execute(
                                "UPDATE snapshots SET state = 'ready', retired_at = NULL \
                                 WHERE id = ?1 AND state = 'superseded'",
                                params![p],
                            )
                            .map_err(q("restore the previous head"))?;
                        (n == 1).then(|| p.clone())
                    }
                    None => None,
                };
                tx.execute("UPDATE work_contexts SET head_id = ?2 WHERE id = ?1", params![wc, back])
                    .map_err(q("move the head back"))?;
            }
        }
        tx.commit().map_err(q("commit seal failed"))
    }

    /// Snapshots whose blob is not written yet.
    pub fn pending_blobs(&self) -> Result<Vec<String>, DbError> {
        self.conn.query("SELECT snapshot_id FROM snapshot_blob_pending", &[], |r| r.get(0)).map_err(q("pending blobs"))
    }

    pub fn blob_pending(&self, id: &str) -> Result<bool, DbError> {
        self.conn
            .query_row("SELECT 1 FROM snapshot_blob_pending WHERE snapshot_id = ?1", params![id], |_| Ok(()))
            .optional()
            .map(|o| o.is_some())
            .map_err(q("blob pending"))
    }

    /// The layers a resume of `id` mounts above the image, root first: its
    /// chain up to (and including) the nearest compacted snapshot, whose one
    /// layer already holds everything below it.
    pub fn snapshot_layer_chain(&self, id: &str) -> Result<Vec<SnapshotRow>, DbError> {
        let mut chain = Vec::new();
        let mut cur = Some(id.to_string());
        while let Some(c) = cur {
            let Some(row) = self.snapshot(&c)? else { break };
            let compacted = row.info.compacted;
            cur = if compacted { None } else { row.parent_id.as_deref().map(str::to_string) };
            chain.push(row);
        }
        chain.reverse();
        Ok(chain)
    }

    /// The snapshot's chain, root first.
    pub fn snapshot_chain(&self, id: &str) -> Result<Vec<SnapshotRow>, DbError> {
        let mut chain = Vec::new();
        let mut cur = Some(id.to_string());
        while let Some(c) = cur {
            let Some(row) = self.snapshot(&c)? else { break };
            cur = row.parent_id.as_deref().map(str::to_string);
            chain.push(row);
        }
        chain.reverse();
        Ok(chain)
    }

    /// Begin removing a snapshot: refused (`Ok(Err(users))`, naming its
    /// child snapshots or the active lineage it heads) while anything
    /// uses it; else it is `deleting` (never restorable again) until
    /// [`Db::finish_delete_snapshot`] removes its row. Sandboxes are
    /// checked by the caller, which knows the live ones.
    pub fn begin_delete_snapshot(&mut self, id: &str) -> Result<Result<(), Vec<String>>, DbError> {
        let tx = self.conn.transaction(true).map_err(q("begin delete snapshot"))?;
        let children: Vec<String> = {
            tx.query("SELECT id FROM snapshots WHERE parent_id = ?1", params![id], |r| r.get(0))
                .map_err(q("snapshot children"))?
        };
        if !children.is_empty() {
            return Ok(Err(children));
        }
        let heads: Vec<String> = {
            let rows: Vec<(String, String)> = tx
                .query("SELECT id, state FROM work_contexts WHERE head_id = ?1", params![id], |r| {
                    Ok((r.get(0)?, r.get(1)?))
                })
                .map_err(q("snapshot lineage"))?;
            rows.into_iter()
                .filter(|(_, st)| st == "active")
                .map(|(wc, _)| format!("head of work context {wc}"))
                .collect()
        };
        if !heads.is_empty() {
            return Ok(Err(heads));
        }
        // Sandboxes started from it, on any host sharing the catalog (this
        // host's own are refused before, from its live list).
        let rows: Vec<(String, Option<String>)> = tx
            .query(
                "SELECT id, host FROM sandboxes WHERE json_extract(spec, '$.snapshot') = ?1 ORDER BY id",
                params![id],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .map_err(q("snapshot users"))?;
        let users: Vec<String> = rows
            .into_iter()
            .map(|(sb, host): (String, Option<String>)| match host {
                Some(h) => format!("sandbox {sb} on host {h}"),
                None => format!("sandbox {sb}"),
            })
            .collect();
        if !users.is_empty() {
            return Ok(Err(users));
        }
        // A retired lineage's head may go; the lineage keeps no pointer to it.
        tx.execute("UPDATE work_contexts SET head_id = NULL WHERE head_id = ?1", params![id])
            .map_err(q("clear head"))?;
        tx.execute("UPDATE snapshots SET state = 'deleting', deleted_at = ?2 WHERE id = ?1", params![id, now()])
            .map_err(q("mark deleting"))?;
        tx.commit().map_err(q("commit begin delete"))?;
        Ok(Ok(()))
    }

    /// What only this snapshot holds: its layer (if no image and no other
    /// snapshot lists it) and its blob (likewise).
    pub fn held_only_by(&self, id: &str) -> Result<(Option<String>, Option<String>), DbError> {
        self.conn
            .query_row(
                "SELECT CASE WHEN EXISTS (SELECT 1 FROM image_layers WHERE layer_id = s.layer_id) \
                   OR EXISTS (SELECT 1 FROM snapshots o WHERE o.layer_id = s.layer_id AND o.id != s.id) \
                   THEN NULL ELSE s.layer_id END, \
                 CASE WHEN s.blob_digest = '' \
                   OR EXISTS (SELECT 1 FROM image_layers WHERE blob_digest = s.blob_digest) \
                   OR EXISTS (SELECT 1 FROM snapshots o WHERE o.blob_digest = s.blob_digest AND o.id != s.id) \
                   THEN NULL ELSE s.blob_digest END \
                 FROM snapshots s WHERE s.id = ?1",
                params![id],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .map_err(q("snapshot's own files"))
    }

    /// Remove a `deleting` snapshot's row, and its layer's row if nothing
    /// else lists it (returned first: its directory is the caller's to
    /// remove). A published snapshot's manifest is queued for deletion
    /// from the fleet registry in the same transaction (its reference
    /// returned second: `catalog/manifests.rs`).
    pub fn finish_delete_snapshot(&mut self, id: &str) -> Result<(Option<String>, Option<String>), DbError> {
        let tx = self.conn.transaction(true).map_err(q("begin finish delete"))?;
        let row: Option<(String, Option<String>)> = tx
            .query_row(
                "SELECT layer_id, published FROM snapshots WHERE id = ?1 AND state = 'deleting'",
                params![id],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .optional()
            .map_err(q("get snapshot"))?;
        let Some((layer, published)) = row else { return Ok((None, None)) };
        tx.execute("DELETE FROM snapshots WHERE id = ?1", params![id]).map_err(q("delete snapshot"))?;
        let orphan = delete_layer_if_unused(&tx, &layer)?.then_some(layer);
        if let Some(reference) = &published {
            super::manifests::queue(&tx, reference, id)?;
        }
        tx.commit().map_err(q("commit delete snapshot"))?;
        Ok((orphan, published))
    }

    /// Snapshots whose removal was interrupted (still `deleting`).
    pub fn deleting_snapshots(&self) -> Result<Vec<String>, DbError> {
        self.conn
            .query("SELECT id FROM snapshots WHERE state = 'deleting'", &[], |r| r.get(0))
            .map_err(q("deleting snapshots"))
    }

    /// Images still referenced by snapshots (image rm is refused for them).
    pub fn snapshots_of_image(&self, image_id: i64) -> Result<Vec<String>, DbError> {
        self.conn
            .query("SELECT id FROM snapshots WHERE image_id = ?1", params![image_id], |r| r.get(0))
            .map_err(q("image snapshots"))
    }

    /// Snapshots out of restore position (superseded, retired, failed) since
    /// before `cutoff` (unix seconds), newest first (children before
    /// parents).
    pub fn gc_candidates(&self, cutoff: i64) -> Result<Vec<String>, DbError> {
        self.conn
            .query(
                "SELECT id FROM snapshots WHERE state IN ('superseded', 'retired', 'failed') \
                 AND COALESCE(retired_at, created_at) <= ?1 AND retained = 0 \
                 AND id NOT IN (SELECT start_id FROM work_contexts WHERE state = 'active' AND start_id IS NOT NULL) \
                 ORDER BY created_at DESC, id",
                params![cutoff],
                |r| r.get(0),
            )
            .map_err(q("gc candidates"))
    }
}
