//! Processes started with the caller's stdio (`Daemon::start_process`, a
//! containerd task's): the files or FIFOs it named are the command's
//! stdin, stdout and stderr as they are (the shim hands them to the
//! command; no byte passes through the daemon), and the sandbox keeps
//! each one's pid and, once it ended, how, until the caller forgets it.

use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use strata_shim::proto::ExitStatus;

use super::exec::SpawnedOutput;
use super::{ExecRequest, Sandbox, SandboxError};

/// How many processes (running, or ended and not yet forgotten) one
/// sandbox keeps.
pub const MAX_PROCESSES: usize = 1024;

/// How a process ended.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ProcEnd {
    pub status: ExitStatus,
    /// Unix ms.
    pub at_ms: i64,
}

/// One process of [`Sandbox::start_with_stdio`].
#[derive(Debug)]
pub struct Proc {
    /// The shim's id of it (for signals).
    pub id: u64,
    /// Its pid in the sandbox's PID namespace.
    pub pid: i32,
    /// Its pid on the host (containerd's tasks are known by it), if it was
    /// found in the sandbox's cgroup when it started.
    pub host_pid: Option<i32>,
    pub argv: Vec<String>,
    /// Unix ms.
    pub started_at: i64,
    end: Mutex<Option<ProcEnd>>,
    ended: Condvar,
}

impl Proc {
    /// How it ended, if it has.
    pub fn end(&self) -> Option<ProcEnd> {
        *self.end.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// How it ended, waiting up to `limit` for it.
    pub fn wait(&self, limit: Duration) -> Option<ProcEnd> {
        let until = Instant::now() + limit;
        let mut end = self.end.lock().unwrap_or_else(|e| e.into_inner());
        while end.is_none() {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            end = self.ended.wait_timeout(end, left).unwrap_or_else(|e| e.into_inner()).0;
        }
        *end
    }

    /// Record its end and wake its waiters (once: a later call is ignored).
    pub fn finish(&self, status: ExitStatus) {
        let mut end = self.end.lock().unwrap_or_else(|e| e.into_inner());
        if end.is_none() {
            *end = Some(ProcEnd { status, at_ms: crate::spec::now_ms() });
            self.ended.notify_all();
        }
    }
}

/// Why a process could not be forgotten.
#[derive(Debug, PartialEq)]
pub enum Forget {
    Unknown,
    Running,
}

impl Sandbox {
    /// Start a command whose stdin, stdout and stderr are `stdio`, kept in
    /// its process table; what [`Sandbox::follow`] needs to see it end is
    /// returned with it (the caller waits for that and calls
    /// [`Proc::finish`]). Not kept across a daemon restart.
    pub fn start_with_stdio(
        &self,
        req: &ExecRequest,
        stdio: [OwnedFd; 3],
    ) -> Result<(Arc<Proc>, SpawnedOutput), SandboxError> {
        let mut procs = self.procs.lock().unwrap_or_else(|e| e.into_inner());
        if procs.len() >= MAX_PROCESSES {
            return Err(SandboxError::BadExec(format!(
                "sandbox {} keeps {MAX_PROCESSES} processes already: forget ended ones first",
                self.id
            )));
        }
        let spec = self.exec_spec(req)?;
        let id = spec.id;
        let fds: Vec<i32> = stdio.iter().map(|f| f.as_raw_fd()).collect();
        let rx = self.shim.exec(spec, &fds).map_err(SandboxError::Exec)?;
        drop(stdio);
        let (pid, _) = self.wait_started(&rx)?;
        let proc = Arc::new(Proc {
            id,
            pid,
            host_pid: self.host_pid(pid),
            argv: req.argv.clone(),
            started_at: crate::spec::now_ms(),
            end: Mutex::new(None),
            ended: Condvar::new(),
        });
        procs.insert(id, proc.clone());
        Ok((proc, SpawnedOutput::events_only(id, rx)))
    }

    /// The host pid of its process `pid` (of its PID namespace): the one in
    /// its cgroup whose `NSpid` ends with it.
    fn host_pid(&self, pid: i32) -> Option<i32> {
        self.cgroup.procs().into_iter().find_map(|h| {
            let host = i32::try_from(h).ok()?;
            let status = procfs::process::Process::new(host).ok()?.status().ok()?;
            (status.nspid?.last() == Some(&pid)).then_some(host)
        })
    }

    pub fn process(&self, id: u64) -> Option<Arc<Proc>> {
        self.procs.lock().unwrap_or_else(|e| e.into_inner()).get(&id).cloned()
    }

    /// Its processes, oldest first.
    pub fn processes(&self) -> Vec<Arc<Proc>> {
        self.procs.lock().unwrap_or_else(|e| e.into_inner()).values().cloned().collect()
    }

    /// Drop an ended process from the table.
    pub fn forget_process(&self, id: u64) -> Result<(), Forget> {
        let mut procs = self.procs.lock().unwrap_or_else(|e| e.into_inner());
        match procs.get(&id) {
            None => Err(Forget::Unknown),
            Some(p) if p.end().is_none() => Err(Forget::Running),
            Some(_) => {
                procs.remove(&id);
                Ok(())
            }
        }
    }
}
