//! What the daemon's reaper needs of a live sandbox (`daemon/lifetime.rs`):
//! its lifetime as last set, when it was last used, and how many execs
//! (buffered or attached) run in it now.

use std::sync::atomic::{AtomicI64, AtomicU32, Ordering};
use std::sync::Mutex;

use super::Sandbox;
use crate::model::OnTimeout;
use crate::spec::{now_ms, Lifetime};

/// A sandbox's lifetime and use.
#[derive(Debug)]
pub struct Activity {
    lifetime: Mutex<Lifetime>,
    /// When it was last used (unix ms): an API call naming it, an exec's
    /// start or end.
    last_ms: AtomicI64,
    /// Execs running in it now.
    busy: AtomicU32,
}

impl Activity {
    pub fn new(lifetime: Lifetime) -> Activity {
        Activity { lifetime: Mutex::new(lifetime), last_ms: AtomicI64::new(now_ms()), busy: AtomicU32::new(0) }
    }
}

/// What the reaper must do with a sandbox now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Due {
    /// Its deadline passed.
    Deadline(OnTimeout),
    /// Nothing used it for its idle timeout.
    Idle,
}

/// An exec running in a sandbox: it is busy until this is dropped.
pub struct Busy<'a>(&'a Sandbox);

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        self.0.activity.busy.fetch_sub(1, Ordering::AcqRel);
        self.0.touch();
    }
}

impl Sandbox {
    /// Mark it used now (an API call named it).
    pub fn touch(&self) {
        self.activity.last_ms.store(now_ms(), Ordering::Release);
    }

    /// Mark an exec running in it, until the guard is dropped.
    pub fn busy(&self) -> Busy<'_> {
        self.activity.busy.fetch_add(1, Ordering::AcqRel);
        self.touch();
        Busy(self)
    }

    pub fn lifetime(&self) -> Lifetime {
        *self.activity.lifetime.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn set_lifetime(&self, l: Lifetime) {
        *self.activity.lifetime.lock().unwrap_or_else(|p| p.into_inner()) = l;
    }

    /// What is due at `now` (unix ms), if anything; a deadline first. What
    /// is returned is taken: the deadline is cleared (in memory; the
    /// database keeps it, so a daemon restarted before the action is done
    /// does it), the idle clock restarts.
    pub fn take_due(&self, now: i64) -> Option<Due> {
        let mut l = self.activity.lifetime.lock().unwrap_or_else(|p| p.into_inner());
        if l.deadline_ms.is_some_and(|d| d <= now) {
            l.deadline_ms = None;
            return Some(Due::Deadline(l.on_timeout));
        }
        let idle = l.idle_timeout?;
        let since = now - self.activity.last_ms.load(Ordering::Acquire);
        if self.activity.busy.load(Ordering::Acquire) == 0 && since >= (idle as i64).saturating_mul(1000) {
            self.touch();
            return Some(Due::Idle);
        }
        None
    }
}
