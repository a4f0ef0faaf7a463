//! `exec`: a command in a live sandbox, buffered, streamed or attached,
//! and `follow` of one still running.

use std::sync::Arc;

use crate::sandbox::{self, Sandbox};

use super::{Daemon, RunExec, SandboxOpError};

impl Daemon {
    /// Run a command in a sandbox to completion, its output buffered, and
    /// log it.
    pub fn exec(
        &self,
        sb: &Sandbox,
        req: &sandbox::ExecRequest,
        stdin: Vec<u8>,
    ) -> Result<sandbox::ExecOutput, SandboxOpError> {
        self.exec_with(sb, req, stdin, &mut |sb, req, stdin| sb.exec_buffered(req, stdin))
    }

    /// [`Daemon::exec`], the command started and waited for by `run` (the
    /// API's server waits on its async worker for a while before it hands
    /// the worker's other tasks to another thread: `api::serve`).
    pub fn exec_with(
        &self,
        sb: &Sandbox,
        req: &sandbox::ExecRequest,
        stdin: Vec<u8>,
        run: &mut RunExec<'_>,
    ) -> Result<sandbox::ExecOutput, SandboxOpError> {
        let _busy = sb.busy();
        let req = &sandbox::ExecRequest { keep_output: self.cfg.keep_output, ..req.clone() };
        let out = run(sb, req, stdin)?;
        self.record_exec(sb, req, &out.summary);
        Ok(out)
    }

    /// Run a command in a sandbox attached to `conn` (the exec stream
    /// protocol); `started` is called once it runs, before any frame. The
    /// command is logged when it ends, before its exit frame is sent.
    pub fn exec_attached(
        &self,
        sb: &Arc<Sandbox>,
        req: &sandbox::ExecRequest,
        conn: std::os::unix::net::UnixStream,
        started: impl FnOnce(&mut std::os::unix::net::UnixStream) -> std::io::Result<()>,
    ) -> Result<(), SandboxOpError> {
        let _busy = sb.busy();
        let req = &sandbox::ExecRequest { keep_output: self.cfg.keep_output, ..req.clone() };
        sb.exec_attached(req, conn, started, &mut |summary| self.record_exec(sb, req, summary))?;
        Ok(())
    }

    /// Follow a command [`Sandbox::spawn`] left running (E2B's processes):
    /// its output to `sink` until it ends (or `timeout` kills it), then
    /// log it. The sandbox counts as busy meanwhile.
    pub fn follow(
        &self,
        sb: &Sandbox,
        req: &sandbox::ExecRequest,
        output: sandbox::SpawnedOutput,
        timeout: Option<std::time::Duration>,
        sink: &mut dyn FnMut(crate::stream::FrameKind, &[u8]),
    ) -> Result<(strata_shim::proto::ExitStatus, bool), SandboxOpError> {
        let _busy = sb.busy();
        let (started_at, start) = (std::time::SystemTime::now(), std::time::Instant::now());
        let (mut kept, mut output_bytes) = (crate::model::KeptOutput::default(), 0u64);
        let (status, timed_out) = sb.follow(output, timeout, &mut |kind, data| {
            output_bytes += data.len() as u64;
            kept.keep(self.cfg.keep_output, kind == crate::stream::FrameKind::Stdout, data);
            sink(kind, data);
            true
        })?;
        let summary = sandbox::ExecSummary { status, started_at, duration: start.elapsed(), output_bytes, kept };
        self.record_exec(sb, req, &summary);
        Ok((status, timed_out))
    }
}
