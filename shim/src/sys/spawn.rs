//! Processes into new namespaces and cgroups: `clone3` (with a pidfd, into
//! a cgroup), the shim's own start, and `spawn_shared`, each command's
//! `CLONE_VM` spawn with a deadline on its `execve`.

use std::ffi::{CStr, CString};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::time::{Duration, Instant};

use nix::errno::Errno;

/// Namespaces every sandbox gets.
pub const SANDBOX_NAMESPACES: u64 =
    (libc::CLONE_NEWNS | libc::CLONE_NEWPID | libc::CLONE_NEWUTS | libc::CLONE_NEWIPC | libc::CLONE_NEWNET) as u64;

/// `struct clone_args` from `<linux/sched.h>` (version 2, 88 bytes).
#[repr(C)]
#[derive(Default)]
pub(super) struct CloneArgs {
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
    /// A network namespace the child joins (`setns`) before it execs; the
    /// caller leaves `CLONE_NEWNET` out of the namespaces then.
    pub netns: Option<BorrowedFd<'a>>,
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
    let netns = plan.netns.map(high).transpose()?;
    let netns_fd = netns.as_ref().map_or(-1, |f| f.as_raw_fd());

    let mut argv: Vec<*const libc::c_char> = plan.argv.iter().map(|a| a.as_ptr()).collect();
    argv.push(std::ptr::null());
    let mut envp: Vec<*const libc::c_char> = plan.envp.iter().map(|a| a.as_ptr()).collect();
    envp.push(std::ptr::null());

    let fds = [&exe, &listener, &log, &devnull].map(|f| f.as_raw_fd());
    let cgroup = plan.cgroup_dir.map(|d| d.as_raw_fd());
    let Some(gate) = plan.userns_gate.as_ref().map(|g| g.as_raw_fd()) else {
        let join: Vec<*const libc::c_char> = plan.cgroup_tasks.iter().map(|t| t.as_ptr()).collect();
        return spawn_shared_in_namespaces(namespaces, cgroup, fds, netns_fd, &join, &argv, &envp);
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
        unsafe { libc::_exit(shim_child(fds, netns_fd, Some(gate), &[], &argv, &envp)) };
    }
    // SAFETY: CLONE_PIDFD stored a new descriptor owned by nobody else.
    let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd) };
    Ok(Spawned { pid: ret as i32, pidfd })
}

/// The child's side of a shim spawn, on either path: detach, wait for its
/// user namespace maps if `gate` is given, join the network namespace
/// `netns` (if not -1), put `fds` (the shim's
/// executable, its listener, its log and /dev/null) in place, join the
/// cgroups whose `tasks` files `join` names (NUL-terminated paths) and
/// `execveat` the shim. Returns only on failure, with the exit code to end
/// with.
///
/// # Safety
/// For a child of `clone`: makes only async-signal-safe system calls,
/// allocates nothing and takes no lock, on descriptors and C string arrays
/// (null-terminated) prepared before the clone.
pub(super) unsafe fn shim_child(
    [exe, listener, log, devnull]: [RawFd; 4],
    netns: RawFd,
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
        if netns >= 0 && libc::setns(netns, libc::CLONE_NEWNET) < 0 {
            let msg = b"strata-shim: could not join the network namespace it was handed\n";
            libc::write(2, msg.as_ptr() as *const libc::c_void, msg.len());
            return 122;
        }
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
pub(super) const SHIM_EXEC_DEADLINE: Duration = Duration::from_secs(5);

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
pub(super) fn spawn_shared_in_namespaces(
    namespaces: u64,
    cgroup: Option<RawFd>,
    fds: [RawFd; 4],
    netns: RawFd,
    join: &[*const libc::c_char],
    argv: &[*const libc::c_char],
    envp: &[*const libc::c_char],
) -> Result<Spawned, Errno> {
    let flags = libc::c_int::try_from(namespaces).map_err(|_| Errno::EINVAL)?;
    // SAFETY: `shim_child`'s contract holds: the fds, `argv` and `envp`
    // were prepared before the clone and outlive the child's exec.
    let mut child = || -> i32 { unsafe { shim_child(fds, netns, None, join, argv, envp) } };
    spawn_with_pidfd(&mut child, flags, cgroup, SHIM_EXEC_DEADLINE)
}

/// [`clone_shared`] a child on a stack of its own with `CLONE_PIDFD` and
/// `flags`: its pid and pidfd, or ETIMEDOUT (the child reaped) if it did
/// not exec or exit within `deadline`.
pub(super) fn spawn_with_pidfd(
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
pub(super) const PROGRAM_EXEC_DEADLINE: Duration = Duration::from_secs(5);

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
pub(super) fn clone_shared(
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
pub(super) const CLONE_INTO_CGROUP: u64 = 0x2_0000_0000;

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
pub(super) unsafe fn clone3_shared(
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
pub(super) unsafe fn clone3_shared(
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
