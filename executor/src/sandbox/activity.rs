//! What the daemon's reaper needs of a live sandbox (`daemon/lifetime.rs`):
//! its lifetime as last set, when it was last used, and how many execs
//! and API calls (a checkpoint, a diff, a copy, an attached session) are
//! using it now.

use std::sync::atomic::{AtomicI64, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use super::Sandbox;
use crate::model::OnTimeout;
use crate::spec::{now_ms, Lifetime};

/// A sandbox's lifetime and use.
#[derive(Debug)]
pub struct Activity {
    lifetime: Mutex<Clock>,
    /// When it was last used (unix ms): an API call naming it, an exec's
    /// start or end.
    last_ms: AtomicI64,
    /// How many times it was used (as `last_ms`), to tell whether it was
    /// used again since its idle timeout was taken.
    uses: AtomicU64,
    /// Execs and API calls using it now ([`Busy`], [`InUse`]).
    busy: AtomicU32,
}

/// The lifetime as last set, and whether the reaper took it (its
/// deadline or idle timeout came and the sandbox is being removed or
/// suspended): one lock, so a renewal and the reaper never both win.
#[derive(Debug)]
struct Clock {
    lifetime: Lifetime,
    taken: bool,
}

impl Activity {
    pub fn new(lifetime: Lifetime) -> Activity {
        Activity {
            lifetime: Mutex::new(Clock { lifetime, taken: false }),
            last_ms: AtomicI64::new(now_ms()),
            uses: AtomicU64::new(0),
            busy: AtomicU32::new(0),
        }
    }
}

/// What the reaper must do with a sandbox now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Due {
    /// Its deadline passed.
    Deadline(OnTimeout),
    /// Nothing used it for its idle timeout; it had been used `uses`
    /// times then ([`Sandbox::begin_idle_stop`]).
    Idle { uses: u64 },
}

/// An exec running in a sandbox: it is busy until this is dropped.
pub struct Busy<'a>(&'a Sandbox);

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        self.0.activity.leave();
    }
}

/// A sandbox an API call looked up (`Daemon::sandbox`): busy, as an exec
/// is, until the call drops it, so an idle suspend never cuts into a call
/// in progress (a checkpoint, a diff, a copy).
pub struct InUse(Arc<Sandbox>);

impl InUse {
    pub fn new(sb: Arc<Sandbox>) -> InUse {
        sb.activity.enter();
        InUse(sb)
    }
}

impl std::ops::Deref for InUse {
    type Target = Arc<Sandbox>;
    fn deref(&self) -> &Arc<Sandbox> {
        &self.0
    }
}

impl Drop for InUse {
    fn drop(&mut self) {
        self.0.activity.leave();
    }
}

impl Sandbox {
    /// Mark it used now (an API call named it).
    pub fn touch(&self) {
        self.activity.touch()
    }

    /// See [`Activity::unused_since`].
    pub(super) fn unused_since(&self, uses: u64) -> bool {
        self.activity.unused_since(uses)
    }

    /// Mark an exec running in it, until the guard is dropped.
    pub fn busy(&self) -> Busy<'_> {
        self.activity.enter();
        Busy(self)
    }

    pub fn lifetime(&self) -> Lifetime {
        self.activity.lifetime()
    }

    /// See [`Activity::renew`].
    pub fn renew(&self, l: Lifetime) -> bool {
        self.activity.renew(l)
    }

    /// See [`Activity::untake`].
    pub fn untake(&self, retry_ms: Option<i64>) {
        self.activity.untake(retry_ms)
    }

    /// See [`Activity::take_due`].
    pub fn take_due(&self, now: i64) -> Option<Due> {
        self.activity.take_due(now)
    }
}

impl Activity {
    fn clock(&self) -> std::sync::MutexGuard<'_, Clock> {
        self.lifetime.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn lifetime(&self) -> Lifetime {
        self.clock().lifetime
    }

    fn touch(&self) {
        self.last_ms.store(now_ms(), Ordering::Release);
        self.uses.fetch_add(1, Ordering::AcqRel);
    }

    /// An exec or a call begins using it: busy, and used now.
    fn enter(&self) {
        self.busy.fetch_add(1, Ordering::AcqRel);
        self.touch();
    }

    /// It ends: used now (the idle clock starts from its end).
    fn leave(&self) {
        self.busy.fetch_sub(1, Ordering::AcqRel);
        self.touch();
    }

    /// Nothing uses it and nothing did since it had been used `uses` times.
    fn unused_since(&self, uses: u64) -> bool {
        self.busy.load(Ordering::Acquire) == 0 && self.uses.load(Ordering::Acquire) == uses
    }

    /// Renew: set a new lifetime unless the reaper took this one already
    /// (then `false`: the sandbox is going, a renewal would be a lie).
    pub fn renew(&self, l: Lifetime) -> bool {
        let mut c = self.clock();
        if c.taken {
            return false;
        }
        c.lifetime = l;
        true
    }

    /// The reaper's action failed: give the sandbox back to it, with a
    /// deadline `retry_ms` from now if it had none (a deadline is kept by
    /// trying again; an idle timeout simply comes again).
    pub fn untake(&self, retry_ms: Option<i64>) {
        let mut c = self.clock();
        c.taken = false;
        if let Some(ms) = retry_ms {
            c.lifetime.deadline_ms.get_or_insert(now_ms() + ms);
        }
    }

    /// What is due at `now` (unix ms), if anything; a deadline first. What
    /// is returned is taken: the deadline is cleared (in memory; the
    /// database keeps it, so a daemon restarted before the action is done
    /// does it), the idle clock restarts, and renewals are refused until
    /// [`Activity::untake`].
    pub fn take_due(&self, now: i64) -> Option<Due> {
        let mut c = self.clock();
        if c.taken {
            return None;
        }
        if c.lifetime.deadline_ms.is_some_and(|d| d <= now) {
            c.lifetime.deadline_ms = None;
            c.taken = true;
            return Some(Due::Deadline(c.lifetime.on_timeout));
        }
        let idle = c.lifetime.idle_timeout?;
        let uses = self.uses.load(Ordering::Acquire);
        let since = now - self.last_ms.load(Ordering::Acquire);
        if self.busy.load(Ordering::Acquire) == 0 && since >= (idle as i64).saturating_mul(1000) {
            self.last_ms.store(now_ms(), Ordering::Release);
            c.taken = true;
            return Some(Due::Idle { uses });
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_taken_deadline_refuses_renewal_until_given_back() {
        let now = now_ms();
        let l = Lifetime { deadline_ms: Some(now - 1), on_timeout: OnTimeout::Remove, idle_timeout: None };
        let a = Activity::new(l);
        assert_eq!(a.take_due(now), Some(Due::Deadline(OnTimeout::Remove)));
        // Taken: nothing is due twice, and a renewal is refused.
        assert_eq!(a.take_due(now + 10_000), None);
        assert!(!a.renew(Lifetime { deadline_ms: Some(now + 60_000), ..l }));
        assert_eq!(a.lifetime().deadline_ms, None);
        // Given back after a failed removal: due again a second later.
        a.untake(Some(1000));
        assert_eq!(a.take_due(now), None);
        assert!(a.take_due(now + 5_000).is_some());
        a.untake(None);
        assert!(a.renew(Lifetime { deadline_ms: Some(now + 60_000), ..l }));
        assert_eq!(a.take_due(now + 5_000), None);
    }

    #[test]
    fn idle_is_due_only_when_no_exec_runs() {
        let now = now_ms();
        let a = Activity::new(Lifetime { deadline_ms: None, on_timeout: OnTimeout::Suspend, idle_timeout: Some(2) });
        assert_eq!(a.take_due(now + 1_000), None);
        a.enter();
        assert_eq!(a.take_due(now + 3_000), None);
        a.leave();
        assert_eq!(a.take_due(now_ms() + 3_000), Some(Due::Idle { uses: 2 }));
        assert!(!a.renew(Lifetime {
            deadline_ms: Some(now + 60_000),
            on_timeout: OnTimeout::Remove,
            idle_timeout: Some(2)
        }));
        // Taken, then used before its suspend stops it: the suspend sees it.
        assert!(a.unused_since(2));
        a.touch();
        assert!(!a.unused_since(2));
        a.untake(None);
        let Some(Due::Idle { uses }) = a.take_due(now_ms() + 3_000) else { panic!("not idle") };
        assert!(a.unused_since(uses));
        a.enter();
        assert!(!a.unused_since(uses), "an exec or a call uses it");
    }
}
