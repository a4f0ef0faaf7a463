//! envd's `process.Process` service: commands that outlive the request
//! that started them. Each is a command the daemon spawned in the sandbox
//! (its own process group, pid in the sandbox's PID namespace); a thread
//! follows its output and hands each chunk to every stream attached to it
//! (`Start`'s, then any `Connect`'s), then its end. A stream going away
//! detaches; it does not kill the command (`SendSignal` does, and so does
//! the sandbox going).
//!
//! The table outlives the daemon: each command is a catalog row
//! (`e2b_processes`), and the shim keeps copies of the daemon's ends of
//! its stdio, so a command writing while no daemon runs only waits for
//! room in its pipe (never EPIPE). A restarted daemon's E2B listener takes
//! each recorded command back from the shim as it starts, and a paused
//! sandbox's at its first envd call ([`Procs::restore`]): `List` shows it with its pid, tag and config,
//! and `Connect` streams its output from then on. What it wrote before
//! is gone (a stream attached before the restart ended with it); while no
//! daemon read it, a command that wrote more than its pipe holds (64 KiB)
//! waited, as on a terminal nobody reads. A command that ended meanwhile
//! is dropped from the table, its exit status unknown.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Write;
use std::os::fd::{AsFd, AsRawFd};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use serde_json::{json, Value};
use strata_shim::proto::ExitStatus;
use tokio::sync::mpsc;

use super::connect::{self, field, Code, RpcError};
use super::users::User;
use crate::catalog::E2bProcess;
use crate::daemon::{lock, Daemon};
use crate::sandbox::{ExecRequest, Sandbox, Spawned};
use crate::stream::FrameKind;

/// Frames queued per attached stream before the command's output waits
/// for it.
const STREAM_QUEUE: usize = 64;
/// How long a stream may keep a command's output waiting before it is
/// dropped.
const STREAM_STALL: Duration = Duration::from_secs(30);
/// Commands E2B clients may have running in one sandbox at once.
pub const MAX_PROCESSES: usize = 1024;

/// A stream's frames: messages, then the end-of-stream envelope.
pub type Frames = mpsc::Receiver<Bytes>;

struct Attached {
    streams: Vec<mpsc::Sender<Bytes>>,
    ended: bool,
}

pub struct Proc {
    pid: u32,
    tag: Option<String>,
    /// `ProcessConfig` as it was asked for (echoed by `List`).
    config: Value,
    exec_id: u64,
    stdin: Mutex<Option<File>>,
    master: Option<File>,
    /// With a pty: input queued for the thread that writes it to the
    /// master (a program that does not read would block a request).
    pty_input: Option<std::sync::mpsc::SyncSender<Vec<u8>>>,
    attached: Mutex<Attached>,
}

impl Proc {
    /// Attach a stream; its first message is the start event. None once
    /// the command has ended.
    fn attach(&self) -> Option<Frames> {
        let (tx, rx) = mpsc::channel(STREAM_QUEUE);
        let mut a = lock(&self.attached);
        if a.ended {
            return None;
        }
        let _ = tx.try_send(connect::message(&json!({"event": {"start": {"pid": self.pid}}})));
        a.streams.push(tx);
        Some(rx)
    }

    /// Send to every attached stream, dropping those that went away. A
    /// client slow to read holds the command's output (its pipe fills, as
    /// on a terminal), for at most [`STREAM_STALL`]: then its stream is
    /// dropped (it ends without an end event) and the others go on.
    fn broadcast(&self, frame: Bytes) {
        use tokio::sync::mpsc::error::TrySendError;
        let streams = lock(&self.attached).streams.clone();
        let mut dropped: Vec<mpsc::Sender<Bytes>> = Vec::new();
        for s in &streams {
            let deadline = Instant::now() + STREAM_STALL;
            let mut f = frame.clone();
            loop {
                match s.try_send(f) {
                    Ok(()) => break,
                    Err(TrySendError::Full(back)) if Instant::now() < deadline => {
                        f = back;
                        std::thread::sleep(Duration::from_millis(5));
                    }
                    Err(_) => {
                        dropped.push(s.clone());
                        break;
                    }
                }
            }
        }
        if !dropped.is_empty() {
            lock(&self.attached).streams.retain(|s| !dropped.iter().any(|d| d.same_channel(s)));
        }
    }
}

/// The commands E2B clients started in one sandbox, by pid.
#[derive(Default)]
pub struct Procs {
    by_pid: Mutex<BTreeMap<u32, Arc<Proc>>>,
    /// The catalog's rows were taken back ([`Procs::restore`]); held while
    /// that runs, so a call waits for it.
    restored: Mutex<bool>,
}

/// What `Start` asks for, read from its message.
pub struct StartRequest {
    pub cmd: String,
    pub args: Vec<String>,
    pub envs: Vec<(String, String)>,
    pub cwd: Option<String>,
    pub tag: Option<String>,
    pub stdin: bool,
    /// With a pty: (rows, cols).
    pub pty: Option<(u16, u16)>,
    pub config: Value,
}

impl StartRequest {
    pub fn parse(m: &Value) -> Result<StartRequest, RpcError> {
        let p = m.get("process").ok_or_else(|| RpcError::invalid("process is required"))?;
        let cmd = field::str(p, "cmd")?.to_string();
        if cmd.is_empty() {
            return Err(RpcError::invalid("process.cmd is required"));
        }
        let args = match p.get("args") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| v.as_str().map(String::from).ok_or_else(|| RpcError::invalid("args must be strings")))
                .collect::<Result<_, _>>()?,
            Some(_) => return Err(RpcError::invalid("process.args must be a list")),
        };
        let pty = match m.get("pty").and_then(|p| p.get("size")) {
            Some(size) => {
                let dim = |k| field::uint(size, k).map(|n| n.clamp(1, u64::from(u16::MAX)) as u16);
                Some((dim("rows")?, dim("cols")?))
            }
            None if m.get("pty").is_some_and(|p| !p.is_null()) => Some((24, 80)),
            None => None,
        };
        Ok(StartRequest {
            cmd,
            args,
            envs: field::map(p, "envs")?,
            cwd: field::opt_str(p, "cwd")?.filter(|c| !c.is_empty()).map(String::from),
            tag: field::opt_str(m, "tag")?.map(String::from),
            stdin: field::bool(m, "stdin")?,
            pty,
            config: p.clone(),
        })
    }
}

/// How long input waits for a command that does not read its stdin.
const STDIN_WAIT: Duration = Duration::from_secs(10);

/// Write all of `data` to a non-blocking pipe, waiting for room at most
/// `wait` in all: a command that never reads cannot hold a request.
fn write_within(w: &mut File, mut data: &[u8], wait: Duration) -> Result<(), RpcError> {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    let deadline = std::time::Instant::now() + wait;
    while !data.is_empty() {
        match w.write(data) {
            Ok(n) => data = &data[n..],
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                let left = deadline.saturating_duration_since(std::time::Instant::now());
                if left.is_zero() {
                    return Err(RpcError::new(
                        Code::ResourceExhausted,
                        format!("the process did not read its stdin for {} s", wait.as_secs()),
                    ));
                }
                let ms = PollTimeout::from(left.as_millis().min(1000) as u16);
                let _ = poll(&mut [PollFd::new(w.as_fd(), PollFlags::POLLOUT)], ms);
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(RpcError::internal(format!("write to stdin: {e}"))),
        }
    }
    Ok(())
}

/// Inputs queued for a pty before `SendInput` is refused.
const PTY_QUEUE: usize = 256;

/// A thread writing queued input to a pty master (through its own
/// descriptor of it), until the queue's sender is dropped (the process is
/// forgotten) or the terminal is gone (EIO once the program ended).
fn pty_writer(master: &std::os::fd::OwnedFd) -> Result<std::sync::mpsc::SyncSender<Vec<u8>>, RpcError> {
    let mut out = File::from(master.try_clone().map_err(|e| RpcError::internal(format!("dup pty master: {e}")))?);
    let (tx, rx) = std::sync::mpsc::sync_channel::<Vec<u8>>(PTY_QUEUE);
    std::thread::spawn(move || {
        for data in rx {
            if out.write_all(&data).is_err() {
                return;
            }
        }
    });
    Ok(tx)
}

/// How a command ended, as envd's `EndEvent`.
fn end_event(status: ExitStatus) -> Value {
    match status {
        ExitStatus::Code(c) => json!({"exitCode": c, "exited": true, "status": format!("exit status {c}")}),
        ExitStatus::Signal(s) => {
            let name = nix::sys::signal::Signal::try_from(s)
                .map(|s| match s {
                    nix::sys::signal::Signal::SIGKILL => "killed".to_string(),
                    nix::sys::signal::Signal::SIGTERM => "terminated".to_string(),
                    other => other.as_str().trim_start_matches("SIG").to_lowercase(),
                })
                .unwrap_or_else(|_| s.to_string());
            json!({"exitCode": -1, "exited": false, "status": format!("signal: {name}")})
        }
    }
}

impl Procs {
    fn get(&self, m: &Value) -> Result<Arc<Proc>, RpcError> {
        let sel = m.get("process").ok_or_else(|| RpcError::invalid("process (a selector) is required"))?;
        let procs = lock(&self.by_pid);
        if let Some(tag) = field::opt_str(sel, "tag")? {
            return procs
                .values()
                .find(|p| p.tag.as_deref() == Some(tag))
                .cloned()
                .ok_or_else(|| RpcError::not_found(format!("no process with tag {tag:?}")));
        }
        let pid = field::uint(sel, "pid")?;
        procs
            .get(&(pid as u32))
            .cloned()
            .ok_or_else(|| RpcError::not_found(format!("process with pid {pid} not found")))
    }

    /// Start a command; the returned stream begins with its start event.
    pub fn start(
        self: &Arc<Self>,
        d: &Arc<Daemon>,
        sb: &Arc<Sandbox>,
        user: &User,
        req: StartRequest,
        timeout: Option<Duration>,
    ) -> Result<Frames, RpcError> {
        if lock(&self.by_pid).len() >= MAX_PROCESSES {
            return Err(RpcError::new(
                Code::ResourceExhausted,
                format!("{MAX_PROCESSES} commands are running already"),
            ));
        }
        // The environment envd gives: the user's, then the request's.
        let mut env =
            vec![format!("HOME={}", user.home), format!("USER={}", user.name), format!("LOGNAME={}", user.name)];
        env.extend(req.envs.iter().map(|(k, v)| format!("{k}={v}")));
        let exec = ExecRequest {
            argv: std::iter::once(req.cmd.clone()).chain(req.args.iter().cloned()).collect(),
            env,
            // No cwd asked: the image's working directory, else the home;
            // a relative one is under the home, as envd's paths are.
            cwd: Some(match &req.cwd {
                Some(c) => super::fs::absolute(c, user)?,
                None if sb.defaults.image_cwd => sb.defaults.cwd.clone(),
                None => user.home.clone(),
            }),
            user: Some(format!("{}:{}", user.uid, user.gid)),
            timeout: None,
            tty: req.pty.is_some(),
            size: req.pty.unwrap_or((24, 80)),
            keep_output: 0,
        };
        let spawned = sb.spawn(&exec, req.stdin).map_err(|e| {
            let msg = crate::error::chain(&e);
            match e {
                crate::sandbox::SandboxError::BadExec(_) => RpcError::invalid(msg),
                _ => RpcError::new(Code::Unavailable, msg),
            }
        })?;
        let row = E2bProcess {
            sandbox: sb.id.to_string(),
            pid: spawned.pid as u32,
            exec_id: spawned.id,
            tag: req.tag.clone(),
            config: req.config.clone(),
            cwd: exec.cwd.clone().unwrap_or_default(),
            stdin: req.stdin,
            pty: req.pty.is_some(),
            deadline: timeout.map(|t| crate::catalog::now_ms() + t.as_millis() as i64),
        };
        if spawned.kept {
            // Its environment stays out of the catalog (a shared database,
            // and envs carry secrets): listed after a restart without it.
            let mut stored = row.clone();
            if let Some(c) = stored.config.as_object_mut() {
                c.remove("envs");
            }
            // Not recorded: the command still runs, but a restart loses it.
            if let Err(e) = lock(&d.db).insert_e2b_process(&stored) {
                tracing::warn!(sandbox = %sb.id, pid = row.pid, "record an E2B process: {}", crate::error::chain(&e));
            }
        }
        self.adopt(d, sb, row, spawned, timeout, true)?
            .ok_or_else(|| RpcError::internal("the command ended before it started"))
    }

    /// Take back, once, the commands the catalog records as running in
    /// `sb` (started before a daemon restart): each the shim still runs
    /// is followed again; the others are forgotten.
    pub fn restore(self: &Arc<Self>, d: &Arc<Daemon>, sb: &Arc<Sandbox>) {
        let mut restored = lock(&self.restored);
        // A frozen shim answers once thawed: taken back then.
        if *restored || sb.run_state() != crate::sandbox::RunState::Running {
            return;
        }
        *restored = true;
        let rows = match lock(&d.db).e2b_processes(sb.id.as_str()) {
            Ok(rows) => rows,
            Err(e) => {
                tracing::warn!(sandbox = %sb.id, "read the E2B process table: {}", crate::error::chain(&e));
                return;
            }
        };
        for row in rows {
            if lock(&self.by_pid).contains_key(&row.pid) {
                continue;
            }
            match sb.reattach(row.exec_id, row.pid as i32) {
                Ok(Some(spawned)) => {
                    let left =
                        row.deadline.map(|t| Duration::from_millis((t - crate::catalog::now_ms()).max(0) as u64));
                    let pid = row.pid;
                    if let Err(e) = self.adopt(d, sb, row, spawned, left, false) {
                        tracing::warn!(sandbox = %sb.id, pid, "take back an E2B process: {}", e.message);
                    }
                }
                Ok(None) => {
                    if let Err(e) = lock(&d.db).delete_e2b_process(&row.sandbox, row.pid, row.exec_id) {
                        tracing::warn!(sandbox = %sb.id, "forget an E2B process: {}", crate::error::chain(&e));
                    }
                }
                // Not now (no answer, or the shim's features not known yet:
                // a sandbox adopted frozen): its row stays and the next call
                // tries again.
                Err(e) => {
                    tracing::warn!(sandbox = %sb.id, pid = row.pid, "take back an E2B process: {}", crate::error::chain(&e));
                    *restored = false;
                }
            }
        }
    }

    /// Enter a started (or taken back) command in the table, and follow
    /// its output on a thread until it ends; then its row goes. With
    /// `attach`, the stream returned is attached before any output is read.
    fn adopt(
        self: &Arc<Self>,
        d: &Arc<Daemon>,
        sb: &Arc<Sandbox>,
        row: E2bProcess,
        spawned: Spawned,
        timeout: Option<Duration>,
        attach: bool,
    ) -> Result<Option<Frames>, RpcError> {
        let pty = row.pty;
        let proc = Arc::new(Proc {
            pid: row.pid,
            tag: row.tag.clone(),
            config: row.config.clone(),
            exec_id: spawned.id,
            stdin: Mutex::new(spawned.stdin.map(|fd| {
                // Our end only (the command's end is its own descriptor).
                let _ = nix::fcntl::fcntl(fd.as_raw_fd(), nix::fcntl::FcntlArg::F_SETFL(nix::fcntl::OFlag::O_NONBLOCK));
                File::from(fd)
            })),
            pty_input: match &spawned.master {
                Some(m) => Some(pty_writer(m)?),
                None => None,
            },
            master: spawned.master.map(File::from),
            attached: Mutex::new(Attached { streams: Vec::new(), ended: false }),
        });
        let frames = if attach { proc.attach() } else { None };
        lock(&self.by_pid).insert(proc.pid, proc.clone());
        // What the exec log records: the command line its config holds.
        let argv = StartRequest::parse(&json!({"process": row.config}))
            .map(|r| std::iter::once(r.cmd).chain(r.args).collect())
            .unwrap_or_default();
        let exec = ExecRequest { argv, cwd: Some(row.cwd.clone()), ..Default::default() };
        let (d, sb, procs, output, this) = (d.clone(), sb.clone(), self.clone(), spawned.output, proc.clone());
        std::thread::spawn(move || {
            let proc = this;
            let followed = d.follow(&sb, &exec, output, timeout, &mut |kind, data| {
                let key = match (pty, kind) {
                    (true, _) => "pty",
                    (false, FrameKind::Stderr) => "stderr",
                    (false, _) => "stdout",
                };
                proc.broadcast(connect::message(&json!({"event": {"data": {key: field::base64(data)}}})));
            });
            {
                // Not a later command that got the same pid.
                let mut by_pid = lock(&procs.by_pid);
                if by_pid.get(&proc.pid).is_some_and(|p| Arc::ptr_eq(p, &proc)) {
                    by_pid.remove(&proc.pid);
                }
            }
            // Ended: its row goes. Lost (the shim or the daemon going):
            // it stays for a later daemon, or goes with the sandbox's row.
            if followed.is_ok() {
                if let Err(e) = lock(&d.db).delete_e2b_process(&row.sandbox, row.pid, row.exec_id) {
                    tracing::warn!(sandbox = %sb.id, "forget an E2B process: {}", crate::error::chain(&e));
                }
            }
            let (end, error) = match followed {
                Ok((status, false)) => (Some(end_event(status)), None),
                Ok((status, true)) => (
                    Some(end_event(status)),
                    Some(RpcError::new(Code::DeadlineExceeded, "the command's time ran out; it was killed")),
                ),
                Err(e) => (None, Some(RpcError::new(Code::Unavailable, crate::error::chain(&e)))),
            };
            if let Some(end) = end {
                proc.broadcast(connect::message(&json!({"event": {"end": end}})));
            }
            proc.broadcast(connect::end(error.as_ref()));
            let mut a = lock(&proc.attached);
            a.ended = true;
            a.streams.clear();
        });
        Ok(frames)
    }

    /// `Connect`: attach to a running command.
    pub fn connect(&self, m: &Value) -> Result<Frames, RpcError> {
        let p = self.get(m)?;
        p.attach().ok_or_else(|| RpcError::not_found(format!("process with pid {} has ended", p.pid)))
    }

    pub fn list(&self) -> Value {
        let procs = lock(&self.by_pid);
        let list: Vec<Value> = procs
            .values()
            .map(|p| {
                let mut v = json!({"config": p.config, "pid": p.pid});
                if let Some(t) = &p.tag {
                    v["tag"] = json!(t);
                }
                v
            })
            .collect();
        json!({ "processes": list })
    }

    /// `SendInput` (and each message of `StreamInput`): bytes to its stdin
    /// or its pty.
    pub fn input(&self, m: &Value, input: &Value) -> Result<(), RpcError> {
        let p = self.get(m)?;
        if input.get("pty").is_some() {
            let data = field::bytes(input, "pty")?;
            let input = p.pty_input.as_ref().ok_or_else(|| RpcError::invalid("the process has no pty"))?;
            return input.try_send(data).map_err(|e| match e {
                std::sync::mpsc::TrySendError::Full(_) => RpcError::new(
                    Code::ResourceExhausted,
                    format!("{PTY_QUEUE} inputs are waiting for the program to read its terminal"),
                ),
                std::sync::mpsc::TrySendError::Disconnected(_) => {
                    RpcError::not_found(format!("process with pid {} has ended", p.pid))
                }
            });
        }
        let data = field::bytes(input, "stdin")?;
        let mut stdin = lock(&p.stdin);
        let w = stdin.as_mut().ok_or_else(|| {
            RpcError::new(Code::FailedPrecondition, "the process's stdin is closed (start it with stdin: true)")
        })?;
        write_within(w, &data, STDIN_WAIT)
    }

    pub fn close_stdin(&self, sb: &Sandbox, m: &Value) -> Result<(), RpcError> {
        let p = self.get(m)?;
        if lock(&p.stdin).take().is_some() {
            sb.close_stdin(p.exec_id).map_err(|e| RpcError::new(Code::Unavailable, crate::error::chain(&e)))?;
        }
        Ok(())
    }

    pub fn signal(&self, sb: &Sandbox, m: &Value) -> Result<(), RpcError> {
        let p = self.get(m)?;
        let sig = match m.get("signal") {
            Some(Value::String(s)) if s == "SIGNAL_SIGKILL" => libc::SIGKILL,
            Some(Value::String(s)) if s == "SIGNAL_SIGTERM" => libc::SIGTERM,
            Some(Value::Number(n)) if n.as_i64() == Some(9) => libc::SIGKILL,
            Some(Value::Number(n)) if n.as_i64() == Some(15) => libc::SIGTERM,
            other => return Err(RpcError::invalid(format!("signal {other:?}: SIGNAL_SIGKILL or SIGNAL_SIGTERM"))),
        };
        sb.signal_exec(p.exec_id, sig).map_err(|e| RpcError::new(Code::Unavailable, crate::error::chain(&e)))
    }

    /// `Update`: a pty's window size.
    pub fn update(&self, m: &Value) -> Result<(), RpcError> {
        let p = self.get(m)?;
        let Some(size) = m.get("pty").and_then(|p| p.get("size")) else { return Ok(()) };
        let master = p.master.as_ref().ok_or_else(|| RpcError::invalid("the process has no pty"))?;
        let dim = |k| field::uint(size, k).map(|n| n.clamp(1, u64::from(u16::MAX)) as u16);
        strata_shim::sys::set_window_size(master.as_fd(), dim("rows")?, dim("cols")?)
            .map_err(|e| RpcError::internal(format!("set the window size: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn start_requests_parse_as_the_sdk_sends_them() {
        let m = json!({"process": {"cmd": "/bin/bash", "args": ["-l", "-c", "echo hi"], "envs": {"A": "1"}, "cwd": "/tmp"}, "stdin": true});
        let r = StartRequest::parse(&m).unwrap();
        assert_eq!(
            (r.cmd.as_str(), r.args.len(), r.cwd.as_deref(), r.stdin, r.pty),
            ("/bin/bash", 3, Some("/tmp"), true, None)
        );
        let m =
            json!({"process": {"cmd": "/bin/bash", "args": ["-i", "-l"]}, "pty": {"size": {"cols": 80, "rows": 24}}});
        assert_eq!(StartRequest::parse(&m).unwrap().pty, Some((24, 80)));
        assert!(StartRequest::parse(&json!({"process": {"args": []}})).is_err());
        assert!(StartRequest::parse(&json!({"process": {"cmd": "x", "args": [1]}})).is_err());
    }

    #[test]
    fn input_to_a_command_that_does_not_read_gives_up() {
        let (r, w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC | nix::fcntl::OFlag::O_NONBLOCK).unwrap();
        let mut w = File::from(w);
        write_within(&mut w, b"fits", Duration::from_millis(100)).unwrap();
        let started = Instant::now();
        let e = write_within(&mut w, &vec![0u8; 4 << 20], Duration::from_millis(200)).unwrap_err();
        assert_eq!(e.code, Code::ResourceExhausted);
        assert!(started.elapsed() >= Duration::from_millis(200) && started.elapsed() < Duration::from_secs(5));
        drop(r);
    }

    #[test]
    fn ends_read_as_envd_reports_them() {
        assert_eq!(end_event(ExitStatus::Code(3))["exitCode"], 3);
        assert_eq!(end_event(ExitStatus::Signal(9))["status"], "signal: killed");
        assert_eq!(end_event(ExitStatus::Signal(9))["exited"], false);
    }
}
