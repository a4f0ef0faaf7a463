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
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

use sha2::{Digest as _, Sha256};

use crate::stamps::{Stamp, Stamps};

/// Which extended attributes a delta carries. `trusted.overlay.*` is
/// overlay's own bookkeeping (origin, impure, opaque...) and must never reach
/// a layer; `security.capability` and `user.*` are what files carry in images.
pub fn keep_xattr(name: &[u8]) -> bool {
    name.starts_with(b"user.") || name == b"security.capability"
}

const OPAQUE_XATTR: &str = "trusted.overlay.opaque";

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
fn descend(rel: &Path) -> Result<(), DiffError> {
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

/// Counts and hashes (sha256) what passes through: the diff_id of a tar
/// written through it, or the digest of a blob.
pub(crate) struct Hashing<W> {
    inner: W,
    hash: Option<Sha256>,
    written: u64,
}

impl<W: Write> Hashing<W> {
    pub(crate) fn new(inner: W) -> Self {
        Hashing { inner, hash: Some(Sha256::new()), written: 0 }
    }

    /// Counts only (its hex is empty).
    fn counting(inner: W) -> Self {
        Hashing { inner, hash: None, written: 0 }
    }

    /// The inner writer, the sha256 hex and the byte count.
    pub(crate) fn finish(self) -> (W, String, u64) {
        (self.inner, self.hash.map(|h| hex::encode(h.finalize())).unwrap_or_default(), self.written)
    }
}

impl<W: Write> Write for Hashing<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        if let Some(h) = &mut self.hash {
            h.update(&buf[..n]);
        }
        self.written += n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// Counts and hashes (sha256) what passes through, like [`Hashing`], but
/// the hash runs on a thread of its own, fed in chunks: the writing thread
/// (a blob's compressor) then only compresses and copies. sha256 costs a
/// core about as much as zstd level 1 does (2 GB/s with SHA-NI).
pub(crate) struct HashBeside<W> {
    inner: W,
    chunk: Vec<u8>,
    full: std::sync::mpsc::SyncSender<Vec<u8>>,
    /// Chunks the hash thread is done with.
    empty: std::sync::mpsc::Receiver<Vec<u8>>,
    thread: std::thread::JoinHandle<String>,
    written: u64,
}

impl<W: std::io::Write> HashBeside<W> {
    const CHUNK: usize = 1 << 20;

    pub(crate) fn new(inner: W) -> std::io::Result<Self> {
        use sha2::Digest;
        let (full, filled) = std::sync::mpsc::sync_channel::<Vec<u8>>(2);
        let (give_back, empty) = std::sync::mpsc::sync_channel(4);
        let thread = std::thread::Builder::new().name("blob-hash".into()).spawn(move || {
            let mut hash = sha2::Sha256::new();
            for chunk in filled {
                hash.update(&chunk);
                let _ = give_back.try_send(chunk);
            }
            hex::encode(hash.finalize())
        })?;
        Ok(HashBeside { inner, chunk: Vec::with_capacity(Self::CHUNK), full, empty, thread, written: 0 })
    }

    fn send(&mut self) -> std::io::Result<()> {
        let mut next = self.empty.try_recv().unwrap_or_else(|_| Vec::with_capacity(Self::CHUNK));
        next.clear();
        let chunk = std::mem::replace(&mut self.chunk, next);
        self.full.send(chunk).map_err(|_| std::io::Error::other("the blob's hash thread ended"))
    }

    /// The inner writer, the sha256 hex and the byte count.
    pub(crate) fn finish(mut self) -> std::io::Result<(W, String, u64)> {
        if !self.chunk.is_empty() {
            self.send()?;
        }
        let HashBeside { inner, full, thread, written, .. } = self;
        drop(full);
        let hex = thread.join().map_err(|_| std::io::Error::other("the blob's hash thread panicked"))?;
        Ok((inner, hex, written))
    }
}

impl<W: std::io::Write> std::io::Write for HashBeside<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        let mut rest = &buf[..n];
        while !rest.is_empty() {
            let take = rest.len().min(Self::CHUNK - self.chunk.len());
            self.chunk.extend_from_slice(&rest[..take]);
            rest = &rest[take..];
            if self.chunk.len() == Self::CHUNK {
                self.send()?;
            }
        }
        self.written += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
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
        now: Stamps::new(crate::stamps::now_ns()),
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

fn read_err(path: &Path) -> impl FnOnce(io::Error) -> DiffError + '_ {
    move |source| DiffError::Read { path: path.into(), source }
}

/// (name, value) of one extended attribute.
type Xattr = (Vec<u8>, Vec<u8>);

/// The entries of `dir`, sorted by the bytes of their names.
fn sorted_names(dir: &Path) -> Result<Vec<std::ffi::OsString>, DiffError> {
    let mut names: Vec<_> = fs::read_dir(dir)
        .map_err(read_err(dir))?
        .map(|e| e.map(|e| e.file_name()))
        .collect::<Result<_, _>>()
        .map_err(read_err(dir))?;
    names.sort_by(|a, b| a.as_bytes().cmp(b.as_bytes()));
    Ok(names)
}

/// Extended attributes of `path` (not following symlinks), name-sorted.
fn xattrs(path: &Path) -> Result<Vec<Xattr>, DiffError> {
    let c = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| DiffError::Read { path: path.into(), source: io::ErrorKind::InvalidInput.into() })?;
    xattrs_of(&c).map_err(|source| DiffError::Read { path: path.into(), source })
}

fn xattrs_of(c: &std::ffi::CStr) -> io::Result<Vec<Xattr>> {
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
                crate::extents::copy_exactly(file, n, out)?;
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
        if let Some(extents) = crate::extents::data_extents(&file, &opened).map_err(read_err(host))? {
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
            Ok(false) => crate::extents::copy_exactly(&file, len, out),
            Err(e) => Err(e),
        };
        let pad = (512 - len % 512) % 512;
        appended.and_then(|()| out.write_all(&[0; 512][..pad as usize])).map_err(e).map(|()| false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{symlink, PermissionsExt};

    /// Unpack the uncompressed delta tar at `tar` into `out` (made here)
    /// as an image layer is; returns `out`.
    fn unpack_tar(tar: &Path, stats: &DeltaStats, diff_id: &str, out: &Path) -> PathBuf {
        let digest: crate::oci::Digest = format!("sha256:{diff_id}").parse().unwrap();
        let layer = crate::oci::LayerSource {
            blob_path: tar.to_path_buf(),
            digest: digest.clone(),
            size: stats.tar_bytes,
            media_type: "application/vnd.oci.image.layer.v1.tar".into(),
            diff_id: digest,
            compression: crate::oci::Compression::None,
        };
        fs::create_dir(out).unwrap();
        crate::oci::unpack_layer(&layer, out).unwrap();
        out.to_path_buf()
    }

    fn entries(tar_bytes: &[u8]) -> Vec<(String, tar::EntryType, Vec<u8>)> {
        let mut a = tar::Archive::new(tar_bytes);
        a.entries()
            .unwrap()
            .map(|e| {
                let mut e = e.unwrap();
                let path = e.path().unwrap().display().to_string();
                let kind = e.header().entry_type();
                let mut data = Vec::new();
                if kind == tar::EntryType::Link || kind == tar::EntryType::Symlink {
                    data = e.link_name_bytes().unwrap().to_vec();
                } else {
                    io::Read::read_to_end(&mut e, &mut data).unwrap();
                }
                (path, kind, data)
            })
            .collect()
    }

    /// Takes at most 1000 bytes per write, as a pipe or a socket may.
    struct Short(Vec<u8>);

    impl Write for Short {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            let n = buf.len().min(1000);
            self.0.extend_from_slice(&buf[..n]);
            Ok(n)
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn hashing_beside_hashes_what_the_inner_writer_took() {
        let chunk = HashBeside::<Short>::CHUNK;
        for len in [0, 1, chunk - 1, chunk, chunk + 1, 3 * chunk + 4321] {
            let data: Vec<u8> = (0..len).map(|i| (i * 7 + i / 4099) as u8).collect();
            let mut w = HashBeside::new(Short(Vec::new())).unwrap();
            // Pieces of odd sizes, crossing chunk ends anywhere.
            for piece in data.chunks(77_777) {
                w.write_all(piece).unwrap();
            }
            let (inner, hex, n) = w.finish().unwrap();
            assert!(inner.0 == data, "{len} bytes: the inner writer got other bytes");
            assert_eq!(n, len as u64);
            assert_eq!(hex, hex::encode(Sha256::digest(&data)), "{len} bytes");
        }
    }

    #[test]
    fn pax_records_count_their_own_length() {
        assert_eq!(pax_record(b"a", b"b"), b"6 a=b\n");
        let r = pax_record(b"SCHILY.xattr.user.x", &[b'v'; 90]);
        let len: usize =
            std::str::from_utf8(&r[..r.iter().position(|&c| c == b' ').unwrap()]).unwrap().parse().unwrap();
        assert_eq!(len, r.len());
    }

    #[test]
    fn delta_is_sorted_complete_and_deterministic() {
        let t = tempfile::tempdir().unwrap();
        let u = t.path();
        fs::create_dir_all(u.join("b/deep")).unwrap();
        fs::write(u.join("b/deep/f"), b"data").unwrap();
        fs::write(u.join("a"), b"").unwrap();
        fs::hard_link(u.join("b/deep/f"), u.join("c-link")).unwrap();
        symlink("/b/deep/f", u.join("s")).unwrap();
        fs::write(u.join("x"), b"exec").unwrap();
        fs::set_permissions(u.join("x"), fs::Permissions::from_mode(0o4755)).unwrap();
        let long = "n".repeat(150);
        fs::write(u.join(&long), b"long").unwrap();
        nix::unistd::mkfifo(&u.join("p"), nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();

        let mut one = Vec::new();
        let (stats, diff_id) = write_delta(u, &mut one).unwrap();
        let mut two = Vec::new();
        let (_, diff_id2) = write_delta(u, &mut two).unwrap();
        assert_eq!(one, two, "same tree, same bytes");
        assert_eq!(diff_id, diff_id2);
        assert_eq!(diff_id, hex::encode(Sha256::digest(&one)));
        assert_eq!(stats.tar_bytes, one.len() as u64);
        assert_eq!(stats.hardlinks, 1);

        let got = entries(&one);
        let names: Vec<&str> = got.iter().map(|e| e.0.as_str()).collect();
        assert_eq!(names, vec!["a", "b", "b/deep", "b/deep/f", "c-link", long.as_str(), "p", "s", "x"]);
        let by = |n: &str| got.iter().find(|e| e.0 == n).unwrap().clone();
        assert_eq!(by("b/deep/f").2, b"data");
        assert_eq!((by("c-link").1, by("c-link").2), (tar::EntryType::Link, b"b/deep/f".to_vec()));
        assert_eq!((by("s").1, by("s").2), (tar::EntryType::Symlink, b"/b/deep/f".to_vec()));
        assert_eq!(by("p").1, tar::EntryType::Fifo);
        assert_eq!(by(&long).2, b"long");
        let mut a = tar::Archive::new(&one[..]);
        let x = a.entries().unwrap().map(|e| e.unwrap()).find(|e| e.path().unwrap().ends_with("x")).unwrap();
        assert_eq!(x.header().mode().unwrap(), 0o4755);
    }

    #[test]
    fn names_the_layer_format_reserves_are_refused() {
        for name in [".wh.passwd", ".wh..wh..opq", ".wh."] {
            let t = tempfile::tempdir().unwrap();
            fs::create_dir(t.path().join("etc")).unwrap();
            fs::write(t.path().join("etc").join(name), b"").unwrap();
            let e = write_delta(t.path(), &mut Vec::new()).unwrap_err();
            assert!(e.is_content(), "{e}");
            assert!(e.to_string().contains(&format!("etc/{name}")), "{e}");
        }
        // Elsewhere in a name it is an ordinary name.
        let t = tempfile::tempdir().unwrap();
        fs::write(t.path().join("a.wh.b"), b"").unwrap();
        write_delta(t.path(), &mut Vec::new()).unwrap();
    }

    #[test]
    fn symlink_targets_are_kept_byte_for_byte() {
        let t = tempfile::tempdir().unwrap();
        let long_target = format!("a//b/{}//./../c/", "x".repeat(140));
        let targets: Vec<&str> = vec!["/", "a//b", "./x/", "..//..", "//etc//passwd", "", long_target.as_str()];
        for (i, target) in targets.iter().enumerate() {
            if !target.is_empty() {
                symlink(target, t.path().join(format!("l{i}"))).unwrap();
            }
        }
        let mut out = Vec::new();
        write_delta(t.path(), &mut out).unwrap();
        let got = entries(&out);
        for (i, target) in targets.iter().enumerate().filter(|(_, t)| !t.is_empty()) {
            let e = got.iter().find(|e| e.0 == format!("l{i}")).unwrap();
            assert_eq!(
                (e.1, String::from_utf8_lossy(&e.2).into_owned()),
                (tar::EntryType::Symlink, target.to_string())
            );
        }
    }

    #[test]
    fn user_xattrs_are_kept_in_pax_headers() {
        let t = tempfile::tempdir().unwrap();
        fs::write(t.path().join("f"), b"x").unwrap();
        let c = CString::new(t.path().join("f").as_os_str().as_bytes()).unwrap();
        strata_shim::sys::lsetxattr(&c, c"user.note", b"hello").unwrap();
        let mut out = Vec::new();
        write_delta(t.path(), &mut out).unwrap();
        let mut a = tar::Archive::new(&out[..]);
        let mut e = a.entries().unwrap().next().unwrap().unwrap();
        let pax: Vec<(String, Vec<u8>)> = e
            .pax_extensions()
            .unwrap()
            .unwrap()
            .map(|r| {
                let r = r.unwrap();
                (r.key().unwrap().to_string(), r.value_bytes().to_vec())
            })
            .collect();
        assert_eq!(pax, vec![("SCHILY.xattr.user.note".to_string(), b"hello".to_vec())]);
    }

    /// Whiteouts and opaque dirs need root (mknod 0/0, trusted.* xattrs).
    /// A sparse file's tar costs its data; unpacked, its holes stay holes.
    #[test]
    #[ignore = "needs root"]
    fn sparse_files_cost_their_data_and_keep_their_holes() {
        use std::os::unix::fs::FileExt;
        assert!(nix::unistd::geteuid().is_root(), "run as root (scripts/test.sh does)");
        let t = tempfile::tempdir().unwrap();
        let upper = t.path().join("upper");
        fs::create_dir_all(&upper).unwrap();
        // 16 GiB of nothing; 1 GiB with data at both ends and in between
        // (nine extents); a small dense file beside them.
        let empty = File::create(upper.join("empty16g")).unwrap();
        empty.set_len(16 << 30).unwrap();
        let holey = File::create(upper.join("holey")).unwrap();
        holey.set_len(1 << 30).unwrap();
        let marks: Vec<u64> = (0..8).map(|i| i * (128 << 20)).chain([(1 << 30) - 64]).collect();
        for &at in &marks {
            holey.write_all_at(format!("mark{at}").as_bytes(), at).unwrap();
        }
        fs::write(upper.join("dense"), vec![3u8; 100_000]).unwrap();

        let started = std::time::Instant::now();
        let tar_path = t.path().join("layer.tar");
        let (stats, diff_id) = write_delta(&upper, File::create(&tar_path).unwrap()).unwrap();
        assert!(stats.tar_bytes < 1 << 20, "the tar holds the holes: {} bytes", stats.tar_bytes);
        assert_eq!(stats.bytes, (16 << 30) + (1 << 30) + 100_000);
        // Regular entries, the sparse ones in PAX format 1.0 (a reader that
        // knows no sparse format sees the map and the data).
        let bytes = fs::read(&tar_path).unwrap();
        let mut a = tar::Archive::new(&bytes[..]);
        let mut seen = Vec::new();
        for e in a.entries().unwrap() {
            let mut e = e.unwrap();
            let path = e.path().unwrap().display().to_string();
            let mut records = Vec::new();
            for r in e.pax_extensions().unwrap().into_iter().flatten() {
                let r = r.unwrap();
                records.push(format!("{}={}", r.key().unwrap(), r.value().unwrap()));
            }
            assert_eq!(e.header().entry_type(), tar::EntryType::Regular);
            seen.push((path, records.join(" "), e.size()));
        }
        let sparse = |name: &str, size: u64| {
            format!("GNU.sparse.major=1 GNU.sparse.minor=0 GNU.sparse.name={name} GNU.sparse.realsize={size}")
        };
        assert_eq!(seen[0], ("dense".to_string(), String::new(), 100_000));
        assert_eq!(seen[1], ("empty16g".to_string(), sparse("empty16g", 16 << 30), 512));
        assert_eq!((&seen[2].0, &seen[2].1), (&"holey".to_string(), &sparse("holey", 1 << 30)));
        assert!(seen[2].2 < 64 << 10, "{seen:?}");
        // The same tree, the same bytes.
        let (_, again) = write_delta(&upper, io::sink()).unwrap();
        assert_eq!(again, diff_id);

        let out = unpack_tar(&tar_path, &stats, &diff_id, &t.path().join("out"));
        assert!(started.elapsed().as_secs() < 10, "took {:?}", started.elapsed());
        for (name, len) in [("empty16g", 16u64 << 30), ("holey", 1 << 30)] {
            let m = fs::metadata(out.join(name)).unwrap();
            assert_eq!(m.len(), len, "{name}");
            assert!(m.blocks() * 512 < 1 << 20, "{name} was written out: {} blocks", m.blocks());
        }
        let got = File::open(out.join("holey")).unwrap();
        for &at in &marks {
            let want = format!("mark{at}");
            let mut buf = vec![0u8; want.len()];
            got.read_exact_at(&mut buf, at).unwrap();
            assert_eq!(buf, want.as_bytes(), "at {at}");
        }
        let mut gap = [1u8; 4096];
        got.read_exact_at(&mut gap, 64 << 20).unwrap();
        assert_eq!(gap, [0u8; 4096]);
        assert_eq!(fs::read(out.join("dense")).unwrap(), vec![3u8; 100_000]);
        // Nothing else was made beside the destination.
        assert_eq!(fs::read_dir(t.path()).unwrap().count(), 3, "upper, layer.tar, out");
    }

    /// Round trip: overlay form → OCI tar → `oci::unpack` → overlay form.
    #[test]
    #[ignore = "needs root"]
    fn whiteouts_and_opaque_dirs_round_trip_through_unpack() {
        assert!(nix::unistd::geteuid().is_root(), "run as root (scripts/test.sh does)");
        use nix::sys::stat::{makedev, mknod, Mode, SFlag};
        let t = tempfile::tempdir().unwrap();
        let upper = t.path().join("upper");
        fs::create_dir_all(upper.join("d/sub")).unwrap();
        fs::write(upper.join("d/sub/new"), b"n").unwrap();
        fs::hard_link(upper.join("d/sub/new"), upper.join("d/link")).unwrap();
        symlink("sub/new", upper.join("d/sym")).unwrap();
        nix::unistd::mkfifo(&upper.join("d/fifo"), Mode::from_bits_truncate(0o600)).unwrap();
        mknod(&upper.join("gone"), SFlag::S_IFCHR, Mode::empty(), makedev(0, 0)).unwrap();
        let c = CString::new(upper.join("d").as_os_str().as_bytes()).unwrap();
        strata_shim::sys::lsetxattr(&c, c"trusted.overlay.opaque", b"y").unwrap();
        strata_shim::sys::lsetxattr(&c, c"trusted.overlay.origin", b"junk").unwrap();

        let tar_path = t.path().join("layer.tar");
        let (stats, diff_id) = write_delta(&upper, File::create(&tar_path).unwrap()).unwrap();
        assert_eq!((stats.whiteouts, stats.opaque_dirs), (1, 1));
        let names: Vec<String> = entries(&fs::read(&tar_path).unwrap()).into_iter().map(|e| e.0).collect();
        assert_eq!(names, vec!["d", "d/.wh..wh..opq", "d/fifo", "d/link", "d/sub", "d/sub/new", "d/sym", ".wh.gone"]);

        let out = unpack_tar(&tar_path, &stats, &diff_id, &t.path().join("out"));
        let gone = fs::symlink_metadata(out.join("gone")).unwrap();
        assert!(gone.file_type().is_char_device() && gone.rdev() == 0, "whiteout restored");
        let dc = CString::new(out.join("d").as_os_str().as_bytes()).unwrap();
        assert_eq!(strata_shim::sys::lgetxattr(&dc, c"trusted.overlay.opaque").unwrap(), b"y");
        assert!(strata_shim::sys::lgetxattr(&dc, c"trusted.overlay.origin").is_err(), "bookkeeping leaked");
        assert_eq!(fs::read(out.join("d/sub/new")).unwrap(), b"n");
        assert_eq!(fs::metadata(out.join("d/sub/new")).unwrap().ino(), fs::metadata(out.join("d/link")).unwrap().ino());
        assert_eq!(fs::read_link(out.join("d/sym")).unwrap(), Path::new("sub/new"));
        assert!(fs::symlink_metadata(out.join("d/fifo")).unwrap().file_type().is_fifo());

        // The same upper as changes against a lower that had `gone` and `d/x`.
        let lower = t.path().join("lower");
        fs::create_dir_all(lower.join("d")).unwrap();
        fs::write(lower.join("gone"), b"g").unwrap();
        fs::write(lower.join("d/x"), b"x").unwrap();
        let got: Vec<String> =
            changes(&upper, &[lower]).unwrap().iter().map(|c| format!("{} {}", c.kind, c.path)).collect();
        assert_eq!(
            got,
            vec!["C /d", "A /d/fifo", "A /d/link", "A /d/sub", "A /d/sub/new", "A /d/sym", "D /d/x", "D /gone"]
        );
    }

    #[test]
    fn changes_against_lowers() {
        let t = tempfile::tempdir().unwrap();
        let (lower, upper) = (t.path().join("lower"), t.path().join("upper"));
        for d in ["etc", "keep", "opq/old"] {
            fs::create_dir_all(lower.join(d)).unwrap();
        }
        fs::write(lower.join("etc/conf"), b"1").unwrap();
        fs::create_dir_all(upper.join("etc")).unwrap();
        fs::write(upper.join("etc/conf"), b"2").unwrap();
        fs::write(upper.join("etc/added"), b"n").unwrap();
        let got = changes(&upper, std::slice::from_ref(&lower)).unwrap();
        let got: Vec<(char, &str)> = got.iter().map(|c| (c.kind, c.path.as_str())).collect();
        assert_eq!(got, vec![('C', "/etc"), ('A', "/etc/added"), ('C', "/etc/conf")]);
    }

    /// Needs root for whiteouts and the trusted opaque xattr.
    #[test]
    #[ignore = "needs root"]
    fn flatten_merges_layers_and_keeps_what_hides_the_base() {
        assert!(nix::unistd::geteuid().is_root(), "run as root (scripts/test.sh does)");
        use nix::sys::stat::{makedev, mknod, Mode, SFlag};
        let t = tempfile::tempdir().unwrap();
        let (l1, l2, out) = (t.path().join("l1"), t.path().join("l2"), t.path().join("out"));
        for d in [&l1, &l2, &out] {
            fs::create_dir_all(d).unwrap();
        }
        // l1 adds a, d/x, d/y and hides base file b.
        fs::write(l1.join("a"), b"1").unwrap();
        fs::create_dir(l1.join("d")).unwrap();
        fs::write(l1.join("d/x"), b"x").unwrap();
        fs::write(l1.join("d/y"), b"y").unwrap();
        mknod(&l1.join("b"), SFlag::S_IFCHR, Mode::empty(), makedev(0, 0)).unwrap();
        // l2 changes a, deletes d/x, makes e an opaque dir with a hardlink pair.
        fs::write(l2.join("a"), b"2").unwrap();
        fs::create_dir(l2.join("d")).unwrap();
        mknod(&l2.join("d/x"), SFlag::S_IFCHR, Mode::empty(), makedev(0, 0)).unwrap();
        fs::create_dir(l2.join("e")).unwrap();
        let c = CString::new(l2.join("e").as_os_str().as_bytes()).unwrap();
        strata_shim::sys::lsetxattr(&c, c"trusted.overlay.opaque", b"y").unwrap();
        fs::write(l2.join("e/new"), b"n").unwrap();
        fs::hard_link(l2.join("e/new"), l2.join("e/link")).unwrap();

        flatten(&[l1, l2], &out).unwrap();
        assert_eq!(fs::read(out.join("a")).unwrap(), b"2");
        assert_eq!(fs::read(out.join("d/y")).unwrap(), b"y");
        let wh = |p: &str| fs::symlink_metadata(out.join(p)).map(|m| m.file_type().is_char_device()).unwrap_or(false);
        assert!(wh("b") && wh("d/x"), "whiteouts kept against the base");
        let ce = CString::new(out.join("e").as_os_str().as_bytes()).unwrap();
        assert_eq!(strata_shim::sys::lgetxattr(&ce, c"trusted.overlay.opaque").unwrap(), b"y");
        assert_eq!(fs::metadata(out.join("e/new")).unwrap().ino(), fs::metadata(out.join("e/link")).unwrap().ino());
    }

    #[test]
    #[ignore = "needs root"]
    fn a_directory_of_the_merged_view_becomes_a_layer_of_its_own() {
        assert!(nix::unistd::geteuid().is_root(), "run as root (scripts/test.sh does)");
        use nix::sys::stat::{makedev, mknod, Mode, SFlag};
        let t = tempfile::tempdir().unwrap();
        let [base, mid, top, out] = ["base", "mid", "top", "out"].map(|n| t.path().join(n));
        for d in [&base, &mid, &top, &out] {
            fs::create_dir_all(d).unwrap();
        }
        // base: src/app/{old,keep}, src/other, etc/secret.
        fs::create_dir_all(base.join("src/app")).unwrap();
        fs::write(base.join("src/app/old"), b"o").unwrap();
        fs::write(base.join("src/app/keep"), b"k").unwrap();
        fs::write(base.join("src/other"), b"x").unwrap();
        fs::create_dir(base.join("etc")).unwrap();
        fs::write(base.join("etc/secret"), b"s").unwrap();
        // mid: deletes src/app/old, adds src/app/d (opaque, hiding nothing).
        fs::create_dir_all(mid.join("src/app/d")).unwrap();
        mknod(&mid.join("src/app/old"), SFlag::S_IFCHR, Mode::empty(), makedev(0, 0)).unwrap();
        fs::write(mid.join("src/app/d/f"), b"f").unwrap();
        // top (the upper): changes keep, adds a socket-free file.
        fs::create_dir_all(top.join("src/app")).unwrap();
        fs::write(top.join("src/app/keep"), b"K").unwrap();
        let layers = [top.clone(), mid.clone(), base.clone()];
        layer_of_dir(&layers, Path::new("src/app"), &out).unwrap();
        let mut names = Vec::new();
        for e in walkdir(&out) {
            names.push(e.strip_prefix(&out).unwrap().display().to_string());
        }
        names.sort();
        assert_eq!(names, ["src", "src/app", "src/app/d", "src/app/d/f", "src/app/keep"]);
        assert_eq!(fs::read(out.join("src/app/keep")).unwrap(), b"K");
        let c = CString::new(out.join("src/app").as_os_str().as_bytes()).unwrap();
        assert_eq!(strata_shim::sys::lgetxattr(&c, c"trusted.overlay.opaque").unwrap(), b"y");
        // An ancestor that is a symlink is never followed.
        let out2 = t.path().join("out2");
        fs::create_dir(&out2).unwrap();
        std::os::unix::fs::symlink("/etc", top.join("lnk")).unwrap();
        let e = layer_of_dir(&layers, Path::new("lnk"), &out2).unwrap_err();
        assert!(matches!(e, DiffError::NotADirectory { .. }), "{e}");
        // A directory an upper layer deleted is not there.
        mknod(&top.join("etc"), SFlag::S_IFCHR, Mode::empty(), makedev(0, 0)).unwrap();
        let e = layer_of_dir(&layers, Path::new("etc"), &out2).unwrap_err();
        assert!(matches!(e, DiffError::NotADirectory { .. }), "{e}");
    }

    /// Every path under `dir`, not following symlinks.
    fn walkdir(dir: &Path) -> Vec<PathBuf> {
        let mut out = Vec::new();
        for e in fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            out.push(p.clone());
            if fs::symlink_metadata(&p).unwrap().is_dir() {
                out.extend(walkdir(&p));
            }
        }
        out
    }

    /// A tree that changes while it is written (a directory swapped with a
    /// symlink to outside it, over and over, and a file with a FIFO) makes
    /// the walk fail or read the tree, never what a symlink points to, and
    /// never blocks.
    #[test]
    fn a_changing_tree_never_leads_the_walk_outside() {
        use nix::fcntl::{renameat2, RenameFlags};
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("x"), b"SECRET").unwrap();
        nix::unistd::mkfifo(&outside.path().join("fifo"), nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        let tree = tempfile::tempdir().unwrap();
        let t = tree.path();
        std::fs::create_dir(t.join("d")).unwrap();
        std::fs::write(t.join("d/x"), b"inner").unwrap();
        symlink(outside.path(), t.join("s")).unwrap();
        std::fs::write(t.join("f"), b"file").unwrap();
        symlink(outside.path().join("fifo"), t.join("p")).unwrap();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let swapper = {
            let (t, stop) = (t.to_path_buf(), stop.clone());
            std::thread::spawn(move || {
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    for (a, b) in [("d", "s"), ("f", "p")] {
                        renameat2(None, &t.join(a), None, &t.join(b), RenameFlags::RENAME_EXCHANGE).unwrap();
                    }
                }
            })
        };
        let (mut ok, mut failed) = (0, 0);
        let until = std::time::Instant::now() + std::time::Duration::from_secs(2);
        while std::time::Instant::now() < until {
            let mut out = Vec::new();
            match write_delta(t, &mut out) {
                Ok(_) => {
                    ok += 1;
                    assert!(!out.windows(6).any(|w| w == b"SECRET"), "the walk followed a swapped-in symlink");
                }
                Err(DiffError::Read { .. }) => failed += 1,
                Err(e) => panic!("{e}"),
            }
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        swapper.join().unwrap();
        assert!(ok + failed > 100, "{ok} walks, {failed} failed");
    }

    /// A walk down a deep tree holds a few descriptors, not one per level
    /// (a sandbox's tree of 512 levels must not exhaust the daemon's).
    #[test]
    fn a_deep_walk_holds_few_descriptors() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        static OPEN_AT_BOTTOM: AtomicUsize = AtomicUsize::new(0);
        fn count(_: &mut Vec<u8>, _: &File, _: &fs::Metadata) -> io::Result<bool> {
            OPEN_AT_BOTTOM.store(fs::read_dir("/proc/self/fd")?.count(), Ordering::SeqCst);
            Ok(false)
        }
        let tree = tempfile::tempdir().unwrap();
        let mut deep = tree.path().to_path_buf();
        for _ in 0..300 {
            deep.push("d");
        }
        fs::create_dir_all(&deep).unwrap();
        fs::write(deep.join("bottom"), b"x").unwrap();
        let before = fs::read_dir("/proc/self/fd").unwrap().count();
        let (stats, _) = write_delta_unhashed(tree.path(), Vec::new(), Some(count), None).unwrap();
        assert_eq!(stats.entries, 301);
        let held = OPEN_AT_BOTTOM.load(Ordering::SeqCst).saturating_sub(before);
        // Other tests run alongside and open files too: a margin.
        assert!(held < 100, "{held} more descriptors open at the bottom of 300 levels");
    }

    #[test]
    fn overlay_bookkeeping_is_never_kept() {
        assert!(!keep_xattr(b"trusted.overlay.origin"));
        assert!(!keep_xattr(b"trusted.overlay.opaque"));
        assert!(keep_xattr(b"security.capability"));
        assert!(keep_xattr(b"user.x"));
    }
}

/// One change of a delta, as `docker diff` prints it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Change {
    /// `A` added, `C` changed, `D` deleted.
    pub kind: char,
    /// Absolute path inside the sandbox.
    pub path: String,
}

/// Does `rel` exist in the merged view of `lowers` (topmost first)? A
/// whiteout or an opaque parent in an upper lower hides what is below.
/// `lower/rel`, if every ancestor of it inside `lower` is a real directory:
/// never follow a symlink in a layer to a path outside it (a layer holding
/// `d -> /` must not make `d/x` mean the host's `/x`).
fn in_layer(lower: &Path, rel: &Path) -> Option<PathBuf> {
    let mut p = lower.to_path_buf();
    let comps: Vec<_> = rel.components().collect();
    for (i, c) in comps.iter().enumerate() {
        p.push(c);
        if i + 1 < comps.len() && !fs::symlink_metadata(&p).map(|m| m.is_dir()).unwrap_or(false) {
            return None;
        }
    }
    Some(p)
}

fn in_lowers(lowers: &[PathBuf], rel: &Path) -> bool {
    find_in(lowers, rel).is_some()
}

/// Where `rel` of the merged view of `lowers` (topmost first) is: the
/// path in the topmost layer that has it; `None` if no layer has it or a
/// whiteout or an opaque directory hides it.
pub(crate) fn find_in(lowers: &[PathBuf], rel: &Path) -> Option<PathBuf> {
    for lower in lowers {
        let Some(path) = in_layer(lower, rel) else { continue };
        match fs::symlink_metadata(&path) {
            Ok(m) if m.file_type().is_char_device() && m.rdev() == 0 => return None,
            Ok(_) => return Some(path),
            Err(_) => {
                // An opaque ancestor in this layer hides everything below it.
                let mut anc = rel.parent();
                while let Some(a) = anc.filter(|a| !a.as_os_str().is_empty()) {
                    if xattrs(&lower.join(a))
                        .map(|x| x.iter().any(|(n, v)| n == OPAQUE_XATTR.as_bytes() && v == b"y"))
                        .unwrap_or(false)
                    {
                        return None;
                    }
                    anc = a.parent();
                }
            }
        }
    }
    None
}

/// Names in the merged view of `lowers` under directory `rel`.
pub(crate) fn lower_children(lowers: &[PathBuf], rel: &Path) -> Vec<std::ffi::OsString> {
    let mut names: Vec<std::ffi::OsString> = Vec::new();
    for lower in lowers {
        let Some(dir) = in_layer(lower, rel) else { continue };
        if !fs::symlink_metadata(&dir).map(|m| m.is_dir()).unwrap_or(false) {
            continue;
        }
        if let Ok(rd) = fs::read_dir(&dir) {
            for e in rd.flatten() {
                if !names.contains(&e.file_name()) && in_lowers(lowers, &rel.join(e.file_name())) {
                    names.push(e.file_name());
                }
            }
        }
    }
    names.sort_by(|a, b| a.as_bytes().cmp(b.as_bytes()));
    names
}

/// The changes an upper (or a snapshot's delta layer) makes to `lowers`
/// (layer trees, topmost first), sorted by path.
pub fn changes(upper: &Path, lowers: &[PathBuf]) -> Result<Vec<Change>, DiffError> {
    fn walk(upper: &Path, rel: &Path, lowers: &[PathBuf], out: &mut Vec<Change>) -> Result<(), DiffError> {
        descend(rel)?;
        let dir = upper.join(rel);
        let names = sorted_names(&dir)?;
        for name in names {
            let r = rel.join(&name);
            let host = upper.join(&r);
            let meta = fs::symlink_metadata(&host).map_err(read_err(&host))?;
            let path = format!("/{}", r.display());
            if meta.file_type().is_char_device() && meta.rdev() == 0 {
                if in_lowers(lowers, &r) {
                    out.push(Change { kind: 'D', path });
                }
                continue;
            }
            let existed = in_lowers(lowers, &r);
            out.push(Change { kind: if existed { 'C' } else { 'A' }, path });
            if meta.is_dir() {
                let opaque = xattrs(&host)?.iter().any(|(n, v)| n == OPAQUE_XATTR.as_bytes() && v == b"y");
                if opaque && existed {
                    // Everything the lowers had here and the upper lacks is gone.
                    for child in lower_children(lowers, &r) {
                        if fs::symlink_metadata(host.join(&child)).is_err() {
                            out.push(Change { kind: 'D', path: format!("/{}", r.join(&child).display()) });
                        }
                    }
                }
                walk(upper, &r, lowers, out)?;
            }
        }
        Ok(())
    }
    let mut out = Vec::new();
    walk(upper, Path::new(""), lowers, &mut out)?;
    out.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(out)
}

/// Flatten overlay-form layers (bottom first) into one overlay-form tree at
/// `dest` (an empty directory): the merged view of the layers, keeping the
/// whiteouts and opaque markers that still matter for whatever lies below
/// them. Used to compact a long snapshot chain into one layer; copies file
/// data (hardlinks within a layer stay hardlinks).
pub fn flatten(layers: &[PathBuf], dest: &Path) -> Result<u64, DiffError> {
    let mut copied = 0;
    for layer in layers {
        let mut links = HashMap::new();
        apply(layer, dest, Path::new(""), Form::Layer, &mut links, &mut copied)?;
    }
    Ok(copied)
}

/// What [`apply`] makes: an overlay-form layer (whiteouts and opaque
/// markers kept for what lies below) or a plain tree (the merged view: a
/// whiteout only removes, overlay's xattrs are dropped, sockets skipped).
#[derive(Clone, Copy, PartialEq)]
enum Form {
    Layer,
    Merged,
}

/// A layer holding the directory `rel` of the merged view of the
/// overlay-form `layers` (topmost first) whole, made at `dest` (an empty
/// directory): `rel`'s ancestors as directories with the merged view's
/// metadata, `rel` itself opaque (whatever lies below it in other layers is
/// hidden), and below it what a mount of `layers` shows there (owners,
/// modes, `user.*` and capability xattrs, mtimes, hardlinks within a layer;
/// no whiteouts). A baseline is such a layer: the repository, and nothing
/// else of the sandbox (`daemon/baseline.rs`).
///
/// No symlink is followed: an ancestor of `rel` that is a symlink (or any
/// other non-directory) in the layer that decides it makes `rel` not a
/// directory ([`DiffError::NotADirectory`]). The caller keeps `layers`
/// still while it runs (a sandbox's upper: frozen). Returns the bytes of
/// file data copied.
pub fn layer_of_dir(layers: &[PathBuf], rel: &Path, dest: &Path) -> Result<u64, DiffError> {
    let comps: Vec<&OsStr> = rel
        .components()
        .map(|c| match c {
            std::path::Component::Normal(n) => Ok(n),
            _ => Err(DiffError::NotADirectory { path: rel.into() }),
        })
        .collect::<Result<_, _>>()?;
    if comps.is_empty() {
        return Err(DiffError::NotADirectory { path: rel.into() });
    }
    descend(rel)?;
    let opaque = |p: &Path| -> Result<bool, DiffError> {
        Ok(xattrs(p)?.iter().any(|(n, v)| n == OPAQUE_XATTR.as_bytes() && v == b"y"))
    };
    // The layers that show something at `rel`, topmost first, and for each
    // ancestor the topmost layer where it is a directory (its metadata).
    let mut shown: Vec<&PathBuf> = Vec::new();
    let mut ancestors: Vec<Option<PathBuf>> = vec![None; comps.len() - 1];
    'layers: for layer in layers {
        let mut p = layer.clone();
        let mut hides_below = false;
        for (i, c) in comps.iter().enumerate() {
            p.push(c);
            let meta = match fs::symlink_metadata(&p) {
                Ok(m) => m,
                Err(e) if e.kind() == io::ErrorKind::NotFound => {
                    if hides_below {
                        break 'layers;
                    }
                    continue 'layers;
                }
                Err(e) => return Err(DiffError::Read { path: p, source: e }),
            };
            if !meta.is_dir() {
                // A whiteout, a file or a symlink: `rel` is hidden below here
                // (and is no directory at all if nothing above showed it).
                if shown.is_empty() {
                    return Err(DiffError::NotADirectory { path: rel.into() });
                }
                break 'layers;
            }
            hides_below |= opaque(&p)?;
            match ancestors.get_mut(i) {
                Some(slot) => {
                    slot.get_or_insert_with(|| p.clone());
                }
                None => shown.push(layer),
            }
        }
        if hides_below {
            break;
        }
    }
    let Some(top) = shown.first() else {
        return Err(DiffError::NotADirectory { path: rel.into() });
    };
    let mut d = dest.to_path_buf();
    for (c, src) in comps.iter().zip(&ancestors) {
        d.push(c);
        fs::create_dir(&d).map_err(|source| DiffError::Write { path: d.clone(), source })?;
        if let Some(src) = src {
            let meta = fs::symlink_metadata(src).map_err(read_err(src))?;
            copy_meta(src, &meta, &d, Form::Merged)?;
        }
    }
    let target = dest.join(rel);
    fs::create_dir(&target).map_err(|source| DiffError::Write { path: target.clone(), source })?;
    let mut copied = 0;
    for layer in shown.iter().rev() {
        let mut links = HashMap::new();
        apply(layer, dest, rel, Form::Merged, &mut links, &mut copied)?;
    }
    let src = top.join(rel);
    let meta = fs::symlink_metadata(&src).map_err(read_err(&src))?;
    copy_meta(&src, &meta, &target, Form::Merged)?;
    let c = CString::new(target.as_os_str().as_bytes()).unwrap_or_default();
    let name = CString::new(OPAQUE_XATTR).unwrap_or_default();
    strata_shim::sys::lsetxattr(&c, &name, b"y")
        .map_err(|e| DiffError::Write { path: target.clone(), source: e.into() })?;
    Ok(copied)
}

fn remove_any(p: &Path) -> Result<(), DiffError> {
    match fs::symlink_metadata(p) {
        Ok(m) if m.is_dir() => fs::remove_dir_all(p).map_err(read_err(p)),
        Ok(_) => fs::remove_file(p).map_err(read_err(p)),
        Err(_) => Ok(()),
    }
}

/// Copy owner, mode, xattrs (for a layer all, including the opaque
/// marker; for a merged tree those a delta keeps) and mtime.
fn copy_meta(src: &Path, meta: &fs::Metadata, dst: &Path, form: Form) -> Result<(), DiffError> {
    use nix::sys::stat::{utimensat, UtimensatFlags};
    use nix::sys::time::TimeSpec;
    let werr = |e: nix::errno::Errno| DiffError::Write { path: dst.into(), source: e.into() };
    nix::unistd::fchownat(
        None,
        dst,
        Some(nix::unistd::Uid::from_raw(meta.uid())),
        Some(nix::unistd::Gid::from_raw(meta.gid())),
        nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
    )
    .map_err(werr)?;
    if !meta.file_type().is_symlink() {
        fs::set_permissions(dst, std::os::unix::fs::PermissionsExt::from_mode(meta.mode() & 0o7777))
            .map_err(|source| DiffError::Write { path: dst.into(), source })?;
    }
    let cdst = CString::new(dst.as_os_str().as_bytes()).unwrap_or_default();
    for (name, value) in xattrs(src)? {
        if form == Form::Merged && !keep_xattr(&name) {
            continue;
        }
        let n = CString::new(name).unwrap_or_default();
        strata_shim::sys::lsetxattr(&cdst, &n, &value).map_err(werr)?;
    }
    let t = TimeSpec::new(meta.mtime(), meta.mtime_nsec());
    utimensat(None, dst, &t, &t, UtimensatFlags::NoFollowSymlink).map_err(werr)
}

fn apply(
    layer: &Path,
    dest: &Path,
    rel: &Path,
    form: Form,
    links: &mut HashMap<(u64, u64), PathBuf>,
    copied: &mut u64,
) -> Result<(), DiffError> {
    descend(rel)?;
    let dir = layer.join(rel);
    let names = sorted_names(&dir)?;
    let mut dirs = Vec::new();
    for name in names {
        let r = rel.join(&name);
        let src = layer.join(&r);
        let dst = dest.join(&r);
        let meta = fs::symlink_metadata(&src).map_err(read_err(&src))?;
        let ft = meta.file_type();
        let werr = |source| DiffError::Write { path: dst.clone(), source };
        if ft.is_dir() {
            let opaque = xattrs(&src)?.iter().any(|(n, v)| n == OPAQUE_XATTR.as_bytes() && v == b"y");
            let is_dir = fs::symlink_metadata(&dst).map(|m| m.is_dir()).unwrap_or(false);
            if opaque || !is_dir {
                // An opaque directory replaces whatever was below it.
                remove_any(&dst)?;
                fs::create_dir(&dst).map_err(werr)?;
            }
            apply(layer, dest, &r, form, links, copied)?;
            dirs.push((src, meta, dst));
            continue;
        }
        remove_any(&dst)?;
        if form == Form::Merged && ((ft.is_char_device() && meta.rdev() == 0) || ft.is_socket()) {
            // Deleted (a whiteout removes only), or a socket (no content).
            continue;
        }
        if ft.is_char_device() && meta.rdev() == 0 {
            nix::sys::stat::mknod(&dst, nix::sys::stat::SFlag::S_IFCHR, nix::sys::stat::Mode::empty(), 0)
                .map_err(|e| werr(e.into()))?;
            continue;
        }
        if meta.nlink() > 1 {
            if let Some(first) = links.get(&(meta.dev(), meta.ino())) {
                fs::hard_link(first, &dst).map_err(werr)?;
                continue;
            }
            links.insert((meta.dev(), meta.ino()), dst.clone());
        }
        if ft.is_symlink() {
            let target = fs::read_link(&src).map_err(read_err(&src))?;
            std::os::unix::fs::symlink(target, &dst).map_err(werr)?;
        } else if ft.is_fifo() {
            nix::unistd::mkfifo(&dst, nix::sys::stat::Mode::from_bits_truncate(0o600)).map_err(|e| werr(e.into()))?;
        } else if ft.is_file() {
            // Holes stay holes (`fs::copy` writes them out as zeros).
            let from = File::open(&src).map_err(read_err(&src))?;
            let to = File::options().write(true).create_new(true).open(&dst).map_err(werr)?;
            *copied += crate::extents::copy_file(&from, &meta, &to).map_err(werr)?;
        } else {
            let kind = if ft.is_char_device() { "character device" } else { "block device or socket" };
            return Err(DiffError::DeviceNode { path: r, kind });
        }
        copy_meta(&src, &meta, &dst, form)?;
    }
    // Directory metadata last: creating children changes their mtime.
    for (src, meta, dst) in dirs {
        copy_meta(&src, &meta, &dst, form)?;
    }
    Ok(())
}
