//! Processes with the caller's stdio (`/v1/sandboxes/{id}/processes`): a
//! containerd task's main process and its execs. The caller names host
//! files or FIFOs (containerd's) for stdin, stdout and stderr; the daemon
//! opens them and the command gets them as they are. Its pid is answered
//! at once; a thread of the daemon follows it to its end (logging it in
//! the exec log as every command is), and a wait (`?wait=SECS`) returns
//! once it ended. Signals go to the process (its process group with
//! `group`). An ended process is kept until it is forgotten (`DELETE`) or
//! its sandbox goes; a daemon restart forgets them all (the commands run
//! on; they are not adopted).

use std::os::fd::OwnedFd;
use std::time::Duration;

use crate::daemon::Daemon;
use crate::error::{Classify, ErrorKind};
use crate::ids::SandboxId;
use crate::sandbox::{ExecRequest, Proc};
use crate::types::{ProcessInfo, ProcessRequest, SignalRequest};

/// The longest a wait may ask for (`?wait=SECS`): a caller waiting longer
/// asks again.
pub const MAX_WAIT_SECS: u64 = 60;

/// Why a process operation failed.
#[derive(Debug, thiserror::Error, displaydoc::Display)]
pub enum ProcessError {
    /// {0}
    Sandbox(#[from] crate::daemon::SandboxOpError),
    /// {0}
    Start(#[from] crate::sandbox::SandboxError),
    /// {what} {path:?}: {why}
    Stdio { what: &'static str, path: String, why: String },
    /// sandbox {0} has no process {1}
    Unknown(SandboxId, u64),
    /// process {1} of sandbox {0} is still running: signal it first
    Running(SandboxId, u64),
    /// signal {0}: use 1-64
    Signal(i32),
    /// wait {0}: use 0-60 seconds
    Wait(u64),
    /// the daemon's background threads are not running: no process can be followed
    NotStarted,
}

impl Classify for ProcessError {
    fn kind(&self) -> ErrorKind {
        match self {
            ProcessError::Sandbox(e) => e.kind(),
            ProcessError::Start(e) => e.kind(),
            ProcessError::Stdio { .. } | ProcessError::Signal(_) | ProcessError::Wait(_) => ErrorKind::InvalidArgument,
            ProcessError::Unknown(..) => ErrorKind::NotFound,
            ProcessError::Running(..) => ErrorKind::Conflict,
            ProcessError::NotStarted => ErrorKind::Internal,
        }
    }
}

/// Open the host file or FIFO `path` for a command's stdio: an absolute
/// path; none is /dev/null. A FIFO is opened without waiting (the caller
/// has its other end open, as containerd has) and given to the command
/// blocking.
fn stdio(what: &'static str, path: Option<&str>, write: bool) -> Result<OwnedFd, ProcessError> {
    use std::os::unix::fs::OpenOptionsExt;
    let bad = |p: &str, why: String| ProcessError::Stdio { what, path: p.to_string(), why };
    let path = match path.filter(|p| !p.is_empty()) {
        None => "/dev/null",
        Some(p) if !p.starts_with('/') => return Err(bad(p, "must be an absolute path".into())),
        Some(p) => p,
    };
    let f = std::fs::OpenOptions::new()
        .read(!write)
        .write(write)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
        .map_err(|e| match e.raw_os_error() {
            Some(libc::ENXIO) => bad(path, "a FIFO nobody reads (open its read end first)".into()),
            _ => bad(path, e.to_string()),
        })?;
    let fd = OwnedFd::from(f);
    use std::os::fd::AsRawFd;
    let flags =
        nix::fcntl::fcntl(fd.as_raw_fd(), nix::fcntl::FcntlArg::F_GETFL).map_err(|e| bad(path, e.to_string()))?;
    let blocking = nix::fcntl::OFlag::from_bits_truncate(flags) - nix::fcntl::OFlag::O_NONBLOCK;
    nix::fcntl::fcntl(fd.as_raw_fd(), nix::fcntl::FcntlArg::F_SETFL(blocking)).map_err(|e| bad(path, e.to_string()))?;
    Ok(fd)
}

fn info(p: &Proc) -> ProcessInfo {
    let end = p.end();
    ProcessInfo {
        id: p.id,
        pid: p.pid,
        host_pid: p.host_pid,
        argv: p.argv.clone(),
        started_at: p.started_at,
        running: end.is_none(),
        exit_code: end.map(|e| e.status.shell_code()),
        signal: end.and_then(|e| match e.status {
            strata_shim::proto::ExitStatus::Signal(s) => Some(s),
            strata_shim::proto::ExitStatus::Code(_) => None,
        }),
        exited_at: end.map(|e| e.at_ms),
    }
}

impl Daemon {
    /// Start a process with the caller's stdio; its pid at once.
    pub fn start_process(&self, id: &str, req: ProcessRequest) -> Result<ProcessInfo, ProcessError> {
        let me = self.me.get().and_then(|w| w.upgrade()).ok_or(ProcessError::NotStarted)?;
        let sb = self.sandbox(id)?;
        let fds = [
            stdio("stdin", req.stdin.as_deref(), false)?,
            stdio("stdout", req.stdout.as_deref(), true)?,
            stdio("stderr", req.stderr.as_deref(), true)?,
        ];
        let ereq = ExecRequest {
            argv: req.argv,
            env: req.env,
            cwd: req.cwd,
            user: req.user,
            timeout: None,
            tty: false,
            size: (0, 0),
            keep_output: self.cfg.keep_output,
        };
        let (proc, events) = sb.start_with_stdio(&ereq, fds)?;
        let (sandbox, p) = ((*sb).clone(), proc.clone());
        let waiter = std::thread::Builder::new().name(format!("process-{}", proc.pid)).spawn(move || {
            // A sandbox gone under it (removed, its shim dead): killed.
            let status = match me.follow(&sandbox, &ereq, events, None, &mut |_, _| {}) {
                Ok((status, _)) => status,
                Err(_) => strata_shim::proto::ExitStatus::Signal(libc::SIGKILL),
            };
            p.finish(status);
        });
        if let Err(e) = waiter {
            // Nobody would see it end: stop it rather than keep a process
            // that never reports.
            tracing::warn!("sandbox {}: no thread to follow process {}: {e}; killing it", sb.id, proc.pid);
            let _ = sb.signal_exec(proc.id, libc::SIGKILL);
            proc.finish(strata_shim::proto::ExitStatus::Signal(libc::SIGKILL));
        }
        tracing::info!("sandbox {}: process {} started: {:?}", sb.id, proc.pid, proc.argv);
        Ok(info(&proc))
    }

    fn proc_of(&self, id: &str, n: u64) -> Result<(crate::sandbox::InUse, std::sync::Arc<Proc>), ProcessError> {
        let sb = self.sandbox(id)?;
        let p = sb.process(n).ok_or_else(|| ProcessError::Unknown(sb.id.clone(), n))?;
        Ok((sb, p))
    }

    /// One process, after waiting up to `wait` seconds for it to end.
    pub fn process(&self, id: &str, n: u64, wait: Option<u64>) -> Result<ProcessInfo, ProcessError> {
        if let Some(w) = wait.filter(|w| *w > MAX_WAIT_SECS) {
            return Err(ProcessError::Wait(w));
        }
        let (_sb, p) = self.proc_of(id, n)?;
        if let Some(w) = wait {
            p.wait(Duration::from_secs(w));
        }
        Ok(info(&p))
    }

    pub fn processes(&self, id: &str) -> Result<Vec<ProcessInfo>, ProcessError> {
        Ok(self.sandbox(id)?.processes().iter().map(|p| info(p)).collect())
    }

    /// Send a signal to a running process (its process group with
    /// `group`); one that ended is left alone.
    pub fn signal_process(&self, id: &str, n: u64, req: SignalRequest) -> Result<ProcessInfo, ProcessError> {
        if !(1..=64).contains(&req.signal) {
            return Err(ProcessError::Signal(req.signal));
        }
        let (sb, p) = self.proc_of(id, n)?;
        if p.end().is_none() {
            sb.signal_one(p.id, req.signal, req.group)?;
        }
        Ok(info(&p))
    }

    /// Forget an ended process.
    pub fn forget_process(&self, id: &str, n: u64) -> Result<(), ProcessError> {
        let sb = self.sandbox(id)?;
        sb.forget_process(n).map_err(|f| match f {
            crate::sandbox::Forget::Unknown => ProcessError::Unknown(sb.id.clone(), n),
            crate::sandbox::Forget::Running => ProcessError::Running(sb.id.clone(), n),
        })
    }
}
