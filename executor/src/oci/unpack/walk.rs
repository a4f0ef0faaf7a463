//! Walking the destination: a path's parents opened one component at a
//! time beneath it (no symlink followed), what a later entry replaces
//! cleared, extended attributes set, and the directories' metadata applied
//! last (their mtimes after their contents).

use std::borrow::Cow;
use std::ffi::CString;
use std::io::{self, Read};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};

use nix::errno::Errno;
use nix::fcntl::AtFlags;
use nix::sys::stat::{self, Mode, SFlag};
use nix::sys::time::TimeSpec;
use nix::unistd::{self, Gid, Uid, UnlinkatFlags};

use super::super::sys;
use super::super::tarpath::{self};
use super::{Existing, Extractor, UnpackError, WalkError};

/// Where xattrs go: an open fd, or a name in a directory (symlinks, FIFOs).
#[derive(Clone, Copy)]
pub(super) enum Target<'f> {
    Fd(BorrowedFd<'f>),
    At(BorrowedFd<'f>, &'f [u8]),
}

/// Only these xattrs are restored: user data, file capabilities, ACLs.
pub(super) fn xattr_allowed(name: &[u8]) -> bool {
    name.starts_with(b"user.")
        || name == b"security.capability"
        || name == b"system.posix_acl_access"
        || name == b"system.posix_acl_default"
}

/// The last component and its parents; callers have checked `comps` is not
/// empty (the root is handled before).
pub(super) fn split<'c>(comps: &'c [&'c [u8]]) -> (&'c [u8], &'c [&'c [u8]]) {
    match comps.split_last() {
        Some((last, parents)) => (last, parents),
        None => (b".", &[]),
    }
}

pub(super) fn link_target<R: Read>(entry: &tar::Entry<'_, R>) -> Vec<u8> {
    entry.link_name_bytes().map(Cow::into_owned).unwrap_or_default()
}

pub(super) fn file_type(mode: libc::mode_t) -> SFlag {
    SFlag::from_bits_truncate(mode & SFlag::S_IFMT.bits())
}

/// Removes `name` in `parent` and everything below it, without following
/// symlinks (each level is opened with `O_NOFOLLOW` and entries are unlinked
/// by name relative to it).
pub(super) fn remove_all_at(parent: BorrowedFd<'_>, name: &[u8]) -> io::Result<()> {
    let fd = sys::open_dir_at(parent, name)?;
    let mut names = Vec::new();
    // `Dir` takes ownership of the fd it reads; give it a duplicate.
    let mut dir = nix::dir::Dir::from(fd.try_clone()?)?;
    for child in dir.iter() {
        let child = child?;
        let n = child.file_name().to_bytes();
        if n != b"." && n != b".." {
            names.push(n.to_vec());
        }
    }
    drop(dir);
    for n in names {
        let st = stat::fstatat(Some(fd.as_raw_fd()), &n[..], AtFlags::AT_SYMLINK_NOFOLLOW)?;
        if file_type(st.st_mode) == SFlag::S_IFDIR {
            remove_all_at(fd.as_fd(), &n)?;
        } else {
            unistd::unlinkat(Some(fd.as_raw_fd()), &n[..], UnlinkatFlags::NoRemoveDir)?;
        }
    }
    unistd::unlinkat(Some(parent.as_raw_fd()), name, UnlinkatFlags::RemoveDir)?;
    Ok(())
}

/// A PAX time (`1700000000.25`, possibly negative) as a `TimeSpec`.
pub(super) fn parse_pax_time(value: &[u8]) -> Option<TimeSpec> {
    let s = std::str::from_utf8(value).ok()?;
    let (int, frac) = s.split_once('.').unwrap_or((s, ""));
    let negative = int.starts_with('-');
    let secs: i64 = int.parse().ok()?;
    if !frac.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let digits: String = frac.chars().chain(std::iter::repeat('0')).take(9).collect();
    let nanos: i64 = digits.parse().ok()?;
    Some(if negative && nanos > 0 {
        TimeSpec::new(secs - 1, 1_000_000_000 - nanos)
    } else {
        TimeSpec::new(secs, nanos)
    })
}

impl Extractor<'_> {
    /// Makes room for a new entry at `comps`: nothing there, or a directory
    /// kept for a new directory, or the old entry removed (recursively for a
    /// directory, whose deferred metadata is then forgotten).
    pub(super) fn clear(
        &mut self,
        parent: BorrowedFd<'_>,
        raw: &[u8],
        comps: &[&[u8]],
        keep_dir: bool,
    ) -> Result<Existing, UnpackError> {
        let (name, _) = split(comps);
        let st = match stat::fstatat(Some(parent.as_raw_fd()), name, AtFlags::AT_SYMLINK_NOFOLLOW) {
            Err(Errno::ENOENT) => return Ok(Existing::Nothing),
            Err(e) => return Err(self.io("inspect", raw, e)),
            Ok(st) => st,
        };
        match file_type(st.st_mode) {
            SFlag::S_IFDIR if keep_dir => Ok(Existing::Dir),
            SFlag::S_IFDIR => {
                // The cached parent may be this directory or below it.
                self.last_parent = None;
                remove_all_at(parent, name).map_err(|e| self.io("remove replaced directory", raw, e))?;
                self.forget_dirs(&tarpath::join(comps));
                Ok(Existing::Other)
            }
            t => {
                unistd::unlinkat(Some(parent.as_raw_fd()), name, UnlinkatFlags::NoRemoveDir)
                    .map_err(|e| self.io("remove replaced entry", raw, e))?;
                Ok(if t == SFlag::S_IFCHR { Existing::Whiteout } else { Existing::Other })
            }
        }
    }

    /// Drops deferred metadata of `key` and everything below it.
    pub(super) fn forget_dirs(&mut self, key: &[u8]) {
        let doomed: Vec<Vec<u8>> = self
            .dirs
            .range(key.to_vec()..)
            .map(|(k, _)| k)
            .take_while(|k| k.starts_with(key))
            .filter(|k| k.len() == key.len() || k[key.len()] == b'/')
            .cloned()
            .collect();
        for k in doomed {
            self.dirs.remove(&k);
        }
    }

    /// The parent directory of an entry, creating missing directories
    /// (mode 0755, as Docker and containerd do for implied parents).
    pub(super) fn walk_entry(&mut self, raw: &[u8], parents: &[&[u8]]) -> Result<OwnedFd, UnpackError> {
        let key = tarpath::join(parents);
        if let Some((cached, fd)) = &self.last_parent {
            if *cached == key {
                return fd.try_clone().map_err(|e| self.io("reuse parent directory of", raw, e));
            }
        }
        let prefix = |i: usize| tarpath::shown(&tarpath::join(&parents[..=i]));
        let fd = self.walk(parents, true).map_err(|e| match e {
            WalkError::Symlink(i) => UnpackError::ThroughSymlink {
                digest: self.digest.clone(),
                path: tarpath::shown(raw),
                symlink: prefix(i),
            },
            WalkError::NotDir(i) | WalkError::Missing(i) => UnpackError::NotADirectory {
                digest: self.digest.clone(),
                path: tarpath::shown(raw),
                component: prefix(i),
            },
            WalkError::Io(step, e) => self.io(step, raw, e),
        })?;
        let copy = fd.try_clone().map_err(|e| self.io("reuse parent directory of", raw, e))?;
        self.last_parent = Some((key, copy));
        Ok(fd)
    }

    /// Opens the directory at `comps` below the root, one component at a
    /// time with `O_NOFOLLOW`, so no symlink is ever followed. With `create`,
    /// missing directories are made, and a whiteout in the way (deleted and
    /// re-created in this layer) becomes an opaque directory.
    pub(super) fn walk(&self, comps: &[&[u8]], create: bool) -> Result<OwnedFd, WalkError> {
        let mut cur = self.root.try_clone().map_err(|e| WalkError::Io("open layer root for", e))?;
        for (i, comp) in comps.iter().enumerate() {
            let dirfd = Some(cur.as_raw_fd());
            cur = match sys::open_dir_at(cur.as_fd(), comp) {
                Ok(fd) => fd,
                Err(Errno::ENOENT) if create => {
                    stat::mkdirat(dirfd, *comp, Mode::from_bits_truncate(0o755))
                        .map_err(|e| WalkError::Io("create parent directory of", e.into()))?;
                    sys::open_dir_at(cur.as_fd(), comp)
                        .map_err(|e| WalkError::Io("open parent directory of", e.into()))?
                }
                Err(Errno::ENOENT) => return Err(WalkError::Missing(i)),
                Err(Errno::ELOOP | Errno::ENOTDIR) => {
                    let st = stat::fstatat(dirfd, *comp, AtFlags::AT_SYMLINK_NOFOLLOW)
                        .map_err(|e| WalkError::Io("inspect parent directory of", e.into()))?;
                    match file_type(st.st_mode) {
                        SFlag::S_IFLNK => return Err(WalkError::Symlink(i)),
                        SFlag::S_IFCHR if create => {
                            let io = |e: Errno| WalkError::Io("replace whiteout on the way to", e.into());
                            unistd::unlinkat(dirfd, *comp, UnlinkatFlags::NoRemoveDir).map_err(io)?;
                            stat::mkdirat(dirfd, *comp, Mode::from_bits_truncate(0o755)).map_err(io)?;
                            let fd = sys::open_dir_at(cur.as_fd(), comp).map_err(io)?;
                            sys::fsetxattr(fd.as_fd(), c"trusted.overlay.opaque", b"y").map_err(io)?;
                            fd
                        }
                        _ => return Err(WalkError::NotDir(i)),
                    }
                }
                Err(e) => return Err(WalkError::Io("open parent directory of", e.into())),
            };
        }
        Ok(cur)
    }

    pub(super) fn set_xattrs(
        &self,
        target: Target<'_>,
        raw: &[u8],
        xattrs: &[(CString, Vec<u8>)],
    ) -> Result<(), UnpackError> {
        for (name, value) in xattrs {
            let result = match target {
                Target::Fd(fd) => sys::fsetxattr(fd, name, value),
                Target::At(dir, entry) => sys::lsetxattr_at(dir, entry, name, value),
            };
            match result {
                Ok(()) => {}
                // Not supported by this file system (or, for user.*, on this
                // file type): skipped, as containerd does.
                Err(Errno::EOPNOTSUPP) => {
                    tracing::warn!(layer = %self.digest, entry = ?tarpath::shown(raw),
                        xattr = ?name, "xattr not supported here; skipped");
                }
                Err(e) => return Err(self.io("set xattr on", raw, e)),
            }
        }
        Ok(())
    }

    /// Applies the deferred owner, mode and mtime of every directory the
    /// layer declared, deepest first (a key sorts before its descendants).
    pub(super) fn finish_dirs(&mut self) -> Result<(), UnpackError> {
        let dirs = std::mem::take(&mut self.dirs);
        for (key, m) in dirs.iter().rev() {
            let comps: Vec<&[u8]> = if key.is_empty() { Vec::new() } else { key.split(|b| *b == b'/').collect() };
            let fd = self.walk(&comps, false).map_err(|e| match e {
                WalkError::Io(step, e) => self.io(step, key, e),
                _ => self.io("reopen directory", key, Errno::ENOENT),
            })?;
            unistd::fchown(fd.as_raw_fd(), Some(Uid::from_raw(m.uid)), Some(Gid::from_raw(m.gid)))
                .map_err(|e| self.io("change owner of", key, e))?;
            stat::fchmod(fd.as_raw_fd(), Mode::from_bits_truncate(m.mode))
                .map_err(|e| self.io("change mode of", key, e))?;
            stat::futimens(fd.as_raw_fd(), &m.mtime, &m.mtime).map_err(|e| self.io("set times of", key, e))?;
        }
        Ok(())
    }
}
