//! The shim's two halves: the `start`/`delete` handshake containerd runs
//! it with ([`Service`]), and the Task service it then serves over ttrpc
//! ([`Tasks`]). Each task is a Strata sandbox on the bundle's root (the
//! snapshotter's mounts, mounted at `<bundle>/rootfs` as runc's shim does),
//! made through the daemon's API; its process and execs are the daemon's
//! processes with containerd's FIFOs as their stdio. What this shim keeps
//! is only which sandbox and processes are its task's, and their ends
//! (a thread per process waits for it through the daemon).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use containerd_shim::api::{self, Status};
use containerd_shim::event::Event;
use containerd_shim::protos::cgroups::metrics::{CPUStat, CPUUsage, MemoryEntry, MemoryStat, Metrics, PidsStat};
use containerd_shim::protos::events::task::{
    TaskCreate, TaskDelete, TaskExecAdded, TaskExecStarted, TaskExit, TaskIO, TaskPaused, TaskResumed, TaskStart,
};
use containerd_shim::protos::protobuf::well_known_types::timestamp::Timestamp;
use containerd_shim::protos::protobuf::{MessageDyn, MessageField};
use containerd_shim::publisher::RemotePublisher;
use containerd_shim::{
    Config, Context, DeleteResponse, Error, ExitSignal, Flags, StartOpts, TtrpcContext, TtrpcResult,
};
use serde_json::{json, Value};
use strata::client::{Client, ClientError};
use strata::types::{ProcessInfo, SandboxInfo, SandboxMetrics};

use crate::spec::{self, Command};

/// The runtime name containerd knows this shim by (`--runtime`, a
/// RuntimeClass's handler): the binary is `containerd-shim-strata-v2`.
pub const RUNTIME: &str = "io.containerd.strata.v2";

/// The file in a task's bundle naming its sandbox, for a `delete` after
/// this shim died.
const SANDBOX_FILE: &str = "strata-sandbox";

/// How long one wait asks the daemon for (its maximum); a waiter asks again.
const WAIT_SECS: u64 = 60;

/// The daemon's socket: `STRATA_SOCKET` (containerd's environment, which
/// its shims inherit), else the daemon's default.
fn socket() -> PathBuf {
    std::env::var_os("STRATA_SOCKET").map_or_else(|| strata::cli::DEFAULT_SOCKET.into(), PathBuf::from)
}

/// A daemon error as containerd's: its 404, 400 and 409 keep their meaning.
fn daemon_err(what: &str, e: ClientError) -> Error {
    let msg = format!("{what}: {e}");
    match e.status() {
        Some(404) => Error::NotFoundError(msg),
        Some(400) => Error::InvalidArgument(msg),
        Some(409) => Error::FailedPreconditionError(msg),
        _ => Error::Other(msg),
    }
}

/// One call to the daemon (a connection each: calls come from many
/// threads, and a wait holds its connection).
fn call<T: serde::de::DeserializeOwned>(method: &str, path: &str, body: Option<&Value>) -> Result<T, Error> {
    let what = format!("{method} {path}");
    let mut c = Client::connect(&socket()).map_err(|e| daemon_err(&what, e))?;
    c.call(method, path, body).map_err(|e| daemon_err(&what, e))
}

fn call_empty(method: &str, path: &str, body: Option<&Value>) -> Result<(), Error> {
    let what = format!("{method} {path}");
    let mut c = Client::connect(&socket()).map_err(|e| daemon_err(&what, e))?;
    c.request(method, path, body).map(drop).map_err(|e| daemon_err(&what, e))
}

fn ms_timestamp(ms: i64) -> Timestamp {
    Timestamp { seconds: ms.div_euclid(1000), nanos: (ms.rem_euclid(1000) * 1_000_000) as i32, ..Default::default() }
}

/// A task's process (the init one has exec id `""`).
struct Proc {
    exec_id: String,
    command: Command,
    stdin: String,
    stdout: String,
    stderr: String,
    state: Mutex<ProcState>,
    changed: Condvar,
}

#[derive(Default, Clone)]
struct ProcState {
    /// Once started: its number in the sandbox's processes and its host pid.
    started: Option<(u64, u32)>,
    /// Once ended: exit status and when.
    exit: Option<(u32, Timestamp)>,
}

impl Proc {
    fn state(&self) -> ProcState {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn finish(&self, status: u32, at: Timestamp) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if s.exit.is_none() {
            s.exit = Some((status, at));
            self.changed.notify_all();
        }
    }

    fn wait(&self) -> (u32, Timestamp) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(e) = &s.exit {
                return e.clone();
            }
            s = self.changed.wait(s).unwrap_or_else(|e| e.into_inner());
        }
    }
}

/// A task: its sandbox and processes.
struct Task {
    sandbox: String,
    bundle: PathBuf,
    /// The snapshotter's mounts this shim mounted at `<bundle>/rootfs`.
    mounted: bool,
    /// The sandbox's init (the strata-shim), its pid before the task starts.
    shim_pid: u32,
    /// Paused (frozen) by a Pause, until a Resume.
    paused: bool,
    procs: HashMap<String, Arc<Proc>>,
}

/// The `start`/`delete` half.
pub struct Service {
    exit: Arc<ExitSignal>,
    namespace: String,
    bundle: String,
}

impl containerd_shim::Shim for Service {
    type T = Tasks;

    fn new(_runtime_id: &str, args: &Flags, _config: &mut Config) -> Self {
        Service {
            exit: Arc::new(ExitSignal::default()),
            namespace: args.namespace.clone(),
            bundle: args.bundle.clone(),
        }
    }

    fn start_shim(&mut self, opts: StartOpts) -> Result<String, Error> {
        let grouping = opts.id.clone();
        let (_pid, address) = containerd_shim::spawn(opts, &grouping, Vec::new())?;
        // containerd reads it back to reconnect after a restart; the
        // server reads it at shutdown to remove the socket.
        containerd_shim::util::write_address(&address)?;
        Ok(address)
    }

    /// After a shim died: remove the sandbox its bundle names, unmount the
    /// root it mounted.
    fn delete_shim(&mut self) -> Result<DeleteResponse, Error> {
        let bundle = match self.bundle.as_str() {
            // containerd runs `delete` in the bundle.
            "" => std::env::current_dir().map_err(|e| Error::Other(format!("the bundle (cwd): {e}")))?,
            b => PathBuf::from(b),
        };
        if let Ok(id) = std::fs::read_to_string(bundle.join(SANDBOX_FILE)) {
            if let Err(e) = call_empty("DELETE", &format!("/v1/sandboxes/{}?wait=true", id.trim()), None) {
                eprintln!("remove sandbox {}: {e}", id.trim());
            }
            let _ = std::fs::remove_file(bundle.join(SANDBOX_FILE));
        }
        unmount_root(&bundle);
        Ok(DeleteResponse {
            exit_status: 128 + libc::SIGKILL as u32,
            exited_at: MessageField::some(containerd_shim::util::timestamp()?),
            ..Default::default()
        })
    }

    fn wait(&mut self) {
        self.exit.wait();
    }

    fn create_task_service(&self, publisher: RemotePublisher) -> Tasks {
        let (tx, rx) = channel::<(String, Box<dyn MessageDyn>)>();
        let namespace = self.namespace.clone();
        // Events go out in order, off the request path.
        std::thread::spawn(move || {
            for (topic, event) in rx {
                if let Err(e) = publisher.publish(Context::default(), &topic, &namespace, event) {
                    log::warn!("publish {topic} to containerd: {e}");
                }
            }
        });
        Tasks {
            inner: Arc::new(Inner { tasks: Mutex::new(HashMap::new()), events: Mutex::new(tx) }),
            exit: self.exit.clone(),
        }
    }
}

/// Unmount `<bundle>/rootfs` if this shim mounted something there.
fn unmount_root(bundle: &Path) {
    let root = bundle.join("rootfs");
    if let Some(r) = root.to_str() {
        let _ = containerd_shim::mount::umount_recursive(Some(r), libc::MNT_DETACH);
    }
}

struct Inner {
    tasks: Mutex<HashMap<String, Task>>,
    events: Mutex<Sender<(String, Box<dyn MessageDyn>)>>,
}

impl Inner {
    fn publish<E: Event + 'static>(&self, e: E) {
        let _ = self.events.lock().unwrap_or_else(|e| e.into_inner()).send((e.topic(), Box::new(e)));
    }

    fn with_task<T>(&self, id: &str, f: impl FnOnce(&mut Task) -> Result<T, Error>) -> Result<T, Error> {
        let mut tasks = self.tasks.lock().unwrap_or_else(|e| e.into_inner());
        let t = tasks.get_mut(id).ok_or_else(|| Error::NotFoundError(format!("task {id}")))?;
        f(t)
    }

    /// The sandbox of task `id`.
    fn sandbox(&self, id: &str) -> Result<String, Error> {
        self.with_task(id, |t| Ok(t.sandbox.clone()))
    }

    /// Freeze or thaw task `id`'s sandbox, and say so.
    fn set_paused(&self, id: &str, paused: bool) -> Result<(), Error> {
        let sandbox = self.sandbox(id)?;
        let verb = if paused { "pause" } else { "unpause" };
        call_empty("POST", &format!("/v1/sandboxes/{sandbox}/{verb}"), None)?;
        self.with_task(id, |t| {
            t.paused = paused;
            Ok(())
        })?;
        let container_id = id.to_string();
        if paused {
            self.publish(TaskPaused { container_id, ..Default::default() });
        } else {
            self.publish(TaskResumed { container_id, ..Default::default() });
        }
        Ok(())
    }

    fn proc(&self, id: &str, exec_id: &str) -> Result<(String, Arc<Proc>), Error> {
        self.with_task(id, |t| {
            let p = t.procs.get(exec_id).ok_or_else(|| Error::NotFoundError(format!("process {exec_id:?} of {id}")))?;
            Ok((t.sandbox.clone(), p.clone()))
        })
    }
}

/// The Task service.
#[derive(Clone)]
pub struct Tasks {
    inner: Arc<Inner>,
    exit: Arc<ExitSignal>,
}

impl Tasks {
    fn create_task(&self, req: &api::CreateTaskRequest) -> Result<api::CreateTaskResponse, Error> {
        if req.terminal {
            return Err(Error::InvalidArgument(spec::SpecError::Terminal.to_string()));
        }
        let bundle = PathBuf::from(&req.bundle);
        let oci = oci_spec::runtime::Spec::load(bundle.join("config.json"))
            .map_err(|e| Error::InvalidArgument(format!("{}: {e}", bundle.join("config.json").display())))?;
        let command = spec::task_command(&oci).map_err(|e| Error::InvalidArgument(e.to_string()))?;
        // The snapshotter's mounts, at <bundle>/rootfs; none: the spec's
        // root as it is (`ctr run --rootfs`).
        let mounted = !req.rootfs.is_empty();
        let root = if mounted {
            let target = bundle.join("rootfs");
            for m in &req.rootfs {
                if let Err(e) =
                    containerd_shim::mount::mount_rootfs(Some(&m.type_), Some(&m.source), &m.options, &target)
                {
                    unmount_root(&bundle);
                    return Err(e);
                }
            }
            target
        } else {
            spec::root_path(&oci, &bundle)
        };
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        let body = spec::create_request(&oci, &root, cpus);
        let sb: SandboxInfo = match call("POST", "/v1/sandboxes", Some(&body)) {
            Ok(sb) => sb,
            Err(e) => {
                if mounted {
                    unmount_root(&bundle);
                }
                return Err(e);
            }
        };
        if let Err(e) = std::fs::write(bundle.join(SANDBOX_FILE), &sb.id) {
            log::warn!("{}: {e}; a delete after a crash will not find sandbox {}", bundle.display(), sb.id);
        }
        let shim_pid = sb.shim_pid as u32;
        let init = Arc::new(Proc {
            exec_id: String::new(),
            command,
            stdin: req.stdin.clone(),
            stdout: req.stdout.clone(),
            stderr: req.stderr.clone(),
            state: Mutex::default(),
            changed: Condvar::new(),
        });
        let task = Task {
            sandbox: sb.id.clone(),
            bundle,
            mounted,
            shim_pid,
            paused: false,
            procs: HashMap::from([(String::new(), init)]),
        };
        self.inner.tasks.lock().unwrap_or_else(|e| e.into_inner()).insert(req.id.clone(), task);
        log::info!("task {}: sandbox {}", req.id, sb.id);
        self.inner.publish(TaskCreate {
            container_id: req.id.clone(),
            bundle: req.bundle.clone(),
            rootfs: req.rootfs.clone(),
            io: MessageField::some(TaskIO {
                stdin: req.stdin.clone(),
                stdout: req.stdout.clone(),
                stderr: req.stderr.clone(),
                terminal: false,
                ..Default::default()
            }),
            pid: shim_pid,
            ..Default::default()
        });
        Ok(api::CreateTaskResponse { pid: shim_pid, ..Default::default() })
    }

    fn start_proc(&self, id: &str, exec_id: &str) -> Result<u32, Error> {
        let (sandbox, p) = self.inner.proc(id, exec_id)?;
        if p.state().started.is_some() {
            return Err(Error::FailedPreconditionError(format!("process {exec_id:?} of {id} has started already")));
        }
        let body = p.command.request(&p.stdin, &p.stdout, &p.stderr);
        let info: ProcessInfo = call("POST", &format!("/v1/sandboxes/{sandbox}/processes"), Some(&body))?;
        let pid = info.host_pid.unwrap_or(info.pid) as u32;
        p.state.lock().unwrap_or_else(|e| e.into_inner()).started = Some((info.id, pid));
        // Its end, through the daemon.
        let (inner, id_, n) = (self.inner.clone(), id.to_string(), info.id);
        let proc = p.clone();
        std::thread::spawn(move || {
            let path = format!("/v1/sandboxes/{sandbox}/processes/{n}?wait={WAIT_SECS}");
            let (status, at) = loop {
                match call::<ProcessInfo>("GET", &path, None) {
                    Ok(i) if i.running => continue,
                    Ok(i) => break (i.exit_code.unwrap_or(0) as u32, ms_timestamp(i.exited_at.unwrap_or_default())),
                    // Its sandbox is gone (removed, its shim dead): killed.
                    Err(Error::NotFoundError(_)) => {
                        break (128 + libc::SIGKILL as u32, containerd_shim::util::timestamp().unwrap_or_default())
                    }
                    Err(e) => {
                        log::warn!("wait for process {n} of sandbox {sandbox}: {e}; asking again");
                        std::thread::sleep(Duration::from_secs(1));
                    }
                }
            };
            proc.finish(status, at.clone());
            inner.publish(TaskExit {
                container_id: id_.clone(),
                id: if proc.exec_id.is_empty() { id_ } else { proc.exec_id.clone() },
                pid,
                exit_status: status,
                exited_at: MessageField::some(at),
                ..Default::default()
            });
        });
        if exec_id.is_empty() {
            self.inner.publish(TaskStart { container_id: id.to_string(), pid, ..Default::default() });
        } else {
            self.inner.publish(TaskExecStarted {
                container_id: id.to_string(),
                exec_id: exec_id.to_string(),
                pid,
                ..Default::default()
            });
        }
        Ok(pid)
    }

    fn delete_proc(&self, id: &str, exec_id: &str) -> Result<api::DeleteResponse, Error> {
        let (sandbox, p) = self.inner.proc(id, exec_id)?;
        let state = p.state();
        if state.started.is_some() && state.exit.is_none() {
            return Err(Error::FailedPreconditionError(format!("process {exec_id:?} of {id} is running")));
        }
        let (status, at) = state.exit.unwrap_or_default();
        let pid = state.started.map_or(0, |(_, pid)| pid);
        if exec_id.is_empty() {
            // The task: its sandbox, its root, its record.
            let task = self.inner.tasks.lock().unwrap_or_else(|e| e.into_inner()).remove(id);
            if let Some(t) = task {
                match call_empty("DELETE", &format!("/v1/sandboxes/{}?wait=true", t.sandbox), None) {
                    Ok(()) | Err(Error::NotFoundError(_)) => {}
                    Err(e) => return Err(e),
                }
                if t.mounted {
                    unmount_root(&t.bundle);
                }
                let _ = std::fs::remove_file(t.bundle.join(SANDBOX_FILE));
            }
            self.inner.publish(TaskDelete {
                container_id: id.to_string(),
                pid,
                exit_status: status,
                exited_at: MessageField::some(at.clone()),
                id: id.to_string(),
                ..Default::default()
            });
        } else {
            if let Some((n, _)) = state.started {
                match call_empty("DELETE", &format!("/v1/sandboxes/{sandbox}/processes/{n}"), None) {
                    Ok(()) | Err(Error::NotFoundError(_)) => {}
                    Err(e) => return Err(e),
                }
            }
            self.inner.with_task(id, |t| Ok(t.procs.remove(exec_id)))?;
        }
        Ok(api::DeleteResponse { pid, exit_status: status, exited_at: MessageField::some(at), ..Default::default() })
    }
}

fn ttrpc<T>(r: Result<T, Error>) -> TtrpcResult<T> {
    r.map_err(|e| {
        log::warn!("{e}");
        e.into()
    })
}

impl containerd_shim::Task for Tasks {
    fn create(&self, _ctx: &TtrpcContext, req: api::CreateTaskRequest) -> TtrpcResult<api::CreateTaskResponse> {
        ttrpc(self.create_task(&req))
    }

    fn start(&self, _ctx: &TtrpcContext, req: api::StartRequest) -> TtrpcResult<api::StartResponse> {
        ttrpc(self.start_proc(&req.id, &req.exec_id).map(|pid| api::StartResponse { pid, ..Default::default() }))
    }

    fn delete(&self, _ctx: &TtrpcContext, req: api::DeleteRequest) -> TtrpcResult<api::DeleteResponse> {
        ttrpc(self.delete_proc(&req.id, &req.exec_id))
    }

    fn state(&self, _ctx: &TtrpcContext, req: api::StateRequest) -> TtrpcResult<api::StateResponse> {
        ttrpc((|| {
            let (bundle, shim_pid, paused) =
                self.inner.with_task(&req.id, |t| Ok((t.bundle.clone(), t.shim_pid, t.paused)))?;
            let (_, p) = self.inner.proc(&req.id, &req.exec_id)?;
            let s = p.state();
            let status = match (&s.started, &s.exit) {
                (_, Some(_)) => Status::STOPPED,
                (Some(_), None) if paused => Status::PAUSED,
                (Some(_), None) => Status::RUNNING,
                (None, None) => Status::CREATED,
            };
            let exit_status = s.exit.as_ref().map_or(0, |(status, _)| *status);
            Ok(api::StateResponse {
                id: req.id.clone(),
                bundle: bundle.display().to_string(),
                pid: s.started.map_or(if req.exec_id.is_empty() { shim_pid } else { 0 }, |(_, pid)| pid),
                status: status.into(),
                stdin: p.stdin.clone(),
                stdout: p.stdout.clone(),
                stderr: p.stderr.clone(),
                terminal: false,
                exit_status,
                exited_at: MessageField::from_option(s.exit.map(|(_, at)| at)),
                exec_id: req.exec_id.clone(),
                ..Default::default()
            })
        })())
    }

    fn pids(&self, _ctx: &TtrpcContext, req: api::PidsRequest) -> TtrpcResult<api::PidsResponse> {
        ttrpc((|| {
            let sandbox = self.inner.sandbox(&req.id)?;
            let procs: Vec<ProcessInfo> = call("GET", &format!("/v1/sandboxes/{sandbox}/processes"), None)?;
            let processes = procs
                .iter()
                .filter(|p| p.running)
                .map(|p| containerd_shim::protos::api::ProcessInfo {
                    pid: p.host_pid.unwrap_or(p.pid) as u32,
                    ..Default::default()
                })
                .collect();
            Ok(api::PidsResponse { processes, ..Default::default() })
        })())
    }

    fn pause(&self, _ctx: &TtrpcContext, req: api::PauseRequest) -> TtrpcResult<api::Empty> {
        ttrpc(self.inner.set_paused(&req.id, true).map(|()| api::Empty::new()))
    }

    fn resume(&self, _ctx: &TtrpcContext, req: api::ResumeRequest) -> TtrpcResult<api::Empty> {
        ttrpc(self.inner.set_paused(&req.id, false).map(|()| api::Empty::new()))
    }

    fn kill(&self, _ctx: &TtrpcContext, req: api::KillRequest) -> TtrpcResult<api::Empty> {
        ttrpc((|| {
            let (sandbox, p) = self.inner.proc(&req.id, &req.exec_id)?;
            let s = p.state();
            match (s.started, s.exit) {
                (_, Some(_)) => {
                    Err(Error::NotFoundError(format!("process {:?} of {} already finished", req.exec_id, req.id)))
                }
                // Never started: it ends here, as killed.
                (None, None) => {
                    p.finish(128 + req.signal, containerd_shim::util::timestamp()?);
                    Ok(api::Empty::new())
                }
                (Some((n, _)), None) => {
                    let body = json!({"signal": req.signal, "group": req.all});
                    call_empty("POST", &format!("/v1/sandboxes/{sandbox}/processes/{n}/signal"), Some(&body))?;
                    Ok(api::Empty::new())
                }
            }
        })())
    }

    fn exec(&self, _ctx: &TtrpcContext, req: api::ExecProcessRequest) -> TtrpcResult<api::Empty> {
        ttrpc((|| {
            if req.terminal {
                return Err(Error::InvalidArgument(spec::SpecError::Terminal.to_string()));
            }
            let json = req.spec.as_ref().map(|a| a.value.as_slice()).unwrap_or_default();
            let command = Command::of_json(json).map_err(|e| Error::InvalidArgument(e.to_string()))?;
            let proc = Arc::new(Proc {
                exec_id: req.exec_id.clone(),
                command,
                stdin: req.stdin.clone(),
                stdout: req.stdout.clone(),
                stderr: req.stderr.clone(),
                state: Mutex::default(),
                changed: Condvar::new(),
            });
            self.inner.with_task(&req.id, |t| {
                if t.procs.contains_key(&req.exec_id) {
                    return Err(Error::FailedPreconditionError(format!("exec {:?} exists", req.exec_id)));
                }
                t.procs.insert(req.exec_id.clone(), proc);
                Ok(())
            })?;
            self.inner.publish(TaskExecAdded {
                container_id: req.id.clone(),
                exec_id: req.exec_id.clone(),
                ..Default::default()
            });
            Ok(api::Empty::new())
        })())
    }

    fn resize_pty(&self, _ctx: &TtrpcContext, _req: api::ResizePtyRequest) -> TtrpcResult<api::Empty> {
        ttrpc(Err(Error::Unimplemented(spec::SpecError::Terminal.to_string())))
    }

    /// The FIFOs were handed to the process as they are: its stdin ends
    /// when containerd closes its end; nothing of ours holds one.
    fn close_io(&self, _ctx: &TtrpcContext, req: api::CloseIORequest) -> TtrpcResult<api::Empty> {
        ttrpc(self.inner.proc(&req.id, &req.exec_id).map(|_| api::Empty::new()))
    }

    fn update(&self, _ctx: &TtrpcContext, req: api::UpdateTaskRequest) -> TtrpcResult<api::Empty> {
        ttrpc((|| {
            let sandbox = self.inner.sandbox(&req.id)?;
            let json = req.resources.as_ref().map(|a| a.value.as_slice()).unwrap_or_default();
            let r: oci_spec::runtime::LinuxResources =
                serde_json::from_slice(json).map_err(|e| Error::InvalidArgument(format!("resources: {e}")))?;
            let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
            let body = Value::Object(spec::limits(&r, cpus).into_iter().map(|(k, v)| (k.to_string(), v)).collect());
            call_empty("PUT", &format!("/v1/sandboxes/{sandbox}/limits"), Some(&body))?;
            Ok(api::Empty::new())
        })())
    }

    fn wait(&self, _ctx: &TtrpcContext, req: api::WaitRequest) -> TtrpcResult<api::WaitResponse> {
        ttrpc((|| {
            let (_, p) = self.inner.proc(&req.id, &req.exec_id)?;
            let (exit_status, at) = p.wait();
            Ok(api::WaitResponse { exit_status, exited_at: MessageField::some(at), ..Default::default() })
        })())
    }

    fn stats(&self, _ctx: &TtrpcContext, req: api::StatsRequest) -> TtrpcResult<api::StatsResponse> {
        ttrpc((|| {
            let sandbox = self.inner.sandbox(&req.id)?;
            let m: SandboxMetrics = call("GET", &format!("/v1/sandboxes/{sandbox}/metrics"), None)?;
            let info: SandboxInfo = call("GET", &format!("/v1/sandboxes/{sandbox}"), None)?;
            let procs: Vec<ProcessInfo> = call("GET", &format!("/v1/sandboxes/{sandbox}/processes"), None)?;
            let metrics = Metrics {
                cpu: MessageField::some(CPUStat {
                    usage: MessageField::some(CPUUsage { total: m.cpu_usage_ns, ..Default::default() }),
                    ..Default::default()
                }),
                memory: MessageField::some(MemoryStat {
                    cache: m.mem_cache,
                    usage: MessageField::some(MemoryEntry {
                        usage: m.mem_used,
                        limit: m.mem_total,
                        ..Default::default()
                    }),
                    ..Default::default()
                }),
                pids: MessageField::some(PidsStat {
                    current: procs.iter().filter(|p| p.running).count() as u64,
                    limit: info.limits.pids.unwrap_or(0),
                    ..Default::default()
                }),
                ..Default::default()
            };
            let stats = containerd_shim::util::convert_to_any(Box::new(metrics))?;
            Ok(api::StatsResponse { stats: MessageField::some(stats), ..Default::default() })
        })())
    }

    fn connect(&self, _ctx: &TtrpcContext, req: api::ConnectRequest) -> TtrpcResult<api::ConnectResponse> {
        ttrpc((|| {
            let (shim_pid, init) = self.inner.with_task(&req.id, |t| Ok((t.shim_pid, t.procs.get("").cloned())))?;
            let task_pid = init.and_then(|p| p.state().started.map(|(_, pid)| pid)).unwrap_or(shim_pid);
            Ok(api::ConnectResponse {
                shim_pid: std::process::id(),
                task_pid,
                version: env!("CARGO_PKG_VERSION").to_string(),
                ..Default::default()
            })
        })())
    }

    /// Ends the shim once it has no task left.
    fn shutdown(&self, _ctx: &TtrpcContext, _req: api::ShutdownRequest) -> TtrpcResult<api::Empty> {
        if self.inner.tasks.lock().unwrap_or_else(|e| e.into_inner()).is_empty() {
            self.exit.signal();
        }
        Ok(api::Empty::new())
    }
}
