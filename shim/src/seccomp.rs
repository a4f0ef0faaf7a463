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
//! made through another ABI kills the process). `--seccomp unconfined` on a
//! sandbox leaves it out.

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
    Ok(vec![compile(deny)?, compile(clone3)?])
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
        assert_eq!(f.len(), 2);
        assert!(f.iter().all(|p| !p.is_empty() && p.len() < 4096));
    }
}
