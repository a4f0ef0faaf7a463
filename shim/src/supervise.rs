//! The shim's supervision loop: accept daemon connections, start commands,
//! reap every zombie (we are PID 1), report exit statuses.
//!
//! Single-threaded `poll` over: a signalfd for SIGCHLD, the listening socket,
//! and each daemon connection. A daemon restart just means a new connection;
//! commands keep running, and exits whose connection is gone are reported to
//! the newest one.

use std::collections::HashMap;
use std::ffi::CString;
use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};

use nix::errno::Errno;
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::signal::{kill, SigSet, SigmaskHow, Signal};
use nix::sys::signalfd::{SfdFlags, SignalFd};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::{ForkResult, Pid};
use strata_shim::proto::{self, ExecSpec, ExitStatus, ProtoError, ShimEvent, ShimRequest};
use strata_shim::sys;

#[derive(Debug, thiserror::Error)]
pub enum SuperviseError {
    #[error("block SIGCHLD / create signalfd")]
    Signals(#[source] Errno),
    #[error("poll")]
    Poll(#[source] Errno),
}

pub fn accept(listener: &OwnedFd) -> Result<OwnedFd, Errno> {
    loop {
        match sys::accept(listener.as_fd()) {
            Err(Errno::EINTR) => continue,
            r => return r,
        }
    }
}

struct Conn {
    token: u64,
    fd: OwnedFd,
}

struct Running {
    id: u64,
    conn: u64,
}

struct Supervisor {
    conns: Vec<Conn>,
    next_token: u64,
    running: HashMap<i32, Running>,
}

pub fn run(listener: OwnedFd, first: OwnedFd) -> Result<(), SuperviseError> {
    let mut mask = SigSet::empty();
    mask.add(Signal::SIGCHLD);
    mask.thread_block().map_err(SuperviseError::Signals)?;
    let sfd =
        SignalFd::with_flags(&mask, SfdFlags::SFD_CLOEXEC | SfdFlags::SFD_NONBLOCK).map_err(SuperviseError::Signals)?;
    // A daemon that vanished mid-write must not kill PID 1.
    sys::set_sigpipe(false).map_err(SuperviseError::Signals)?;

    let mut sup = Supervisor { conns: vec![Conn { token: 0, fd: first }], next_token: 1, running: HashMap::new() };
    loop {
        let mut fds =
            vec![PollFd::new(sfd.as_fd(), PollFlags::POLLIN), PollFd::new(listener.as_fd(), PollFlags::POLLIN)];
        for c in &sup.conns {
            fds.push(PollFd::new(c.fd.as_fd(), PollFlags::POLLIN));
        }
        match poll(&mut fds, PollTimeout::NONE) {
            Ok(_) => {}
            Err(Errno::EINTR) => continue,
            Err(e) => return Err(SuperviseError::Poll(e)),
        }
        let ready: Vec<bool> = fds.iter().map(|f| f.revents().is_some_and(|r| !r.is_empty())).collect();
        drop(fds);
        if ready[0] {
            while let Ok(Some(_)) = sfd.read_signal() {}
            sup.reap();
        }
        if ready[1] {
            if let Ok(fd) = accept(&listener) {
                let token = sup.next_token;
                sup.next_token += 1;
                sup.conns.push(Conn { token, fd });
            }
        }
        let tokens: Vec<u64> = sup.conns.iter().zip(&ready[2..]).filter(|(_, r)| **r).map(|(c, _)| c.token).collect();
        for token in tokens {
            sup.serve(token);
        }
    }
}

impl Supervisor {
    fn conn(&self, token: u64) -> Option<&Conn> {
        self.conns.iter().find(|c| c.token == token)
    }

    fn drop_conn(&mut self, token: u64) {
        self.conns.retain(|c| c.token != token);
    }

    /// Send an event on `token`, or on the newest connection if that one is gone.
    fn send(&mut self, token: u64, ev: &ShimEvent, fds: &[RawFd]) {
        let target = self.conn(token).or(self.conns.last()).map(|c| c.token);
        if let Some(t) = target {
            let ok = self.conn(t).map(|c| proto::send(&c.fd, ev, fds).is_ok()).unwrap_or(false);
            if !ok {
                self.drop_conn(t);
            }
        }
    }

    fn serve(&mut self, token: u64) {
        let Some(c) = self.conn(token) else { return };
        let (req, fds) = match proto::recv::<ShimRequest>(&c.fd) {
            Ok(m) => m,
            Err(ProtoError::Closed) | Err(ProtoError::Recv(_)) => {
                self.drop_conn(token);
                return;
            }
            Err(e) => {
                eprintln!("strata-shim: bad request: {e}");
                self.drop_conn(token);
                return;
            }
        };
        match req {
            ShimRequest::Exec(spec) => self.exec(token, spec, fds),
            ShimRequest::Signal { id, signal, group } => {
                if let Some((&pid, _)) = self.running.iter().find(|(_, r)| r.id == id) {
                    let target = if group { Pid::from_raw(-pid) } else { Pid::from_raw(pid) };
                    if let Ok(sig) = Signal::try_from(signal) {
                        let _ = kill(target, sig);
                    }
                }
            }
            ShimRequest::Hello => {
                let running = self.running.values().map(|r| r.id).collect();
                self.send(token, &ShimEvent::Hello { running }, &[]);
            }
            ShimRequest::Setup(_) => {
                self.send(token, &ShimEvent::StartFailed { id: 0, message: "already set up".into() }, &[]);
            }
        }
    }

    fn exec(&mut self, token: u64, spec: ExecSpec, fds: Vec<OwnedFd>) {
        let id = spec.id;
        match start(&spec, fds) {
            Ok((pid, master)) => {
                self.running.insert(pid, Running { id, conn: token });
                let raw: Vec<RawFd> = master.iter().map(|m| m.as_raw_fd()).collect();
                self.send(token, &ShimEvent::Started { id, pid }, &raw);
            }
            Err(message) => self.send(token, &ShimEvent::StartFailed { id, message }, &[]),
        }
    }

    /// Reap every exited child: our commands and any orphan reparented to us.
    fn reap(&mut self) {
        loop {
            let (pid, status) = match waitpid(Pid::from_raw(-1), Some(WaitPidFlag::WNOHANG)) {
                Ok(WaitStatus::Exited(pid, code)) => (pid, ExitStatus::Code(code)),
                Ok(WaitStatus::Signaled(pid, sig, _)) => (pid, ExitStatus::Signal(sig as i32)),
                Ok(WaitStatus::StillAlive) | Err(_) => return,
                Ok(_) => continue,
            };
            if let Some(r) = self.running.remove(&pid.as_raw()) {
                self.send(r.conn, &ShimEvent::Exited { id: r.id, status }, &[]);
            }
        }
    }
}

/// Fork and exec one command. Returns its pid and, with a tty, the pty master.
fn start(spec: &ExecSpec, fds: Vec<OwnedFd>) -> Result<(i32, Option<OwnedFd>), String> {
    if spec.argv.is_empty() {
        return Err("empty argv".into());
    }
    let cstrings = |v: &[String]| -> Result<Vec<CString>, String> {
        v.iter().map(|s| CString::new(s.as_str()).map_err(|_| format!("{s:?} contains a NUL byte"))).collect()
    };
    let argv = cstrings(&spec.argv)?;
    let env = cstrings(&spec.env)?;
    let (master, slave_path) = if spec.tty {
        if !fds.is_empty() {
            return Err("a tty exec takes no fds".into());
        }
        let (m, p) = sys::open_pty().map_err(|e| format!("allocate pty: {e}"))?;
        // Before the fork, so the command's first TIOCGWINSZ sees it.
        if spec.rows > 0 && spec.cols > 0 {
            sys::set_window_size(m.as_fd(), spec.rows, spec.cols).map_err(|e| format!("set window size: {e}"))?;
        }
        (Some(m), Some(p))
    } else {
        if fds.len() != 3 {
            return Err(format!("expected 3 stdio fds, got {}", fds.len()));
        }
        (None, None)
    };
    match sys::fork_single_threaded().map_err(|e| format!("fork: {e}"))? {
        ForkResult::Parent { child } => Ok((child.as_raw(), master)),
        ForkResult::Child => {
            drop(master);
            let code = child(spec, &argv, &env, &fds, slave_path.as_deref());
            sys::exit_now(code)
        }
    }
}

/// The forked child: becomes its own session and process-group leader, wires
/// stdio, drops to the requested user and execs. Returns only on failure,
/// with the exit code the shell would use (126 cannot run, 127 not found).
fn child(spec: &ExecSpec, argv: &[CString], env: &[CString], fds: &[OwnedFd], slave: Option<&str>) -> i32 {
    let fail = |what: &str, e: Errno, code: i32| -> i32 {
        let msg = format!("strata: {what}: {}\n", e.desc());
        let _ = nix::unistd::write(std::io::stderr(), msg.as_bytes());
        code
    };
    if let Err(e) = nix::unistd::setsid() {
        return fail("setsid", e, 126);
    }
    if let Some(path) = slave {
        let fd = match nix::fcntl::open(path, nix::fcntl::OFlag::O_RDWR, nix::sys::stat::Mode::empty()) {
            Ok(fd) => fd,
            Err(e) => return fail("open pty slave", e, 126),
        };
        if let Err(e) = sys::set_controlling_tty(fd) {
            return fail("set controlling tty", e, 126);
        }
        for target in 0..3 {
            if let Err(e) = nix::unistd::dup2(fd, target) {
                return fail("dup2 tty", e, 126);
            }
        }
    } else {
        for (target, fd) in fds.iter().enumerate() {
            if let Err(e) = nix::unistd::dup2(fd.as_raw_fd(), target as RawFd) {
                return fail("dup2 stdio", e, 126);
            }
        }
    }
    sys::close_from(3);
    // Undo what PID 1 changed for itself: the blocked SIGCHLD and the ignored
    // SIGPIPE would otherwise be inherited across exec.
    let _ = nix::sys::signal::sigprocmask(SigmaskHow::SIG_SETMASK, Some(&SigSet::empty()), None);
    let _ = sys::set_sigpipe(true);

    if let Err(e) = nix::unistd::chdir(spec.cwd.as_str()) {
        return fail(&format!("chdir {}", spec.cwd), e, 126);
    }
    let gid = nix::unistd::Gid::from_raw(spec.gid);
    let uid = nix::unistd::Uid::from_raw(spec.uid);
    if let Err(e) = nix::unistd::setgroups(&[gid]) {
        return fail("setgroups", e, 126);
    }
    if let Err(e) = nix::unistd::setgid(gid) {
        return fail("setgid", e, 126);
    }
    if let Err(e) = nix::unistd::setuid(uid) {
        return fail("setuid", e, 126);
    }
    exec_path(argv, env, fail)
}

/// execve `argv[0]`, searching the exec's own PATH (not the shim's) when it
/// has no slash, as execvpe would.
fn exec_path(argv: &[CString], env: &[CString], fail: impl Fn(&str, Errno, i32) -> i32) -> i32 {
    let prog = argv[0].to_bytes();
    let name = String::from_utf8_lossy(prog).into_owned();
    if prog.contains(&b'/') {
        let e = nix::unistd::execve(&argv[0], argv, env).unwrap_err();
        return fail(&format!("exec {name}"), e, if e == Errno::ENOENT { 127 } else { 126 });
    }
    let path = env
        .iter()
        .find_map(|e| e.to_bytes().strip_prefix(b"PATH="))
        .map(|p| String::from_utf8_lossy(p).into_owned())
        .unwrap_or_else(|| "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into());
    let mut last = Errno::ENOENT;
    for dir in path.split(':').filter(|d| !d.is_empty()) {
        let Ok(full) = CString::new(format!("{dir}/{name}")) else { continue };
        let e = nix::unistd::execve(&full, argv, env).unwrap_err();
        match e {
            Errno::ENOENT | Errno::ENOTDIR => {}
            Errno::EACCES => last = e,
            other => return fail(&format!("exec {name}"), other, 126),
        }
    }
    if last == Errno::EACCES {
        return fail(&format!("exec {name}"), last, 126);
    }
    let msg = format!("strata: exec {name}: executable file not found in $PATH\n");
    let _ = nix::unistd::write(std::io::stderr(), msg.as_bytes());
    127
}
