//! Exec records (`exec_records`): one row per command a sandbox ran, with
//! its output up to `--keep-output`; a snapshot seals its sandbox's records
//! since its parent.

use rusqlite::params;

use super::sql::Conn;
use super::{q, Db, DbError};
pub use crate::records::ExecRecord;

/// Insert an exec record (its id is the database's; `pulled`: a pulled
/// snapshot's); returns the id.
pub(super) fn insert_exec_record_in(conn: &Conn, r: &ExecRecord, pulled: bool) -> Result<i64, DbError> {
    let argv = serde_json::to_string(&r.argv).map_err(|source| DbError::Decode { what: "argv", source })?;
    let out = r.output.as_ref();
    conn.query_row(
        "INSERT INTO exec_records (sandbox_id, argv, cwd, started_at, duration_ms, exit_code, output_bytes, \
         stdout, stderr, output_cut, pulled) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11) RETURNING id",
        params![
            r.sandbox_id,
            argv,
            r.cwd,
            r.started_at,
            r.duration_ms,
            r.exit_code,
            r.output_bytes as i64,
            out.map(|o| &o.stdout),
            out.map(|o| &o.stderr),
            out.map_or(0, |o| o.cut as i64),
            pulled,
        ],
        |r| r.get(0),
    )
    .map_err(q("insert exec record"))
}

impl Db {
    pub fn insert_exec_record(&self, r: &ExecRecord) -> Result<(), DbError> {
        insert_exec_record_in(&self.conn, r, false).map(|_| ())
    }

    /// Insert exec records in order: one transaction for them all, or, if
    /// that fails, each on its own, so one that cannot be written does not
    /// take the others with it. The error is the last record's that failed.
    pub fn insert_exec_records(&self, records: &[ExecRecord]) -> Result<(), DbError> {
        if let [one] = records {
            return self.insert_exec_record(one);
        }
        let batch = (|| {
            let tx = self.conn.transaction(true).map_err(q("begin exec records"))?;
            for r in records {
                insert_exec_record_in(&tx, r, false)?;
            }
            tx.commit().map_err(q("commit exec records"))
        })();
        if batch.is_ok() {
            return batch;
        }
        records.iter().map(|r| self.insert_exec_record(r)).filter(Result::is_err).last().unwrap_or(Ok(()))
    }

    /// Exec records with `from < id <= upto` (`upto` `None`: all after
    /// `from`) of one sandbox (or, `None`, of any: a pulled snapshot's),
    /// oldest first; with their output if `output`.
    pub fn exec_records(
        &self,
        sandbox_id: Option<&str>,
        from: i64,
        upto: Option<i64>,
        output: bool,
    ) -> Result<Vec<ExecRecord>, DbError> {
        const COLUMNS: &str = "SELECT id, sandbox_id, argv, cwd, started_at, duration_ms, exit_code, output_bytes, \
                 CASE WHEN ?4 THEN stdout END, CASE WHEN ?4 THEN stderr END, output_cut FROM exec_records";
        let sql = match sandbox_id {
            Some(_) => format!("{COLUMNS} WHERE sandbox_id = ?1 AND pulled = 0 AND id > ?2 AND id <= ?3 ORDER BY id"),
            None => format!("{COLUMNS} WHERE CAST(?1 AS TEXT) IS NULL AND id > ?2 AND id <= ?3 ORDER BY id"),
        };
        let rows: Vec<(ExecRecord, String)> = self
            .conn
            .query(&sql, params![sandbox_id, from, upto.unwrap_or(i64::MAX), output], |r| {
                let stdout: Option<Vec<u8>> = r.get(8)?;
                let stderr: Option<Vec<u8>> = r.get(9)?;
                let rec = ExecRecord {
                    id: r.get(0)?,
                    sandbox_id: r.get(1)?,
                    argv: Vec::new(),
                    cwd: r.get(3)?,
                    started_at: r.get(4)?,
                    duration_ms: r.get(5)?,
                    exit_code: r.get(6)?,
                    output_bytes: r.get::<_, i64>(7)? as u64,
                    output: match (stdout, stderr) {
                        (Some(stdout), Some(stderr)) => {
                            Some(crate::model::KeptOutput { stdout, stderr, cut: r.get::<_, i64>(10)? as u64 })
                        }
                        _ => None,
                    },
                };
                Ok((rec, r.get(2)?))
            })
            .map_err(q("exec records"))?;
        rows.into_iter()
            .map(|(mut rec, argv)| {
                rec.argv = serde_json::from_str(&argv).map_err(|source| DbError::Decode { what: "argv", source })?;
                Ok(rec)
            })
            .collect()
    }

    /// The newest exec record id of a sandbox (0 if none).
    pub fn last_exec_record(&self, sandbox_id: &str) -> Result<i64, DbError> {
        self.conn
            .query_row(
                "SELECT COALESCE(MAX(id), 0) FROM exec_records WHERE sandbox_id = ?1",
                params![sandbox_id],
                |r| r.get(0),
            )
            .map_err(q("last exec record"))
    }
}
