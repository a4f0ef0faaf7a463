//! `--disk BYTES`: a sandbox's own sized filesystem.
//!
//! The upper and work dirs of a sandbox with a disk cap live on an ext4
//! filesystem of exactly that size: a sparse image file
//! `sandboxes/<id>/disk.img` on a loop device (auto-clearing), mounted at
//! `sandboxes/<id>/rw` in the host's mount namespace before the shim is
//! cloned (so its namespace has it). Writing past the cap gives ENOSPC inside
//! the sandbox; the host's free space drops only by what was written, and
//! other sandboxes are untouched. A sized filesystem rather than a project
//! quota: it works on any host filesystem with sparse files (ext4, xfs,
//! btrfs, tmpfs), while project quotas need ext4/xfs mounted with `prjquota`.
//!
//! Shims cloned while a disk is mounted hold a copy of that mount in their
//! namespace (until their pivot_root drops the host's tree). They do not pin
//! it: removing a sandbox unmounts its disk, then deletes its directory, and
//! the kernel detaches mounts on a deleted mount point in every namespace,
//! so the filesystem and its loop device go at once (tested with a warm
//! shim started after the disk).
//!
//! Owns: the image, the loop device and the mount. Does not own the upper's
//! contents (the store and the captures) or the overlay (the shim).

#![forbid(unsafe_code)]

use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::process::Command;

use nix::errno::Errno;
use nix::mount::{mount, umount2, MntFlags, MsFlags};

/// Smallest cap: ext4's own metadata must fit with room to spare.
pub const MIN_DISK: u64 = 16 << 20;
/// Largest cap accepted (a sanity bound; the image is sparse).
pub const MAX_DISK: u64 = 16 << 40;

#[derive(Debug, thiserror::Error)]
pub enum DiskError {
    #[error("create disk image {path}")]
    Image {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("run mkfs.ext4 (install e2fsprogs)")]
    MkfsSpawn(#[source] std::io::Error),
    #[error("mkfs.ext4 {path} failed: {stderr}")]
    Mkfs { path: PathBuf, stderr: String },
    #[error("attach a loop device for {path} (--disk needs /dev/loop-control and loop devices)")]
    Loop {
        path: PathBuf,
        #[source]
        source: Errno,
    },
    #[error("mount {device} at {target}")]
    Mount {
        device: PathBuf,
        target: PathBuf,
        #[source]
        source: Errno,
    },
    #[error("create {path}")]
    Dir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("unmount {path}")]
    Unmount {
        path: PathBuf,
        #[source]
        source: Errno,
    },
}

/// The mount point of a sandbox dir's disk (`rw/`, which holds the upper
/// and work dirs).
pub fn mount_point(sandbox_dir: &Path) -> PathBuf {
    sandbox_dir.join("rw")
}

/// Make a `bytes`-sized ext4 filesystem for the sandbox dir `dir`, mount it
/// at [`mount_point`] and create `upper/` and `work/` in it. On error
/// nothing stays mounted (the caller removes the dir).
pub fn create(dir: &Path, bytes: u64) -> Result<(), DiskError> {
    let image = dir.join("disk.img");
    let target = mount_point(dir);
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(&image)
        .map_err(|source| DiskError::Image { path: image.clone(), source })?;
    file.set_len(bytes).map_err(|source| DiskError::Image { path: image.clone(), source })?;
    // No journal (a sandbox's upper does not outlive a host crash); lazy
    // inode tables and no discard keep mkfs at a few milliseconds and the
    // image sparse; one inode per 8 KiB so small files run out of bytes
    // before inodes; no reserved blocks (the cap is the sandbox's).
    let out = Command::new("mkfs.ext4")
        .args(["-q", "-F", "-m", "0", "-i", "8192", "-O", "^has_journal"])
        .args(["-E", "lazy_itable_init=1,nodiscard,root_owner=0:0", "-L", "strata-disk"])
        .arg(&image)
        .output()
        .map_err(DiskError::MkfsSpawn)?;
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr).trim().to_string();
        return Err(DiskError::Mkfs { path: image, stderr });
    }
    let (device, dev_fd) = strata_shim::sys::attach_loop(file.as_fd())
        .map_err(|source| DiskError::Loop { path: image.clone(), source })?;
    drop(file);
    std::fs::create_dir(&target).map_err(|source| DiskError::Dir { path: target.clone(), source })?;
    // nosuid/nodev on the host's view; the sandbox sees the files through
    // its overlay, whose own flags apply.
    let flags = MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOATIME;
    mount(Some(device.as_path()), &target, Some("ext4"), flags, None::<&str>).map_err(|source| DiskError::Mount {
        device: device.clone(),
        target: target.clone(),
        source,
    })?;
    // The mount holds the device now; with ours closed it detaches itself
    // on the last unmount.
    drop(dev_fd);
    for sub in ["upper", "work"] {
        let p = target.join(sub);
        if let Err(source) = std::fs::create_dir(&p) {
            let _ = release(dir);
            return Err(DiskError::Dir { path: p, source });
        }
    }
    let _ = std::fs::remove_dir(target.join("lost+found"));
    Ok(())
}

/// Unmount the sandbox dir's disk if it is mounted (idempotent). A shim
/// that is still exiting may hold the filesystem busy: then it is detached
/// lazily and freed (with its loop device) when the last user goes.
pub fn release(dir: &Path) -> Result<(), DiskError> {
    let target = mount_point(dir);
    // Most sandboxes have no `rw/` (and only capped ones mount a disk
    // there): a stat spares removals the read of the mount table.
    if !target.exists() {
        return Ok(());
    }
    while !crate::store::tree::mounts_under(&target).is_empty() {
        match umount2(&target, MntFlags::empty()) {
            Ok(()) => {}
            Err(Errno::EBUSY) => {
                umount2(&target, MntFlags::MNT_DETACH)
                    .map_err(|source| DiskError::Unmount { path: target.clone(), source })?;
            }
            Err(Errno::EINVAL | Errno::ENOENT) => break,
            Err(source) => return Err(DiskError::Unmount { path: target, source }),
        }
    }
    Ok(())
}
