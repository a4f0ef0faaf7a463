//! Reading one small file out of a live sandbox (an evaluation's result),
//! resolved as `cp` resolves sandbox paths: `openat2(RESOLVE_IN_ROOT |
//! RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV)` from the sandbox's root
//! (`/proc/<shim>/root`), the last component not followed if it is a
//! symlink, opened non-blocking and read only if it is a regular file, and
//! never more than a bound.
#![forbid(unsafe_code)]

use std::io::Read;
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::fs::OpenOptionsExt;

use nix::errno::Errno;
use nix::sys::stat::{fstat, SFlag};
use strata_shim::sys::{openat2, RESOLVE_IN_ROOT, RESOLVE_NO_MAGICLINKS, RESOLVE_NO_XDEV};

#[derive(Debug, thiserror::Error)]
pub enum ReadFileError {
    #[error("open the sandbox's root")]
    Root(#[source] std::io::Error),
    #[error("{path} in the sandbox")]
    Resolve {
        path: String,
        #[source]
        source: Errno,
    },
    #[error("{path} in the sandbox is not a regular file")]
    NotFile { path: String },
    #[error("{path} in the sandbox holds more than {limit} bytes")]
    TooLarge { path: String, limit: u64 },
}

/// The sandbox's regular file `path` (absolute, inside its root), or
/// `None` if there is none.
pub fn read_file(shim_pid: i32, path: &str, limit: u64) -> Result<Option<Vec<u8>>, ReadFileError> {
    let root = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_PATH | libc::O_DIRECTORY)
        .open(format!("/proc/{shim_pid}/root"))
        .map_err(ReadFileError::Root)?;
    let resolve = |source| ReadFileError::Resolve { path: path.to_string(), source };
    let name = std::ffi::CString::new(path).map_err(|_| resolve(Errno::EINVAL))?;
    let flags = libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_NONBLOCK;
    let fd = match openat2(root.as_fd(), &name, flags, 0, RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV) {
        Ok(fd) => fd,
        Err(Errno::ENOENT) => return Ok(None),
        Err(e) => return Err(resolve(e)),
    };
    let st = fstat(fd.as_raw_fd()).map_err(resolve)?;
    if SFlag::from_bits_truncate(st.st_mode & libc::S_IFMT) != SFlag::S_IFREG {
        return Err(ReadFileError::NotFile { path: path.to_string() });
    }
    let mut data = Vec::new();
    std::fs::File::from(fd)
        .take(limit + 1)
        .read_to_end(&mut data)
        .map_err(|e| resolve(Errno::from_raw(e.raw_os_error().unwrap_or(libc::EIO))))?;
    if data.len() as u64 > limit {
        return Err(ReadFileError::TooLarge { path: path.to_string(), limit });
    }
    Ok(Some(data))
}
