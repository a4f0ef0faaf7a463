//! Pulls: a chain from a registry recorded as it came (a claim of
//! lineage, fenced like a local append), and its layers waiting to be
//! unpacked on this host (`layer_hydration`).

use rusqlite::params;

use super::sql::{Conn, Optional};
use super::{
    fence, insert_exec_record_in, insert_image_in, insert_layer, insert_snapshot_row, lineage_head_in, now, q, Db,
    DbError, ExecRecord, Fence, LayerRow, SnapshotRow,
};
use crate::ids::{ImageName, LayerId, SnapshotId};
use crate::model::{BlobCompression, SnapshotState, StartKind};
use crate::oci::{Digest, ImageConfig};
use crate::records::Evaluation;

/// The image a pull recreates: found by manifest digest and layers, or
/// inserted under `name` (or `name`'s repository with the manifest digest's
/// first 12 hex digits as tag, if `name` is taken by another image).
pub struct PulledImage {
    pub name: ImageName,
    pub manifest_digest: Digest,
    pub config_digest: Digest,
    pub config: ImageConfig,
    pub layers: Vec<(LayerRow, Digest)>,
}

/// A snapshot a pull recreates, with its layer and its lineage's start.
pub struct PulledSnapshot {
    pub row: SnapshotRow,
    pub layer: LayerRow,
    pub start_kind: StartKind,
    pub start_id: Option<SnapshotId>,
    /// Its exec log as pushed: the first `inherited` records are its
    /// ancestors' (below the pushed chain), the rest its own.
    pub log: Vec<ExecRecord>,
    pub inherited: usize,
    pub evaluations: Vec<Evaluation>,
}

/// A pulled layer whose tree is not unpacked yet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unhydrated {
    pub layer_id: LayerId,
    pub blob_digest: Digest,
    pub compression: BlobCompression,
    pub error: Option<String>,
}

/// Why a pull cannot be recorded on this host.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PullConflict {
    #[error("snapshot {id} exists on this host with other content (layer {here}, pulled {pulled})")]
    Differs { id: SnapshotId, here: String, pulled: String },
    #[error("lineage {work_context} has another checkpoint ({here}) at sequence {sequence} on this host: the lineages diverged")]
    Diverged { work_context: String, sequence: i64, here: String },
    #[error("image names {0:?} are taken by other images")]
    ImageName(Vec<String>),
    #[error("snapshot {0} is being removed on this host; pull again once it is gone")]
    BeingRemoved(SnapshotId),
}

pub(super) fn insert_pulled_row(tx: &Conn, snap: &SnapshotRow, host: Option<&str>) -> Result<(), DbError> {
    let info = serde_json::to_string(&snap.info).map_err(|source| DbError::Decode { what: "snapshot info", source })?;
    insert_snapshot_row(tx, snap, &info, host)
}

/// Why a pulled baseline is not ready yet.
pub const PULLED_UNCHECKED: &str = "pulled: not yet checked on this host";

impl Db {
    /// Record a pulled chain in one transaction: its image (found or
    /// inserted), layers, lineages and snapshots (root first, same ids).
    /// Snapshots the host has are checked, not rewritten. A pulled
    /// checkpoint's lineage metadata is a claim: it becomes its lineage's
    /// head only through the fence a local append meets (the head here is
    /// the predecessor it names, and it is further along), or as the first
    /// row of a lineage the pull brought; otherwise it lands outside the
    /// lineage (`info.outside_lineage` says why). A baseline is ready unless
    /// its key already has a ready one. The first snapshot's parent is kept only if the host
    /// has it (a compacted layer needs nothing below it).
    pub fn record_pull(
        &mut self,
        image: &PulledImage,
        snaps: &mut [PulledSnapshot],
        unhydrated: &[Unhydrated],
    ) -> Result<Result<i64, PullConflict>, DbError> {
        let tx = self.conn.transaction(true).map_err(q("begin pull"))?;
        let want: Vec<&str> = image.layers.iter().map(|(l, _)| l.id.as_str()).collect();
        let candidates: Vec<i64> = {
            tx.query("SELECT id FROM images WHERE manifest_digest = ?1", params![&image.manifest_digest], |r| r.get(0))
                .map_err(q("find image"))?
        };
        let mut image_id = None;
        for id in candidates {
            let layers: Vec<String> = tx
                .query("SELECT layer_id FROM image_layers WHERE image_id = ?1 ORDER BY position", params![id], |r| {
                    r.get(0)
                })
                .map_err(q("image layers"))?;
            if layers == want {
                image_id = Some(id);
                break;
            }
        }
        let image_id = match image_id {
            Some(id) => id,
            None => {
                let hex12: String = image.manifest_digest.hex().chars().take(12).collect();
                let base = image.name.as_str().rsplit_once(':').map_or(image.name.as_str(), |(n, _)| n);
                let names: Vec<String> = vec![image.name.to_string(), format!("{base}:{hex12}")];
                let free = names.iter().find(|n| {
                    tx.query_row("SELECT 1 FROM images WHERE name = ?1", params![n], |_| Ok(())).optional().ok()
                        == Some(None)
                });
                let Some(free) = free else {
                    return Ok(Err(PullConflict::ImageName(names)));
                };
                let name: ImageName = free.parse().map_err(|_| DbError::Invalid(format!("image name {free:?}")))?;
                let config = serde_json::to_string(&image.config)
                    .map_err(|source| DbError::Decode { what: "image config", source })?;
                insert_image_in(&tx, &name, &image.manifest_digest, &image.config_digest, &config, &image.layers)?
            }
        };
        let mut inserted = Vec::new();
        // Lineages this pull made on this host.
        let mut fresh: Vec<String> = Vec::new();
        for p in snaps.iter_mut() {
            let pulled = p.layer.id.to_string();
            let here: Option<(Option<String>, SnapshotState)> = tx
                .query_row(
                    "SELECT l.diff_id, s.state FROM snapshots s JOIN layers l ON l.id = s.layer_id WHERE s.id = ?1",
                    params![&p.row.id],
                    |r| Ok((r.get(0)?, r.get(1)?)),
                )
                .optional()
                .map_err(q("pulled snapshot"))?;
            if let Some((_, SnapshotState::Deleting)) = here {
                return Ok(Err(PullConflict::BeingRemoved(p.row.id.clone())));
            }
            if let Some((here, _)) = here {
                if here.as_deref() != Some(pulled.as_str()) {
                    let here = here.unwrap_or_else(|| "sealing".into());
                    return Ok(Err(PullConflict::Differs { id: p.row.id.clone(), here, pulled }));
                }
                continue;
            }
            if let Some(parent) = p.row.parent_id.clone() {
                let known: Option<SnapshotState> = tx
                    .query_row("SELECT state FROM snapshots WHERE id = ?1", params![&parent], |r| r.get(0))
                    .optional()
                    .map_err(q("pulled parent"))?;
                match known {
                    None => p.row.parent_id = None,
                    Some(SnapshotState::Deleting) => return Ok(Err(PullConflict::BeingRemoved(parent))),
                    Some(_) => {}
                }
            }
            insert_layer(&tx, &p.layer)?;
            inserted.push(p.row.id.clone());
            // Its log: its own records, and its ancestors' too when this
            // host lacks them (its parent was not kept). Inserted in one
            // transaction, their ids are one range: its segment.
            let keep = if p.row.parent_id.is_none() { 0 } else { p.inherited.min(p.log.len()) };
            let mut range = (0, 0);
            for (i, r) in p.log[keep..].iter().enumerate() {
                let id = insert_exec_record_in(&tx, r, true)?;
                range = (if i == 0 { id - 1 } else { range.0 }, id);
            }
            (p.row.info.log_from, p.row.info.log_upto, p.row.info.log_pulled) = (Some(range.0), Some(range.1), true);
            p.row.image_id = image_id;
            p.row.layer = p.layer.id.clone();
            p.row.diff_id = p.layer.diff_id.clone();
            match (&p.row.work_context, p.row.sequence, &p.row.baseline) {
                (Some(wc), Some(seq), _) => {
                    let made = tx
                        .execute(
                            "INSERT INTO work_contexts (id, image_id, start_kind, start_id, state, created_at, \
                             used_at) VALUES (?1, ?2, ?3, ?4, 'active', ?5, ?5) ON CONFLICT DO NOTHING",
                            params![wc, image_id, p.start_kind, p.start_id, now()],
                        )
                        .map_err(q("pulled lineage"))?;
                    if made > 0 {
                        fresh.push(wc.clone());
                    }
                    let other: Option<String> = tx
                        .query_row(
                            "SELECT id FROM snapshots WHERE work_context = ?1 AND sequence = ?2",
                            params![wc, seq],
                            |r| r.get(0),
                        )
                        .optional()
                        .map_err(q("pulled sequence"))?;
                    if let Some(here) = other {
                        return Ok(Err(PullConflict::Diverged { work_context: wc.clone(), sequence: seq, here }));
                    }
                    let (head, head_seq, state) = lineage_head_in(&tx, wc)?;
                    // What its metadata says its lineage's head was when it
                    // was appended there: a claim, checked against this
                    // host's head.
                    let claimed = p.row.predecessor_id.clone();
                    // The fenced append a local checkpoint takes: the head
                    // here must be its predecessor. A lineage this pull
                    // brought to the host has nothing here to protect: its
                    // first row becomes its head whatever it claims.
                    let outside = if seq <= head_seq {
                        Some(format!("its sequence {seq} is not past the head's here ({head_seq})"))
                    } else if head.is_none() && fresh.contains(wc) {
                        None
                    } else {
                        let show = |h: &Option<SnapshotId>| h.as_ref().map_or("none".to_string(), |h| h.to_string());
                        fence(wc, &claimed, &head, state).map(|f| match f {
                            Fence::Ended { state, .. } => format!("work context {wc} is {state} here"),
                            Fence::Moved { .. } => format!(
                                "it follows {} in work context {wc}, but the head here is {}",
                                show(&claimed),
                                show(&head)
                            ),
                        })
                    };
                    if let Some(why) = outside {
                        p.row.info.outside_lineage = Some(why);
                        p.row.state = SnapshotState::Superseded;
                        insert_pulled_row(&tx, &p.row, self.host.as_deref())?;
                    } else {
                        if let Some(h) = &head {
                            tx.execute(
                                "UPDATE snapshots SET state = 'superseded', retired_at = ?2 WHERE id = ?1",
                                params![h, now()],
                            )
                            .map_err(q("supersede head"))?;
                        }
                        p.row.state = SnapshotState::Ready;
                        insert_pulled_row(&tx, &p.row, self.host.as_deref())?;
                        tx.execute(
                            "UPDATE work_contexts SET head_id = ?2, head_seq = ?3, used_at = ?4 WHERE id = ?1",
                            params![wc, p.row.id, seq, now()],
                        )
                        .map_err(q("advance head"))?;
                    }
                }
                (_, _, Some(_)) => {
                    // Not eligible for new work until this host checked it
                    // (`Daemon::admit_pulled_baseline`).
                    p.row.state = SnapshotState::Superseded;
                    p.row.info.ineligible = Some(PULLED_UNCHECKED.to_string());
                    insert_pulled_row(&tx, &p.row, self.host.as_deref())?;
                }
                _ => return Err(DbError::Invalid(format!("pulled snapshot {} has neither lineage nor key", p.row.id))),
            }
        }
        for p in snaps.iter() {
            // Only with the snapshot rows this pull inserted.
            if inserted.contains(&p.row.id) {
                for e in &p.evaluations {
                    super::results::insert_evaluation_in(
                        &tx,
                        &Evaluation { snapshot: p.row.id.to_string(), ..e.clone() },
                    )?;
                }
            }
        }
        for u in unhydrated {
            let used = tx
                .query_row("SELECT 1 FROM layers WHERE id = ?1", params![&u.layer_id], |_| Ok(()))
                .optional()
                .map_err(q("unhydrated layer"))?;
            if used.is_some() {
                tx.execute(
                    "INSERT INTO layer_hydration (host, layer_id, blob_digest, compression) VALUES (?4, ?1, ?2, ?3) \
                     ON CONFLICT DO NOTHING",
                    params![u.layer_id, u.blob_digest, u.compression, self.host.as_deref().unwrap_or("")],
                )
                .map_err(q("mark layer unhydrated"))?;
            }
        }
        tx.commit().map_err(q("commit pull"))?;
        Ok(Ok(image_id))
    }

    /// A layer still to be hydrated: its blob digest, compression and the
    /// last unpack error.
    pub fn unhydrated(&self, layer_id: &str) -> Result<Option<Unhydrated>, DbError> {
        self.conn
            .query_row(
                "SELECT layer_id, blob_digest, compression, error FROM layer_hydration WHERE layer_id = ?1 AND host = ?2",
                params![layer_id, self.hydration_host()],
                |r| {
                    Ok(Unhydrated {
                        layer_id: r.get(0)?,
                        blob_digest: r.get(1)?,
                        compression: r.get(2)?,
                        error: r.get(3)?,
                    })
                },
            )
            .optional()
            .map_err(q("unhydrated layer"))
    }

    /// Every layer still to be hydrated (with `errors`, also those whose
    /// unpack failed).
    pub fn unhydrated_layers_with(&self, errors: bool) -> Result<Vec<LayerId>, DbError> {
        let sql = if errors {
            "SELECT layer_id FROM layer_hydration WHERE host = ?1"
        } else {
            "SELECT layer_id FROM layer_hydration WHERE host = ?1 AND error IS NULL"
        };
        self.conn.query(sql, params![self.hydration_host()], |r| r.get(0)).map_err(q("unhydrated layers"))
    }

    /// A layer's tree is in place: record its size and entries. False if
    /// the layer is gone (its snapshot was removed meanwhile).
    pub fn hydrated(&mut self, layer_id: &str, size: u64, entries: u64) -> Result<bool, DbError> {
        let host = self.hydration_host().to_string();
        let tx = self.conn.transaction(false).map_err(q("begin hydrated"))?;
        let n = tx
            .execute(
                "UPDATE layers SET size = ?2, entries = ?3 WHERE id = ?1",
                params![layer_id, size as i64, entries as i64],
            )
            .map_err(q("hydrated layer"))?;
        tx.execute("DELETE FROM layer_hydration WHERE layer_id = ?1 AND host = ?2", params![layer_id, host])
            .map_err(q("hydrated layer"))?;
        tx.commit().map_err(q("commit hydrated"))?;
        Ok(n == 1)
    }

    pub fn hydration_failed(&self, layer_id: &str, error: &str) -> Result<(), DbError> {
        self.conn
            .execute(
                "UPDATE layer_hydration SET error = ?2 WHERE layer_id = ?1 AND host = ?3",
                params![layer_id, error, self.hydration_host()],
            )
            .map_err(q("hydration failed"))?;
        Ok(())
    }
}
