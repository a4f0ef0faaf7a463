//! Lineages (`work_contexts`, `restores`): a work context, its head and
//! every activation; the fence a checkpoint's append meets; the end of a
//! lineage (retired, or closed with its outcome).
//!
//! Who holds a lineage: at most one live sandbox works in an active lineage,
//! fleet-wide. The lease is the sandbox's own row (its work context is in
//! its spec) and it lasts as long as its host's heartbeat deadline, which
//! every heartbeat renews: there is no second row to keep in step with the
//! sandbox's, and nothing to release when it ends (its row goes). A launch
//! takes the lease in the transaction that records the sandbox
//! ([`Db::activate_sandbox`]), so two launches of one lineage (one host or
//! two) cannot both commit.
//!
//! A row holds while it is not stopped and its host is this one, none (a
//! daemon outside a fleet) or a host that is up and within its deadline. A
//! host marked down, or stopped, holds nothing: its sandboxes' lineages
//! may be resumed elsewhere, and if that host comes back its stale
//! sandboxes' appends meet the lineage's fence.

use std::collections::HashMap;

use rusqlite::params;
use serde::{Deserialize, Serialize};

use super::sql::{Conn, Optional, Row, SqlError};
use super::{now, now_ms, q, sandbox_lineage_in, Db, DbError, SnapshotRow};
use crate::ids::{SandboxId, SnapshotId};
use crate::model::{LineageState, Rung, StartKind};
pub use crate::records::{Holder, RestoreRow};
use crate::spec::SandboxSpec;

/// One lineage (a work context).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkContextRow {
    pub id: String,
    pub image_id: i64,
    /// What the lineage began from.
    pub start_kind: StartKind,
    /// The baseline or fork origin it began from (none for `image`).
    pub start_id: Option<SnapshotId>,
    /// Its ready head (the last checkpoint appended).
    pub head_id: Option<SnapshotId>,
    pub head_seq: i64,
    pub state: LineageState,
    pub created_at: i64,
    pub used_at: i64,
    pub retired_at: Option<i64>,
}

/// The columns [`work_context_row`] reads, in its order.
pub(crate) const WORK_CONTEXT_COLUMNS: &str =
    "id, image_id, start_kind, start_id, head_id, head_seq, state, created_at, used_at, retired_at";
pub(crate) fn work_context_row(r: &Row<'_>) -> Result<WorkContextRow, SqlError> {
    Ok(WorkContextRow {
        id: r.get(0)?,
        image_id: r.get(1)?,
        start_kind: r.get(2)?,
        start_id: r.get(3)?,
        head_id: r.get(4)?,
        head_seq: r.get(5)?,
        state: r.get(6)?,
        created_at: r.get(7)?,
        used_at: r.get(8)?,
        retired_at: r.get(9)?,
    })
}

impl WorkContextRow {
    /// A new, active lineage with no head yet.
    pub fn new(id: &str, image_id: i64, start_kind: StartKind, start_id: Option<&SnapshotId>) -> WorkContextRow {
        WorkContextRow {
            id: id.into(),
            image_id,
            start_kind,
            start_id: start_id.cloned(),
            head_id: None,
            head_seq: 0,
            state: LineageState::Active,
            created_at: 0,
            used_at: 0,
            retired_at: None,
        }
    }
}

/// Why an append to a lineage was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fence {
    /// Another activation advanced the head since this sandbox observed it.
    Moved { work_context: String, observed: Option<SnapshotId>, head: Option<SnapshotId> },
    /// The lineage has ended (retired, or closed as `state`).
    Ended { work_context: String, state: LineageState },
}

impl std::fmt::Display for Fence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let show = |h: &Option<SnapshotId>| h.as_ref().map_or_else(|| "none".to_string(), |h| h.to_string());
        match self {
            Fence::Moved { work_context, observed, head } => write!(
                f,
                "work context {work_context} moved on: this sandbox observed head {} but the head is now {} \
                 (another sandbox of the lineage appended first)",
                show(observed),
                show(head)
            ),
            Fence::Ended { work_context, state } => write!(f, "work context {work_context} is {state}"),
        }
    }
}

/// A lineage's head, its sequence number and its state.
pub(super) fn lineage_head_in(conn: &Conn, wc: &str) -> Result<(Option<SnapshotId>, i64, LineageState), DbError> {
    conn.query_row("SELECT head_id, head_seq, state FROM work_contexts WHERE id = ?1", params![wc], |r| {
        Ok((r.get(0)?, r.get(1)?, r.get(2)?))
    })
    .map_err(q("work context head"))
}

/// The fence an append to lineage `wc` by a sandbox that observed
/// `observed` meets, given the lineage's `head` and `state`.
pub(super) fn fence(
    wc: &str,
    observed: &Option<SnapshotId>,
    head: &Option<SnapshotId>,
    state: LineageState,
) -> Option<Fence> {
    if state != LineageState::Active {
        Some(Fence::Ended { work_context: wc.into(), state })
    } else if head != observed {
        Some(Fence::Moved { work_context: wc.into(), observed: observed.clone(), head: head.clone() })
    } else {
        None
    }
}

/// Delete a layer's row if no image or snapshot lists it; true if deleted.
/// The lineage a sandbox appends to; a sandbox from before lineages gets
/// its own, from now.
pub(super) fn adopt_lineage_in(
    tx: &Conn,
    sandbox: &SandboxId,
    wc: Option<String>,
    image_id: i64,
) -> Result<String, DbError> {
    if let Some(wc) = wc {
        return Ok(wc);
    }
    tx.execute(
        "INSERT INTO work_contexts (id, image_id, start_kind, state, created_at, used_at) \
         VALUES (?1, ?2, 'image', 'active', ?3, ?3) ON CONFLICT DO NOTHING",
        params![sandbox.as_str(), image_id, now()],
    )
    .map_err(q("adopt work context"))?;
    Ok(sandbox.to_string())
}

impl Db {
    /// Make a work context; false if one with that id exists.
    pub fn insert_work_context(&mut self, wc: &WorkContextRow) -> Result<bool, DbError> {
        let n = self
            .conn
            .execute(
                "INSERT INTO work_contexts (id, image_id, start_kind, start_id, state, created_at, used_at) \
                 VALUES (?1, ?2, ?3, ?4, 'active', ?5, ?5) ON CONFLICT DO NOTHING",
                params![wc.id, wc.image_id, wc.start_kind, wc.start_id, now()],
            )
            .map_err(q("insert work context"))?;
        Ok(n == 1)
    }

    /// Remove a work context nothing was recorded in (a create that failed).
    pub fn delete_unused_work_context(&mut self, id: &str) -> Result<(), DbError> {
        self.conn
            .execute(
                "DELETE FROM work_contexts WHERE id = ?1 AND head_id IS NULL \
                 AND NOT EXISTS (SELECT 1 FROM snapshots WHERE work_context = ?1) \
                 AND NOT EXISTS (SELECT 1 FROM restores WHERE work_context = ?1)",
                params![id],
            )
            .map_err(q("delete work context"))?;
        Ok(())
    }

    pub fn work_context(&self, id: &str) -> Result<Option<WorkContextRow>, DbError> {
        self.conn
            .query_row(
                &format!("SELECT {WORK_CONTEXT_COLUMNS} FROM work_contexts WHERE id = ?1"),
                params![id],
                work_context_row,
            )
            .optional()
            .map_err(q("get work context"))
    }

    /// Record a started sandbox and its activation of a lineage in one
    /// transaction (one commit on the create path, not three). Refused
    /// (`LineageHeld`) while another live sandbox holds the lineage
    /// (`catalog/lineages.rs`).
    #[allow(clippy::too_many_arguments)]
    pub fn activate_sandbox(
        &self,
        id: &SandboxId,
        image_id: i64,
        spec: &SandboxSpec,
        shim_pid: i32,
        shim_start: u64,
        rung: Rung,
        snapshot: Option<&str>,
        fell: &[String],
    ) -> Result<(), DbError> {
        let wc = spec.work_context.as_deref().unwrap_or(id.as_str());
        let tx = self.conn.transaction(true).map_err(q("begin activate sandbox"))?;
        self.take_lineage(wc, id.as_str())?;
        self.insert_running_sandbox(id, image_id, spec, shim_pid, shim_start)?;
        self.record_restore(wc, id, (rung, snapshot, fell), spec.observed_head.as_deref())?;
        tx.commit().map_err(q("commit activate sandbox"))
    }

    pub(super) fn record_restore(
        &self,
        work_context: &str,
        sandbox: &SandboxId,
        (rung, snapshot, fell): (Rung, Option<&str>, &[String]),
        observed_head: Option<&str>,
    ) -> Result<(), DbError> {
        let fell = if fell.is_empty() {
            None
        } else {
            Some(serde_json::to_string(fell).map_err(|source| DbError::Decode { what: "restore falls", source })?)
        };
        self.conn
            .execute(
                "INSERT INTO restores (work_context, sandbox_id, rung, snapshot_id, observed_head, created_at, fell) \
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
                params![work_context, sandbox.as_str(), rung, snapshot, observed_head, now(), fell],
            )
            .map_err(q("record restore"))?;
        // A launch checked the lineage when it began; gc may have retired
        // it since (a sandbox with no row yet does not keep it).
        let n = self
            .conn
            .execute(
                "UPDATE work_contexts SET used_at = ?2 WHERE id = ?1 AND state = 'active'",
                params![work_context, now()],
            )
            .map_err(q("touch work context"))?;
        if n == 0 {
            return Err(DbError::RetiredMeanwhile(work_context.into()));
        }
        Ok(())
    }

    pub fn restores(&self, work_context: &str) -> Result<Vec<RestoreRow>, DbError> {
        self.conn
            .query(
                "SELECT id, work_context, sandbox_id, rung, snapshot_id, observed_head, created_at, fell \
                 FROM restores WHERE work_context = ?1 ORDER BY id",
                params![work_context],
                |r| {
                    Ok(RestoreRow {
                        id: r.get(0)?,
                        work_context: r.get(1)?,
                        sandbox_id: r.get(2)?,
                        rung: r.get(3)?,
                        snapshot_id: r.get(4)?,
                        observed_head: r.get(5)?,
                        created_at: r.get(6)?,
                        fell: match r.get::<_, Option<String>>(7)? {
                            None => Vec::new(),
                            Some(j) => serde_json::from_str(&j).map_err(|e| {
                                rusqlite::Error::FromSqlConversionFailure(7, rusqlite::types::Type::Text, Box::new(e))
                            })?,
                        },
                    })
                },
            )
            .map_err(q("restores"))
    }

    /// A lineage's checkpoints, in append order.
    pub fn lineage_snapshots(&self, work_context: &str) -> Result<Vec<SnapshotRow>, DbError> {
        // Captures (in progress or failed: no sequence) after the sequence.
        let sql = format!(
            "{} WHERE s.work_context = ?1 ORDER BY s.sequence IS NULL, s.sequence, s.created_at",
            Self::SNAP_SELECT
        );
        let rows: Vec<_> =
            self.conn.query(&sql, params![work_context], Self::snapshot_from).map_err(q("lineage snapshots"))?;
        rows.into_iter().map(Self::decode_snapshot).collect()
    }

    /// Retire a lineage: it and its checkpoints leave restore eligibility.
    /// False if it was retired already.
    pub fn retire_work_context(&mut self, id: &str) -> Result<bool, DbError> {
        self.retire(id, None)
    }

    /// gc's retirement of a stale lineage: only if it is still unused since
    /// `cutoff`, no sandbox row of the catalog (on any host, one marked down
    /// included) works in it and no E2B sandbox is paused in it, all checked
    /// by the retiring write itself, so a resume or checkpoint recorded
    /// since the lineage was listed keeps it (and a launch still under way
    /// fails its activation: `RetiredMeanwhile`).
    pub fn retire_stale_work_context(&mut self, id: &str, cutoff: i64) -> Result<bool, DbError> {
        self.retire(id, Some(cutoff))
    }

    pub(super) fn retire(&mut self, id: &str, stale_before: Option<i64>) -> Result<bool, DbError> {
        self.end(id, LineageState::Retired, stale_before)
    }

    /// Close an active lineage as `outcome` (completed, cancelled,
    /// failed): its checkpoints leave restore position as a retirement's
    /// do, and retention counts from now. `Err(state)`: it had ended
    /// already, as `state`.
    pub fn close_work_context(&mut self, id: &str, outcome: LineageState) -> Result<Result<(), LineageState>, DbError> {
        if self.end(id, outcome, None)? {
            return Ok(Ok(()));
        }
        let (_, _, state) = lineage_head_in(&self.conn, id)?;
        Ok(Err(state))
    }

    /// End an active lineage as `state` (its checkpoints retired with
    /// it); with `stale_before`, only as gc retires a stale one.
    pub(super) fn end(&mut self, id: &str, state: LineageState, stale_before: Option<i64>) -> Result<bool, DbError> {
        let tx = self.conn.transaction(true).map_err(q("begin retire"))?;
        let n = tx
            .execute(
                "UPDATE work_contexts SET state = ?4, retired_at = ?2 WHERE id = ?1 AND state = 'active' \
                 AND (CAST(?3 AS BIGINT) IS NULL OR (used_at <= ?3 \
                      AND NOT EXISTS (SELECT 1 FROM sandboxes WHERE json_extract(spec, '$.work_context') = ?1) \
                      AND id NOT IN (SELECT work_context FROM e2b_sandboxes)))",
                params![id, now(), stale_before, state],
            )
            .map_err(q("retire work context"))?;
        if n == 1 {
            tx.execute(
                "UPDATE snapshots SET state = 'retired', retired_at = ?2 \
                 WHERE work_context = ?1 AND state IN ('ready', 'superseded')",
                params![id, now()],
            )
            .map_err(q("retire checkpoints"))?;
        }
        tx.commit().map_err(q("commit retire"))?;
        Ok(n == 1)
    }

    /// The lineage and observed head a live sandbox's row holds now.
    pub fn sandbox_lineage(&self, id: &SandboxId) -> Result<(Option<String>, Option<SnapshotId>), DbError> {
        sandbox_lineage_in(&self.conn, id)
    }

    /// Why an append by `sandbox` would be refused now, if it would (the
    /// append checks again in its transaction).
    pub fn append_fence(&self, sandbox: &SandboxId) -> Result<Option<Fence>, DbError> {
        let (Some(wc), observed) = sandbox_lineage_in(&self.conn, sandbox)? else { return Ok(None) };
        let (head, _, state) = lineage_head_in(&self.conn, &wc)?;
        Ok(fence(&wc, &observed, &head, state))
    }

    /// Active lineages neither captured nor restored since `cutoff`. An
    /// E2B sandbox's work context is never stale: it holds the sandbox's
    /// files while it is paused, and is retired when it is killed.
    pub fn stale_lineages(&self, cutoff: i64) -> Result<Vec<String>, DbError> {
        self.conn
            .query(
                "SELECT id FROM work_contexts WHERE state = 'active' AND used_at <= ?1 \
                 AND id NOT IN (SELECT work_context FROM e2b_sandboxes) ORDER BY id",
                params![cutoff],
                |r| r.get(0),
            )
            .map_err(q("stale lineages"))
    }
}

/// The rows that hold their lineage (`?1`: this host, `?2`: now in ms),
/// with the lineage as the first column.
const HOLDING: &str = "SELECT json_extract(s.spec, '$.work_context'), s.id, s.host FROM sandboxes s \
     LEFT JOIN hosts h ON h.id = s.host \
     WHERE s.state <> 'stopped' AND json_extract(s.spec, '$.work_context') IS NOT NULL \
     AND (s.host IS NULL OR s.host = ?1 OR (h.down IS NULL AND h.deadline_at >= ?2))";

impl Db {
    /// The live sandbox other than `except` holding lineage `wc`, if any.
    pub fn lineage_holder(&self, wc: &str, except: Option<&str>) -> Result<Option<Holder>, DbError> {
        self.conn
            .query_row(
                &format!(
                    "{HOLDING} AND json_extract(s.spec, '$.work_context') = ?3 AND s.id <> ?4 ORDER BY s.created_at"
                ),
                params![self.host, now_ms(), wc, except.unwrap_or("")],
                |r| Ok(Holder { sandbox: r.get(1)?, host: r.get(2)? }),
            )
            .optional()
            .map_err(q("lineage holder"))
    }

    /// Fail with [`DbError::LineageHeld`] if another live sandbox holds
    /// `wc` (called inside the launch's transaction).
    pub(super) fn take_lineage(&self, wc: &str, sandbox: &str) -> Result<(), DbError> {
        match self.lineage_holder(wc, Some(sandbox))? {
            Some(holder) => Err(DbError::LineageHeld { work_context: wc.into(), holder }),
            None => Ok(()),
        }
    }

    /// Every lineage, oldest first, with its holder.
    pub fn lineages(&self) -> Result<Vec<(WorkContextRow, Option<Holder>)>, DbError> {
        let rows: Vec<WorkContextRow> = self
            .conn
            .query(
                &format!("SELECT {WORK_CONTEXT_COLUMNS} FROM work_contexts ORDER BY created_at, id"),
                params![],
                work_context_row,
            )
            .map_err(q("list work contexts"))?;
        let held: Vec<(String, Holder)> = self
            .conn
            .query(&format!("{HOLDING} ORDER BY s.created_at"), params![self.host, now_ms()], |r| {
                Ok((r.get::<_, String>(0)?, Holder { sandbox: r.get(1)?, host: r.get(2)? }))
            })
            .map_err(q("lineage holders"))?;
        // The oldest holder of each, the one a launch would name.
        let mut holders: HashMap<String, Holder> = HashMap::new();
        for (wc, h) in held {
            holders.entry(wc).or_insert(h);
        }
        Ok(rows
            .into_iter()
            .map(|wc| {
                let h = holders.remove(&wc.id);
                (wc, h)
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::catalog::{HostClaim, Rung, SandboxState, StartKind};
    use crate::ids::SandboxId;
    use crate::oci::ImageConfig;
    use crate::spec::SandboxSpec;

    fn claim(id: &str, deadline_ms: i64) -> HostClaim<'_> {
        HostClaim { id, machine: "m", root: "/r", version: "0", info: "{}", deadline_ms }
    }

    /// A catalog with one image and lineages `wcs`.
    fn catalog(wcs: &[&str]) -> (Db, i64) {
        let mut db = Db::open_in_memory().unwrap();
        let d = |c: &str| format!("sha256:{}", c.repeat(64)).parse().unwrap();
        let img = db.insert_image(&"a".parse().unwrap(), &d("e"), &d("c"), &ImageConfig::default(), &[]).unwrap();
        for wc in wcs {
            db.insert_work_context(&WorkContextRow::new(wc, img, StartKind::Image, None)).unwrap();
        }
        (db, img)
    }

    fn launch(db: &Db, img: i64, wc: &str) -> Result<SandboxId, DbError> {
        let id = SandboxId::random();
        let spec = SandboxSpec { work_context: Some(wc.into()), ..Default::default() };
        db.activate_sandbox(&id, img, &spec, 1, 1, Rung::Image, None, &[]).map(|()| id)
    }

    fn held(r: Result<SandboxId, DbError>) -> Holder {
        match r {
            Err(DbError::LineageHeld { holder, .. }) => holder,
            other => panic!("not refused as held: {other:?}"),
        }
    }

    #[test]
    fn a_second_launch_outside_a_fleet_is_refused_and_records_nothing() {
        let (db, img) = catalog(&["w"]);
        let x = launch(&db, img, "w").unwrap();
        let e = launch(&db, img, "w").unwrap_err();
        assert!(e.to_string().contains(&format!("held by live sandbox {x}")), "{e}");
        assert_eq!(held(Err(e)), Holder { sandbox: x.to_string(), host: None });
        assert_eq!(db.list_sandboxes().unwrap().len(), 1);
        assert_eq!(db.restores("w").unwrap().len(), 1);
        // A stopped row (its removal under way) holds nothing.
        db.set_sandbox_state(&x, SandboxState::Stopped).unwrap();
        assert_eq!(db.lineage_holder("w", None).unwrap(), None);
        let y = launch(&db, img, "w").unwrap();
        assert_eq!(db.lineage_holder("w", None).unwrap().unwrap().sandbox, y.to_string());
        assert_eq!(db.lineage_holder("w", Some(y.as_str())).unwrap(), None, "a sandbox does not hold against itself");
    }

    #[test]
    fn the_lease_lasts_as_long_as_its_hosts_deadline() {
        let (mut db, img) = catalog(&["v", "w"]);
        db.register_host(&claim("b", 60_000)).unwrap();
        let x = launch(&db, img, "w").unwrap();
        // Another host, b up: refused, naming the sandbox and its host.
        db.register_host(&claim("a", 60_000)).unwrap();
        assert_eq!(held(launch(&db, img, "w")), Holder { sandbox: x.to_string(), host: Some("b".into()) });
        // b's deadline passes (not yet marked down): the lease has expired.
        db.register_host(&claim("b", -1)).unwrap();
        db.register_host(&claim("a", 60_000)).unwrap();
        assert_eq!(db.lineage_holder("w", None).unwrap(), None);
        let y = launch(&db, img, "w").unwrap();
        assert_eq!(held(launch(&db, img, "w")), Holder { sandbox: y.to_string(), host: Some("a".into()) });
        // A stopped host holds nothing for the others.
        let z = launch(&db, img, "v").unwrap();
        db.host_stopped().unwrap();
        db.register_host(&claim("c", 60_000)).unwrap();
        assert_eq!(db.lineage_holder("v", None).unwrap(), None);
        // The listing shows each lineage's holder (b's expired x is not w's).
        let list: Vec<_> = db.lineages().unwrap().into_iter().map(|(wc, h)| (wc.id, h.map(|h| h.sandbox))).collect();
        assert_eq!(list, [("v".to_string(), None), ("w".to_string(), None)], "a stopped: y and z hold nothing");
        db.register_host(&claim("a", 60_000)).unwrap();
        let list: Vec<_> = db.lineages().unwrap().into_iter().map(|(wc, h)| (wc.id, h.map(|h| h.sandbox))).collect();
        assert_eq!(list, [("v".to_string(), Some(z.to_string())), ("w".to_string(), Some(y.to_string()))]);
        // b back within its deadline: its stale x holds again (the oldest,
        // named first); its appends meet the lineage's fence.
        db.register_host(&claim("b", 60_000)).unwrap();
        assert_eq!(held(launch(&db, img, "w")).sandbox, x.to_string());
    }
}
