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

use super::sql::Optional;
use super::{now_ms, q, work_context_row, Db, DbError, WorkContextRow, WORK_CONTEXT_COLUMNS};

/// The live sandbox working in a lineage.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Holder {
    pub sandbox: String,
    /// Its host (`None`: a daemon outside a fleet).
    pub host: Option<String>,
}

impl std::fmt::Display for Holder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.host {
            Some(h) => write!(f, "sandbox {} on host {h}", self.sandbox),
            None => write!(f, "sandbox {}", self.sandbox),
        }
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
        let mut holders: HashMap<String, Holder> = HashMap::new();
        let held: Vec<(String, Holder)> = self
            .conn
            .query(&format!("{HOLDING} ORDER BY s.created_at DESC"), params![self.host, now_ms()], |r| {
                Ok((r.get::<_, String>(0)?, Holder { sandbox: r.get(1)?, host: r.get(2)? }))
            })
            .map_err(q("lineage holders"))?;
        // Oldest last: the first holder is the one a launch would name.
        holders.extend(held);
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
    use crate::db::{HostClaim, ImageConfig, Rung, SandboxState, StartKind};
    use crate::ids::SandboxId;
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
