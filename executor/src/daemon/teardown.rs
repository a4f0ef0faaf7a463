//! Removing a sandbox answers once it can run nothing more; the rest of
//! its teardown runs here, on one thread, off the request path.
//!
//! [`Daemon::remove_sandbox`] deletes the row, queues SIGKILL for PID 1
//! (it cannot be caught or blocked, and the kernel ends every process of
//! the PID namespace with it), moves the sandbox from `live` to `removing`
//! and answers. This thread then waits for the kernel's teardown of its
//! namespaces (the overlay goes with the mount namespace), removes its
//! cgroups and moves its files to `tmp/`. Until then the sandbox keeps its
//! slot (a create that finds only such slots taken waits for one rather
//! than answer 429) and its layers (the collector skips them).
//!
//! One that fails (a process that will not die) is tried again, with
//! backoff, on a thread of its own, keeping its slot and layers meanwhile.
//! A stop waits for every teardown queued. A daemon killed meanwhile
//! leaves a sandbox directory without a row: the next start sweeps it
//! (processes, cgroups, files), as it does a create cut short.

use std::sync::mpsc;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::daemon::{lock, Daemon, Pool};
use crate::sandbox::Sandbox;

/// How long a create that finds every free slot held by a removal waits
/// for one: a teardown ends within the kill's own timeout.
pub(crate) const SLOT_WAIT: Duration = Duration::from_secs(10);

#[derive(Default)]
pub(crate) struct Teardowns {
    queue: Mutex<Option<mpsc::Sender<Arc<Sandbox>>>>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl Daemon {
    /// Start the teardown thread. Without it, a removal tears its sandbox
    /// down before it answers.
    pub fn start_teardown(self: &Arc<Self>) {
        let (tx, rx) = mpsc::channel::<Arc<Sandbox>>();
        let d = self.clone();
        let spawned = super::background("teardown", "removals tear down before they answer", move || {
            for sb in rx {
                if d.try_teardown(&sb).is_err() {
                    d.retry_teardown(sb);
                }
            }
        });
        if let Some(h) = spawned {
            *lock(&self.teardown.queue) = Some(tx);
            *lock(&self.teardown.thread) = Some(h);
        }
    }

    /// Tear down a sandbox already in `removing`: on the teardown thread,
    /// or here and now when there is none (not started, or stopped).
    pub(crate) fn tear_down(&self, sb: Arc<Sandbox>) {
        let queue = lock(&self.teardown.queue);
        let sb = match queue.as_ref() {
            Some(tx) => match tx.send(sb) {
                Ok(()) => return,
                Err(mpsc::SendError(sb)) => sb,
            },
            None => sb,
        };
        drop(queue);
        if self.try_teardown(&sb).is_err() {
            // Stopping (or no thread): the next start sweeps what is left.
            lock(&self.pool).removing.remove(&sb.id);
            self.slots.notify_all();
        }
    }

    /// One attempt; done, the sandbox leaves `removing` (its slot and
    /// layers are free). Every step of `destroy` can be repeated.
    fn try_teardown(&self, sb: &Sandbox) -> Result<(), ()> {
        crate::failpoint::hit("teardown:start");
        if crate::failpoint::fails("teardown:destroy") {
            return Err(());
        }
        if let Err(e) = sb.destroy(&self.rt.store) {
            tracing::warn!("tear down sandbox {}: {}", sb.id, crate::error::chain(&e));
            return Err(());
        }
        lock(&self.pool).removing.remove(&sb.id);
        self.slots.notify_all();
        Ok(())
    }

    /// A teardown that failed (a process that will not die, a cgroup that
    /// will not go) is tried again on a thread of its own, with backoff,
    /// so the others go on; the sandbox keeps its slot and layers until
    /// it is done, since they are still in use. A stop leaves it to the
    /// next start's sweep.
    fn retry_teardown(self: &Arc<Self>, sb: Arc<Sandbox>) {
        let d = self.clone();
        super::background("teardown-retry", "the next daemon start sweeps the sandbox", move || {
            let mut pause = Duration::from_secs(1);
            loop {
                std::thread::sleep(pause);
                crate::failpoint::hit("teardown:retry");
                if d.stopping.load(std::sync::atomic::Ordering::Acquire) || d.try_teardown(&sb).is_ok() {
                    return;
                }
                pause = (pause * 2).min(Duration::from_secs(30));
            }
        });
    }

    /// The pool, once no sandbox being torn down matches `which` (or
    /// [`SLOT_WAIT`] has passed): what it holds (an id, a slot, layers)
    /// is free in moments.
    pub(crate) fn after_removals(&self, which: impl Fn(&Sandbox) -> bool) -> MutexGuard<'_, Pool> {
        let until = Instant::now() + SLOT_WAIT;
        let mut pool = lock(&self.pool);
        while pool.removing.values().any(|s| which(s)) {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            pool = self.slots.wait_timeout(pool, left).map(|(g, _)| g).unwrap_or_else(|p| p.into_inner().0);
        }
        pool
    }

    /// Finish every teardown queued, and tear down any later removal
    /// before it answers (at shutdown).
    pub(crate) fn stop_teardown(&self) {
        drop(lock(&self.teardown.queue).take());
        if let Some(h) = lock(&self.teardown.thread).take() {
            let _ = h.join();
        }
    }
}
