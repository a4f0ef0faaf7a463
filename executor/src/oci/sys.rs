//! The few calls `oci` needs beyond what nix 0.29 offers as safe functions.
//! The crate is `forbid(unsafe_code)`, so the raw calls (`openat` returning
//! an owned fd, the xattr calls) live in the workspace's one unsafe module,
//! `strata_shim::sys`; this module adapts them to byte-string names.

use std::ffi::{CStr, CString};
use std::fs::File;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};

use nix::errno::Errno;

/// A name from a tar entry as a C string. Entry names and components are
/// checked for NUL bytes before they get here; `EINVAL` if one slipped by.
fn c_name(name: &[u8]) -> Result<CString, Errno> {
    CString::new(name).map_err(|_| Errno::EINVAL)
}

/// `openat(dir, name, O_RDONLY|O_DIRECTORY|O_NOFOLLOW|O_CLOEXEC)`: fails with
/// `ELOOP` or `ENOTDIR` if `name` is a symlink or not a directory.
pub fn open_dir_at(dir: BorrowedFd<'_>, name: &[u8]) -> Result<OwnedFd, Errno> {
    let flags = libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW;
    strata_shim::sys::openat(dir, &c_name(name)?, flags, 0)
}

/// `openat(dir, name, O_WRONLY|O_CREAT|O_EXCL|O_NOFOLLOW|O_CLOEXEC, mode)`:
/// a new file, never an existing one and never through a symlink.
pub fn create_file_at(dir: BorrowedFd<'_>, name: &[u8], mode: u32) -> Result<File, Errno> {
    let flags = libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW;
    strata_shim::sys::openat(dir, &c_name(name)?, flags, mode).map(File::from)
}

/// `openat(dir, name, O_RDONLY|O_NOFOLLOW|O_NONBLOCK|O_CLOEXEC)`: never
/// through a symlink, never blocking on a FIFO (the unpacker changes the
/// metadata of files it just put there; the layer-tar writer reads them).
pub fn open_file_at(dir: BorrowedFd<'_>, name: &[u8]) -> Result<File, Errno> {
    let flags = libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_NONBLOCK;
    strata_shim::sys::openat(dir, &c_name(name)?, flags, 0).map(File::from)
}

/// The regular file at `comps` under the tree `root`, read without
/// following a symlink anywhere on the way (a layer's `etc -> /etc` must
/// not make the daemon read a host file) and without blocking on a FIFO;
/// at most `limit` bytes. `None` if it is absent or not a regular file.
pub fn read_in_tree(root: &std::path::Path, comps: &[&str], limit: u64) -> Option<Vec<u8>> {
    use std::io::Read;
    use std::os::fd::AsFd;
    use std::os::unix::fs::OpenOptionsExt;
    let (last, dirs) = comps.split_last()?;
    let mut dir: OwnedFd = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW)
        .open(root)
        .ok()?
        .into();
    for c in dirs {
        dir = open_dir_at(dir.as_fd(), c.as_bytes()).ok()?;
    }
    let flags = libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_NONBLOCK;
    let file = File::from(strata_shim::sys::openat(dir.as_fd(), &c_name(last.as_bytes()).ok()?, flags, 0).ok()?);
    if !file.metadata().ok()?.is_file() {
        return None;
    }
    let mut data = Vec::new();
    file.take(limit).read_to_end(&mut data).ok()?;
    Some(data)
}

/// `fsetxattr(fd, name, value, 0)`.
pub fn fsetxattr(fd: BorrowedFd<'_>, name: &CStr, value: &[u8]) -> Result<(), Errno> {
    strata_shim::sys::fsetxattr(fd, name, value)
}

/// The attribute `name` of `entry` in `dir` itself, never of what a symlink
/// there points to: `lsetxattr` on `/proc/self/fd/<dir>/<entry>`, whose fd
/// magic link resolves to the directory object and whose last component is
/// not followed. (There is no `*at` form of setxattr; symlinks and FIFOs
/// cannot be opened for `fsetxattr` without side effects.)
pub fn lsetxattr_at(dir: BorrowedFd<'_>, entry: &[u8], name: &CStr, value: &[u8]) -> Result<(), Errno> {
    strata_shim::sys::lsetxattr(&entry_path(dir, entry)?, name, value)
}

/// `/proc/self/fd/<dir>/<entry>`: a path by which only `entry` is looked
/// up, in `dir` itself (the fd magic link resolves to the directory
/// object), for the xattr calls that have no `*at` form.
pub fn entry_path(dir: BorrowedFd<'_>, entry: &[u8]) -> Result<CString, Errno> {
    let mut path = format!("/proc/self/fd/{}/", dir.as_raw_fd()).into_bytes();
    path.extend_from_slice(entry);
    c_name(&path)
}

/// `lgetxattr(path, name)`, for tests that check what was set.
#[cfg(test)]
pub fn lgetxattr(path: &std::path::Path, name: &CStr) -> Result<Vec<u8>, Errno> {
    use std::os::unix::ffi::OsStrExt;
    strata_shim::sys::lgetxattr(&c_name(path.as_os_str().as_bytes())?, name)
}
