//! The raw syscalls Strata needs that `nix` does not wrap: `clone3` into new
//! namespaces, the new mount API (`fsopen`/`fsconfig`/`fsmount`/`move_mount`),
//! idmapped mounts, pidfds, loopback bring-up, GRO, capability sets, tty and
//! loop-device ioctls; and libnftables, loaded at run time.
//!
//! This is the one module of the workspace that contains `unsafe`; every block
//! says which invariants it relies on. Everything else is `forbid(unsafe_code)`.
//!
//! One file per family (`spawn`, `mount`, `fs`, `creds`, `net`, `bpf`,
//! `nft`), all re-exported here: callers name `sys::X`.

mod bpf;
mod creds;
mod fs;
mod mount;
mod net;
mod nft;
mod spawn;

pub use bpf::*;
pub use creds::*;
pub use fs::*;
pub use mount::*;
pub use net::*;
pub use nft::*;
pub use spawn::*;

use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

use nix::errno::Errno;

/// The supplementary groups of a Unix socket's peer as they were when it
/// connected (SO_PEERGROUPS, Linux 4.13): unlike the peer's /proc status,
/// immune to the peer exiting and its pid being reused.
pub fn peer_groups(sock: BorrowedFd<'_>) -> Result<Vec<u32>, Errno> {
    let mut groups = vec![0 as libc::gid_t; 64];
    loop {
        let mut len = (groups.len() * std::mem::size_of::<libc::gid_t>()) as libc::socklen_t;
        // SAFETY: `groups` is a writable buffer of `len` bytes that outlives
        // the call; the kernel writes at most `len` bytes and sets `len`.
        let r = unsafe {
            libc::getsockopt(
                sock.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_PEERGROUPS,
                groups.as_mut_ptr().cast::<libc::c_void>(),
                &mut len,
            )
        };
        let n = len as usize / std::mem::size_of::<libc::gid_t>();
        match r {
            0 => {
                groups.truncate(n);
                return Ok(groups);
            }
            _ if Errno::last() == Errno::ERANGE && n > groups.len() => groups.resize(n, 0),
            _ => return Err(Errno::last()),
        }
    }
}

/// Signal the process behind a pidfd; immune to pid reuse.
pub fn pidfd_send_signal(pidfd: BorrowedFd<'_>, signal: i32) -> Result<(), Errno> {
    // SAFETY: plain syscall; a null siginfo means "as kill(2) would".
    let r = unsafe {
        libc::syscall(libc::SYS_pidfd_send_signal, pidfd.as_raw_fd(), signal, std::ptr::null::<libc::siginfo_t>(), 0)
    };
    if r < 0 {
        return Err(Errno::last());
    }
    Ok(())
}

/// Make `fd` (a pty slave) the controlling terminal of the calling session leader.
pub fn set_controlling_tty(fd: RawFd) -> Result<(), Errno> {
    // SAFETY: TIOCSCTTY takes an int argument; no memory is passed.
    if unsafe { libc::ioctl(fd, libc::TIOCSCTTY, 0) } < 0 {
        return Err(Errno::last());
    }
    Ok(())
}

/// Set a terminal's window size.
pub fn set_window_size(fd: BorrowedFd<'_>, rows: u16, cols: u16) -> Result<(), Errno> {
    let ws = libc::winsize { ws_row: rows, ws_col: cols, ws_xpixel: 0, ws_ypixel: 0 };
    // SAFETY: TIOCSWINSZ reads a winsize we own.
    if unsafe { libc::ioctl(fd.as_raw_fd(), libc::TIOCSWINSZ, &ws) } < 0 {
        return Err(Errno::last());
    }
    Ok(())
}

/// Mark every fd >= `first` close-on-exec, in a new child before exec:
/// they close at its execve (or its exit), not before. A
/// [`spawn_shared`] child's gate must stay open until then.
pub fn cloexec_from(first: u32) {
    // SAFETY: close_range takes integers only and closes nothing here.
    let r = unsafe { libc::syscall(libc::SYS_close_range, first, u32::MAX, libc::CLOSE_RANGE_CLOEXEC) };
    if r != 0 {
        // Linux before 5.11: one fd at a time, up to the open-files limit.
        let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: the kernel writes `lim`, alive for the call.
        unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) };
        for fd in first as u64..lim.rlim_cur.min(1 << 20) {
            // SAFETY: integers only; a number that is no open fd is EBADF.
            unsafe { libc::fcntl(fd as libc::c_int, libc::F_SETFD, libc::FD_CLOEXEC) };
        }
    }
}

/// Take ownership of the listening socket the daemon left at fd 3.
pub fn inherited_listener() -> Result<OwnedFd, Errno> {
    nix::fcntl::fcntl(crate::proto::LISTEN_FD, nix::fcntl::FcntlArg::F_GETFD)?;
    // SAFETY: F_GETFD just proved fd 3 is open; it was handed to this process
    // for exactly this purpose and nothing else in the process refers to it.
    let fd = unsafe { OwnedFd::from_raw_fd(crate::proto::LISTEN_FD) };
    nix::fcntl::fcntl(fd.as_raw_fd(), nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::FD_CLOEXEC))?;
    Ok(fd)
}

/// `accept4(SOCK_CLOEXEC)` returning an owned fd.
pub fn accept(listener: BorrowedFd<'_>) -> Result<OwnedFd, Errno> {
    let fd = nix::sys::socket::accept4(listener.as_raw_fd(), nix::sys::socket::SockFlag::SOCK_CLOEXEC)?;
    // SAFETY: accept4 returned a new descriptor that we alone own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Ignore SIGPIPE (`false`) or restore its default action (`true`).
pub fn set_sigpipe(default: bool) -> Result<(), Errno> {
    use nix::sys::signal::{signal, SigHandler, Signal};
    let h = if default { SigHandler::SigDfl } else { SigHandler::SigIgn };
    // SAFETY: SIG_DFL and SIG_IGN install no Rust handler code.
    unsafe { signal(Signal::SIGPIPE, h) }.map(|_| ())
}

/// Allocate a pseudo-terminal in the current `/dev/pts`; returns the master
/// and the slave's path.
pub fn open_pty() -> Result<(OwnedFd, String), Errno> {
    use nix::fcntl::OFlag;
    use nix::pty::{grantpt, posix_openpt, ptsname_r, unlockpt};
    use std::os::fd::IntoRawFd;
    let m = posix_openpt(OFlag::O_RDWR | OFlag::O_NOCTTY | OFlag::O_CLOEXEC)?;
    grantpt(&m)?;
    unlockpt(&m)?;
    let name = ptsname_r(&m)?;
    // SAFETY: into_raw_fd hands over sole ownership of the master fd.
    Ok((unsafe { OwnedFd::from_raw_fd(m.into_raw_fd()) }, name))
}

/// A terminal's window size as (rows, cols).
pub fn window_size(fd: BorrowedFd<'_>) -> Result<(u16, u16), Errno> {
    let mut ws = libc::winsize { ws_row: 0, ws_col: 0, ws_xpixel: 0, ws_ypixel: 0 };
    // SAFETY: TIOCGWINSZ writes a winsize into memory we own.
    if unsafe { libc::ioctl(fd.as_raw_fd(), libc::TIOCGWINSZ, &mut ws) } < 0 {
        return Err(Errno::last());
    }
    Ok((ws.ws_row, ws.ws_col))
}

/// Set the nice value of the calling thread (Linux: `PRIO_PROCESS` with 0
/// is the calling thread). Lowering it below the current value needs
/// CAP_SYS_NICE.
pub fn set_thread_nice(nice: i32) -> Result<(), Errno> {
    set_nice(0, nice)
}

/// The nice value of thread `tid` (a single-threaded process's pid; 0 is
/// the calling thread).
pub fn set_nice(tid: i32, nice: i32) -> Result<(), Errno> {
    let tid = libc::id_t::try_from(tid).map_err(|_| Errno::EINVAL)?;
    // SAFETY: setpriority takes integers only.
    let r = unsafe { libc::setpriority(libc::PRIO_PROCESS, tid, nice) };
    Errno::result(r).map(drop)
}

/// Stop being killed when the parent thread exits (see `spawn_in_namespaces`).
pub fn clear_parent_death_signal() -> Result<(), Errno> {
    // SAFETY: prctl with integer arguments only.
    let r = unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, 0 as libc::c_ulong, 0, 0, 0) };
    Errno::result(r).map(drop)
}

#[cfg(test)]
mod tests;
