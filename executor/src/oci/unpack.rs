//! Safe extraction of one OCI layer blob into an empty directory that the
//! caller made under its `tmp/` (and renames into place on success, deletes
//! on error). Nothing outside that directory is ever created, changed or
//! followed into.
//!
//! The recipe, in order:
//! 1. hash the whole blob and check size and digest before parsing a byte;
//! 2. decompress (gzip, zstd or none) through a `Meter` that hashes the
//!    uncompressed stream, parse the tar, then read the stream to its end (so
//!    the gzip CRC and length trailer are checked) and compare the hash with
//!    the diff_id;
//! 3. create each entry with `*at()` calls relative to its parent directory's
//!    fd, found by walking from the destination fd one component at a time
//!    with `O_NOFOLLOW`: a symlink on the way refuses the layer. New files
//!    are `O_CREAT|O_EXCL|O_NOFOLLOW`; hard links use `linkat` without
//!    `AT_SYMLINK_FOLLOW` and must point at a non-directory extracted before;
//! 4. turn OCI whiteouts into overlay ones: `.wh.<name>` becomes a 0/0
//!    character device, `.wh..wh..opq` the `trusted.overlay.opaque=y` xattr
//!    (image-spec `layer.md`, kernel `Documentation/filesystems/overlayfs.rst`);
//! 5. apply owner (numeric ids only), mode, xattrs and mtimes with calls that
//!    never follow symlinks; directories get theirs last, deepest first,
//!    because creating their children changes their mtime and a read-only
//!    mode would stop the extraction of the children.
//!
//! Whiteouts, the opaque xattr and foreign owners need root; everything else
//! works for a normal user, which is what the unit tests below exercise.
#![forbid(unsafe_code)]

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::ffi::CString;
use std::fs::{self, File, OpenOptions};
use std::io::{self, BufReader, Read, Seek, SeekFrom, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use flate2::read::MultiGzDecoder;
use nix::errno::Errno;
use nix::fcntl::AtFlags;
use nix::sys::stat::{self, FchmodatFlags, Mode, SFlag, UtimensatFlags};
use nix::sys::time::TimeSpec;
use nix::unistd::{self, Gid, Uid, UnlinkatFlags};
use sha2::{Digest as _, Sha256};

use super::digest::Digest;
use super::layout::{Compression, LayerSource};
use super::meter::{Meter, MeterState, HEADER_BUDGET};
use super::sys;
use super::tarpath::{self, PathError, PATH_MAX};

/// Prefix of an OCI whiteout file name.
const WHITEOUT: &[u8] = b".wh.";
/// Prefix of AUFS bookkeeping names (`.wh..wh.plnk`, ...), which are skipped.
const WHITEOUT_META: &[u8] = b".wh..wh.";
/// The OCI opaque-directory marker.
const OPAQUE: &[u8] = b".wh..wh..opq";
/// PAX record prefix carrying one extended attribute.
const PAX_XATTR: &[u8] = b"SCHILY.xattr.";

/// What an unpack did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct UnpackStats {
    /// Tar entries read, including whiteouts and skipped ones.
    pub entries: u64,
    /// Bytes of regular-file data written.
    pub bytes: u64,
    /// Bytes of the uncompressed tar stream (what the diff_id hashes).
    pub tar_bytes: u64,
}

/// What an unpack error names as its layer: the blob's digest, or a tar
/// this daemon captured itself (which has no digest yet).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LayerName {
    Blob(Digest),
    Capture,
}

impl std::fmt::Display for LayerName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LayerName::Blob(d) => d.fmt(f),
            LayerName::Capture => f.write_str("(captured changes)"),
        }
    }
}

/// Why a layer was refused or could not be unpacked. Every variant but `Io`
/// is a fault of the layer (bad request); `Io` is a fault of this host.
#[derive(Debug, thiserror::Error)]
pub enum UnpackError {
    /// The destination is not an empty directory.
    #[error("layer {digest}: destination {path} is not an empty directory")]
    DestNotEmpty { digest: LayerName, path: PathBuf },
    /// The blob path holds a symlink, FIFO, directory or similar.
    #[error("layer {digest}: blob {path} is not a regular file")]
    BlobNotFile { digest: LayerName, path: PathBuf },
    /// The blob's size differs from the descriptor's.
    #[error("layer {digest}: blob is {actual} bytes, its descriptor says {expected}")]
    BlobSizeMismatch { digest: LayerName, expected: u64, actual: u64 },
    /// The blob's sha256 differs from the descriptor's.
    #[error("layer {expected}: blob hashes to {actual}")]
    BlobDigestMismatch { expected: Digest, actual: Digest },
    /// The compressed stream is corrupt (or, uncompressed, unreadable).
    #[error("layer {digest}: corrupt {compression} stream")]
    Decompress {
        digest: LayerName,
        compression: Compression,
        #[source]
        source: io::Error,
    },
    /// The tar framing is malformed (bad checksum, header cut short, ...).
    #[error("layer {digest}: malformed tar stream")]
    Tar {
        digest: LayerName,
        #[source]
        source: io::Error,
    },
    /// PAX or GNU long-name records larger than `HEADER_BUDGET`.
    #[error("layer {digest}: tar headers of entry {entry} exceed {HEADER_BUDGET} bytes")]
    HeaderTooLarge { digest: LayerName, entry: u64 },
    /// The stream ends inside an entry's data.
    #[error("layer {digest}: entry {path:?} is truncated: the stream ends inside its data")]
    Truncated { digest: LayerName, path: PathBuf },
    /// The uncompressed stream does not hash to the config's diff_id.
    #[error("layer {digest}: uncompressed stream hashes to {actual}, the diff_id is {expected}")]
    DiffIdMismatch { digest: LayerName, expected: Digest, actual: Digest },
    /// An entry name is absolute.
    #[error("layer {digest}: entry {path:?} has an absolute path")]
    AbsolutePath { digest: LayerName, path: PathBuf },
    /// An entry name has a `..` component.
    #[error("layer {digest}: entry {path:?} escapes the layer root")]
    Escape { digest: LayerName, path: PathBuf },
    /// An entry name is empty, has a NUL byte or is too long.
    #[error("layer {digest}: entry {path:?} {problem}")]
    InvalidName { digest: LayerName, path: PathBuf, problem: PathError },
    /// A non-directory entry names the layer root (`./`).
    #[error("layer {digest}: entry {path:?} names the layer root but is not a directory")]
    RootNotDirectory { digest: LayerName, path: PathBuf },
    /// An entry's path (or a hard link's target) goes through a symlink.
    #[error("layer {digest}: entry {path:?} passes through symlink {symlink:?}")]
    ThroughSymlink { digest: LayerName, path: PathBuf, symlink: PathBuf },
    /// A parent of an entry exists but is not a directory.
    #[error("layer {digest}: entry {path:?} needs {component:?} to be a directory")]
    NotADirectory { digest: LayerName, path: PathBuf, component: PathBuf },
    /// A relative symlink target climbs above the layer root.
    #[error("layer {digest}: symlink {path:?} -> {target:?} escapes the layer root")]
    SymlinkEscape { digest: LayerName, path: PathBuf, target: PathBuf },
    /// A link target is empty, has a NUL byte or is too long.
    #[error("layer {digest}: link {path:?} has a target that {problem}")]
    InvalidLinkTarget { digest: LayerName, path: PathBuf, problem: PathError },
    /// A hard link target is absolute or climbs with `..`.
    #[error("layer {digest}: hardlink {path:?} -> {target:?} escapes the layer root")]
    HardlinkEscape { digest: LayerName, path: PathBuf, target: PathBuf },
    /// A hard link target was not extracted before the link.
    #[error("layer {digest}: hardlink {path:?} -> {target:?} points to nothing extracted before it")]
    HardlinkMissing { digest: LayerName, path: PathBuf, target: PathBuf },
    /// A hard link target is a directory.
    #[error("layer {digest}: hardlink {path:?} -> {target:?} points to a directory")]
    HardlinkToDirectory { digest: LayerName, path: PathBuf, target: PathBuf },
    /// A character or block device entry.
    #[error("layer {digest}: entry {path:?} is a {kind}; layers may not contain device nodes")]
    DeviceNode { digest: LayerName, path: PathBuf, kind: &'static str },
    /// A GNU sparse file whose map is malformed.
    #[error("layer {digest}: sparse file {path:?} is malformed: {problem}")]
    InvalidSparse { digest: LayerName, path: PathBuf, problem: String },
    /// A GNU sparse file or an unknown entry type.
    #[error("layer {digest}: entry {path:?} has unsupported type {kind} (type flag {flag:?})")]
    UnsupportedEntry { digest: LayerName, path: PathBuf, kind: &'static str, flag: char },
    /// A whiteout with no name (`.wh.`), `.`, `..`, or with children.
    #[error("layer {digest}: entry {path:?} is not a valid whiteout")]
    InvalidWhiteout { digest: LayerName, path: PathBuf },
    /// A `trusted.*` xattr: overlayfs keeps its own state there.
    #[error("layer {digest}: entry {path:?} carries xattr {name:?} in the trusted namespace")]
    TrustedXattr { digest: LayerName, path: PathBuf, name: String },
    /// An xattr name that is empty or has a NUL byte.
    #[error("layer {digest}: entry {path:?} has an invalid xattr name {name:?}")]
    InvalidXattr { digest: LayerName, path: PathBuf, name: String },
    /// A header or PAX field that does not parse.
    #[error("layer {digest}: entry {path:?} has an invalid {field}")]
    InvalidHeader {
        digest: LayerName,
        path: PathBuf,
        field: &'static str,
        #[source]
        source: io::Error,
    },
    /// A uid or gid that is not a valid 32-bit id.
    #[error("layer {digest}: entry {path:?} has owner id {id}, out of range")]
    OwnerRange { digest: LayerName, path: PathBuf, id: u64 },
    /// A system call failed on this host.
    #[error("layer {digest}: {step} {path:?}")]
    Io {
        digest: LayerName,
        step: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

impl UnpackError {
    /// Whether the fault is this host's (a failed system call), not the
    /// layer's: the daemon answers 500 for these and 400 for the rest.
    pub fn is_io(&self) -> bool {
        matches!(self, UnpackError::Io { .. })
    }
}

/// Unpacks `layer` into `dest`, an existing empty directory. On error `dest`
/// holds a partial tree (never anything outside it) for the caller to delete.
pub fn unpack_layer(layer: &LayerSource, dest: &Path) -> Result<UnpackStats, UnpackError> {
    let name = LayerName::Blob(layer.digest.clone());
    let blob_io = |step| {
        let name = name.clone();
        move |source| UnpackError::Io { digest: name, step, path: layer.blob_path.clone(), source }
    };
    // Non-blocking so that a FIFO in place of the blob cannot hang us.
    let mut blob = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(&layer.blob_path)
        .map_err(blob_io("open blob"))?;
    verify_blob(layer, &mut blob)?;
    blob.seek(SeekFrom::Start(0)).map_err(blob_io("rewind blob"))?;
    let (stats, actual) = extract(&name, blob, layer.compression, dest, None)?;
    if actual != layer.diff_id {
        return Err(UnpackError::DiffIdMismatch { digest: name, expected: layer.diff_id.clone(), actual });
    }
    Ok(stats)
}

/// Unpacks an uncompressed tar this daemon wrote itself (a checkpoint's
/// capture, under the root-only `tmp/`) into `dest`: every entry gets the
/// same checks as an image layer's, but there is no digest to verify; the
/// tar's sha256 (its diff_id) is returned.
pub fn unpack_own_tar(tar: &Path, dest: &Path) -> Result<(UnpackStats, Digest), UnpackError> {
    let file = OpenOptions::new().read(true).custom_flags(libc::O_NOFOLLOW).open(tar).map_err(|source| {
        UnpackError::Io { digest: LayerName::Capture, step: "open captured tar", path: tar.to_owned(), source }
    })?;
    unpack_own_stream(file, dest)
}

/// [`unpack_own_tar`] from a stream (a pipe from this daemon's own tar
/// writer), so the tar never lands on disk.
pub fn unpack_own_stream(stream: File, dest: &Path) -> Result<(UnpackStats, Digest), UnpackError> {
    extract(&LayerName::Capture, stream, Compression::None, dest, None)
}

/// Files this daemon made ahead for some entries of its own tar: given an
/// entry's data offset in the stream and its size, the path of a file
/// with exactly that content (a checkpoint's pre-copy), which the unpacker
/// links into the tree instead of writing the data again. The data is
/// still read from the stream, for the digest.
pub type Prepared<'a> = &'a dyn Fn(u64, u64) -> Option<std::path::PathBuf>;

/// [`unpack_own_tar`] from a reader of a checkpoint's capture, with the
/// files its pre-copy made.
pub fn unpack_capture(
    stream: impl Read,
    prepared: Prepared<'_>,
    dest: &Path,
) -> Result<(UnpackStats, Digest), UnpackError> {
    extract(&LayerName::Capture, stream, Compression::None, dest, Some(prepared))
}

/// Extracts the (compressed) tar in `blob` into `dest`, checking every
/// entry; returns the uncompressed stream's sha256 too.
fn extract(
    name: &LayerName,
    blob: impl Read,
    compression: Compression,
    dest: &Path,
    prepared: Option<Prepared<'_>>,
) -> Result<(UnpackStats, Digest), UnpackError> {
    let root = open_dest(name, dest)?;
    let state = MeterState::default();
    let decompress = |source| UnpackError::Decompress { digest: name.clone(), compression, source };
    let blob = BufReader::with_capacity(1 << 20, blob);
    let stream: Box<dyn Read + '_> = match compression {
        Compression::None => Box::new(blob),
        // Multi-member: pigz and concatenated gzip files are valid layers.
        Compression::Gzip => Box::new(MultiGzDecoder::new(blob)),
        Compression::Zstd => Box::new(zstd::Decoder::with_buffer(blob).map_err(decompress)?),
    };
    let mut archive = tar::Archive::new(Meter::new(stream, &state));
    let mut ex = Extractor {
        digest: name,
        compression,
        state: &state,
        root,
        dirs: BTreeMap::new(),
        stats: UnpackStats::default(),
        buf: vec![0; 64 * 1024],
        last_parent: None,
        prepared,
    };
    ex.extract(&mut archive)?;

    let mut meter = archive.into_inner();
    meter.drain().map_err(decompress)?;
    let (actual, tar_bytes) = meter.finish();
    ex.finish_dirs()?;
    Ok((UnpackStats { tar_bytes, ..ex.stats }, actual))
}

/// Step 1: size and sha256 of the whole blob, before any parsing.
fn verify_blob(layer: &LayerSource, blob: &mut File) -> Result<(), UnpackError> {
    let digest = &layer.digest;
    let name = LayerName::Blob(digest.clone());
    let io_err =
        |source| UnpackError::Io { digest: name.clone(), step: "read blob", path: layer.blob_path.clone(), source };
    let meta = blob.metadata().map_err(io_err)?;
    if !meta.is_file() {
        return Err(UnpackError::BlobNotFile { digest: name.clone(), path: layer.blob_path.clone() });
    }
    let size_err = |actual| UnpackError::BlobSizeMismatch { digest: name.clone(), expected: layer.size, actual };
    if meta.len() != layer.size {
        return Err(size_err(meta.len()));
    }
    let mut hasher = Sha256::new();
    let n = io::copy(&mut blob.take(layer.size), &mut hasher).map_err(io_err)?;
    if n != layer.size {
        return Err(size_err(n));
    }
    let actual = Digest::from_hasher(hasher);
    if &actual != digest {
        return Err(UnpackError::BlobDigestMismatch { expected: digest.clone(), actual });
    }
    Ok(())
}

/// Opens the destination (not through a final symlink) and checks it is empty.
fn open_dest(digest: &LayerName, dest: &Path) -> Result<OwnedFd, UnpackError> {
    let io_err =
        |source| UnpackError::Io { digest: digest.clone(), step: "open destination", path: dest.to_owned(), source };
    let dir =
        OpenOptions::new().read(true).custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW).open(dest).map_err(io_err)?;
    if fs::read_dir(dest).map_err(io_err)?.next().is_some() {
        return Err(UnpackError::DestNotEmpty { digest: digest.clone(), path: dest.to_owned() });
    }
    Ok(OwnedFd::from(dir))
}

/// What a tar entry creates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    File,
    Dir,
    Symlink,
    Hardlink,
    Fifo,
    /// PAX global headers: no file, nothing to apply.
    Skip,
}

/// Owner, mode, mtime and xattrs of one entry, validated.
struct Meta {
    uid: u32,
    gid: u32,
    mode: u32,
    mtime: TimeSpec,
    xattrs: Vec<(CString, Vec<u8>)>,
    /// A GNU sparse file (PAX format 1.0): its real size.
    sparse: Option<u64>,
}

/// GNU sparse PAX records; only format 1.0 (major 1, minor 0) is read.
const PAX_SPARSE: &[u8] = b"GNU.sparse.";

/// Most extents a sparse file's map may list (the map is held while its
/// data is read: 16 bytes each).
const MAX_SPARSE_EXTENTS: u64 = 1 << 20;

/// What a directory gets once every entry is in place.
#[derive(Debug, Clone, Copy)]
struct DirMeta {
    uid: u32,
    gid: u32,
    mode: u32,
    mtime: TimeSpec,
}

/// What was at an entry's name before it was created.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Existing {
    Nothing,
    /// A directory, kept because the new entry is a directory too.
    Dir,
    /// A whiteout made earlier in this layer, now removed.
    Whiteout,
    /// Anything else, now removed.
    Other,
}

/// Why a walk to a directory stopped; the index is of the component.
enum WalkError {
    Missing(usize),
    Symlink(usize),
    NotDir(usize),
    Io(&'static str, io::Error),
}

struct Extractor<'a> {
    digest: &'a LayerName,
    compression: Compression,
    state: &'a MeterState,
    /// The destination directory; every path is resolved from here.
    root: OwnedFd,
    /// Directories declared by the layer (key: `a/b`, root is empty), whose
    /// owner, mode and mtime are applied last.
    dirs: BTreeMap<Vec<u8>, DirMeta>,
    stats: UnpackStats,
    buf: Vec<u8>,
    /// The parent directory of the previous entry (tars list a directory's
    /// entries together), so most entries skip the walk. Only removing a
    /// directory can make it stale, and `clear` drops it when it does.
    last_parent: Option<(Vec<u8>, OwnedFd)>,
    prepared: Option<Prepared<'a>>,
}

impl Extractor<'_> {
    fn extract<R: Read>(&mut self, archive: &mut tar::Archive<R>) -> Result<(), UnpackError> {
        self.state.limit_headers();
        let entries = archive.entries().map_err(|e| self.stream_error(e))?;
        for entry in entries {
            let mut entry = entry.map_err(|e| self.stream_error(e))?;
            self.state.unlimited();
            self.entry(&mut entry)?;
            self.state.limit_headers();
        }
        self.state.unlimited();
        Ok(())
    }

    /// Sorts a read error from the stream into what caused it.
    fn stream_error(&self, source: io::Error) -> UnpackError {
        let digest = self.digest.clone();
        if self.state.over_budget() {
            UnpackError::HeaderTooLarge { digest, entry: self.stats.entries + 1 }
        } else if self.state.source_failed() {
            UnpackError::Decompress { digest, compression: self.compression, source }
        } else {
            UnpackError::Tar { digest, source }
        }
    }

    fn io(&self, step: &'static str, raw: &[u8], source: impl Into<io::Error>) -> UnpackError {
        UnpackError::Io { digest: self.digest.clone(), step, path: tarpath::shown(raw), source: source.into() }
    }

    /// Validates, creates and reads one entry to its end.
    fn entry<R: Read>(&mut self, entry: &mut tar::Entry<'_, R>) -> Result<(), UnpackError> {
        self.stats.entries += 1;
        let raw = entry.path_bytes().into_owned();
        let kind = self.kind(entry.header(), &raw)?;
        let mut consumed = 0;
        if kind != Kind::Skip {
            let comps = tarpath::components(&raw).map_err(|p| self.name_error(&raw, p))?;
            let meta = self.meta(entry, &raw)?;
            consumed = self.place(entry, &raw, &comps, kind, &meta)?;
        }
        // Read what is left so that a stream cut inside this entry's data is
        // caught here, by name, rather than as a vague error at the next one.
        let rest = io::copy(entry, &mut io::sink()).map_err(|e| self.stream_error(e))?;
        if consumed + rest != entry.size() {
            return Err(UnpackError::Truncated { digest: self.digest.clone(), path: tarpath::shown(&raw) });
        }
        Ok(())
    }

    fn name_error(&self, raw: &[u8], problem: PathError) -> UnpackError {
        let (digest, path) = (self.digest.clone(), tarpath::shown(raw));
        match problem {
            PathError::Absolute => UnpackError::AbsolutePath { digest, path },
            PathError::DotDot => UnpackError::Escape { digest, path },
            problem => UnpackError::InvalidName { digest, path, problem },
        }
    }

    fn kind(&self, header: &tar::Header, raw: &[u8]) -> Result<Kind, UnpackError> {
        use tar::EntryType as T;
        let flag = header.as_bytes()[156];
        Ok(match header.entry_type() {
            // Pre-POSIX tars mark a directory by a trailing slash only.
            T::Regular if flag == 0 && raw.ends_with(b"/") => Kind::Dir,
            T::Regular | T::Continuous => Kind::File,
            T::Directory => Kind::Dir,
            T::Symlink => Kind::Symlink,
            T::Link => Kind::Hardlink,
            T::Fifo => Kind::Fifo,
            T::XGlobalHeader => Kind::Skip,
            t @ (T::Char | T::Block) => {
                return Err(UnpackError::DeviceNode {
                    digest: self.digest.clone(),
                    path: tarpath::shown(raw),
                    kind: tarpath::kind_name(t),
                })
            }
            // GNU sparse files are refused: a tiny entry could claim a huge
            // real size and fill the disk with zeros.
            t => {
                return Err(UnpackError::UnsupportedEntry {
                    digest: self.digest.clone(),
                    path: tarpath::shown(raw),
                    kind: tarpath::kind_name(t),
                    flag: char::from(flag),
                })
            }
        })
    }

    /// Reads owner, mode, mtime and xattrs. The `tar` crate has already put
    /// PAX `uid`/`gid` into the header; PAX `mtime` (sub-second) and
    /// `SCHILY.xattr.*` are read here.
    fn meta<R: Read>(&self, entry: &mut tar::Entry<'_, R>, raw: &[u8]) -> Result<Meta, UnpackError> {
        let invalid = |field| {
            move |source| UnpackError::InvalidHeader {
                digest: self.digest.clone(),
                path: tarpath::shown(raw),
                field,
                source,
            }
        };
        let h = entry.header();
        let uid = self.owner_id(raw, h.uid().map_err(invalid("uid"))?)?;
        let gid = self.owner_id(raw, h.gid().map_err(invalid("gid"))?)?;
        let mode = h.mode().map_err(invalid("mode"))? & 0o7777;
        let secs = h.mtime().map_err(invalid("mtime"))?;
        let mut mtime = TimeSpec::new(i64::try_from(secs).unwrap_or(i64::MAX), 0);
        let mut xattrs = Vec::new();
        let Some(records) = entry.pax_extensions().map_err(invalid("pax header"))? else {
            return Ok(Meta { uid, gid, mode, mtime, xattrs, sparse: None });
        };
        let mut sparse: Vec<(Vec<u8>, Vec<u8>)> = Vec::new();
        for record in records {
            let record = record.map_err(invalid("pax record"))?;
            let key = record.key_bytes();
            if let Some(k) = key.strip_prefix(PAX_SPARSE) {
                sparse.push((k.to_vec(), record.value_bytes().to_vec()));
                continue;
            }
            if key == b"mtime" {
                if let Some(t) = parse_pax_time(record.value_bytes()) {
                    mtime = t;
                }
                continue;
            }
            let Some(name) = key.strip_prefix(PAX_XATTR) else {
                continue;
            };
            let shown_name = || String::from_utf8_lossy(name).into_owned();
            if name.starts_with(b"trusted.") {
                return Err(UnpackError::TrustedXattr {
                    digest: self.digest.clone(),
                    path: tarpath::shown(raw),
                    name: shown_name(),
                });
            }
            let cname = CString::new(name).ok().filter(|n| !n.is_empty()).ok_or_else(|| UnpackError::InvalidXattr {
                digest: self.digest.clone(),
                path: tarpath::shown(raw),
                name: shown_name(),
            })?;
            if xattr_allowed(name) {
                xattrs.push((cname, record.value_bytes().to_vec()));
            } else {
                // SELinux labels, IMA/EVM and the like are host policy, not
                // image content: a layer must not choose them.
                tracing::warn!(layer = %self.digest, entry = ?tarpath::shown(raw),
                    xattr = %shown_name(), "skipping xattr outside user.*, security.capability and ACLs");
            }
        }
        let sparse = self.sparse_size(entry, raw, &sparse)?;
        Ok(Meta { uid, gid, mode, mtime, xattrs, sparse })
    }

    /// The real size of a GNU sparse file in PAX format 1.0 (records
    /// `major=1`, `minor=0`, `realsize`, and `name`, which must be the
    /// entry's path); other sparse formats are refused (read as plain
    /// files, their data would be the map and packed extents).
    fn sparse_size<R: Read>(
        &self,
        entry: &tar::Entry<'_, R>,
        raw: &[u8],
        records: &[(Vec<u8>, Vec<u8>)],
    ) -> Result<Option<u64>, UnpackError> {
        if records.is_empty() {
            return Ok(None);
        }
        let get = |k: &[u8]| records.iter().find(|(key, _)| key == k).map(|(_, v)| v.as_slice());
        let unsupported = || UnpackError::UnsupportedEntry {
            digest: self.digest.clone(),
            path: tarpath::shown(raw),
            kind: "GNU sparse file in a format other than PAX 1.0",
            flag: char::from(entry.header().as_bytes()[156]),
        };
        let known = records.iter().all(|(k, _)| matches!(k.as_slice(), b"major" | b"minor" | b"name" | b"realsize"));
        if !known || get(b"major") != Some(b"1") || get(b"minor") != Some(b"0") {
            return Err(unsupported());
        }
        if entry.header().entry_type() != tar::EntryType::Regular {
            return Err(unsupported());
        }
        let bad = |problem: &str| UnpackError::InvalidSparse {
            digest: self.digest.clone(),
            path: tarpath::shown(raw),
            problem: problem.to_string(),
        };
        if get(b"name").is_some_and(|n| n != raw) {
            return Err(bad("its GNU.sparse.name is not its path"));
        }
        let size = get(b"realsize")
            .and_then(|v| std::str::from_utf8(v).ok())
            .and_then(|v| v.parse::<u64>().ok())
            .filter(|&n| i64::try_from(n).is_ok())
            .ok_or_else(|| bad("no valid GNU.sparse.realsize"))?;
        Ok(Some(size))
    }

    /// A header id as a `uid_t`/`gid_t`; `u32::MAX` means "unchanged" to
    /// chown and is refused too.
    fn owner_id(&self, raw: &[u8], id: u64) -> Result<u32, UnpackError> {
        u32::try_from(id).ok().filter(|v| *v != u32::MAX).ok_or_else(|| UnpackError::OwnerRange {
            digest: self.digest.clone(),
            path: tarpath::shown(raw),
            id,
        })
    }

    /// Creates the entry; returns how many data bytes it read.
    fn place<R: Read>(
        &mut self,
        entry: &mut tar::Entry<'_, R>,
        raw: &[u8],
        comps: &[&[u8]],
        kind: Kind,
        meta: &Meta,
    ) -> Result<u64, UnpackError> {
        let Some((last, parents)) = comps.split_last() else {
            if kind == Kind::Dir {
                self.dir(raw, comps, meta)?;
                return Ok(0);
            }
            return Err(UnpackError::RootNotDirectory { digest: self.digest.clone(), path: tarpath::shown(raw) });
        };
        // AUFS bookkeeping (`.wh..wh.plnk/...`) is skipped, as Docker does.
        if parents.iter().any(|c| c.starts_with(WHITEOUT_META)) {
            return Ok(0);
        }
        if *last == OPAQUE {
            let dir = self.walk_entry(raw, parents)?;
            self.set_opaque(dir.as_fd(), raw)?;
            return Ok(0);
        }
        if last.starts_with(WHITEOUT_META) {
            return Ok(0);
        }
        if parents.iter().any(|c| c.starts_with(WHITEOUT)) {
            return Err(self.invalid_whiteout(raw));
        }
        if let Some(name) = last.strip_prefix(WHITEOUT) {
            self.whiteout(raw, parents, name)?;
            return Ok(0);
        }
        match kind {
            Kind::Dir => self.dir(raw, comps, meta).map(|()| 0),
            Kind::File if meta.sparse.is_some() => self.sparse_file(entry, raw, comps, meta),
            Kind::File => self.file(entry, raw, comps, meta),
            Kind::Symlink => self.symlink(entry, raw, comps, meta).map(|()| 0),
            Kind::Hardlink => self.hardlink(entry, raw, comps).map(|()| 0),
            Kind::Fifo => self.fifo(raw, comps, meta).map(|()| 0),
            Kind::Skip => Ok(0),
        }
    }

    fn invalid_whiteout(&self, raw: &[u8]) -> UnpackError {
        UnpackError::InvalidWhiteout { digest: self.digest.clone(), path: tarpath::shown(raw) }
    }

    /// `.wh.<name>`: hides `<name>` of the lower layers. A whiteout applies
    /// to lower layers only (image-spec: "files that are present in the same
    /// layer as a whiteout file can only be hidden by whiteout files in
    /// subsequent layers"), so an entry of this layer already at `<name>` is
    /// kept; a directory there is made opaque, since the lower one is gone.
    fn whiteout(&mut self, raw: &[u8], parents: &[&[u8]], name: &[u8]) -> Result<(), UnpackError> {
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

    fn set_opaque(&self, dir: BorrowedFd<'_>, raw: &[u8]) -> Result<(), UnpackError> {
        sys::fsetxattr(dir, c"trusted.overlay.opaque", b"y").map_err(|e| self.io("mark opaque", raw, e))
    }

    fn dir(&mut self, raw: &[u8], comps: &[&[u8]], meta: &Meta) -> Result<(), UnpackError> {
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

    fn file<R: Read>(
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
    fn sparse_file<R: Read>(
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
    fn sparse_map<R: Read>(
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
    fn link_prepared<R: Read>(
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
    fn file_meta(&self, file: &File, raw: &[u8], meta: &Meta) -> Result<(), UnpackError> {
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

    fn symlink<R: Read>(
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

    fn fifo(&mut self, raw: &[u8], comps: &[&[u8]], meta: &Meta) -> Result<(), UnpackError> {
        let (name, parents) = split(comps);
        let parent = self.walk_entry(raw, parents)?;
        self.clear(parent.as_fd(), raw, comps, false)?;
        stat::mknodat(Some(parent.as_raw_fd()), name, SFlag::S_IFIFO, Mode::S_IRUSR | Mode::S_IWUSR, 0)
            .map_err(|e| self.io("create fifo", raw, e))?;
        self.finish_special(parent.as_fd(), name, raw, meta, true)
    }

    /// Owner, mode (not for symlinks), xattrs and times of a symlink or FIFO,
    /// by name, never following it.
    fn finish_special(
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

    fn hardlink<R: Read>(&mut self, entry: &tar::Entry<'_, R>, raw: &[u8], comps: &[&[u8]]) -> Result<(), UnpackError> {
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

    fn check_link_target(&self, raw: &[u8], target: &[u8]) -> Result<(), UnpackError> {
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

    /// Makes room for a new entry at `comps`: nothing there, or a directory
    /// kept for a new directory, or the old entry removed (recursively for a
    /// directory, whose deferred metadata is then forgotten).
    fn clear(
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
    fn forget_dirs(&mut self, key: &[u8]) {
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
    fn walk_entry(&mut self, raw: &[u8], parents: &[&[u8]]) -> Result<OwnedFd, UnpackError> {
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
    fn walk(&self, comps: &[&[u8]], create: bool) -> Result<OwnedFd, WalkError> {
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

    fn set_xattrs(&self, target: Target<'_>, raw: &[u8], xattrs: &[(CString, Vec<u8>)]) -> Result<(), UnpackError> {
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
    fn finish_dirs(&mut self) -> Result<(), UnpackError> {
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

/// Where xattrs go: an open fd, or a name in a directory (symlinks, FIFOs).
#[derive(Clone, Copy)]
enum Target<'f> {
    Fd(BorrowedFd<'f>),
    At(BorrowedFd<'f>, &'f [u8]),
}

/// Only these xattrs are restored: user data, file capabilities, ACLs.
fn xattr_allowed(name: &[u8]) -> bool {
    name.starts_with(b"user.")
        || name == b"security.capability"
        || name == b"system.posix_acl_access"
        || name == b"system.posix_acl_default"
}

/// The last component and its parents; callers have checked `comps` is not
/// empty (the root is handled before).
fn split<'c>(comps: &'c [&'c [u8]]) -> (&'c [u8], &'c [&'c [u8]]) {
    match comps.split_last() {
        Some((last, parents)) => (last, parents),
        None => (b".", &[]),
    }
}

fn link_target<R: Read>(entry: &tar::Entry<'_, R>) -> Vec<u8> {
    entry.link_name_bytes().map(Cow::into_owned).unwrap_or_default()
}

fn file_type(mode: libc::mode_t) -> SFlag {
    SFlag::from_bits_truncate(mode & SFlag::S_IFMT.bits())
}

/// Removes `name` in `parent` and everything below it, without following
/// symlinks (each level is opened with `O_NOFOLLOW` and entries are unlinked
/// by name relative to it).
fn remove_all_at(parent: BorrowedFd<'_>, name: &[u8]) -> io::Result<()> {
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
fn parse_pax_time(value: &[u8]) -> Option<TimeSpec> {
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

#[cfg(test)]
mod tests;
