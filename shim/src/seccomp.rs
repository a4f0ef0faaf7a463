//! The sandbox's seccomp filter, installed by the shim at the end of setup
//! (after `no_new_privs`), so the shim and every command it starts run
//! under it. A deny list, like the spirit of Docker's default profile: what
//! a workload does not need and what has been the way out of containers
//! (mounting, kernel modules and kexec, bpf, perf events, the kernel
//! keyring, handle-based opens, namespace entry and user namespaces,
//! io_uring, clock and swap control, cross-process memory access). Denied
//! calls fail with EPERM; `clone3` fails with ENOSYS, because its flags are
//! behind a pointer a filter cannot read, so libc falls back to `clone`,
//! whose flags it can. The filter checks the architecture first (a call
//! made through another ABI kills the process). On x86_64 it also refuses
//! the x32 ABI (ENOSYS): x32 calls carry the x86_64 audit architecture with
//! bit 30 set in the number, so a deny list by number would miss them on
//! kernels built with x32. `--seccomp unconfined` on a sandbox leaves all
//! of it out.
//!
//! All of it is one classic BPF program, written out here rather than
//! compiled by seccompiler: seccompiler gives a filter one action for every
//! rule, so EPERM, ENOSYS and the x32 check took three filters, and each
//! filter costs its own attachment (a JIT compilation and the kernel's
//! per-syscall action cache) at every sandbox start and its own run at
//! every call the cache cannot answer. seccompiler still installs it.

use seccompiler::sock_filter;

#[derive(Debug, thiserror::Error)]
pub enum SeccompError {
    #[error("build the seccomp filter: {0}")]
    Build(String),
    #[error("install the seccomp filter: {0}")]
    Install(String),
}

/// The audit architecture of this build's native ABI (linux/audit.h:
/// EM_* | __AUDIT_ARCH_64BIT | __AUDIT_ARCH_LE).
#[cfg(target_arch = "x86_64")]
const AUDIT_ARCH: u32 = 62 | 0x8000_0000 | 0x4000_0000;
#[cfg(target_arch = "aarch64")]
const AUDIT_ARCH: u32 = 183 | 0x8000_0000 | 0x4000_0000;

/// Always denied (EPERM).
const DENIED: &[libc::c_long] = &[
    libc::SYS_mount,
    libc::SYS_umount2,
    libc::SYS_pivot_root,
    libc::SYS_open_tree,
    libc::SYS_move_mount,
    libc::SYS_fsopen,
    libc::SYS_fsconfig,
    libc::SYS_fsmount,
    libc::SYS_fspick,
    libc::SYS_mount_setattr,
    libc::SYS_init_module,
    libc::SYS_finit_module,
    libc::SYS_delete_module,
    libc::SYS_kexec_load,
    libc::SYS_kexec_file_load,
    libc::SYS_bpf,
    libc::SYS_perf_event_open,
    libc::SYS_keyctl,
    libc::SYS_add_key,
    libc::SYS_request_key,
    libc::SYS_open_by_handle_at,
    libc::SYS_name_to_handle_at,
    libc::SYS_setns,
    libc::SYS_reboot,
    libc::SYS_swapon,
    libc::SYS_swapoff,
    libc::SYS_syslog,
    libc::SYS_acct,
    libc::SYS_settimeofday,
    libc::SYS_clock_settime,
    libc::SYS_clock_adjtime,
    libc::SYS_adjtimex,
    libc::SYS_quotactl,
    libc::SYS_userfaultfd,
    libc::SYS_process_vm_readv,
    libc::SYS_process_vm_writev,
    libc::SYS_io_uring_setup,
    libc::SYS_io_uring_enter,
    libc::SYS_io_uring_register,
    libc::SYS_vhangup,
    #[cfg(target_arch = "x86_64")]
    libc::SYS_iopl,
    #[cfg(target_arch = "x86_64")]
    libc::SYS_ioperm,
    #[cfg(target_arch = "x86_64")]
    libc::SYS_uselib,
];

/// Denied (EPERM) only when their flags (the first argument) ask for a
/// user namespace.
const DENIED_WITH_NEWUSER: &[libc::c_long] = &[libc::SYS_unshare, libc::SYS_clone];

/// Bit 30 of a syscall number on x86_64 selects the x32 ABI.
const X32_SYSCALL_BIT: u32 = 0x4000_0000;

/// `struct seccomp_data`: the number, the audit architecture, the
/// instruction pointer, then six 64-bit arguments (the low half first on
/// these little-endian architectures).
const OFFSET_NR: u32 = 0;
const OFFSET_ARCH: u32 = 4;
const OFFSET_ARG0_LOW: u32 = 16;

// Classic BPF opcodes (linux/bpf_common.h); libc has them as u32.
const LD_W_ABS: u16 = (libc::BPF_LD | libc::BPF_W | libc::BPF_ABS) as u16;
const JEQ_K: u16 = (libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K) as u16;
const JGE_K: u16 = (libc::BPF_JMP | libc::BPF_JGE | libc::BPF_K) as u16;
const JSET_K: u16 = (libc::BPF_JMP | libc::BPF_JSET | libc::BPF_K) as u16;
const RET_K: u16 = (libc::BPF_RET | libc::BPF_K) as u16;

const ALLOW: u32 = libc::SECCOMP_RET_ALLOW;
const KILL_PROCESS: u32 = libc::SECCOMP_RET_KILL_PROCESS;
const EPERM: u32 = libc::SECCOMP_RET_ERRNO | libc::EPERM as u32;
const ENOSYS: u32 = libc::SECCOMP_RET_ERRNO | libc::ENOSYS as u32;

/// Where a conditional jump goes: the next instruction or one of the
/// shared blocks at the program's end.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum To {
    Next,
    Kill,
    CheckNewUser,
    Allow,
    Eperm,
    Enosys,
}

/// One instruction before its jumps are resolved to offsets.
type Insn = (u16, u32, To, To);

fn stmt(code: u16, k: u32) -> Insn {
    (code, k, To::Next, To::Next)
}

/// The program: architecture, then x32 and `clone3` (ENOSYS), then the deny
/// list, then `clone`/`unshare` by their flags; every match jumps to one
/// shared block at the end.
pub fn program() -> Result<Vec<sock_filter>, SeccompError> {
    let mut insns =
        vec![stmt(LD_W_ABS, OFFSET_ARCH), (JEQ_K, AUDIT_ARCH, To::Next, To::Kill), stmt(LD_W_ABS, OFFSET_NR)];
    if cfg!(target_arch = "x86_64") {
        insns.push((JGE_K, X32_SYSCALL_BIT, To::Enosys, To::Next));
    }
    insns.push((JEQ_K, libc::SYS_clone3 as u32, To::Enosys, To::Next));
    insns.extend(DENIED.iter().map(|&nr| (JEQ_K, nr as u32, To::Eperm, To::Next)));
    insns.extend(DENIED_WITH_NEWUSER.iter().map(|&nr| (JEQ_K, nr as u32, To::CheckNewUser, To::Next)));
    insns.push(stmt(RET_K, ALLOW));
    let blocks = [
        (To::Kill, vec![stmt(RET_K, KILL_PROCESS)]),
        (
            To::CheckNewUser,
            vec![stmt(LD_W_ABS, OFFSET_ARG0_LOW), (JSET_K, libc::CLONE_NEWUSER as u32, To::Eperm, To::Allow)],
        ),
        (To::Allow, vec![stmt(RET_K, ALLOW)]),
        (To::Eperm, vec![stmt(RET_K, EPERM)]),
        (To::Enosys, vec![stmt(RET_K, ENOSYS)]),
    ];
    let mut starts = Vec::new();
    for (label, block) in blocks {
        starts.push((label, insns.len()));
        insns.extend(block);
    }
    let at = |to: To| starts.iter().find(|(label, _)| *label == to).map(|(_, pc)| *pc);
    insns
        .iter()
        .enumerate()
        .map(|(pc, &(code, k, t, f))| {
            // Offsets count from the next instruction and only go forward.
            let offset = |to: To| match to {
                To::Next => Ok(0),
                _ => at(to)
                    .and_then(|target| target.checked_sub(pc + 1))
                    .and_then(|offset| u8::try_from(offset).ok())
                    .ok_or_else(|| SeccompError::Build(format!("no jump from {pc} to {to:?}"))),
            };
            Ok(sock_filter { code, jt: offset(t)?, jf: offset(f)?, k })
        })
        .collect()
}

/// Install the filter on the calling (only) thread; it is inherited by
/// every process it starts. Needs `no_new_privs` (set just before).
pub fn install() -> Result<(), SeccompError> {
    seccompiler::apply_filter(&program()?).map_err(|e| SeccompError::Install(e.to_string()))
}

#[cfg(all(target_arch = "aarch64", target_endian = "big"))]
compile_error!("the seccomp filter reads arguments at little-endian offsets and names AArch64's little-endian ABI");

#[cfg(test)]
mod tests {
    use super::*;

    /// A call as the kernel hands it to a filter: `struct seccomp_data`,
    /// 64 bytes, little-endian (nr, arch, instruction pointer, six args).
    fn data(nr: u32, arch: u32, args: [u64; 6]) -> [u8; 64] {
        let mut d = [0u8; 64];
        d[0..4].copy_from_slice(&nr.to_le_bytes());
        d[4..8].copy_from_slice(&arch.to_le_bytes());
        for (i, a) in args.iter().enumerate() {
            d[16 + 8 * i..24 + 8 * i].copy_from_slice(&a.to_le_bytes());
        }
        d
    }

    /// Run the classic BPF the program uses, as the kernel would: loads
    /// read the bytes at their offset.
    fn run(prog: &[sock_filter], data: &[u8; 64]) -> u32 {
        let (mut pc, mut acc) = (0usize, 0u32);
        loop {
            let ins = &prog[pc];
            pc += 1;
            let jump = |hit: bool| usize::from(if hit { ins.jt } else { ins.jf });
            match ins.code {
                LD_W_ABS => {
                    let k = ins.k as usize;
                    assert!(k.is_multiple_of(4) && k + 4 <= data.len(), "load from offset {k}");
                    acc = u32::from_le_bytes(data[k..k + 4].try_into().unwrap());
                }
                JEQ_K => pc += jump(acc == ins.k),
                JGE_K => pc += jump(acc >= ins.k),
                JSET_K => pc += jump(acc & ins.k != 0),
                RET_K => return ins.k,
                c => panic!("unexpected opcode {c:#x}"),
            }
        }
    }

    fn native(nr: libc::c_long, arg0: u64) -> [u8; 64] {
        data(nr as u32, AUDIT_ARCH, [arg0, 0, 0, 0, 0, 0])
    }

    #[test]
    fn the_audit_architecture_is_the_native_abis() {
        #[cfg(target_arch = "x86_64")]
        assert_eq!(AUDIT_ARCH, 0xC000_003E);
        #[cfg(target_arch = "aarch64")]
        assert_eq!(AUDIT_ARCH, 0xC000_00B7);
    }

    #[test]
    fn one_program_decides_every_call() {
        let p = program().unwrap();
        assert!(p.len() < 4096, "{}", p.len());
        for &nr in DENIED {
            assert_eq!(run(&p, &native(nr, 0)), EPERM, "{nr}");
        }
        let newuser = libc::CLONE_NEWUSER as u64;
        for &nr in DENIED_WITH_NEWUSER {
            assert_eq!(run(&p, &native(nr, newuser | libc::CLONE_NEWNS as u64)), EPERM, "{nr}");
            assert_eq!(run(&p, &native(nr, libc::CLONE_NEWNS as u64)), ALLOW, "{nr}");
            // The flags are the low half of the first argument only.
            assert_eq!(run(&p, &native(nr, newuser << 32)), ALLOW, "{nr}");
            assert_eq!(run(&p, &data(nr as u32, AUDIT_ARCH, [0, newuser, 0, 0, 0, 0])), ALLOW, "{nr}");
        }
        assert_eq!(run(&p, &native(libc::SYS_clone3, 0)), ENOSYS);
        for nr in [libc::SYS_getpid, libc::SYS_read, libc::SYS_execve, libc::SYS_openat] {
            assert_eq!(run(&p, &native(nr, 0)), ALLOW, "{nr}");
        }
        // Another ABI (here i386's audit architecture): killed.
        assert_eq!(run(&p, &data(39, 3 | 0x4000_0000, [0; 6])), KILL_PROCESS);
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn x32_calls_are_refused() {
        let p = program().unwrap();
        // x32 getpid and mount: numbers a deny list by number misses.
        for nr in [39, 165] {
            assert_eq!(run(&p, &native(i64::from(X32_SYSCALL_BIT | nr), 0)), ENOSYS, "{nr}");
        }
    }
}
