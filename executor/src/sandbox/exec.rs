//! Running a command in a sandbox, buffered (API returns exit code and
//! output) or attached (output streamed as frames, stdin and window size
//! forwarded, see `stream.rs`).
//!
//! The daemon makes the pipes and hands the child's ends to the shim with
//! the request; with a tty the shim allocates the pty inside the sandbox's
//! own devpts and hands the master back. Every command leads its own process
//! group, so a timeout or a vanished client kills everything it started.

use std::io::{Read, Write};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, RecvTimeoutError, TryRecvError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use strata_shim::proto::{self, ExecSpec, ExitStatus, ShimEvent};

use super::{merge_env, parse_user, Sandbox, SandboxError, SandboxId};
use crate::sandbox::shim_client::Delivery;
use crate::stream::{self, FrameKind};

/// Largest stdout (and stderr) kept by a buffered exec; the rest is dropped
/// and `truncated` is set.
pub const MAX_BUFFERED_OUTPUT: usize = 16 << 20;

/// How long [`Sandbox::reattach`] waits for the shim's answer.
const REATTACH_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, Clone, Default, PartialEq)]
pub struct ExecRequest {
    pub argv: Vec<String>,
    pub env: Vec<String>,
    pub cwd: Option<String>,
    pub user: Option<String>,
    pub timeout: Option<Duration>,
    pub tty: bool,
    /// With `tty`: initial (rows, cols).
    pub size: (u16, u16),
    /// How many bytes of its output (stdout and stderr together) the exec
    /// log keeps; the daemon sets it (`--keep-output`).
    pub keep_output: usize,
}

/// What the exec log keeps of a finished command.
#[derive(Debug, Clone, PartialEq)]
pub struct ExecSummary {
    pub status: ExitStatus,
    pub started_at: std::time::SystemTime,
    pub duration: Duration,
    /// stdout + stderr bytes (all of them, also past a buffered exec's cap).
    pub output_bytes: u64,
    /// The output as the log keeps it (up to the request's `keep_output`).
    pub kept: crate::model::KeptOutput,
}

#[derive(Debug, Clone, PartialEq)]
pub struct ExecOutput {
    pub status: ExitStatus,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    pub duration: Duration,
    pub timed_out: bool,
    pub truncated: bool,
    pub summary: ExecSummary,
}

fn pipe() -> Result<(OwnedFd, OwnedFd), SandboxError> {
    nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)
        .map_err(|e| SandboxError::Io { step: "create pipe", source: e.into() })
}

/// Three fresh pipes: the command's ends (stdin's read end, stdout's and
/// stderr's write ends) and ours.
fn stdio_pipes() -> Result<([OwnedFd; 3], [OwnedFd; 3]), SandboxError> {
    let (in_r, in_w) = pipe()?;
    let (out_r, out_w) = pipe()?;
    let (err_r, err_w) = pipe()?;
    Ok(([in_r, out_w, err_w], [in_w, out_r, err_r]))
}

/// Our ends of a started command's stdio, and its event channel.
struct Piped {
    rx: Receiver<Delivery>,
    stdin: OwnedFd,
    stdout: OwnedFd,
    stderr: OwnedFd,
}

/// A command left running by [`Sandbox::spawn`].
pub struct Spawned {
    /// The shim's id of it (for signals).
    pub id: u64,
    /// Its pid in the sandbox's PID namespace.
    pub pid: i32,
    /// Its stdin (none with a tty: input goes to the master).
    pub stdin: Option<OwnedFd>,
    /// With a tty: the pty master (input, window size).
    pub master: Option<OwnedFd>,
    pub output: SpawnedOutput,
    /// The shim keeps it for a later daemon ([`Sandbox::reattach`]).
    pub kept: bool,
}

/// A spawned command on a pty: the master for input and size, a copy of
/// it for the output.
fn spawned_tty(
    id: u64,
    pid: i32,
    master: OwnedFd,
    rx: Receiver<Delivery>,
    kept: bool,
) -> Result<Spawned, SandboxError> {
    let out = master.try_clone().map_err(|source| SandboxError::Io { step: "dup pty master", source })?;
    let output = SpawnedOutput { id, rx, outputs: vec![(out, FrameKind::Stdout)] };
    Ok(Spawned { id, pid, stdin: None, master: Some(master), output, kept })
}

/// What [`Sandbox::follow`] reads: a spawned command's output and events.
pub struct SpawnedOutput {
    id: u64,
    rx: Receiver<Delivery>,
    outputs: Vec<(OwnedFd, FrameKind)>,
}

impl SpawnedOutput {
    /// A command whose output is not the daemon's to read: its events only.
    pub(super) fn events_only(id: u64, rx: Receiver<Delivery>) -> SpawnedOutput {
        SpawnedOutput { id, rx, outputs: Vec::new() }
    }
}

/// A buffered exec started by [`Sandbox::exec_start`], to be waited for.
pub struct BufferedExec {
    pump: Pump,
    out: Collected,
    start: Instant,
    started_at: std::time::SystemTime,
}

/// What [`Sandbox::exec_wait_until`] came back with.
pub enum Waited {
    Done(ExecOutput),
    /// Still running at the time given.
    Running(BufferedExec),
}

/// A buffered exec's output as it is read: each stream up to
/// [`MAX_BUFFERED_OUTPUT`], and what the exec log keeps.
struct Collected {
    keep_output: usize,
    stdout: Vec<u8>,
    stderr: Vec<u8>,
    truncated: bool,
    output_bytes: u64,
    kept: crate::model::KeptOutput,
}

impl Collected {
    fn new(keep_output: usize) -> Collected {
        Collected {
            keep_output,
            stdout: Vec::new(),
            stderr: Vec::new(),
            truncated: false,
            output_bytes: 0,
            kept: Default::default(),
        }
    }

    fn add(&mut self, kind: FrameKind, data: &[u8]) {
        self.output_bytes += data.len() as u64;
        self.kept.keep(self.keep_output, kind == FrameKind::Stdout, data);
        let buf = if kind == FrameKind::Stdout { &mut self.stdout } else { &mut self.stderr };
        let room = MAX_BUFFERED_OUTPUT.saturating_sub(buf.len());
        self.truncated |= data.len() > room;
        buf.extend_from_slice(&data[..data.len().min(room)]);
    }

    fn finish(self, fin: Finished, start: Instant, started_at: std::time::SystemTime) -> ExecOutput {
        let duration = start.elapsed();
        let Collected { stdout, stderr, truncated, output_bytes, kept, .. } = self;
        ExecOutput {
            status: fin.status,
            stdout,
            stderr,
            duration,
            timed_out: fin.timed_out,
            truncated,
            summary: ExecSummary { status: fin.status, started_at, duration, output_bytes, kept },
        }
    }
}

/// How the pump loop ended.
struct Finished {
    status: ExitStatus,
    timed_out: bool,
}

/// Where the pump learns that a command ended.
enum Events {
    /// Events the connection's reader thread routes to this exec.
    Channel(Receiver<Delivery>),
    /// The read end of the exec's status pipe ([`ExecSpec::status_fd`]).
    Status(std::fs::File),
}

impl Sandbox {
    pub(super) fn exec_spec(&self, req: &ExecRequest) -> Result<ExecSpec, SandboxError> {
        self.exec_spec_in(req, self.run_state())
    }

    /// [`Sandbox::exec_spec`] with the sandbox's run `state` read.
    fn exec_spec_in(&self, req: &ExecRequest, state: super::RunState) -> Result<ExecSpec, SandboxError> {
        match state {
            super::RunState::Running => {}
            super::RunState::Stopping => return Err(SandboxError::Stopping(self.id.clone())),
            state => return Err(SandboxError::State { id: self.id.clone(), state, action: "exec" }),
        }
        if !self.shim.is_alive() {
            return Err(SandboxError::Dead(self.id.clone()));
        }
        if req.argv.is_empty() || req.argv[0].is_empty() {
            return Err(SandboxError::BadExec("argv must name a command".into()));
        }
        for e in &req.env {
            if !e.contains('=') || e.starts_with('=') {
                return Err(SandboxError::BadExec(format!("env entry {e:?} is not KEY=VALUE")));
            }
        }
        if req.argv.iter().chain(&req.env).any(|s| s.contains('\0')) {
            return Err(SandboxError::BadExec("argv and env must not contain NUL bytes".into()));
        }
        let cwd = req.cwd.clone().unwrap_or_else(|| self.defaults.cwd.clone());
        if !cwd.starts_with('/') {
            return Err(SandboxError::BadExec(format!("cwd {cwd:?} must be absolute")));
        }
        if cwd.contains('\0') {
            return Err(SandboxError::BadExec("cwd must not contain NUL bytes".into()));
        }
        let (uid, gid) = match req.user.as_deref() {
            None | Some("") => (self.defaults.uid, self.defaults.gid),
            Some(u) => parse_user(u, |_| None).map_err(SandboxError::BadExec)?,
        };
        let spec = ExecSpec {
            id: self.next_exec.fetch_add(1, Ordering::Relaxed),
            argv: req.argv.clone(),
            env: merge_env(&self.defaults.env, &req.env),
            cwd,
            uid,
            gid,
            tty: req.tty,
            rows: req.size.0,
            cols: req.size.1,
            status_fd: false,
            keep: false,
        };
        // Refused here, with the limit, rather than by sendmsg (EMSGSIZE, a 500).
        let n = serde_json::to_vec(&spec).map_or(usize::MAX, |b| b.len());
        if n > proto::MAX_EXEC_SPEC {
            return Err(SandboxError::BadExec(format!(
                "argv, env and cwd take {n} bytes as sent to the shim (the sandbox's env included); at most {}",
                proto::MAX_EXEC_SPEC
            )));
        }
        Ok(spec)
    }

    /// Ask the shim to start `spec` with three fresh pipes as its stdio; we
    /// keep the other ends.
    fn start_piped(&self, spec: ExecSpec) -> Result<Piped, SandboxError> {
        let (theirs, [stdin, stdout, stderr]) = stdio_pipes()?;
        let rx = self.shim.exec(spec, &theirs.each_ref().map(|f| f.as_raw_fd())).map_err(SandboxError::Exec)?;
        Ok(Piped { rx, stdin, stdout, stderr })
    }

    /// [`Sandbox::start_piped`] for a buffered exec: its end comes on a
    /// status pipe when the shim takes one. Returns the events and our
    /// ends of stdin, stdout and stderr; with `wait` false, `None` where
    /// sending would wait (the shim's queue is full, or it is a shim
    /// without the status pipe).
    fn start_buffered(&self, spec: ExecSpec, wait: bool) -> Result<Option<(Events, [OwnedFd; 3])>, SandboxError> {
        if !self.shim.takes_status_fd() {
            if !wait {
                return Ok(None);
            }
            let Piped { rx, stdin, stdout, stderr } = self.start_piped(spec)?;
            return Ok(Some((Events::Channel(rx), [stdin, stdout, stderr])));
        }
        let (theirs, ours) = stdio_pipes()?;
        let (status, status_w) = pipe()?;
        let sent = self
            .shim
            .exec_with_status(spec, theirs.each_ref().map(|f| f.as_raw_fd()), status_w.as_raw_fd(), wait)
            .map_err(SandboxError::Exec)?;
        Ok(sent.then(|| (Events::Status(std::fs::File::from(status)), ours)))
    }

    /// Wait for the shim to confirm the start; returns the command's pid in
    /// the sandbox and the pty master if any.
    pub(super) fn wait_started(&self, rx: &Receiver<Delivery>) -> Result<(i32, Option<OwnedFd>), SandboxError> {
        loop {
            match rx.recv() {
                Ok(Delivery { event: ShimEvent::Started { pid, .. }, mut fds }) => return Ok((pid, fds.pop())),
                Ok(Delivery { event: ShimEvent::StartFailed { message, .. }, .. }) => {
                    return Err(SandboxError::BadExec(message))
                }
                Ok(_) => continue,
                Err(_) => return Err(SandboxError::Dead(self.id.clone())),
            }
        }
    }

    /// Run a command to completion and return its output.
    pub fn exec_buffered(&self, req: &ExecRequest, stdin: Vec<u8>) -> Result<ExecOutput, SandboxError> {
        match self.exec_start(req, stdin, true)? {
            Ok(started) => self.exec_wait(started),
            Err(_) => Err(SandboxError::Dead(self.id.clone())), // not with `wait`
        }
    }

    /// Start a buffered exec if that needs no wait: the sandbox's state is
    /// not being changed (a pause holds it while the cgroup freezes) and
    /// the shim's queue has room. Otherwise its input is given back
    /// (`Ok(Err(stdin))`) and nothing was started. The rest of the start
    /// (checks, four pipes, the thread that feeds a non-empty input) takes
    /// microseconds. Then [`Sandbox::exec_wait_until`], or
    /// [`Sandbox::exec_wait`].
    pub fn try_exec_start(
        &self,
        req: &ExecRequest,
        stdin: Vec<u8>,
    ) -> Result<Result<BufferedExec, Vec<u8>>, SandboxError> {
        self.exec_start(req, stdin, false)
    }

    /// Start a buffered exec: checked, its pipes made, the request sent to
    /// the shim, its input (if any) fed by a thread. With `wait` false, as
    /// [`Sandbox::try_exec_start`].
    fn exec_start(
        &self,
        req: &ExecRequest,
        stdin: Vec<u8>,
        wait: bool,
    ) -> Result<Result<BufferedExec, Vec<u8>>, SandboxError> {
        if req.tty {
            return Err(SandboxError::BadExec("a tty needs an attached exec".into()));
        }
        let state = if wait { Some(self.run_state()) } else { self.try_run_state() };
        let Some(state) = state else { return Ok(Err(stdin)) };
        let spec = self.exec_spec_in(req, state)?;
        let id = spec.id;
        let start = Instant::now();
        let started_at = std::time::SystemTime::now();
        let Some((events, [in_w, out_r, err_r])) = self.start_buffered(spec, wait)? else { return Ok(Err(stdin)) };
        // No wait for `Started`: the pump sees output, exit or StartFailed.
        if !stdin.is_empty() {
            let mut w = std::fs::File::from(in_w);
            std::thread::spawn(move || {
                let _ = w.write_all(&stdin);
            });
        } else {
            drop(in_w);
        }
        let outputs = vec![(out_r, FrameKind::Stdout), (err_r, FrameKind::Stderr)];
        Ok(Ok(BufferedExec {
            pump: Pump::new(id, events, outputs, req.timeout),
            out: Collected::new(req.keep_output),
            start,
            started_at,
        }))
    }

    /// Wait for a buffered exec to end, this thread blocked meanwhile.
    pub fn exec_wait(&self, x: BufferedExec) -> Result<ExecOutput, SandboxError> {
        match self.exec_wait_until(x, None)? {
            Waited::Done(out) => Ok(out),
            Waited::Running(_) => Err(SandboxError::Dead(self.id.clone())),
        }
    }

    /// Wait for a buffered exec to end, but not past `until`: then it is
    /// given back, still running, to be waited for again.
    pub fn exec_wait_until(&self, mut x: BufferedExec, until: Option<Instant>) -> Result<Waited, SandboxError> {
        let out = &mut x.out;
        let id = x.pump.id;
        let fin = x.pump.run(&self.id, &|| drop(self.signal_exec(id, libc::SIGKILL)), until, &mut |kind, data| {
            out.add(kind, data);
            true
        })?;
        Ok(match fin {
            Some(fin) => Waited::Done(x.out.finish(fin, x.start, x.started_at)),
            None => Waited::Running(x),
        })
    }

    /// Run a command attached to an upgraded client connection: frames out,
    /// stdin and resizes in, an exit frame last. If the client goes away, the
    /// command's process group is killed. `ended` sees the command's
    /// summary before the exit frame is sent (a client told "exited" finds
    /// what `ended` recorded).
    pub fn exec_attached(
        self: &Arc<Self>,
        req: &ExecRequest,
        mut conn: UnixStream,
        upgrade: impl FnOnce(&mut UnixStream) -> std::io::Result<()>,
        ended: &mut dyn FnMut(&ExecSummary),
    ) -> Result<(), SandboxError> {
        let spec = self.exec_spec(req)?;
        let id = spec.id;
        if req.tty {
            let rx = self.shim.exec(spec, &[]).map_err(SandboxError::Exec)?;
            let master = self.wait_started(&rx)?.1.ok_or_else(|| SandboxError::BadExec("shim sent no pty".into()))?;
            let dup = |m: &OwnedFd| m.try_clone().map_err(|source| SandboxError::Io { step: "dup pty master", source });
            let (input, resize) = (dup(&master)?, dup(&master)?);
            upgrade(&mut conn).map_err(|source| SandboxError::Io { step: "upgrade connection", source })?;
            let outputs = vec![(master, FrameKind::Stdout)];
            return self.attached_loop(id, rx, outputs, input, Some(resize), req, conn, ended);
        }
        let Piped { rx, stdin: in_w, stdout: out_r, stderr: err_r } = self.start_piped(spec)?;
        self.wait_started(&rx)?;
        upgrade(&mut conn).map_err(|source| SandboxError::Io { step: "upgrade connection", source })?;
        let outputs = vec![(out_r, FrameKind::Stdout), (err_r, FrameKind::Stderr)];
        self.attached_loop(id, rx, outputs, in_w, None, req, conn, ended)
    }

    /// Start a command and leave it running: its pid, its input (stdin if
    /// `stdin`, else it reads EOF; the pty master with `tty`) and its
    /// output to [`Sandbox::follow`]. Nothing here kills it when a client
    /// goes away; its owner does. With a shim that keeps commands
    /// ([`Spawned::kept`]), it outlives a daemon restart and
    /// [`Sandbox::reattach`] gives it back.
    pub fn spawn(&self, req: &ExecRequest, stdin: bool) -> Result<Spawned, SandboxError> {
        let mut spec = self.exec_spec(req)?;
        let id = spec.id;
        spec.keep = self.shim.keeps();
        let kept = spec.keep;
        if req.tty {
            let rx = self.shim.exec(spec, &[]).map_err(SandboxError::Exec)?;
            let (pid, master) = self.wait_started(&rx)?;
            let master = master.ok_or_else(|| SandboxError::BadExec("shim sent no pty".into()))?;
            return spawned_tty(id, pid, master, rx, kept);
        }
        let (theirs, [in_w, out_r, err_r]) = stdio_pipes()?;
        let mut fds: Vec<_> = theirs.iter().map(|f| f.as_raw_fd()).collect();
        if kept {
            fds.extend([out_r.as_raw_fd(), err_r.as_raw_fd()]);
            fds.extend(stdin.then(|| in_w.as_raw_fd()));
        }
        let rx = self.shim.exec(spec, &fds).map_err(SandboxError::Exec)?;
        drop(theirs);
        let (pid, _) = self.wait_started(&rx)?;
        let output = SpawnedOutput { id, rx, outputs: vec![(out_r, FrameKind::Stdout), (err_r, FrameKind::Stderr)] };
        Ok(Spawned { id, pid, stdin: stdin.then_some(in_w), master: None, output, kept })
    }

    /// A command [`Sandbox::spawn`] started with the shim keeping it (by
    /// this daemon or an earlier one), given back by the shim: `None` if it
    /// no longer runs, or if the command of that id is not the one whose
    /// pid was recorded.
    /// An error (the row is kept) while the shim's features are unknown.
    pub fn reattach(&self, id: u64, pid: i32) -> Result<Option<Spawned>, SandboxError> {
        // A shim adopted frozen answers its `Hello` once thawed: moments.
        if !self.shim.features_known(REATTACH_TIMEOUT) {
            return Err(SandboxError::Exec(crate::sandbox::shim_client::ShimError::FeaturesUnknown));
        }
        if !self.shim.keeps() {
            return Ok(None);
        }
        let Some(r) = self.shim.reattach(id, REATTACH_TIMEOUT).map_err(SandboxError::Exec)? else {
            return Ok(None);
        };
        if r.pid != pid {
            // Another command under that id: its events are not ours.
            self.shim.forget(id);
            return Ok(None);
        }
        let mut fds = r.fds.into_iter();
        if r.tty {
            let master = fds.next().expect("one fd, checked by the client");
            return spawned_tty(id, pid, master, r.rx, true).map(Some);
        }
        let (out_r, err_r, in_w) = (fds.next().expect("checked"), fds.next().expect("checked"), fds.next());
        let output =
            SpawnedOutput { id, rx: r.rx, outputs: vec![(out_r, FrameKind::Stdout), (err_r, FrameKind::Stderr)] };
        Ok(Some(Spawned { id, pid, stdin: in_w, master: None, output, kept: true }))
    }

    /// Close a spawned command's stdin: the caller dropped its end; this
    /// closes the copy a keeping shim holds.
    pub fn close_stdin(&self, id: u64) -> Result<(), SandboxError> {
        if self.shim.keeps() {
            self.shim.close_stdin(id).map_err(SandboxError::Exec)?;
        }
        Ok(())
    }

    /// Copy a spawned command's output to `sink` until it has exited and
    /// its output is drained; `timeout` kills its process group.
    pub fn follow(
        &self,
        output: SpawnedOutput,
        timeout: Option<Duration>,
        sink: &mut dyn FnMut(FrameKind, &[u8]) -> bool,
    ) -> Result<(ExitStatus, bool), SandboxError> {
        let fin = self.pump(output.id, Events::Channel(output.rx), output.outputs, timeout, sink)?;
        Ok((fin.status, fin.timed_out))
    }

    /// Send `signal` to a command's process group.
    pub fn signal_exec(&self, id: u64, signal: i32) -> Result<(), SandboxError> {
        self.shim.signal(id, signal, true).map_err(SandboxError::Exec)
    }

    /// Send `signal` to a command, or with `group` to its process group.
    pub fn signal_one(&self, id: u64, signal: i32, group: bool) -> Result<(), SandboxError> {
        self.shim.signal(id, signal, group).map_err(SandboxError::Exec)
    }

    #[allow(clippy::too_many_arguments)]
    fn attached_loop(
        self: &Arc<Self>,
        id: u64,
        rx: Receiver<Delivery>,
        outputs: Vec<(OwnedFd, FrameKind)>,
        stdin_w: OwnedFd,
        master: Option<OwnedFd>,
        req: &ExecRequest,
        conn: UnixStream,
        ended: &mut dyn FnMut(&ExecSummary),
    ) -> Result<(), SandboxError> {
        let started_at = std::time::SystemTime::now();
        let start = Instant::now();
        let mut writer = conn.try_clone().map_err(|source| SandboxError::Io { step: "clone connection", source })?;
        let mut reader = conn;
        let tty = req.tty;
        let this = self.clone();
        // Client → command: stdin bytes, stdin EOF, window size. A vanished
        // client kills the command's process group.
        std::thread::spawn(move || {
            let mut stdin = Some(std::fs::File::from(stdin_w));
            loop {
                match stream::read_frame(&mut reader) {
                    Ok(Some((FrameKind::Stdin, data))) if data.is_empty() => {
                        if !tty {
                            stdin = None;
                        }
                    }
                    Ok(Some((FrameKind::Stdin, data))) => {
                        if stdin.as_mut().is_some_and(|w| w.write_all(&data).is_err()) {
                            stdin = None;
                        }
                    }
                    Ok(Some((FrameKind::Resize, p))) => {
                        if let (Some(m), Some((r, c))) = (master.as_ref(), stream::parse_resize(&p)) {
                            let _ = strata_shim::sys::set_window_size(m.as_fd(), r, c);
                        }
                    }
                    Ok(Some(_)) => {}
                    Ok(None) | Err(_) => {
                        let _ = this.shim.signal(id, libc::SIGKILL, true);
                        return;
                    }
                }
            }
        });
        let mut output_bytes = 0u64;
        let mut kept = crate::model::KeptOutput::default();
        let fin = self.pump(id, Events::Channel(rx), outputs, req.timeout, &mut |kind, data| {
            output_bytes += data.len() as u64;
            kept.keep(req.keep_output, kind == FrameKind::Stdout, data);
            stream::write_frame(&mut writer, kind, data).is_ok()
        });
        let fin = match fin {
            Ok(fin) => fin,
            Err(e) => {
                // Say why and end the stream (which also ends the stdin
                // thread's read): a client once waited forever for an exit
                // status after the shim died or the sandbox was removed.
                let _ = stream::write_frame(&mut writer, FrameKind::Error, crate::error::chain(&e).as_bytes());
                let _ = writer.shutdown(std::net::Shutdown::Both);
                return Err(e);
            }
        };
        ended(&ExecSummary { status: fin.status, started_at, duration: start.elapsed(), output_bytes, kept });
        let _ = stream::write_frame(&mut writer, FrameKind::Exit, &fin.status.shell_code().to_be_bytes());
        let _ = writer.shutdown(std::net::Shutdown::Both);
        Ok(())
    }

    /// Copy output to `sink` until the command has exited and its output is
    /// drained (see [`Pump::run`]).
    fn pump(
        &self,
        id: u64,
        events: Events,
        outputs: Vec<(OwnedFd, FrameKind)>,
        timeout: Option<Duration>,
        sink: &mut dyn FnMut(FrameKind, &[u8]) -> bool,
    ) -> Result<Finished, SandboxError> {
        let kill = || drop(self.signal_exec(id, libc::SIGKILL));
        match Pump::new(id, events, outputs, timeout).run(&self.id, &kill, None, sink)? {
            Some(fin) => Ok(fin),
            None => Err(SandboxError::Dead(self.id.clone())),
        }
    }
}

/// A running command's output and end, as [`Pump::run`] waits for them.
struct Pump {
    id: u64,
    open: Vec<(std::fs::File, FrameKind)>,
    /// Where the end comes from: the connection's events, or a status pipe
    /// (polled with the outputs until its one event came).
    rx: Option<Receiver<Delivery>>,
    status_pipe: Option<std::fs::File>,
    status_bytes: Vec<u8>,
    deadline: Option<Instant>,
    timed_out: bool,
    status: Option<ExitStatus>,
    /// Once exited: the end unless more output comes before it (then
    /// [`QUIET`] after that). An output still open then is a background
    /// process's, not waited for.
    quiet_until: Option<Instant>,
    killed: bool,
}

/// How long output may pause after the command exited before the rest is
/// taken to be a background process's.
const QUIET: Duration = Duration::from_millis(20);

impl Pump {
    fn new(id: u64, events: Events, outputs: Vec<(OwnedFd, FrameKind)>, timeout: Option<Duration>) -> Pump {
        let (rx, status_pipe) = match events {
            Events::Channel(rx) => (Some(rx), None),
            Events::Status(f) => (None, Some(f)),
        };
        Pump {
            id,
            open: outputs.into_iter().map(|(fd, k)| (std::fs::File::from(fd), k)).collect(),
            rx,
            status_pipe,
            status_bytes: Vec::new(),
            deadline: timeout.map(|t| Instant::now() + t),
            timed_out: false,
            status: None,
            quiet_until: None,
            killed: false,
        }
    }

    /// Copy output to `sink` until the command has exited and its output
    /// is drained (or only a background process still holds it open), or
    /// until `until` has passed (then `None`: call again to go on).
    /// Enforces the timeout; `sink` returning false means the consumer is
    /// gone, and the command's process group is killed.
    /// `sandbox` names it in errors; `kill` sends SIGKILL to the command's
    /// process group.
    fn run(
        &mut self,
        sandbox: &SandboxId,
        kill: &dyn Fn(),
        until: Option<Instant>,
        sink: &mut dyn FnMut(FrameKind, &[u8]) -> bool,
    ) -> Result<Option<Finished>, SandboxError> {
        let dead = || SandboxError::Dead(sandbox.clone());
        // How long a wait of `ms` may be with `until` in view (at least 1:
        // no busy loop; past `until` by under a millisecond).
        let capped = |ms: u128| -> u128 {
            until.map_or(ms, |u| ms.min(u.saturating_duration_since(Instant::now()).as_millis())).max(1)
        };
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            if until.is_some_and(|u| Instant::now() >= u) {
                return Ok(None);
            }
            // Collect exit events without blocking.
            match self.rx.as_ref().map(|rx| rx.try_recv()) {
                Some(Ok(Delivery { event: ShimEvent::Exited { status: s, .. }, .. })) => self.status = Some(s),
                Some(Ok(Delivery { event: ShimEvent::StartFailed { message, .. }, .. })) => {
                    return Err(SandboxError::BadExec(message))
                }
                Some(Err(TryRecvError::Disconnected)) if self.status.is_none() => return Err(dead()),
                _ => {}
            }
            if let Some(d) = self.deadline {
                if Instant::now() >= d {
                    self.timed_out = true;
                    self.deadline = None;
                    kill();
                }
            }
            if self.open.is_empty() && self.status_pipe.is_none() {
                if let Some(s) = self.status {
                    return Ok(Some(Finished { status: s, timed_out: self.timed_out }));
                }
                let Some(rx) = self.rx.as_ref() else { return Err(dead()) };
                let wait = self
                    .deadline
                    .map(|d| d.saturating_duration_since(Instant::now()))
                    .unwrap_or(Duration::from_secs(3600))
                    .min(until.map_or(Duration::MAX, |u| u.saturating_duration_since(Instant::now())));
                match rx.recv_timeout(wait) {
                    Ok(Delivery { event: ShimEvent::Exited { status: s, .. }, .. }) => self.status = Some(s),
                    Ok(Delivery { event: ShimEvent::StartFailed { message, .. }, .. }) => {
                        return Err(SandboxError::BadExec(message))
                    }
                    Ok(_) | Err(RecvTimeoutError::Timeout) => {}
                    Err(RecvTimeoutError::Disconnected) => return Err(dead()),
                }
                continue;
            }
            if self.status.is_some() && self.quiet_until.is_none() {
                self.quiet_until = Some(Instant::now() + QUIET);
            }
            let wait_ms = match self.quiet_until {
                Some(q) => capped(q.saturating_duration_since(Instant::now()).as_millis()),
                None => {
                    let left =
                        self.deadline.map(|d| d.saturating_duration_since(Instant::now()).as_millis()).unwrap_or(100);
                    capped(left.clamp(1, 100))
                }
            };
            let ready: Vec<bool> = {
                let mut pfds: Vec<PollFd> = self
                    .open
                    .iter()
                    .map(|(f, _)| f)
                    .chain(self.status_pipe.as_ref())
                    .map(|f| PollFd::new(f.as_fd(), PollFlags::POLLIN))
                    .collect();
                match poll(&mut pfds, PollTimeout::from(wait_ms as u16)) {
                    Ok(0) => {
                        if let (Some(s), Some(q)) = (self.status, self.quiet_until) {
                            if Instant::now() >= q {
                                // Exited, and nothing more came: a background
                                // process holds the pipe. Stop here.
                                return Ok(Some(Finished { status: s, timed_out: self.timed_out }));
                            }
                        }
                        continue;
                    }
                    Ok(_) => {}
                    Err(nix::Error::EINTR) => continue,
                    Err(e) => return Err(SandboxError::Io { step: "poll command output", source: e.into() }),
                }
                pfds.iter().map(|p| p.revents().is_some_and(|r| !r.is_empty())).collect()
            };
            if ready.get(self.open.len()) == Some(&true) {
                if let Some(f) = self.status_pipe.as_mut() {
                    // The shim writes one event in one write; it counts once
                    // whole (a copy of the write end held by a process
                    // forked meanwhile must not delay it until that closes).
                    let end = match f.read(&mut buf) {
                        Ok(0) => true,
                        Ok(n) => {
                            self.status_bytes.extend_from_slice(&buf[..n]);
                            false
                        }
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => false,
                        Err(_) => true,
                    };
                    match serde_json::from_slice::<ShimEvent>(&self.status_bytes) {
                        Ok(ShimEvent::Exited { status: s, .. }) => {
                            self.status = Some(s);
                            self.status_pipe = None;
                        }
                        Ok(ShimEvent::StartFailed { message, .. }) => return Err(SandboxError::BadExec(message)),
                        // EOF with no whole event: the shim died.
                        _ if end => return Err(dead()),
                        _ => {}
                    }
                }
            }
            let mut closed = Vec::new();
            for (i, is_ready) in ready.into_iter().take(self.open.len()).enumerate() {
                if !is_ready {
                    continue;
                }
                let (f, kind) = &mut self.open[i];
                match f.read(&mut buf) {
                    Ok(0) | Err(_) => closed.push(i), // EOF, or EIO once a pty's slave side is gone
                    Ok(n) => {
                        if self.quiet_until.is_some() {
                            self.quiet_until = Some(Instant::now() + QUIET);
                        }
                        if !sink(*kind, &buf[..n]) && !self.killed {
                            self.killed = true;
                            kill();
                        }
                    }
                }
            }
            for i in closed.into_iter().rev() {
                self.open.remove(i);
            }
        }
    }
}

#[cfg(test)]
mod tests;
