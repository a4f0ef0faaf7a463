//! The collector (containerd's leases and garbage collector): operations
//! lease the layers and blobs they put in place or find there
//! ([`crate::store::Lease`]) and, failing, drop the lease and nothing else;
//! [`Daemon::collect`], the one place that deletes layers and blobs, removes
//! under the database lock those no row lists and no lease holds. It runs
//! when an operation's lease ends ([`Daemon::leased`]), after a removal
//! (with what the removal unlisted), over the whole store at start-up and
//! in every `gc`.

use std::collections::{BTreeSet, HashSet};

use crate::daemon::CollectError;
use crate::daemon::{lock, Daemon};
use crate::store::{Lease, Resource, Scope};

impl Daemon {
    /// Store a sealed suspend's layer once: if another layer holds the
    /// same content, snapshot `id` lists that one and its own `s<id>`
    /// directory goes to the collector. Done only while nothing can be
    /// reading that directory: no live sandbox mounts it and no launch or
    /// read of a snapshot whose chain holds it is in flight (a launch pins
    /// the snapshot it starts from; the caller's own `own_pins` on `id`
    /// aside); otherwise the next `gc` tries again.
    /// Returns whether the snapshot now shares a layer.
    pub(crate) fn share_layer(&self, id: &crate::ids::SnapshotId, own_pins: usize) -> Result<bool, CollectError> {
        let layer = crate::ids::LayerId::suspended(id);
        let gone = {
            // The database lock is held throughout: a launch pins its
            // snapshot before it reads the chain under this lock, so one
            // pinning later reads the chain as it is after this.
            let mut db = lock(&self.db);
            let pinned: Vec<String> = {
                let pool = lock(&self.pool);
                let mounted = pool.mounting().any(|s| s.spec.layers.contains(&layer));
                if mounted || pool.doomed.contains(id.as_str()) {
                    return Ok(false);
                }
                let other = |p: &String, n: usize| p.as_str() != id.as_str() || n > own_pins;
                pool.pinned.iter().filter(|(p, n)| other(p, **n)).map(|(p, _)| p.clone()).collect()
            };
            for p in pinned {
                if db.snapshot_layer_chain(&p)?.iter().any(|s| s.layer == layer) {
                    return Ok(false);
                }
            }
            // (Layer directories are removed under the database lock,
            // held here: what is there stays while the row changes.)
            let present = |l: &str| self.rt.store.layer_dir(l).join("fs").is_dir();
            db.share_layer(id.as_str(), present).map_err(CollectError::from)?
        };
        let Some(gone) = gone else { return Ok(false) };
        tracing::info!("snapshot {id}: its layer's content is stored already; {gone} goes");
        self.collect(Scope::Released, [Resource::Layer(gone)])?;
        Ok(true)
    }

    /// The store's use by images, snapshots and live sandboxes, and what
    /// a `gc` with the daemon's retention would reclaim now.
    pub fn disk_usage(&self) -> Result<crate::types::DiskUsage, crate::catalog::DbError> {
        use crate::types::{DiskUsage, Reclaimable, Usage};
        let store = &self.rt.store;
        let blob_bytes = |digests: &[String]| -> u64 {
            digests
                .iter()
                .filter_map(|d| d.parse::<crate::oci::Digest>().ok())
                .filter_map(|d| std::fs::metadata(store.blob_path(d.hex())).ok())
                .map(|m| m.len())
                .sum()
        };
        let (u, mut candidates, links) = {
            let db = lock(&self.db);
            let now = crate::catalog::now();
            let cutoff = now.saturating_sub(i64::try_from(self.cfg.retention.as_secs()).unwrap_or(i64::MAX));
            (db.usage()?, db.gc_candidates(cutoff)?, db.snapshot_parents()?)
        };
        let live: Vec<_> = lock(&self.pool).live.values().cloned().collect();
        // As `gc` goes: a candidate a live sandbox runs on stays, as does
        // one with a child that stays; children go first.
        let mut kept: HashSet<String> =
            live.iter().filter_map(|s| s.spec.snapshot.as_ref().map(|i| i.to_string())).collect();
        loop {
            let staying = |id: &String| kept.contains(id) || !candidates.contains(id);
            let blocked: Vec<String> = candidates
                .iter()
                .filter(|c| kept.contains(*c) || links.iter().any(|(child, parent)| parent == *c && staying(child)))
                .cloned()
                .collect();
            if blocked.is_empty() {
                break;
            }
            candidates.retain(|c| !blocked.contains(c));
            kept.extend(blocked);
        }
        // What only they hold.
        let mut reclaim = 0;
        let mut snapshots = Vec::new();
        for id in candidates {
            let db = lock(&self.db);
            let (layer, blob) = db.held_only_by(&id)?;
            reclaim += layer.map(|l| db.layer_size(&l)).transpose()?.unwrap_or(0);
            drop(db);
            reclaim += blob.map(|b| blob_bytes(&[b])).unwrap_or(0);
            if let Ok(id) = id.parse() {
                snapshots.push(id);
            }
        }
        let uppers: u64 = live.iter().map(|sb| allocated(&sb.dirs(store).upper)).sum();
        let (store_used_bytes, store_free_bytes) = nix::sys::statvfs::statvfs(store.root())
            .map(|v| {
                let f = v.fragment_size();
                ((v.blocks() - v.blocks_free()) * f, v.blocks_available() * f)
            })
            .unwrap_or((0, 0));
        Ok(DiskUsage {
            images: Usage { count: u.images, layer_bytes: u.image_layer_bytes, blob_bytes: blob_bytes(&u.image_blobs) },
            snapshots: Usage {
                count: u.snapshots,
                layer_bytes: u.snapshot_layer_bytes,
                blob_bytes: u.snapshot_blob_bytes,
            },
            sandboxes: Usage { count: live.len() as u64, layer_bytes: uppers, blob_bytes: 0 },
            reclaimable: Reclaimable { snapshots, bytes: reclaim },
            store_used_bytes,
            store_free_bytes,
        })
    }

    /// The collector: remove the layers and blobs in `scope` (and `also`)
    /// that no row lists and no lease holds; returns how many it removed.
    /// The rows are read and the files removed under the database lock (a
    /// layer is moved aside under it, and deleted after), so an operation
    /// recording a row is either seen or finds the file gone.
    pub fn collect(&self, scope: Scope, also: impl IntoIterator<Item = Resource>) -> Result<usize, CollectError> {
        let store = &self.rt.store;
        let mut candidates = store.take_released();
        candidates.extend(also);
        if scope == Scope::Everything {
            candidates.extend(store.present()?);
        }
        if candidates.is_empty() {
            return Ok(0);
        }
        // A layer a live sandbox here mounts stays, whatever the rows say
        // (another host sharing the catalog may have removed them). One a
        // removed sandbox mounts until its teardown ends is waited for.
        let layers: HashSet<&str> = candidates
            .iter()
            .filter_map(|r| if let Resource::Layer(id) = r { Some(id.as_str()) } else { None })
            .collect();
        let mounted: HashSet<String> = self
            .after_removals(|s| s.spec.layers.iter().any(|l| layers.contains(l.as_str())))
            .mounting()
            .flat_map(|s| s.spec.layers.iter().map(|l| l.to_string()))
            .collect();
        candidates.retain(|r| !matches!(r, Resource::Layer(id) if mounted.contains(id)));
        let db = lock(&self.db);
        // The few candidates an operation's lease leaves are looked up one
        // by one (a checkpoint's layer and blob: two point queries); the
        // whole store against whole lists.
        let mut doomed = BTreeSet::new();
        if scope == Scope::Everything {
            let layers: HashSet<String> = db.all_layers()?.into_iter().collect();
            let blobs = db.all_blobs()?;
            doomed.extend(candidates.into_iter().filter(|r| match r {
                Resource::Layer(id) => !layers.contains(id),
                Resource::Blob(hex) => !blobs.contains(&format!("sha256:{hex}")),
            }));
        } else {
            for r in candidates {
                let listed = match &r {
                    Resource::Layer(id) => db.layer_exists(id)?,
                    Resource::Blob(hex) => db.blob_listed(&format!("sha256:{hex}"))?,
                };
                if !listed {
                    doomed.insert(r);
                }
            }
        }
        Ok(store.remove_unleased(db, &doomed)?)
    }

    /// Run `op` with a lease on what it puts in place ([`Lease`]); when it
    /// ends, done or failed, the lease ends and the collector looks at what
    /// it held (what a failed operation wrote and no row lists goes; a
    /// collection that fails is logged: the next one retries).
    pub fn leased<T, E>(&self, op: impl FnOnce(&Lease) -> Result<T, E>) -> Result<T, E> {
        let lease = self.rt.store.lease();
        let r = op(&lease);
        drop(lease);
        if let Err(e) = self.collect(Scope::Released, []) {
            tracing::warn!("collect: {}", crate::error::chain(&e));
        }
        r
    }
}

/// Bytes allocated on disk under `dir` (a file with several names counted
/// once; nothing followed). What vanishes meanwhile (a running sandbox
/// writes) is skipped.
fn allocated(dir: &std::path::Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let mut seen = HashSet::new();
    let mut total = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else { continue };
        for e in entries.flatten() {
            let Ok(m) = e.path().symlink_metadata() else { continue };
            if m.nlink() > 1 && !m.is_dir() && !seen.insert((m.dev(), m.ino())) {
                continue;
            }
            total += m.blocks() * 512;
            if m.is_dir() {
                stack.push(e.path());
            }
        }
    }
    total
}
