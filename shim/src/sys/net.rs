//! Loopback bring-up and GRO on a link (ethtool).

use std::os::fd::AsRawFd;

use nix::errno::Errno;

/// `ETHTOOL_SGRO` of `<linux/ethtool.h>` (the legacy one-feature ioctl:
/// the rust-netlink `ethtool` crate reads features but cannot set them).
pub(super) const ETHTOOL_SGRO: u32 = 0x2c;

/// `struct ethtool_value`.
#[repr(C)]
pub(super) struct EthtoolValue {
    cmd: u32,
    data: u32,
}

/// Turn generic receive offload on or off for the link `name` of the
/// calling thread's network namespace (`ethtool -K NAME gro on|off`).
pub fn set_gro(name: &str, on: bool) -> Result<(), Errno> {
    use nix::sys::socket::{socket, AddressFamily, SockFlag, SockType};
    if name.len() >= libc::IFNAMSIZ || name.as_bytes().contains(&0) {
        return Err(Errno::EINVAL);
    }
    let sock = socket(AddressFamily::Inet, SockType::Datagram, SockFlag::SOCK_CLOEXEC, None)?;
    let mut value = EthtoolValue { cmd: ETHTOOL_SGRO, data: u32::from(on) };
    // SAFETY: ifreq is plain old data; zeroed is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in req.ifr_name.iter_mut().zip(name.as_bytes()) {
        *dst = *src as libc::c_char;
    }
    req.ifr_ifru.ifru_data = (&mut value as *mut EthtoolValue).cast();
    // SAFETY: SIOCETHTOOL reads the ifreq we own (a NUL-terminated name,
    // checked above, and a pointer to an ethtool_value that outlives the
    // call); ETHTOOL_SGRO only reads that value.
    if unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCETHTOOL as _, &mut req) } < 0 {
        return Err(Errno::last());
    }
    Ok(())
}

/// Bring `lo` up in the current network namespace.
pub fn loopback_up() -> Result<(), Errno> {
    use nix::sys::socket::{socket, AddressFamily, SockFlag, SockType};
    let sock = socket(AddressFamily::Inet, SockType::Datagram, SockFlag::SOCK_CLOEXEC, None)?;
    // SAFETY: ifreq is plain old data; zeroed is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in req.ifr_name.iter_mut().zip(b"lo\0") {
        *dst = *src as libc::c_char;
    }
    // SAFETY: SIOCGIFFLAGS reads into the ifreq we own.
    if unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFFLAGS as _, &mut req) } < 0 {
        return Err(Errno::last());
    }
    // SAFETY: the union member ifru_flags is the one SIOCGIFFLAGS filled.
    unsafe { req.ifr_ifru.ifru_flags |= (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short };
    // SAFETY: SIOCSIFFLAGS reads the ifreq we own.
    if unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCSIFFLAGS as _, &req) } < 0 {
        return Err(Errno::last());
    }
    Ok(())
}

/// `NS_GET_NSTYPE` of `<linux/nsfs.h>`: `_IO(0xb7, 0x3)`.
const NS_GET_NSTYPE: libc::c_ulong = 0xb703;

/// Whether `fd` is a network namespace (a `/proc/PID/ns/net` or a bind
/// mount of one, such as `/var/run/netns/NAME`): nsfs tells its type.
pub fn is_network_namespace(fd: std::os::fd::BorrowedFd<'_>) -> Result<bool, Errno> {
    // SAFETY: NS_GET_NSTYPE takes no argument and only reads the file's
    // inode; on a file that is no namespace it fails (ENOTTY) and changes
    // nothing.
    let t = unsafe { libc::ioctl(fd.as_raw_fd(), NS_GET_NSTYPE as _) };
    match t {
        t if t >= 0 => Ok(t == libc::CLONE_NEWNET),
        _ if Errno::last() == Errno::ENOTTY => Ok(false),
        _ => Err(Errno::last()),
    }
}
