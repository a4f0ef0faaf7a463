//! Idempotent requests (the scheduler's contract): a POST that creates
//! something (a sandbox, a snapshot, a pull, a baseline) and carries an
//! `Idempotency-Key` runs once. The same key with the same request within
//! 24 h gets the first response again (status and body); with another
//! request, 422. Keys live in the database, so they hold across restarts;
//! a request in flight when a daemon stopped has no response to give, and
//! its key is forgotten at the next start (a retry runs it again).
//!
//! The HTTP side (which requests, the header, the replay) is `api`'s; this
//! is the ledger.

use std::time::{Duration, Instant};

use crate::catalog::{Claim, DbError};
use crate::daemon::{lock, Daemon};

/// How long a request waits for the same request in flight to finish
/// before it is answered 409.
const WAIT_FOR_FIRST: Duration = Duration::from_secs(120);

impl Daemon {
    /// Claim an idempotency key for a request (`fingerprint`: a hash of
    /// it). If the same request is in flight, wait for its response.
    pub fn claim_request(&self, key: &str, fingerprint: &str) -> Result<Claim, DbError> {
        let start = Instant::now();
        loop {
            let claim = lock(&self.db).claim_idempotency_key(key, fingerprint)?;
            if claim != Claim::InFlight || start.elapsed() > WAIT_FOR_FIRST {
                return Ok(claim);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Keep the response to a claimed request, or (`None`: a failure worth
    /// retrying) forget the key.
    pub fn settle_request(&self, key: &str, response: Option<(u16, &[u8])>) {
        if let Err(e) = lock(&self.db).settle_idempotency_key(key, response) {
            tracing::error!("idempotency key {key:?}: {}", crate::error::chain(&e));
        }
    }
}
