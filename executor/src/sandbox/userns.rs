//! `--userns`: a sandbox in its own user namespace, its root mapped to an
//! unprivileged host range.
//!
//! The shim is cloned with `CLONE_NEWUSER` (its other namespaces are then
//! owned by the new one) and the daemon writes its `uid_map`/`gid_map`:
//! ids `0..65536` inside are `host_id..host_id+65536` on the host. Each
//! sandbox gets its own range, so sandboxes are different users to each
//! other as well as to the host.
//!
//! Layers stay shared and on disk nothing is shifted: the daemon (only the
//! host's root may) makes idmapped mounts of `layers/` and of the sandbox's
//! `rw/` (upper + work) through the shim's user namespace, mounts the root
//! overlay over them in its own namespace, takes a detached copy of that
//! mount, unmounts the rest and sends the copy to the shim, which attaches
//! it as its root. A file owned by 0 in a layer is seen as root inside; a
//! file the sandbox's root creates is stored as 0 in the upper, so
//! checkpoints, diffs and blobs are the same as without `--userns`.
//!
//! Owns: the maps and the idmapped root. Does not own the shim's other
//! mounts (the shim) or the range allocation (the daemon's pool).

#![forbid(unsafe_code)]

use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::mount::{umount2, MntFlags};

use crate::spec::UsernsMap;
use strata_shim::sys;

use crate::store::SandboxDirs;

/// Ids per sandbox: the 16-bit range images assume.
pub const RANGE_SIZE: u32 = 65536;
/// Default first host id of the ranges (`--userns-base`), far above
/// regular and system users.
pub const DEFAULT_BASE: u32 = 1_000_000_000;

#[derive(Debug, thiserror::Error)]
pub enum UsernsError {
    #[error("write {path}")]
    Map {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("open the shim's user namespace")]
    Namespace(#[source] std::io::Error),
    #[error(
        "idmapped mount of {path}: the store's file system or this kernel does not support idmapped mounts \
         (--userns needs Linux >= 5.19 and ext4, xfs, btrfs or tmpfs >= 6.3 under the store)"
    )]
    Idmap {
        path: PathBuf,
        #[source]
        source: Errno,
    },
    #[error("{step} {path}")]
    Mount {
        step: &'static str,
        path: PathBuf,
        #[source]
        source: Errno,
    },
    #[error("mount the root overlay over idmapped layers")]
    Overlay(#[source] sys::MountError),
    #[error("switch a daemon thread to the user namespace range's root ids")]
    FsIds(#[source] Errno),
    #[error("create {path}")]
    Dir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Host range number `slot` of ranges starting at `base`, if it fits in
/// 32-bit ids (the last id, 2^32-1, is the kernel's "invalid").
pub fn range(base: u32, slot: u32) -> Option<UsernsMap> {
    let host_id = u64::from(base) + u64::from(slot) * u64::from(RANGE_SIZE);
    let end = host_id + u64::from(RANGE_SIZE);
    (end < u64::from(u32::MAX)).then_some(UsernsMap { host_id: host_id as u32, size: RANGE_SIZE })
}

/// How many ranges start at `base`.
pub fn slots(base: u32) -> u32 {
    ((u64::from(u32::MAX) - 1 - u64::from(base)) / u64::from(RANGE_SIZE)) as u32
}

/// Users and groups of this host (`/etc/passwd`, `/etc/group`) whose id is
/// inside the ranges starting at `base`: such a user would share ids with
/// a sandbox (and could signal or ptrace its processes). Directory
/// services (LDAP, SSSD id mapping) are not consulted.
pub fn host_ids_in_ranges(base: u32) -> Vec<String> {
    let end = u64::from(base) + u64::from(slots(base)) * u64::from(RANGE_SIZE);
    let mut found = Vec::new();
    for file in ["/etc/passwd", "/etc/group"] {
        let Ok(text) = std::fs::read_to_string(file) else { continue };
        for line in text.lines() {
            let mut f = line.split(':');
            let (Some(name), Some(id)) = (f.next(), f.nth(1)) else { continue };
            if let Ok(id) = id.parse::<u64>() {
                if (u64::from(base)..end).contains(&id) {
                    found.push(format!("{file}: {name} ({id})"));
                }
            }
        }
    }
    found
}

/// Write the shim's uid and gid maps (it waits for its connection until
/// then, as nobody).
pub fn write_maps(pid: i32, map: &UsernsMap) -> Result<(), UsernsError> {
    let line = format!("0 {} {}\n", map.host_id, map.size);
    for file in ["uid_map", "gid_map"] {
        let path = PathBuf::from(format!("/proc/{pid}/{file}"));
        std::fs::write(&path, &line).map_err(|source| UsernsError::Map { path, source })?;
    }
    Ok(())
}

/// Run `f` on a thread of its own whose file system ids are the range's
/// root, with the daemon's capabilities kept (what it creates through an
/// idmapped mount is stored as id 0; as host id 0 it could not be stored,
/// EOVERFLOW) and its own working directory (the legacy overlay mount of
/// kernels before 6.8 chdirs, which must not move the rest of the daemon).
/// No other request ever runs with those ids.
pub fn as_range_root<T: Send>(map: &UsernsMap, f: impl FnOnce() -> T + Send) -> Result<T, Errno> {
    std::thread::scope(|s| {
        s.spawn(|| {
            nix::sched::unshare(nix::sched::CloneFlags::CLONE_FS)?;
            sys::set_thread_fs_ids(map.host_id, map.host_id)?;
            Ok(f())
        })
        .join()
        .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
    })
}

/// Build the sandbox's root overlay over idmapped `layers_dir` and `rw/`
/// (see the module docs) and return it as a detached mount. Nothing stays
/// mounted in the daemon's namespace, on success or error.
pub fn root_tree(
    shim_pid: i32,
    map: &UsernsMap,
    layers_dir: &Path,
    lowers: &[PathBuf],
    dirs: &SandboxDirs,
) -> Result<OwnedFd, UsernsError> {
    let userns = std::fs::File::open(format!("/proc/{shim_pid}/ns/user")).map_err(UsernsError::Namespace)?;
    let staged_layers = dirs.dir.join("idmap-layers");
    let staged_rw = dirs.dir.join("idmap-rw");
    for p in [&staged_layers, &staged_rw] {
        match std::fs::create_dir(p) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(source) => return Err(UsernsError::Dir { path: p.clone(), source }),
        }
    }
    let mut attached: Vec<&Path> = Vec::new();
    let result = (|| {
        for (src, at) in [(layers_dir, &staged_layers), (dirs.rw.as_path(), &staged_rw)] {
            let tree = sys::idmapped_tree(src, userns.as_fd())
                .map_err(|source| UsernsError::Idmap { path: src.to_path_buf(), source })?;
            sys::attach_tree(tree.as_fd(), at).map_err(|source| UsernsError::Mount {
                step: "attach idmapped tree at",
                path: at.clone(),
                source,
            })?;
            attached.push(at);
        }
        // Overlay records its mounter's credentials and creates its work
        // dirs and copies up with them: mounted as the range's root.
        let upper = staged_rw.join("upper");
        let work = staged_rw.join("work");
        let mount =
            sys::OverlayMount { layers_dir: &staged_layers, lowers, upper: &upper, work: &work, target: &dirs.rootfs };
        as_range_root(map, || sys::mount_overlay(&mount)).map_err(UsernsError::FsIds)?.map_err(UsernsError::Overlay)?;
        attached.push(&dirs.rootfs);
        sys::clone_tree(&dirs.rootfs).map_err(|source| UsernsError::Mount {
            step: "take a detached copy of",
            path: dirs.rootfs.clone(),
            source,
        })
    })();
    // The detached copy keeps the overlay (and the overlay its layers).
    for p in attached.iter().rev() {
        if let Err(e) = umount2(*p, MntFlags::MNT_DETACH) {
            tracing::error!("unmount {}: {e}", p.display());
        }
    }
    let _ = std::fs::remove_dir(&staged_layers);
    let _ = std::fs::remove_dir(&staged_rw);
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_are_disjoint_and_fit_in_32_bits() {
        let a = range(DEFAULT_BASE, 0).unwrap();
        let b = range(DEFAULT_BASE, 1).unwrap();
        assert_eq!((a.host_id, b.host_id), (DEFAULT_BASE, DEFAULT_BASE + RANGE_SIZE));
        let n = slots(DEFAULT_BASE);
        assert!(range(DEFAULT_BASE, n - 1).is_some());
        assert!(range(DEFAULT_BASE, n).is_none());
        assert!(u64::from(range(DEFAULT_BASE, n - 1).unwrap().host_id) + u64::from(RANGE_SIZE) < u64::from(u32::MAX));
    }
}
