//! Capture workers: the work a checkpoint does on a sandbox's data
//! (compressing its blob, hydrating its layer: hashing, copying, writing
//! files) runs in a process of its own, `strata worker`, placed in the
//! sandbox's capture cgroup (`<sandbox cgroup>.capture`, with the
//! sandbox's CPU quota) before it reads anything. So what a sandbox makes
//! the daemon do is charged to the sandbox's account and bounded by its
//! quota, not taken from the daemon's; and a sandbox that goes away takes
//! its workers with it (killed, by pid, when [`Gone`] is set).
//!
//! Why a process and not a daemon thread in that cgroup: cgroup v2 keeps
//! every thread of a process in one domain cgroup (only a threaded subtree
//! the daemon itself would have to live in may split them), and v1's
//! per-thread placement has no v2 equivalent.
//!
//! How it gets there: it is born there rather than moved by pid (see
//! `cgroups::Join`): on cgroup v1 the worker joins by itself, first thing
//! (`STRATA_WORKER_JOIN` names the `tasks` files); on v2 `clone3` starts
//! it in the cgroup (`sys::spawn_program`), or where that cannot be used,
//! the daemon moves it by pid before it writes its job.
//!
//! The protocol, on the worker's stdin and stdout: one JSON [`Job`] line
//! in, read only once the worker is in its cgroup (then, for
//! [`Job::Compress`], the data to compress until EOF); one JSON [`Reply`]
//! line out. The worker dies with the daemon (`PDEATHSIG`); what
//! it leaves under `tmp/` is swept at the next start.

use std::io::{BufRead, Read, Write};
use std::os::fd::AsFd;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::oci::UnpackStats;
use crate::sandbox::cgroups::Join;
use crate::sandbox::{Gone, Segment};
use crate::store::diff::DeltaStats;
use crate::store::BlobCompression;

/// What a worker is asked to do.
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "job")]
pub enum Job {
    /// Compress stdin into the new file `out` (`store::compress_with`).
    Compress { compression: BlobCompression, out: PathBuf, fsync: bool },
    /// Unpack a finished capture's tar into `dest` (`oci::unpack_capture`),
    /// taking the pre-copied files of `segments` as they are.
    Unpack { tar: PathBuf, segments: Vec<SegmentJob>, dest: PathBuf },
    /// Serialise the layer tree `fs` as a tar straight into a new zstd
    /// blob `out`, fsynced (a suspended snapshot's seal).
    Seal { fs: PathBuf, out: PathBuf },
}

/// A [`Segment`] as a worker is told it.
#[derive(Debug, Serialize, Deserialize)]
pub struct SegmentJob {
    pub offset: u64,
    pub len: u64,
    pub path: PathBuf,
}

/// What a worker answers.
#[derive(Debug, Serialize, Deserialize)]
pub struct Reply {
    pub result: Result<Done, Failed>,
    /// CPU time the worker used (user + system), in milliseconds.
    pub cpu_ms: f64,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Done {
    Compressed { hex: String, size: u64 },
    Unpacked { entries: u64, bytes: u64, tar_bytes: u64, diff_id: String },
    Sealed { stats: DeltaStats, diff_id: String, hex: String, size: u64 },
}

/// A job that failed, as the daemon needs to tell it on.
#[derive(Debug, Clone, Serialize, Deserialize, thiserror::Error)]
#[error("{message}")]
pub struct Failed {
    pub message: String,
    /// The data was refused (a layer may not hold it), not the host.
    pub content: bool,
    /// The host's errno, when a system call failed.
    pub errno: Option<i32>,
}

#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error("start capture worker")]
    Spawn(#[source] std::io::Error),
    #[error("place capture worker in its cgroup")]
    Place(#[source] crate::sandbox::SandboxError),
    #[error("talk to capture worker")]
    Pipe(#[source] std::io::Error),
    #[error("feed capture worker")]
    Feed(#[source] std::io::Error),
    #[error("the sandbox is being removed or suspended")]
    Gone,
    #[error("capture worker ended without an answer ({status})")]
    Died { status: String },
    #[error("capture worker answered {0:?}")]
    Garbled(String),
    #[error(transparent)]
    Failed(#[from] Failed),
}

impl WorkerError {
    /// The host's error number behind it, if a system call failed.
    pub fn errno(&self) -> Option<i32> {
        match self {
            WorkerError::Failed(f) => f.errno,
            WorkerError::Spawn(e) | WorkerError::Pipe(e) | WorkerError::Feed(e) => io_errno(e),
            _ => None,
        }
    }
}

/// The pipe a worker is fed through, in bytes.
const PIPE_SIZE: i32 = 1 << 20;

/// Where a worker goes before it does its job (a capture cgroup).
pub trait Placement: Sync {
    /// Make sure the cgroup is there and may take a worker; how the worker
    /// is born in it (moving a process by pid waits for an RCU grace
    /// period: 10-15 ms of an idle host's checkpoint).
    fn prepare(&self) -> Result<Join, crate::sandbox::SandboxError>;
    /// Move the worker `pid` there ([`Join::ByPid`]).
    fn add(&self, pid: u32) -> Result<(), crate::sandbox::SandboxError>;
}

pub type Place<'a> = &'a dyn Placement;

/// A sandbox's capture workers go to its capture cgroup.
impl Placement for crate::sandbox::Sandbox {
    fn prepare(&self) -> Result<Join, crate::sandbox::SandboxError> {
        self.capture_join()
    }

    fn add(&self, pid: u32) -> Result<(), crate::sandbox::SandboxError> {
        self.place_worker(pid)
    }
}

impl Placement for crate::sandbox::cgroups::SandboxCgroup {
    fn prepare(&self) -> Result<Join, crate::sandbox::SandboxError> {
        self.join().map_err(crate::sandbox::SandboxError::Cgroup)
    }

    fn add(&self, pid: u32) -> Result<(), crate::sandbox::SandboxError> {
        crate::sandbox::cgroups::SandboxCgroup::add(self, pid).map_err(crate::sandbox::SandboxError::Cgroup)
    }
}

/// The environment variable that names the `tasks` files a worker joins
/// (one per line).
const JOIN_ENV: &str = "STRATA_WORKER_JOIN";

/// A started worker, told its job (which it reads only once in its cgroup).
pub struct Worker {
    pid: nix::unistd::Pid,
    /// Until it is reaped.
    running: bool,
    stdin: Option<std::fs::File>,
    stdout: Option<std::fs::File>,
    gone: Gone,
}

impl Worker {
    fn start(job: &Job, place: Place<'_>, gone: &Gone) -> Result<Worker, WorkerError> {
        let join = place.prepare().map_err(WorkerError::Place)?;
        let mut tasks = std::ffi::OsString::new();
        if let Join::Tasks(files) = &join {
            for (i, t) in files.iter().enumerate() {
                if i > 0 {
                    tasks.push("\n");
                }
                tasks.push(t);
            }
        }
        // The daemon's own binary (only `strata` runs a daemon), by the
        // kernel's link: still right if the file was replaced meanwhile;
        // the daemon's environment, and the `tasks` files to join.
        let spawn = |e: std::io::Error| WorkerError::Spawn(e);
        let cstring = |s: &std::ffi::OsStr| std::ffi::CString::new(s.as_bytes()).map_err(|e| spawn(e.into()));
        let mut env = Vec::new();
        for (k, v) in std::env::vars_os().filter(|(k, _)| k != JOIN_ENV) {
            env.push(cstring(&[k.as_os_str(), v.as_os_str()].join(std::ffi::OsStr::new("=")))?);
        }
        env.push(cstring(&[std::ffi::OsStr::new(JOIN_ENV), tasks.as_os_str()].join(std::ffi::OsStr::new("=")))?);
        let args = strata_shim::sys::ExecArgs::new(vec![c"strata".into(), c"worker".into()], env);
        let pipe = || nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(|e| spawn(e.into()));
        let ((stdin_r, stdin_w), (stdout_r, stdout_w)) = (pipe()?, pipe()?);
        let dir = match &join {
            Join::Dir(d) => Some(d.as_fd()),
            _ => None,
        };
        let stderr = std::io::stderr();
        let stdio = [stdin_r.as_fd(), stdout_w.as_fd(), stderr.as_fd()];
        let spawned =
            strata_shim::sys::spawn_program(c"/proc/self/exe", &args, stdio, dir).map_err(|e| spawn(e.into()))?;
        drop((stdin_r, stdout_w));
        // Fewer, larger writes when feeding a compressor (the default pipe
        // holds 64 KiB); best effort (capped by pipe-max-size).
        let _ =
            nix::fcntl::fcntl(std::os::fd::AsRawFd::as_raw_fd(&stdin_w), nix::fcntl::FcntlArg::F_SETPIPE_SZ(PIPE_SIZE));
        let mut w = Worker {
            pid: nix::unistd::Pid::from_raw(spawned.pid),
            running: true,
            stdin: Some(stdin_w.into()),
            stdout: Some(stdout_r.into()),
            gone: gone.clone(),
        };
        if let Join::ByPid = join {
            place.add(spawned.pid as u32).map_err(WorkerError::Place)?;
        }
        let mut line = serde_json::to_vec(job).map_err(|e| WorkerError::Pipe(e.into()))?;
        line.push(b'\n');
        match w.stdin()?.write_all(&line) {
            // It ended before its job (it could not join its cgroup, say):
            // its answer says why (`finish`).
            Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {}
            r => r.map_err(WorkerError::Pipe)?,
        }
        Ok(w)
    }

    fn stdin(&mut self) -> Result<&mut std::fs::File, WorkerError> {
        self.stdin.as_mut().ok_or_else(|| WorkerError::Pipe(std::io::ErrorKind::BrokenPipe.into()))
    }

    /// Reap it: how it ended.
    fn wait(&mut self) -> Result<String, WorkerError> {
        loop {
            match nix::sys::wait::waitpid(self.pid, None) {
                Err(nix::Error::EINTR) => continue,
                Err(e) => return Err(WorkerError::Pipe(e.into())),
                Ok(status) => {
                    self.running = false;
                    return Ok(match status {
                        nix::sys::wait::WaitStatus::Exited(_, code) => format!("exit status: {code}"),
                        nix::sys::wait::WaitStatus::Signaled(_, sig, _) => format!("signal: {sig}"),
                        other => format!("{other:?}"),
                    });
                }
            }
        }
    }

    /// Close its stdin and wait for its answer, checking meanwhile whether
    /// the sandbox went away (then it is killed).
    fn finish(mut self) -> Result<Reply, WorkerError> {
        drop(self.stdin.take());
        let mut out = self.stdout.take().ok_or_else(|| WorkerError::Garbled(String::new()))?;
        loop {
            if self.gone.is_set() {
                return Err(WorkerError::Gone);
            }
            let mut fds = [nix::poll::PollFd::new(out.as_fd(), nix::poll::PollFlags::POLLIN)];
            match nix::poll::poll(&mut fds, nix::poll::PollTimeout::from(20u8)) {
                Ok(0) | Err(nix::Error::EINTR) => continue,
                Ok(_) => break,
                Err(e) => return Err(WorkerError::Pipe(e.into())),
            }
        }
        let mut text = String::new();
        let read = out.read_to_string(&mut text);
        let status = self.wait()?;
        read.map_err(WorkerError::Pipe)?;
        if text.is_empty() {
            return Err(WorkerError::Died { status });
        }
        serde_json::from_str(text.trim_end()).map_err(|_| WorkerError::Garbled(text))
    }
}

impl Drop for Worker {
    /// One that was not finished (an error, the sandbox gone) is killed
    /// and reaped: its own pid (not reaped yet, so not reused), nothing
    /// else.
    fn drop(&mut self) {
        if self.running {
            let _ = nix::sys::signal::kill(self.pid, nix::sys::signal::SIGKILL);
            let _ = self.wait();
        }
    }
}

/// Compress what `input` reads (until EOF) into the new file `out`, in a
/// worker placed by `place`. Returns the file's sha256 hex and size, and
/// the worker's CPU time.
pub fn compress(
    input: &mut dyn Read,
    compression: BlobCompression,
    out: &Path,
    fsync: bool,
    place: Place<'_>,
    gone: &Gone,
) -> Result<((String, u64), Duration), WorkerError> {
    let mut w = Worker::start(&Job::Compress { compression, out: out.to_path_buf(), fsync }, place, gone)?;
    let fed = std::io::copy(input, w.stdin()?);
    if gone.is_set() {
        return Err(WorkerError::Gone);
    }
    match fed {
        Ok(_) => {}
        // It died: its answer (if any) or its status says why.
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {}
        Err(e) => return Err(WorkerError::Feed(e)),
    }
    match w.finish()? {
        Reply { result: Ok(Done::Compressed { hex, size }), cpu_ms } => Ok(((hex, size), ms(cpu_ms))),
        Reply { result: Err(f), .. } => Err(f.into()),
        r => Err(WorkerError::Garbled(format!("{r:?}"))),
    }
}

/// Unpack a finished capture (its tar, with the pre-copied files of
/// `segments`) into `dest`, in a worker placed by `place`. Returns what
/// was unpacked, the tar's sha256 hex (its diff_id) and the worker's CPU.
pub fn unpack(
    tar: &Path,
    segments: &[Segment],
    dest: &Path,
    place: Place<'_>,
    gone: &Gone,
) -> Result<(UnpackStats, String, Duration), WorkerError> {
    let segments =
        segments.iter().map(|s| SegmentJob { offset: s.offset, len: s.len, path: s.copy.path.to_path_buf() }).collect();
    let w = Worker::start(&Job::Unpack { tar: tar.to_path_buf(), segments, dest: dest.to_path_buf() }, place, gone)?;
    match w.finish()? {
        Reply { result: Ok(Done::Unpacked { entries, bytes, tar_bytes, diff_id }), cpu_ms } => {
            Ok((UnpackStats { entries, bytes, tar_bytes }, diff_id, ms(cpu_ms)))
        }
        Reply { result: Err(f), .. } => Err(f.into()),
        r => Err(WorkerError::Garbled(format!("{r:?}"))),
    }
}

/// What [`seal`] made: the tar's statistics and sha256 hex (diff_id), the
/// blob's sha256 hex and size.
pub type SealedBlob = (DeltaStats, String, String, u64);

/// Serialise the layer tree `fs` into the new zstd blob file `out`
/// (fsynced), in a worker placed by `place`. Returns what it made and the
/// worker's CPU time.
pub fn seal(fs: &Path, out: &Path, place: Place<'_>) -> Result<(SealedBlob, Duration), WorkerError> {
    let w = Worker::start(&Job::Seal { fs: fs.to_path_buf(), out: out.to_path_buf() }, place, &Gone::default())?;
    match w.finish()? {
        Reply { result: Ok(Done::Sealed { stats, diff_id, hex, size }), cpu_ms } => {
            Ok(((stats, diff_id, hex, size), ms(cpu_ms)))
        }
        Reply { result: Err(f), .. } => Err(f.into()),
        r => Err(WorkerError::Garbled(format!("{r:?}"))),
    }
}

fn ms(v: f64) -> Duration {
    Duration::from_secs_f64(v.max(0.0) / 1000.0)
}

/// `strata worker`: read one job, do it, answer. Returns the exit code.
pub fn main() -> i32 {
    // Never outlive the daemon that placed it (a daemon killed meanwhile
    // closes stdin too, which ends a worker still waiting for its job).
    let _ = nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL);
    // Into the capture cgroup before anything is read (see `Placement`):
    // "0" is the calling thread, this process's only one so far.
    let join = std::env::var_os(JOIN_ENV).unwrap_or_default();
    for tasks in join.as_encoded_bytes().split(|b| *b == b'\n').filter(|t| !t.is_empty()) {
        let tasks = Path::new(std::ffi::OsStr::from_bytes(tasks));
        let joined = match crate::failpoint::fails("worker:join") {
            true => Err(std::io::Error::other("failpoint worker:join")),
            false => std::fs::write(tasks, "0"),
        };
        if let Err(e) = joined {
            let message = format!("join capture cgroup ({}): {e}", tasks.display());
            let result = Err(Failed { message, content: false, errno: e.raw_os_error() });
            return answer(&Reply { result, cpu_ms: cpu_ms() });
        }
    }
    let stdin = std::io::stdin();
    let mut input = stdin.lock();
    let mut line = String::new();
    let result = match input.read_line(&mut line) {
        Ok(0) => return 2,
        Ok(_) => match serde_json::from_str::<Job>(&line) {
            Ok(job) => run(job, &mut input),
            Err(e) => Err(Failed { message: format!("bad job: {e}"), content: false, errno: None }),
        },
        Err(_) => return 2,
    };
    answer(&Reply { result, cpu_ms: cpu_ms() })
}

/// Write `reply` on stdout; the exit code.
fn answer(reply: &Reply) -> i32 {
    let mut out = std::io::stdout().lock();
    let written =
        serde_json::to_writer(&mut out, reply).map_err(std::io::Error::from).and_then(|()| out.write_all(b"\n"));
    match (written, &reply.result) {
        (Ok(()), Ok(_)) => 0,
        _ => 1,
    }
}

fn run(job: Job, input: &mut dyn Read) -> Result<Done, Failed> {
    match job {
        Job::Compress { compression, out, fsync } => {
            crate::store::compress_with(compression, &out, fsync, |w| std::io::copy(input, w))
                .map(|(_, hex, size)| Done::Compressed { hex, size })
                .map_err(|e| {
                    let _ = std::fs::remove_file(&out);
                    Failed { message: crate::error::chain(&e), content: false, errno: e.raw_os_error() }
                })
        }
        Job::Unpack { tar, segments, dest } => {
            let io = |e: std::io::Error| Failed {
                message: crate::error::chain(&e),
                content: false,
                errno: e.raw_os_error(),
            };
            let parts: Vec<Segment> = segments
                .into_iter()
                .map(|s| Segment {
                    offset: s.offset,
                    len: s.len,
                    copy: crate::sandbox::PreCopy { path: s.path.into() },
                })
                .collect();
            let prepared = |offset: u64, len: u64| crate::sandbox::prepared_in(&parts, offset, len);
            let follower = crate::sandbox::TarFollower::of_file(&tar, parts.clone()).map_err(io)?;
            let (stats, diff_id) = crate::oci::unpack_capture(follower, &prepared, &dest).map_err(|e| Failed {
                message: crate::error::chain(&e),
                content: !e.is_io(),
                errno: io_errno(&e),
            })?;
            Ok(Done::Unpacked {
                entries: stats.entries,
                bytes: stats.bytes,
                tar_bytes: stats.tar_bytes,
                diff_id: diff_id.hex().to_string(),
            })
        }
        Job::Seal { fs, out } => {
            let written = crate::store::compress_with(BlobCompression::Zstd, &out, true, |w| {
                crate::store::diff::write_delta(&fs, w).map_err(std::io::Error::other)
            });
            match written {
                Ok(((stats, diff_id), hex, size)) => Ok(Done::Sealed { stats, diff_id, hex, size }),
                Err(e) => {
                    let _ = std::fs::remove_file(&out);
                    let diff = e.get_ref().and_then(|i| i.downcast_ref::<crate::store::diff::DiffError>());
                    let content = diff.is_some_and(|d| d.is_content());
                    Err(Failed { message: crate::error::chain(&e), content, errno: io_errno(&e) })
                }
            }
        }
    }
}

/// The errno of the first I/O error in `e`'s chain.
fn io_errno(e: &(dyn std::error::Error + 'static)) -> Option<i32> {
    let mut cur = Some(e);
    while let Some(c) = cur {
        if let Some(errno) = c.downcast_ref::<std::io::Error>().and_then(|io| io.raw_os_error()) {
            return Some(errno);
        }
        cur = c.source();
    }
    None
}

fn cpu_ms() -> f64 {
    let tv = |t: nix::sys::time::TimeVal| t.tv_sec() as f64 * 1000.0 + t.tv_usec() as f64 / 1000.0;
    nix::sys::resource::getrusage(nix::sys::resource::UsageWho::RUSAGE_SELF)
        .map_or(0.0, |u| tv(u.user_time()) + tv(u.system_time()))
}
