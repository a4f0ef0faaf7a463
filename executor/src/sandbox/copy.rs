//! `strata cp`: files and directory trees between the host and a running
//! sandbox.
//!
//! The sandbox's side is untrusted: its code may plant symlinks, or swap a
//! directory for a symlink while a copy runs. Every sandbox path is
//! resolved with `openat2(RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS |
//! RESOLVE_NO_XDEV)` from the sandbox's root (`/proc/<shim>/root`): `..`
//! stops at that root, absolute symlink targets start from it, `/proc/*/fd`
//! style magic links and crossings into other mounts (`/proc`, `/sys`,
//! `/dev`, scratch and cache mounts) are refused. Below the first
//! directory, entries are opened with `*at` calls and `O_NOFOLLOW`, so a
//! swap makes the copy fail (ELOOP, ENOTDIR) and never makes the daemon
//! follow a link. Files are opened `O_NONBLOCK` and must be regular (a
//! FIFO cannot hang the daemon). Modes are copied without setuid, setgid
//! and sticky bits, and neither owners nor xattrs are copied: a sandbox
//! cannot plant a setuid-root or file-capability binary on the host.
#![forbid(unsafe_code)]

use std::ffi::{CString, OsStr};
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::sys::stat::{fstat, Mode, SFlag};
use serde::{Deserialize, Serialize};
use strata_shim::sys::{openat, openat2, RESOLVE_IN_ROOT, RESOLVE_NO_MAGICLINKS, RESOLVE_NO_XDEV};

const RESOLVE: u64 = RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV;

/// What a copy moved.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Copied {
    pub files: u64,
    pub dirs: u64,
    pub symlinks: u64,
    pub bytes: u64,
    /// Symlinks left out (`no_symlinks`).
    #[serde(default)]
    pub skipped_symlinks: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum CopyError {
    #[error("{0:?} must be an absolute path")]
    Relative(String),
    #[error("{path:?} names no file (it is the root, or ends in . or ..)")]
    NoName { path: String },
    #[error("{path} in the sandbox{}", explain(*.source))]
    Sandbox {
        path: String,
        #[source]
        source: Errno,
    },
    #[error("{path} in the sandbox is a {kind}, not a file, directory or symlink")]
    Unsupported { path: String, kind: &'static str },
    #[error("{step} {path} on the host")]
    Host {
        step: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("open the sandbox's root")]
    Root(#[source] io::Error),
    #[error("{path} in the sandbox is more than {} directories deep", crate::store::diff::MAX_DEPTH)]
    TooDeep { path: String },
}

impl CopyError {
    /// Whether the sandbox's side refused the path (a bad request), rather
    /// than the host failing.
    pub fn is_refusal(&self) -> bool {
        !matches!(self, CopyError::Host { .. } | CopyError::Root(_))
    }
}

/// What the refusals of a confined resolution mean.
fn explain(e: Errno) -> &'static str {
    match e {
        Errno::EXDEV => {
            " leaves the sandbox's root file system (another mount such as /proc, /sys, /dev, \
                         scratch or a cache, or a /proc magic link)"
        }
        Errno::ELOOP => " is a symlink where a file or directory must be (not followed)",
        _ => "",
    }
}

fn sb_err(path: &str) -> impl Fn(Errno) -> CopyError + '_ {
    move |source| CopyError::Sandbox { path: path.to_string(), source }
}

fn host_err<'a>(step: &'static str, path: &'a Path) -> impl Fn(io::Error) -> CopyError + 'a {
    move |source| CopyError::Host { step, path: path.to_path_buf(), source }
}

fn cstr(b: &[u8]) -> Result<CString, CopyError> {
    CString::new(b).map_err(|_| CopyError::Sandbox { path: String::from_utf8_lossy(b).into(), source: Errno::EINVAL })
}

/// The root of a live sandbox, seen from the host through its shim.
pub fn sandbox_root(shim_pid: i32) -> Result<OwnedFd, CopyError> {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_PATH | libc::O_DIRECTORY)
        .open(format!("/proc/{shim_pid}/root"))
        .map_err(CopyError::Root)?;
    Ok(f.into())
}

/// `path` split into its parent and last component (lexically; the parent
/// is resolved in the sandbox's root).
fn split(path: &str) -> Result<(&str, &str), CopyError> {
    if !path.starts_with('/') {
        return Err(CopyError::Relative(path.into()));
    }
    let trimmed = path.trim_end_matches('/');
    let (parent, name) = trimmed.rsplit_once('/').unwrap_or(("", trimmed));
    if name.is_empty() || name == "." || name == ".." {
        return Err(CopyError::NoName { path: path.into() });
    }
    Ok((if parent.is_empty() { "/" } else { parent }, name))
}

/// Copy the host file or tree `src` to `dst` in the sandbox: into `dst` if
/// it is a directory there, else as `dst`.
pub fn copy_in(root: BorrowedFd<'_>, src: &Path, dst: &str) -> Result<Copied, CopyError> {
    if !dst.starts_with('/') {
        return Err(CopyError::Relative(dst.into()));
    }
    let name = src.file_name().ok_or_else(|| CopyError::NoName { path: src.display().to_string() })?;
    let into = openat2(root, &cstr(dst.as_bytes())?, libc::O_PATH | libc::O_DIRECTORY, 0, RESOLVE);
    let (dir, name, shown) = match into {
        Ok(dir) => (dir, name.as_bytes().to_vec(), format!("{}/{}", dst.trim_end_matches('/'), name.to_string_lossy())),
        Err(Errno::ENOENT | Errno::ENOTDIR) => {
            let (parent, name) = split(dst)?;
            let dir = openat2(root, &cstr(parent.as_bytes())?, libc::O_PATH | libc::O_DIRECTORY, 0, RESOLVE)
                .map_err(sb_err(parent))?;
            (dir, name.as_bytes().to_vec(), dst.to_string())
        }
        Err(e) => return Err(sb_err(dst)(e)),
    };
    let mut copied = Copied::default();
    put(dir.as_fd(), &name, src, &shown, 0, &mut copied)?;
    Ok(copied)
}

/// Create `name` in the sandbox directory `dir` from the host path `src`,
/// `depth` directories below the start. Recursion (one descriptor per
/// level) stops at [`crate::store::diff::MAX_DEPTH`], as the capture does.
fn put(
    dir: BorrowedFd<'_>,
    name: &[u8],
    src: &Path,
    shown: &str,
    depth: usize,
    c: &mut Copied,
) -> Result<(), CopyError> {
    if depth > crate::store::diff::MAX_DEPTH {
        return Err(CopyError::TooDeep { path: shown.into() });
    }
    let meta = std::fs::symlink_metadata(src).map_err(host_err("inspect", src))?;
    let mode = meta.permissions().mode() & 0o777;
    let cname = cstr(name)?;
    if meta.is_file() {
        let flags = libc::O_WRONLY | libc::O_CREAT | libc::O_TRUNC | libc::O_NOFOLLOW | libc::O_NONBLOCK;
        let out = File::from(openat(dir, &cname, flags, mode).map_err(sb_err(shown))?);
        if !SFlag::from_bits_truncate(fstat(out.as_raw_fd()).map_err(sb_err(shown))?.st_mode).contains(SFlag::S_IFREG) {
            return Err(CopyError::Unsupported { path: shown.into(), kind: "special file" });
        }
        let mut input = File::open(src).map_err(host_err("open", src))?;
        let mut out = out;
        c.bytes += io::copy(&mut input, &mut out).map_err(host_err("copy", src))?;
        out.set_permissions(std::fs::Permissions::from_mode(mode)).map_err(host_err("chmod copy of", src))?;
        c.files += 1;
    } else if meta.is_dir() {
        match nix::sys::stat::mkdirat(Some(dir.as_raw_fd()), cname.as_c_str(), Mode::from_bits_truncate(mode)) {
            Ok(()) | Err(Errno::EEXIST) => {}
            Err(e) => return Err(sb_err(shown)(e)),
        }
        let sub =
            openat(dir, &cname, libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW, 0).map_err(sb_err(shown))?;
        c.dirs += 1;
        for entry in std::fs::read_dir(src).map_err(host_err("read", src))? {
            let entry = entry.map_err(host_err("read", src))?;
            let n = entry.file_name();
            put(sub.as_fd(), n.as_bytes(), &entry.path(), &format!("{shown}/{}", n.to_string_lossy()), depth + 1, c)?;
        }
    } else if meta.file_type().is_symlink() {
        let target = std::fs::read_link(src).map_err(host_err("read link", src))?;
        nix::unistd::symlinkat(target.as_os_str(), Some(dir.as_raw_fd()), cname.as_c_str()).map_err(sb_err(shown))?;
        c.symlinks += 1;
    } else {
        return Err(CopyError::Host {
            step: "copy",
            path: src.into(),
            source: io::Error::other("not a file, directory or symlink"),
        });
    }
    Ok(())
}

/// Copy the sandbox's file or tree `src` to the host path `dst`: into
/// `dst` if it is a directory, else as `dst`.
pub fn copy_out(root: BorrowedFd<'_>, src: &str, dst: &Path, no_symlinks: bool) -> Result<Copied, CopyError> {
    let (parent, name) = split(src)?;
    let dir = openat2(root, &cstr(parent.as_bytes())?, libc::O_PATH | libc::O_DIRECTORY, 0, RESOLVE)
        .map_err(sb_err(parent))?;
    let target = if dst.is_dir() { dst.join(name) } else { dst.to_path_buf() };
    let mut copied = Copied::default();
    let mut out = Out { copied: &mut copied, no_symlinks };
    get(dir.as_fd(), name.as_bytes(), src, &target, 0, &mut out)?;
    Ok(copied)
}

/// What a copy out has copied, and how.
struct Out<'a> {
    copied: &'a mut Copied,
    no_symlinks: bool,
}

/// Copy entry `name` of the sandbox directory `dir` to the host path `dst`,
/// `depth` directories below the start (a sandbox makes trees of any
/// depth: recursion, one descriptor per level, stops at
/// [`crate::store::diff::MAX_DEPTH`]).
fn get(
    dir: BorrowedFd<'_>,
    name: &[u8],
    shown: &str,
    dst: &Path,
    depth: usize,
    o: &mut Out<'_>,
) -> Result<(), CopyError> {
    if depth > crate::store::diff::MAX_DEPTH {
        return Err(CopyError::TooDeep { path: shown.into() });
    }
    let cname = cstr(name)?;
    let st = nix::sys::stat::fstatat(Some(dir.as_raw_fd()), cname.as_c_str(), nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW)
        .map_err(sb_err(shown))?;
    let kind = SFlag::from_bits_truncate(st.st_mode & libc::S_IFMT);
    let mode = st.st_mode & 0o777;
    if kind == SFlag::S_IFREG {
        let flags = libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_NONBLOCK;
        let mut input = File::from(openat(dir, &cname, flags, 0).map_err(sb_err(shown))?);
        // Swapped for something else since the stat: refuse.
        let now = fstat(input.as_raw_fd()).map_err(sb_err(shown))?;
        if SFlag::from_bits_truncate(now.st_mode & libc::S_IFMT) != SFlag::S_IFREG {
            return Err(CopyError::Unsupported { path: shown.into(), kind: "special file" });
        }
        let mut out = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(mode)
            .open(dst)
            .map_err(host_err("create", dst))?;
        o.copied.bytes += io::copy(&mut input, &mut out).map_err(host_err("write", dst))?;
        out.set_permissions(std::fs::Permissions::from_mode(mode)).map_err(host_err("chmod", dst))?;
        o.copied.files += 1;
    } else if kind == SFlag::S_IFDIR {
        let sub =
            openat(dir, &cname, libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW, 0).map_err(sb_err(shown))?;
        match std::fs::create_dir(dst) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists && dst.is_dir() => {}
            Err(e) => return Err(host_err("create", dst)(e)),
        }
        std::fs::set_permissions(dst, std::fs::Permissions::from_mode(mode)).map_err(host_err("chmod", dst))?;
        o.copied.dirs += 1;
        // Entries are listed through our own descriptor of the directory.
        let listing = PathBuf::from(format!("/proc/self/fd/{}", sub.as_raw_fd()));
        let mut names: Vec<_> = std::fs::read_dir(&listing)
            .map_err(|e| sb_err(shown)(Errno::from_raw(e.raw_os_error().unwrap_or(libc::EIO))))?
            .filter_map(|e| e.ok().map(|e| e.file_name()))
            .collect();
        names.sort();
        for n in names {
            get(sub.as_fd(), n.as_bytes(), &format!("{shown}/{}", n.to_string_lossy()), &dst.join(&n), depth + 1, o)?;
        }
    } else if kind == SFlag::S_IFLNK && o.no_symlinks {
        o.copied.skipped_symlinks += 1;
    } else if kind == SFlag::S_IFLNK {
        let target = nix::fcntl::readlinkat(Some(dir.as_raw_fd()), cname.as_c_str()).map_err(sb_err(shown))?;
        std::os::unix::fs::symlink(OsStr::new(&target), dst).map_err(host_err("create symlink", dst))?;
        o.copied.symlinks += 1;
    } else {
        let kind = match kind {
            SFlag::S_IFIFO => "FIFO",
            SFlag::S_IFSOCK => "socket",
            _ => "device node",
        };
        return Err(CopyError::Unsupported { path: shown.into(), kind });
    }
    Ok(())
}

/// Which way a copy goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Direction {
    /// Host to sandbox.
    In,
    /// Sandbox to host.
    Out,
}

/// `POST /v1/sandboxes/{id}/copy`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CopyRequest {
    pub direction: Direction,
    /// Absolute path in the sandbox.
    pub path: String,
    /// Absolute path on the daemon's host.
    pub host_path: String,
    /// `out` only: leave symlinks out instead of recreating them on the
    /// host (where a target such as `/etc/shadow` names a host file), for
    /// callers that then read the tree.
    #[serde(default)]
    pub no_symlinks: bool,
}
