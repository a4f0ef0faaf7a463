//! Manifests to delete from the fleet registry (migration 18). Removing a
//! published snapshot records its manifest here in the transaction that
//! deletes the snapshot's row, so the deletion outlives a registry that is
//! down, a failed request and a daemon stopped before it got to it: a
//! host whose fleet registry holds it deletes it (`daemon/fleet.rs`), and
//! tries again later on failure. The registry's delete is idempotent, so
//! two hosts doing one row is harmless; a claim keeps it rare.

use rusqlite::params;

use super::{now_ms, q, Db, DbError};

/// One manifest waiting to be deleted.
#[derive(Debug, Clone, PartialEq)]
pub struct ManifestDelete {
    /// `HOST:PORT/REPOSITORY:TAG`, as the snapshot was published.
    pub reference: String,
    /// The removed snapshot it was published for.
    pub snapshot: String,
    /// Failed tries so far.
    pub attempts: i64,
}

/// Migration 18, one text for both engines (SQLite takes `BIGINT` as
/// INTEGER). `next_at`: Unix ms before which no host tries it.
pub(super) const MIGRATION_18: &str = r#"
    CREATE TABLE manifest_deletes (
        reference TEXT PRIMARY KEY,
        snapshot  TEXT NOT NULL,
        attempts  BIGINT NOT NULL DEFAULT 0,
        next_at   BIGINT NOT NULL,
        error     TEXT
    );
"#;

/// Record that `reference` (snapshot `snapshot`'s) is to be deleted, due
/// now; inside the removal's transaction.
pub(super) fn queue(conn: &super::sql::Conn, reference: &str, snapshot: &str) -> Result<(), DbError> {
    conn.execute(
        "INSERT INTO manifest_deletes (reference, snapshot, attempts, next_at) VALUES (?1, ?2, 0, ?3) \
         ON CONFLICT (reference) DO NOTHING",
        params![reference, snapshot, now_ms()],
    )
    .map_err(q("queue a manifest delete"))?;
    Ok(())
}

impl Db {
    /// Up to 100 manifests under `prefix` (`HOST:PORT/REPOSITORY:`) due
    /// for a try, the longest waiting first.
    pub fn due_manifest_deletes(&self, prefix: &str) -> Result<Vec<ManifestDelete>, DbError> {
        self.conn
            .query(
                "SELECT reference, snapshot, attempts FROM manifest_deletes \
                 WHERE substr(reference, 1, length(?1)) = ?1 AND next_at <= ?2 ORDER BY next_at LIMIT 100",
                params![prefix, now_ms()],
                |r| Ok(ManifestDelete { reference: r.get(0)?, snapshot: r.get(1)?, attempts: r.get(2)? }),
            )
            .map_err(q("due manifest deletes"))
    }

    /// Take `m` for a try: no other host tries it before `until` (Unix ms;
    /// what a failure would set, so a host stopped mid-try leaves it due
    /// then). False if another host took it first or it is gone.
    pub fn claim_manifest_delete(&self, m: &ManifestDelete, until: i64) -> Result<bool, DbError> {
        let n = self
            .conn
            .execute(
                "UPDATE manifest_deletes SET next_at = ?3 WHERE reference = ?1 AND attempts = ?2 AND next_at <= ?4",
                params![m.reference, m.attempts, until, now_ms()],
            )
            .map_err(q("claim a manifest delete"))?;
        Ok(n == 1)
    }

    /// `reference` is deleted (or was not there): forget it.
    pub fn manifest_deleted(&self, reference: &str) -> Result<(), DbError> {
        self.conn
            .execute("DELETE FROM manifest_deletes WHERE reference = ?1", params![reference])
            .map_err(q("forget a manifest delete"))?;
        Ok(())
    }

    /// A try of `reference` failed (`error`): one more attempt, next not
    /// before `next_at`.
    pub fn manifest_delete_failed(&self, reference: &str, error: &str, next_at: i64) -> Result<(), DbError> {
        self.conn
            .execute(
                "UPDATE manifest_deletes SET attempts = attempts + 1, error = ?2, next_at = ?3 WHERE reference = ?1",
                params![reference, error, next_at],
            )
            .map_err(q("record a failed manifest delete"))?;
        Ok(())
    }

    /// Every manifest waiting to be deleted, with its last error.
    pub fn manifest_deletes(&self) -> Result<Vec<(ManifestDelete, Option<String>)>, DbError> {
        self.conn
            .query("SELECT reference, snapshot, attempts, error FROM manifest_deletes ORDER BY reference", &[], |r| {
                Ok((ManifestDelete { reference: r.get(0)?, snapshot: r.get(1)?, attempts: r.get(2)? }, r.get(3)?))
            })
            .map_err(q("manifest deletes"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_queued_manifest_delete_is_claimed_once_retried_after_a_failure_and_forgotten_when_done() {
        let db = Db::open_in_memory().unwrap();
        queue(&db.conn, "r:5000/fleet:a", "a").unwrap();
        queue(&db.conn, "r:5000/fleet:a", "a").unwrap();
        queue(&db.conn, "other:5000/fleet:b", "b").unwrap();
        let due = db.due_manifest_deletes("r:5000/fleet:").unwrap();
        assert_eq!(due, [ManifestDelete { reference: "r:5000/fleet:a".into(), snapshot: "a".into(), attempts: 0 }]);
        let later = now_ms() + 60_000;
        assert!(db.claim_manifest_delete(&due[0], later).unwrap());
        assert!(!db.claim_manifest_delete(&due[0], later).unwrap(), "claimed twice");
        assert!(db.due_manifest_deletes("r:5000/fleet:").unwrap().is_empty(), "due while claimed");
        db.manifest_delete_failed("r:5000/fleet:a", "connection refused", now_ms() - 1).unwrap();
        let due = db.due_manifest_deletes("r:5000/fleet:").unwrap();
        assert_eq!(due[0].attempts, 1);
        let stale = ManifestDelete { attempts: 0, ..due[0].clone() };
        assert!(!db.claim_manifest_delete(&stale, later).unwrap(), "claimed from a read before the failure");
        assert!(db.claim_manifest_delete(&due[0], later).unwrap());
        let all = db.manifest_deletes().unwrap();
        assert_eq!(all[1].1.as_deref(), Some("connection refused"));
        db.manifest_deleted("r:5000/fleet:a").unwrap();
        let left: Vec<String> = db.manifest_deletes().unwrap().into_iter().map(|(m, _)| m.reference).collect();
        assert_eq!(left, ["other:5000/fleet:b"], "another registry's stays for its hosts");
    }
}
