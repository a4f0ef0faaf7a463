//! The catalog's side of sealed results: evaluations recorded with a
//! snapshot, its labels and whether it is retained (migration 11).
//! Evaluations and labels go with their snapshot (ON DELETE CASCADE).

use std::collections::BTreeMap;

use rusqlite::params;

use super::sql::{Conn, Optional, Row, SqlError};
use super::{now, q, Db, DbError};
use crate::model::KeptOutput;
pub use crate::records::Evaluation;

/// A label key or value as stored (the schema's CHECKs bound them too).
pub const MAX_LABEL_KEY: usize = 128;
pub const MAX_LABEL_VALUE: usize = 1024;

const EVAL_COLUMNS: &str = "id, snapshot_id, name, version, argv, exit_code, timed_out, duration_ms, stdout, stderr, \
                            output_cut, result, result_error, created_at";

fn evaluation_from(r: &Row<'_>) -> Result<(Evaluation, String, Option<String>), SqlError> {
    Ok((
        Evaluation {
            id: r.get(0)?,
            snapshot: r.get(1)?,
            name: r.get(2)?,
            version: r.get(3)?,
            argv: Vec::new(),
            exit_code: r.get(5)?,
            timed_out: r.get(6)?,
            duration_ms: r.get(7)?,
            output: KeptOutput { stdout: r.get(8)?, stderr: r.get(9)?, cut: r.get::<_, i64>(10)? as u64 },
            result: None,
            result_error: r.get(12)?,
            created_at: r.get(13)?,
            recorded: true,
        },
        r.get(4)?,
        r.get(11)?,
    ))
}

fn decode((mut e, argv, result): (Evaluation, String, Option<String>)) -> Result<Evaluation, DbError> {
    e.argv = serde_json::from_str(&argv).map_err(|source| DbError::Decode { what: "evaluation argv", source })?;
    e.result = match result {
        Some(r) => {
            Some(serde_json::from_str(&r).map_err(|source| DbError::Decode { what: "evaluation result", source })?)
        }
        None => None,
    };
    Ok(e)
}

/// Insert an evaluation (its id is the database's); returns the id.
pub(super) fn insert_evaluation_in(conn: &Conn, e: &Evaluation) -> Result<i64, DbError> {
    let argv = serde_json::to_string(&e.argv).map_err(|source| DbError::Decode { what: "argv", source })?;
    let result = e.result.as_ref().map(serde_json::Value::to_string);
    conn.query_row(
        "INSERT INTO evaluations (snapshot_id, name, version, argv, exit_code, timed_out, duration_ms, \
                 stdout, stderr, output_cut, result, result_error, created_at) \
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13) RETURNING id",
        params![
            e.snapshot,
            e.name,
            e.version,
            argv,
            e.exit_code,
            e.timed_out,
            e.duration_ms,
            e.output.stdout,
            e.output.stderr,
            e.output.cut as i64,
            result,
            e.result_error,
            if e.created_at == 0 { now() } else { e.created_at },
        ],
        |r| r.get(0),
    )
    .map_err(q("insert evaluation"))
}

impl Db {
    /// Record an evaluation of its snapshot; returns its id.
    pub fn insert_evaluation(&self, e: &Evaluation) -> Result<i64, DbError> {
        insert_evaluation_in(&self.conn, e)
    }

    /// A snapshot's evaluations, oldest first.
    pub fn evaluations(&self, snapshot: &str) -> Result<Vec<Evaluation>, DbError> {
        let rows: Vec<_> = self
            .conn
            .query(
                &format!("SELECT {EVAL_COLUMNS} FROM evaluations WHERE snapshot_id = ?1 ORDER BY id"),
                params![snapshot],
                evaluation_from,
            )
            .map_err(q("evaluations"))?;
        rows.into_iter().map(decode).collect()
    }

    /// The newest evaluation of a snapshot by this name and version.
    pub fn evaluation(&self, snapshot: &str, name: &str, version: &str) -> Result<Option<Evaluation>, DbError> {
        let row = self
            .conn
            .query_row(
                &format!(
                    "SELECT {EVAL_COLUMNS} FROM evaluations WHERE snapshot_id = ?1 AND name = ?2 AND version = ?3 \
                     ORDER BY id DESC LIMIT 1"
                ),
                params![snapshot, name, version],
                evaluation_from,
            )
            .optional()
            .map_err(q("evaluation"))?;
        row.map(decode).transpose()
    }

    /// Set (`Some`) or remove (`None`) labels of a snapshot, all in one
    /// transaction. Setting a label to its value is a no-op.
    pub fn set_labels(&mut self, snapshot: &str, labels: &BTreeMap<String, Option<String>>) -> Result<(), DbError> {
        let tx = self.conn.transaction(false).map_err(q("begin labels"))?;
        for (k, v) in labels {
            match v {
                Some(v) => tx.execute(
                    "INSERT INTO snapshot_labels (snapshot_id, key, value) VALUES (?1, ?2, ?3) \
                     ON CONFLICT (snapshot_id, key) DO UPDATE SET value = excluded.value",
                    params![snapshot, k, v],
                ),
                None => {
                    tx.execute("DELETE FROM snapshot_labels WHERE snapshot_id = ?1 AND key = ?2", params![snapshot, k])
                }
            }
            .map_err(q("set label"))?;
        }
        tx.commit().map_err(q("commit labels"))
    }

    /// A snapshot's labels.
    pub fn labels(&self, snapshot: &str) -> Result<BTreeMap<String, String>, DbError> {
        self.conn
            .query("SELECT key, value FROM snapshot_labels WHERE snapshot_id = ?1", params![snapshot], |r| {
                Ok((r.get(0)?, r.get(1)?))
            })
            .map_err(q("labels"))
    }

    /// Whether gc keeps the snapshot whatever its age.
    pub fn retained(&self, snapshot: &str) -> Result<bool, DbError> {
        self.conn
            .query_row("SELECT retained FROM snapshots WHERE id = ?1", params![snapshot], |r| r.get(0))
            .map_err(q("snapshot retained"))
    }

    /// Retain the snapshot (or release it); idempotent.
    pub fn set_retained(&self, snapshot: &str, retained: bool) -> Result<(), DbError> {
        self.conn
            .execute("UPDATE snapshots SET retained = ?2 WHERE id = ?1", params![snapshot, retained])
            .map_err(q("set retained"))?;
        Ok(())
    }

    /// Forget a lineage that only a throwaway sandbox used (an
    /// evaluation's): its restore records go with it. Kept if anything
    /// was captured into it.
    pub fn delete_throwaway_lineage(&self, id: &str) -> Result<(), DbError> {
        self.conn
            .execute(
                "DELETE FROM work_contexts WHERE id = ?1 AND head_id IS NULL \
                 AND NOT EXISTS (SELECT 1 FROM snapshots WHERE work_context = ?1)",
                params![id],
            )
            .map_err(q("delete throwaway lineage"))?;
        Ok(())
    }

    /// Every (snapshot, parent) link.
    pub fn snapshot_parents(&self) -> Result<Vec<(String, String)>, DbError> {
        self.conn
            .query("SELECT id, parent_id FROM snapshots WHERE parent_id IS NOT NULL", &[], |r| {
                Ok((r.get(0)?, r.get(1)?))
            })
            .map_err(q("snapshot parents"))
    }

    /// A layer's unpacked size (0 for a layer still sealing or unknown).
    pub fn layer_size(&self, id: &str) -> Result<u64, DbError> {
        self.conn
            .query_row("SELECT size FROM layers WHERE id = ?1", params![id], |r| r.get::<_, i64>(0))
            .optional()
            .map(|s| s.unwrap_or(0) as u64)
            .map_err(q("layer size"))
    }

    /// What the store holds, by owner: images (count, their layers'
    /// unpacked bytes, their blob digests) and snapshots (count, the
    /// unpacked bytes of layers no image lists, their blobs' bytes).
    /// Layers and blobs are counted once however many rows list them.
    pub fn usage(&self) -> Result<StoreUsage, DbError> {
        let one = |sql: &str| -> Result<i64, DbError> {
            self.conn.query_row(sql, &[], |r| r.get::<_, Option<i64>>(0)).map(|v| v.unwrap_or(0)).map_err(q("usage"))
        };
        let image_blobs: Vec<String> = self
            .conn
            .query("SELECT DISTINCT blob_digest FROM image_layers", &[], |r| r.get(0))
            .map_err(q("image blobs"))?;
        Ok(StoreUsage {
            images: one("SELECT COUNT(*) FROM images")? as u64,
            image_layer_bytes: one("SELECT CAST(SUM(size) AS BIGINT) FROM layers WHERE id IN (SELECT layer_id FROM image_layers)")?
                as u64,
            image_blobs,
            snapshots: one("SELECT COUNT(*) FROM snapshots")? as u64,
            snapshot_layer_bytes: one("SELECT CAST(SUM(size) AS BIGINT) FROM layers WHERE id IN (SELECT layer_id FROM snapshots) \
                 AND id NOT IN (SELECT layer_id FROM image_layers)")? as u64,
            snapshot_blob_bytes: one(
                "SELECT CAST(SUM(blob_size) AS BIGINT) FROM (SELECT blob_digest, MAX(blob_size) AS blob_size FROM snapshots \
                 WHERE blob_digest != '' AND blob_digest NOT IN (SELECT blob_digest FROM image_layers) \
                 GROUP BY blob_digest) AS b",
            )? as u64,
        })
    }
}

/// See [`Db::usage`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StoreUsage {
    pub images: u64,
    pub image_layer_bytes: u64,
    pub image_blobs: Vec<String>,
    pub snapshots: u64,
    pub snapshot_layer_bytes: u64,
    pub snapshot_blob_bytes: u64,
}
