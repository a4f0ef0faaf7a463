//! Sandbox lifetimes (the scheduler's contract): a deadline after which a
//! sandbox is removed or suspended into its lineage, renewable; an idle
//! timeout after which it is suspended. A scheduler that dies leaks no
//! slot for longer than the timeouts it asked for.
//!
//! The lifetime is part of the sandbox's spec in the database (a renewal
//! rewrites it), so deadlines hold across daemon restarts: an adopted
//! sandbox whose deadline passed while no daemon ran is handled at once.
//! One reaper thread looks every [`TICK`]; each action runs on a thread of
//! its own so a slow suspend does not delay another sandbox's removal.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use crate::daemon::capture::CaptureError;
use crate::daemon::{lock, sandbox_info, Daemon, SandboxOpError};
use crate::model::OnTimeout;
use crate::sandbox::{Due, Sandbox, SandboxError};
use crate::spec::now_ms;
use crate::types::{SandboxInfo, TimeoutRequest};

/// How often the reaper looks.
const TICK: Duration = Duration::from_millis(200);

impl Daemon {
    /// `POST /v1/sandboxes/{id}/timeout`: a new deadline, `timeout`
    /// seconds from now (and a new action, if given); kept in the database.
    /// Refused (409) once the old one came and the sandbox is going: a
    /// scheduler told "renewed" can count on it.
    pub fn set_timeout(&self, id: &str, req: TimeoutRequest) -> Result<SandboxInfo, SandboxOpError> {
        self.renew_deadline(id, req, false)
    }

    /// [`Daemon::set_timeout`] only where it moves the deadline later: a
    /// sandbox whose deadline is further off (or that has none) keeps it,
    /// as E2B's connect does ("the timeout will update only if the new
    /// timeout is longer than the existing one"). A bad timeout is refused
    /// either way.
    pub fn extend_timeout(&self, id: &str, req: TimeoutRequest) -> Result<SandboxInfo, SandboxOpError> {
        self.renew_deadline(id, req, true)
    }

    fn renew_deadline(&self, id: &str, req: TimeoutRequest, only_later: bool) -> Result<SandboxInfo, SandboxOpError> {
        let sb = self.sandbox(id)?;
        let old = sb.lifetime();
        // Unset, the action stays the sandbox's.
        let new = crate::spec::lifetime(Some(req.timeout), req.on_timeout, old.idle_timeout, old.on_timeout)
            .map_err(SandboxOpError::Invalid)?;
        let later = match (old.deadline_ms, new.deadline_ms) {
            (Some(was), Some(now)) => now > was,
            _ => false,
        };
        if only_later && !later {
            return Ok(sandbox_info(&sb));
        }
        if sb.gone().is_set() || !sb.renew(new) {
            return Err(SandboxOpError::Expiring(sb.id.clone()));
        }
        match lock(&self.db).set_sandbox_lifetime(&sb.id, &new) {
            Ok(true) => {}
            // Its row went meanwhile: a removal or suspend began.
            Ok(false) => return Err(SandboxOpError::Expiring(sb.id.clone())),
            Err(e) => {
                sb.renew(old);
                return Err(e.into());
            }
        }
        tracing::info!("sandbox {}: deadline renewed, {} s from now ({})", sb.id, req.timeout, new.on_timeout);
        Ok(sandbox_info(&sb))
    }

    /// Start the reaper thread; it ends once [`Daemon::shutdown`] began.
    pub fn start_reaper(self: &Arc<Self>) {
        let d = self.clone();
        super::background("reaper", "no deadline or idle timeout is acted on", move || loop {
            if d.stopping.load(Ordering::Acquire) {
                return;
            }
            d.reap(now_ms());
            std::thread::sleep(TICK);
        });
    }

    /// Act on every sandbox whose deadline or idle timeout is due at `now`.
    fn reap(self: &Arc<Self>, now: i64) {
        let live: Vec<Arc<Sandbox>> = lock(&self.pool).live.values().cloned().collect();
        for sb in live {
            let Some(due) = sb.take_due(now) else { continue };
            // Not started: given back, a deadline tried again in a second
            // (as a failed action is), an idle suspend after another idle
            // period.
            let retry = matches!(due, Due::Deadline(_)).then_some(1000);
            let (d, taken) = (self.clone(), sb.clone());
            if super::background("expire", "it is tried again", move || d.expire(&taken, due)).is_none() {
                sb.untake(retry);
            }
        }
    }

    /// Remove or suspend a sandbox whose time came, and say so in the log.
    /// Renewals are refused from the moment it was taken; a deadline whose
    /// action fails (the sandbox is in a checkpoint, say) is tried again
    /// in a second.
    fn expire(&self, sb: &Sandbox, due: Due) {
        if self.stopping.load(Ordering::Acquire) {
            return;
        }
        let id = sb.id.to_string();
        let (action, why) = match due {
            Due::Deadline(action) => (action, "its deadline passed"),
            Due::Idle { .. } => (OnTimeout::Suspend, "it was idle for its idle timeout"),
        };
        let idle = match due {
            Due::Idle { uses } => Some(uses),
            Due::Deadline(_) => None,
        };
        if action == OnTimeout::Suspend {
            match self.suspend_sandbox(sb, idle) {
                Ok(snap) => {
                    let wc = snap.work_context.as_deref().unwrap_or("-");
                    tracing::info!("sandbox {id} suspended ({why}) into lineage {wc} as snapshot {}", snap.id);
                    return self.publish_suspend(snap);
                }
                // An idle sandbox that cannot be suspended now is tried
                // again after another idle period; a deadline is kept by
                // removing it.
                Err(CaptureError::Live(SandboxError::UsedAgain(_))) => {
                    sb.untake(None);
                    return tracing::info!("sandbox {id} was used again as its idle suspend began: it stays");
                }
                Err(e) if idle.is_some() => {
                    sb.untake(None);
                    return tracing::warn!("sandbox {id}: idle suspend failed: {}", crate::error::chain(&e));
                }
                Err(e) => tracing::warn!(
                    "sandbox {id}: suspend at its deadline failed ({}); removing it",
                    crate::error::chain(&e)
                ),
            }
        }
        match self.remove_sandbox(&id) {
            Ok(()) => tracing::info!("sandbox {id} removed ({why})"),
            Err(SandboxOpError::NotFound(_)) => {}
            Err(e) => {
                tracing::warn!(
                    "sandbox {id}: removal at its deadline failed ({}); again in 1 s",
                    crate::error::chain(&e)
                );
                sb.untake(Some(1000));
            }
        }
    }
}
