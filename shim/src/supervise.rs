//! The shim's supervision loop: accept daemon connections, start commands,
//! reap every zombie (we are PID 1), report exit statuses.
//!
//! Single-threaded `poll` over: a signalfd for SIGCHLD, the listening socket,
//! and each daemon connection. A daemon restart just means a new connection;
//! commands keep running, and exits whose connection is gone are reported to
//! the newest one. For a command started with `keep` the shim also holds
//! copies of the daemon's ends of its stdio, so it never writes into a
//! pipe nobody holds while no daemon runs, and hands them to the next
//! daemon that asks (`Reattach`); they close when it is reaped.

use std::collections::HashMap;
use std::ffi::{CStr, CString};
use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};

use nix::errno::Errno;
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::signal::{kill, SigSet, SigmaskHow, Signal};
use nix::sys::signalfd::{SfdFlags, SignalFd};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;
use strata_shim::proto::{self, ExecSpec, ExitStatus, ProtoError, ShimEvent, ShimRequest};
use strata_shim::sys;

#[derive(Debug, thiserror::Error)]
pub enum SuperviseError {
    #[error("block SIGCHLD / create signalfd")]
    Signals(#[source] Errno),
    #[error("poll")]
    Poll(#[source] Errno),
}

/// Size of [`Supervisor::stack`]: the child makes a few system calls and
/// execs. Pages it never touches are never backed.
const CHILD_STACK: usize = 256 * 1024;

/// A command's child not exec'd this long after its clone is killed; the
/// shim waits for it until then ([`sys::spawn_shared`]).
const EXEC_DEADLINE: std::time::Duration = std::time::Duration::from_secs(5);

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
    /// [`ExecSpec::status_fd`]: where its exit goes instead of `conn`.
    status: Option<OwnedFd>,
    /// [`ExecSpec::keep`]: copies of the daemon's ends, for a daemon that
    /// reattaches (dropped, so closed, when the command is reaped).
    kept: Option<Kept>,
}

/// What the shim keeps of a command started with [`ExecSpec::keep`].
struct Kept {
    pid: i32,
    tty: bool,
    /// stdout's and stderr's read ends, or the pty master.
    outputs: Vec<OwnedFd>,
    /// stdin's write end, while the daemon keeps it open.
    stdin: Option<OwnedFd>,
}

struct Supervisor {
    /// The stack each command's child runs on until it execs.
    stack: Vec<u8>,
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

    let mut sup = Supervisor {
        stack: vec![0; CHILD_STACK],
        conns: vec![Conn { token: 0, fd: first }],
        next_token: 1,
        running: HashMap::new(),
    };
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
                self.send(token, &ShimEvent::Hello { running, features: proto::features() }, &[]);
            }
            ShimRequest::Reattach { id } => self.reattach(token, id),
            ShimRequest::CloseStdin { id } => {
                if let Some(k) = self.running.values_mut().find(|r| r.id == id).and_then(|r| r.kept.as_mut()) {
                    k.stdin = None;
                }
            }
            ShimRequest::Setup(_) => {
                self.send(token, &ShimEvent::StartFailed { id: 0, message: "already set up".into() }, &[]);
            }
        }
    }

    fn exec(&mut self, token: u64, spec: ExecSpec, mut fds: Vec<OwnedFd>) {
        let id = spec.id;
        // The daemon's ends of a kept command: stdout's, stderr's, stdin's.
        let mut ends = if spec.keep && !spec.tty && fds.len() > 3 { fds.split_off(3) } else { Vec::new() };
        let status = if spec.status_fd && !spec.keep && !spec.tty && fds.len() == 4 { fds.pop() } else { None };
        if spec.keep && !spec.tty && !(2..=3).contains(&ends.len()) {
            let message = format!("a kept exec takes 5 or 6 fds, got {}", fds.len() + ends.len());
            return self.send(token, &ShimEvent::StartFailed { id, message }, &[]);
        }
        match start(&spec, fds, &mut self.stack) {
            Ok((pid, master)) => {
                let quiet = status.is_some();
                let kept = match (spec.keep, &master) {
                    (false, _) => None,
                    (true, Some(m)) => match m.try_clone() {
                        Ok(m) => Some(Kept { pid, tty: true, outputs: vec![m], stdin: None }),
                        Err(e) => {
                            eprintln!("strata-shim: keep the pty master of exec {id}: {e}");
                            None
                        }
                    },
                    (true, None) => {
                        let stdin = (ends.len() == 3).then(|| ends.remove(2));
                        Some(Kept { pid, tty: false, outputs: ends, stdin })
                    }
                };
                self.running.insert(pid, Running { id, conn: token, status, kept });
                if !quiet {
                    let raw: Vec<RawFd> = master.iter().map(|m| m.as_raw_fd()).collect();
                    self.send(token, &ShimEvent::Started { id, pid }, &raw);
                }
            }
            Err(message) => match status {
                Some(fd) => write_status(fd, ShimEvent::StartFailed { id, message }),
                None => self.send(token, &ShimEvent::StartFailed { id, message }, &[]),
            },
        }
    }

    /// Hand a reattaching daemon its ends of a kept command; its events go
    /// to this connection from now on.
    fn reattach(&mut self, token: u64, id: u64) {
        let found = self.running.values_mut().find(|r| r.id == id && r.kept.is_some());
        let Some(r) = found else {
            return self.send(token, &ShimEvent::NotRunning { id }, &[]);
        };
        r.conn = token;
        let k = r.kept.as_ref().expect("kept");
        let raw: Vec<RawFd> = k.outputs.iter().chain(&k.stdin).map(|f| f.as_raw_fd()).collect();
        let ev = ShimEvent::Reattached { id, pid: k.pid, tty: k.tty, stdin: k.stdin.is_some() };
        self.send(token, &ev, &raw);
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
                let ev = ShimEvent::Exited { id: r.id, status };
                match r.status {
                    Some(fd) => write_status(fd, ev),
                    None => self.send(r.conn, &ev, &[]),
                }
            }
        }
    }
}

/// Write the event that ends a command to its status fd, and close it. One
/// write below PIPE_BUF to the empty pipe never blocks PID 1 and is
/// atomic (a longer error message is cut); a reader that is gone (EPIPE:
/// SIGPIPE is ignored here) was not waiting for it.
fn write_status(fd: OwnedFd, mut ev: ShimEvent) {
    if let ShimEvent::StartFailed { message, .. } = &mut ev {
        if message.len() > 1024 {
            let mut cut = 1024;
            while !message.is_char_boundary(cut) {
                cut -= 1;
            }
            message.truncate(cut);
        }
    }
    if let Ok(buf) = serde_json::to_vec(&ev) {
        let _ = nix::unistd::write(&fd, &buf);
    }
}

/// Start one command (see [`sys::spawn_shared`]). Returns its pid and,
/// with a tty, the pty master. Everything the child needs is prepared
/// here, before the clone: argv and env, the cwd, and every path its
/// `execve` may try (the exec's own PATH searched, as execvpe would).
fn start(spec: &ExecSpec, fds: Vec<OwnedFd>, stack: &mut [u8]) -> Result<(i32, Option<OwnedFd>), String> {
    if spec.argv.is_empty() {
        return Err("empty argv".into());
    }
    let cstring = |s: &str| CString::new(s).map_err(|_| format!("{s:?} contains a NUL byte"));
    let cstrings = |v: &[String]| -> Result<Vec<CString>, String> { v.iter().map(|s| cstring(s)).collect() };
    let args = sys::ExecArgs::new(cstrings(&spec.argv)?, cstrings(&spec.env)?);
    let cwd = cstring(&spec.cwd)?;
    let name = spec.argv[0].as_str();
    let candidates: Vec<CString> = if name.contains('/') {
        vec![cstring(name)?]
    } else {
        let path = spec
            .env
            .iter()
            .find_map(|e| e.strip_prefix("PATH="))
            .unwrap_or("/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin");
        path.split(':').filter(|d| !d.is_empty()).filter_map(|d| CString::new(format!("{d}/{name}")).ok()).collect()
    };
    let (master, slave) = if spec.tty {
        if !fds.is_empty() {
            return Err("a tty exec takes no fds".into());
        }
        let (m, p) = sys::open_pty().map_err(|e| format!("allocate pty: {e}"))?;
        // Before the clone, so the command's first TIOCGWINSZ sees it.
        if spec.rows > 0 && spec.cols > 0 {
            sys::set_window_size(m.as_fd(), spec.rows, spec.cols).map_err(|e| format!("set window size: {e}"))?;
        }
        (Some(m), Some(cstring(&p)?))
    } else {
        if fds.len() != 3 {
            return Err(format!("expected 3 stdio fds, got {}", fds.len()));
        }
        (None, None)
    };
    let stdio: Vec<RawFd> = fds.iter().map(|f| f.as_raw_fd()).collect();
    let plan = Plan {
        args: &args,
        cwd: &cwd,
        name: name.as_bytes(),
        candidates: &candidates,
        search: !name.contains('/'),
        uid: spec.uid,
        gid: spec.gid,
    };
    let spawned = sys::spawn_shared(stack, &mut || child(&plan, &stdio, slave.as_deref()), EXEC_DEADLINE)
        .map_err(|e| format!("clone: {e}"));
    // The child shared this memory and may have changed its dumpability
    // (see `child`); whatever happened, PID 1 stays closed to ptrace.
    if let Err(e) = nix::sys::prctl::set_dumpable(false) {
        eprintln!("strata-shim: PR_SET_DUMPABLE: {e}");
    }
    let (pid, killed) = spawned?;
    if killed {
        // Say why on the command's stderr (its exit alone says SIGKILL).
        let msg = format!(
            "strata: {name} was stopped before it could start and killed after {} s\n",
            EXEC_DEADLINE.as_secs()
        );
        if let Some(stderr) = fds.get(2) {
            let _ = nix::unistd::write(stderr, msg.as_bytes());
        }
    }
    Ok((pid, master))
}

/// What [`child`] runs, prepared by [`start`].
struct Plan<'a> {
    args: &'a sys::ExecArgs,
    cwd: &'a CStr,
    /// argv[0], for messages.
    name: &'a [u8],
    /// The paths to execve, in order.
    candidates: &'a [CString],
    /// `candidates` come from a PATH search (argv[0] has no slash).
    search: bool,
    uid: u32,
    gid: u32,
}

/// Write `strata: PARTS...: ERROR` to stderr without allocating (the
/// child shares the shim's heap) and return `code`.
fn fail(parts: &[&[u8]], e: Errno, code: i32) -> i32 {
    let stderr = std::io::stderr();
    for p in [b"strata: ".as_slice()].iter().chain(parts).chain(&[b": ".as_slice(), e.desc().as_bytes(), b"\n"]) {
        let _ = nix::unistd::write(&stderr, p);
    }
    code
}

/// The child: becomes its own session and process-group leader, wires
/// stdio, drops to the requested user and execs. Returns only on failure,
/// with the exit code the shell would use (126 cannot run, 127 not
/// found). It shares the shim's memory: system calls only, no allocation.
fn child(plan: &Plan<'_>, stdio: &[RawFd], slave: Option<&CStr>) -> i32 {
    if let Err(e) = nix::unistd::setsid() {
        return fail(&[b"setsid"], e, 126);
    }
    if let Some(path) = slave {
        let fd = match nix::fcntl::open(path, nix::fcntl::OFlag::O_RDWR, nix::sys::stat::Mode::empty()) {
            Ok(fd) => fd,
            Err(e) => return fail(&[b"open pty slave"], e, 126),
        };
        if let Err(e) = sys::set_controlling_tty(fd) {
            return fail(&[b"set controlling tty"], e, 126);
        }
        for target in 0..3 {
            if let Err(e) = nix::unistd::dup2(fd, target) {
                return fail(&[b"dup2 tty"], e, 126);
            }
        }
    } else {
        for (target, fd) in stdio.iter().enumerate() {
            if let Err(e) = nix::unistd::dup2(*fd, target as RawFd) {
                return fail(&[b"dup2 stdio"], e, 126);
            }
        }
    }
    sys::cloexec_from(3);
    // Undo what PID 1 changed for itself: the blocked SIGCHLD and the ignored
    // SIGPIPE would otherwise be inherited across exec.
    let _ = nix::sys::signal::sigprocmask(SigmaskHow::SIG_SETMASK, Some(&SigSet::empty()), None);
    let _ = sys::set_sigpipe(true);

    if let Err(e) = nix::unistd::chdir(plan.cwd) {
        return fail(&[b"chdir ", plan.cwd.to_bytes()], e, 126);
    }
    if let Err((call, e)) = sys::set_ids(plan.uid, plan.gid) {
        return fail(&[call], e, 126);
    }
    // A change of uid or gid resets dumpability, which belongs to the
    // memory: the shim's until the execve. Non-dumpable again (the shim
    // says so too once the clone returns).
    let _ = nix::sys::prctl::set_dumpable(false);
    let mut last = Errno::ENOENT;
    for path in plan.candidates {
        match plan.args.execve(path) {
            Errno::ENOENT | Errno::ENOTDIR if plan.search => {}
            Errno::EACCES if plan.search => last = Errno::EACCES,
            e => return fail(&[b"exec ", plan.name], e, if e == Errno::ENOENT { 127 } else { 126 }),
        }
    }
    if last == Errno::EACCES {
        return fail(&[b"exec ", plan.name], last, 126);
    }
    let _ = nix::unistd::write(std::io::stderr(), b"strata: exec ");
    let _ = nix::unistd::write(std::io::stderr(), plan.name);
    let _ = nix::unistd::write(std::io::stderr(), b": executable file not found in $PATH\n");
    127
}
