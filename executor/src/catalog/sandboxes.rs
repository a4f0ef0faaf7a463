//! Sandboxes (`sandboxes`): one row per live sandbox, its spec, state and
//! host.

use rusqlite::params;

use super::sql::{Conn, Optional};
use super::{now, q, Db, DbError};
use crate::ids::{SandboxId, SnapshotId};
use crate::model::SandboxState;
use crate::spec::SandboxSpec;

#[derive(Debug, Clone, PartialEq)]
pub struct SandboxRow {
    pub id: SandboxId,
    pub image_id: i64,
    pub state: SandboxState,
    pub spec: SandboxSpec,
    pub shim_pid: Option<i32>,
    pub shim_start: Option<u64>,
    pub created_at: i64,
}

/// A live sandbox's lineage and the head it observed, as its row says.
pub(super) fn sandbox_lineage_in(conn: &Conn, id: &SandboxId) -> Result<(Option<String>, Option<SnapshotId>), DbError> {
    conn.query_row(
        "SELECT json_extract(spec, '$.work_context'), json_extract(spec, '$.observed_head') FROM sandboxes WHERE id = ?1",
        params![id.as_str()],
        |r| Ok((r.get(0)?, r.get(1)?)),
    )
    .map_err(q("sandbox lineage"))
}

impl Db {
    /// Record a sandbox that is up (one write on the create path).
    pub fn insert_running_sandbox(
        &self,
        id: &SandboxId,
        image_id: i64,
        spec: &SandboxSpec,
        shim_pid: i32,
        shim_start: u64,
    ) -> Result<(), DbError> {
        let spec = serde_json::to_string(spec).map_err(|source| DbError::Decode { what: "sandbox spec", source })?;
        self.conn
            .execute(
                "INSERT INTO sandboxes (id, image_id, state, spec, shim_pid, shim_start, created_at, host) \
                 VALUES (?1, ?2, 'running', ?3, ?4, ?5, ?6, ?7)",
                params![id.as_str(), image_id, spec, shim_pid, shim_start as i64, now(), self.host],
            )
            .map_err(q("insert sandbox"))?;
        Ok(())
    }

    /// Set a sandbox's state; a row marked stopped stays so (its removal
    /// is under way here, or was asked by another host while this one was
    /// down: see [`Db::stop_lost_sandbox`]).
    pub fn set_sandbox_state(&self, id: &SandboxId, state: SandboxState) -> Result<(), DbError> {
        self.change_sandbox_state(id, state, "<>")
    }

    /// Undo the mark a removal of this host set ([`Db::set_sandbox_state`]
    /// to stopped) when the removal failed and the sandbox stays.
    pub fn unstop_sandbox(&self, id: &SandboxId, state: SandboxState) -> Result<(), DbError> {
        self.change_sandbox_state(id, state, "=")
    }

    /// Set the state of a row whose state is (`=`) or is not (`<>`) stopped.
    pub(super) fn change_sandbox_state(
        &self,
        id: &SandboxId,
        state: SandboxState,
        stopped: &str,
    ) -> Result<(), DbError> {
        self.conn
            .execute(
                &format!("UPDATE sandboxes SET state = ?2 WHERE id = ?1 AND state {stopped} ?3"),
                params![id.as_str(), state, SandboxState::Stopped],
            )
            .map_err(q("set sandbox state"))?;
        Ok(())
    }

    /// Where sandbox `id` runs and its state, as the catalog says (`None`:
    /// no row; the host `None` for a daemon outside a fleet).
    pub fn sandbox_place(&self, id: &str) -> Result<Option<(Option<String>, SandboxState)>, DbError> {
        self.conn
            .query_row("SELECT host, state FROM sandboxes WHERE id = ?1", params![id], |r| Ok((r.get(0)?, r.get(1)?)))
            .optional()
            .map_err(q("sandbox place"))
    }

    /// Ask host `host`, down and not because it stopped (its sandboxes
    /// lost to the fleet), to remove sandbox `id` once it is back: the row
    /// is marked stopped, which that host's next start (or, had it not
    /// stopped, its next heartbeat: [`Db::stopped_sandboxes`]) carries
    /// out. False, and nothing changed, unless the row is on `host` and
    /// that host is down so, both read in the one statement.
    pub fn stop_lost_sandbox(&self, id: &str, host: &str) -> Result<bool, DbError> {
        let n = self
            .conn
            .execute(
                "UPDATE sandboxes SET state = ?3 WHERE id = ?1 AND host = ?2 AND EXISTS \
                 (SELECT 1 FROM hosts WHERE id = ?2 AND down IS NOT NULL AND down <> 'stopped')",
                params![id, host, SandboxState::Stopped],
            )
            .map_err(q("stop a lost sandbox"))?;
        Ok(n > 0)
    }

    /// This host's sandboxes whose rows are marked stopped: removals under
    /// way here, and those another host asked for while this one was down.
    pub fn stopped_sandboxes(&self) -> Result<Vec<SandboxId>, DbError> {
        let ids: Vec<String> = self
            .conn
            .query(
                "SELECT id FROM sandboxes WHERE state = ?2 AND (CAST(?1 AS TEXT) IS NULL OR host = ?1) ORDER BY id",
                params![self.host, SandboxState::Stopped],
                |r| r.get(0),
            )
            .map_err(q("stopped sandboxes"))?;
        Ok(ids.into_iter().filter_map(|id| id.parse().ok()).collect())
    }

    /// Whether a sandbox id was ever used here: a row, a snapshot taken
    /// from it, an exec record. A chosen id must be new (its files, cgroup
    /// and logs would mix with the old one's).
    pub fn sandbox_id_seen(&self, id: &str) -> Result<bool, DbError> {
        self.conn
            .query_row(
                "SELECT EXISTS (SELECT 1 FROM sandboxes WHERE id = ?1) \
                 OR EXISTS (SELECT 1 FROM snapshots WHERE source_sandbox = ?1) \
                 OR EXISTS (SELECT 1 FROM exec_records WHERE sandbox_id = ?1)",
                params![id],
                |r| r.get(0),
            )
            .map_err(q("sandbox id seen"))
    }

    /// A renewed lifetime: the sandbox's spec with only its `lifetime`
    /// replaced (the rest, such as the lineage head a checkpoint moved, is
    /// the catalog's). `false` if there is no such sandbox.
    pub fn set_sandbox_lifetime(&self, id: &SandboxId, lifetime: &crate::spec::Lifetime) -> Result<bool, DbError> {
        let value = serde_json::to_value(lifetime).map_err(|source| DbError::Decode { what: "lifetime", source })?;
        self.set_sandbox_spec_field(id, "lifetime", value)
    }

    /// A live network policy change: the spec's `network` replaced, as
    /// [`Db::set_sandbox_lifetime`] replaces its lifetime.
    pub fn set_sandbox_network(&self, id: &SandboxId, network: &crate::net::NetworkSpec) -> Result<bool, DbError> {
        let value = serde_json::to_value(network).map_err(|source| DbError::Decode { what: "network", source })?;
        self.set_sandbox_spec_field(id, "network", value)
    }

    /// A live limits change: the spec's `limits` replaced.
    pub fn set_sandbox_limits(&self, id: &SandboxId, limits: &crate::spec::Limits) -> Result<bool, DbError> {
        let value = serde_json::to_value(limits).map_err(|source| DbError::Decode { what: "limits", source })?;
        self.set_sandbox_spec_field(id, "limits", value)
    }

    pub(super) fn set_sandbox_spec_field(
        &self,
        id: &SandboxId,
        field: &str,
        value: serde_json::Value,
    ) -> Result<bool, DbError> {
        let tx = self.conn.transaction(true).map_err(q("begin sandbox spec change"))?;
        let Some(spec) = tx
            .query_row("SELECT spec FROM sandboxes WHERE id = ?1", params![id.as_str()], |r| r.get::<_, String>(0))
            .optional()
            .map_err(q("sandbox spec"))?
        else {
            return Ok(false);
        };
        // Untyped: fields a newer build of the fleet added stay.
        let decode = |source| DbError::Decode { what: "sandbox spec", source };
        let mut spec: serde_json::Value = serde_json::from_str(&spec).map_err(decode)?;
        let Some(fields) = spec.as_object_mut() else {
            return Err(DbError::Invalid(format!("sandbox {id}: its spec is not an object")));
        };
        fields.insert(field.into(), value);
        let spec = serde_json::to_string(&spec).map_err(decode)?;
        tx.execute("UPDATE sandboxes SET spec = ?2 WHERE id = ?1", params![id.as_str(), spec])
            .map_err(q("set sandbox spec"))?;
        tx.commit().map_err(q("commit sandbox spec change"))?;
        Ok(true)
    }

    /// Rewrite a sandbox's whole spec. The daemon changes parts of it in
    /// place (a checkpoint's lineage head, a renewal's lifetime); the
    /// catalog tests set a row's observed head with this.
    pub fn set_sandbox_spec(&self, id: &SandboxId, spec: &SandboxSpec) -> Result<(), DbError> {
        let spec = serde_json::to_string(spec).map_err(|source| DbError::Decode { what: "sandbox spec", source })?;
        self.conn
            .execute("UPDATE sandboxes SET spec = ?2 WHERE id = ?1", params![id.as_str(), spec])
            .map_err(q("set sandbox spec"))?;
        Ok(())
    }

    pub fn delete_sandbox(&self, id: &SandboxId) -> Result<(), DbError> {
        let tx = self.conn.transaction(false).map_err(q("begin delete sandbox"))?;
        tx.execute("DELETE FROM e2b_processes WHERE sandbox = ?1", params![id.as_str()])
            .map_err(q("delete its e2b processes"))?;
        tx.execute("DELETE FROM sandboxes WHERE id = ?1", params![id.as_str()]).map_err(q("delete sandbox"))?;
        tx.commit().map_err(q("commit delete sandbox"))?;
        Ok(())
    }

    pub fn list_sandboxes(&self) -> Result<Vec<SandboxRow>, DbError> {
        type Raw = (String, i64, SandboxState, String, Option<i32>, Option<i64>, i64);
        let rows: Vec<Raw> = self
            .conn
            .query(
                "SELECT id, image_id, state, spec, shim_pid, shim_start, created_at FROM sandboxes \
                 WHERE CAST(?1 AS TEXT) IS NULL OR host = ?1 ORDER BY created_at, id",
                params![self.host],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?, r.get(5)?, r.get(6)?)),
            )
            .map_err(q("list sandboxes"))?;
        rows.into_iter()
            .filter_map(|(id, image_id, state, spec, shim_pid, shim_start, created_at)| {
                // The CHECK constraint guarantees 16 hex chars; skip anything else.
                let id = id.parse().ok()?;
                Some((id, image_id, state, spec, shim_pid, shim_start, created_at))
            })
            .map(|(id, image_id, state, spec, shim_pid, shim_start, created_at)| {
                let spec =
                    serde_json::from_str(&spec).map_err(|source| DbError::Decode { what: "sandbox spec", source })?;
                Ok(SandboxRow {
                    id,
                    image_id,
                    state,
                    spec,
                    shim_pid,
                    shim_start: shim_start.map(|s| s as u64),
                    created_at,
                })
            })
            .collect()
    }
}
