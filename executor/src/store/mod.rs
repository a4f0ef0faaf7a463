//! The on-disk store under the root directory (docs/design.md "On disk"):
//!
//! ```text
//! layers/<layer id>/fs       hydrated immutable lowers (id: diff_id hex, or
//!                            s<snapshot id> for a suspended sandbox's upper)
//! sandboxes/<id>/{upper,work,rootfs,shim.sock,shim.log}
//! tmp/                       in-flight imports; swept at start
//! shim/<sha256>/{bin,empty}  the daemon's copy of strata-shim, run from a
//!                            read-only overlay (`sandbox::ShimExe`)
//! ```
//!
//! A path is either finished and immutable or under `tmp/`: layers are
//! unpacked into `tmp/` and renamed into place. The store never mounts (the
//! shim does); it hands out paths. Directories are named by digest or
//! by ids the daemon made, never by user text.

pub mod diff;
pub mod direct;
pub mod disk;
pub mod extents;
pub mod hash;
pub mod layers;
pub mod patch;
pub mod stamps;
pub mod tree;

use std::collections::{BTreeSet, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use crate::ids::SandboxId;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("{step} {path}")]
    Io {
        step: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("refusing to remove {path}: something is still mounted under it ({mount})")]
    StillMounted { path: PathBuf, mount: String },
    #[error("sandbox disk")]
    Disk(#[from] crate::store::disk::DiskError),
}

impl SandboxDirs {
    /// The same sandbox with its upper and work dirs under `rw/`.
    pub fn with_rw(mut self) -> SandboxDirs {
        self.upper = self.rw.join("upper");
        self.work = self.rw.join("work");
        self
    }
}

fn io<'a>(step: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> StoreError + 'a {
    move |source| StoreError::Io { step, path: path.to_path_buf(), source }
}

/// Write what `produce` writes, compressed, into the new file `out`,
/// hashing the compressed bytes; with `fsync`, fsyncs `out` (without, the
/// caller makes it durable later, e.g. with one syncfs for several files).
/// Returns what `produce` returned and the sha256 hex and size of the file.
pub fn compress_with<T>(
    compression: BlobCompression,
    out: &Path,
    fsync: bool,
    produce: impl FnOnce(&mut dyn std::io::Write) -> std::io::Result<T>,
) -> std::io::Result<(T, String, u64)> {
    let file = std::fs::OpenOptions::new().write(true).create_new(true).open(out)?;
    // A blob is written once and read rarely: around the page cache. Its
    // sha256 runs on a thread of its own (1 GiB of random bytes, 2 vCPUs:
    // 0.65-0.87 s, against 0.96-0.99 s hashed on the compressing thread;
    // in a checkpoint, whose walk and hydration keep both cores busy
    // anyway, no difference measured either way).
    let mut h = crate::store::hash::HashBeside::new(crate::store::direct::DirectWriter::new(file))?;
    let t = match compression {
        BlobCompression::Zstd => {
            // One thread: a checkpoint's follower runs beside the frozen
            // capture and then the hydration, so a zstd worker thread
            // would only take a core from them (measured: the blob of a
            // 1 GiB checkpoint 1.5-1.6 s single-threaded, 1.9-2.6 s with
            // one worker, on 2 vCPUs).
            let mut enc = zstd::Encoder::new(&mut h, 1)?;
            let t = produce(&mut enc)?;
            enc.finish()?;
            t
        }
        BlobCompression::Gzip => {
            let mut enc = flate2::write::GzEncoder::new(&mut h, flate2::Compression::fast());
            let t = produce(&mut enc)?;
            enc.finish()?;
            t
        }
    };
    let (inner, hex, n) = h.finish()?;
    let file = inner.finish()?;
    if fsync {
        file.sync_all()?;
    }
    Ok((t, hex, n))
}

/// Compress `tar` into the new file `out` (see [`compress_with`]).
pub fn compress_into(tar: &Path, compression: BlobCompression, out: &Path) -> std::io::Result<(String, u64)> {
    let mut src = std::io::BufReader::with_capacity(1 << 20, std::fs::File::open(tar)?);
    compress_with(compression, out, true, |w| std::io::copy(&mut src, w)).map(|(_, hex, n)| (hex, n))
}

pub use crate::model::BlobCompression;

/// Paths of one sandbox.
#[derive(Debug, Clone)]
pub struct SandboxDirs {
    /// `rw/`: holds upper and work when the sandbox has a disk cap (its own
    /// file system is mounted here) or a user namespace (idmapped as one
    /// tree); unused otherwise.
    pub rw: PathBuf,
    pub dir: PathBuf,
    pub upper: PathBuf,
    pub work: PathBuf,
    pub rootfs: PathBuf,
    pub socket: PathBuf,
    pub log: PathBuf,
}

#[derive(Debug, Clone)]
pub struct Store {
    root: PathBuf,
    /// Which layers and blobs operations hold ([`Lease`]), and which
    /// ones lost their last lease since the collector last looked.
    leases: Arc<Mutex<LeaseTable>>,
}

/// What a lease holds and the collector removes: a layer (by id) or a
/// blob (by its sha256 hex).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Resource {
    Layer(String),
    Blob(String),
}

/// Which layers and blobs a collection looks at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// Those whose last lease ended since the last collection (and those
    /// the caller names).
    Released,
    /// Every one in the store: at start-up (no lease survives a daemon)
    /// and in each `gc`.
    Everything,
}

#[derive(Debug, Default)]
struct LeaseTable {
    /// How many live leases hold each resource.
    held: HashMap<Resource, usize>,
    /// Resources whose last lease ended since the collector last looked:
    /// what it looks at next (besides what a removal names).
    released: BTreeSet<Resource>,
}

/// An operation's claim on the layers and blobs it puts in place or finds
/// there and will record (containerd's leases): while any lease holds one,
/// the collector leaves it, row or no row. Layers and blobs are named by
/// their content, so two checkpoints of the same tree make the same ones,
/// and an operation that fails must not delete what another is
/// recording; so no operation deletes what it wrote. It drops its lease,
/// and the collector ([`Store::remove_unleased`], driven by
/// `Daemon::collect` under the database lock) removes what no row lists
/// and no lease holds. Take the lease before looking for what it names:
/// a removal that comes later then leaves it, one that came earlier has
/// removed it already and the operation puts its own in place.
///
/// Leases live in memory: a daemon that dies drops them all, and the
/// start-up collection removes what no row lists.
#[derive(Debug)]
#[must_use]
pub struct Lease {
    table: Arc<Mutex<LeaseTable>>,
    mine: Mutex<Vec<Resource>>,
}

impl Lease {
    fn add(&self, r: Resource) {
        *lock(&self.table).held.entry(r.clone()).or_default() += 1;
        lock(&self.mine).push(r);
    }

    /// Hold layer `id`.
    pub fn layer(&self, id: &str) {
        self.add(Resource::Layer(id.to_string()));
    }

    /// Hold blob `digest_hex`.
    pub fn blob(&self, digest_hex: &str) {
        self.add(Resource::Blob(digest_hex.to_string()));
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        let mine = std::mem::take(&mut *lock(&self.mine));
        let mut table = lock(&self.table);
        for r in mine {
            if let Some(n) = table.held.get_mut(&r) {
                *n -= 1;
                if *n == 0 {
                    table.held.remove(&r);
                    table.released.insert(r);
                }
            }
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Store {
    /// Open (creating if needed) the store at `root`.
    pub fn open(root: &Path) -> Result<Store, StoreError> {
        // Layers hold setuid files and files of any owner; sandboxes hold
        // uppers the sandbox wrote. Only root may look inside (mode 0700).
        for sub in ["layers", "sandboxes", "tmp", "blobs", "blobs/sha256"] {
            let p = root.join(sub);
            std::fs::create_dir_all(&p).map_err(io("create", &p))?;
            std::fs::set_permissions(&p, std::os::unix::fs::PermissionsExt::from_mode(0o700))
                .map_err(io("chmod 0700", &p))?;
        }
        // The root too: it holds strata.db (exec logs with argv and env)
        // and caches/.
        std::fs::set_permissions(root, std::os::unix::fs::PermissionsExt::from_mode(0o700))
            .map_err(io("chmod 0700", root))?;
        let root = std::fs::canonicalize(root).map_err(io("resolve", root))?;
        Ok(Store { root, leases: Default::default() })
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    pub fn layers_dir(&self) -> PathBuf {
        self.root.join("layers")
    }

    /// `layers/<id>` (the layer's directory; its tree is in `fs/`).
    pub fn layer_dir(&self, id: &str) -> PathBuf {
        self.layers_dir().join(id)
    }

    /// A lower as the shim mounts it: relative to [`Store::layers_dir`], so the
    /// legacy overlay option string stays short.
    pub fn lower_rel(id: &str) -> PathBuf {
        PathBuf::from(id).join("fs")
    }

    pub fn tmp_dir(&self) -> PathBuf {
        self.root.join("tmp")
    }

    /// A fresh, empty directory under `tmp/`.
    pub fn new_tmp(&self, prefix: &str) -> Result<PathBuf, StoreError> {
        let p = self.tmp_dir().join(format!("{prefix}-{:016x}", rand::random::<u64>()));
        std::fs::create_dir(&p).map_err(io("create", &p))?;
        Ok(p)
    }

    pub fn sandbox_dirs(&self, id: &SandboxId) -> SandboxDirs {
        let dir = self.root.join("sandboxes").join(id.as_str());
        SandboxDirs {
            upper: dir.join("upper"),
            work: dir.join("work"),
            rootfs: dir.join("rootfs"),
            socket: dir.join("shim.sock"),
            log: dir.join("shim.log"),
            rw: crate::store::disk::mount_point(&dir),
            dir,
        }
    }

    /// Create a sandbox's private directories. With a disk cap its upper
    /// and work dirs are on a file system of that size ([`crate::store::disk`])
    /// mounted at `rw/`; with `separate_rw` (a user namespace) they are in
    /// a plain `rw/`.
    pub fn prepare_sandbox(
        &self,
        id: &SandboxId,
        disk: Option<u64>,
        separate_rw: bool,
    ) -> Result<SandboxDirs, StoreError> {
        let mut d = self.sandbox_dirs(id);
        std::fs::create_dir(&d.dir).map_err(io("create", &d.dir))?;
        if let Some(bytes) = disk {
            d = d.with_rw();
            if let Err(e) = crate::store::disk::create(&d.dir, bytes) {
                let _ = remove_tree(&d.dir);
                return Err(StoreError::Disk(e));
            }
            if let Err(e) = std::fs::create_dir(&d.rootfs) {
                let _ = crate::store::disk::release(&d.dir);
                let _ = remove_tree(&d.dir);
                return Err(io("create", &d.rootfs)(e));
            }
            return Ok(d);
        }
        if separate_rw {
            d = d.with_rw();
            std::fs::create_dir(&d.rw).map_err(io("create", &d.rw))?;
        }
        for p in [&d.upper, &d.work, &d.rootfs] {
            std::fs::create_dir(p).map_err(io("create", p))?;
        }
        Ok(d)
    }

    /// Remove a sandbox's directories. Refuses while anything is mounted below
    /// them: `remove_dir_all` through a live overlay would write whiteouts,
    /// through a bind mount it would delete someone else's files.
    pub fn remove_sandbox(&self, id: &SandboxId) -> Result<(), StoreError> {
        let d = self.sandbox_dirs(id);
        crate::store::disk::release(&d.dir)?;
        remove_tree(&d.dir)
    }

    /// Remove a sandbox's directories off the caller's path: check for
    /// mounts, rename the directory into `tmp/` (atomic; `tmp/` is swept at
    /// start, so a crash cannot leak it) and delete it on a background thread.
    /// The teardown thread, already off the request path, uses it too: a
    /// thread per tree keeps a large upper's deletion from delaying the
    /// next queued teardown and the slot it frees.
    pub fn discard_sandbox(&self, id: &SandboxId) -> Result<(), StoreError> {
        let d = self.sandbox_dirs(id);
        crate::store::disk::release(&d.dir)?;
        if let Some(mount) = crate::store::tree::mounts_under(&d.dir).into_iter().next() {
            return Err(StoreError::StillMounted { path: d.dir, mount });
        }
        let doomed = self.tmp_dir().join(format!("rm-{id}-{:08x}", rand::random::<u32>()));
        match std::fs::rename(&d.dir, &doomed) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            r => r.map_err(io("move to tmp", &d.dir))?,
        }
        // Checked for mounts above (mounts below a renamed directory move
        // with it), so the thread deletes without reading mountinfo again.
        std::thread::spawn(move || {
            if let Err(e) = crate::store::tree::remove_all(&doomed) {
                tracing::warn!("remove {}: {e}", doomed.display());
            }
        });
        Ok(())
    }

    /// Flush the store's file system: layers, blobs and everything else
    /// written so far (one syncfs, not one fsync per file).
    pub fn sync(&self) -> Result<(), StoreError> {
        self.sync_layer(&self.root)
    }

    /// Flush a layer's file system (syncfs: one call, not one per file).
    pub fn sync_layer(&self, dir: &Path) -> Result<(), StoreError> {
        let f = std::fs::File::open(dir).map_err(io("open", dir))?;
        nix::unistd::syncfs(std::os::fd::AsRawFd::as_raw_fd(&f)).map_err(|e| StoreError::Io {
            step: "sync",
            path: dir.into(),
            source: e.into(),
        })
    }

    /// Move a finished layer from `tmp/` into place as `layers/<id>`,
    /// synced first if `durable`, held by `lease` (keep it until the layer
    /// is recorded). Returns whether it is new (else the layer already
    /// existed and `tmp_layer` is deleted).
    pub fn commit_layer(&self, tmp_layer: &Path, id: &str, durable: bool, lease: &Lease) -> Result<bool, StoreError> {
        // Leased before it is looked for: a collection that comes later
        // leaves it; one that came earlier has moved it away already.
        lease.layer(id);
        let dst = self.layer_dir(id);
        if dst.exists() {
            remove_tree(tmp_layer)?;
            return Ok(false);
        }
        if durable {
            self.sync_layer(tmp_layer)?;
        }
        match std::fs::rename(tmp_layer, &dst) {
            Ok(()) => Ok(true),
            // Another import or checkpoint put the same layer in place
            // between the check above and here: content-addressed, so ours
            // is the same; keep theirs.
            Err(e) if matches!(e.raw_os_error(), Some(libc::ENOTEMPTY) | Some(libc::EEXIST)) => {
                remove_tree(tmp_layer)?;
                Ok(false)
            }
            Err(e) => Err(StoreError::Io { step: "rename into place", path: dst, source: e }),
        }
    }

    /// A new lease (see [`Lease`]).
    pub fn lease(&self) -> Lease {
        Lease { table: self.leases.clone(), mine: Mutex::new(Vec::new()) }
    }

    /// The resources whose last lease ended since this was last called:
    /// the collector's candidates.
    pub fn take_released(&self) -> BTreeSet<Resource> {
        std::mem::take(&mut lock(&self.leases).released)
    }

    /// Every layer and blob in the store: a full collection's candidates.
    pub fn present(&self) -> Result<BTreeSet<Resource>, StoreError> {
        let mut all = BTreeSet::new();
        for (sub, make) in [("layers", Resource::Layer as fn(String) -> Resource), ("blobs/sha256", Resource::Blob)] {
            let dir = self.root.join(sub);
            for entry in std::fs::read_dir(&dir).map_err(io("read", &dir))? {
                let entry = entry.map_err(io("read", &dir))?;
                all.insert(make(entry.file_name().to_string_lossy().into_owned()));
            }
        }
        Ok(all)
    }

    /// The collector's half in the store: remove each of `doomed` (what
    /// the database, locked by the caller, `locked_db` its guard, has just
    /// said no row lists) that no lease holds. Layers are moved aside and
    /// blobs deleted with the lease table locked, so a lease is either
    /// taken before (and the resource stays) or after (and its operation
    /// finds it gone and puts its own in place); then the database is
    /// unlocked and the layers moved aside are deleted. Goes on past a
    /// failure (what fails stays for the next collection); returns how
    /// many it removed (absent ones are not counted), or the first failure.
    pub fn remove_unleased<G>(&self, locked_db: G, doomed: &BTreeSet<Resource>) -> Result<usize, StoreError> {
        let mut first = Ok(());
        let mut aside = Vec::new();
        let mut removed = 0;
        {
            let table = lock(&self.leases);
            for r in doomed {
                if table.held.contains_key(r) {
                    continue;
                }
                // Whether it was there to remove.
                let done = match r {
                    Resource::Layer(id) => self.take_layer_aside(id).map(|d| {
                        let there = d.is_some();
                        aside.extend(d);
                        there
                    }),
                    Resource::Blob(hex) => match std::fs::remove_file(self.blob_path(hex)) {
                        Ok(()) => Ok(true),
                        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
                        Err(e) => Err(StoreError::Io { step: "remove blob", path: self.blob_path(hex), source: e }),
                    },
                };
                match done {
                    Ok(true) => {
                        removed += 1;
                        tracing::info!("collect: removed {r:?}");
                    }
                    Ok(false) => {}
                    Err(e) => first = first.and(Err(e)),
                }
            }
        }
        drop(locked_db);
        for d in aside {
            first = first.and(remove_tree(&d));
        }
        first.map(|()| removed)
    }

    /// Move layer `id` aside under `tmp/` (unless it is absent) and return
    /// where it went, to delete with [`remove_tree`].
    fn take_layer_aside(&self, id: &str) -> Result<Option<PathBuf>, StoreError> {
        let dir = self.layer_dir(id);
        if let Some(mount) = crate::store::tree::mounts_under(&dir).into_iter().next() {
            return Err(StoreError::StillMounted { path: dir, mount });
        }
        let doomed = self.tmp_dir().join(format!("removed-{:016x}", rand::random::<u64>()));
        match std::fs::rename(&dir, &doomed) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(StoreError::Io { step: "move aside", path: dir, source: e }),
            Ok(()) => Ok(Some(doomed)),
        }
    }

    /// `caches/<name>`, created if missing (a lost cache is rebuilt empty).
    pub fn cache_dir(&self, name: &str) -> Result<PathBuf, StoreError> {
        let caches = self.root.join("caches");
        if !caches.exists() {
            std::fs::create_dir(&caches).map_err(io("create", &caches))?;
            // Sandboxes' root writes setuid files and anything else here.
            std::fs::set_permissions(&caches, std::os::unix::fs::PermissionsExt::from_mode(0o700))
                .map_err(io("chmod 0700", &caches))?;
        }
        let p = caches.join(name);
        std::fs::create_dir_all(&p).map_err(io("create cache", &p))?;
        Ok(p)
    }

    /// `blobs/sha256/<hex>`.
    pub fn blob_path(&self, digest_hex: &str) -> PathBuf {
        self.root.join("blobs/sha256").join(digest_hex)
    }

    /// Compress what `produce` writes into the blob store (zstd or gzip at
    /// their fastest levels), hashing as it goes: write under `tmp/`, fsync
    /// (unless the caller will [`Store::sync`] before recording it), rename.
    /// Returns what `produce` returned, the blob's digest hex (held by
    /// `lease`: keep it until the blob is recorded) and its size. On error
    /// nothing is left.
    pub fn write_blob<T>(
        &self,
        compression: BlobCompression,
        fsync: bool,
        lease: &Lease,
        produce: impl FnOnce(&mut dyn std::io::Write) -> std::io::Result<T>,
    ) -> Result<(T, String, u64), StoreError> {
        let tmp = self.new_blob_path();
        let (t, hex, size) = match compress_with(compression, &tmp, fsync, produce) {
            Ok(r) => r,
            Err(source) => {
                let _ = std::fs::remove_file(&tmp);
                return Err(StoreError::Io { step: "write blob", path: tmp, source });
            }
        };
        self.place_blob(&tmp, &hex, lease).map(|()| (t, hex, size))
    }

    /// A new file for [`Store::place_blob`], under `tmp/`.
    pub fn new_blob_path(&self) -> PathBuf {
        self.tmp_dir().join(format!("blob-{:016x}", rand::random::<u64>()))
    }

    /// Put the blob file `tmp` (under `tmp/`, its sha256 `hex`) in place,
    /// held by `lease`. On error `tmp` is removed.
    pub fn place_blob(&self, tmp: &Path, hex: &str, lease: &Lease) -> Result<(), StoreError> {
        let dst = self.blob_path(hex);
        // Leased before it is in place: a collection that comes later
        // leaves it.
        lease.blob(hex);
        if let Err(e) = std::fs::rename(tmp, &dst) {
            let _ = std::fs::remove_file(tmp);
            return Err(StoreError::Io { step: "rename blob into place", path: dst, source: e });
        }
        Ok(())
    }

    /// Move the verified blob file `src` (under `tmp/`) into `blobs/` as
    /// `digest_hex`, synced first when `durable`, held by `lease`. Returns
    /// false (and removes `src`) if the store has it already.
    pub fn adopt_blob(&self, src: &Path, digest_hex: &str, durable: bool, lease: &Lease) -> Result<bool, StoreError> {
        lease.blob(digest_hex);
        let dst = self.blob_path(digest_hex);
        if dst.is_file() {
            let _ = std::fs::remove_file(src);
            return Ok(false);
        }
        if durable {
            std::fs::File::open(src).and_then(|f| f.sync_all()).map_err(io("sync blob", src))?;
        }
        std::fs::rename(src, &dst).map_err(io("rename blob into place", &dst))?;
        Ok(true)
    }

    /// Start-up sweep: empty `tmp/`, and delete sandbox directories the
    /// database does not know (left by a crash between dir and row).
    /// Layers and blobs no row lists are the collector's
    /// (`Daemon::collect`).
    pub fn sweep(&self, known_sandboxes: &HashSet<String>) -> Result<(), StoreError> {
        for (sub, keep) in [("tmp", None), ("sandboxes", Some(known_sandboxes))] {
            let dir = self.root.join(sub);
            for entry in std::fs::read_dir(&dir).map_err(io("read", &dir))? {
                let entry = entry.map_err(io("read", &dir))?;
                let name = entry.file_name().to_string_lossy().into_owned();
                if keep.is_some_and(|k| k.contains(&name)) {
                    continue;
                }
                tracing::info!("sweep: removing {}", entry.path().display());
                // Mounts the daemon made under it and did not undo before a
                // crash: a disk, or the idmapped trees and overlay of a
                // `--userns` root being built (all ours: nothing else mounts
                // in the store).
                for m in crate::store::tree::mounts_under(&entry.path()).into_iter().rev() {
                    tracing::info!("sweep: unmounting {m}");
                    let _ = nix::mount::umount2(m.as_str(), nix::mount::MntFlags::MNT_DETACH);
                }
                // What cannot be removed stays for the next sweep: the
                // daemon starts anyway (a tree it could not remove once
                // kept it from starting at all).
                if let Err(e) = remove_tree(&entry.path()) {
                    tracing::warn!("sweep: could not remove {}: {}", entry.path().display(), crate::error::chain(&e));
                }
            }
        }
        Ok(())
    }
}

/// Remove a file or a tree of any depth ([`crate::store::tree::remove_all`]:
/// sandboxes make the trees), but never through a mount.
pub fn remove_tree(path: &Path) -> Result<(), StoreError> {
    if let Some(mount) = crate::store::tree::mounts_under(path).into_iter().next() {
        return Err(StoreError::StillMounted { path: path.into(), mount });
    }
    crate::store::tree::remove_all(path).map_err(io("remove", path))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn collect(s: &Store, doomed: &[Resource]) -> Result<usize, StoreError> {
        let db = Mutex::new(());
        s.remove_unleased(db.lock().unwrap(), &doomed.iter().cloned().collect())
    }

    /// Two writers of the same content lease the same blob; the first
    /// one's lease ending does not let it be removed while the second's
    /// holds it; the second's ending makes it a candidate.
    #[test]
    fn a_leased_blob_is_not_collected() {
        let t = tempfile::tempdir().unwrap();
        let store = Store::open(t.path()).unwrap();
        let (first, second) = (store.lease(), store.lease());
        let write = |l| store.write_blob(BlobCompression::Zstd, false, l, |w| w.write_all(b"same")).unwrap();
        let ((), hex, _) = write(&first);
        let ((), again, _) = write(&second);
        assert_eq!(hex, again);
        drop(first);
        assert!(store.take_released().is_empty(), "released while the second lease holds it");
        assert_eq!(collect(&store, &[Resource::Blob(hex.clone())]).unwrap(), 0);
        assert!(store.blob_path(&hex).is_file(), "removed while the second writer holds it");
        drop(second);
        assert_eq!(store.take_released(), [Resource::Blob(hex.clone())].into());
        assert_eq!(collect(&store, &[Resource::Blob(hex.clone())]).unwrap(), 1);
        assert!(!store.blob_path(&hex).exists());
    }

    #[test]
    fn sweep_empties_tmp_and_removes_unknown_sandboxes_only() {
        let t = tempfile::tempdir().unwrap();
        let s = Store::open(t.path()).unwrap();
        let tmp = s.new_tmp("import").unwrap();
        std::fs::write(tmp.join("f"), b"x").unwrap();
        std::fs::create_dir_all(s.layer_dir("bb").join("fs")).unwrap();
        let (known, unknown) = (SandboxId::random(), SandboxId::random());
        s.prepare_sandbox(&known, None, false).unwrap();
        s.prepare_sandbox(&unknown, None, false).unwrap();
        s.sweep(&[known.to_string()].into()).unwrap();
        assert!(!tmp.exists());
        assert!(s.layer_dir("bb").exists(), "layers are the collector's");
        assert!(s.sandbox_dirs(&known).dir.exists());
        assert!(!s.sandbox_dirs(&unknown).dir.exists());
        let present = s.present().unwrap();
        assert_eq!(present, [Resource::Layer("bb".into())].into());
    }

    #[test]
    fn commit_layer_is_idempotent() {
        let t = tempfile::tempdir().unwrap();
        let s = Store::open(t.path()).unwrap();
        let lease = s.lease();
        for expect_new in [true, false] {
            let tmp = s.new_tmp("layer").unwrap();
            std::fs::create_dir(tmp.join("fs")).unwrap();
            assert_eq!(s.commit_layer(&tmp, "cc", true, &lease).unwrap(), expect_new);
            assert!(!tmp.exists());
        }
        assert!(s.layer_dir("cc").join("fs").is_dir());
    }

    /// A checkpoint that put a layer in place and fails does not take it
    /// from another one, which found it there and leases it; once
    /// collected, the next commit of the same layer puts its own in place.
    #[test]
    fn a_leased_layer_is_not_collected() {
        let t = tempfile::tempdir().unwrap();
        let s = Store::open(t.path()).unwrap();
        let commit = |lease: &Lease| {
            let tmp = s.new_tmp("layer").unwrap();
            std::fs::create_dir(tmp.join("fs")).unwrap();
            std::fs::write(tmp.join("fs/f"), b"x").unwrap();
            s.commit_layer(&tmp, "dd", false, lease).unwrap()
        };
        let (first, second) = (s.lease(), s.lease());
        assert!(commit(&first) && !commit(&second));
        drop(first);
        let dd = [Resource::Layer("dd".into())];
        assert_eq!(collect(&s, &dd).unwrap(), 0);
        assert!(s.layer_dir("dd").join("fs/f").is_file(), "removed while the second committer leases it");
        drop(second);
        assert_eq!(collect(&s, &dd).unwrap(), 1);
        assert!(!s.layer_dir("dd").exists());
        assert_eq!(std::fs::read_dir(s.tmp_dir()).unwrap().count(), 0, "left under tmp/");
        let third = s.lease();
        assert!(commit(&third) && s.layer_dir("dd").join("fs/f").is_file());
        assert_eq!(collect(&s, &[Resource::Layer("absent".into())]).unwrap(), 0, "nothing to remove");
    }

    /// The collector goes on past a failure (a "blob" that is a directory
    /// cannot be unlinked), returns it, and leaves leased layers.
    #[test]
    fn collection_goes_on_past_a_failure_but_leaves_leased_layers() {
        let t = tempfile::tempdir().unwrap();
        let s = Store::open(t.path()).unwrap();
        for id in ["e1", "e2"] {
            std::fs::create_dir_all(s.layer_dir(id).join("fs")).unwrap();
        }
        let held = s.lease();
        held.layer("e2");
        let gone = s.lease();
        let ((), hex, _) = s.write_blob(BlobCompression::Zstd, false, &gone, |w| w.write_all(b"orphan")).unwrap();
        drop(gone);
        let bad = "0".repeat(64);
        std::fs::create_dir_all(s.blob_path(&bad).join("x")).unwrap();
        let layers = ["e0-absent", "e1", "e2"].map(|l| Resource::Layer(l.into()));
        let blobs = [&bad, &hex].map(|b| Resource::Blob(b.clone()));
        let r = collect(&s, &[&layers[..], &blobs[..]].concat());
        assert!(matches!(r, Err(StoreError::Io { step: "remove blob", .. })), "{r:?}");
        assert!(!s.blob_path(&hex).exists(), "stopped at the failure");
        assert!(!s.layer_dir("e1").exists(), "stopped at the failure");
        assert!(s.layer_dir("e2").join("fs").is_dir(), "a leased layer was removed");
        drop(held);
        collect(&s, &layers).unwrap();
        assert!(!s.layer_dir("e2").exists());
        assert_eq!(std::fs::read_dir(s.tmp_dir()).unwrap().count(), 0, "left under tmp/");
    }
}
