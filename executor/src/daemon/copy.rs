//! `cp`: files and directory trees between the host and a running (or
//! paused) sandbox, through the sandbox's root (`sandbox/copy.rs` holds the
//! safe copy itself).

use std::io;
use std::os::fd::AsFd;
use std::path::PathBuf;

use nix::errno::Errno;

use crate::sandbox::copy::{copy_in, copy_out, sandbox_root, Copied, CopyError, CopyRequest, Direction};

/// Why `cp` failed.
#[derive(Debug, thiserror::Error, displaydoc::Display)]
pub enum CopyOpError {
    /// {0}
    Sandbox(#[from] crate::daemon::SandboxOpError),
    /// host_path must be absolute (it is used by the daemon)
    Relative,
    /// sandbox {0} is stopping
    Stopping(crate::ids::SandboxId),
    /// {0}
    Copy(#[from] CopyError),
}

impl crate::error::Classify for CopyOpError {
    fn kind(&self) -> crate::error::ErrorKind {
        use crate::error::ErrorKind;
        match self {
            CopyOpError::Sandbox(e) => e.kind(),
            CopyOpError::Relative => ErrorKind::InvalidArgument,
            CopyOpError::Stopping(_) => ErrorKind::Conflict,
            CopyOpError::Copy(CopyError::Sandbox { source: Errno::ENOENT, .. }) => ErrorKind::NotFound,
            CopyOpError::Copy(e) if e.is_refusal() => ErrorKind::InvalidArgument,
            CopyOpError::Copy(CopyError::Host { source, .. }) if source.kind() == io::ErrorKind::NotFound => {
                ErrorKind::InvalidArgument
            }
            CopyOpError::Copy(e) => ErrorKind::of_host_failure(e),
        }
    }
}

impl crate::daemon::Daemon {
    /// Copy between the host and a running (or paused) sandbox.
    pub fn copy(&self, id: &str, req: &CopyRequest) -> Result<Copied, CopyOpError> {
        let sb = self.sandbox(id)?;
        let host = PathBuf::from(&req.host_path);
        if !host.is_absolute() {
            return Err(CopyOpError::Relative);
        }
        if matches!(sb.run_state(), crate::sandbox::RunState::Stopping) {
            return Err(CopyOpError::Stopping(sb.id.clone()));
        }
        let root = sandbox_root(sb.shim_pid)?;
        let r = match (req.direction, sb.spec.userns) {
            (Direction::In, None) => copy_in(root.as_fd(), &host, &req.path),
            // In a user namespace the upper is idmapped: new files are
            // created as the range's root (stored as 0, root's inside).
            (Direction::In, Some(map)) => {
                crate::sandbox::userns::as_range_root(&map, || copy_in(root.as_fd(), &host, &req.path))
                    .map_err(|e| CopyError::Sandbox { path: req.path.clone(), source: e })
                    .and_then(|r| r)
            }
            (Direction::Out, _) => copy_out(root.as_fd(), &req.path, &host, req.no_symlinks),
        };
        Ok(r?)
    }
}
