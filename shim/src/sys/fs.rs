//! `openat`/`openat2` beneath a directory, extended attributes, and
//! whether a file has writers.

use std::ffi::CStr;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

use nix::errno::Errno;

/// `openat(dir, name, flags | O_CLOEXEC, mode)` returning an owned fd.
pub fn openat(dir: BorrowedFd<'_>, name: &CStr, flags: libc::c_int, mode: libc::mode_t) -> Result<OwnedFd, Errno> {
    // SAFETY: `name` is NUL-terminated and outlives the call; `dir` is open
    // for the borrow's lifetime.
    let fd = unsafe { libc::openat(dir.as_raw_fd(), name.as_ptr(), flags | libc::O_CLOEXEC, mode as libc::c_uint) };
    if fd < 0 {
        return Err(Errno::last());
    }
    // SAFETY: openat returned a new descriptor that we alone own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// `struct open_how` of openat2(2).
#[repr(C)]
pub(super) struct OpenHow {
    flags: u64,
    mode: u64,
    resolve: u64,
}

/// `RESOLVE_NO_XDEV`, `RESOLVE_NO_MAGICLINKS`, `RESOLVE_NO_SYMLINKS`,
/// `RESOLVE_BENEATH`, `RESOLVE_IN_ROOT` (uapi/linux/openat2.h).
pub const RESOLVE_NO_XDEV: u64 = 0x01;

pub const RESOLVE_NO_MAGICLINKS: u64 = 0x02;

pub const RESOLVE_NO_SYMLINKS: u64 = 0x04;

pub const RESOLVE_BENEATH: u64 = 0x08;

pub const RESOLVE_IN_ROOT: u64 = 0x10;

/// `openat2(dir, path, {flags | O_CLOEXEC, mode, resolve})` (Linux 5.6):
/// with `RESOLVE_IN_ROOT`, `path` and every symlink met on the way resolve
/// as if `dir` were `/` (`..` stops there, absolute targets start there).
pub fn openat2(
    dir: BorrowedFd<'_>,
    path: &CStr,
    flags: libc::c_int,
    mode: libc::mode_t,
    resolve: u64,
) -> Result<OwnedFd, Errno> {
    let how = OpenHow { flags: (flags | libc::O_CLOEXEC) as u64, mode: u64::from(mode), resolve };
    // SAFETY: `path` is NUL-terminated and `how` a valid open_how of the
    // size passed; both outlive the call; `dir` is open for the borrow.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_openat2,
            dir.as_raw_fd(),
            path.as_ptr(),
            &how as *const OpenHow,
            std::mem::size_of::<OpenHow>(),
        )
    };
    if fd < 0 {
        return Err(Errno::last());
    }
    // SAFETY: the kernel returned a new descriptor that we alone own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// `fsetxattr(fd, name, value, 0)`: create or replace one attribute.
pub fn fsetxattr(fd: BorrowedFd<'_>, name: &CStr, value: &[u8]) -> Result<(), Errno> {
    // SAFETY: `name` is NUL-terminated, `value` a live slice of its length;
    // the kernel only reads them during the call.
    let rc = unsafe { libc::fsetxattr(fd.as_raw_fd(), name.as_ptr(), value.as_ptr().cast(), value.len(), 0) };
    Errno::result(rc).map(drop)
}

/// `lsetxattr(path, name, value, 0)`: never follows a final symlink.
pub fn lsetxattr(path: &CStr, name: &CStr, value: &[u8]) -> Result<(), Errno> {
    // SAFETY: both strings are NUL-terminated, `value` a live slice of its
    // length; the kernel only reads them during the call.
    let rc = unsafe { libc::lsetxattr(path.as_ptr(), name.as_ptr(), value.as_ptr().cast(), value.len(), 0) };
    Errno::result(rc).map(drop)
}

/// `lremovexattr(path, name)`: never follows a final symlink.
pub fn lremovexattr(path: &CStr, name: &CStr) -> Result<(), Errno> {
    // SAFETY: both strings are NUL-terminated; the kernel only reads them
    // during the call.
    let rc = unsafe { libc::lremovexattr(path.as_ptr(), name.as_ptr()) };
    Errno::result(rc).map(drop)
}

/// `lgetxattr(path, name)`: the attribute's value.
pub fn lgetxattr(path: &CStr, name: &CStr) -> Result<Vec<u8>, Errno> {
    let mut buf = vec![0u8; 64 * 1024];
    // SAFETY: strings are NUL-terminated; the kernel writes at most
    // `buf.len()` bytes into `buf`, which we own.
    let n = unsafe { libc::lgetxattr(path.as_ptr(), name.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    if n < 0 {
        return Err(Errno::last());
    }
    buf.truncate(n as usize);
    Ok(buf)
}

/// Whether nobody has the file open for writing (which includes a
/// writable shared mapping of it: the mapping holds such an open): a read
/// lease is taken and dropped at once, and the kernel grants it only then.
/// An open for writing that races with it waits for the drop (one that is
/// `O_NONBLOCK` fails with `EWOULDBLOCK`), and the kernel signals the
/// lease holder: with SIGURG, set here (`F_SETSIG`) because its default
/// action is to be ignored, where SIGIO's would end this process. (The
/// process must not handle SIGURG.)
pub fn no_writers(fd: BorrowedFd<'_>) -> Result<(), Errno> {
    /// `F_SETSIG` (uapi/asm-generic/fcntl.h; not in the libc crate).
    const F_SETSIG: libc::c_int = 10;
    // SAFETY: fcntl with integer arguments; `fd` is open for the borrow.
    let r = unsafe { libc::fcntl(fd.as_raw_fd(), F_SETSIG, libc::SIGURG) };
    Errno::result(r)?;
    // SAFETY: as above.
    let r = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETLEASE, libc::F_RDLCK as libc::c_int) };
    Errno::result(r)?;
    // SAFETY: as above.
    let r = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETLEASE, libc::F_UNLCK as libc::c_int) };
    Errno::result(r).map(drop)
}

/// `llistxattr(path)`: the attribute names, never following a final symlink.
pub fn llistxattr(path: &CStr) -> Result<Vec<Vec<u8>>, Errno> {
    let mut buf = vec![0u8; 64 * 1024];
    // SAFETY: `path` is NUL-terminated; the kernel writes at most
    // `buf.len()` bytes into `buf`, which we own.
    let n = unsafe { libc::llistxattr(path.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    if n < 0 {
        return Err(Errno::last());
    }
    buf.truncate(n as usize);
    Ok(buf.split(|&b| b == 0).filter(|n| !n.is_empty()).map(<[u8]>::to_vec).collect())
}
