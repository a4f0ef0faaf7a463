//! The catalog's side of the E2B-compatible API (migration 13): the
//! sandboxes an E2B client made, and the snapshots it took. A row outlives
//! the Strata sandbox running it: pausing suspends that sandbox into the
//! row's work context and clears `sandbox`; resuming sets the new one.
//! Migration 19 adds envd's process table ([`E2bProcess`]), so a daemon
//! restart keeps it.

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

/// Migration 19, one text for both engines: the commands E2B clients
/// started (envd's process table), one row per running command of a live
/// Strata sandbox, removed when it ends or its sandbox goes.
pub(super) const MIGRATION_19: &str = r#"
    CREATE TABLE e2b_processes (
        sandbox  TEXT NOT NULL,
        pid      BIGINT NOT NULL,
        exec_id  BIGINT NOT NULL,
        tag      TEXT,
        config   TEXT NOT NULL,
        cwd      TEXT NOT NULL,
        stdin    BIGINT NOT NULL CHECK (stdin IN (0, 1)),
        pty      BIGINT NOT NULL CHECK (pty IN (0, 1)),
        deadline BIGINT,
        PRIMARY KEY (sandbox, pid)
    );
"#;

/// A command an E2B client started (`process.Process/Start`), as a
/// restarted daemon needs it to list it and reattach to it.
#[derive(Debug, Clone, PartialEq)]
pub struct E2bProcess {
    /// The Strata sandbox it runs in.
    pub sandbox: String,
    /// Its pid in the sandbox (E2B's name for it).
    pub pid: u32,
    /// The shim's id of it.
    pub exec_id: u64,
    pub tag: Option<String>,
    /// `ProcessConfig` as it was asked for (JSON).
    pub config: serde_json::Value,
    /// Its working directory (what the exec log records with its
    /// command line, which `config` holds).
    pub cwd: String,
    /// Its stdin was kept open for input.
    pub stdin: bool,
    pub pty: bool,
    /// When its time runs out (unix ms), if it has a limit.
    pub deadline: Option<i64>,
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

    pub fn insert_e2b_process(&self, p: &E2bProcess) -> Result<(), DbError> {
        let config = p.config.to_string();
        self.conn
            .execute(
                "INSERT INTO e2b_processes (sandbox, pid, exec_id, tag, config, cwd, stdin, pty, deadline) \
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9) \
                 ON CONFLICT (sandbox, pid) DO UPDATE SET exec_id = ?3, tag = ?4, config = ?5, \
                 cwd = ?6, stdin = ?7, pty = ?8, deadline = ?9",
                params![
                    p.sandbox,
                    i64::from(p.pid),
                    p.exec_id as i64,
                    p.tag,
                    config,
                    p.cwd,
                    i64::from(p.stdin),
                    i64::from(p.pty),
                    p.deadline
                ],
            )
            .map_err(q("insert e2b process"))?;
        Ok(())
    }

    /// The commands recorded as running in Strata sandbox `sandbox`, by pid.
    pub fn e2b_processes(&self, sandbox: &str) -> Result<Vec<E2bProcess>, DbError> {
        type Raw = (E2bProcess, String);
        let rows: Vec<Raw> = self
            .conn
            .query(
                "SELECT sandbox, pid, exec_id, tag, config, cwd, stdin, pty, deadline FROM e2b_processes \
                 WHERE sandbox = ?1 ORDER BY pid",
                params![sandbox],
                |r| {
                    let (pid, exec_id, stdin, pty): (i64, i64, i64, i64) = (r.get(1)?, r.get(2)?, r.get(6)?, r.get(7)?);
                    Ok((
                        E2bProcess {
                            sandbox: r.get(0)?,
                            pid: pid as u32,
                            exec_id: exec_id as u64,
                            tag: r.get(3)?,
                            config: serde_json::Value::Null,
                            cwd: r.get(5)?,
                            stdin: stdin != 0,
                            pty: pty != 0,
                            deadline: r.get(8)?,
                        },
                        r.get(4)?,
                    ))
                },
            )
            .map_err(q("e2b processes"))?;
        rows.into_iter()
            .map(|(mut p, config)| {
                p.config =
                    serde_json::from_str(&config).map_err(|source| DbError::Decode { what: "e2b process", source })?;
                Ok(p)
            })
            .collect()
    }

    /// The Strata sandboxes the process table has commands of.
    pub fn e2b_process_sandboxes(&self) -> Result<Vec<String>, DbError> {
        self.conn
            .query("SELECT DISTINCT sandbox FROM e2b_processes ORDER BY sandbox", params![], |r| r.get(0))
            .map_err(q("e2b process sandboxes"))
    }

    /// Forget a command (it ended, or no longer runs); not a later one
    /// that got its pid (another exec id).
    pub fn delete_e2b_process(&self, sandbox: &str, pid: u32, exec_id: u64) -> Result<(), DbError> {
        self.conn
            .execute(
                "DELETE FROM e2b_processes WHERE sandbox = ?1 AND pid = ?2 AND exec_id = ?3",
                params![sandbox, i64::from(pid), exec_id as i64],
            )
            .map_err(q("delete e2b process"))?;
        Ok(())
    }
}
