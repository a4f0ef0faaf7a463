//! The host as a scheduler sees it: capacity (`GET /v1/info`) and drain.
//! A draining host starts no new sandbox (create, resume, fork, a
//! lineage's resume answer 409 with the reason) while running ones go on
//! (exec, checkpoint, suspend, rollback, rm).

use crate::daemon::{lock, Daemon};
use crate::db::DbError;
use crate::types::{DrainRequest, HostInfo};

impl Daemon {
    pub fn host_info(&self) -> Result<HostInfo, DbError> {
        let (live, used, waiting, draining) = {
            let pool = lock(&self.pool);
            let live: Vec<_> = pool.live.values().cloned().collect();
            (live, pool.live.len() + pool.reserved, pool.queue.len(), pool.draining.clone())
        };
        let memory_allocated = live.iter().filter_map(|s| s.spec.limits.memory).sum();
        let cpus_allocated = live.iter().filter_map(|s| s.spec.limits.cpus).sum();
        let memory_total = memory_total();
        let (store_used_bytes, store_free_bytes) = nix::sys::statvfs::statvfs(self.rt.store.root())
            .map(|v| {
                let f = v.fragment_size();
                ((v.blocks() - v.blocks_free()) * f, v.blocks_available() * f)
            })
            .unwrap_or((0, 0));
        let images = lock(&self.db).list_images()?.into_iter().map(|i| i.name.to_string()).collect();
        let mut layers: Vec<String> = std::fs::read_dir(self.rt.store.layers_dir())
            .map(|rd| rd.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect())
            .unwrap_or_default();
        layers.sort();
        Ok(HostInfo {
            version: env!("CARGO_PKG_VERSION").into(),
            host_id: nix::unistd::gethostname().map(|h| h.to_string_lossy().into_owned()).unwrap_or_default(),
            state: if draining.is_some() { "draining" } else { "ready" }.into(),
            draining_reason: draining,
            slots_used: used,
            slots_max: self.max_sandboxes,
            slots_waiting: waiting,
            memory_allocated,
            memory_total,
            cpus_allocated,
            cpus_total: self.host_cpus,
            store_used_bytes,
            store_free_bytes,
            images,
            layers,
            ready: self.ready_counts().into_iter().collect(),
        })
    }

    /// Start draining (`Some`) or stop (`None`); launches waiting for a
    /// slot are refused too.
    pub fn drain(&self, req: Option<DrainRequest>) -> Result<HostInfo, DbError> {
        {
            let mut pool = lock(&self.pool);
            pool.draining = req.map(|r| r.reason.unwrap_or_else(|| "drained by request".into()));
            match &pool.draining {
                Some(why) => tracing::info!("draining: {why}"),
                None => tracing::info!("drain ended: ready"),
            }
        }
        self.slots.notify_all();
        self.host_info()
    }
}

/// The host's memory, in bytes (0 if /proc/meminfo cannot be read).
pub fn memory_total() -> u64 {
    use procfs::Current;
    procfs::Meminfo::current().map(|m| m.mem_total).unwrap_or(0)
}

/// The CPUs this process may run on.
pub fn cpu_count() -> u64 {
    std::thread::available_parallelism().map_or(1, |n| n.get() as u64)
}
