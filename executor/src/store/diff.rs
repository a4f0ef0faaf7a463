//! Upper dir → OCI layer tar: the delta a checkpoint seals.
//!
//! Owns the conversion from overlayfs' representation of a change set to the
//! OCI image-spec one (`layer.md`): a whiteout (0/0 character device) becomes
//! an empty `.wh.<name>` file, a directory with `trusted.overlay.opaque=y`
//! gets a `.wh..wh..opq` entry right after its own, a second name of an inode
//! becomes a hardlink entry. Symlinks, modes (setuid included), numeric
//! owners, mtimes (seconds) and extended attributes (PAX `SCHILY.xattr.*`)
//! are kept; overlay's private `trusted.overlay.*` bookkeeping never is.
//!
//! Entries are written depth-first in byte order of their names, with fixed
//! header fields otherwise (no user/group names, no atime/ctime), so the same
//! tree always gives the same bytes, hence the same diff_id.
//!
//! Incremental: given what the last capture saw of each entry
//! ([`Stamps`], `stamps.rs`), only what changed since is written: entries
//! whose stamp differs (or is new), the directories on their paths (their
//! headers only, never an opaque marker: their other entries are in the
//! earlier layer), a whiteout for each name gone since, and a directory
//! that is not the one recorded (removed and made again, or new where a
//! file was) whole and opaque. Unchanged file data is never read.
//!
//! The reverse direction (tar → directory, whiteouts → overlay form) is
//! `oci::unpack`. This module does not freeze or lock anything: the caller
//! keeps the tree still while it is read.
#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::ffi::{CString, OsStr};
use std::fs::{self, File};
use std::io::{self, Write};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use crate::store::hash::Hashing;
use crate::store::stamps::{Stamp, Stamps};

/// Which extended attributes a delta carries. `trusted.overlay.*` is
/// overlay's own bookkeeping (origin, impure, opaque...) and must never reach
/// a layer; `security.capability` and `user.*` are what files carry in images.
pub fn keep_xattr(name: &[u8]) -> bool {
    name.starts_with(b"user.") || name == b"security.capability"
}

pub(crate) const OPAQUE_XATTR: &str = "trusted.overlay.opaque";

#[derive(Debug, thiserror::Error)]
pub enum DiffError {
    #[error("read {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("write the layer tar (at {path})")]
    Write {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{path} is a device node ({kind}); device nodes are not captured in a snapshot")]
    DeviceNode { path: PathBuf, kind: &'static str },
    #[error("{path} is more than {MAX_DEPTH} directories deep; such trees are not captured")]
    TooDeep { path: PathBuf },
    #[error(
        "{path}: names starting with .wh. are reserved by the layer format (a whiteout, a deletion of what \
         the rest of the name says); such files are not captured"
    )]
    Reserved { path: PathBuf },
    #[error("{path} is not a directory in the sandbox (or is reached through a symlink, which is not followed)")]
    NotADirectory { path: PathBuf },
}

/// The deepest directory a capture, diff or compaction descends into (the
/// same limit as for layer entries). The walkers recurse once per level; a
/// sandbox can nest directories far deeper than any thread's stack allows
/// (and past PATH_MAX), so deeper trees are refused with an error instead
/// of crashing the daemon.
pub use crate::oci::MAX_DEPTH;

impl DiffError {
    /// Whether the tree itself cannot be captured (what a sandbox put
    /// there), rather than the host failing.
    pub fn is_content(&self) -> bool {
        match self {
            DiffError::DeviceNode { .. }
            | DiffError::TooDeep { .. }
            | DiffError::Reserved { .. }
            | DiffError::NotADirectory { .. } => true,
            DiffError::Read { source, .. } => source.raw_os_error() == Some(libc::ENAMETOOLONG),
            DiffError::Write { .. } => false,
        }
    }
}

/// Refuse to descend below `rel` if it is already [`MAX_DEPTH`] deep.
pub(crate) fn descend(rel: &Path) -> Result<(), DiffError> {
    if rel.components().count() >= MAX_DEPTH {
        return Err(DiffError::TooDeep { path: rel.to_path_buf() });
    }
    Ok(())
}

/// What a delta contains.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct DeltaStats {
    pub entries: u64,
    pub whiteouts: u64,
    pub opaque_dirs: u64,
    pub hardlinks: u64,
    /// Bytes of file data.
    pub bytes: u64,
    /// Size of the uncompressed tar.
    pub tar_bytes: u64,
}

/// Write the delta in `upper` as an uncompressed OCI layer tar to `out`.
/// Returns its statistics and its diff_id (lowercase sha256 hex).
pub fn write_delta(upper: &Path, out: impl Write) -> Result<(DeltaStats, String), DiffError> {
    write_delta_with(upper, Hashing::new(out), None, None).map(|(stats, hex, _)| (stats, hex))
}

/// [`write_delta`] of what changed since `since` (all of it without), and
/// the stamps of what it saw now.
pub fn write_delta_since(
    upper: &Path,
    out: impl Write,
    since: Option<&Stamps>,
) -> Result<(DeltaStats, String, Stamps), DiffError> {
    write_delta_with(upper, Hashing::new(out), None, since)
}

/// Takes a regular file's content (as long as its `fstat` says) into a
/// tar's output without passing it through the tar's buffer (spliced
/// inside the kernel, or referred to: `checkpoint.rs`), where the output
/// allows it; `false` if it did not, and the writer copies it.
pub type SpliceFile<W> = fn(&mut W, &File, &fs::Metadata) -> io::Result<bool>;

/// [`write_delta`] without the hashing, for a caller that hashes the tar as
/// it reads it back (a checkpoint's capture: copying only). With `splice`,
/// file contents are appended by it instead of read and written. With
/// `since`, only what changed since those stamps were taken is written
/// (see the module's doc). Returns the stamps of what it saw now.
pub fn write_delta_unhashed<W: Write>(
    upper: &Path,
    out: W,
    splice: Option<SpliceFile<W>>,
    since: Option<&Stamps>,
) -> Result<(DeltaStats, Stamps), DiffError> {
    write_delta_with(upper, Hashing::counting(out), splice, since).map(|(stats, _, stamps)| (stats, stamps))
}

fn write_delta_with<W: Write>(
    upper: &Path,
    out: Hashing<W>,
    splice: Option<SpliceFile<W>>,
    since: Option<&Stamps>,
) -> Result<(DeltaStats, String, Stamps), DiffError> {
    let root = File::open(upper).map_err(read_err(upper))?;
    let mut w = Writer {
        tar: tar::Builder::new(out),
        root,
        links: HashMap::new(),
        stats: DeltaStats::default(),
        splice,
        since,
        now: Stamps::new(crate::store::stamps::now_ns()),
        pending: Vec::new(),
    };
    w.tar.mode(tar::HeaderMode::Complete);
    w.tar.follow_symlinks(false);
    w.now.open_dir(Path::new(""));
    w.dir_children(upper, Path::new(""), since.is_none())?;
    let werr = |source| DiffError::Write { path: upper.into(), source };
    let (_, diff_id, written) = w.tar.into_inner().map_err(werr)?.finish();
    let mut stats = w.stats;
    stats.tar_bytes = written;
    Ok((stats, diff_id, w.now))
}

struct Writer<'a, W: Write> {
    tar: tar::Builder<Hashing<W>>,
    /// The tree's root directory.
    root: File,
    /// (dev, ino) of multiply-linked files → the name written first.
    links: HashMap<(u64, u64), PathBuf>,
    stats: DeltaStats,
    splice: Option<SpliceFile<W>>,
    /// What the last capture saw (incremental), if anything.
    since: Option<&'a Stamps>,
    /// What this one sees.
    now: Stamps,
    /// Directories on the path being walked whose headers are not written
    /// yet (unchanged, incremental): written before anything below them.
    pending: Vec<(PathBuf, Meta, Vec<Xattr>)>,
}

pub(crate) fn read_err(path: &Path) -> impl FnOnce(io::Error) -> DiffError + '_ {
    move |source| DiffError::Read { path: path.into(), source }
}

/// (name, value) of one extended attribute.
pub(crate) type Xattr = (Vec<u8>, Vec<u8>);

/// The entries of `dir`, sorted by the bytes of their names.
pub(crate) fn sorted_names(dir: &Path) -> Result<Vec<std::ffi::OsString>, DiffError> {
    let mut names: Vec<_> = fs::read_dir(dir)
        .map_err(read_err(dir))?
        .map(|e| e.map(|e| e.file_name()))
        .collect::<Result<_, _>>()
        .map_err(read_err(dir))?;
    names.sort_by(|a, b| a.as_bytes().cmp(b.as_bytes()));
    Ok(names)
}

/// Extended attributes of `path` (not following symlinks), name-sorted.
pub(crate) fn xattrs(path: &Path) -> Result<Vec<Xattr>, DiffError> {
    let c = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| DiffError::Read { path: path.into(), source: io::ErrorKind::InvalidInput.into() })?;
    xattrs_of(&c).map_err(|source| DiffError::Read { path: path.into(), source })
}

pub(crate) fn xattrs_of(c: &std::ffi::CStr) -> io::Result<Vec<Xattr>> {
    let names = match strata_shim::sys::llistxattr(c) {
        Ok(n) => n,
        // Filesystems without xattr support have none to capture.
        Err(nix::errno::Errno::ENOTSUP) => return Ok(Vec::new()),
        Err(e) => return Err(e.into()),
    };
    let mut out = Vec::new();
    for name in names {
        let cname = CString::new(name.clone()).unwrap_or_default();
        match strata_shim::sys::lgetxattr(c, &cname) {
            Ok(v) => out.push((name, v)),
            // Removed between list and get: nothing to capture.
            Err(nix::errno::Errno::ENODATA) => {}
            Err(e) => return Err(e.into()),
        }
    }
    out.sort();
    Ok(out)
}

/// One directory of the tree a [`Writer`] reads, held open. Its entries
/// are looked up in it by name (`fstatat`, `openat`, `readlinkat`, none
/// following a final symlink), and directories are opened by their path
/// from the root without following any symlink (`Writer::open_dir`): a
/// tree that changes while it is read (a running sandbox's upper:
/// `checkpoint.rs` writes ahead from one) can make a read fail or mix old
/// and new, which the caller must detect, but cannot lead the walk out of
/// the tree, into a FIFO that blocks it, or onto a device.
struct Dir<'a> {
    fd: &'a File,
    /// Its host path, for messages only.
    shown: &'a Path,
}

impl Dir<'_> {
    fn cname(name: &OsStr) -> CString {
        // Names from a directory listing hold no NUL byte.
        CString::new(name.as_bytes()).unwrap_or_default()
    }

    fn stat(&self, name: &OsStr) -> io::Result<Meta> {
        use std::os::fd::AsRawFd;
        let flags = nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW;
        let st = nix::sys::stat::fstatat(Some(self.fd.as_raw_fd()), Self::cname(name).as_c_str(), flags)?;
        Ok(Meta {
            mode: st.st_mode,
            uid: st.st_uid,
            gid: st.st_gid,
            mtime: st.st_mtime,
            size: st.st_size as u64,
            nlink: st.st_nlink as u64,
            dev: st.st_dev,
            ino: st.st_ino,
            rdev: st.st_rdev,
            ctime_ns: i128::from(st.st_ctime) * 1_000_000_000 + i128::from(st.st_ctime_nsec),
        })
    }

    /// `name` opened without following a symlink or blocking on a FIFO.
    fn open(&self, name: &OsStr) -> io::Result<File> {
        use std::os::fd::AsFd;
        Ok(crate::oci::sys::open_file_at(self.fd.as_fd(), name.as_bytes())?)
    }

    fn read_link(&self, name: &OsStr) -> io::Result<std::ffi::OsString> {
        use std::os::fd::AsRawFd;
        Ok(nix::fcntl::readlinkat(Some(self.fd.as_raw_fd()), Self::cname(name).as_c_str())?)
    }

    /// Extended attributes of `name`, through `/proc/self/fd/N/name`: the
    /// magic link stands for this open directory, so only `name` is looked
    /// up (and not followed: `l*xattr`). Works for symlinks and FIFOs too,
    /// which cannot be opened for `f*xattr`.
    fn xattrs(&self, name: &OsStr) -> io::Result<Vec<Xattr>> {
        use std::os::fd::AsFd;
        xattrs_of(&crate::oci::sys::entry_path(self.fd.as_fd(), name.as_bytes())?)
    }

    /// The names in it, sorted by their bytes.
    fn names(&self) -> io::Result<Vec<std::ffi::OsString>> {
        use std::os::fd::AsRawFd;
        let flags = nix::fcntl::OFlag::O_RDONLY | nix::fcntl::OFlag::O_DIRECTORY | nix::fcntl::OFlag::O_CLOEXEC;
        let mut list = nix::dir::Dir::openat(Some(self.fd.as_raw_fd()), ".", flags, nix::sys::stat::Mode::empty())?;
        let mut names = Vec::new();
        for entry in list.iter() {
            let name = entry?.file_name().to_bytes().to_vec();
            if name != b"." && name != b".." {
                names.push(std::ffi::OsString::from_vec(name));
            }
        }
        names.sort_by(|a, b| a.as_bytes().cmp(b.as_bytes()));
        Ok(names)
    }
}

/// What a header (and a [`Stamp`]) needs of an entry's `lstat`.
#[derive(Clone)]
struct Meta {
    mode: u32,
    uid: u32,
    gid: u32,
    mtime: i64,
    size: u64,
    nlink: u64,
    dev: u64,
    ino: u64,
    rdev: u64,
    ctime_ns: i128,
}

impl Meta {
    fn is(&self, kind: libc::mode_t) -> bool {
        self.mode & libc::S_IFMT == kind
    }

    fn stamp(&self, opaque: bool) -> Stamp {
        Stamp { ino: self.ino, ctime_ns: self.ctime_ns, size: self.size, mode: self.mode, opaque, racy: false }
    }
}

/// How a directory entry is written: as the tree says (a whole capture, or
/// under a directory written whole), without the opaque marker (an
/// unchanged directory, whose other entries are in an earlier layer), or
/// opaque whatever the tree says (made again since the last capture).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Opaque {
    AsIs,
    Never,
    Always,
}

/// Header of an empty marker entry (whiteout, opaque marker, PAX header):
/// every numeric field set, fixed values, so digests are stable.
fn marker_header() -> tar::Header {
    let mut h = tar::Header::new_gnu();
    h.set_entry_type(tar::EntryType::Regular);
    h.set_mode(0o644);
    h.set_uid(0);
    h.set_gid(0);
    h.set_mtime(0);
    h.set_size(0);
    let _ = h.set_device_major(0);
    let _ = h.set_device_minor(0);
    h
}

/// One PAX record: "<len> <key>=<value>\n", len counting itself.
fn pax_record(key: &[u8], value: &[u8]) -> Vec<u8> {
    let body = key.len() + value.len() + 3; // ' ', '=', '\n'
    let mut len = body + 1;
    while len != body + len.to_string().len() {
        len = body + len.to_string().len();
    }
    let mut r = format!("{len} ").into_bytes();
    r.extend_from_slice(key);
    r.push(b'=');
    r.extend_from_slice(value);
    r.push(b'\n');
    r
}

impl<W: Write> Writer<'_, W> {
    fn werr(&self, rel: &Path) -> impl FnOnce(io::Error) -> DiffError {
        let path = rel.to_path_buf();
        move |source| DiffError::Write { path, source }
    }

    /// The directory at `rel` under the root, opened by that path without
    /// following any symlink or leaving the root (`openat2` with
    /// `RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS`).
    fn open_dir(&self, rel: &Path) -> io::Result<File> {
        use std::os::fd::AsFd;
        if rel.as_os_str().is_empty() {
            return self.root.try_clone();
        }
        let path =
            CString::new(rel.as_os_str().as_bytes()).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        let flags = libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_NONBLOCK;
        let resolve = strata_shim::sys::RESOLVE_BENEATH
            | strata_shim::sys::RESOLVE_NO_SYMLINKS
            | strata_shim::sys::RESOLVE_NO_MAGICLINKS;
        Ok(File::from(strata_shim::sys::openat2(self.root.as_fd(), &path, flags, 0, resolve)?))
    }

    /// Children of the directory at archive path `rel` (host path `shown`),
    /// sorted by name bytes; all of them if `whole`, else what changed
    /// since `self.since` (which recorded this directory). Only the
    /// directory being read is held open, not its ancestors (a tree 512
    /// levels deep would hold 512 descriptors): after a subdirectory it is
    /// opened again by its path.
    fn dir_children(&mut self, shown: &Path, rel: &Path, whole: bool) -> Result<(), DiffError> {
        descend(rel)?;
        let mut fd = Some(self.open_dir(rel).map_err(read_err(shown))?);
        let names = fd.as_ref().map(|fd| Dir { fd, shown }.names()).transpose().map_err(read_err(shown))?;
        let before = if whole { None } else { self.since.and_then(|s| s.children(rel)) };
        let mut before = before.unwrap_or_default().iter().peekable();
        for name in names.unwrap_or_default() {
            // Names recorded before this one and gone now: whiteouts.
            while let Some((gone, _)) = before.next_if(|(b, _)| b.as_bytes() < name.as_bytes()) {
                self.whiteout(&rel.join(gone))?;
            }
            let was = before.next_if(|(b, _)| *b == name).map(|(_, s)| *s);
            let open = match fd {
                Some(ref f) => f,
                None => fd.insert(self.open_dir(rel).map_err(read_err(shown))?),
            };
            let child = rel.join(&name);
            let dir = Dir { fd: open, shown };
            if name.as_bytes().starts_with(b".wh.") {
                return Err(DiffError::Reserved { path: child });
            }
            let meta = dir.stat(&name).map_err(read_err(&shown.join(&name)))?;
            let opaque = meta.is(libc::S_IFDIR)
                && dir
                    .xattrs(&name)
                    .map_err(read_err(&shown.join(&name)))?
                    .iter()
                    .any(|(n, v)| n == OPAQUE_XATTR.as_bytes() && v == b"y");
            let stamp = meta.stamp(opaque);
            if !meta.is(libc::S_IFSOCK) {
                self.now.record(rel, &name, stamp);
            }
            // Whole: as the tree says. Incremental: a directory that is
            // the one recorded is walked for changes (its header written
            // if it changed itself, else only if something below is); any
            // other entry is written if it is not as recorded, and a
            // directory that is new there is written whole, opaque if
            // anything was there before.
            let same_dir = was.is_some_and(|w| w.same_dir(&stamp));
            let unchanged = was.is_some_and(|w| w.unchanged(&stamp));
            let written = if whole {
                self.entry(&dir, &name, &child, meta, Opaque::AsIs)?.then_some(true)
            } else if same_dir && unchanged {
                let xattrs = dir.xattrs(&name).map_err(read_err(&shown.join(&name)))?;
                self.pending.push((child.clone(), meta, xattrs));
                Some(false)
            } else if same_dir {
                self.flush_pending()?;
                self.entry(&dir, &name, &child, meta, Opaque::Never)?.then_some(false)
            } else if unchanged {
                None
            } else {
                self.flush_pending()?;
                let opaque = if was.is_some() { Opaque::Always } else { Opaque::AsIs };
                self.entry(&dir, &name, &child, meta, opaque)?.then_some(true)
            };
            if let Some(whole) = written {
                fd = None;
                self.now.open_dir(&child);
                self.dir_children(&shown.join(&name), &child, whole)?;
                if self.pending.last().is_some_and(|(p, ..)| *p == child) {
                    self.pending.pop();
                }
            }
        }
        for (gone, _) in before {
            self.whiteout(&rel.join(gone))?;
        }
        Ok(())
    }

    /// Write the headers of the unchanged directories above what is about
    /// to be written (incremental), outermost first.
    fn flush_pending(&mut self) -> Result<(), DiffError> {
        for (rel, meta, xattrs) in std::mem::take(&mut self.pending) {
            self.dir_header(&meta, xattrs, &rel, false)?;
        }
        Ok(())
    }

    /// A whiteout for `rel`, gone since the last capture (incremental).
    fn whiteout(&mut self, rel: &Path) -> Result<(), DiffError> {
        self.flush_pending()?;
        let mut wh = b".wh.".to_vec();
        wh.extend_from_slice(rel.file_name().unwrap_or_default().as_bytes());
        let path = rel.with_file_name(OsStr::from_bytes(&wh));
        self.stats.whiteouts += 1;
        let e = self.werr(rel);
        self.tar.append_data(&mut marker_header(), &path, io::empty()).map_err(e)
    }

    /// A directory's header (after its xattrs' PAX header), and the opaque
    /// marker after it if `opaque`.
    fn dir_header(&mut self, meta: &Meta, xattrs: Vec<Xattr>, rel: &Path, opaque: bool) -> Result<(), DiffError> {
        self.pax(xattrs, rel)?;
        let mut h = self.header(meta, tar::EntryType::Directory, 0);
        let e = self.werr(rel);
        self.tar.append_data(&mut h, rel, io::empty()).map_err(e)?;
        if opaque {
            let mut h = marker_header();
            self.stats.opaque_dirs += 1;
            let e = self.werr(rel);
            self.tar.append_data(&mut h, rel.join(".wh..wh..opq"), io::empty()).map_err(e)?;
        }
        Ok(())
    }

    fn header(&self, meta: &Meta, kind: tar::EntryType, size: u64) -> tar::Header {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(kind);
        h.set_mode(meta.mode & 0o7777);
        h.set_uid(u64::from(meta.uid));
        h.set_gid(u64::from(meta.gid));
        h.set_mtime(meta.mtime.max(0) as u64);
        h.set_size(size);
        let _ = h.set_device_major(0);
        let _ = h.set_device_minor(0);
        h
    }

    /// PAX header carrying the xattrs of `name` in `dir`, if it has any
    /// worth keeping.
    fn pax(&mut self, xattrs: Vec<Xattr>, rel: &Path) -> Result<(), DiffError> {
        self.pax_with(xattrs, Vec::new(), rel)
    }

    /// [`Writer::pax`] with more `records` before the xattrs' (one PAX
    /// header per entry: readers keep only the last).
    fn pax_with(&mut self, xattrs: Vec<Xattr>, mut records: Vec<u8>, rel: &Path) -> Result<(), DiffError> {
        for (name, value) in xattrs {
            if keep_xattr(&name) {
                let mut key = b"SCHILY.xattr.".to_vec();
                key.extend_from_slice(&name);
                records.extend(pax_record(&key, &value));
            }
        }
        if records.is_empty() {
            return Ok(());
        }
        let mut h = marker_header();
        h.set_entry_type(tar::EntryType::XHeader);
        h.set_size(records.len() as u64);
        // The name of a PAX header is informational; keep it short and fixed.
        let e = self.werr(rel);
        h.set_path("PaxHeader").map_err(e)?;
        h.set_cksum();
        let e = self.werr(rel);
        self.tar.append(&h, &records[..]).map_err(e)
    }

    /// A symlink entry whose target is `target` byte for byte. The tar
    /// crate's `append_link` normalises a short target as a path (`/`
    /// became `//`, `a//b` became `a/b`): a target is bytes, not a path.
    /// Past the header's 100 bytes it goes in a GNU long-link record, as
    /// the tar crate writes them.
    fn symlink(&mut self, h: &mut tar::Header, rel: &Path, target: &[u8]) -> io::Result<()> {
        let field = h.as_old().linkname.len();
        if target.len() > field {
            let mut long = tar::Header::new_gnu();
            long.as_gnu_mut().ok_or_else(|| io::Error::other("GNU header"))?.name[..13]
                .copy_from_slice(b"././@LongLink");
            long.set_mode(0o644);
            long.set_entry_type(tar::EntryType::GNULongLink);
            long.set_size(target.len() as u64 + 1);
            long.set_cksum();
            self.tar.append(&long, io::Read::chain(target, &[0u8][..]))?;
        }
        h.set_link_name_literal(&target[..target.len().min(field)])?;
        self.tar.append_data(h, rel, io::empty())
    }

    /// A regular file of `meta.size` bytes in GNU tar's PAX sparse format
    /// 1.0, as `tar --sparse --format=posix` writes it: PAX records
    /// `GNU.sparse.major=1`, `minor=0`, `name` and `realsize`; the entry is
    /// a regular file whose data is the map (decimal lines: the count, then
    /// offset and length of each extent, padded to a block) followed by
    /// the extents' bytes. Go's `archive/tar` (containerd, umoci, podman)
    /// hands it to its callers as the regular file it stands for; the old
    /// GNU type `S` it passes through, and they refuse it.
    fn sparse(
        &mut self,
        meta: &Meta,
        rel: &Path,
        xattrs: Vec<Xattr>,
        file: &File,
        extents: &[(u64, u64)],
    ) -> Result<bool, DiffError> {
        let mut map = format!("{}\n", extents.len()).into_bytes();
        for (off, n) in extents {
            map.extend_from_slice(format!("{off}\n{n}\n").as_bytes());
        }
        map.resize(map.len().next_multiple_of(512), 0);
        let stored: u64 = extents.iter().map(|&(_, n)| n).sum();
        let mut records = Vec::new();
        records.extend(pax_record(b"GNU.sparse.major", b"1"));
        records.extend(pax_record(b"GNU.sparse.minor", b"0"));
        records.extend(pax_record(b"GNU.sparse.name", rel.as_os_str().as_bytes()));
        records.extend(pax_record(b"GNU.sparse.realsize", meta.size.to_string().as_bytes()));
        self.pax_with(xattrs, records, rel)?;
        let mut h = self.header(meta, tar::EntryType::Regular, map.len() as u64 + stored);
        let e = self.werr(rel);
        let written = (|| {
            self.tar.append_data(&mut h, rel, io::empty())?;
            let out = self.tar.get_mut();
            out.write_all(&map)?;
            for &(off, n) in extents {
                io::Seek::seek(&mut &*file, io::SeekFrom::Start(off))?;
                crate::store::extents::copy_exactly(file, n, out)?;
            }
            let pad = (512 - stored % 512) % 512;
            out.write_all(&[0; 512][..pad as usize])
        })();
        written.map_err(e).map(|()| false)
    }

    /// Write the entry `name` of `dir`, whose `lstat` is `meta`; `true` if
    /// it is a directory, whose children the caller writes next. A
    /// sandbox's own `.wh.passwd` would be read as a deletion of `passwd`
    /// by whoever unpacks the layer (and `strata diff` would show an added
    /// file): the caller refuses such names, as the unpacker's whiteouts
    /// are ours alone.
    fn entry(
        &mut self,
        dir: &Dir<'_>,
        name: &OsStr,
        rel: &Path,
        meta: Meta,
        opaque: Opaque,
    ) -> Result<bool, DiffError> {
        let host = dir.shown.join(name);
        let host = host.as_path();
        let xattrs = || dir.xattrs(name).map_err(read_err(host));
        self.stats.entries += 1;
        if meta.is(libc::S_IFCHR) && meta.rdev == 0 {
            // Overlay whiteout → OCI whiteout.
            let mut wh = name.as_bytes().to_vec();
            wh.splice(0..0, b".wh.".iter().copied());
            let path = rel.with_file_name(OsStr::from_bytes(&wh));
            let mut h = marker_header();
            self.stats.whiteouts += 1;
            let e = self.werr(rel);
            return self.tar.append_data(&mut h, &path, io::empty()).map_err(e).map(|()| false);
        }
        if meta.is(libc::S_IFCHR) || meta.is(libc::S_IFBLK) {
            let kind = if meta.is(libc::S_IFCHR) { "character device" } else { "block device" };
            return Err(DiffError::DeviceNode { path: rel.into(), kind });
        }
        if meta.is(libc::S_IFSOCK) {
            // A socket has no content to capture (tar skips them too).
            self.stats.entries -= 1;
            return Ok(false);
        }
        if meta.is(libc::S_IFDIR) {
            let xattrs = xattrs()?;
            let opaque = match opaque {
                Opaque::AsIs => xattrs.iter().any(|(n, v)| n == OPAQUE_XATTR.as_bytes() && v == b"y"),
                Opaque::Never => false,
                Opaque::Always => true,
            };
            self.dir_header(&meta, xattrs, rel, opaque)?;
            return Ok(true);
        }
        if meta.is(libc::S_IFLNK) {
            let target = dir.read_link(name).map_err(read_err(host))?;
            self.pax(xattrs()?, rel)?;
            let mut h = self.header(&meta, tar::EntryType::Symlink, 0);
            let e = self.werr(rel);
            return self.symlink(&mut h, rel, target.as_os_str().as_bytes()).map_err(e).map(|()| false);
        }
        if meta.nlink > 1 {
            let key = (meta.dev, meta.ino);
            if let Some(first) = self.links.get(&key).cloned() {
                let mut h = self.header(&meta, tar::EntryType::Link, 0);
                self.stats.hardlinks += 1;
                let e = self.werr(rel);
                return self.tar.append_link(&mut h, rel, first).map_err(e).map(|()| false);
            }
            self.links.insert(key, rel.to_path_buf());
        }
        if meta.is(libc::S_IFIFO) {
            self.pax(xattrs()?, rel)?;
            let mut h = self.header(&meta, tar::EntryType::Fifo, 0);
            let e = self.werr(rel);
            return self.tar.append_data(&mut h, rel, io::empty()).map_err(e).map(|()| false);
        }
        // Regular file: its header from the open file, which must be the
        // one looked at (in a tree that changes, the name can be replaced).
        let file = dir.open(name).map_err(read_err(host))?;
        let opened = file.metadata().map_err(read_err(host))?;
        if !opened.is_file() || (opened.dev(), opened.ino()) != (meta.dev, meta.ino) {
            let source = io::Error::other("replaced while it was read");
            return Err(DiffError::Read { path: host.into(), source });
        }
        let meta = Meta {
            mode: opened.mode(),
            uid: opened.uid(),
            gid: opened.gid(),
            mtime: opened.mtime(),
            size: opened.size(),
            ..meta
        };
        let len = meta.size;
        self.stats.bytes += len;
        // A file with holes: its data extents only, so a 16 GiB
        // `truncate` costs a header, not 16 GiB of zeros read, hashed,
        // compressed and unpacked.
        if let Some(extents) = crate::store::extents::data_extents(&file, &opened).map_err(read_err(host))? {
            return self.sparse(&meta, rel, xattrs()?, &file, &extents);
        }
        self.pax(xattrs()?, rel)?;
        let mut h = self.header(&meta, tar::EntryType::Regular, len);
        // The header (its size field says what follows), then the content
        // and the padding to the next 512-byte block, written here so that
        // the content can be spliced. A file that shrinks or grows while
        // read would corrupt the archive: exactly `len` bytes are appended,
        // and a short file is an error.
        let e = self.werr(rel);
        self.tar.append_data(&mut h, rel, io::empty()).map_err(e)?;
        let e = self.werr(rel);
        let out = self.tar.get_mut();
        let taken = match self.splice {
            Some(splice) if out.hash.is_none() => splice(&mut out.inner, &file, &opened),
            _ => Ok(false),
        };
        let appended = match taken {
            Ok(true) => {
                out.written += len;
                Ok(())
            }
            Ok(false) => crate::store::extents::copy_exactly(&file, len, out),
            Err(e) => Err(e),
        };
        let pad = (512 - len % 512) % 512;
        appended.and_then(|()| out.write_all(&[0; 512][..pad as usize])).map_err(e).map(|()| false)
    }
}

#[cfg(test)]
mod tests;
