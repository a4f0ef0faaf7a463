//! Removing a sandbox: stop every process, then remove cgroup and files.
//!
//! SIGKILL to the shim (PID 1 of the sandbox's PID namespace) makes the
//! kernel kill every other process in the namespace. The overlay and every
//! other sandbox mount live only in the shim's mount namespace, so they go
//! away with its last process; nothing is unmounted on the host. The cgroup
//! is removed once the killed processes have left it.

use std::os::fd::{AsFd, BorrowedFd};
use std::time::Duration;

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::wait::{waitpid, WaitPidFlag};
use nix::unistd::Pid;
use strata_shim::sys;

use super::{RunEvent, Sandbox, SandboxError};
use crate::store::Store;

const KILL_TIMEOUT_SECS: u64 = 10;

/// SIGKILL a shim through its pidfd, wait until it has exited, and reap it if
/// it is our child (after a daemon restart it is not: init reaps it).
pub fn kill_and_reap(pid: i32, pidfd: BorrowedFd<'_>) -> Result<(), SandboxError> {
    match sys::pidfd_send_signal(pidfd, libc::SIGKILL) {
        Ok(()) | Err(nix::Error::ESRCH) => {}
        Err(source) => return Err(SandboxError::Kill { pid, source }),
    }
    // A pidfd polls readable once the process has exited.
    let mut fds = [PollFd::new(pidfd, PollFlags::POLLIN)];
    let deadline = std::time::Instant::now() + Duration::from_secs(KILL_TIMEOUT_SECS);
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return Err(SandboxError::KillTimeout { pid, secs: KILL_TIMEOUT_SECS });
        }
        let ms = u16::try_from(left.as_millis()).unwrap_or(u16::MAX);
        match poll(&mut fds, PollTimeout::from(ms)) {
            Ok(n) if n > 0 => break,
            Ok(_) | Err(nix::Error::EINTR) => continue,
            Err(source) => return Err(SandboxError::Kill { pid, source }),
        }
    }
    match waitpid(Pid::from_raw(pid), Some(WaitPidFlag::WNOHANG)) {
        Ok(_) | Err(nix::Error::ECHILD) => Ok(()),
        Err(source) => Err(SandboxError::Kill { pid, source }),
    }
}

impl Sandbox {
    /// Mark the sandbox as going away; new execs are refused from now on.
    /// Returns false if it is already being removed.
    pub fn begin_stop(&self) -> bool {
        self.stop_if("remove", || Ok(())).is_ok()
    }

    /// [`Sandbox::begin_stop`] for an idle suspend taken when the sandbox
    /// had been used `uses` times ([`Due::Idle`](super::Due)): refused
    /// (`UsedAgain`) if an exec runs or an API call named it since. Checked
    /// under the state lock an exec's start reads the state under, after
    /// counting itself busy: an exec that saw the sandbox running is seen
    /// here, and one that comes later finds it stopping.
    pub fn begin_idle_stop(&self, uses: u64) -> Result<(), SandboxError> {
        self.stop_if("suspend", || match self.unused_since(uses) {
            true => Ok(()),
            false => Err(SandboxError::UsedAgain(self.id.clone())),
        })
    }

    /// The stop transition, if `check` (run under the state lock) allows.
    fn stop_if(
        &self,
        action: &'static str,
        check: impl FnOnce() -> Result<(), SandboxError>,
    ) -> Result<(), SandboxError> {
        self.transition(RunEvent::Stop, action, check)?;
        self.gone.set(true);
        Ok(())
    }

    /// Undo [`Sandbox::begin_stop`] after a failed removal so it can be retried.
    pub fn end_stop(&self) {
        self.gone.set(false);
        let _ = self.cgroup.thaw();
        let _ = self.transition(RunEvent::StopFailed, "recover", || Ok(()));
    }

    /// Kill every process, remove the cgroup and the sandbox's directories.
    /// Call after [`Sandbox::begin_stop`].
    pub fn destroy(&self, store: &Store) -> Result<(), SandboxError> {
        let mut t = super::Phases::start("destroy");
        self.stop_processes(&mut t)?;
        store.discard_sandbox(&self.id).map_err(SandboxError::Remove)?;
        t.mark("files");
        t.log(&self.id);
        Ok(())
    }

    /// Kill every process (its mounts go with its mount namespace) and
    /// remove the cgroup; the sandbox's files stay. Call after
    /// [`Sandbox::begin_stop`].
    pub fn stop(&self) -> Result<(), SandboxError> {
        self.stop_processes(&mut super::Phases::start("stop"))
    }

    /// Queue SIGKILL for PID 1: from here nothing in the sandbox runs
    /// again (the kernel kills every process of its PID namespace with
    /// PID 1), though the kernel may take a moment to end them all. Frozen
    /// tasks act on SIGKILL only once thawed (v1 freezer): the kill is
    /// queued first so nothing runs in between, then the cgroup thaws.
    pub fn kill(&self) {
        let _ = sys::pidfd_send_signal(self.pidfd.as_fd(), libc::SIGKILL);
        let _ = self.cgroup.thaw();
    }

    fn stop_processes(&self, t: &mut super::Phases) -> Result<(), SandboxError> {
        self.kill();
        kill_and_reap(self.shim_pid, self.pidfd.as_fd())?;
        t.mark("kill");
        if let Some(net) = &self.net {
            net.detach();
            t.mark("network");
        }
        self.cgroup.remove(Duration::from_secs(KILL_TIMEOUT_SECS)).map_err(SandboxError::Cgroup)?;
        self.remove_capture_cgroup(Duration::from_secs(KILL_TIMEOUT_SECS))?;
        t.mark("cgroup");
        Ok(())
    }
}
