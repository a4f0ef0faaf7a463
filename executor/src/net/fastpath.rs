//! The fast path of a sandbox's host end: GRO on, and its NAPI in a kernel
//! thread of its own (`/sys/class/net/<link>/threaded`).
//!
//! What a sandbox sends arrives on the host end of its veth. By default the
//! kernel forwards it (routing, conntrack, NAT, the uplink) in the softirq
//! of the sending CPU, so a sender and its forwarding share one core. With
//! GRO requested, the veth queues what it receives for a NAPI instance,
//! which batches packets into bigger segments; and with that NAPI threaded,
//! a kernel thread on another core does the forwarding beside the sender.
//! BENCHMARKS.md has the numbers. The NAPI thread is the kernel's: its CPU
//! is not charged to the sandbox's cgroup, as softirq work is not either.
//!
//! The `threaded` knob is a sysfs file, and sysfs shows the devices of the
//! network namespace that mounted it: a daemon started in a namespace of its
//! own without a /sys of it (`nsenter --net`, as the tests start it) sees
//! another namespace's. So [`FastPath::open`] makes a sysfs of the daemon's
//! namespace, mounted nowhere ([`strata_shim::sys::detached_sysfs`]), and
//! the writes go through its descriptor.

use std::io::Write;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};

use nix::errno::Errno;

#[derive(Debug, thiserror::Error)]
pub enum FastPathError {
    #[error("mount a sysfs of the daemon's network namespace")]
    Sysfs(#[source] strata_shim::sys::MountError),
    #[error("turn GRO on for {0}")]
    Gro(String, #[source] Errno),
    #[error("thread the NAPI of {0} (class/net/{0}/threaded)")]
    Threaded(String, #[source] std::io::Error),
}

/// The daemon's way to its links' sysfs attributes; `None` inside when the
/// fast path is off (`--network-napi-thread off`) or could not be had.
pub struct FastPath {
    sysfs: Option<OwnedFd>,
    /// Whether a failure was logged already (once per daemon, not per link).
    warned: AtomicBool,
}

impl FastPath {
    /// The fast path for links of the calling thread's network namespace.
    pub fn open(on: bool) -> Result<FastPath, FastPathError> {
        let sysfs = if on { Some(strata_shim::sys::detached_sysfs().map_err(FastPathError::Sysfs)?) } else { None };
        Ok(FastPath { sysfs, warned: AtomicBool::new(false) })
    }

    /// Off: links keep the kernel's defaults.
    pub fn off() -> FastPath {
        FastPath { sysfs: None, warned: AtomicBool::new(false) }
    }

    pub fn is_on(&self) -> bool {
        self.sysfs.is_some()
    }

    /// Put the link `name` (up, in the daemon's namespace) on the fast
    /// path. A failure is logged once and leaves the link as the kernel
    /// made it: it still works, only slower.
    pub fn tune(&self, name: &str) {
        let Some(sysfs) = &self.sysfs else { return };
        if let Err(e) = thread_napi(sysfs, name) {
            if !self.warned.swap(true, Ordering::Relaxed) {
                tracing::warn!(
                    "network: the veths stay on the softirq path ({}); later failures are not logged",
                    crate::error::chain(&e)
                );
            }
        }
    }
}

fn thread_napi(sysfs: &OwnedFd, name: &str) -> Result<(), FastPathError> {
    // GRO first: the veth makes its NAPI instance when GRO is requested,
    // and `threaded` refuses a link without one (EOPNOTSUPP).
    strata_shim::sys::set_gro(name, true).map_err(|e| FastPathError::Gro(name.to_string(), e))?;
    let threaded = |e: std::io::Error| FastPathError::Threaded(name.to_string(), e);
    let path = std::ffi::CString::new(format!("class/net/{name}/threaded"))
        .map_err(|_| threaded(std::io::Error::from(std::io::ErrorKind::InvalidInput)))?;
    let fd = strata_shim::sys::openat(sysfs.as_fd(), &path, libc::O_WRONLY, 0)
        .map_err(|e| threaded(std::io::Error::from(e)))?;
    std::fs::File::from(fd).write_all(b"1").map_err(threaded)
}
