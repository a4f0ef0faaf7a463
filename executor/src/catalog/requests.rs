//! Idempotent requests (`idempotency`): a key claimed once, settled with
//! its answer, replayed for a day.

use rusqlite::params;

use super::sql::Optional;
use super::{now, q, Db, DbError};

/// How long an idempotency key's response is kept (24 h).
pub const IDEMPOTENCY_SECS: i64 = 24 * 3600;

/// What claiming an idempotency key found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
    /// New: the caller runs the request and settles the key.
    Claimed,
    /// The same request is being run now.
    InFlight,
    /// The same request ran: its response.
    Done { status: u16, body: Vec<u8> },
    /// The key was used with another request.
    Mismatch,
}

impl Db {
    /// Claim `key` for a request whose fingerprint is `fp` (keys older
    /// than `IDEMPOTENCY_SECS` are forgotten first).
    pub fn claim_idempotency_key(&mut self, key: &str, fp: &str) -> Result<Claim, DbError> {
        let tx = self.conn.transaction(true).map_err(q("begin claim"))?;
        tx.execute("DELETE FROM idempotency WHERE created_at < ?1", params![now() - IDEMPOTENCY_SECS])
            .map_err(q("forget old keys"))?;
        let row: Option<(String, Option<u16>, Option<Vec<u8>>)> = tx
            .query_row("SELECT fingerprint, status, body FROM idempotency WHERE key = ?1", params![key], |r| {
                Ok((r.get(0)?, r.get(1)?, r.get(2)?))
            })
            .optional()
            .map_err(q("idempotency key"))?;
        let claim = match row {
            None => {
                tx.execute(
                    "INSERT INTO idempotency (key, fingerprint, created_at, host) VALUES (?1, ?2, ?3, ?4)",
                    params![key, fp, now(), self.host],
                )
                .map_err(q("claim idempotency key"))?;
                Claim::Claimed
            }
            Some((f, _, _)) if f != fp => Claim::Mismatch,
            Some((_, None, _)) => Claim::InFlight,
            Some((_, Some(status), body)) => Claim::Done { status, body: body.unwrap_or_default() },
        };
        tx.commit().map_err(q("commit claim"))?;
        Ok(claim)
    }

    /// Keep the response to a claimed key (`None`: forget the key, so a
    /// retry runs again).
    pub fn settle_idempotency_key(&self, key: &str, response: Option<(u16, &[u8])>) -> Result<(), DbError> {
        match response {
            Some((status, body)) => self
                .conn
                .execute("UPDATE idempotency SET status = ?2, body = ?3 WHERE key = ?1", params![key, status, body])
                .map_err(q("keep response")),
            None => self.conn.execute("DELETE FROM idempotency WHERE key = ?1", params![key]).map_err(q("forget key")),
        }
        .map(drop)
    }

    /// Forget keys whose request was in flight when a daemon stopped.
    pub fn forget_unsettled_keys(&self) -> Result<usize, DbError> {
        self.conn
            .execute(
                "DELETE FROM idempotency WHERE status IS NULL AND (CAST(?1 AS TEXT) IS NULL OR host = ?1)",
                params![self.host],
            )
            .map_err(q("forget unsettled keys"))
    }
}
