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
//! made through another ABI kills the process). On x86_64 a third filter
//! refuses the x32 ABI (ENOSYS): x32 calls carry the x86_64 audit
//! architecture with bit 30 set in the number, so a deny list by number
//! would miss them on kernels built with x32. `--seccomp unconfined` on a
//! sandbox leaves all of it out.

use std::collections::BTreeMap;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter, SeccompRule, TargetArch,
};

#[derive(Debug, thiserror::Error)]
pub enum SeccompError {
    #[error("build the seccomp filter: {0}")]
    Build(String),
    #[error("install the seccomp filter: {0}")]
    Install(String),
}

#[cfg(target_arch = "x86_64")]
const ARCH: TargetArch = TargetArch::x86_64;
#[cfg(target_arch = "aarch64")]
const ARCH: TargetArch = TargetArch::aarch64;

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

/// The filters, in install order: the deny list (EPERM, with `unshare` and
/// `clone` denied only when they ask for a user namespace), then `clone3`
/// (ENOSYS).
fn filters() -> Result<Vec<BpfProgram>, SeccompError> {
    let b = |e: seccompiler::BackendError| SeccompError::Build(e.to_string());
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> = DENIED.iter().map(|&n| (n, vec![])).collect();
    let newuser = libc::CLONE_NEWUSER as u64;
    let flags_ask_newuser =
        || SeccompCondition::new(0, SeccompCmpArgLen::Qword, SeccompCmpOp::MaskedEq(newuser), newuser).map_err(b);
    rules.insert(libc::SYS_unshare, vec![SeccompRule::new(vec![flags_ask_newuser()?]).map_err(b)?]);
    rules.insert(libc::SYS_clone, vec![SeccompRule::new(vec![flags_ask_newuser()?]).map_err(b)?]);
    let deny =
        SeccompFilter::new(rules, SeccompAction::Allow, SeccompAction::Errno(libc::EPERM as u32), ARCH).map_err(b)?;
    let clone3 = SeccompFilter::new(
        [(libc::SYS_clone3, vec![])].into_iter().collect(),
        SeccompAction::Allow,
        SeccompAction::Errno(libc::ENOSYS as u32),
        ARCH,
    )
    .map_err(b)?;
    let compile = |f: SeccompFilter| -> Result<BpfProgram, SeccompError> {
        f.try_into().map_err(|e: seccompiler::BackendError| SeccompError::Build(e.to_string()))
    };
    let mut progs = vec![compile(deny)?, compile(clone3)?];
    if cfg!(target_arch = "x86_64") {
        progs.push(no_x32());
    }
    Ok(progs)
}

/// Bit 30 of a syscall number on x86_64 selects the x32 ABI.
const X32_SYSCALL_BIT: u32 = 0x4000_0000;
const AUDIT_ARCH_X86_64: u32 = 62 | 0x8000_0000 | 0x4000_0000;
const SECCOMP_RET_ALLOW: u32 = 0x7fff_0000;
const SECCOMP_RET_ERRNO: u32 = 0x0005_0000;

/// `seccomp_data` offsets: the syscall number, then the audit architecture.
const OFFSET_NR: u32 = 0;
const OFFSET_ARCH: u32 = 4;

/// Every x32 call (x86_64 audit architecture, number >= bit 30): ENOSYS,
/// as on a kernel without x32. Anything else: allowed (the other filters
/// decide).
fn no_x32() -> BpfProgram {
    const LD_W_ABS: u16 = 0x20; // BPF_LD | BPF_W | BPF_ABS
    const JEQ_K: u16 = 0x15; // BPF_JMP | BPF_JEQ | BPF_K
    const JGE_K: u16 = 0x35; // BPF_JMP | BPF_JGE | BPF_K
    const RET_K: u16 = 0x06; // BPF_RET | BPF_K
    let i = |code, jt, jf, k| seccompiler::sock_filter { code, jt, jf, k };
    vec![
        i(LD_W_ABS, 0, 0, OFFSET_ARCH),
        i(JEQ_K, 0, 3, AUDIT_ARCH_X86_64),
        i(LD_W_ABS, 0, 0, OFFSET_NR),
        i(JGE_K, 0, 1, X32_SYSCALL_BIT),
        i(RET_K, 0, 0, SECCOMP_RET_ERRNO | libc::ENOSYS as u32),
        i(RET_K, 0, 0, SECCOMP_RET_ALLOW),
    ]
}

/// Install the filters on the calling (only) thread; it is inherited by
/// every process it starts. Needs `no_new_privs` (set just before).
pub fn install() -> Result<(), SeccompError> {
    for prog in filters()? {
        seccompiler::apply_filter(&prog).map_err(|e| SeccompError::Install(e.to_string()))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_filters_compile() {
        let f = super::filters().unwrap();
        assert_eq!(f.len(), if cfg!(target_arch = "x86_64") { 3 } else { 2 });
        assert!(f.iter().all(|p| !p.is_empty() && p.len() < 4096));
    }

    /// Run a classic BPF program of the few kinds `no_x32` uses.
    fn run(prog: &[seccompiler::sock_filter], nr: u32, arch: u32) -> u32 {
        let (mut pc, mut acc) = (0usize, 0u32);
        loop {
            let ins = &prog[pc];
            match ins.code {
                0x20 => acc = if ins.k == super::OFFSET_NR { nr } else { arch },
                0x15 | 0x35 => {
                    let hit = if ins.code == 0x15 { acc == ins.k } else { acc >= ins.k };
                    pc += usize::from(if hit { ins.jt } else { ins.jf });
                }
                0x06 => return ins.k,
                c => panic!("unexpected opcode {c:#x}"),
            }
            pc += 1;
        }
    }

    #[test]
    fn x32_calls_are_refused_and_others_left_to_the_other_filters() {
        let p = super::no_x32();
        let x86_64 = super::AUDIT_ARCH_X86_64;
        let enosys = super::SECCOMP_RET_ERRNO | libc::ENOSYS as u32;
        // x32 getpid, x32 mount (the numbers a deny list by number misses).
        assert_eq!(run(&p, super::X32_SYSCALL_BIT | 39, x86_64), enosys);
        assert_eq!(run(&p, super::X32_SYSCALL_BIT | 165, x86_64), enosys);
        // Plain x86_64 calls and other architectures pass this filter.
        assert_eq!(run(&p, 39, x86_64), super::SECCOMP_RET_ALLOW);
        assert_eq!(run(&p, 165, x86_64), super::SECCOMP_RET_ALLOW);
        assert_eq!(run(&p, super::X32_SYSCALL_BIT | 39, 0x4000_0003), super::SECCOMP_RET_ALLOW);
    }
}
