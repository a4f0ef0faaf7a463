//! Hosts sharing the catalog (migration 15). Each daemon registers a row
//! under its host id and renews its deadline at every heartbeat; a host
//! past its deadline is marked down by whichever host looks first, and its
//! sandboxes are reported lost. A host's sandboxes, in-flight idempotent
//! requests and captures carry its id: a daemon adopts, forgets and fails
//! only its own at start. `drain` is kept here, so any host (or the
//! operator through any host) can drain another, and a drain outlives a
//! restart. Times are Unix milliseconds from each host's clock: hosts'
//! clocks must agree to well within a deadline.

use rusqlite::params;

use super::sql::{Optional, Row, SqlError};
use super::{digest_column, q, Db, DbError};
use crate::oci::Digest;

/// Where a snapshot is: the host that made it, and its reference in the
/// fleet registry once published (`daemon/fleet.rs`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Place {
    pub host: Option<String>,
    pub published: Option<String>,
}

/// What a daemon registers as.
#[derive(Debug, Clone)]
pub struct HostClaim<'a> {
    pub id: &'a str,
    /// `/etc/machine-id` (or the hostname): with `root`, tells a restart
    /// of the same daemon from another daemon taking the same id.
    pub machine: &'a str,
    pub root: &'a str,
    pub version: &'a str,
    /// Its capacity (`types::HostInfo` as JSON).
    pub info: &'a str,
    /// How long the row stays alive without a heartbeat.
    pub deadline_ms: i64,
}

/// Whether a host is up, as its row's `down` column says: NULL (up), the
/// word `stopped` (its daemon stopped cleanly, `Db::host_stopped`), or why
/// another host marked it down (no heartbeat within its deadline).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostState {
    Up,
    /// Its daemon stopped: its sandboxes go on and its next start adopts
    /// them; nothing of it is lost.
    Stopped,
    /// Marked down by another host (why): its sandboxes are lost to the
    /// fleet until it is back.
    Down(String),
}

/// How a stop is written in the `down` column.
const STOPPED: &str = "stopped";

impl HostState {
    fn from_column(down: Option<String>) -> HostState {
        match down {
            None => HostState::Up,
            Some(s) if s == STOPPED => HostState::Stopped,
            Some(why) => HostState::Down(why),
        }
    }

    pub fn is_up(&self) -> bool {
        *self == HostState::Up
    }

    /// Why it is not up (`None`: it is).
    pub fn why_not_up(&self) -> Option<&str> {
        match self {
            HostState::Up => None,
            HostState::Stopped => Some(STOPPED),
            HostState::Down(why) => Some(why),
        }
    }
}

/// A host's row, and the sandboxes the catalog places on it.
#[derive(Debug, Clone, PartialEq)]
pub struct HostRow {
    pub id: String,
    pub machine: String,
    pub root: String,
    pub version: String,
    /// Why new work is refused there (`None`: not drained).
    pub drain: Option<String>,
    pub state: HostState,
    /// Its capacity at the last heartbeat (`types::HostInfo` as JSON).
    pub info: String,
    pub started_at: i64,
    pub heartbeat_at: i64,
    pub deadline_at: i64,
    pub sandboxes: Vec<String>,
}

/// What a heartbeat found in its own row.
#[derive(Debug, Clone, PartialEq)]
pub struct Beat {
    pub drain: Option<String>,
    /// What the row said before this heartbeat: `Down` if another host
    /// had marked this one down (its heartbeat came too late).
    pub was: HostState,
}

/// A host another host found past its deadline.
#[derive(Debug, Clone, PartialEq)]
pub struct DownHost {
    pub id: String,
    pub heartbeat_at: i64,
    /// Its sandboxes, now reported lost.
    pub sandboxes: Vec<String>,
}

pub fn now_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as i64).unwrap_or(0)
}

const COLUMNS: &str = "id, machine, root, version, drain, down, info, started_at, heartbeat_at, deadline_at";

fn host_row(r: &Row<'_>) -> Result<HostRow, SqlError> {
    Ok(HostRow {
        id: r.get(0)?,
        machine: r.get(1)?,
        root: r.get(2)?,
        version: r.get(3)?,
        drain: r.get(4)?,
        state: HostState::from_column(r.get(5)?),
        info: r.get(6)?,
        started_at: r.get(7)?,
        heartbeat_at: r.get(8)?,
        deadline_at: r.get(9)?,
        sandboxes: Vec::new(),
    })
}

impl Db {
    /// The host this connection acts for (`None` until one registers:
    /// rows it writes then belong to no host).
    pub fn host_id(&self) -> Option<&str> {
        self.host.as_deref()
    }

    /// The key of this host's rows in `layer_hydration` ('' before one
    /// registers).
    pub(crate) fn hydration_host(&self) -> &str {
        self.host.as_deref().unwrap_or("")
    }

    /// Act for host `id` (a second connection of a registered daemon).
    pub fn for_host(mut self, id: &str) -> Db {
        self.host = Some(id.to_string());
        self
    }

    /// Register (or re-register after a restart) as `claim.id`: refused
    /// while another daemon (another machine or root) holds that id alive.
    /// Rows made before hosts were recorded become this host's. A drain
    /// set before the restart stays.
    pub fn register_host(&mut self, claim: &HostClaim<'_>) -> Result<HostRow, DbError> {
        let now = now_ms();
        let tx = self.conn.transaction(true).map_err(q("begin host registration"))?;
        let held: Option<HostRow> = tx
            .query_row(&format!("SELECT {COLUMNS} FROM hosts WHERE id = ?1"), params![claim.id], host_row)
            .optional()
            .map_err(q("host row"))?;
        if let Some(h) = held {
            if h.state.is_up() && h.deadline_at > now && (h.machine != claim.machine || h.root != claim.root) {
                return Err(DbError::HostTaken {
                    id: h.id,
                    machine: h.machine,
                    root: h.root,
                    ago_ms: now - h.heartbeat_at,
                });
            }
        }
        tx.execute(
            "INSERT INTO hosts (id, machine, root, version, info, started_at, heartbeat_at, deadline_at) \
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?6, ?7) \
             ON CONFLICT (id) DO UPDATE SET machine = excluded.machine, root = excluded.root, \
             version = excluded.version, info = excluded.info, started_at = excluded.started_at, \
             heartbeat_at = excluded.heartbeat_at, deadline_at = excluded.deadline_at, down = NULL",
            params![claim.id, claim.machine, claim.root, claim.version, claim.info, now, now + claim.deadline_ms],
        )
        .map_err(q("register host"))?;
        for table in ["sandboxes", "snapshots", "idempotency"] {
            tx.execute(&format!("UPDATE {table} SET host = ?1 WHERE host IS NULL"), params![claim.id])
                .map_err(q("claim rows older than hosts"))?;
        }
        tx.execute("UPDATE layer_hydration SET host = ?1 WHERE host = ''", params![claim.id])
            .map_err(q("claim rows older than hosts"))?;
        let row = tx
            .query_row(&format!("SELECT {COLUMNS} FROM hosts WHERE id = ?1"), params![claim.id], host_row)
            .map_err(q("host row"))?;
        tx.commit().map_err(q("commit host registration"))?;
        self.host = Some(claim.id.to_string());
        Ok(row)
    }

    /// Renew this host's deadline and capacity; says whether it is drained
    /// and whether it had been marked down meanwhile (it is up again).
    pub fn heartbeat(&self, info: &str, deadline_ms: i64) -> Result<Beat, DbError> {
        let id = self.host.as_deref().ok_or_else(|| DbError::Invalid("a heartbeat before registering".into()))?;
        let now = now_ms();
        let tx = self.conn.transaction(true).map_err(q("begin heartbeat"))?;
        let (drain, down): (Option<String>, Option<String>) = tx
            .query_row("SELECT drain, down FROM hosts WHERE id = ?1", params![id], |r| Ok((r.get(0)?, r.get(1)?)))
            .map_err(q("own host row"))?;
        tx.execute(
            "UPDATE hosts SET heartbeat_at = ?2, deadline_at = ?3, info = ?4, down = NULL WHERE id = ?1",
            params![id, now, now + deadline_ms, info],
        )
        .map_err(q("heartbeat"))?;
        tx.commit().map_err(q("commit heartbeat"))?;
        Ok(Beat { drain, was: HostState::from_column(down) })
    }

    /// Mark every other host past its deadline down; each is returned
    /// once, with the sandboxes the catalog places on it (lost).
    pub fn mark_hosts_down(&self) -> Result<Vec<DownHost>, DbError> {
        let now = now_ms();
        let tx = self.conn.transaction(true).map_err(q("begin marking hosts down"))?;
        let late: Vec<(String, i64)> = tx
            .query(
                "SELECT id, heartbeat_at FROM hosts WHERE down IS NULL AND deadline_at < ?1 \
                 AND (CAST(?2 AS TEXT) IS NULL OR id != ?2) ORDER BY id",
                params![now, self.host],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .map_err(q("late hosts"))?;
        let mut down = Vec::new();
        for (id, heartbeat_at) in late {
            let why = format!("no heartbeat for {} ms (past its deadline)", now - heartbeat_at);
            tx.execute("UPDATE hosts SET down = ?2 WHERE id = ?1", params![id, why]).map_err(q("mark host down"))?;
            let sandboxes = sandboxes_on(&tx, &id)?;
            down.push(DownHost { id, heartbeat_at, sandboxes });
        }
        tx.commit().map_err(q("commit marking hosts down"))?;
        Ok(down)
    }

    /// This host stops (its sandboxes go on; the next start adopts them).
    pub fn host_stopped(&self) -> Result<(), DbError> {
        let Some(id) = self.host.as_deref() else { return Ok(()) };
        let now = now_ms();
        self.conn
            .execute("UPDATE hosts SET down = ?3, deadline_at = ?2 WHERE id = ?1", params![id, now, STOPPED])
            .map_err(q("record host stop"))
            .map(drop)
    }

    /// Drain host `id` (`Some(reason)`) or end its drain; `None` if there
    /// is no such host.
    pub fn set_host_drain(&self, id: &str, drain: Option<&str>) -> Result<Option<HostRow>, DbError> {
        let n = self
            .conn
            .execute("UPDATE hosts SET drain = ?2 WHERE id = ?1", params![id, drain])
            .map_err(q("drain host"))?;
        if n == 0 {
            return Ok(None);
        }
        self.host(id)
    }

    pub fn host(&self, id: &str) -> Result<Option<HostRow>, DbError> {
        let row = self
            .conn
            .query_row(&format!("SELECT {COLUMNS} FROM hosts WHERE id = ?1"), params![id], host_row)
            .optional()
            .map_err(q("host"))?;
        row.map(|mut h| {
            h.sandboxes = sandboxes_on(&self.conn, &h.id)?;
            Ok(h)
        })
        .transpose()
    }

    pub fn list_hosts(&self) -> Result<Vec<HostRow>, DbError> {
        let mut rows: Vec<HostRow> =
            self.conn.query(&format!("SELECT {COLUMNS} FROM hosts ORDER BY id"), &[], host_row).map_err(q("hosts"))?;
        for h in &mut rows {
            h.sandboxes = sandboxes_on(&self.conn, &h.id)?;
        }
        Ok(rows)
    }
}

impl Db {
    /// Where snapshot `id` is (`None`: no such snapshot).
    pub fn snapshot_place(&self, id: &str) -> Result<Option<Place>, DbError> {
        self.conn
            .query_row("SELECT host, published FROM snapshots WHERE id = ?1", params![id], |r| {
                Ok(Place { host: r.get(0)?, published: r.get(1)? })
            })
            .optional()
            .map_err(q("snapshot place"))
    }

    pub fn set_published(&self, id: &str, reference: &str) -> Result<(), DbError> {
        self.conn
            .execute("UPDATE snapshots SET published = ?2 WHERE id = ?1", params![id, reference])
            .map_err(q("record publication"))
            .map(drop)
    }

    /// What layer `id` is: the blob it was sealed (or pulled) as and its
    /// tar's diff_id, as the catalog records them (`None`: no sealed blob).
    pub fn layer_source(&self, id: &str) -> Result<Option<(Digest, Digest)>, DbError> {
        self.conn
            .query_row(
                "SELECT s.blob_digest, l.diff_id FROM snapshots s JOIN layers l ON l.id = s.layer_id \
                 WHERE s.layer_id = ?1 AND s.blob_digest != '' AND l.diff_id IS NOT NULL \
                 UNION ALL SELECT il.blob_digest, l.diff_id FROM image_layers il JOIN layers l ON l.id = il.layer_id \
                 WHERE il.layer_id = ?1 AND l.diff_id IS NOT NULL LIMIT 1",
                params![id],
                |r| Ok((digest_column(r, 0, false)?, digest_column(r, 1, true)?)),
            )
            .optional()
            .map(|o| o.and_then(|(b, d)| Some((b?, d?))))
            .map_err(q("layer source"))
    }
}

fn sandboxes_on(conn: &super::sql::Conn, host: &str) -> Result<Vec<String>, DbError> {
    conn.query("SELECT id FROM sandboxes WHERE host = ?1 ORDER BY created_at, id", params![host], |r| r.get(0))
        .map_err(q("sandboxes on host"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claim<'a>(id: &'a str, root: &'a str, deadline_ms: i64) -> HostClaim<'a> {
        HostClaim { id, machine: "m", root, version: "0", info: "{}", deadline_ms }
    }

    #[test]
    fn a_live_host_id_is_refused_to_another_daemon_and_a_late_host_is_marked_down_once() {
        let mut db = Db::open_in_memory().unwrap();
        db.register_host(&claim("h1", "/r1", 60_000)).unwrap();
        // The same daemon again (a restart) registers; another root may not.
        db.register_host(&claim("h1", "/r1", 60_000)).unwrap();
        let err = db.register_host(&claim("h1", "/r2", 60_000)).unwrap_err();
        assert!(matches!(&err, DbError::HostTaken { id, root, .. } if id == "h1" && root == "/r1"), "{err}");
        // h2's deadline has passed; h3 (this connection now) finds it.
        db.register_host(&claim("h2", "/r", -1)).unwrap();
        db.register_host(&claim("h3", "/r", 60_000)).unwrap();
        let down = db.mark_hosts_down().unwrap();
        assert_eq!(down.iter().map(|d| d.id.as_str()).collect::<Vec<_>>(), ["h2"]);
        assert!(db.mark_hosts_down().unwrap().is_empty(), "marked down twice");
        let state = db.host("h2").unwrap().unwrap().state;
        assert!(matches!(&state, HostState::Down(why) if why.starts_with("no heartbeat for")), "{state:?}");
        // A down host's id is free for another daemon.
        let row = db.register_host(&claim("h2", "/elsewhere", 60_000)).unwrap();
        assert_eq!((row.state, row.root.as_str()), (HostState::Up, "/elsewhere"));
        // A drain set by another host is what the next heartbeat finds.
        assert!(db.set_host_drain("h2", Some("maintenance")).unwrap().is_some());
        assert!(db.set_host_drain("nope", Some("x")).unwrap().is_none());
        let beat = db.heartbeat("{}", 60_000).unwrap();
        assert_eq!(beat, Beat { drain: Some("maintenance".into()), was: HostState::Up });
        db.host_stopped().unwrap();
        assert_eq!(db.host("h2").unwrap().unwrap().state, HostState::Stopped);
        let beat = db.heartbeat("{}", 60_000).unwrap();
        assert_eq!(beat.was, HostState::Stopped);
        assert_eq!(db.host("h2").unwrap().unwrap().state, HostState::Up);
        assert_eq!(db.list_hosts().unwrap().len(), 3);
    }
}
