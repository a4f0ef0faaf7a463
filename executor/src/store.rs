//! The on-disk store under the root directory (DESIGN.md "On disk"):
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

use std::collections::HashSet;
use std::path::{Path, PathBuf};

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
    Disk(#[from] crate::disk::DiskError),
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
    let mut h = crate::diff::HashBeside::new(crate::direct::DirectWriter::new(file))?;
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
    /// Blobs and layers put in place (or found there) and not recorded
    /// yet, with how many operations hold each ([`Hold`]).
    holds: std::sync::Arc<std::sync::Mutex<std::collections::HashMap<(Held, String), usize>>>,
}

/// What a [`Hold`] holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Held {
    Blob,
    Layer,
}

/// A blob or layer that an operation has put in place (or found there)
/// and will record or give up: while anyone holds it,
/// [`Store::remove_blob`] and [`Store::remove_layer`] leave it. Both are
/// named by their content, so two checkpoints of the same tree make the
/// same blob and layer, and one that gives up must not delete what the
/// other is recording (nor may an image's removal delete a layer an
/// import is about to list again).
#[must_use]
pub struct Hold<'a> {
    store: &'a Store,
    key: (Held, String),
}

impl Hold<'_> {
    /// The blob's digest hex or the layer's id.
    pub fn id(&self) -> &str {
        &self.key.1
    }

    pub fn is_layer(&self) -> bool {
        self.key.0 == Held::Layer
    }
}

impl Drop for Hold<'_> {
    fn drop(&mut self) {
        let mut holds = self.store.holds();
        if let Some(n) = holds.get_mut(&self.key) {
            *n -= 1;
            if *n == 0 {
                holds.remove(&self.key);
            }
        }
    }
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
        Ok(Store { root, holds: Default::default() })
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
            rw: crate::disk::mount_point(&dir),
            dir,
        }
    }

    /// Create a sandbox's private directories. With a disk cap its upper
    /// and work dirs are on a file system of that size ([`crate::disk`])
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
            if let Err(e) = crate::disk::create(&d.dir, bytes) {
                let _ = remove_tree(&d.dir);
                return Err(StoreError::Disk(e));
            }
            if let Err(e) = std::fs::create_dir(&d.rootfs) {
                let _ = crate::disk::release(&d.dir);
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
        crate::disk::release(&d.dir)?;
        remove_tree(&d.dir)
    }

    /// Remove a sandbox's directories off the caller's path: check for
    /// mounts, rename the directory into `tmp/` (atomic; `tmp/` is swept at
    /// start, so a crash cannot leak it) and delete it on a background thread.
    pub fn discard_sandbox(&self, id: &SandboxId) -> Result<(), StoreError> {
        let d = self.sandbox_dirs(id);
        crate::disk::release(&d.dir)?;
        if let Some(mount) = crate::tree::mounts_under(&d.dir).into_iter().next() {
            return Err(StoreError::StillMounted { path: d.dir, mount });
        }
        let doomed = self.tmp_dir().join(format!("rm-{id}-{:08x}", rand::random::<u32>()));
        match std::fs::rename(&d.dir, &doomed) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            r => r.map_err(io("move to tmp", &d.dir))?,
        }
        std::thread::spawn(move || {
            if let Err(e) = remove_tree(&doomed) {
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
    /// synced first if `durable`. Returns whether it is new (else the
    /// layer already existed and `tmp_layer` is deleted) and the layer held
    /// (see [`Hold`]; keep it until the layer is recorded).
    pub fn commit_layer(&self, tmp_layer: &Path, id: &str, durable: bool) -> Result<(bool, Hold<'_>), StoreError> {
        // Held before it is looked for: a removal that comes later leaves
        // it; one that came earlier has moved it away already.
        let hold = self.hold_layer(id);
        let dst = self.layer_dir(id);
        if dst.exists() {
            remove_tree(tmp_layer)?;
            return Ok((false, hold));
        }
        if durable {
            self.sync_layer(tmp_layer)?;
        }
        match std::fs::rename(tmp_layer, &dst) {
            Ok(()) => Ok((true, hold)),
            // Another import or checkpoint put the same layer in place
            // between the check above and here: content-addressed, so ours
            // is the same; keep theirs.
            Err(e) if matches!(e.raw_os_error(), Some(libc::ENOTEMPTY) | Some(libc::EEXIST)) => {
                remove_tree(tmp_layer)?;
                Ok((false, hold))
            }
            Err(e) => Err(StoreError::Io { step: "rename into place", path: dst, source: e }),
        }
    }

    /// Move layer `id` aside under `tmp/`, unless an operation holds it
    /// ([`Hold`]: that one is about to record it) or it is absent; returns
    /// where it went, to delete with [`remove_tree`]. Call it with the
    /// database locked, right after the database said no row lists the
    /// layer: an operation records its row before it drops its hold, so
    /// the layer is then unlisted and unheld at once, and a commit of the
    /// same layer from then on finds it gone and puts its own in place.
    /// Delete what it returns once the database is unlocked.
    pub fn take_layer_aside(&self, id: &str) -> Result<Option<PathBuf>, StoreError> {
        let dir = self.layer_dir(id);
        if let Some(mount) = crate::tree::mounts_under(&dir).into_iter().next() {
            return Err(StoreError::StillMounted { path: dir, mount });
        }
        let doomed = self.tmp_dir().join(format!("removed-{:016x}", rand::random::<u64>()));
        let holds = self.holds();
        if holds.contains_key(&(Held::Layer, id.to_string())) {
            return Ok(None);
        }
        match std::fs::rename(&dir, &doomed) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(StoreError::Io { step: "move aside", path: dir, source: e }),
            Ok(()) => Ok(Some(doomed)),
        }
    }

    /// Remove `layers` and `blobs` that the database (locked: `locked_db`,
    /// its guard) has just said no row lists any more: the layers are moved
    /// aside and the blobs deleted under the lock, which is then dropped,
    /// and the layers deleted. Goes on past a failure; returns the first.
    pub fn remove_orphans<'b, G>(
        &self,
        locked_db: G,
        layers: &[String],
        blobs: impl IntoIterator<Item = &'b str>,
    ) -> Result<(), StoreError> {
        let mut first = Ok(());
        let mut doomed = Vec::new();
        for id in layers {
            match self.take_layer_aside(id) {
                Ok(d) => doomed.extend(d),
                Err(e) => first = first.and(Err(e)),
            }
        }
        for hex in blobs {
            first = first.and(self.remove_blob(hex));
        }
        drop(locked_db);
        for d in doomed {
            first = first.and(remove_tree(&d));
        }
        first
    }

    /// [`Store::take_layer_aside`] and delete it: for a layer no other
    /// operation can list (named by an id this one made), or with the
    /// database locked (which the deletion then holds up).
    pub fn remove_layer(&self, id: &str) -> Result<(), StoreError> {
        match self.take_layer_aside(id)? {
            Some(doomed) => remove_tree(&doomed),
            None => Ok(()),
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
    /// Returns what `produce` returned, the blob held (its digest hex: see
    /// [`Hold`]; keep it until the blob is recorded) and its size. On
    /// error nothing is left.
    pub fn write_blob<T>(
        &self,
        compression: BlobCompression,
        fsync: bool,
        produce: impl FnOnce(&mut dyn std::io::Write) -> std::io::Result<T>,
    ) -> Result<(T, Hold<'_>, u64), StoreError> {
        let tmp = self.new_blob_path();
        let (t, hex, size) = match compress_with(compression, &tmp, fsync, produce) {
            Ok(r) => r,
            Err(source) => {
                let _ = std::fs::remove_file(&tmp);
                return Err(StoreError::Io { step: "write blob", path: tmp, source });
            }
        };
        self.place_blob(&tmp, &hex).map(|hold| (t, hold, size))
    }

    /// A new file for [`Store::place_blob`], under `tmp/`.
    pub fn new_blob_path(&self) -> PathBuf {
        self.tmp_dir().join(format!("blob-{:016x}", rand::random::<u64>()))
    }

    /// Put the blob file `tmp` (under `tmp/`, its sha256 `hex`) in place,
    /// held (see [`Store::write_blob`]). On error `tmp` is removed.
    pub fn place_blob(&self, tmp: &Path, hex: &str) -> Result<Hold<'_>, StoreError> {
        let dst = self.blob_path(hex);
        // Held before it is in place: a removal of the same blob that
        // comes later leaves it.
        let hold = self.hold_blob(hex);
        if let Err(e) = std::fs::rename(tmp, &dst) {
            let _ = std::fs::remove_file(tmp);
            return Err(StoreError::Io { step: "rename blob into place", path: dst, source: e });
        }
        Ok(hold)
    }

    /// Move the verified blob file `src` (under `tmp/`) into `blobs/` as
    /// `digest_hex`, synced first when `durable`. Returns false (and removes
    /// `src`) if the store has it already.
    pub fn adopt_blob(&self, src: &Path, digest_hex: &str, durable: bool) -> Result<bool, StoreError> {
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

    /// Remove blobs no snapshot or image row lists.
    pub fn sweep_blobs(&self, known: &HashSet<String>) -> Result<(), StoreError> {
        let dir = self.root.join("blobs/sha256");
        for entry in std::fs::read_dir(&dir).map_err(io("read", &dir))? {
            let entry = entry.map_err(io("read", &dir))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            if !known.contains(&name) {
                tracing::info!("sweep: removing blob {name}");
                remove_tree(&entry.path())?;
            }
        }
        Ok(())
    }

    fn holds(&self) -> std::sync::MutexGuard<'_, std::collections::HashMap<(Held, String), usize>> {
        self.holds.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn hold(&self, kind: Held, id: &str) -> Hold<'_> {
        let key = (kind, id.to_string());
        *self.holds().entry(key.clone()).or_default() += 1;
        Hold { store: self, key }
    }

    /// Hold blob `digest_hex` (see [`Hold`]).
    pub fn hold_blob(&self, digest_hex: &str) -> Hold<'_> {
        self.hold(Held::Blob, digest_hex)
    }

    /// Hold layer `id` (see [`Hold`]), one this operation found in place
    /// and will list ([`Store::commit_layer`] holds the layers it commits).
    pub fn hold_layer(&self, id: &str) -> Hold<'_> {
        self.hold(Held::Layer, id)
    }

    /// Delete a blob, unless an operation holds it ([`Hold`]): that one
    /// is about to record it.
    pub fn remove_blob(&self, digest_hex: &str) -> Result<(), StoreError> {
        // Under the lock: a hold is either taken before (and the blob
        // stays) or after (and its writer puts the file back in place).
        let holds = self.holds();
        if holds.contains_key(&(Held::Blob, digest_hex.to_string())) {
            return Ok(());
        }
        match std::fs::remove_file(self.blob_path(digest_hex)) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                Err(StoreError::Io { step: "remove blob", path: self.blob_path(digest_hex), source: e })
            }
            _ => Ok(()),
        }
    }

    /// Start-up sweep: empty `tmp/`, and delete layer and sandbox directories
    /// the database does not know (left by a crash between dir and row).
    pub fn sweep(&self, known_layers: &HashSet<String>, known_sandboxes: &HashSet<String>) -> Result<(), StoreError> {
        for (sub, keep) in [("tmp", None), ("layers", Some(known_layers)), ("sandboxes", Some(known_sandboxes))] {
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
                for m in crate::tree::mounts_under(&entry.path()).into_iter().rev() {
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

/// Remove a file or a tree of any depth ([`crate::tree::remove_all`]:
/// sandboxes make the trees), but never through a mount.
pub fn remove_tree(path: &Path) -> Result<(), StoreError> {
    if let Some(mount) = crate::tree::mounts_under(path).into_iter().next() {
        return Err(StoreError::StillMounted { path: path.into(), mount });
    }
    crate::tree::remove_all(path).map_err(io("remove", path))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two writers of the same content hold the same blob; one giving it
    /// up does not remove it while the other holds it.
    #[test]
    fn a_held_blob_is_not_removed() {
        let t = tempfile::tempdir().unwrap();
        let store = Store::open(t.path()).unwrap();
        let write = || store.write_blob(BlobCompression::Zstd, false, |w| w.write_all(b"same")).unwrap();
        let ((), first, _) = write();
        let ((), second, _) = write();
        assert_eq!(first.id(), second.id());
        let hex = first.id().to_string();
        drop(first);
        store.remove_blob(&hex).unwrap();
        assert!(store.blob_path(&hex).is_file(), "removed while the second writer holds it");
        drop(second);
        store.remove_blob(&hex).unwrap();
        assert!(!store.blob_path(&hex).exists());
    }

    #[test]
    fn sweep_keeps_known_and_removes_unknown() {
        let t = tempfile::tempdir().unwrap();
        let s = Store::open(t.path()).unwrap();
        let tmp = s.new_tmp("import").unwrap();
        std::fs::write(tmp.join("f"), b"x").unwrap();
        std::fs::create_dir_all(s.layer_dir("aa").join("fs")).unwrap();
        std::fs::create_dir_all(s.layer_dir("bb").join("fs")).unwrap();
        let id = SandboxId::random();
        s.prepare_sandbox(&id, None, false).unwrap();
        let known: HashSet<String> = ["aa".to_string()].into();
        s.sweep(&known, &HashSet::new()).unwrap();
        assert!(!tmp.exists());
        assert!(s.layer_dir("aa").exists());
        assert!(!s.layer_dir("bb").exists());
        assert!(!s.sandbox_dirs(&id).dir.exists());
    }

    #[test]
    fn commit_layer_is_idempotent() {
        let t = tempfile::tempdir().unwrap();
        let s = Store::open(t.path()).unwrap();
        for expect_new in [true, false] {
            let tmp = s.new_tmp("layer").unwrap();
            std::fs::create_dir(tmp.join("fs")).unwrap();
            assert_eq!(s.commit_layer(&tmp, "cc", true).unwrap().0, expect_new);
            assert!(!tmp.exists());
        }
        assert!(s.layer_dir("cc").join("fs").is_dir());
    }

    /// A checkpoint that put a layer in place and gives up does not
    /// remove it while another one, which found it there, holds it; once
    /// removed, the next commit of the same layer puts its own in place.
    #[test]
    fn a_held_layer_is_not_removed() {
        let t = tempfile::tempdir().unwrap();
        let s = Store::open(t.path()).unwrap();
        let commit = || {
            let tmp = s.new_tmp("layer").unwrap();
            std::fs::create_dir(tmp.join("fs")).unwrap();
            std::fs::write(tmp.join("fs/f"), b"x").unwrap();
            s.commit_layer(&tmp, "dd", false).unwrap()
        };
        let (new, first) = commit();
        let (again, second) = commit();
        assert!(new && !again);
        drop(first);
        s.remove_layer("dd").unwrap();
        assert!(s.layer_dir("dd").join("fs/f").is_file(), "removed while the second committer holds it");
        drop(second);
        s.remove_layer("dd").unwrap();
        assert!(!s.layer_dir("dd").exists());
        assert_eq!(std::fs::read_dir(s.tmp_dir()).unwrap().count(), 0, "left under tmp/");
        let (new, _third) = commit();
        assert!(new && s.layer_dir("dd").join("fs/f").is_file());
        s.remove_layer("absent").unwrap();
    }

    /// Orphans are removed, except a layer an operation holds; a failure
    /// (a "blob" that is a directory cannot be unlinked) does not stop the
    /// rest, and is returned.
    #[test]
    fn orphans_are_removed_past_a_failure_but_held_layers_stay() {
        let t = tempfile::tempdir().unwrap();
        let s = Store::open(t.path()).unwrap();
        for id in ["e1", "e2"] {
            std::fs::create_dir_all(s.layer_dir(id).join("fs")).unwrap();
        }
        let held = s.hold_layer("e2");
        let ((), blob, _) = s.write_blob(BlobCompression::Zstd, false, |w| w.write_all(b"orphan")).unwrap();
        let hex = blob.id().to_string();
        drop(blob);
        let bad = "0".repeat(64);
        std::fs::create_dir_all(s.blob_path(&bad).join("x")).unwrap();
        let guard = std::sync::Mutex::new(());
        let layers = ["e0-absent".to_string(), "e1".to_string(), "e2".to_string()];
        let r = s.remove_orphans(guard.lock().unwrap(), &layers, [bad.as_str(), hex.as_str()]);
        assert!(matches!(r, Err(StoreError::Io { step: "remove blob", .. })), "{r:?}");
        assert!(!s.blob_path(&hex).exists(), "stopped at the failure");
        assert!(!s.layer_dir("e1").exists(), "stopped at the failure");
        assert!(s.layer_dir("e2").join("fs").is_dir(), "a held layer was removed");
        drop(held);
        s.remove_orphans(guard.lock().unwrap(), &layers, []).unwrap();
        assert!(!s.layer_dir("e2").exists());
        assert_eq!(std::fs::read_dir(s.tmp_dir()).unwrap().count(), 0, "left under tmp/");
    }
}
