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

use std::collections::BTreeMap;
use std::ffi::CString;
use std::fs::{self, File, OpenOptions};
use std::io::{self, BufReader, Read, Seek, SeekFrom};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use flate2::read::MultiGzDecoder;
use nix::sys::time::TimeSpec;
use sha2::{Digest as _, Sha256};

use super::digest::Digest;
use super::layout::{Compression, LayerSource};
use super::meter::{Meter, MeterState, HEADER_BUDGET};
use super::tarpath::{self, PathError};

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
}

mod entries;
#[cfg(test)]
mod tests;
mod walk;

use walk::{parse_pax_time, xattr_allowed};
