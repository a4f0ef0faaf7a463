//! The warm pool (`--warm-pool N`): shims started ahead of any create
//! (namespaces, cgroup, connection; no image, no limits), so a create pays
//! only for its mounts. With networking on, N more are kept wired: their
//! veth made, addresses and route set, their nft part in with the empty
//! policy, as E2B's network slot pool keeps them. An `egress` create that
//! takes one only fills its policy's sets (nothing for the empty policy)
//! and starts its resolver: none of the netlink and nft work of a network
//! is on its path.
//!
//! Refilling is background work on one thread at nice 19; a wired shim
//! holds an address of the range while it waits. Warm shims have no
//! database row: a stop tears them down (rules and links with them), a
//! kill leaves them to the next start's sweep.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use crate::daemon::{lock, Daemon};
use crate::ids::SandboxId;
use crate::sandbox::{self, Prepared};

#[derive(Default)]
pub(crate) struct WarmPool {
    ready: Mutex<Ready>,
    wake: Condvar,
    stop: AtomicBool,
    /// The refill thread; joined at shutdown so a shim it is preparing is
    /// torn down before the daemon exits.
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

#[derive(Default)]
struct Ready {
    plain: Vec<Prepared>,
    /// A tuple drops in order: the shim (and its namespace) first.
    wired: Vec<(Prepared, crate::net::Wired)>,
}

#[derive(Debug, thiserror::Error)]
enum WarmError {
    #[error("start a warm shim")]
    Sandbox(#[from] crate::sandbox::SandboxError),
    #[error("the warm shim of {0} has no pidfd")]
    NoPidfd(SandboxId),
    #[error("wire a warm shim into the network")]
    Net(#[from] crate::net::NetError),
}

/// A warm shim handed to a create, with its wired slot if it has one.
pub(crate) type Warm = (Prepared, Option<crate::net::Wired>);

impl Daemon {
    /// A warm shim that is still alive, wired if `egress` asks for one
    /// and one is ready (else a plain one: the create wires it); dead ones
    /// are torn down (their drop) and the pool refills.
    pub(crate) fn take_warm(&self, egress: bool) -> Option<Warm> {
        loop {
            let w = {
                let mut ready = lock(&self.warm.ready);
                match ready.wired.pop_if(|_| egress) {
                    Some((p, wired)) => Some((p, Some(wired))),
                    None => ready.plain.pop().map(|p| (p, None)),
                }
            };
            self.warm.wake.notify_one();
            match w {
                Some((p, _)) if !p.is_alive() => {
                    tracing::warn!("warm pool: shim of {} is gone; not used", p.id);
                }
                w => return w,
            }
        }
    }

    /// Keep `cfg.warm_pool` prepared shims ready, and as many wired ones
    /// with networking on, on a background thread.
    pub fn start_warm_pool(self: &Arc<Self>) {
        let n = self.cfg.warm_pool;
        if n == 0 {
            return;
        }
        let d = self.clone();
        let spawned = super::background("warm-pool", "creates start cold shims", move || {
            // Refilling is background work: it must not compete with the
            // creates and execs it exists to speed up (2-core hosts).
            let _ = strata_shim::sys::set_thread_nice(19);
            loop {
                let wire = {
                    let mut ready = lock(&d.warm.ready);
                    loop {
                        if d.warm.stop.load(Ordering::Acquire) {
                            return;
                        }
                        if ready.plain.len() < n {
                            break false;
                        }
                        if d.net.is_some() && ready.wired.len() < n {
                            break true;
                        }
                        ready = d.warm.wake.wait(ready).unwrap_or_else(|p| p.into_inner());
                    }
                };
                match d.prepare_warm(wire) {
                    Ok(_) if d.warm.stop.load(Ordering::Acquire) => return, // dropped: torn down
                    Ok((p, None)) => lock(&d.warm.ready).plain.push(p),
                    Ok((p, Some(w))) => lock(&d.warm.ready).wired.push((p, w)),
                    Err(e) => {
                        tracing::warn!("warm pool: {}", crate::error::chain(&e));
                        std::thread::sleep(std::time::Duration::from_secs(1));
                    }
                }
            }
        });
        *lock(&self.warm.thread) = spawned;
    }

    /// One warm shim; `wire`d into a slot of the range with the empty
    /// policy.
    fn prepare_warm(&self, wire: bool) -> Result<Warm, WarmError> {
        let p = sandbox::prepare(&self.rt, &SandboxId::random(), None, None, None)?;
        let Some(net) = self.net.as_ref().filter(|_| wire) else { return Ok((p, None)) };
        let pidfd = p.pidfd().ok_or_else(|| WarmError::NoPidfd(p.id.clone()))?;
        let wired = net.wire(net.reserve(None)?, pidfd, &crate::net::Policy::default())?;
        Ok((p, Some(wired)))
    }

    /// Stop refilling and tear every warm shim down.
    pub(crate) fn stop_warm_pool(&self) {
        {
            // Under the lock: the refill thread checks `stop` and starts
            // waiting atomically with respect to this, so no wake-up is lost.
            let _ready = lock(&self.warm.ready);
            self.warm.stop.store(true, Ordering::Release);
        }
        self.warm.wake.notify_all();
        if let Some(h) = lock(&self.warm.thread).take() {
            let _ = h.join();
        }
        let drained = std::mem::take(&mut *lock(&self.warm.ready));
        drop(drained);
    }
}
