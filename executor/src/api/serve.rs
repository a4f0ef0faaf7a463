//! The API's HTTP/1.1 server: hyper on a small tokio runtime, over the
//! daemon's Unix socket. A connection is a task, not a thread. A request's
//! work (`route`: mounts, fork, tar, SQLite) does not block an async
//! worker: it runs under `block_in_place` (the worker hands its other tasks
//! to another thread for the duration; a hop to the blocking pool per
//! request cost 15 µs more, BENCHMARKS.md), and progress streams and
//! attached execs, which run long, go to the blocking pool. One bounded
//! exception: a buffered exec that can start without waiting is waited
//! for on its worker for up to [`INLINE_EXEC`] (2 ms) before that
//! hand-off, by all workers but one at most ([`run_exec`]): for a short
//! command the hand-off was the largest thing left that the daemon could
//! drop.
//!
//! Timeouts, each a daemon flag ([`ServeConfig`]):
//! - a request head must be whole within `header_timeout` of its first
//!   byte (of the connection opening, for the first request);
//! - a kept-alive connection with nothing in flight is closed after
//!   `idle_timeout`;
//! - a body must arrive within `body_timeout` of its head (408).
//!
//! hyper's own `header_read_timeout` is left off: depending on its version
//! it also bounds the idle wait between requests, and the two are
//! different limits here (like Go's `ReadHeaderTimeout` and `IdleTimeout`).
//! One watchdog per connection enforces both from what the connection's
//! reads and requests record in its [`Activity`].
//!
//! SIGTERM: the listener stops accepting, idle connections close, requests
//! in flight get up to `shutdown_grace` to finish.

use std::convert::Infallible;
use std::os::unix::net::UnixStream as StdUnixStream;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Limited};
use hyper::body::{Frame, Incoming, SizeHint};
use hyper::header::{HeaderValue, ALLOW, CONNECTION, CONTENT_LENGTH, CONTENT_TYPE, UPGRADE};
use hyper::service::service_fn;
use hyper::{Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::UnixStream;
use tokio::sync::{mpsc, oneshot, watch};

use super::http::{self, MAX_BODY, MAX_HEAD, UPGRADE_PROTOCOL};
use super::{route, ApiError, Reply, StreamOp};
use crate::daemon::Daemon;
use crate::error::ErrorKind;

/// The server's limits (daemon flags).
#[derive(Debug, Clone)]
pub struct ServeConfig {
    /// A request head must be whole within this of its first byte.
    pub header_timeout: Duration,
    /// A connection with no request in flight is closed after this.
    pub idle_timeout: Duration,
    /// A request body must be whole within this of its head.
    pub body_timeout: Duration,
    /// Connections open at once; past it a new one is answered 429.
    pub max_connections: usize,
    /// At shut-down, how long requests in flight may take to finish.
    pub shutdown_grace: Duration,
}

impl Default for ServeConfig {
    fn default() -> Self {
        ServeConfig {
            header_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(60),
            body_timeout: Duration::from_secs(30),
            max_connections: DEFAULT_MAX_CONNECTIONS,
            shutdown_grace: Duration::from_secs(30),
        }
    }
}

/// Default of `--max-connections`: idle connections cost a task and a
/// descriptor each, not a thread.
pub const DEFAULT_MAX_CONNECTIONS: usize = 4096;

/// Serve `listener` until `stop` turns true, then drain (bounded) and return.
pub fn serve(
    d: Arc<Daemon>,
    listener: std::os::unix::net::UnixListener,
    cfg: ServeConfig,
    stop: watch::Receiver<bool>,
) -> std::io::Result<()> {
    let workers = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(2).clamp(1, 4);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        // Requests run here; as many at once as the thread-per-connection
        // server allowed connections.
        .max_blocking_threads(512)
        // 8 MiB of stack (reserved, not committed): request handlers walk
        // trees (bounded by diff::MAX_DEPTH).
        .thread_stack_size(8 << 20)
        .thread_name("api")
        .enable_all()
        .build()?;
    listener.set_nonblocking(true)?;
    let result = rt.block_on(async move {
        let listener = tokio::net::UnixListener::from_std(listener)?;
        accept_loop(d, listener, Arc::new(cfg), Arc::new(InlineExecs::new(workers)), stop).await;
        Ok(())
    });
    // Blocking work still running (a request past the grace) ends with
    // the process; do not wait for it here.
    rt.shutdown_background();
    result
}

async fn accept_loop(
    d: Arc<Daemon>,
    listener: tokio::net::UnixListener,
    cfg: Arc<ServeConfig>,
    inline: Arc<InlineExecs>,
    mut stop: watch::Receiver<bool>,
) {
    let open = Arc::new(AtomicUsize::new(0));
    let refusing = Arc::new(AtomicUsize::new(0));
    loop {
        let accepted = tokio::select! {
            _ = stop.changed() => break,
            a = listener.accept() => a,
        };
        match accepted {
            Ok((s, _)) if open.load(Ordering::Acquire) >= cfg.max_connections => {
                refuse(s, cfg.max_connections, &refusing);
            }
            Ok((s, _)) => {
                let counted = Counted::new(&open);
                let (d, cfg, inline, stop) = (d.clone(), cfg.clone(), inline.clone(), stop.clone());
                tokio::spawn(async move {
                    let _counted = counted;
                    connection(d, s, cfg, inline, stop).await;
                });
            }
            Err(e) => {
                tracing::warn!("accept: {e}");
                // Out of descriptors (EMFILE): let connections close.
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
    drop(listener);
    let deadline = Instant::now() + cfg.shutdown_grace;
    while open.load(Ordering::Acquire) > 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let left = open.load(Ordering::Acquire);
    if left > 0 {
        tracing::warn!("{left} API connection(s) still busy after {:?}; closing them", cfg.shutdown_grace);
    }
}

/// One open connection, counted until its task ends (even by a panic).
struct Counted(Arc<AtomicUsize>);

impl Counted {
    fn new(open: &Arc<AtomicUsize>) -> Counted {
        open.fetch_add(1, Ordering::AcqRel);
        Counted(open.clone())
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// How long a refused connection may take to send its request head.
const REFUSE_READ: Duration = Duration::from_secs(1);

/// Refused connections waiting for their request head at once; past it a
/// new one is closed unanswered.
const MAX_REFUSING: usize = 64;

/// Answer a connection past the limit with 429. The answer follows the
/// request's head (read for up to [`REFUSE_READ`], at most [`MAX_HEAD`]
/// bytes; a body is read and dropped after the answer, for the rest of
/// that time): an HTTP/1.1 client that reads a
/// response before it has sent its request drops it as unexpected (hyper:
/// `UnexpectedMessage`), so answering at accept left a client racing its
/// own connection for the 429. A client that sends nothing gets the 429
/// after `REFUSE_READ`. The waits are tasks on their own small budget
/// (`refusing`), never the accept loop's; past it a connection is closed
/// unanswered. The one response written by hand: a hyper connection
/// would read the body too.
fn refuse(mut s: UnixStream, max: usize, refusing: &Arc<AtomicUsize>) {
    if refusing.load(Ordering::Acquire) >= MAX_REFUSING {
        return;
    }
    let counted = Counted::new(refusing);
    tokio::spawn(async move {
        let _counted = counted;
        let deadline = tokio::time::Instant::now() + REFUSE_READ;
        let mut buf = vec![0u8; 16 << 10];
        let mut head: Vec<u8> = Vec::new();
        let _ = tokio::time::timeout_at(deadline, async {
            while head.len() < MAX_HEAD {
                let n = match s.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => n,
                };
                // The head ends at the first blank line, which may straddle reads.
                let from = head.len().saturating_sub(3);
                head.extend_from_slice(&buf[..n]);
                if head[from..].windows(4).any(|w| w == b"\r\n\r\n") {
                    return;
                }
            }
        })
        .await;
        let mut read = head.len();
        let e = ApiError::new(
            ErrorKind::LimitReached,
            format!("the daemon serves at most {max} connections at once; retry later"),
        );
        let body = e.body();
        let mut msg = format!(
            "HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
            body.len()
        )
        .into_bytes();
        msg.extend_from_slice(&body);
        let _ = s.write_all(&msg).await;
        let _ = s.shutdown().await;
        // What the client still sends (a body, up to MAX_BODY) is read and
        // dropped for the rest of the window, so that its write is not cut
        // by our close before it has read the 429.
        let _ = tokio::time::timeout_at(deadline, async {
            while read < MAX_HEAD + MAX_BODY {
                match s.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => read += n,
                }
            }
        })
        .await;
    });
}

/// What a connection's watchdog reads: whether a request is in flight, and
/// since when the connection has been idle or reading a head.
struct Activity {
    base: Instant,
    in_flight: AtomicUsize,
    /// Milliseconds since `base` when the connection last became idle
    /// (opened, or answered its last request).
    idle_since: AtomicU64,
    /// Milliseconds since `base`, plus one, when the first byte of the next
    /// request head arrived; 0 while none has.
    head_since: AtomicU64,
    /// No request yet: the first head is due `header_timeout` after opening.
    fresh: AtomicBool,
}

impl Activity {
    fn new() -> Activity {
        Activity {
            base: Instant::now(),
            in_flight: AtomicUsize::new(0),
            idle_since: AtomicU64::new(0),
            head_since: AtomicU64::new(0),
            fresh: AtomicBool::new(true),
        }
    }

    fn now_ms(&self) -> u64 {
        self.base.elapsed().as_millis() as u64
    }

    fn read(&self) {
        if self.in_flight.load(Ordering::Acquire) == 0 && self.head_since.load(Ordering::Acquire) == 0 {
            self.head_since.store(self.now_ms() + 1, Ordering::Release);
        }
    }

    /// A request's head is in: until the guard (moved into the response
    /// body) is dropped, no timeout of the watchdog applies.
    fn begin(self: &Arc<Self>) -> InFlight {
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        self.head_since.store(0, Ordering::Release);
        self.fresh.store(false, Ordering::Release);
        InFlight(self.clone())
    }

    /// When the connection is to be closed if nothing happens first; `None`
    /// while a request is in flight.
    fn deadline(&self, cfg: &ServeConfig) -> Option<Instant> {
        if self.in_flight.load(Ordering::Acquire) > 0 {
            return None;
        }
        let at = |ms: u64, d: Duration| self.base + Duration::from_millis(ms) + d;
        match self.head_since.load(Ordering::Acquire) {
            0 if self.fresh.load(Ordering::Acquire) => Some(at(0, cfg.header_timeout)),
            0 => Some(at(self.idle_since.load(Ordering::Acquire), cfg.idle_timeout)),
            since => Some(at(since - 1, cfg.header_timeout)),
        }
    }
}

struct InFlight(Arc<Activity>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.idle_since.store(self.0.now_ms(), Ordering::Release);
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Resolves when the connection is past its header or idle deadline.
async fn watchdog(act: &Activity, cfg: &ServeConfig) {
    loop {
        // Deadlines only move later, so sleeping to the one seen now and
        // looking again is exact.
        let due = act.deadline(cfg).unwrap_or_else(|| Instant::now() + cfg.header_timeout.min(cfg.idle_timeout));
        tokio::time::sleep_until(due.into()).await;
        if act.deadline(cfg).is_some_and(|d| d <= Instant::now()) {
            return;
        }
    }
}

/// The socket, recording reads in its connection's [`Activity`].
struct Watched {
    inner: UnixStream,
    act: Arc<Activity>,
}

impl AsyncRead for Watched {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.act.read();
        }
        r
    }
}

impl AsyncWrite for Watched {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

async fn connection(
    d: Arc<Daemon>,
    s: UnixStream,
    cfg: Arc<ServeConfig>,
    inline: Arc<InlineExecs>,
    mut stop: watch::Receiver<bool>,
) {
    let denied: Option<Arc<str>> = super::peer_allowed(&s, d.cfg.socket_gid).err().map(Arc::from);
    let act = Arc::new(Activity::new());
    let io = TokioIo::new(Watched { inner: s, act: act.clone() });
    let svc = {
        let (act, cfg) = (act.clone(), cfg.clone());
        service_fn(move |req| {
            let guard = act.begin();
            let (d, cfg, inline, denied) = (d.clone(), cfg.clone(), inline.clone(), denied.clone());
            async move {
                let mut resp = answer(d, &cfg, &inline, denied, req).await;
                resp.body_mut().guard = Some(guard);
                Ok::<_, Infallible>(resp)
            }
        })
    };
    let conn =
        hyper::server::conn::http1::Builder::new().max_buf_size(MAX_HEAD).serve_connection(io, svc).with_upgrades();
    tokio::pin!(conn);
    let dog = watchdog(&act, &cfg);
    tokio::pin!(dog);
    let mut draining = false;
    loop {
        tokio::select! {
            _ = conn.as_mut() => return,
            // Dropping the connection closes the socket.
            _ = &mut dog => return,
            _ = stop.changed(), if !draining => {
                draining = true;
                conn.as_mut().graceful_shutdown();
            }
        }
    }
}

/// A response body: whole, or the lines of a progress stream. It holds the
/// request's [`InFlight`] guard until hyper has sent it.
pub(crate) struct Body {
    kind: BodyKind,
    guard: Option<InFlight>,
}

enum BodyKind {
    Whole(Option<Bytes>),
    Lines(mpsc::Receiver<Bytes>),
}

impl Body {
    fn whole(b: Vec<u8>) -> Body {
        Body { kind: BodyKind::Whole((!b.is_empty()).then(|| Bytes::from(b))), guard: None }
    }
}

impl hyper::body::Body for Body {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        match &mut self.kind {
            BodyKind::Whole(b) => Poll::Ready(b.take().map(|b| Ok(Frame::data(b)))),
            BodyKind::Lines(rx) => rx.poll_recv(cx).map(|line| line.map(|b| Ok(Frame::data(b)))),
        }
    }

    fn is_end_stream(&self) -> bool {
        matches!(self.kind, BodyKind::Whole(None))
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            BodyKind::Whole(b) => SizeHint::with_exact(b.as_ref().map_or(0, |b| b.len() as u64)),
            BodyKind::Lines(_) => SizeHint::default(),
        }
    }
}

fn respond(status: u16, body: Vec<u8>) -> Response<Body> {
    let json = !body.is_empty();
    let mut r = Response::new(Body::whole(body));
    *r.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    if json {
        r.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    }
    r
}

fn error_response(e: &ApiError) -> Response<Body> {
    let mut r = respond(e.status(), e.body());
    if let Some(allow) = e.allow {
        r.headers_mut().insert(ALLOW, HeaderValue::from_static(allow));
    }
    r
}

/// An error after which the connection closes (its body was not read).
fn closing(e: ApiError) -> Response<Body> {
    let mut r = error_response(&e);
    r.headers_mut().insert(CONNECTION, HeaderValue::from_static("close"));
    r
}

/// How long a buffered exec is waited for on the async worker that serves
/// its request before the worker's other tasks go to another thread
/// (`block_in_place`) for the rest of it. Most commands an agent runs end
/// within it; the hand-off costs a warm exec 4-28 µs and the daemon 12-28
/// µs of CPU (BENCHMARKS.md, "A warm exec waits on its own worker").
const INLINE_EXEC: Duration = Duration::from_millis(2);

/// Output up to this (stdout and stderr) is turned into the answer's JSON
/// on the worker; more, under `block_in_place` (up to 2 x 16 MiB to
/// escape).
const INLINE_ANSWER: usize = 64 << 10;

/// How many buffered execs may wait on async workers at once: one fewer
/// than there are workers, so that one is always free for the rest.
struct InlineExecs(AtomicUsize);

impl InlineExecs {
    fn new(workers: usize) -> InlineExecs {
        InlineExecs(AtomicUsize::new(workers.saturating_sub(1)))
    }

    fn take(&self) -> Option<InlineExec<'_>> {
        self.0.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1)).ok().map(|_| InlineExec(&self.0))
    }
}

/// A slot of [`InlineExecs`], given back when dropped.
struct InlineExec<'a>(&'a AtomicUsize);

impl Drop for InlineExec<'_> {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::AcqRel);
    }
}

/// Run a buffered exec and answer with its result. With a slot free, and
/// if the command can be started without waiting (`try_exec_start`: no
/// pause holds the sandbox, the shim's queue has room), it is started and
/// waited for on this async worker for up to [`INLINE_EXEC`]; the rest,
/// or all of it otherwise, runs under `block_in_place`, without the slot.
fn run_exec(
    d: &Daemon,
    inline: &InlineExecs,
    sandbox: &crate::sandbox::Sandbox,
    req: &crate::sandbox::ExecRequest,
    stdin: Vec<u8>,
) -> Result<Vec<u8>, ApiError> {
    use crate::sandbox::Waited;
    // Ready pools refill only while no request is in flight.
    let _in_flight = d.request_started();
    let mut slot = inline.take();
    let out = d.exec_with(sandbox, req, stdin, &mut |sb, req, stdin| {
        let waited = match slot {
            None => Err(stdin),
            Some(_) => match sb.try_exec_start(req, stdin)? {
                Ok(x) => Ok(sb.exec_wait_until(x, Some(Instant::now() + INLINE_EXEC))?),
                Err(stdin) => Err(stdin),
            },
        };
        slot = None;
        match waited {
            Ok(Waited::Done(out)) => Ok(out),
            Ok(Waited::Running(x)) => tokio::task::block_in_place(|| sb.exec_wait(x)),
            Err(stdin) => tokio::task::block_in_place(|| sb.exec_buffered(req, stdin)),
        }
    })?;
    if out.stdout.len() + out.stderr.len() > INLINE_ANSWER {
        tokio::task::block_in_place(|| super::exec_result(out))
    } else {
        super::exec_result(out)
    }
}

/// Log an internal error of `request` (what the client gets says less).
fn logged<T>(request: &http::Request, r: Result<T, ApiError>) -> Result<T, ApiError> {
    if let Err(e) = &r {
        if e.kind == ErrorKind::Internal {
            tracing::error!("{} {}: {}", request.method, request.path, e.message);
        }
    }
    r
}

async fn answer(
    d: Arc<Daemon>,
    cfg: &ServeConfig,
    inline: &InlineExecs,
    denied: Option<Arc<str>>,
    mut req: hyper::Request<Incoming>,
) -> Response<Body> {
    // A peer that may not use the API gets its answer after its request
    // head is read (so that it sees the answer, not a broken pipe).
    if let Some(why) = denied {
        tracing::warn!("refused API request {} {}: {why}", req.method(), req.uri().path());
        return closing(ApiError::new(ErrorKind::PermissionDenied, why.to_string()));
    }
    let upgrade = hyper::upgrade::on(&mut req);
    let (parts, body) = req.into_parts();
    let declared = parts.headers.get(CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if declared.is_some_and(|n| n > MAX_BODY as u64) {
        return closing(ApiError::new(
            ErrorKind::TooLarge,
            format!("request body of {} bytes exceeds {MAX_BODY}", declared.unwrap_or_default()),
        ));
    }
    let body = match tokio::time::timeout(cfg.body_timeout, Limited::new(body, MAX_BODY).collect()).await {
        Err(_) => {
            return closing(ApiError::new(
                ErrorKind::RequestTimeout,
                format!("request body not received within {:?}", cfg.body_timeout),
            ))
        }
        Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => {
            return closing(ApiError::new(ErrorKind::TooLarge, format!("request body exceeds {MAX_BODY} bytes")))
        }
        Ok(Err(e)) => return closing(ApiError::new(ErrorKind::InvalidArgument, format!("read request body: {e}"))),
        Ok(Ok(b)) => b.to_bytes(),
    };
    let request = http::Request::from_parts(&parts, body.to_vec());
    // A buffered or attached exec is only looked up by `route` (in memory)
    // and run below; every other request runs under `block_in_place`.
    let routed = if super::answers_at_once(&request) {
        logged(&request, route(&d, &request))
    } else {
        tokio::task::block_in_place(|| logged(&request, route(&d, &request)))
    };
    match routed {
        Ok(Reply::Json(status, b)) => respond(status, b),
        Ok(Reply::Empty(status)) => respond(status, Vec::new()),
        Ok(Reply::Metrics(text)) => {
            let mut r = Response::new(Body::whole(text.into_bytes()));
            r.headers_mut().insert(
                CONTENT_TYPE,
                HeaderValue::from_static("application/openmetrics-text; version=1.0.0; charset=utf-8"),
            );
            r
        }
        Ok(Reply::Stream(op)) => stream(d, op),
        Ok(Reply::Exec { sandbox, req, stdin }) => {
            match logged(&request, run_exec(&d, inline, &sandbox, &req, stdin)) {
                Ok(b) => respond(200, b),
                Err(e) => error_response(&e),
            }
        }
        Ok(Reply::Attach { sandbox, req }) => attach(d, sandbox, req, upgrade).await,
        Ok(Reply::Port(stream)) => port(stream, upgrade),
        Err(e) => error_response(&e),
    }
}

/// Run `op` on the blocking pool, streaming its progress as JSON lines,
/// then its result. The operation runs to the end even if the client goes
/// away.
fn stream(d: Arc<Daemon>, op: StreamOp) -> Response<Body> {
    let (tx, rx) = mpsc::channel::<Bytes>(64);
    tokio::task::spawn_blocking(move || {
        let send = |v: serde_json::Value| {
            let mut b = serde_json::to_vec(&v).unwrap_or_default();
            b.push(b'\n');
            // A client gone: the operation goes on.
            let _ = tx.blocking_send(Bytes::from(b));
        };
        let last = match op.run(&d, &mut |p| send(serde_json::json!({ "progress": p }))) {
            Ok(Reply::Json(status, body)) => {
                let result: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
                serde_json::json!({"status": status, "result": result})
            }
            Ok(_) => serde_json::json!({"status": 204}),
            Err(e) => {
                if e.kind == ErrorKind::Internal {
                    tracing::error!("stream: {}", e.message);
                }
                serde_json::json!({"status": e.status(), "error": {"code": e.kind.code(), "message": e.message}})
            }
        };
        send(last);
    });
    let mut r = Response::new(Body { kind: BodyKind::Lines(rx), guard: None });
    r.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("application/x-ndjson"));
    r.headers_mut().insert(CONNECTION, HeaderValue::from_static("close"));
    r
}

/// Start an attached exec on the blocking pool with one end of a socket
/// pair; once it has started, answer 101 and join the other end to the
/// upgraded connection. An exec that fails to start is answered with its
/// error instead.
async fn attach(
    d: Arc<Daemon>,
    sandbox: crate::sandbox::InUse,
    req: crate::sandbox::ExecRequest,
    upgrade: hyper::upgrade::OnUpgrade,
) -> Response<Body> {
    let (ours, theirs) = match StdUnixStream::pair() {
        Ok(p) => p,
        Err(e) => return error_response(&ApiError::internal(&e)),
    };
    let (tx, rx) = oneshot::channel::<Result<(), ApiError>>();
    tokio::task::spawn_blocking(move || {
        let mut tx = Some(tx);
        let r = d.exec_attached(&sandbox, &req, theirs, |_| {
            if let Some(tx) = tx.take() {
                let _ = tx.send(Ok(()));
            }
            Ok(())
        });
        if let (Err(e), Some(tx)) = (r, tx.take()) {
            let _ = tx.send(Err(ApiError::from(e)));
        }
    });
    match rx.await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => return error_response(&e),
        Err(_) => return error_response(&ApiError::new(ErrorKind::Internal, "the exec ended before it started")),
    }
    tokio::spawn(join_upgraded(upgrade, ours));
    let mut r = respond(101, Vec::new());
    r.headers_mut().insert(CONNECTION, HeaderValue::from_static("Upgrade"));
    r.headers_mut().insert(UPGRADE, HeaderValue::from_static(UPGRADE_PROTOCOL));
    r
}

/// Answer 101 and join the upgraded connection to a TCP stream into a
/// sandbox, both ways, until both have ended.
fn port(stream: std::net::TcpStream, upgrade: hyper::upgrade::OnUpgrade) -> Response<Body> {
    if let Err(e) = stream.set_nonblocking(true) {
        return error_response(&ApiError::internal(&e));
    }
    tokio::spawn(async move {
        let Ok(upgraded) = upgrade.await else { return };
        let Ok(mut theirs) = tokio::net::TcpStream::from_std(stream) else { return };
        let mut client = TokioIo::new(upgraded);
        let _ = tokio::io::copy_bidirectional(&mut client, &mut theirs).await;
    });
    let mut r = respond(101, Vec::new());
    r.headers_mut().insert(CONNECTION, HeaderValue::from_static("Upgrade"));
    r.headers_mut().insert(UPGRADE, HeaderValue::from_static(super::http::PORT_UPGRADE));
    r
}

/// Copy between the upgraded connection and the exec's end until the exec
/// ends its stream. The client closing its side is the exec's EOF (which
/// kills the command, as a vanished client does).
async fn join_upgraded(upgrade: hyper::upgrade::OnUpgrade, ours: StdUnixStream) {
    // Dropping `ours` on any failure ends the exec's stream.
    let Ok(upgraded) = upgrade.await else { return };
    if ours.set_nonblocking(true).is_err() {
        return;
    }
    let Ok(ours) = UnixStream::from_std(ours) else { return };
    let (mut exec_r, mut exec_w) = ours.into_split();
    let (mut client_r, mut client_w) = tokio::io::split(TokioIo::new(upgraded));
    let input = tokio::spawn(async move {
        let _ = tokio::io::copy(&mut client_r, &mut exec_w).await;
        // Dropping the write half shuts the exec's input down.
    });
    let _ = tokio::io::copy(&mut exec_r, &mut client_w).await;
    let _ = client_w.shutdown().await;
    input.abort();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inline_execs_leave_one_worker_free_and_come_back() {
        let slots = InlineExecs::new(3);
        let (a, b) = (slots.take(), slots.take());
        assert!(a.is_some() && b.is_some());
        assert!(slots.take().is_none(), "a third of three workers");
        drop(a);
        assert!(slots.take().is_some(), "a slot given back is taken again");
        assert!(InlineExecs::new(1).take().is_none(), "the only worker never waits on an exec");
    }
}
