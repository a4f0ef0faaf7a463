//! envd's file operations on a live sandbox's tree, resolved as `strata cp`
//! resolves sandbox paths (copy.rs): every path is opened with
//! `openat2(RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV)`
//! from the sandbox's root (`/proc/<shim>/root`), so `..` stops at that
//! root, absolute symlink targets start from it, and crossing into another
//! mount (`/proc`, `/dev`, scratch and cache mounts) is refused; the last
//! component is then used through its parent's descriptor with `*at`
//! calls that do not follow it. The daemon does the work as root; what it
//! creates is given to the calling user (as envd, running as that user,
//! would have made it).
#![forbid(unsafe_code)]

use std::ffi::CString;
use std::io::{Read, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;

use nix::errno::Errno;
use nix::fcntl::{AtFlags, OFlag};
use nix::sys::stat::{fstatat, FileStat, Mode, SFlag};
use serde_json::{json, Value};
use strata_shim::sys::{openat, openat2, RESOLVE_IN_ROOT, RESOLVE_NO_MAGICLINKS, RESOLVE_NO_XDEV};

use super::connect::{Code, RpcError};
use super::users::{Accounts, User};

const RESOLVE: u64 = RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV;

/// Where a file's user metadata lives: its `user.e2b.<key>` xattrs (as
/// envd keeps what `files.write(metadata=...)` sends).
const META_PREFIX: &str = "user.e2b.";
/// Most metadata keys one upload may set.
pub const MAX_META_KEYS: usize = 64;
/// Longest metadata value.
pub const MAX_META_VALUE: usize = 4096;

/// File metadata from an upload's `X-Metadata-<key>` headers: keys
/// lowercased, HTTP token characters only; values printable ASCII.
pub type Metadata = std::collections::BTreeMap<String, String>;

/// Check one metadata pair as envd does (400 otherwise).
pub fn check_metadata(key: &str, value: &str) -> Result<(), RpcError> {
    let token = |b: u8| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b);
    if key.is_empty() || !key.bytes().all(token) {
        return Err(RpcError::invalid(format!("metadata key {key:?}: use HTTP token characters")));
    }
    if value.len() > MAX_META_VALUE || !value.bytes().all(|b| (0x20..0x7f).contains(&b)) {
        return Err(RpcError::invalid(format!(
            "metadata value of {key:?}: printable ASCII, at most {MAX_META_VALUE} bytes"
        )));
    }
    Ok(())
}

/// Deepest listing `ListDir` walks (`depth`).
pub const MAX_LIST_DEPTH: u64 = 32;
/// Most entries one listing returns.
pub const MAX_LIST_ENTRIES: usize = 100_000;

/// An errno from the sandbox's side as the RPC error envd would give.
pub fn rpc_error(path: &str, e: Errno) -> RpcError {
    let code = match e {
        Errno::ENOENT => Code::NotFound,
        Errno::EEXIST | Errno::ENOTEMPTY => Code::AlreadyExists,
        Errno::EACCES | Errno::EPERM | Errno::EROFS => Code::PermissionDenied,
        Errno::ENOSPC | Errno::EDQUOT | Errno::EMFILE => Code::ResourceExhausted,
        Errno::EXDEV => return RpcError::invalid(format!("{path}: crosses a mount point (not served)")),
        Errno::ELOOP => return RpcError::invalid(format!("{path}: a symlink where a directory or file was expected")),
        Errno::ENOTDIR | Errno::EISDIR | Errno::EINVAL | Errno::ENAMETOOLONG => Code::InvalidArgument,
        _ => Code::Internal,
    };
    RpcError::new(code, format!("{path}: {}", e.desc()))
}

/// A live sandbox's root and the accounts its `/etc` names.
pub struct Tree {
    root: OwnedFd,
    pub accounts: Accounts,
    /// Added to uids and gids this sandbox's user namespace shifts (0 if none).
    shift: u32,
    /// Its user namespace's size, if it has one.
    size: Option<u32>,
}

/// `path` made absolute (relative paths are under the user's home), with
/// no NUL byte.
pub fn absolute(path: &str, user: &User) -> Result<String, RpcError> {
    if path.contains('\0') {
        return Err(RpcError::invalid("paths must not contain NUL bytes"));
    }
    let p = if path.starts_with('/') {
        path.to_string()
    } else if path.is_empty() {
        return Err(RpcError::invalid("path is empty"));
    } else if path == "~" {
        user.home.clone()
    } else {
        format!("{}/{}", user.home.trim_end_matches('/'), path.strip_prefix("~/").unwrap_or(path))
    };
    Ok(p)
}

fn cstr(s: &[u8]) -> Result<CString, RpcError> {
    CString::new(s).map_err(|_| RpcError::invalid("paths must not contain NUL bytes"))
}

/// `path` split into its parent and its last component (lexically).
fn split(path: &str) -> Result<(&str, &str), RpcError> {
    let trimmed = path.trim_end_matches('/');
    let (parent, name) = trimmed.rsplit_once('/').unwrap_or(("", trimmed));
    if name.is_empty() || name == "." || name == ".." {
        return Err(RpcError::invalid(format!("{path:?} names no file (it is the root, or ends in . or ..)")));
    }
    Ok((if parent.is_empty() { "/" } else { parent }, name))
}

fn kind(st: &FileStat) -> SFlag {
    SFlag::from_bits_truncate(st.st_mode & libc::S_IFMT)
}

/// Go's `FileMode.String()` of a mode (what envd reports as `permissions`).
fn permissions(st: &FileStat) -> String {
    let t = match kind(st) {
        SFlag::S_IFDIR => 'd',
        SFlag::S_IFLNK => 'L',
        SFlag::S_IFIFO => 'p',
        SFlag::S_IFSOCK => 'S',
        SFlag::S_IFCHR => 'c',
        SFlag::S_IFBLK => 'D',
        _ => '-',
    };
    let mut s = String::from(t);
    for (i, c) in "rwxrwxrwx".chars().enumerate() {
        s.push(if st.st_mode & (0o400 >> i) != 0 { c } else { '-' });
    }
    s
}

/// RFC 3339 (UTC, nanoseconds) of a unix time.
pub fn rfc3339(secs: i64, nanos: i64) -> String {
    use time::format_description::well_known::Rfc3339;
    let t = time::OffsetDateTime::from_unix_timestamp_nanos(i128::from(secs) * 1_000_000_000 + i128::from(nanos));
    t.ok().and_then(|t| t.format(&Rfc3339).ok()).unwrap_or_default()
}

/// The user metadata of `name` in `dir` (its `user.e2b.*` xattrs); none for
/// what is not a regular file or directory (a device is never opened, and
/// Linux keeps no user xattrs on symlinks), or what cannot be read.
fn metadata_of(dir: BorrowedFd<'_>, name: &[u8], st: &FileStat) -> Metadata {
    let mut out = Metadata::new();
    if !matches!(kind(st), SFlag::S_IFREG | SFlag::S_IFDIR) {
        return out;
    }
    let Ok(name) = CString::new(name) else { return out };
    let flags = libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_NOCTTY;
    let Ok(fd) = openat(dir, &name, flags, 0) else { return out };
    let f = std::fs::File::from(fd);
    let Ok(names) = xattr::FileExt::list_xattr(&f) else { return out };
    for n in names {
        let Some(key) = n.to_str().and_then(|n| n.strip_prefix(META_PREFIX)) else { continue };
        if let Ok(Some(v)) = xattr::FileExt::get_xattr(&f, &n) {
            out.insert(key.to_string(), String::from_utf8_lossy(&v).into_owned());
        }
    }
    out
}

impl Tree {
    pub fn open(shim_pid: i32, userns: Option<crate::spec::UsernsMap>) -> Result<Tree, RpcError> {
        let (shift, size) = userns.map_or((0, None), |m| (m.host_id, Some(m.size)));
        let root = crate::sandbox::copy::sandbox_root(shim_pid).map_err(|e| {
            RpcError::new(Code::Unavailable, format!("the sandbox's root: {}", crate::error::chain(&e)))
        })?;
        let accounts = Accounts::read(root.as_fd());
        Ok(Tree { root, accounts, shift, size })
    }

    /// Run `f` on a thread of its own that acts on files as `user` (its
    /// access checks, its ownership of what it creates; no root
    /// overrides), as envd, running as that user, would.
    pub fn as_user<T: Send>(&self, user: &User, f: impl FnOnce(&Tree) -> T + Send) -> Result<T, RpcError> {
        std::thread::scope(|s| {
            s.spawn(|| {
                self.become_user(user)?;
                Ok(f(self))
            })
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
        })
    }

    /// Make the calling thread act on files as `user` from now on (its
    /// file system ids; root's file capabilities dropped): for a thread of
    /// its own, as [`Tree::as_user`] makes one.
    pub fn become_user(&self, user: &User) -> Result<(), RpcError> {
        if self.size.is_some_and(|size| user.uid >= size || user.gid >= size) {
            return Err(RpcError::new(
                Code::PermissionDenied,
                format!("user {} ({}:{}) is outside the sandbox's user namespace", user.name, user.uid, user.gid),
            ));
        }
        strata_shim::sys::act_on_files_as(user.uid + self.shift, user.gid + self.shift)
            .map_err(|e| RpcError::internal(format!("act as {}: {e}", user.name)))
    }

    /// A directory of the sandbox, for `*at` calls.
    fn dir(&self, path: &str) -> Result<OwnedFd, RpcError> {
        openat2(self.root.as_fd(), &cstr(path.as_bytes())?, libc::O_PATH | libc::O_DIRECTORY, 0, RESOLVE)
            .map_err(|e| rpc_error(path, e))
    }

    fn parent(&self, path: &str) -> Result<(OwnedFd, CString), RpcError> {
        let (parent, name) = split(path)?;
        Ok((self.dir(parent)?, cstr(name.as_bytes())?))
    }

    /// envd's `EntryInfo` of `name` in `dir` (not followed), at `path`.
    fn entry(&self, dir: BorrowedFd<'_>, name: &[u8], path: &str) -> Result<Value, RpcError> {
        let st = fstatat(Some(dir.as_raw_fd()), name, AtFlags::AT_SYMLINK_NOFOLLOW).map_err(|e| rpc_error(path, e))?;
        let owner = |id: u32| id.wrapping_sub(self.shift);
        let t = match kind(&st) {
            SFlag::S_IFDIR => "FILE_TYPE_DIRECTORY",
            SFlag::S_IFLNK => "FILE_TYPE_SYMLINK",
            _ => "FILE_TYPE_FILE",
        };
        let mut v = json!({
            "name": String::from_utf8_lossy(name),
            "type": t,
            "path": path,
            "size": st.st_size.to_string(),
            "mode": st.st_mode & 0o7777,
            "permissions": permissions(&st),
            "owner": self.accounts.user_name(owner(st.st_uid)),
            "group": self.accounts.group_name(owner(st.st_gid)),
            "modifiedTime": rfc3339(st.st_mtime, st.st_mtime_nsec),
        });
        if kind(&st) == SFlag::S_IFLNK {
            let target = nix::fcntl::readlinkat(Some(dir.as_raw_fd()), name).map_err(|e| rpc_error(path, e))?;
            v["symlinkTarget"] = json!(String::from_utf8_lossy(target.as_bytes()));
        }
        let meta = metadata_of(dir, name, &st);
        if !meta.is_empty() {
            v["metadata"] = json!(meta);
        }
        Ok(v)
    }

    pub fn stat(&self, path: &str) -> Result<Value, RpcError> {
        if path.trim_end_matches('/').is_empty() {
            return self.entry(self.root.as_fd(), b".", "/").map(|mut v| {
                v["name"] = json!("/");
                v
            });
        }
        let (dir, name) = self.parent(path)?;
        self.entry(dir.as_fd(), name.as_bytes(), path.trim_end_matches('/'))
    }

    /// Entries below `path`, `depth` levels down (1: its children).
    pub fn list(&self, path: &str, depth: u64) -> Result<Vec<Value>, RpcError> {
        let depth = depth.clamp(1, MAX_LIST_DEPTH);
        let top = self.dir(path)?;
        let mut out = Vec::new();
        self.list_in(top, path.trim_end_matches('/'), depth, &mut out)?;
        Ok(out)
    }

    fn list_in(&self, dir: OwnedFd, path: &str, depth: u64, out: &mut Vec<Value>) -> Result<(), RpcError> {
        let mut listing = nix::dir::Dir::openat(
            Some(dir.as_raw_fd()),
            ".",
            OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| rpc_error(path, e))?;
        let mut names: Vec<Vec<u8>> = Vec::new();
        for e in listing.iter() {
            let e = e.map_err(|e| rpc_error(path, e))?;
            let n = e.file_name().to_bytes();
            if n != b"." && n != b".." {
                names.push(n.to_vec());
            }
        }
        names.sort();
        for n in names {
            if out.len() >= MAX_LIST_ENTRIES {
                return Err(RpcError::new(
                    Code::ResourceExhausted,
                    format!("{path}: more than {MAX_LIST_ENTRIES} entries; list less deep"),
                ));
            }
            let child = format!("{path}/{}", String::from_utf8_lossy(&n));
            let e = match self.entry(dir.as_fd(), &n, &child) {
                Ok(e) => e,
                Err(e) if e.code == Code::NotFound => continue, // gone meanwhile
                Err(e) => return Err(e),
            };
            let is_dir = e["type"] == "FILE_TYPE_DIRECTORY";
            out.push(e);
            if is_dir && depth > 1 {
                let name = cstr(&n)?;
                let sub = match openat(dir.as_fd(), &name, libc::O_PATH | libc::O_DIRECTORY | libc::O_NOFOLLOW, 0) {
                    Ok(fd) => fd,
                    Err(Errno::ENOENT | Errno::ENOTDIR | Errno::ELOOP) => continue,
                    Err(e) => return Err(rpc_error(&child, e)),
                };
                // Listed, not entered: another mount (/proc, /sys, /dev).
                let devs = (nix::sys::stat::fstat(dir.as_raw_fd()), nix::sys::stat::fstat(sub.as_raw_fd()));
                if !matches!(devs, (Ok(a), Ok(b)) if a.st_dev == b.st_dev) {
                    continue;
                }
                self.list_in(sub, &child, depth - 1, out)?;
            }
        }
        Ok(())
    }

    /// Make `path` and its missing parents; false if it already was a
    /// directory.
    pub fn make_dir(&self, path: &str) -> Result<bool, RpcError> {
        let (parent, name) = split(path)?;
        let dir = match self.dir(parent) {
            Ok(d) => d,
            Err(e) if e.code == Code::NotFound => {
                self.make_dir(parent)?;
                self.dir(parent)?
            }
            Err(e) => return Err(e),
        };
        let name = cstr(name.as_bytes())?;
        match nix::sys::stat::mkdirat(Some(dir.as_raw_fd()), name.as_c_str(), Mode::from_bits_truncate(0o755)) {
            Ok(()) => Ok(true),
            Err(Errno::EEXIST) => {
                let st = fstatat(Some(dir.as_raw_fd()), name.as_c_str(), AtFlags::AT_SYMLINK_NOFOLLOW)
                    .map_err(|e| rpc_error(path, e))?;
                if kind(&st) == SFlag::S_IFDIR {
                    Ok(false)
                } else {
                    Err(RpcError::new(Code::AlreadyExists, format!("{path}: exists and is not a directory")))
                }
            }
            Err(e) => Err(rpc_error(path, e)),
        }
    }

    pub fn rename(&self, from: &str, to: &str) -> Result<Value, RpcError> {
        let (fdir, fname) = self.parent(from)?;
        let (tparent, _) = split(to)?;
        if matches!(self.dir(tparent), Err(ref e) if e.code == Code::NotFound) {
            self.make_dir(tparent)?;
        }
        let (tdir, tname) = self.parent(to)?;
        nix::fcntl::renameat(Some(fdir.as_raw_fd()), fname.as_c_str(), Some(tdir.as_raw_fd()), tname.as_c_str())
            .map_err(|e| rpc_error(from, e))?;
        self.entry(tdir.as_fd(), tname.as_bytes(), to.trim_end_matches('/'))
    }

    /// Remove a file, a symlink (not what it names) or a whole tree. A
    /// path that is not there is removed already, as envd answers it
    /// (`os.RemoveAll`).
    pub fn remove(&self, path: &str) -> Result<(), RpcError> {
        let (dir, name) = match self.parent(path) {
            Err(e) if e.code == Code::NotFound => return Ok(()),
            r => r?,
        };
        let st = match fstatat(Some(dir.as_raw_fd()), name.as_c_str(), AtFlags::AT_SYMLINK_NOFOLLOW) {
            Err(Errno::ENOENT) => return Ok(()),
            r => r.map_err(|e| rpc_error(path, e))?,
        };
        let parent = nix::sys::stat::fstat(dir.as_raw_fd()).map_err(|e| rpc_error(path, e))?;
        if st.st_dev != parent.st_dev {
            // A mount point (/dev, /proc, a scratch or cache mount).
            return Err(rpc_error(path, Errno::EXDEV));
        }
        if kind(&st) != SFlag::S_IFDIR {
            return nix::unistd::unlinkat(
                Some(dir.as_raw_fd()),
                name.as_c_str(),
                nix::unistd::UnlinkatFlags::NoRemoveDir,
            )
            .map_err(|e| rpc_error(path, e));
        }
        // tree::remove_all opens each level O_NOFOLLOW and works by
        // descriptor; the parent is named through our descriptor of it.
        let through = std::path::PathBuf::from(format!("/proc/self/fd/{}", dir.as_raw_fd()))
            .join(std::ffi::OsStr::from_bytes(name.as_bytes()));
        crate::store::tree::remove_all(&through)
            .map_err(|e| rpc_error(path, e.raw_os_error().map(Errno::from_raw).unwrap_or(Errno::EIO)))
    }

    /// The regular file `path`, opened to read, and its size.
    pub fn open_file(&self, path: &str) -> Result<(std::fs::File, u64), RpcError> {
        let fd = openat2(self.root.as_fd(), &cstr(path.as_bytes())?, libc::O_RDONLY | libc::O_NONBLOCK, 0, RESOLVE)
            .map_err(|e| rpc_error(path, e))?;
        let st = nix::sys::stat::fstat(fd.as_raw_fd()).map_err(|e| rpc_error(path, e))?;
        if kind(&st) != SFlag::S_IFREG {
            return Err(RpcError::invalid(format!("{path}: not a regular file")));
        }
        Ok((std::fs::File::from(fd), st.st_size as u64))
    }

    /// Write what `src` gives as the regular file `path` (its contents
    /// replaced; it and its parents made as needed), with `meta` as its
    /// user metadata. A symlink there is refused, not followed; an
    /// existing file keeps its owner and mode. A file made here is
    /// removed again if the write fails. Errors of `src` are the
    /// client's: a stalled one is `DeadlineExceeded`, others
    /// `InvalidArgument`; a full disk is `ResourceExhausted`.
    pub fn write_from(&self, path: &str, src: &mut dyn Read, meta: &Metadata) -> Result<Value, RpcError> {
        let (parent, _) = split(path)?;
        if matches!(self.dir(parent), Err(ref e) if e.code == Code::NotFound) {
            self.make_dir(parent)?;
        }
        let (dir, name) = self.parent(path)?;
        let flags = libc::O_WRONLY | libc::O_NOFOLLOW | libc::O_NONBLOCK;
        let (fd, made) = match openat(dir.as_fd(), &name, flags | libc::O_CREAT | libc::O_EXCL, 0o644) {
            Ok(fd) => (fd, true),
            Err(Errno::EEXIST) => (openat(dir.as_fd(), &name, flags, 0).map_err(|e| rpc_error(path, e))?, false),
            Err(e) => return Err(rpc_error(path, e)),
        };
        let mut f = std::fs::File::from(fd);
        let written = self.fill(path, &mut f, src, meta);
        if written.is_err() && made {
            let _ =
                nix::unistd::unlinkat(Some(dir.as_raw_fd()), name.as_c_str(), nix::unistd::UnlinkatFlags::NoRemoveDir);
        }
        written?;
        let (_, base) = split(path)?;
        let mut v = json!({"name": base, "type": "file", "path": path});
        if !meta.is_empty() {
            v["metadata"] = json!(meta);
        }
        Ok(v)
    }

    /// [`Tree::write_from`]'s copy into the opened `f`, then its metadata.
    fn fill(&self, path: &str, f: &mut std::fs::File, src: &mut dyn Read, meta: &Metadata) -> Result<(), RpcError> {
        let st = nix::sys::stat::fstat(f.as_raw_fd()).map_err(|e| rpc_error(path, e))?;
        if kind(&st) != SFlag::S_IFREG {
            return Err(RpcError::invalid(format!("{path}: not a regular file")));
        }
        let io = |e: std::io::Error| rpc_error(path, e.raw_os_error().map(Errno::from_raw).unwrap_or(Errno::EIO));
        f.set_len(0).map_err(io)?;
        let mut buf = vec![0u8; 256 << 10];
        loop {
            let n = match src.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {
                    return Err(RpcError::new(Code::DeadlineExceeded, format!("{path}: {e}")))
                }
                Err(e) => return Err(RpcError::invalid(format!("{path}: {e}"))),
            };
            f.write_all(&buf[..n]).map_err(io)?;
        }
        for (k, v) in meta {
            xattr::FileExt::set_xattr(&*f, format!("{META_PREFIX}{k}"), v.as_bytes()).map_err(|e| {
                match e.raw_os_error() {
                    Some(libc::EOPNOTSUPP) => {
                        RpcError::invalid(format!("{path}: this sandbox's filesystem keeps no user metadata (xattrs)"))
                    }
                    _ => io(e),
                }
            })?;
        }
        Ok(())
    }

    /// An `O_PATH` descriptor of a directory (for watches).
    pub fn watch_dir(&self, path: &str) -> Result<OwnedFd, RpcError> {
        self.dir(path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_of_known_instants() {
        assert_eq!(rfc3339(0, 0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(951_782_400, 5), "2000-02-29T00:00:00.000000005Z");
        assert_eq!(rfc3339(1_796_083_200, 0), "2026-12-01T00:00:00Z");
    }

    #[test]
    fn paths_split_and_relative_ones_start_at_home() {
        assert_eq!(split("/a/b/").unwrap(), ("/a", "b"));
        assert_eq!(split("/a").unwrap(), ("/", "a"));
        assert!(split("/").is_err() && split("/a/..").is_err());
        let u = User { name: "user".into(), uid: 1000, gid: 1000, home: "/home/user".into() };
        assert_eq!(absolute("x/y", &u).unwrap(), "/home/user/x/y");
        assert_eq!(absolute("~/x", &u).unwrap(), "/home/user/x");
        assert_eq!(absolute("/etc", &u).unwrap(), "/etc");
        assert!(absolute("a\0b", &u).is_err());
    }
}
