//! The shim binary every sandbox runs, out of the sandbox's reach (issue
//! 17, the class of runc's CVE-2019-5736).
//!
//! Between the exec child's clone and its `execve`, and in the shim itself,
//! `/proc/self/exe` is the shim's file. A sandbox whose command resolves to
//! `/proc/self/exe` (a symlink to it, or a `#!/proc/self/exe` script) gets
//! that file executed inside, where its dynamic loader reads the sandbox's
//! `/etc/ld.so.preload`; the preloaded code then opens `/proc/self/exe` and,
//! as the sandbox's root, changes the file: with the installed binary, the
//! host's. So the daemon never runs the installed binary. At start it
//! copies it once into `ROOT/shim/<sha256>/bin/strata-shim` and mounts a
//! detached overlay of that directory with no upper layer
//! ([`sys::readonly_overlay`]); every shim is executed from an `O_PATH`
//! descriptor of the file in that mount. What `/proc/self/exe` leads to
//! inside a sandbox is the overlay's file: overlayfs with no upper refuses
//! every write, chmod, chown and xattr change (EROFS), and no descriptor of
//! the copy underneath can be had through it.
//!
//! Why not runc's sealed memfd: a memfd is copied per sandbox (a shared
//! one could be `fchmod`ed by one sandbox's root to break every later
//! create), costing a few MiB of memory per sandbox and a copy per create;
//! the overlay is shared, costs nothing per create, and refuses metadata
//! changes, which a memfd's seals do not cover. runc 1.2 made the same
//! choice (`libcontainer/dmz`, an overlayfs-backed copy).
//!
//! The shim scripts/build-shim.sh builds is static (musl): it has no
//! dynamic loader to read a preload file at all. The overlay is what
//! protects the file either way (a glibc build works too).
//!
//! Owns: the copy and the mount. Does not own spawning (`create.rs`).

#![forbid(unsafe_code)]

use std::io::Write;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};
use strata_shim::sys;

#[derive(Debug, thiserror::Error)]
pub enum ShimExeError {
    #[error("read strata-shim {0} (scripts/build-shim.sh builds it; --shim names another)")]
    Read(PathBuf, #[source] std::io::Error),
    #[error("copy strata-shim to {0}")]
    Copy(PathBuf, #[source] std::io::Error),
    #[error("mount the read-only overlay the shim runs from")]
    Mount(#[source] sys::MountError),
    #[error("open the shim in its read-only overlay")]
    Open(#[source] nix::Error),
}

/// The shim as every sandbox runs it: a file in a detached read-only
/// overlay, held open as `O_PATH` (which also keeps the mount alive).
#[derive(Debug)]
pub struct ShimExe {
    /// The installed binary it was copied from (for messages).
    pub source: PathBuf,
    exe: OwnedFd,
    /// The detached mount itself: closing its fd would dissolve it (files
    /// open in it keep working, but nothing should depend on that).
    _mount: OwnedFd,
}

impl ShimExe {
    /// Copy `source` under `dir` (`ROOT/shim`) unless an identical copy is
    /// there, drop copies of other versions, and mount the overlay.
    pub fn install(source: &Path, dir: &Path) -> Result<ShimExe, ShimExeError> {
        let bytes = std::fs::read(source).map_err(|e| ShimExeError::Read(source.to_path_buf(), e))?;
        let hex = hex::encode(Sha256::digest(&bytes));
        let version = dir.join(&hex);
        let bin = version.join("bin");
        let file = bin.join("strata-shim");
        // Overlayfs needs two lowers when it has no upper: the second is empty.
        let empty = version.join("empty");
        let copy_err = |p: &Path| {
            let p = p.to_path_buf();
            move |e| ShimExeError::Copy(p, e)
        };
        if !file.is_file() {
            let mut b = std::fs::DirBuilder::new();
            b.recursive(true).mode(0o755);
            b.create(&bin).map_err(copy_err(&bin))?;
            let tmp = bin.join(".strata-shim.tmp");
            let _ = std::fs::remove_file(&tmp);
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o755)
                .open(&tmp)
                .map_err(copy_err(&tmp))?;
            f.write_all(&bytes).map_err(copy_err(&tmp))?;
            f.sync_all().map_err(copy_err(&tmp))?;
            std::fs::rename(&tmp, &file).map_err(copy_err(&file))?;
        }
        std::fs::DirBuilder::new().recursive(true).mode(0o755).create(&empty).map_err(copy_err(&empty))?;
        // Older versions: a shim still running from one keeps its overlay
        // (and the copy's inode) alive; no new lookup needs the names.
        if let Ok(entries) = std::fs::read_dir(dir) {
            for e in entries.flatten() {
                if e.file_name() != hex.as_str() {
                    if let Err(err) = crate::store::tree::remove_all(&e.path()) {
                        tracing::warn!("remove old shim copy {}: {err}", e.path().display());
                    }
                }
            }
        }
        let mnt = sys::readonly_overlay(&[&bin, &empty]).map_err(ShimExeError::Mount)?;
        let exe = sys::openat(mnt.as_fd(), c"strata-shim", libc::O_PATH, 0).map_err(ShimExeError::Open)?;
        Ok(ShimExe { source: source.to_path_buf(), exe, _mount: mnt })
    }

    /// The descriptor to `execveat` (see `sys::SpawnPlan::exe`).
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.exe.as_fd()
    }
}
