//! The catalog's side of the E2B-compatible API (migration 13): the
//! sandboxes an E2B client made, and the snapshots it took. A row outlives
//! the Strata sandbox running it: pausing suspends that sandbox into the
//! row's work context and clears `sandbox`; resuming sets the new one.

use std::collections::BTreeMap;

use rusqlite::params;
use serde::{Deserialize, Serialize};

use super::sql::{Optional, Row, SqlError};
use super::{q, Db, DbError};

/// What an E2B create asked for, kept for its resumes.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct E2bSpec {
    #[serde(default)]
    pub metadata: BTreeMap<String, String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Pause (suspend) rather than kill at the deadline.
    #[serde(default)]
    pub auto_pause: bool,
    /// Seconds of life a create or connect gives when it names none.
    pub timeout: u64,
    /// What its port URLs need in `e2b-traffic-access-token`
    /// (`network.allowPublicTraffic: false`); none: they are public.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traffic_token: Option<String>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct E2bSandbox {
    pub id: String,
    /// sha256 hex of the API key that made it.
    pub owner: String,
    /// The envd access token its envd calls must carry.
    pub token: String,
    pub template: String,
    pub work_context: String,
    pub spec: E2bSpec,
    /// The Strata sandbox running it; `None` while paused.
    pub sandbox: Option<String>,
    /// When its current run started (unix ms).
    pub started_at: i64,
}

#[derive(Debug, Clone, PartialEq)]
pub struct E2bSnapshot {
    pub id: String,
    pub owner: String,
    /// The E2B sandbox it was taken of.
    pub sandbox: String,
    pub name: Option<String>,
    pub created_at: i64,
}

const COLUMNS: &str = "id, owner, token, template, work_context, spec, sandbox, started_at";

fn row(r: &Row<'_>) -> Result<(E2bSandbox, String), SqlError> {
    Ok((
        E2bSandbox {
            id: r.get(0)?,
            owner: r.get(1)?,
            token: r.get(2)?,
            template: r.get(3)?,
            work_context: r.get(4)?,
            spec: E2bSpec::default(),
            sandbox: r.get(6)?,
            started_at: r.get(7)?,
        },
        r.get(5)?,
    ))
}

fn decode((mut s, spec): (E2bSandbox, String)) -> Result<E2bSandbox, DbError> {
    s.spec = serde_json::from_str(&spec).map_err(|source| DbError::Decode { what: "e2b sandbox spec", source })?;
    Ok(s)
}

impl Db {
    pub fn insert_e2b_sandbox(&self, s: &E2bSandbox) -> Result<(), DbError> {
        let spec = serde_json::to_string(&s.spec).map_err(|source| DbError::Decode { what: "e2b spec", source })?;
        self.conn
            .execute(
                &format!("INSERT INTO e2b_sandboxes ({COLUMNS}) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)"),
                params![s.id, s.owner, s.token, s.template, s.work_context, spec, s.sandbox, s.started_at],
            )
            .map_err(q("insert e2b sandbox"))?;
        Ok(())
    }

    pub fn e2b_sandbox(&self, id: &str) -> Result<Option<E2bSandbox>, DbError> {
        let r = self
            .conn
            .query_row(&format!("SELECT {COLUMNS} FROM e2b_sandboxes WHERE id = ?1"), params![id], row)
            .optional()
            .map_err(q("e2b sandbox"))?;
        r.map(decode).transpose()
    }

    /// The E2B sandbox a Strata sandbox runs, if any.
    pub fn e2b_sandbox_running(&self, sandbox: &str) -> Result<Option<E2bSandbox>, DbError> {
        let r = self
            .conn
            .query_row(&format!("SELECT {COLUMNS} FROM e2b_sandboxes WHERE sandbox = ?1"), params![sandbox], row)
            .optional()
            .map_err(q("e2b sandbox by sandbox"))?;
        r.map(decode).transpose()
    }

    /// An owner's sandboxes, oldest first.
    pub fn e2b_sandboxes(&self, owner: &str) -> Result<Vec<E2bSandbox>, DbError> {
        let rows: Vec<_> = self
            .conn
            .query(
                &format!("SELECT {COLUMNS} FROM e2b_sandboxes WHERE owner = ?1 ORDER BY started_at, id"),
                params![owner],
                row,
            )
            .map_err(q("e2b sandboxes"))?;
        rows.into_iter().map(decode).collect()
    }

    /// Record the Strata sandbox now running it (`None`: paused).
    pub fn set_e2b_sandbox_run(&self, id: &str, sandbox: Option<&str>, started_at: i64) -> Result<(), DbError> {
        self.conn
            .execute(
                "UPDATE e2b_sandboxes SET sandbox = ?2, started_at = ?3 WHERE id = ?1",
                params![id, sandbox, started_at],
            )
            .map_err(q("set e2b sandbox run"))?;
        Ok(())
    }

    pub fn delete_e2b_sandbox(&self, id: &str) -> Result<(), DbError> {
        self.conn.execute("DELETE FROM e2b_sandboxes WHERE id = ?1", params![id]).map_err(q("delete e2b sandbox"))?;
        Ok(())
    }

    pub fn insert_e2b_snapshot(&self, s: &E2bSnapshot) -> Result<(), DbError> {
        self.conn
            .execute(
                "INSERT INTO e2b_snapshots (id, owner, sandbox, name, created_at) VALUES (?1, ?2, ?3, ?4, ?5)",
                params![s.id, s.owner, s.sandbox, s.name, s.created_at],
            )
            .map_err(q("insert e2b snapshot"))?;
        Ok(())
    }

    pub fn delete_e2b_snapshot(&self, id: &str) -> Result<(), DbError> {
        self.conn.execute("DELETE FROM e2b_snapshots WHERE id = ?1", params![id]).map_err(q("delete e2b snapshot"))?;
        Ok(())
    }

    /// An owner's snapshots, oldest first.
    pub fn e2b_snapshots(&self, owner: &str) -> Result<Vec<E2bSnapshot>, DbError> {
        self.conn
            .query(
                "SELECT id, owner, sandbox, name, created_at FROM e2b_snapshots WHERE owner = ?1 \
                 ORDER BY created_at, id",
                params![owner],
                |r| {
                    Ok(E2bSnapshot {
                        id: r.get(0)?,
                        owner: r.get(1)?,
                        sandbox: r.get(2)?,
                        name: r.get(3)?,
                        created_at: r.get(4)?,
                    })
                },
            )
            .map_err(q("e2b snapshots"))
    }
}
