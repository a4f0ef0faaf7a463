//! The raw syscalls Strata needs that `nix` does not wrap: `clone3` into new
//! namespaces, the new mount API (`fsopen`/`fsconfig`/`fsmount`/`move_mount`),
//! idmapped mounts, pidfds, loopback bring-up, GRO, capability sets, tty and
//! loop-device ioctls; and libnftables, loaded at run time.
//!
//! This is the one module of the workspace that contains `unsafe`; every block
//! says which invariants it relies on. Everything else is `forbid(unsafe_code)`.

use std::ffi::{CStr, CString};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::errno::Errno;

/// Namespaces every sandbox gets.
pub const SANDBOX_NAMESPACES: u64 =
    (libc::CLONE_NEWNS | libc::CLONE_NEWPID | libc::CLONE_NEWUTS | libc::CLONE_NEWIPC | libc::CLONE_NEWNET) as u64;

/// `struct clone_args` from `<linux/sched.h>` (version 2, 88 bytes).
#[repr(C)]
#[derive(Default)]
struct CloneArgs {
    flags: u64,
    pidfd: u64,
    child_tid: u64,
    parent_tid: u64,
    exit_signal: u64,
    stack: u64,
    stack_size: u64,
    tls: u64,
    set_tid: u64,
    set_tid_size: u64,
    cgroup: u64,
}

/// What the child of [`spawn_in_namespaces`] runs. Everything is prepared
/// before the clone: between it and `execve` the child of a multi-threaded
/// parent may only make async-signal-safe calls (and, sharing the parent's
/// memory, must not allocate).
pub struct SpawnPlan<'a> {
    /// The shim to run, an `O_PATH` descriptor of a file no sandbox can
    /// change (executed with `execveat(AT_EMPTY_PATH)`: no path is walked).
    pub exe: BorrowedFd<'a>,
    pub argv: Vec<CString>,
    pub envp: Vec<CString>,
    /// Becomes fd 3 ([`crate::proto::LISTEN_FD`]) in the child.
    pub listener: OwnedFd,
    /// Becomes stdout and stderr in the child (stdin is /dev/null).
    pub log: OwnedFd,
    pub devnull: OwnedFd,
    /// With `CLONE_NEWUSER`: the read end of a pipe. The child waits for
    /// one byte on it (the parent has written its uid/gid maps), becomes
    /// root of its namespace (setgroups, setresgid, setresuid to 0) and
    /// only then execs, so the exec keeps the namespace's capabilities.
    pub userns_gate: Option<OwnedFd>,
    /// cgroup v1 `tasks` files the child writes "0" to before it execs, so
    /// that it is born in its cgroups rather than moved there. A process
    /// moved by pid (`cgroup.procs`) takes the kernel's global threadgroup
    /// lock for writing, which waits for an RCU grace period (10-15 ms on
    /// the test VM); a single-threaded process moving itself through
    /// `tasks` does not. Not with `userns_gate` (kept simple: the daemon
    /// moves that child by pid before it opens the gate) and not on v2 (no
    /// `tasks`; a thread of a domain cgroup cannot move alone: there
    /// [`SpawnPlan::cgroup_dir`]).
    pub cgroup_tasks: Vec<CString>,
    /// cgroup v2: the directory of the cgroup the child is born in
    /// (`clone3`'s `CLONE_INTO_CGROUP`), for the same reason: never moved
    /// by pid. Only where [`can_clone_into_cgroup`].
    pub cgroup_dir: Option<BorrowedFd<'a>>,
}

/// Whether [`spawn_in_namespaces`] and [`spawn_program`] can start a child
/// in a cgroup v2 directory ([`SpawnPlan::cgroup_dir`]): their
/// shared-memory `clone3` is written for x86_64, and the kernel must have
/// `clone3` with `CLONE_INTO_CGROUP` (Linux 5.7) and let us call it (a
/// container's seccomp profile may answer ENOSYS). Asked of the kernel
/// once: a `clone3` into a descriptor that is no cgroup fails with EBADF
/// where both hold, before any process is made. Elsewhere the caller moves
/// the child by pid.
pub fn can_clone_into_cgroup() -> bool {
    static CAN: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *CAN.get_or_init(|| {
        if !cfg!(target_arch = "x86_64") {
            return false;
        }
        let args = CloneArgs {
            flags: CLONE_INTO_CGROUP,
            exit_signal: libc::SIGCHLD as u64,
            // The highest descriptor number the kernel takes here, open in
            // no process.
            cgroup: i32::MAX as u64,
            ..Default::default()
        };
        // SAFETY: `args` is a valid clone_args of the size passed; with no
        // stack, a clone3 that succeeded would behave like fork: the child
        // exits at once, and the parent reaps it.
        let ret =
            unsafe { libc::syscall(libc::SYS_clone3, &args as *const CloneArgs, std::mem::size_of::<CloneArgs>()) };
        match ret {
            // SAFETY: the child of a fork-like clone3: it only exits.
            0 => unsafe { libc::_exit(0) },
            pid if pid > 0 => {
                let _ = nix::sys::wait::waitpid(nix::unistd::Pid::from_raw(pid as i32), None);
                false
            }
            _ => Errno::last() == Errno::EBADF,
        }
    })
}

/// A started process: its pid in our namespace and a pidfd that stays valid
/// (and unambiguous) even after the pid is reused.
pub struct Spawned {
    pub pid: i32,
    pub pidfd: OwnedFd,
}

/// A child in fresh namespaces that `execve`s the shim: sharing our memory
/// until then ([`spawn_shared_in_namespaces`]), or, with a user namespace
/// (the child waits for its maps), `clone3` with fork semantics.
/// The child calls `setsid` so it is nobody's job-control victim and outlives
/// the daemon.
pub fn spawn_in_namespaces(plan: &SpawnPlan<'_>, namespaces: u64) -> Result<Spawned, Errno> {
    // Move the fds the child needs above 2/3 so the dup2 calls below cannot
    // clobber one another; the copies are close-on-exec in the parent.
    let high = |fd: BorrowedFd<'_>| -> Result<OwnedFd, Errno> {
        let raw = nix::fcntl::fcntl(fd.as_raw_fd(), nix::fcntl::FcntlArg::F_DUPFD_CLOEXEC(10))?;
        // SAFETY: F_DUPFD_CLOEXEC returned a new descriptor that we alone own.
        Ok(unsafe { OwnedFd::from_raw_fd(raw) })
    };
    let listener = high(plan.listener.as_fd())?;
    let exe = high(plan.exe)?;
    let log = high(plan.log.as_fd())?;
    let devnull = high(plan.devnull.as_fd())?;

    let mut argv: Vec<*const libc::c_char> = plan.argv.iter().map(|a| a.as_ptr()).collect();
    argv.push(std::ptr::null());
    let mut envp: Vec<*const libc::c_char> = plan.envp.iter().map(|a| a.as_ptr()).collect();
    envp.push(std::ptr::null());

    let fds = [&exe, &listener, &log, &devnull].map(|f| f.as_raw_fd());
    let cgroup = plan.cgroup_dir.map(|d| d.as_raw_fd());
    let Some(gate) = plan.userns_gate.as_ref().map(|g| g.as_raw_fd()) else {
        let join: Vec<*const libc::c_char> = plan.cgroup_tasks.iter().map(|t| t.as_ptr()).collect();
        return spawn_shared_in_namespaces(namespaces, cgroup, fds, &join, &argv, &envp);
    };
    if !plan.cgroup_tasks.is_empty() {
        return Err(Errno::EINVAL);
    }
    let mut pidfd: RawFd = -1;
    let args = CloneArgs {
        flags: namespaces | libc::CLONE_PIDFD as u64 | if cgroup.is_some() { CLONE_INTO_CGROUP } else { 0 },
        pidfd: &mut pidfd as *mut RawFd as u64,
        exit_signal: libc::SIGCHLD as u64,
        cgroup: cgroup.map_or(0, |fd| fd as u64),
        ..Default::default()
    };
    // SAFETY: `args` is a valid clone_args of the size we pass; with no stack
    // given, clone3 behaves like fork. The child branch below only calls
    // async-signal-safe functions on memory prepared before the call.
    let ret = unsafe { libc::syscall(libc::SYS_clone3, &args as *const CloneArgs, std::mem::size_of::<CloneArgs>()) };
    if ret < 0 {
        return Err(Errno::last());
    }
    if ret == 0 {
        // SAFETY: the child of a fork: `shim_child`'s contract holds (the
        // fds and C strings were prepared before clone3).
        unsafe { libc::_exit(shim_child(fds, Some(gate), &[], &argv, &envp)) };
    }
    // SAFETY: CLONE_PIDFD stored a new descriptor owned by nobody else.
    let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd) };
    Ok(Spawned { pid: ret as i32, pidfd })
}

/// The child's side of a shim spawn, on either path: detach, wait for its
/// user namespace maps if `gate` is given, put `fds` (the shim's
/// executable, its listener, its log and /dev/null) in place, join the
/// cgroups whose `tasks` files `join` names (NUL-terminated paths) and
/// `execveat` the shim. Returns only on failure, with the exit code to end
/// with.
///
/// # Safety
/// For a child of `clone`: makes only async-signal-safe system calls,
/// allocates nothing and takes no lock, on descriptors and C string arrays
/// (null-terminated) prepared before the clone.
unsafe fn shim_child(
    [exe, listener, log, devnull]: [RawFd; 4],
    gate: Option<RawFd>,
    join: &[*const libc::c_char],
    argv: &[*const libc::c_char],
    envp: &[*const libc::c_char],
) -> i32 {
    // SAFETY: the caller upholds the contract above for every call here.
    unsafe {
        // Until it has its spec, a shim dies with the daemon thread that made
        // it (a warm shim must not outlive a killed daemon; it is in no sandbox
        // cgroup a restart could find). The shim clears this once set up: a
        // live sandbox survives its daemon. (getppid() cannot close the race
        // with a parent that died before this line: in a new PID namespace it
        // returns 0.)
        libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong, 0, 0, 0);
        libc::setsid();
        if let Some(gate) = gate {
            let mut byte = 0u8;
            if libc::read(gate, &mut byte as *mut u8 as *mut libc::c_void, 1) != 1 {
                return 124;
            }
            // Raw syscalls: glibc's wrappers would try to signal the parent's
            // other threads, which this child does not have.
            if libc::syscall(libc::SYS_setgroups, 0, std::ptr::null::<libc::gid_t>()) < 0
                || libc::syscall(libc::SYS_setresgid, 0, 0, 0) < 0
                || libc::syscall(libc::SYS_setresuid, 0, 0, 0) < 0
            {
                return 124;
            }
            // Changing ids cleared the parent-death signal: set it again.
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong, 0, 0, 0);
        }
        if libc::dup2(devnull, 0) < 0
            || libc::dup2(log, 1) < 0
            || libc::dup2(log, 2) < 0
            || libc::dup2(listener, crate::proto::LISTEN_FD) < 0
        {
            return 125;
        }
        for &tasks in join {
            // "0": the calling thread, which is this whole process.
            let fd = libc::open(tasks, libc::O_WRONLY | libc::O_CLOEXEC);
            let joined = fd >= 0 && libc::write(fd, b"0".as_ptr() as *const libc::c_void, 1) == 1;
            if fd >= 0 {
                libc::close(fd);
            }
            if !joined {
                let msg = b"strata-shim: could not join its cgroup: write \"0\" to ";
                libc::write(2, msg.as_ptr() as *const libc::c_void, msg.len());
                libc::write(2, tasks as *const libc::c_void, libc::strlen(tasks));
                libc::write(2, b"\n".as_ptr() as *const libc::c_void, 1);
                return 123;
            }
        }
        // The descriptor is close-on-exec: the shim never holds it (fine for an
        // ELF file; only scripts need their fd open).
        libc::syscall(libc::SYS_execveat, exe, c"".as_ptr(), argv.as_ptr(), envp.as_ptr(), libc::AT_EMPTY_PATH);
        // Say why in the shim's log (fd 2) before giving up.
        let msg = b"strata-shim: execveat of the shim failed\n";
        libc::write(2, msg.as_ptr() as *const libc::c_void, msg.len());
        127
    }
}

/// How long a shim's child may take to exec before it is killed.
const SHIM_EXEC_DEADLINE: Duration = Duration::from_secs(5);

/// [`spawn_in_namespaces`] without a user namespace: the child shares the
/// daemon's memory until it execs ([`clone_shared`]). A `fork` of the
/// daemon would copy its page tables and write-protect every page of its
/// heap, so every thread of the daemon took a page fault on each page it
/// next wrote (hundreds per sandbox start). With a user namespace the child
/// waits for the parent to write its maps before it execs, so that spawn
/// forks.
/// `fds`: the shim's executable, its listener, its log and /dev/null;
/// `join`: the `tasks` files of the cgroups it is born in (v1), or
/// `cgroup` the directory (v2).
fn spawn_shared_in_namespaces(
    namespaces: u64,
    cgroup: Option<RawFd>,
    fds: [RawFd; 4],
    join: &[*const libc::c_char],
    argv: &[*const libc::c_char],
    envp: &[*const libc::c_char],
) -> Result<Spawned, Errno> {
    let flags = libc::c_int::try_from(namespaces).map_err(|_| Errno::EINVAL)?;
    // SAFETY: `shim_child`'s contract holds: the fds, `argv` and `envp`
    // were prepared before the clone and outlive the child's exec.
    let mut child = || -> i32 { unsafe { shim_child(fds, None, join, argv, envp) } };
    spawn_with_pidfd(&mut child, flags, cgroup, SHIM_EXEC_DEADLINE)
}

/// [`clone_shared`] a child on a stack of its own with `CLONE_PIDFD` and
/// `flags`: its pid and pidfd, or ETIMEDOUT (the child reaped) if it did
/// not exec or exit within `deadline`.
fn spawn_with_pidfd(
    child: &mut dyn FnMut() -> i32,
    flags: libc::c_int,
    cgroup: Option<RawFd>,
    deadline: Duration,
) -> Result<Spawned, Errno> {
    let mut stack = vec![0u8; 64 * 1024];
    let mut pidfd: RawFd = -1;
    let (pid, killed) = clone_shared(&mut stack, child, flags | libc::CLONE_PIDFD, Some(&mut pidfd), cgroup, deadline)?;
    // SAFETY: CLONE_PIDFD stored a new descriptor owned by nobody else.
    let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd) };
    if killed {
        let _ = nix::sys::wait::waitpid(nix::unistd::Pid::from_raw(pid), None);
        return Err(Errno::ETIMEDOUT);
    }
    Ok(Spawned { pid, pidfd })
}

/// A pidfd for an existing process (for shims adopted after a restart).
pub fn pidfd_open(pid: i32) -> Result<OwnedFd, Errno> {
    // SAFETY: plain syscall with integer arguments.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return Err(Errno::last());
    }
    // SAFETY: the kernel returned a new descriptor that we alone own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

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
const BPF_PROG_TYPE_CGROUP_DEVICE: u32 = 15;
const BPF_CGROUP_DEVICE: u32 = 6;
const BPF_PROG_LOAD: libc::c_int = 5;
const BPF_PROG_ATTACH: libc::c_int = 8;

/// The leading fields of `union bpf_attr` for BPF_PROG_LOAD (the kernel
/// treats the fields after `size` bytes as zero).
#[repr(C)]
#[derive(Default)]
struct ProgLoadAttr {
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
struct ProgAttachAttr {
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

/// Overlay options every sandbox uses (DESIGN.md: the upper must always hold
/// full file data and plain whiteouts, so a captured delta misses nothing).
pub const OVERLAY_FLAGS: [(&str, &str); 4] =
    [("index", "off"), ("metacopy", "off"), ("redirect_dir", "off"), ("xino", "off")];

/// `volatile` (Linux >= 5.10): the overlay skips every sync of its upper:
/// fsync and syncfs inside the sandbox, and, when the sandbox ends and the
/// overlay is unmounted, the syncfs of the upper's whole file system
/// (with a journal, a commit per sandbox). Nothing is lost that was kept:
/// a running sandbox's upper does not outlive a host crash (a restart
/// reaps a sandbox whose shim is gone), and what the daemon keeps of an
/// upper it makes durable itself before a row names it (a checkpoint's
/// layer and blob, a suspended upper). Its marker, `work/work/incompat/
/// volatile`, would refuse a second mount of the same upper and work dir;
/// none is made (a sandbox that starts again gets new ones). Kernels
/// without it (5.9) mount without it.
pub const OVERLAY_VOLATILE: &str = "volatile";

/// An overlay mount to make: lowers topmost first, relative to `layers_dir`.
pub struct OverlayMount<'a> {
    pub layers_dir: &'a Path,
    pub lowers: &'a [PathBuf],
    pub upper: &'a Path,
    pub work: &'a Path,
    pub target: &'a Path,
}

#[derive(Debug, thiserror::Error)]
pub enum MountError {
    #[error("fsopen {0}")]
    FsOpen(&'static str, #[source] Errno),
    #[error("fsconfig {key}={value}: {detail}")]
    FsConfig {
        key: String,
        value: String,
        detail: String,
        #[source]
        source: Errno,
    },
    #[error("create {fstype} superblock: {detail}")]
    Create {
        fstype: &'static str,
        detail: String,
        #[source]
        source: Errno,
    },
    #[error("fsmount {0}")]
    FsMount(&'static str, #[source] Errno),
    #[error("move overlay mount to {0}")]
    Move(PathBuf, #[source] Errno),
    #[error("overlay option string is {len} bytes for {lowers} lowers; this kernel lacks lowerdir+ (needs >= 6.8) and the legacy limit is one page")]
    OptionsTooLong { len: usize, lowers: usize },
    #[error("mount overlay at {0} (legacy options)")]
    Legacy(PathBuf, #[source] Errno),
    #[error("path {0:?} contains a NUL byte or a character overlay cannot take (',' or ':')")]
    BadPath(PathBuf),
}

fn cstr(p: &Path) -> Result<CString, MountError> {
    CString::new(p.as_os_str().as_encoded_bytes()).map_err(|_| MountError::BadPath(p.into()))
}

/// Read the kernel's error messages queued on an fs context fd (`fsopen(2)`).
fn fs_context_log(fd: &OwnedFd) -> String {
    let mut out = Vec::new();
    let mut buf = [0u8; 512];
    loop {
        match nix::unistd::read(fd.as_raw_fd(), &mut buf) {
            Ok(n) if n > 0 => {
                if !out.is_empty() {
                    out.extend_from_slice(b"; ");
                }
                out.extend_from_slice(&buf[..n]);
            }
            _ => break,
        }
    }
    String::from_utf8_lossy(&out).trim().to_string()
}

const FSOPEN_CLOEXEC: libc::c_uint = 1;
const FSCONFIG_SET_FLAG: libc::c_uint = 0;
const FSCONFIG_SET_STRING: libc::c_uint = 1;
const FSCONFIG_CMD_CREATE: libc::c_uint = 6;
const FSMOUNT_CLOEXEC: libc::c_uint = 1;
const MOUNT_ATTR_RDONLY: libc::c_uint = 0x1;
const MOUNT_ATTR_NOSUID: libc::c_uint = 0x2;
const MOUNT_ATTR_NODEV: libc::c_uint = 0x4;
const MOUNT_ATTR_NOEXEC: libc::c_uint = 0x8;

/// A file system context (`fsopen(2)`) being configured.
struct FsContext {
    fd: OwnedFd,
    fstype: &'static str,
}

impl FsContext {
    fn open(fstype: &'static CStr) -> Result<FsContext, MountError> {
        let name = fstype.to_str().unwrap_or("?");
        // SAFETY: fstype is a valid NUL-terminated string.
        let fd = unsafe { libc::syscall(libc::SYS_fsopen, fstype.as_ptr(), FSOPEN_CLOEXEC) };
        if fd < 0 {
            return Err(MountError::FsOpen(name, Errno::last()));
        }
        // SAFETY: fsopen returned a new descriptor that we alone own.
        Ok(FsContext { fd: unsafe { OwnedFd::from_raw_fd(fd as RawFd) }, fstype: name })
    }

    fn set(&self, key: &str, value: &CStr) -> Result<(), MountError> {
        self.config(FSCONFIG_SET_STRING, key, Some(value))
    }

    /// Set a flag parameter (one without a value, e.g. `volatile`).
    fn flag(&self, key: &str) -> Result<(), MountError> {
        self.config(FSCONFIG_SET_FLAG, key, None)
    }

    fn config(&self, cmd: libc::c_uint, key: &str, value: Option<&CStr>) -> Result<(), MountError> {
        let k = CString::new(key).map_err(|_| MountError::BadPath(key.into()))?;
        let v = value.map_or(std::ptr::null(), CStr::as_ptr);
        // SAFETY: the key is NUL-terminated, the value NUL-terminated or
        // null (a flag), and both outlive the call.
        let r = unsafe { libc::syscall(libc::SYS_fsconfig, self.fd.as_raw_fd(), cmd, k.as_ptr(), v, 0) };
        if r < 0 {
            let source = Errno::last();
            return Err(MountError::FsConfig {
                key: key.into(),
                value: value.map(|v| v.to_string_lossy().into_owned()).unwrap_or_default(),
                detail: fs_context_log(&self.fd),
                source,
            });
        }
        Ok(())
    }

    /// Create the superblock and a detached mount of it with `attrs`.
    fn mount(self, attrs: libc::c_uint) -> Result<OwnedFd, MountError> {
        // SAFETY: plain syscall on our fs context fd; null key/value as documented.
        let r = unsafe {
            libc::syscall(
                libc::SYS_fsconfig,
                self.fd.as_raw_fd(),
                FSCONFIG_CMD_CREATE,
                std::ptr::null::<libc::c_char>(),
                std::ptr::null::<libc::c_void>(),
                0,
            )
        };
        if r < 0 {
            let source = Errno::last();
            return Err(MountError::Create { fstype: self.fstype, detail: fs_context_log(&self.fd), source });
        }
        // SAFETY: plain syscall on our fs context fd.
        let mfd = unsafe { libc::syscall(libc::SYS_fsmount, self.fd.as_raw_fd(), FSMOUNT_CLOEXEC, attrs) };
        if mfd < 0 {
            return Err(MountError::FsMount(self.fstype, Errno::last()));
        }
        // SAFETY: fsmount returned a new descriptor that we alone own.
        Ok(unsafe { OwnedFd::from_raw_fd(mfd as RawFd) })
    }
}

/// Mount an overlay. Uses the new mount API with `lowerdir+` (one fsconfig
/// call per lower, no length limit; kernel >= 6.8) and falls back to the
/// legacy option string with lowers relative to `layers_dir` on older kernels.
pub fn mount_overlay(m: &OverlayMount<'_>) -> Result<(), MountError> {
    let ctx = FsContext::open(c"overlay")?;
    // Before 6.5 overlayfs had no fs_context parameters of its own: the
    // kernel's legacy wrapper accepts any key (even `lowerdir+`) and only
    // FSCONFIG_CMD_CREATE fails. A key no kernel knows tells the two apart:
    // if it is accepted, use the legacy option string. (Found by the 6.1 VM lane.)
    if ctx.set("strata-probe-unknown-key", c"x").is_ok() {
        return mount_overlay_legacy(m);
    }
    let mut lowers = m.lowers.iter();
    if let Some(first) = lowers.next() {
        match ctx.set("lowerdir+", &cstr(&m.layers_dir.join(first))?) {
            Ok(()) => {}
            Err(MountError::FsConfig { source: Errno::EINVAL, .. }) => {
                return mount_overlay_legacy(m);
            }
            Err(e) => return Err(e),
        }
    }
    for l in lowers {
        ctx.set("lowerdir+", &cstr(&m.layers_dir.join(l))?)?;
    }
    ctx.set("upperdir", &cstr(m.upper)?)?;
    ctx.set("workdir", &cstr(m.work)?)?;
    for (k, v) in OVERLAY_FLAGS {
        ctx.set(k, &CString::new(v).map_err(|_| MountError::BadPath(v.into()))?)?;
    }
    // Overlay's own parameters (this path) came in 6.5, after volatile.
    ctx.flag(OVERLAY_VOLATILE)?;
    // nodev: a device node in the image or the upper is never usable.
    let mfd = ctx.mount(MOUNT_ATTR_NODEV)?;
    attach_tree(mfd.as_fd(), m.target).map_err(|e| MountError::Move(m.target.into(), e))
}

/// A detached, read-only overlay of `lowers` (topmost first; overlayfs wants
/// two when there is no upper) as a mount fd that no mount table lists.
/// With no upper layer overlayfs itself refuses every write, chmod, chown
/// and xattr change (EROFS) whatever the mount's flags, and a file opened
/// through it is the overlay's file: nothing reached through it leads to
/// the files underneath. Used to run the shim (`ShimExe` in the daemon).
/// Works on the legacy fs_context of kernels before 6.5 too: `lowerdir` is
/// one colon-separated value either way.
pub fn readonly_overlay(lowers: &[&Path]) -> Result<OwnedFd, MountError> {
    let mut list = Vec::new();
    for l in lowers {
        let b = l.as_os_str().as_encoded_bytes();
        if b.contains(&b':') || b.contains(&b',') {
            return Err(MountError::BadPath(l.to_path_buf()));
        }
        if !list.is_empty() {
            list.push(b':');
        }
        list.extend_from_slice(b);
    }
    let ctx = FsContext::open(c"overlay")?;
    let list = CString::new(list).map_err(|e| {
        use std::os::unix::ffi::OsStringExt;
        MountError::BadPath(std::ffi::OsString::from_vec(e.into_vec()).into())
    })?;
    ctx.set("lowerdir", &list)?;
    ctx.mount(MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV)
}

/// What `mount(2)` takes as its data: one page.
const LEGACY_OPTIONS_MAX: usize = 4096;

/// The legacy `mount(2)` option string, with lowers relative to the layers
/// directory (the caller's cwd at mount time) to stay under one page.
pub fn legacy_overlay_options(m: &OverlayMount<'_>) -> Result<String, MountError> {
    let check = |p: &Path| -> Result<String, MountError> {
        let s = p.to_str().ok_or_else(|| MountError::BadPath(p.into()))?;
        if s.contains([',', ':', '\0']) {
            return Err(MountError::BadPath(p.into()));
        }
        Ok(s.to_string())
    };
    let lowers: Vec<String> = m.lowers.iter().map(|l| check(l)).collect::<Result<_, _>>()?;
    let mut opts = format!("lowerdir={},upperdir={},workdir={}", lowers.join(":"), check(m.upper)?, check(m.work)?);
    for (k, v) in OVERLAY_FLAGS {
        opts.push_str(&format!(",{k}={v}"));
    }
    if opts.len() >= LEGACY_OPTIONS_MAX {
        return Err(MountError::OptionsTooLong { len: opts.len(), lowers: lowers.len() });
    }
    Ok(opts)
}

fn mount_overlay_legacy(m: &OverlayMount<'_>) -> Result<(), MountError> {
    use nix::mount::{mount, MsFlags};
    let opts = legacy_overlay_options(m)?;
    let volatile = format!("{opts},{OVERLAY_VOLATILE}");
    let old = std::env::current_dir()
        .map_err(|e| MountError::Legacy(m.target.into(), Errno::from_raw(e.raw_os_error().unwrap_or(0))))?;
    nix::unistd::chdir(m.layers_dir).map_err(|e| MountError::Legacy(m.layers_dir.into(), e))?;
    let overlay = |o: &str| mount(Some("overlay"), m.target, Some("overlay"), MsFlags::MS_NODEV, Some(o));
    // A kernel before 5.10 refuses `volatile` (EINVAL): mount without it.
    // Past one page with it, the string without it is still tried.
    let r = if volatile.len() < LEGACY_OPTIONS_MAX {
        overlay(&volatile).or_else(|e| if e == Errno::EINVAL { overlay(&opts) } else { Err(e) })
    } else {
        overlay(&opts)
    };
    let _ = nix::unistd::chdir(&old);
    r.map_err(|e| MountError::Legacy(m.target.into(), e))
}

/// A sysfs of the calling thread's network namespace, mounted nowhere
/// (`fsmount(2)` without `move_mount`): its files are reached by `openat`
/// on the returned descriptor, and no mount namespace sees it. sysfs shows
/// the network devices of the namespace that made it, so this is how a
/// process whose /sys was mounted elsewhere (one started by `nsenter
/// --net`) reaches its own devices' attributes.
pub fn detached_sysfs() -> Result<OwnedFd, MountError> {
    FsContext::open(c"sysfs")?.mount(MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV | MOUNT_ATTR_NOEXEC)
}

/// `ETHTOOL_SGRO` of `<linux/ethtool.h>` (the legacy one-feature ioctl:
/// the rust-netlink `ethtool` crate reads features but cannot set them).
const ETHTOOL_SGRO: u32 = 0x2c;

/// `struct ethtool_value`.
#[repr(C)]
struct EthtoolValue {
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

/// `_LINUX_CAPABILITY_VERSION_3`.
const CAP_V3: u32 = 0x2008_0522;

#[repr(C)]
struct CapHeader {
    version: u32,
    pid: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct CapData {
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

/// Start `child` as a new process that shares the caller's memory until
/// it execs, as `posix_spawn` does (no page tables copied, no
/// copy-on-write faults in the caller afterwards: most of what a `fork`
/// of the shim cost on an exec's path), and wait until it has exec'd or
/// exited, at most `deadline`: past it, the child is killed. `vfork`
/// semantics would wait without end, and anything in the sandbox allowed
/// to signal the child can stop it before it execs (SIGSTOP cannot be
/// blocked, and it lands at the child's first return to user mode).
///
/// The wait is on a close-on-exec pipe only the child holds open: it
/// reads EOF once the child's execve has replaced its memory or its exit
/// has released it, so after this returns the child touches nothing of
/// ours. `child` must not allocate or free (it would do so in the
/// caller's heap), must fit in `stack`, and returns only an exit code.
/// Returns the child's pid (the caller reaps it as usual) and whether the
/// deadline killed it.
pub fn spawn_shared(
    stack: &mut [u8],
    child: &mut dyn FnMut() -> i32,
    deadline: Duration,
) -> Result<(i32, bool), Errno> {
    clone_shared(stack, child, 0, None, None, deadline)
}

/// How long a [`spawn_program`] child may take to exec before it is killed.
const PROGRAM_EXEC_DEADLINE: Duration = Duration::from_secs(5);

/// Start program `exe` with `args`, `stdio` as its descriptors 0-2 (every
/// other one of ours is close-on-exec, as Rust opens them), no signal
/// blocked, and, given `cgroup` (a cgroup v2 directory; only where
/// [`can_clone_into_cgroup`]), born in that cgroup: the way
/// [`spawn_shared`] starts a child, sharing our memory until it execs.
/// Signal dispositions are left as they are: one we ignore (SIGPIPE, in a
/// Rust program) stays ignored across the exec, where std's `Command`
/// would reset SIGPIPE. The caller reaps it.
pub fn spawn_program(
    exe: &CStr,
    args: &ExecArgs,
    stdio: [BorrowedFd<'_>; 3],
    cgroup: Option<BorrowedFd<'_>>,
) -> Result<Spawned, Errno> {
    // Above 2, so that the dup2 calls cannot clobber one another.
    let high = |fd: &BorrowedFd<'_>| -> Result<OwnedFd, Errno> {
        let raw = nix::fcntl::fcntl(fd.as_raw_fd(), nix::fcntl::FcntlArg::F_DUPFD_CLOEXEC(10))?;
        // SAFETY: F_DUPFD_CLOEXEC returned a new descriptor that we alone own.
        Ok(unsafe { OwnedFd::from_raw_fd(raw) })
    };
    let [a, b, c] = &stdio;
    let high = [high(a)?, high(b)?, high(c)?];
    let fds = high.each_ref().map(|f| f.as_raw_fd());
    let mut child = || -> i32 {
        for (target, fd) in fds.iter().enumerate() {
            // SAFETY: integers only; `fd` is open until we return.
            if unsafe { libc::dup2(*fd, target as RawFd) } < 0 {
                return 126;
            }
        }
        // The calling thread's blocked signals would stay blocked.
        let _ = nix::sys::signal::sigprocmask(
            nix::sys::signal::SigmaskHow::SIG_SETMASK,
            Some(&nix::sys::signal::SigSet::empty()),
            None,
        );
        args.execve(exe);
        127
    };
    spawn_with_pidfd(&mut child, 0, cgroup.map(|c| c.as_raw_fd()), PROGRAM_EXEC_DEADLINE)
}

/// [`spawn_shared`] with more `clone` flags (namespaces, `CLONE_PIDFD`,
/// whose descriptor is stored in `pidfd`), and born in the cgroup v2
/// directory `cgroup` if given (`clone3`, [`clone3_shared`]).
fn clone_shared(
    stack: &mut [u8],
    child: &mut dyn FnMut() -> i32,
    flags: libc::c_int,
    pidfd: Option<&mut RawFd>,
    cgroup: Option<RawFd>,
    deadline: Duration,
) -> Result<(i32, bool), Errno> {
    extern "C" fn trampoline(data: *mut libc::c_void) -> libc::c_int {
        // SAFETY: `data` is the `&mut dyn FnMut` below, alive until the
        // caller has seen this child exec or exit.
        let f = unsafe { &mut *(data as *mut &mut dyn FnMut() -> i32) };
        f()
    }
    let (gate, gate_w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?;
    let mut f: &mut dyn FnMut() -> i32 = child;
    // The top of the stack, 16-byte aligned (it grows down).
    let top = (stack.as_mut_ptr_range().end as usize & !15) as *mut libc::c_void;
    let pidfd_ptr = pidfd.map_or(std::ptr::null_mut(), |p| p as *mut RawFd);
    let data = &mut f as *mut _ as *mut libc::c_void;
    // Why both clones below are sound: `top` is the aligned end of
    // `stack`, which (like `f`) is borrowed until we return, after the child stopped using our memory
    // (see above); `pidfd_ptr` (CLONE_PIDFD's `parent_tid`) is null or a
    // live `RawFd`. The child takes no lock and allocates nothing, so other
    // threads of the caller (the daemon's) holding locks cannot block it;
    // this thread only makes system calls meanwhile. Signals are not
    // blocked around the clone (posix_spawn blocks them, to keep handlers
    // from running in the child): neither the daemon nor the shim has a
    // handler (the daemon waits for SIGTERM and SIGINT on a thread, with
    // them blocked), so a signal before the exec takes its default action.
    // The one handler, std's for SIGSEGV/SIGBUS, would run on the child's
    // stack (the kernel clears the alternate stack in a CLONE_VM child),
    // find the fault outside the guard page it knows (the parent thread's),
    // restore the default action and return: the fault repeats and the
    // child dies of it. `stack` has no guard page: the children
    // (`shim_child`, the exec path's) are short, non-recursive code that
    // uses a small part of it.
    let pid = match cgroup {
        // SAFETY: see above.
        None => unsafe { libc::clone(trampoline, top, libc::CLONE_VM | flags | libc::SIGCHLD, data, pidfd_ptr) },
        Some(dir) => {
            let args = CloneArgs {
                flags: (libc::CLONE_VM | flags) as u64 | CLONE_INTO_CGROUP,
                pidfd: pidfd_ptr as u64,
                exit_signal: libc::SIGCHLD as u64,
                stack: stack.as_mut_ptr() as u64,
                stack_size: (top as usize - stack.as_mut_ptr() as usize) as u64,
                cgroup: dir as u64,
                ..Default::default()
            };
            // SAFETY: as for `clone` (see above); `args` names the same
            // stack, and `trampoline` with `data` is what the child runs.
            unsafe { clone3_shared(&args, trampoline, data) }
        }
    };
    let pid = Errno::result(pid)?;
    drop(gate_w);
    let until = Instant::now() + deadline;
    let mut killed = false;
    loop {
        let left = until.saturating_duration_since(Instant::now());
        let ms = if killed { -1 } else { left.as_millis().min(i32::MAX as u128) as i32 };
        let mut fds = [libc::pollfd { fd: gate.as_raw_fd(), events: libc::POLLIN, revents: 0 }];
        // SAFETY: one valid pollfd for the call. A raw call, and errno not
        // read: the child, sharing our thread's TLS, may be writing it.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), 1, ms) };
        if n > 0 {
            return Ok((pid, killed));
        }
        if n == 0 && !killed {
            // SAFETY: `pid` is our unreaped child: the number is its own.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            killed = true;
        }
    }
}

/// `CLONE_INTO_CGROUP` (Linux 5.7; not in the libc crate for every target).
const CLONE_INTO_CGROUP: u64 = 0x2_0000_0000;

/// `clone3(args)` for a child that shares our memory: the child runs
/// `f(data)` on the stack `args` names and exits with what it returns,
/// as libc's `clone` does for `clone` (no libc has a `clone3` wrapper).
/// Returns the child's pid, or -1 with errno set.
///
/// # Safety
/// `args` has `CLONE_VM`, a stack no one else uses and no `CLONE_SETTLS`;
/// `f` must be safe to run with `data` in such a child (on that stack,
/// sharing our memory and thread-local storage).
#[cfg(target_arch = "x86_64")]
unsafe fn clone3_shared(
    args: &CloneArgs,
    f: extern "C" fn(*mut libc::c_void) -> libc::c_int,
    data: *mut libc::c_void,
) -> libc::c_int {
    let ret: libc::c_long;
    // SAFETY: the caller's contract. In the parent this is one system
    // call (rcx and r11 clobbered). In the child (rax 0) the kernel has
    // switched to the new 16-byte aligned stack; r12 and r13, kept across
    // the call, hold `f` and `data`; it calls `f` with a cleared frame
    // pointer and ends with `exit`, never returning into this frame.
    unsafe {
        std::arch::asm!(
            "syscall",
            "test rax, rax",
            "jnz 2f",
            "xor ebp, ebp",
            "mov rdi, r13",
            "call r12",
            "mov edi, eax",
            "mov eax, {exit}",
            "syscall",
            "ud2",
            "2:",
            exit = const libc::SYS_exit,
            inlateout("rax") libc::SYS_clone3 => ret,
            in("rdi") args as *const CloneArgs,
            in("rsi") std::mem::size_of::<CloneArgs>(),
            in("r12") f,
            in("r13") data,
            lateout("rcx") _,
            lateout("r11") _,
            options(nostack),
        );
    }
    if ret < 0 {
        Errno::set_raw(-ret as i32);
        return -1;
    }
    ret as libc::c_int
}

/// Elsewhere [`can_clone_into_cgroup`] is false and this is never called.
#[cfg(not(target_arch = "x86_64"))]
unsafe fn clone3_shared(
    _args: &CloneArgs,
    _f: extern "C" fn(*mut libc::c_void) -> libc::c_int,
    _data: *mut libc::c_void,
) -> libc::c_int {
    Errno::set_raw(libc::ENOSYS);
    -1
}

/// `setgroups([gid])`, `setgid`, `setuid` as raw system calls, for a
/// [`spawn_shared`] child: they change the calling thread only, where
/// glibc's wrappers would, in a process it believes multi-threaded, signal
/// every thread and take locks in the memory the child shares. Names the
/// call that failed.
pub fn set_ids(uid: u32, gid: u32) -> Result<(), (&'static [u8], Errno)> {
    let groups = [gid as libc::gid_t];
    // SAFETY: integer arguments, and a pointer to `groups`, alive for the call.
    if unsafe { libc::syscall(libc::SYS_setgroups, 1usize, groups.as_ptr()) } != 0 {
        return Err((b"setgroups", Errno::last()));
    }
    // SAFETY: integer arguments only.
    if unsafe { libc::syscall(libc::SYS_setgid, gid as libc::gid_t) } != 0 {
        return Err((b"setgid", Errno::last()));
    }
    // SAFETY: integer arguments only.
    if unsafe { libc::syscall(libc::SYS_setuid, uid as libc::uid_t) } != 0 {
        return Err((b"setuid", Errno::last()));
    }
    Ok(())
}

/// `argv` and `envp` for `execve`, built before a [`spawn_shared`] child
/// runs (`nix::unistd::execve` builds these arrays on each call, in the
/// heap the child must not touch).
pub struct ExecArgs {
    _strings: Vec<CString>,
    argv: Vec<*const libc::c_char>,
    envp: Vec<*const libc::c_char>,
}

impl ExecArgs {
    pub fn new(argv: Vec<CString>, env: Vec<CString>) -> ExecArgs {
        let ptrs = |v: &[CString]| v.iter().map(|s| s.as_ptr()).chain(std::iter::once(std::ptr::null())).collect();
        let (argv_p, envp) = (ptrs(&argv), ptrs(&env));
        // The pointers point into each CString's own heap buffer, which
        // does not move when the CStrings move into `_strings`.
        ExecArgs { _strings: argv.into_iter().chain(env).collect(), argv: argv_p, envp }
    }

    /// `execve(path)` with these arguments; returns only on failure.
    pub fn execve(&self, path: &CStr) -> Errno {
        // SAFETY: `argv` and `envp` are NULL-terminated arrays of pointers
        // to NUL-terminated strings owned by `self`, alive for the call.
        unsafe { libc::execve(path.as_ptr(), self.argv.as_ptr(), self.envp.as_ptr()) };
        Errno::last()
    }
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

/// `openat(dir, name, flags | O_CLOEXEC, mode)` returning an owned fd.
pub fn openat(dir: BorrowedFd<'_>, name: &CStr, flags: libc::c_int, mode: libc::mode_t) -> Result<OwnedFd, Errno> {
    // SAFETY: `name` is NUL-terminated and outlives the call; `dir` is open
    // for the borrow's lifetime.
    let fd = unsafe { libc::openat(dir.as_raw_fd(), name.as_ptr(), flags | libc::O_CLOEXEC, mode as libc::c_uint) };
    if fd < 0 {
        return Err(Errno::last());
    }
    // SAFETY: openat returned a new descriptor that we alone own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// `struct open_how` of openat2(2).
#[repr(C)]
struct OpenHow {
    flags: u64,
    mode: u64,
    resolve: u64,
}

/// `RESOLVE_NO_XDEV`, `RESOLVE_NO_MAGICLINKS`, `RESOLVE_NO_SYMLINKS`,
/// `RESOLVE_BENEATH`, `RESOLVE_IN_ROOT` (uapi/linux/openat2.h).
pub const RESOLVE_NO_XDEV: u64 = 0x01;
pub const RESOLVE_NO_MAGICLINKS: u64 = 0x02;
pub const RESOLVE_NO_SYMLINKS: u64 = 0x04;
pub const RESOLVE_BENEATH: u64 = 0x08;
pub const RESOLVE_IN_ROOT: u64 = 0x10;

/// `openat2(dir, path, {flags | O_CLOEXEC, mode, resolve})` (Linux 5.6):
/// with `RESOLVE_IN_ROOT`, `path` and every symlink met on the way resolve
/// as if `dir` were `/` (`..` stops there, absolute targets start there).
pub fn openat2(
    dir: BorrowedFd<'_>,
    path: &CStr,
    flags: libc::c_int,
    mode: libc::mode_t,
    resolve: u64,
) -> Result<OwnedFd, Errno> {
    let how = OpenHow { flags: (flags | libc::O_CLOEXEC) as u64, mode: u64::from(mode), resolve };
    // SAFETY: `path` is NUL-terminated and `how` a valid open_how of the
    // size passed; both outlive the call; `dir` is open for the borrow.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_openat2,
            dir.as_raw_fd(),
            path.as_ptr(),
            &how as *const OpenHow,
            std::mem::size_of::<OpenHow>(),
        )
    };
    if fd < 0 {
        return Err(Errno::last());
    }
    // SAFETY: the kernel returned a new descriptor that we alone own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// `fsetxattr(fd, name, value, 0)`: create or replace one attribute.
pub fn fsetxattr(fd: BorrowedFd<'_>, name: &CStr, value: &[u8]) -> Result<(), Errno> {
    // SAFETY: `name` is NUL-terminated, `value` a live slice of its length;
    // the kernel only reads them during the call.
    let rc = unsafe { libc::fsetxattr(fd.as_raw_fd(), name.as_ptr(), value.as_ptr().cast(), value.len(), 0) };
    Errno::result(rc).map(drop)
}

/// `lsetxattr(path, name, value, 0)`: never follows a final symlink.
pub fn lsetxattr(path: &CStr, name: &CStr, value: &[u8]) -> Result<(), Errno> {
    // SAFETY: both strings are NUL-terminated, `value` a live slice of its
    // length; the kernel only reads them during the call.
    let rc = unsafe { libc::lsetxattr(path.as_ptr(), name.as_ptr(), value.as_ptr().cast(), value.len(), 0) };
    Errno::result(rc).map(drop)
}

/// `lremovexattr(path, name)`: never follows a final symlink.
pub fn lremovexattr(path: &CStr, name: &CStr) -> Result<(), Errno> {
    // SAFETY: both strings are NUL-terminated; the kernel only reads them
    // during the call.
    let rc = unsafe { libc::lremovexattr(path.as_ptr(), name.as_ptr()) };
    Errno::result(rc).map(drop)
}

/// `lgetxattr(path, name)`: the attribute's value.
pub fn lgetxattr(path: &CStr, name: &CStr) -> Result<Vec<u8>, Errno> {
    let mut buf = vec![0u8; 64 * 1024];
    // SAFETY: strings are NUL-terminated; the kernel writes at most
    // `buf.len()` bytes into `buf`, which we own.
    let n = unsafe { libc::lgetxattr(path.as_ptr(), name.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    if n < 0 {
        return Err(Errno::last());
    }
    buf.truncate(n as usize);
    Ok(buf)
}

/// Whether nobody has the file open for writing (which includes a
/// writable shared mapping of it: the mapping holds such an open): a read
/// lease is taken and dropped at once, and the kernel grants it only then.
/// An open for writing that races with it waits for the drop (one that is
/// `O_NONBLOCK` fails with `EWOULDBLOCK`), and the kernel signals the
/// lease holder: with SIGURG, set here (`F_SETSIG`) because its default
/// action is to be ignored, where SIGIO's would end this process. (The
/// process must not handle SIGURG.)
pub fn no_writers(fd: BorrowedFd<'_>) -> Result<(), Errno> {
    /// `F_SETSIG` (uapi/asm-generic/fcntl.h; not in the libc crate).
    const F_SETSIG: libc::c_int = 10;
    // SAFETY: fcntl with integer arguments; `fd` is open for the borrow.
    let r = unsafe { libc::fcntl(fd.as_raw_fd(), F_SETSIG, libc::SIGURG) };
    Errno::result(r)?;
    // SAFETY: as above.
    let r = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETLEASE, libc::F_RDLCK as libc::c_int) };
    Errno::result(r)?;
    // SAFETY: as above.
    let r = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETLEASE, libc::F_UNLCK as libc::c_int) };
    Errno::result(r).map(drop)
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

/// `llistxattr(path)`: the attribute names, never following a final symlink.
pub fn llistxattr(path: &CStr) -> Result<Vec<Vec<u8>>, Errno> {
    let mut buf = vec![0u8; 64 * 1024];
    // SAFETY: `path` is NUL-terminated; the kernel writes at most
    // `buf.len()` bytes into `buf`, which we own.
    let n = unsafe { libc::llistxattr(path.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    if n < 0 {
        return Err(Errno::last());
    }
    buf.truncate(n as usize);
    Ok(buf.split(|&b| b == 0).filter(|n| !n.is_empty()).map(<[u8]>::to_vec).collect())
}

/// A detached copy of the mount at `path` (`open_tree(OPEN_TREE_CLONE)`):
/// taken before pivot_root, attached after it with [`attach_tree`], so the
/// host path is resolved in the host's view and the target in the sandbox's.
pub fn clone_tree(path: &Path) -> Result<OwnedFd, Errno> {
    const OPEN_TREE_CLONE: libc::c_uint = 1;
    let c = CString::new(path.as_os_str().as_encoded_bytes()).map_err(|_| Errno::EINVAL)?;
    // SAFETY: `c` is NUL-terminated and outlives the call.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_open_tree,
            libc::AT_FDCWD,
            c.as_ptr(),
            OPEN_TREE_CLONE | libc::O_CLOEXEC as libc::c_uint,
        )
    };
    if fd < 0 {
        return Err(Errno::last());
    }
    // SAFETY: open_tree returned a new descriptor that we alone own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// `struct mount_attr` from `<linux/mount.h>` (`mount_setattr(2)`).
#[repr(C)]
struct MountAttr {
    attr_set: u64,
    attr_clr: u64,
    propagation: u64,
    userns_fd: u64,
}

/// A detached copy of the mount at `path` whose ownership is seen through
/// the user namespace `userns` (an idmapped mount, Linux 5.12; overlayfs
/// takes them as layers from 5.19): a file owned by `n` on disk appears
/// owned by whatever `n` maps to in `userns`, and a file created through it
/// by that id is stored as `n`. Fails with EINVAL where the file system
/// does not support idmapped mounts.
pub fn idmapped_tree(path: &Path, userns: BorrowedFd<'_>) -> Result<OwnedFd, Errno> {
    const MOUNT_ATTR_IDMAP: u64 = 0x0010_0000;
    let tree = clone_tree(path)?;
    let attr =
        MountAttr { attr_set: MOUNT_ATTR_IDMAP, attr_clr: 0, propagation: 0, userns_fd: userns.as_raw_fd() as u64 };
    // SAFETY: `attr` is a valid mount_attr of the size passed; the empty path
    // with AT_EMPTY_PATH names the detached tree we own.
    let r = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            tree.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_EMPTY_PATH,
            &attr as *const MountAttr,
            std::mem::size_of::<MountAttr>(),
        )
    };
    Errno::result(r).map(|_| tree)
}

/// Attach a tree from [`clone_tree`] at `target`.
pub fn attach_tree(tree: BorrowedFd<'_>, target: &Path) -> Result<(), Errno> {
    const MOVE_MOUNT_F_EMPTY_PATH: libc::c_uint = 4;
    let t = CString::new(target.as_os_str().as_encoded_bytes()).map_err(|_| Errno::EINVAL)?;
    // SAFETY: strings are NUL-terminated; `tree` is a detached mount we own.
    let r = unsafe {
        libc::syscall(
            libc::SYS_move_mount,
            tree.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_FDCWD,
            t.as_ptr(),
            MOVE_MOUNT_F_EMPTY_PATH,
        )
    };
    Errno::result(r).map(drop)
}

/// `struct loop_info64` from `<linux/loop.h>`.
#[repr(C)]
struct LoopInfo64 {
    device: u64,
    inode: u64,
    rdevice: u64,
    offset: u64,
    sizelimit: u64,
    number: u32,
    encrypt_type: u32,
    encrypt_key_size: u32,
    flags: u32,
    file_name: [u8; 64],
    crypt_name: [u8; 64],
    encrypt_key: [u8; 32],
    init: [u64; 2],
}

/// `struct loop_config` from `<linux/loop.h>` (LOOP_CONFIGURE, Linux 5.8).
#[repr(C)]
struct LoopConfig {
    fd: u32,
    block_size: u32,
    info: LoopInfo64,
    reserved: [u64; 8],
}

const LOOP_CTL_GET_FREE: libc::c_ulong = 0x4C82;
const LOOP_CONFIGURE: libc::c_ulong = 0x4C0A;
const LO_FLAGS_AUTOCLEAR: u32 = 4;

/// Bind `backing` (an open regular file) to a free loop device with
/// `LO_FLAGS_AUTOCLEAR`: the device detaches itself when its last user
/// (the returned fd, then the filesystem mounted from it) lets go, so a
/// crash cannot leak it. Returns the device's path and an open fd on it.
pub fn attach_loop(backing: BorrowedFd<'_>) -> Result<(PathBuf, OwnedFd), Errno> {
    let ctl = nix::fcntl::open(
        "/dev/loop-control",
        nix::fcntl::OFlag::O_RDWR | nix::fcntl::OFlag::O_CLOEXEC,
        nix::sys::stat::Mode::empty(),
    )?;
    // SAFETY: open returned a new descriptor that we alone own.
    let ctl = unsafe { OwnedFd::from_raw_fd(ctl) };
    // Another process may take the device between GET_FREE and CONFIGURE
    // (EBUSY): ask again.
    for _ in 0..32 {
        // SAFETY: LOOP_CTL_GET_FREE takes no argument and returns a number.
        let n = unsafe { libc::ioctl(ctl.as_raw_fd(), LOOP_CTL_GET_FREE as _) };
        let n = Errno::result(n)?;
        let path = PathBuf::from(format!("/dev/loop{n}"));
        let dev = nix::fcntl::open(
            &path,
            nix::fcntl::OFlag::O_RDWR | nix::fcntl::OFlag::O_CLOEXEC,
            nix::sys::stat::Mode::empty(),
        )?;
        // SAFETY: open returned a new descriptor that we alone own.
        let dev = unsafe { OwnedFd::from_raw_fd(dev) };
        let cfg = LoopConfig {
            fd: backing.as_raw_fd() as u32,
            block_size: 0,
            info: LoopInfo64 {
                device: 0,
                inode: 0,
                rdevice: 0,
                offset: 0,
                sizelimit: 0,
                number: 0,
                encrypt_type: 0,
                encrypt_key_size: 0,
                flags: LO_FLAGS_AUTOCLEAR,
                file_name: [0; 64],
                crypt_name: [0; 64],
                encrypt_key: [0; 32],
                init: [0; 2],
            },
            reserved: [0; 8],
        };
        // SAFETY: `cfg` is a valid `struct loop_config` that outlives the call;
        // the kernel only reads it.
        let r = unsafe { libc::ioctl(dev.as_raw_fd(), LOOP_CONFIGURE as _, &cfg as *const LoopConfig) };
        match Errno::result(r) {
            Ok(_) => return Ok((path, dev)),
            Err(Errno::EBUSY) => continue,
            Err(e) => return Err(e),
        }
    }
    Err(Errno::EBUSY)
}

/// libnftables (Debian's `libnftables1`, the library the `nft` binary is a
/// front end of), loaded at run time: the same scripts `nft -f` reads, run
/// in the caller's process, without a process spawn each (2-3 ms here,
/// more than a sandbox's whole network set-up otherwise). `None` from
/// [`Nftables::load`] where the library is missing (callers run `nft`).
pub struct Nftables {
    ctx: std::ptr::NonNull<libc::c_void>,
    run: NftRun,
    error: NftBuffer,
    output: NftBuffer,
    free: NftFree,
}

type NftNew = unsafe extern "C" fn(u32) -> *mut libc::c_void;
type NftSetup = unsafe extern "C" fn(*mut libc::c_void) -> libc::c_int;
type NftRun = unsafe extern "C" fn(*mut libc::c_void, *const libc::c_char) -> libc::c_int;
type NftBuffer = unsafe extern "C" fn(*mut libc::c_void) -> *const libc::c_char;
type NftFree = unsafe extern "C" fn(*mut libc::c_void);

// SAFETY: an nft context is used by one thread at a time (`&mut self`);
// nothing in it is tied to the thread that made it.
unsafe impl Send for Nftables {}

impl Nftables {
    pub fn load() -> Option<Nftables> {
        // SAFETY: dlopen and dlsym take NUL-terminated names; each symbol
        // is cast to the signature libnftables' nftables.h (1.0) declares
        // for it; the handle is never closed, so the symbols stay valid.
        // nft_ctx_new(NFT_CTX_DEFAULT = 0) returns an owned context or
        // NULL; buffering its output and errors makes the run calls print
        // nothing and keep the error text for nft_ctx_get_error_buffer.
        unsafe {
            let lib = libc::dlopen(c"libnftables.so.1".as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL);
            if lib.is_null() {
                return None;
            }
            let sym = |name: &CStr| {
                let p = libc::dlsym(lib, name.as_ptr());
                (!p.is_null()).then_some(p)
            };
            let new = sym(c"nft_ctx_new")?;
            let buffer_output = sym(c"nft_ctx_buffer_output")?;
            let buffer_error = sym(c"nft_ctx_buffer_error")?;
            let run = sym(c"nft_run_cmd_from_buffer")?;
            let error = sym(c"nft_ctx_get_error_buffer")?;
            let output = sym(c"nft_ctx_get_output_buffer")?;
            let free = sym(c"nft_ctx_free")?;
            let new = std::mem::transmute::<*mut libc::c_void, NftNew>(new);
            let buffer = std::mem::transmute::<*mut libc::c_void, NftSetup>(buffer_output);
            let buffer_err = std::mem::transmute::<*mut libc::c_void, NftSetup>(buffer_error);
            let ctx = std::ptr::NonNull::new(new(0))?;
            let nft = Nftables {
                ctx,
                run: std::mem::transmute::<*mut libc::c_void, NftRun>(run),
                error: std::mem::transmute::<*mut libc::c_void, NftBuffer>(error),
                output: std::mem::transmute::<*mut libc::c_void, NftBuffer>(output),
                free: std::mem::transmute::<*mut libc::c_void, NftFree>(free),
            };
            if buffer(ctx.as_ptr()) != 0 || buffer_err(ctx.as_ptr()) != 0 {
                return None;
            }
            Some(nft)
        }
    }

    /// Run `script` (one transaction, as `nft -f`); its error text else.
    pub fn run(&mut self, script: &CStr) -> Result<(), String> {
        // SAFETY: the context is live (freed only by drop) and used by this
        // thread alone; the script is NUL-terminated; the buffers returned
        // are the context's, valid until its next call, and copied at once.
        // Reading a buffer rewinds it, so each run's text is its own.
        unsafe {
            let rc = (self.run)(self.ctx.as_ptr(), script.as_ptr());
            let _ = (self.output)(self.ctx.as_ptr());
            let err = (self.error)(self.ctx.as_ptr());
            let text = if err.is_null() { String::new() } else { CStr::from_ptr(err).to_string_lossy().into_owned() };
            if rc == 0 {
                Ok(())
            } else {
                Err(text)
            }
        }
    }
}

impl Drop for Nftables {
    fn drop(&mut self) {
        // SAFETY: the context came from nft_ctx_new and is freed once.
        unsafe { (self.free)(self.ctx.as_ptr()) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Opens for writing that race with the lease (the kernel then signals
    /// the holder) do not end this process, which blocks no signal.
    #[test]
    fn a_racing_open_for_writing_is_harmless() {
        use std::os::fd::AsFd;
        use std::os::unix::fs::OpenOptionsExt;
        use std::sync::atomic::{AtomicBool, Ordering};
        // Removed even if an assertion below fails.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        std::fs::write(&path, b"x").unwrap();
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let writer = {
            let (path, stop) = (path.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut opened = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let f = std::fs::OpenOptions::new().write(true).custom_flags(libc::O_NONBLOCK).open(&path);
                    opened += u64::from(f.is_ok());
                }
                opened
            })
        };
        let until = std::time::Instant::now() + std::time::Duration::from_secs(2);
        let mut free = 0u64;
        while std::time::Instant::now() < until {
            let f = std::fs::File::open(&path).unwrap();
            free += u64::from(no_writers(f.as_fd()).is_ok());
        }
        stop.store(true, Ordering::Relaxed);
        let opened = writer.join().unwrap();
        assert!(free > 0 && opened > 0, "{free} leases, {opened} opens");
    }

    /// A child started with a cgroup v2 directory is in that cgroup from
    /// its first instruction (here, still there as it sleeps), and one
    /// started without is in ours.
    #[test]
    fn a_shared_memory_child_is_born_in_the_cgroup_given() {
        if !nix::unistd::geteuid().is_root() {
            return eprintln!("skipped: needs root");
        }
        // A cgroup2 mount: the whole tree (v2) or the hybrid one's.
        let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
        let Some(mnt) = mountinfo.lines().find_map(|l| {
            let (left, right) = l.split_once(" - ")?;
            right.starts_with("cgroup2 ").then(|| left.split(' ').nth(4).map(PathBuf::from)).flatten()
        }) else {
            return eprintln!("skipped: no cgroup2 mount");
        };
        assert!(can_clone_into_cgroup(), "clone3 with CLONE_INTO_CGROUP (x86_64, Linux 5.7)");
        let name = format!("strata-unit-{}", std::process::id());
        // Removed however the test ends.
        struct Dir(PathBuf);
        impl Drop for Dir {
            fn drop(&mut self) {
                let _ = std::fs::remove_dir(&self.0);
            }
        }
        let dir = Dir(mnt.join(&name));
        std::fs::create_dir(&dir.0).unwrap();
        let cgroup_of = |pid: i32| -> String {
            let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
            text.lines().find_map(|l| l.strip_prefix("0::")).unwrap_or_default().to_string()
        };
        let args = ExecArgs::new(vec![c"sleep".into(), c"5".into()], vec![]);
        let start = |cgroup: Option<RawFd>| -> i32 {
            let mut stack = vec![0u8; 64 * 1024];
            let mut child = || -> i32 {
                args.execve(c"/bin/sleep");
                127
            };
            let (pid, killed) = clone_shared(&mut stack, &mut child, 0, None, cgroup, Duration::from_secs(5)).unwrap();
            assert!(!killed);
            pid
        };
        let d = std::fs::File::open(&dir.0).unwrap();
        let (inside, outside) = (start(Some(d.as_raw_fd())), start(None));
        let seen = (cgroup_of(inside), cgroup_of(outside));
        for pid in [inside, outside] {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::SIGKILL);
            let _ = nix::sys::wait::waitpid(nix::unistd::Pid::from_raw(pid), None);
        }
        // The cgroup's path as this cgroup namespace shows it: `/NAME`
        // below the mount's root, which may itself be a subtree.
        assert!(seen.0.ends_with(&format!("/{name}")), "{seen:?}");
        assert_eq!(seen.1, cgroup_of(std::process::id() as i32));
    }

    #[test]
    fn loop_structs_match_the_kernel_abi() {
        assert_eq!(std::mem::size_of::<LoopInfo64>(), 232);
        assert_eq!(std::mem::size_of::<LoopConfig>(), 304);
        assert_eq!(std::mem::size_of::<MountAttr>(), 32);
    }

    #[test]
    fn legacy_options_are_relative_and_complete() {
        let lowers = vec![PathBuf::from("b/fs"), PathBuf::from("a/fs")];
        let m = OverlayMount {
            layers_dir: Path::new("/var/lib/strata/layers"),
            lowers: &lowers,
            upper: Path::new("/u"),
            work: Path::new("/w"),
            target: Path::new("/t"),
        };
        assert_eq!(
            legacy_overlay_options(&m).unwrap(),
            "lowerdir=b/fs:a/fs,upperdir=/u,workdir=/w,index=off,metacopy=off,redirect_dir=off,xino=off"
        );
    }

    #[test]
    fn legacy_options_refuse_past_one_page() {
        let lowers: Vec<PathBuf> = (0..80).map(|i| PathBuf::from(format!("{:064x}/fs", i))).collect();
        let m = OverlayMount {
            layers_dir: Path::new("/l"),
            lowers: &lowers,
            upper: Path::new("/u"),
            work: Path::new("/w"),
            target: Path::new("/t"),
        };
        assert!(matches!(legacy_overlay_options(&m), Err(MountError::OptionsTooLong { lowers: 80, .. })));
    }

    #[test]
    fn legacy_options_refuse_separators() {
        let lowers = vec![PathBuf::from("a:b")];
        let m = OverlayMount {
            layers_dir: Path::new("/l"),
            lowers: &lowers,
            upper: Path::new("/u"),
            work: Path::new("/w"),
            target: Path::new("/t"),
        };
        assert!(matches!(legacy_overlay_options(&m), Err(MountError::BadPath(_))));
    }
}
