//! The daemon's end of one shim connection.
//!
//! One reader thread per connection delivers each [`ShimEvent`] to the exec
//! that is waiting for it (by exec id, over an mpsc channel). A buffered
//! exec skips it: its end comes on a status pipe the request thread polls
//! with the output ([`ShimClient::exec_with_status`]). Sending needs no
//! lock: on a `SOCK_SEQPACKET` socket each `sendmsg` is one whole message.

use std::collections::HashMap;
use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::socket::{connect, shutdown, socket, AddressFamily, Shutdown, SockFlag, SockType, UnixAddr};
use strata_shim::proto::{self, ExecSpec, ProtoError, SetupSpec, ShimEvent, ShimRequest};

#[derive(Debug, thiserror::Error)]
pub enum ShimError {
    #[error("connect to shim socket {path}")]
    Connect {
        path: String,
        #[source]
        source: nix::Error,
    },
    #[error("talk to shim")]
    Proto(#[from] ProtoError),
    #[error("shim did not answer within {0:?}")]
    Timeout(Duration),
    #[error("sandbox setup failed: {}", .0.join(": "))]
    SetupFailed(Vec<String>),
    #[error("unexpected shim message {0:?}")]
    Unexpected(Box<ShimEvent>),
    #[error("the shim connection is closed (the sandbox's init process is gone)")]
    Gone,
    #[error("the shim has not said what it can do yet (its sandbox was paused when this daemon started)")]
    FeaturesUnknown,
    #[error("exec id {0} is in use on this connection")]
    IdInUse(u64),
}

/// An event and the fds that came with it.
pub struct Delivery {
    pub event: ShimEvent,
    pub fds: Vec<OwnedFd>,
}

type Pending = Arc<Mutex<HashMap<u64, Sender<Delivery>>>>;

/// Exec id 0 is reserved for connection-level replies (`Hello`).
const CONTROL_ID: u64 = 0;

pub struct ShimClient {
    sock: Arc<OwnedFd>,
    pending: Pending,
    alive: Arc<AtomicBool>,
    features: Arc<Features>,
}

/// What the shim can do: from its setup or its `Hello`, which a frozen
/// shim answers only once thawed (the reader thread records it then).
#[derive(Default)]
struct Features {
    known: AtomicBool,
    /// The shim takes a status fd with an exec ([`ExecSpec::status_fd`]).
    status_fd: AtomicBool,
    /// The shim keeps a command's stdio for a later daemon ([`ExecSpec::keep`]).
    keep: AtomicBool,
}

impl Features {
    fn set(&self, features: &[String]) {
        let has = |name: &str| features.iter().any(|f| f == name);
        self.status_fd.store(has(proto::FEATURE_STATUS_FD), Ordering::Release);
        self.keep.store(has(proto::FEATURE_KEEP), Ordering::Release);
        self.known.store(true, Ordering::Release);
    }
}

/// A kept command a reattaching daemon got back ([`ShimClient::reattach`]).
pub struct Reattached {
    pub pid: i32,
    pub tty: bool,
    /// stdout's and stderr's read ends then, if still open, stdin's write
    /// end; with `tty`, the pty master.
    pub fds: Vec<OwnedFd>,
    pub stdin: bool,
    /// Its events from now on (its exit).
    pub rx: Receiver<Delivery>,
}

fn event_id(ev: &ShimEvent) -> u64 {
    match ev {
        ShimEvent::Started { id, .. }
        | ShimEvent::StartFailed { id, .. }
        | ShimEvent::Exited { id, .. }
        | ShimEvent::Reattached { id, .. }
        | ShimEvent::NotRunning { id } => *id,
        ShimEvent::Ready | ShimEvent::ReadyWith { .. } | ShimEvent::SetupFailed { .. } | ShimEvent::Hello { .. } => {
            CONTROL_ID
        }
    }
}

/// Connect to a shim's listening socket.
pub fn connect_path(path: &Path) -> Result<OwnedFd, ShimError> {
    let err = |source| ShimError::Connect { path: path.display().to_string(), source };
    let fd = socket(AddressFamily::Unix, SockType::SeqPacket, SockFlag::SOCK_CLOEXEC, None).map_err(err)?;
    let addr = UnixAddr::new(path).map_err(err)?;
    connect(fd.as_raw_fd(), &addr).map_err(err)?;
    Ok(fd)
}

/// Wait up to `timeout` for one message.
fn recv_timeout(sock: &OwnedFd, timeout: Duration) -> Result<Delivery, ShimError> {
    let ms = u16::try_from(timeout.as_millis()).unwrap_or(u16::MAX);
    let mut fds = [PollFd::new(sock.as_fd(), PollFlags::POLLIN)];
    loop {
        match poll(&mut fds, PollTimeout::from(ms)) {
            Ok(0) => return Err(ShimError::Timeout(timeout)),
            Ok(_) => break,
            Err(nix::Error::EINTR) => continue,
            Err(e) => return Err(ShimError::Proto(ProtoError::Recv(e))),
        }
    }
    let (event, fds) = proto::recv::<ShimEvent>(sock)?;
    Ok(Delivery { event, fds })
}

/// Hand the shim its spec, with `fds` (the root mount of a sandbox in a user
/// namespace), and wait for it to be set up. Returns the shim's features
/// (for [`ShimClient::start`]).
pub fn setup(sock: &OwnedFd, spec: &SetupSpec, fds: &[RawFd], timeout: Duration) -> Result<Vec<String>, ShimError> {
    proto::send(sock, &ShimRequest::Setup(spec.clone()), fds)?;
    match recv_timeout(sock, timeout)?.event {
        ShimEvent::Ready => Ok(Vec::new()),
        ShimEvent::ReadyWith { features } => Ok(features),
        ShimEvent::SetupFailed { chain } => Err(ShimError::SetupFailed(chain)),
        other => Err(ShimError::Unexpected(Box::new(other))),
    }
}

impl ShimClient {
    /// Start dispatching events from an established connection to a shim
    /// that can do `features` (what [`setup`] returned, or its `Hello`;
    /// `None`: not known yet, until the `Hello` asked for arrives).
    pub fn start(sock: OwnedFd, features: Option<&[String]>) -> ShimClient {
        let known = Arc::new(Features::default());
        if let Some(f) = features {
            known.set(f);
        }
        let sock = Arc::new(sock);
        let pending: Pending = Arc::default();
        let alive = Arc::new(AtomicBool::new(true));
        let (s, p, a, f) = (sock.clone(), pending.clone(), alive.clone(), known.clone());
        std::thread::Builder::new()
            .name("shim-reader".into())
            .spawn(move || reader(s, p, a, f))
            .map_err(|e| tracing::error!("spawn shim reader thread: {e}"))
            .ok();
        ShimClient { sock, pending, alive, features: known }
    }

    /// Re-attach to a live shim after a daemon restart; returns the exec ids it
    /// still runs. A frozen shim (its sandbox is paused, and the shim lives in
    /// the sandbox's cgroup) cannot answer until it is thawed: with
    /// `frozen`, the connection is queued and the `Hello` answered later
    /// (its features unknown meanwhile: none are used; the reader records
    /// them when it comes).
    pub fn reconnect(path: &Path, timeout: Duration, frozen: bool) -> Result<(ShimClient, Vec<u64>), ShimError> {
        let sock = connect_path(path)?;
        proto::send(&sock, &ShimRequest::Hello, &[])?;
        if frozen {
            return Ok((ShimClient::start(sock, None), Vec::new()));
        }
        let (running, features) = match recv_timeout(&sock, timeout)?.event {
            ShimEvent::Hello { running, features } => (running, features),
            other => return Err(ShimError::Unexpected(Box::new(other))),
        };
        Ok((ShimClient::start(sock, Some(&features)), running))
    }

    pub fn is_alive(&self) -> bool {
        self.alive.load(Ordering::Acquire)
    }

    /// Whether [`ShimClient::exec_with_status`] can be used.
    pub fn takes_status_fd(&self) -> bool {
        self.features.status_fd.load(Ordering::Acquire)
    }

    /// Whether the shim keeps commands for a later daemon ([`ExecSpec::keep`]).
    pub fn keeps(&self) -> bool {
        self.features.keep.load(Ordering::Acquire)
    }

    /// Whether the shim's features are known ([`ShimClient::start`]),
    /// waiting up to `wait` for the `Hello` that says them.
    pub fn features_known(&self, wait: Duration) -> bool {
        let until = std::time::Instant::now() + wait;
        while !self.features.known.load(Ordering::Acquire) {
            if std::time::Instant::now() >= until || !self.is_alive() {
                return false;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        true
    }

    /// Take back a command started with [`ExecSpec::keep`] (by an earlier
    /// daemon, or this one): `None` if it no longer runs.
    pub fn reattach(&self, id: u64, timeout: Duration) -> Result<Option<Reattached>, ShimError> {
        let rx = self.register(id, &ShimRequest::Reattach { id }, &[])?;
        match rx.recv_timeout(timeout) {
            Ok(Delivery { event: ShimEvent::Reattached { pid, tty, stdin, .. }, fds }) => {
                let want = if tty { 1 } else { 2 + usize::from(stdin) };
                if fds.len() != want {
                    lock(&self.pending).remove(&id);
                    return Err(ShimError::Unexpected(Box::new(ShimEvent::Reattached { id, pid, tty, stdin })));
                }
                Ok(Some(Reattached { pid, tty, fds, stdin, rx }))
            }
            Ok(Delivery { event: ShimEvent::NotRunning { .. }, .. }) => {
                lock(&self.pending).remove(&id);
                Ok(None)
            }
            Ok(Delivery { event, .. }) => {
                lock(&self.pending).remove(&id);
                Err(ShimError::Unexpected(Box::new(event)))
            }
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                lock(&self.pending).remove(&id);
                Err(ShimError::Timeout(timeout))
            }
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => Err(ShimError::Gone),
        }
    }

    /// Stop routing exec `id`'s events (a reattach that was not the
    /// command the caller looked for).
    pub fn forget(&self, id: u64) {
        lock(&self.pending).remove(&id);
    }

    /// Close the shim's copy of a kept command's stdin.
    pub fn close_stdin(&self, id: u64) -> Result<(), ShimError> {
        proto::send(&*self.sock, &ShimRequest::CloseStdin { id }, &[])?;
        Ok(())
    }

    /// Ask the shim to start a command whose end it writes to `status`
    /// (the write end of a pipe, sent after the three stdio fds): no event
    /// about it comes on the connection.
    /// With `wait` false a full queue to the shim is `Ok(false)` (nothing
    /// sent) instead of a wait for room.
    pub fn exec_with_status(
        &self,
        mut spec: ExecSpec,
        stdio: [RawFd; 3],
        status: RawFd,
        wait: bool,
    ) -> Result<bool, ShimError> {
        if !self.is_alive() {
            return Err(ShimError::Gone);
        }
        spec.status_fd = true;
        let (req, fds) = (ShimRequest::Exec(spec), [stdio[0], stdio[1], stdio[2], status]);
        match if wait { proto::send(&*self.sock, &req, &fds) } else { proto::send_nowait(&*self.sock, &req, &fds) } {
            Ok(()) => Ok(true),
            Err(ProtoError::Send(nix::Error::EAGAIN)) if !wait => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    /// Ask the shim to start a command. Events about it arrive on the returned
    /// channel; it disconnects if the shim goes away.
    pub fn exec(&self, spec: ExecSpec, fds: &[RawFd]) -> Result<Receiver<Delivery>, ShimError> {
        let id = spec.id;
        self.register(id, &ShimRequest::Exec(spec), fds)
    }

    /// Send `req` about exec `id`, its events routed to the channel returned.
    fn register(&self, id: u64, req: &ShimRequest, fds: &[RawFd]) -> Result<Receiver<Delivery>, ShimError> {
        if !self.is_alive() {
            return Err(ShimError::Gone);
        }
        let (tx, rx) = channel();
        {
            let mut pending = lock(&self.pending);
            if id != CONTROL_ID && pending.contains_key(&id) {
                return Err(ShimError::IdInUse(id));
            }
            pending.insert(id, tx);
        }
        if let Err(e) = proto::send(&*self.sock, req, fds) {
            lock(&self.pending).remove(&id);
            return Err(e.into());
        }
        Ok(rx)
    }

    pub fn signal(&self, id: u64, signal: i32, group: bool) -> Result<(), ShimError> {
        proto::send(&*self.sock, &ShimRequest::Signal { id, signal, group }, &[])?;
        Ok(())
    }
}

impl Drop for ShimClient {
    fn drop(&mut self) {
        // Wakes the reader thread, which then exits.
        let _ = shutdown(self.sock.as_raw_fd(), Shutdown::Both);
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn reader(sock: Arc<OwnedFd>, pending: Pending, alive: Arc<AtomicBool>, features: Arc<Features>) {
    loop {
        match proto::recv::<ShimEvent>(&*sock) {
            Ok((event, fds)) => {
                if let ShimEvent::Hello { features: f, .. } = &event {
                    features.set(f);
                }
                let id = event_id(&event);
                let done = matches!(event, ShimEvent::Exited { .. } | ShimEvent::StartFailed { .. });
                let mut map = lock(&pending);
                let tx = if done { map.remove(&id) } else { map.get(&id).cloned() };
                drop(map);
                if let Some(tx) = tx {
                    let _ = tx.send(Delivery { event, fds });
                }
            }
            Err(ProtoError::Decode(e)) => tracing::warn!("undecodable shim message: {e}"),
            Err(_) => break,
        }
    }
    alive.store(false, Ordering::Release);
    // Dropping the senders tells every waiting exec that the shim is gone.
    lock(&pending).clear();
}
