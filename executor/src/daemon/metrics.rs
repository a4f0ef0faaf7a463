//! Per-sandbox metrics: CPU, memory and disk, from its cgroup and the
//! filesystem its writes go to. One thread samples every live sandbox each
//! [`INTERVAL`] (E2B's period) and keeps the last [`KEEP`] samples (an
//! hour); a request takes one more, now, so that its CPU share covers at
//! most the last interval. The history lives in memory only: a daemon
//! restart starts it again.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::{lock, Daemon, SandboxOpError};
use crate::ids::SandboxId;
use crate::sandbox::Sandbox;
use crate::spec::now_ms;
use crate::types::SandboxMetrics;

/// How often the sampler takes every sandbox's metrics.
pub const INTERVAL: Duration = Duration::from_secs(5);
/// Samples kept per sandbox.
pub const KEEP: usize = 720;

/// Each live sandbox's samples, oldest first.
#[derive(Default)]
pub struct History(Mutex<HashMap<SandboxId, VecDeque<SandboxMetrics>>>);

impl Daemon {
    /// Start the sampler; it ends once [`Daemon::shutdown`] began.
    pub fn start_metrics(self: &Arc<Self>) {
        let d = self.clone();
        super::background("metrics", "no metrics are sampled", move || {
            let _ = strata_shim::sys::set_thread_nice(10);
            while !d.stopping.load(Ordering::Acquire) {
                d.sample_all();
                std::thread::sleep(INTERVAL);
            }
        });
    }

    fn sample_all(&self) {
        let live: Vec<Arc<Sandbox>> = lock(&self.pool).live.values().cloned().collect();
        let mut samples = Vec::with_capacity(live.len());
        for sb in &live {
            let prev = lock(&self.metrics.0).get(&sb.id).and_then(|h| h.back().cloned());
            samples.push((sb.id.clone(), self.measure(sb, prev.as_ref())));
        }
        let mut history = lock(&self.metrics.0);
        history.retain(|id, _| live.iter().any(|sb| &sb.id == id));
        for (id, m) in samples {
            let h = history.entry(id).or_default();
            if h.len() == KEEP {
                h.pop_front();
            }
            h.push_back(m);
        }
    }

    /// A sample of `sb` now; its CPU share is over the time since `prev`
    /// (else since it started).
    fn measure(&self, sb: &Sandbox, prev: Option<&SandboxMetrics>) -> SandboxMetrics {
        let now = now_ms();
        let usage = sb.usage();
        let cpus = sb.limits().cpus.unwrap_or(self.host_cpus as f64);
        let (since_ms, since_ns) = prev.map_or((sb.created_at * 1000, 0), |p| (p.timestamp, p.cpu_usage_ns));
        let wall_ns = (now - since_ms).max(1) as f64 * 1e6;
        let pct = (usage.cpu_ns.saturating_sub(since_ns) as f64 / (wall_ns * cpus) * 100.0).clamp(0.0, 100.0);
        let dirs = sb.dirs(&self.rt.store);
        let (disk_used, disk_total) = match nix::sys::statvfs::statvfs(&dirs.upper) {
            Ok(v) => {
                let frag = v.fragment_size();
                (v.blocks().saturating_sub(v.blocks_free()) * frag, v.blocks() * frag)
            }
            Err(e) => {
                tracing::debug!("sandbox {}: statvfs {}: {e}", sb.id, dirs.upper.display());
                (0, 0)
            }
        };
        SandboxMetrics {
            timestamp: now,
            cpu_count: cpus.ceil() as u64,
            cpu_used_pct: (pct * 100.0).round() / 100.0,
            cpu_usage_ns: usage.cpu_ns,
            mem_used: usage.memory,
            mem_cache: usage.memory_cache,
            mem_total: sb.limits().memory.unwrap_or_else(super::memory_total),
            disk_used,
            disk_total,
        }
    }

    /// A live sandbox's metrics now. Not a use of it: its idle timeout
    /// goes on.
    pub fn sandbox_metrics(&self, id: &str) -> Result<SandboxMetrics, SandboxOpError> {
        let (sb, kept) = self.metered(id)?;
        Ok(self.measure(&sb, kept.last()))
    }

    /// A live sandbox's samples from `start` to `end` (unix ms, inclusive;
    /// open when `None`), oldest first, the last taken now.
    pub fn sandbox_metrics_between(
        &self,
        id: &str,
        start: Option<i64>,
        end: Option<i64>,
    ) -> Result<Vec<SandboxMetrics>, SandboxOpError> {
        let (sb, mut kept) = self.metered(id)?;
        let now = self.measure(&sb, kept.last());
        kept.push(now);
        kept.retain(|m| start.is_none_or(|s| m.timestamp >= s) && end.is_none_or(|e| m.timestamp <= e));
        Ok(kept)
    }

    /// A live sandbox (not marked in use) and its samples so far.
    fn metered(&self, id: &str) -> Result<(Arc<Sandbox>, Vec<SandboxMetrics>), SandboxOpError> {
        let parsed: SandboxId = id.parse().map_err(|_| SandboxOpError::NotFound(format!("{id:?}")))?;
        let sb = lock(&self.pool).live.get(&parsed).cloned().ok_or_else(|| SandboxOpError::NotFound(id.to_string()))?;
        let kept = lock(&self.metrics.0).get(&parsed).map(|h| h.iter().cloned().collect()).unwrap_or_default();
        Ok((sb, kept))
    }
}
