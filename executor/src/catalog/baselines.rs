//! Baselines: the one ready baseline per key (owner, repo, image, ref),
//! published by compare-and-swap, and a pulled one's admission once
//! checked.

use rusqlite::params;

use super::sql::{Conn, Optional};
use super::{insert_layer, insert_snapshot_row, now, q, Db, DbError, LayerRow, SnapshotRow};
use crate::model::{SnapshotClass, SnapshotState};
pub use crate::records::Baseline;

pub(super) fn ready_baseline_in(
    conn: &Conn,
    owner: &str,
    repo: &str,
    image_id: i64,
    git_ref: &str,
) -> Result<Option<String>, DbError> {
    conn.query_row(
        "SELECT id FROM snapshots WHERE class = 'baseline' AND state = 'ready' \
         AND owner = ?1 AND repo = ?2 AND image_id = ?3 AND ref = ?4",
        params![owner, repo, image_id, git_ref],
        |r| r.get(0),
    )
    .optional()
    .map_err(q("ready baseline"))
}

impl Db {
    /// The ready baseline for a key, if any.
    pub fn ready_baseline(
        &self,
        owner: &str,
        repo: &str,
        image_id: i64,
        git_ref: &str,
    ) -> Result<Option<String>, DbError> {
        ready_baseline_in(&self.conn, owner, repo, image_id, git_ref)
    }

    /// Publish a baseline as the ready one for its key: a compare-and-swap
    /// on the ready baseline the publisher observed when it began. If
    /// another publisher replaced it meanwhile, `Ok(Err(current))` and
    /// nothing is written; else the old one is superseded and `snap` (with
    /// its layer) recorded, in one transaction.
    pub fn publish_baseline(
        &mut self,
        snap: &mut SnapshotRow,
        layer: &LayerRow,
        observed: Option<&str>,
    ) -> Result<Result<(), Option<String>>, DbError> {
        let b = snap.baseline.clone().expect("publish_baseline needs a baseline row");
        let info =
            serde_json::to_string(&snap.info).map_err(|source| DbError::Decode { what: "snapshot info", source })?;
        let tx = self.conn.transaction(true).map_err(q("begin publish"))?;
        let current = ready_baseline_in(&tx, &b.owner, &b.repo, snap.image_id, &b.git_ref)?;
        if current.as_deref() != observed {
            return Ok(Err(current));
        }
        insert_layer(&tx, layer)?;
        if let Some(c) = &current {
            tx.execute("UPDATE snapshots SET state = 'superseded', retired_at = ?2 WHERE id = ?1", params![c, now()])
                .map_err(q("supersede baseline"))?;
        }
        snap.class = SnapshotClass::Baseline;
        snap.state = SnapshotState::Ready;
        insert_snapshot_row(&tx, snap, &info, self.host.as_deref())?;
        tx.commit().map_err(q("commit publish"))?;
        Ok(Ok(()))
    }

    /// Make a pulled baseline (checked by the caller) the ready one of its
    /// key, by a compare-and-swap on the ready baseline the caller observed
    /// (as [`Db::publish_baseline`]); its info loses the `ineligible` mark.
    pub fn admit_baseline(&mut self, id: &str, observed: Option<&str>) -> Result<Result<(), Option<String>>, DbError> {
        let tx = self.conn.transaction(true).map_err(q("begin admit"))?;
        let (owner, repo, image_id, git_ref): (String, String, i64, String) = tx
            .query_row(
                "SELECT owner, repo, image_id, ref FROM snapshots WHERE id = ?1 AND class = 'baseline'",
                params![id],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)),
            )
            .map_err(q("baseline to admit"))?;
        let current = ready_baseline_in(&tx, &owner, &repo, image_id, &git_ref)?;
        if current.as_deref() != observed {
            return Ok(Err(current));
        }
        if let Some(c) = &current {
            tx.execute("UPDATE snapshots SET state = 'superseded', retired_at = ?2 WHERE id = ?1", params![c, now()])
                .map_err(q("supersede baseline"))?;
        }
        tx.execute(
            "UPDATE snapshots SET state = 'ready', retired_at = NULL, info = json_remove(info, '$.ineligible') \
             WHERE id = ?1",
            params![id],
        )
        .map_err(q("admit baseline"))?;
        tx.commit().map_err(q("commit admit"))?;
        Ok(Ok(()))
    }

    /// Say why a snapshot is not eligible for new work (its info's
    /// `ineligible`).
    pub fn mark_ineligible(&mut self, id: &str, why: &str) -> Result<(), DbError> {
        self.conn
            .execute("UPDATE snapshots SET info = json_set(info, '$.ineligible', ?2) WHERE id = ?1", params![id, why])
            .map_err(q("mark ineligible"))?;
        Ok(())
    }
}
