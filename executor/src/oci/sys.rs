//! The few calls `oci` needs beyond what nix 0.29 offers as safe functions,
//! written in safe code because the crate is `forbid(unsafe_code)`.
//!
//! - Opening relative to a directory fd: nix 0.29's `openat` returns a raw
//!   fd (owned fds arrive in nix 0.30) and wrapping it needs `unsafe`. We
//!   open `/proc/self/fd/<dirfd>/<name>` with `std` instead: the kernel
//!   resolves the fd's magic link to the directory object itself (not to its
//!   path) and then looks `name` up with the given flags, exactly as
//!   `openat(dirfd, name, flags)` would. Needs `/proc`, which the daemon has.
//! - Extended attributes: neither nix 0.29 nor `std` can set them; the raw
//!   calls live in the workspace's one unsafe module, `strata_shim::sys`.

use std::ffi::{CStr, OsString};
use std::fs::{File, OpenOptions};
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStringExt;
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;

use nix::errno::Errno;

/// `/proc/self/fd/<dir>/<name>`: `name` looked up inside the open `dir`.
pub fn anchored(dir: BorrowedFd<'_>, name: &[u8]) -> PathBuf {
    let mut path = format!("/proc/self/fd/{}/", dir.as_raw_fd()).into_bytes();
    path.extend_from_slice(name);
    PathBuf::from(OsString::from_vec(path))
}

fn errno(e: std::io::Error) -> Errno {
    Errno::from_raw(e.raw_os_error().unwrap_or(libc::EIO))
}

/// `openat(dir, name, O_RDONLY|O_DIRECTORY|O_NOFOLLOW|O_CLOEXEC)`: fails with
/// `ELOOP` or `ENOTDIR` if `name` is a symlink or not a directory.
pub fn open_dir_at(dir: BorrowedFd<'_>, name: &[u8]) -> Result<OwnedFd, Errno> {
    OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW)
        .open(anchored(dir, name))
        .map(OwnedFd::from)
        .map_err(errno)
}

/// `openat(dir, name, O_WRONLY|O_CREAT|O_EXCL|O_NOFOLLOW|O_CLOEXEC, mode)`:
/// a new file, never an existing one and never through a symlink.
pub fn create_file_at(dir: BorrowedFd<'_>, name: &[u8], mode: u32) -> Result<File, Errno> {
    OpenOptions::new()
        .write(true)
        .create_new(true)
        .custom_flags(libc::O_NOFOLLOW)
        .mode(mode)
        .open(anchored(dir, name))
        .map_err(errno)
}

/// `fsetxattr(fd, name, value, 0)`.
pub fn fsetxattr(fd: BorrowedFd<'_>, name: &CStr, value: &[u8]) -> Result<(), Errno> {
    strata_shim::sys::fsetxattr(fd, name, value)
}

/// `lsetxattr(/proc/self/fd/<dir>/<entry>, name, value, 0)`: the attribute
/// of `entry` itself, never of what a symlink there points to. Pending: see
/// the module comment.
pub fn lsetxattr_at(dir: BorrowedFd<'_>, entry: &[u8], name: &CStr, value: &[u8]) -> Result<(), Errno> {
    let path = std::ffi::CString::new(anchored(dir, entry).into_os_string().into_vec()).map_err(|_| Errno::EINVAL)?;
    strata_shim::sys::lsetxattr(&path, name, value)
}

/// `lgetxattr(path, name)`, for tests that check what was set. Pending: see
/// the module comment.
#[cfg(test)]
pub fn lgetxattr(path: &std::path::Path, name: &CStr) -> Result<Vec<u8>, Errno> {
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::CString::new(path.as_os_str().as_bytes()).map_err(|_| Errno::EINVAL)?;
    strata_shim::sys::lgetxattr(&path, name)
}
