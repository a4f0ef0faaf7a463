//! A cgroup v2 device filter: the BPF program loaded and attached.

use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

use nix::errno::Errno;

/// One eBPF instruction (`struct bpf_insn`): opcode, registers (dst in the
/// low nibble, src in the high one), offset, immediate.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BpfInsn {
    pub code: u8,
    pub regs: u8,
    pub off: i16,
    pub imm: i32,
}

/// `BPF_PROG_TYPE_CGROUP_DEVICE` and `BPF_CGROUP_DEVICE` (uapi/linux/bpf.h).
pub(super) const BPF_PROG_TYPE_CGROUP_DEVICE: u32 = 15;

pub(super) const BPF_CGROUP_DEVICE: u32 = 6;

pub(super) const BPF_PROG_LOAD: libc::c_int = 5;

pub(super) const BPF_PROG_ATTACH: libc::c_int = 8;

/// The leading fields of `union bpf_attr` for BPF_PROG_LOAD (the kernel
/// treats the fields after `size` bytes as zero).
#[repr(C)]
#[derive(Default)]
pub(super) struct ProgLoadAttr {
    prog_type: u32,
    insn_cnt: u32,
    insns: u64,
    license: u64,
    log_level: u32,
    log_size: u32,
    log_buf: u64,
    kern_version: u32,
    prog_flags: u32,
    prog_name: [u8; 16],
}

/// The leading fields of `union bpf_attr` for BPF_PROG_ATTACH.
#[repr(C)]
#[derive(Default)]
pub(super) struct ProgAttachAttr {
    target_fd: u32,
    attach_bpf_fd: u32,
    attach_type: u32,
    attach_flags: u32,
}

/// Load `program` as a cgroup device filter and attach it to the cgroup v2
/// directory `cgroup`: from then on every open or mknod of a device node
/// by the cgroup's processes asks it (1 allows, 0 refuses with EPERM). The
/// program stays attached until the cgroup is removed.
pub fn attach_device_filter(cgroup: BorrowedFd<'_>, program: &[BpfInsn]) -> Result<(), Errno> {
    let license = c"Apache-2.0";
    let mut load = ProgLoadAttr {
        prog_type: BPF_PROG_TYPE_CGROUP_DEVICE,
        insn_cnt: u32::try_from(program.len()).map_err(|_| Errno::E2BIG)?,
        insns: program.as_ptr() as u64,
        license: license.as_ptr() as u64,
        ..Default::default()
    };
    load.prog_name[..12].copy_from_slice(b"strata_devcg");
    // SAFETY: `load` is a valid, fully initialised bpf_attr prefix of the
    // size passed; the pointers in it (program, license) outlive the call.
    let fd = unsafe {
        libc::syscall(libc::SYS_bpf, BPF_PROG_LOAD, &load as *const ProgLoadAttr, std::mem::size_of::<ProgLoadAttr>())
    };
    if fd < 0 {
        return Err(Errno::last());
    }
    // SAFETY: the kernel returned a new descriptor that we alone own.
    let prog = unsafe { OwnedFd::from_raw_fd(fd as RawFd) };
    let attach = ProgAttachAttr {
        target_fd: cgroup.as_raw_fd() as u32,
        attach_bpf_fd: prog.as_raw_fd() as u32,
        attach_type: BPF_CGROUP_DEVICE,
        attach_flags: 0,
    };
    // SAFETY: `attach` is a valid bpf_attr prefix of the size passed; both
    // descriptors in it are open for the duration of the call.
    let r = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_PROG_ATTACH,
            &attach as *const ProgAttachAttr,
            std::mem::size_of::<ProgAttachAttr>(),
        )
    };
    if r < 0 {
        return Err(Errno::last());
    }
    Ok(())
}
