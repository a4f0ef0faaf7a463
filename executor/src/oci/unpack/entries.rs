//! One tar entry of each kind written under the destination, through file
//! descriptors opened beneath it (never a path that could leave it): whiteouts
//! and opaque markers in overlay form, directories, regular and sparse
//! files, symlinks, FIFOs, hard links, and the metadata each takes.

use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::path::Path;

use nix::errno::Errno;
use nix::fcntl::AtFlags;
use nix::sys::stat::{self, FchmodatFlags, Mode, SFlag, UtimensatFlags};
use nix::unistd::{self, Gid, Uid};

use super::super::sys;
use super::super::tarpath::{self, PathError, PATH_MAX};
use super::walk::{file_type, link_target, split, Target};
use super::{DirMeta, Existing, Extractor, Meta, UnpackError, WalkError, MAX_SPARSE_EXTENTS};

impl Extractor<'_> {
    pub(super) fn invalid_whiteout(&self, raw: &[u8]) -> UnpackError {
        UnpackError::InvalidWhiteout { digest: self.digest.clone(), path: tarpath::shown(raw) }
    }

    /// `.wh.<name>`: hides `<name>` of the lower layers. A whiteout applies
    /// to lower layers only (image-spec: "files that are present in the same
    /// layer as a whiteout file can only be hidden by whiteout files in
    /// subsequent layers"), so an entry of this layer already at `<name>` is
    /// kept; a directory there is made opaque, since the lower one is gone.
    pub(super) fn whiteout(&mut self, raw: &[u8], parents: &[&[u8]], name: &[u8]) -> Result<(), UnpackError> {
        if name.is_empty() || name == b"." || name == b".." {
            return Err(self.invalid_whiteout(raw));
        }
        let parent = self.walk_entry(raw, parents)?;
        match stat::fstatat(Some(parent.as_raw_fd()), name, AtFlags::AT_SYMLINK_NOFOLLOW) {
            Err(Errno::ENOENT) => {
                stat::mknodat(Some(parent.as_raw_fd()), name, SFlag::S_IFCHR, Mode::empty(), stat::makedev(0, 0))
                    .map_err(|e| self.io("create whiteout", raw, e))
            }
            Ok(st) if file_type(st.st_mode) == SFlag::S_IFDIR => {
                let dir = sys::open_dir_at(parent.as_fd(), name).map_err(|e| self.io("open", raw, e))?;
                self.set_opaque(dir.as_fd(), raw)
            }
            Ok(_) => Ok(()),
            Err(e) => Err(self.io("inspect", raw, e)),
        }
    }

    pub(super) fn set_opaque(&self, dir: BorrowedFd<'_>, raw: &[u8]) -> Result<(), UnpackError> {
        sys::fsetxattr(dir, c"trusted.overlay.opaque", b"y").map_err(|e| self.io("mark opaque", raw, e))
    }

    pub(super) fn dir(&mut self, raw: &[u8], comps: &[&[u8]], meta: &Meta) -> Result<(), UnpackError> {
        let fd = match comps.split_last() {
            None => self.root.try_clone().map_err(|e| self.io("open", raw, e))?,
            Some((name, parents)) => {
                let parent = self.walk_entry(raw, parents)?;
                let existing = self.clear(parent.as_fd(), raw, comps, true)?;
                if existing != Existing::Dir {
                    // Owner-only until the deferred chmod.
                    stat::mkdirat(Some(parent.as_raw_fd()), *name, Mode::S_IRWXU)
                        .map_err(|e| self.io("create directory", raw, e))?;
                }
                let fd = sys::open_dir_at(parent.as_fd(), name).map_err(|e| self.io("open", raw, e))?;
                if existing == Existing::Whiteout {
                    // Deleted, then re-created in the same layer: the lower
                    // directory's contents must not show through.
                    self.set_opaque(fd.as_fd(), raw)?;
                }
                fd
            }
        };
        self.set_xattrs(Target::Fd(fd.as_fd()), raw, &meta.xattrs)?;
        self.dirs
            .insert(tarpath::join(comps), DirMeta { uid: meta.uid, gid: meta.gid, mode: meta.mode, mtime: meta.mtime });
        Ok(())
    }

    pub(super) fn file<R: Read>(
        &mut self,
        entry: &mut tar::Entry<'_, R>,
        raw: &[u8],
        comps: &[&[u8]],
        meta: &Meta,
    ) -> Result<u64, UnpackError> {
        let (name, parents) = split(comps);
        let parent = self.walk_entry(raw, parents)?;
        self.clear(parent.as_fd(), raw, comps, false)?;
        if let Some(made) = self.prepared.and_then(|p| p(entry.raw_file_position(), entry.size())) {
            return self.link_prepared(entry, raw, parent.as_fd(), name, &made, meta);
        }
        let mut file = sys::create_file_at(parent.as_fd(), name, 0o600).map_err(|e| self.io("create file", raw, e))?;
        let mut written = 0u64;
        loop {
            let n = match entry.read(&mut self.buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(self.stream_error(e)),
            };
            // Runs of zeros become holes: a sparse file in a layer (say a
            // 1 GiB image file) stays sparse on disk instead of being written.
            if self.buf[..n].iter().all(|&b| b == 0) {
                file.seek(SeekFrom::Current(n as i64)).map_err(|e| self.io("seek in file", raw, e))?;
            } else {
                file.write_all(&self.buf[..n]).map_err(|e| self.io("write file", raw, e))?;
            }
            written += n as u64;
        }
        // A hole at the end needs the length set explicitly.
        file.set_len(written).map_err(|e| self.io("set length of", raw, e))?;
        self.stats.bytes += written;
        if written != entry.size() {
            return Err(UnpackError::Truncated { digest: self.digest.clone(), path: tarpath::shown(raw) });
        }
        self.file_meta(&file, raw, meta)?;
        Ok(written)
    }

    /// A GNU sparse file (PAX 1.0): the map, then each extent's bytes
    /// written at its offset; the rest stays holes. Costs what the entry
    /// holds, whatever size it claims. Returns the bytes read.
    pub(super) fn sparse_file<R: Read>(
        &mut self,
        entry: &mut tar::Entry<'_, R>,
        raw: &[u8],
        comps: &[&[u8]],
        meta: &Meta,
    ) -> Result<u64, UnpackError> {
        let size = meta.sparse.unwrap_or_default();
        let (name, parents) = split(comps);
        let parent = self.walk_entry(raw, parents)?;
        self.clear(parent.as_fd(), raw, comps, false)?;
        let (map, mut consumed) = self.sparse_map(entry, raw, size)?;
        let mut file = sys::create_file_at(parent.as_fd(), name, 0o600).map_err(|e| self.io("create file", raw, e))?;
        for (off, len) in map {
            file.seek(SeekFrom::Start(off)).map_err(|e| self.io("seek in file", raw, e))?;
            // Read and written apart, so that each failure says which side.
            let mut left = len;
            while left > 0 {
                let want = self.buf.len().min(left as usize);
                let n = match entry.read(&mut self.buf[..want]) {
                    Ok(0) => {
                        return Err(UnpackError::Truncated { digest: self.digest.clone(), path: tarpath::shown(raw) })
                    }
                    Ok(n) => n,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) => return Err(self.stream_error(e)),
                };
                file.write_all(&self.buf[..n]).map_err(|e| self.io("write file", raw, e))?;
                left -= n as u64;
            }
            consumed += len;
        }
        // Nothing may follow the extents (it would be data no one reads).
        let rest = io::copy(entry, &mut io::sink()).map_err(|e| self.stream_error(e))?;
        if rest != 0 {
            let problem = format!("{rest} bytes follow its last extent");
            return Err(UnpackError::InvalidSparse { digest: self.digest.clone(), path: tarpath::shown(raw), problem });
        }
        file.set_len(size).map_err(|e| self.io("set length of", raw, e))?;
        self.stats.bytes += size;
        self.file_meta(&file, raw, meta)?;
        Ok(consumed)
    }

    /// Read a PAX 1.0 sparse map from the start of the entry's data:
    /// decimal lines (count, then offset and length of each extent),
    /// padded with zeros to a 512-byte block. Extents must be in order,
    /// apart, and inside `size`. Returns the map and the bytes it took.
    pub(super) fn sparse_map<R: Read>(
        &self,
        entry: &mut tar::Entry<'_, R>,
        raw: &[u8],
        size: u64,
    ) -> Result<(Vec<(u64, u64)>, u64), UnpackError> {
        let bad = |problem: String| UnpackError::InvalidSparse {
            digest: self.digest.clone(),
            path: tarpath::shown(raw),
            problem,
        };
        let mut read = 0u64;
        let mut line = Vec::new();
        let mut byte = [0u8; 1];
        let mut number = |entry: &mut tar::Entry<'_, R>| -> Result<u64, UnpackError> {
            line.clear();
            loop {
                match entry.read(&mut byte) {
                    Ok(1) => {}
                    Ok(_) => return Err(bad("its map ends early".into())),
                    Err(e) => return Err(self.stream_error(e)),
                }
                read += 1;
                if byte[0] == b'\n' {
                    break;
                }
                if !byte[0].is_ascii_digit() || line.len() >= 20 {
                    return Err(bad("its map is not decimal lines".into()));
                }
                line.push(byte[0]);
            }
            std::str::from_utf8(&line)
                .ok()
                .and_then(|l| l.parse::<u64>().ok())
                .ok_or_else(|| bad("its map has an empty or too large number".into()))
        };
        let count = number(entry)?;
        if count > MAX_SPARSE_EXTENTS {
            return Err(bad(format!("its map lists {count} extents (at most {MAX_SPARSE_EXTENTS})")));
        }
        let mut map = Vec::with_capacity(count as usize);
        let mut end = 0u64;
        for _ in 0..count {
            let off = number(entry)?;
            let len = number(entry)?;
            match off.checked_add(len) {
                Some(e) if off >= end && e <= size => end = e,
                _ => return Err(bad(format!("extent {off}+{len} overlaps or passes its size {size}"))),
            }
            map.push((off, len));
        }
        let _ = &mut number;
        let pad = (512 - read % 512) % 512;
        let mut zeros = [0u8; 512];
        entry.read_exact(&mut zeros[..pad as usize]).map_err(|e| self.stream_error(e))?;
        if zeros.iter().any(|&b| b != 0) {
            return Err(bad("its map's padding is not zeros".into()));
        }
        Ok((map, read + pad))
    }

    /// A regular file whose content was made ahead ([`Prepared`]): linked
    /// in; its data is read from the stream only for the digest.
    pub(super) fn link_prepared<R: Read>(
        &mut self,
        entry: &mut tar::Entry<'_, R>,
        raw: &[u8],
        parent: BorrowedFd<'_>,
        name: &[u8],
        made: &Path,
        meta: &Meta,
    ) -> Result<u64, UnpackError> {
        use std::os::unix::ffi::OsStrExt;
        let at = Path::new(std::ffi::OsStr::from_bytes(name));
        unistd::linkat(None, made, Some(parent.as_raw_fd()), at, AtFlags::empty())
            .map_err(|e| self.io("link file", raw, e))?;
        let file = sys::open_file_at(parent, name).map_err(|e| self.io("open file", raw, e))?;
        let made_len = file.metadata().map_err(|e| self.io("look at file", raw, e))?.len();
        let read = io::copy(entry, &mut io::sink()).map_err(|e| self.stream_error(e))?;
        if made_len != entry.size() {
            return Err(UnpackError::Truncated { digest: self.digest.clone(), path: tarpath::shown(raw) });
        }
        self.stats.bytes += read;
        if read != entry.size() {
            return Err(UnpackError::Truncated { digest: self.digest.clone(), path: tarpath::shown(raw) });
        }
        self.file_meta(&file, raw, meta)?;
        Ok(read)
    }

    /// Owner, mode, xattrs and times of a file whose data is in place.
    pub(super) fn file_meta(&self, file: &File, raw: &[u8], meta: &Meta) -> Result<(), UnpackError> {
        // chown clears setuid/setgid and security.capability, and writing
        // clears security.capability: so data, owner, mode, xattrs, times.
        unistd::fchown(file.as_raw_fd(), Some(Uid::from_raw(meta.uid)), Some(Gid::from_raw(meta.gid)))
            .map_err(|e| self.io("change owner of", raw, e))?;
        stat::fchmod(file.as_raw_fd(), Mode::from_bits_truncate(meta.mode))
            .map_err(|e| self.io("change mode of", raw, e))?;
        self.set_xattrs(Target::Fd(file.as_fd()), raw, &meta.xattrs)?;
        stat::futimens(file.as_raw_fd(), &meta.mtime, &meta.mtime).map_err(|e| self.io("set times of", raw, e))?;
        Ok(())
    }

    pub(super) fn symlink<R: Read>(
        &mut self,
        entry: &tar::Entry<'_, R>,
        raw: &[u8],
        comps: &[&[u8]],
        meta: &Meta,
    ) -> Result<(), UnpackError> {
        let target = link_target(entry);
        self.check_link_target(raw, &target)?;
        // Absolute targets resolve inside the sandbox root at run time; a
        // relative one must not climb above the layer root from its directory.
        if target[0] != b'/' && tarpath::climbs_out(comps.len() - 1, &target) {
            return Err(UnpackError::SymlinkEscape {
                digest: self.digest.clone(),
                path: tarpath::shown(raw),
                target: tarpath::shown(&target),
            });
        }
        let (name, parents) = split(comps);
        let parent = self.walk_entry(raw, parents)?;
        self.clear(parent.as_fd(), raw, comps, false)?;
        unistd::symlinkat(&target[..], Some(parent.as_raw_fd()), name)
            .map_err(|e| self.io("create symlink", raw, e))?;
        self.finish_special(parent.as_fd(), name, raw, meta, false)
    }

    pub(super) fn fifo(&mut self, raw: &[u8], comps: &[&[u8]], meta: &Meta) -> Result<(), UnpackError> {
        let (name, parents) = split(comps);
        let parent = self.walk_entry(raw, parents)?;
        self.clear(parent.as_fd(), raw, comps, false)?;
        stat::mknodat(Some(parent.as_raw_fd()), name, SFlag::S_IFIFO, Mode::S_IRUSR | Mode::S_IWUSR, 0)
            .map_err(|e| self.io("create fifo", raw, e))?;
        self.finish_special(parent.as_fd(), name, raw, meta, true)
    }

    /// Owner, mode (not for symlinks), xattrs and times of a symlink or FIFO,
    /// by name, never following it.
    pub(super) fn finish_special(
        &self,
        parent: BorrowedFd<'_>,
        name: &[u8],
        raw: &[u8],
        meta: &Meta,
        chmod: bool,
    ) -> Result<(), UnpackError> {
        let dirfd = Some(parent.as_raw_fd());
        unistd::fchownat(
            dirfd,
            name,
            Some(Uid::from_raw(meta.uid)),
            Some(Gid::from_raw(meta.gid)),
            AtFlags::AT_SYMLINK_NOFOLLOW,
        )
        .map_err(|e| self.io("change owner of", raw, e))?;
        if chmod {
            // Linux fchmodat cannot refuse to follow; the name was created
            // just above as a FIFO and nothing else writes in `dest`.
            stat::fchmodat(dirfd, name, Mode::from_bits_truncate(meta.mode), FchmodatFlags::FollowSymlink)
                .map_err(|e| self.io("change mode of", raw, e))?;
        }
        self.set_xattrs(Target::At(parent, name), raw, &meta.xattrs)?;
        stat::utimensat(dirfd, name, &meta.mtime, &meta.mtime, UtimensatFlags::NoFollowSymlink)
            .map_err(|e| self.io("set times of", raw, e))
    }

    pub(super) fn hardlink<R: Read>(
        &mut self,
        entry: &tar::Entry<'_, R>,
        raw: &[u8],
        comps: &[&[u8]],
    ) -> Result<(), UnpackError> {
        let target = link_target(entry);
        let (digest, path, shown_target) = (self.digest.clone(), tarpath::shown(raw), tarpath::shown(&target));
        let tcomps = match tarpath::components(&target) {
            Ok(c) => c,
            Err(PathError::Absolute | PathError::DotDot) => {
                return Err(UnpackError::HardlinkEscape { digest, path, target: shown_target })
            }
            Err(problem) => return Err(UnpackError::InvalidLinkTarget { digest, path, problem }),
        };
        let Some((tname, tparents)) = tcomps.split_last() else {
            return Err(UnpackError::HardlinkToDirectory { digest, path, target: shown_target });
        };
        let (name, parents) = split(comps);
        let parent = self.walk_entry(raw, parents)?;
        // Remove first: a link to its own name then finds nothing.
        self.clear(parent.as_fd(), raw, comps, false)?;
        let missing = || UnpackError::HardlinkMissing {
            digest: digest.clone(),
            path: path.clone(),
            target: shown_target.clone(),
        };
        let tparent = match self.walk(tparents, false) {
            Ok(fd) => fd,
            Err(WalkError::Symlink(i)) => {
                return Err(UnpackError::ThroughSymlink {
                    digest: digest.clone(),
                    path: path.clone(),
                    symlink: tarpath::shown(&tarpath::join(&tparents[..=i])),
                })
            }
            Err(WalkError::Missing(_) | WalkError::NotDir(_)) => return Err(missing()),
            Err(WalkError::Io(step, e)) => return Err(self.io(step, raw, e)),
        };
        match stat::fstatat(Some(tparent.as_raw_fd()), *tname, AtFlags::AT_SYMLINK_NOFOLLOW) {
            Err(Errno::ENOENT) => return Err(missing()),
            Err(e) => return Err(self.io("inspect hardlink target of", raw, e)),
            Ok(st) if file_type(st.st_mode) == SFlag::S_IFDIR => {
                return Err(UnpackError::HardlinkToDirectory { digest, path, target: shown_target })
            }
            // A 0/0 device here is a whiteout: the target was deleted.
            Ok(st) if file_type(st.st_mode) == SFlag::S_IFCHR => return Err(missing()),
            Ok(_) => {}
        }
        // No AT_SYMLINK_FOLLOW: a symlink target is linked, not followed.
        unistd::linkat(Some(tparent.as_raw_fd()), *tname, Some(parent.as_raw_fd()), name, AtFlags::empty())
            .map_err(|e| self.io("create hardlink", raw, e))
    }

    pub(super) fn check_link_target(&self, raw: &[u8], target: &[u8]) -> Result<(), UnpackError> {
        let problem = if target.is_empty() {
            PathError::Empty
        } else if target.contains(&0) {
            PathError::Nul
        } else if target.len() > PATH_MAX {
            PathError::PathTooLong
        } else {
            return Ok(());
        };
        Err(UnpackError::InvalidLinkTarget { digest: self.digest.clone(), path: tarpath::shown(raw), problem })
    }
}
