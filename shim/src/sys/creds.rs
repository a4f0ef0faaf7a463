//! Capability sets and a thread's file-system ids.

use nix::errno::Errno;

/// `_LINUX_CAPABILITY_VERSION_3`.
pub(super) const CAP_V3: u32 = 0x2008_0522;

#[repr(C)]
pub(super) struct CapHeader {
    version: u32,
    pid: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(super) struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

/// For the calling thread only: file system ids `uid`/`gid` (what files it
/// creates are owned by, what access checks compare), with its capabilities
/// kept effective (the kernel clears the file system ones when fsuid leaves
/// 0). Used by a short-lived thread whose credentials a mount records.
pub fn set_thread_fs_ids(uid: u32, gid: u32) -> Result<(), Errno> {
    // SAFETY: plain syscalls with integer arguments; they act on this
    // thread's credentials only (raw, unlike glibc's setxid broadcast).
    unsafe {
        libc::syscall(libc::SYS_setfsgid, gid);
        libc::syscall(libc::SYS_setfsuid, uid);
    }
    let header = CapHeader { version: CAP_V3, pid: 0 };
    let mut data = [CapData::default(); 2];
    // SAFETY: header and data are the v3 layout capget(2) fills.
    if unsafe { libc::syscall(libc::SYS_capget, &header as *const CapHeader, data.as_mut_ptr()) } < 0 {
        return Err(Errno::last());
    }
    for d in &mut data {
        d.effective = d.permitted;
    }
    // SAFETY: as above, for capset(2).
    if unsafe { libc::syscall(libc::SYS_capset, &header as *const CapHeader, data.as_ptr()) } < 0 {
        return Err(Errno::last());
    }
    // setfsuid reports the previous id, not errors: check the result.
    // SAFETY: -1 is an invalid id, so these only read the current ids.
    let (now_uid, now_gid) =
        unsafe { (libc::syscall(libc::SYS_setfsuid, u32::MAX), libc::syscall(libc::SYS_setfsgid, u32::MAX)) };
    if (now_uid as u32, now_gid as u32) != (uid, gid) {
        return Err(Errno::EPERM);
    }
    Ok(())
}

/// For the calling thread only: act on files as `uid`/`gid` (supplementary
/// groups just `gid`): access checks are theirs and new files are theirs.
/// Leaving fsuid 0 makes the kernel drop the file capabilities
/// (`CAP_DAC_OVERRIDE`, `CAP_FOWNER`, `CAP_CHOWN`, ...) from the effective
/// set (capabilities(7)), so root's overrides go too. Meant for a thread
/// that ends after its work.
pub fn act_on_files_as(uid: u32, gid: u32) -> Result<(), Errno> {
    let groups = [gid];
    // SAFETY: `groups` is a valid gid_t array of the length passed; raw
    // syscalls act on this thread's credentials only (glibc's wrappers
    // would broadcast to every thread).
    if unsafe { libc::syscall(libc::SYS_setgroups, 1usize, groups.as_ptr()) } < 0 {
        return Err(Errno::last());
    }
    // SAFETY: plain syscalls with integer arguments, this thread only.
    unsafe {
        libc::syscall(libc::SYS_setfsgid, gid);
        libc::syscall(libc::SYS_setfsuid, uid);
    }
    // setfsuid reports the previous id, not errors: check the result.
    // SAFETY: -1 is an invalid id, so these only read the current ids.
    let (now_uid, now_gid) =
        unsafe { (libc::syscall(libc::SYS_setfsuid, u32::MAX), libc::syscall(libc::SYS_setfsgid, u32::MAX)) };
    if (now_uid as u32, now_gid as u32) != (uid, gid) {
        return Err(Errno::EPERM);
    }
    Ok(())
}
