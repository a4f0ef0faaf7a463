//! envd's `/files`: `GET ?path=` (the file's bytes) and `POST` (multipart
//! parts named by their filename, or one octet-stream body at `?path=`,
//! gzip allowed), streamed between the connection and the sandbox's file:
//! a transfer holds a few chunks in memory whatever the file's size
//! ([`CHUNK`] × [`QUEUE`]), and an upload is bounded by the sandbox's disk
//! (507 once it is full, as envd answers).
//!
//! A transfer runs on a blocking thread of its own while the connection's
//! task goes on reading the body (a handler blocking that task would stall
//! the very body it reads): the thread pulls chunks through the runtime's
//! handle, each within [`IDLE`]. A file an upload made is removed again if
//! the upload fails (envd leaves it half written); one it overwrote keeps
//! what was written, as envd's does.

use std::io::Read;
use std::sync::Mutex;
use std::time::Duration;

use bytes::{Buf, Bytes};
use futures_util::StreamExt;
use http_body_util::BodyDataStream;
use hyper::body::Incoming;
use serde_json::Value;
use tokio::sync::mpsc;

use super::connect::{Code, RpcError};
use super::{fs, Envd, Resp};
use crate::daemon::lock;

/// How long a transfer may move nothing (an upload's client sending, a
/// download's reading) before it is given up.
pub const IDLE: Duration = Duration::from_secs(60);
/// Bytes read or written at once.
const CHUNK: usize = 256 << 10;
/// Chunks of a download queued for a slow client.
const QUEUE: usize = 4;
/// How long the rest of a refused upload is read (and dropped) before its
/// answer: a client still sending would meet a closed connection (EPIPE)
/// instead of the 507 it is owed. Past this the connection is closed.
const DRAIN: Duration = Duration::from_secs(30);

/// What a `/files` request brings besides its head: its body, unread, and
/// the transfer permit it holds until the transfer ends.
pub struct Transfer {
    body: Mutex<Option<Incoming>>,
    permit: Mutex<Option<tokio::sync::OwnedSemaphorePermit>>,
    rt: tokio::runtime::Handle,
}

impl Transfer {
    /// Made on the connection's task (it takes that runtime's handle).
    pub fn new(body: Incoming, permit: Option<tokio::sync::OwnedSemaphorePermit>) -> Transfer {
        Transfer { body: Mutex::new(Some(body)), permit: Mutex::new(permit), rt: tokio::runtime::Handle::current() }
    }

    /// A body no one read (the upload was refused before it started):
    /// read through and dropped, as [`after_failure`] does.
    fn discard_unread(&self) {
        if let Some(body) = lock(&self.body).take() {
            let until = tokio::time::Instant::now() + DRAIN;
            Chunks::new(self, Source::Body(BodyDataStream::new(body))).discard(until);
        }
    }

    fn body(&self) -> Result<BodyDataStream<Incoming>, RpcError> {
        let body = lock(&self.body).take().ok_or_else(|| RpcError::internal("the upload was read already"))?;
        Ok(BodyDataStream::new(body))
    }

    /// `fut` on the runtime, within [`IDLE`].
    fn wait<T>(&self, fut: impl std::future::Future<Output = T>) -> std::io::Result<T> {
        // (The timer is made on the runtime: it needs its context.)
        self.rt.block_on(async { tokio::time::timeout(IDLE, fut).await }).map_err(|_| {
            std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("the upload sent nothing for {} s", IDLE.as_secs()),
            )
        })
    }
}

/// Where an upload's bytes come from: the whole body, or one file part.
enum Source {
    Body(BodyDataStream<Incoming>),
    Part(Box<multer::Field<'static>>),
}

/// A [`Source`] as a [`Read`], chunk by chunk.
struct Chunks<'a> {
    transfer: &'a Transfer,
    src: Source,
    buf: Bytes,
}

impl<'a> Chunks<'a> {
    fn new(transfer: &'a Transfer, src: Source) -> Chunks<'a> {
        Chunks { transfer, src, buf: Bytes::new() }
    }

    /// Read what is left of the source and drop it, until its end or
    /// `until`; whether the end came.
    fn discard(&mut self, until: tokio::time::Instant) -> bool {
        self.buf = Bytes::new();
        let src = &mut self.src;
        self.transfer
            .rt
            .block_on(async {
                tokio::time::timeout_at(until, async {
                    loop {
                        let more = match src {
                            Source::Body(b) => matches!(b.next().await, Some(Ok(_))),
                            Source::Part(f) => matches!(f.chunk().await, Ok(Some(_))),
                        };
                        if !more {
                            return;
                        }
                    }
                })
                .await
            })
            .is_ok()
    }
}

/// After an upload failed for a reason of ours (not the client's stall):
/// let the client finish sending, so it reads the answer ([`DRAIN`]).
fn after_failure(e: RpcError, src: &mut Chunks<'_>, parts: Option<&mut multer::Multipart<'static>>) -> RpcError {
    if e.code == Code::DeadlineExceeded {
        return e;
    }
    let until = tokio::time::Instant::now() + DRAIN;
    if src.discard(until) {
        if let Some(parts) = parts {
            // The parts after it, read through and dropped.
            let rt = &src.transfer.rt;
            while let Ok(Ok(Some(field))) =
                rt.block_on(async { tokio::time::timeout_at(until, parts.next_field()).await })
            {
                if !Chunks::new(src.transfer, Source::Part(Box::new(field))).discard(until) {
                    break;
                }
            }
        }
    }
    e
}

impl Read for Chunks<'_> {
    fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
        while self.buf.is_empty() {
            let next = match &mut self.src {
                Source::Body(b) => self.transfer.wait(b.next())?.map(|r| r.map_err(|e| e.to_string())),
                Source::Part(f) => self.transfer.wait(f.chunk())?.map_err(|e| e.to_string()).transpose(),
            };
            match next {
                None => return Ok(0),
                Some(Err(e)) => return Err(std::io::Error::other(format!("read the upload: {e}"))),
                Some(Ok(b)) => self.buf = b,
            }
        }
        let n = out.len().min(self.buf.len());
        out[..n].copy_from_slice(&self.buf[..n]);
        self.buf.advance(n);
        Ok(n)
    }
}

/// How a failed transfer is answered: envd's 507 for a full disk, 408
/// for an upload that stalled, else the code's status.
pub fn refused(e: RpcError) -> Resp {
    let status = match e.code {
        Code::ResourceExhausted => 507,
        Code::DeadlineExceeded => 408,
        c => c.status(),
    };
    Resp::error(status, &e.message)
}

impl Envd<'_> {
    /// Serve `/files` (as the request's user: the caller switched to it).
    pub(super) fn files(&self) -> Result<Resp, RpcError> {
        let req = self.req;
        let transfer = req.transfer.as_ref().ok_or_else(|| RpcError::internal("/files without its transfer"))?;
        match req.method.as_str() {
            "GET" => {
                let p = fs::absolute(&req.query("path").unwrap_or_default(), self.user)?;
                let (file, size) = self.tree.open_file(&p)?;
                Ok(download(file, size, transfer))
            }
            "POST" => self.upload(transfer).inspect_err(|_| transfer.discard_unread()),
            m => Ok(Resp::error(405, &format!("method {m} not allowed on /files (GET, POST)"))),
        }
    }

    /// `POST /files`: each file of the body written as it arrives.
    fn upload(&self, transfer: &Transfer) -> Result<Resp, RpcError> {
        let req = self.req;
        let meta = upload_metadata(&req.headers)?;
        let ctype = req.header("content-type").unwrap_or("");
        let mut written = Vec::new();
        if let Some(boundary) = multipart_boundary(ctype) {
            let mut parts = multer::Multipart::new(transfer.body()?, boundary);
            loop {
                let field = transfer
                    .wait(parts.next_field())
                    .map_err(|e| RpcError::new(Code::DeadlineExceeded, e.to_string()))?
                    .map_err(|e| RpcError::invalid(format!("multipart body: {e}")))?;
                let Some(field) = field else { break };
                // Parts without a filename are form fields, not files.
                let Some(name) = field.file_name().map(String::from) else { continue };
                let path = req.query("path").filter(|_| name.is_empty()).unwrap_or(name);
                let p = fs::absolute(&path, self.user)?;
                let mut src = Chunks::new(transfer, Source::Part(Box::new(field)));
                match self.tree.write_from(&p, &mut src, &meta) {
                    Ok(w) => written.push(w),
                    Err(e) => return Err(after_failure(e, &mut src, Some(&mut parts))),
                }
            }
        } else {
            let p = fs::absolute(&req.query("path").unwrap_or_default(), self.user)?;
            let mut src = Chunks::new(transfer, Source::Body(transfer.body()?));
            let gzip = req.header("content-encoding").is_some_and(|e| e.eq_ignore_ascii_case("gzip"));
            let w = if gzip {
                self.tree.write_from(&p, &mut flate2::read::GzDecoder::new(&mut src), &meta)
            } else {
                self.tree.write_from(&p, &mut src, &meta)
            };
            written.push(w.map_err(|e| after_failure(e, &mut src, None))?);
        }
        if written.is_empty() {
            return Err(RpcError::invalid("no file in the request"));
        }
        Ok(Resp::json(200, Value::Array(written)))
    }
}

/// `file`'s `size` bytes as a streamed body, read by a thread of its own
/// (which keeps the transfer's permit until the body is sent, dropped, or
/// its client has read nothing for [`IDLE`]). A file that shrank
/// meanwhile, or a client given up, ends the body short of its length,
/// which the client sees as a cut transfer, not as the file.
fn download(file: std::fs::File, size: u64, transfer: &Transfer) -> Resp {
    let (tx, rx) = mpsc::channel::<Bytes>(QUEUE);
    let (permit, rt) = (lock(&transfer.permit).take(), transfer.rt.clone());
    std::thread::spawn(move || {
        let _permit = permit;
        let mut file = file.take(size);
        loop {
            let mut buf = vec![0u8; CHUNK];
            match file.read(&mut buf) {
                Ok(0) => return,
                Ok(n) => {
                    buf.truncate(n);
                    match rt.block_on(async { tokio::time::timeout(IDLE, tx.send(Bytes::from(buf))).await }) {
                        Ok(Ok(())) => {}
                        Ok(Err(_)) => return,
                        Err(_) => {
                            tracing::warn!("e2b: a download's client read nothing for {} s; cut", IDLE.as_secs());
                            return;
                        }
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => {
                    tracing::warn!("e2b: download cut short: {e}");
                    return;
                }
            }
        }
    });
    let mut r = Resp::frames(rx);
    r.content_type = "application/octet-stream";
    r.headers.push(("content-length", size.to_string()));
    r
}

/// An upload's `X-Metadata-<key>: <value>` headers, keys lowercased (the
/// same for every file of the upload).
fn upload_metadata(headers: &hyper::HeaderMap) -> Result<fs::Metadata, RpcError> {
    let mut meta = fs::Metadata::new();
    for (name, value) in headers {
        // hyper gives header names lowercased.
        let Some(key) = name.as_str().strip_prefix("x-metadata-") else { continue };
        let value =
            value.to_str().map_err(|_| RpcError::invalid(format!("metadata value of {key:?}: printable ASCII")))?;
        fs::check_metadata(key, value)?;
        meta.insert(key.to_string(), value.to_string());
    }
    if meta.len() > fs::MAX_META_KEYS {
        return Err(RpcError::invalid(format!("{} metadata keys; at most {}", meta.len(), fs::MAX_META_KEYS)));
    }
    Ok(meta)
}

/// The boundary of a `multipart/form-data` body, from its content type.
fn multipart_boundary(ctype: &str) -> Option<String> {
    let (kind, params) = ctype.split_once(';')?;
    if !kind.trim().eq_ignore_ascii_case("multipart/form-data") {
        return None;
    }
    params.split(';').find_map(|p| {
        let (k, v) = p.trim().split_once('=')?;
        k.eq_ignore_ascii_case("boundary").then(|| v.trim_matches('"').to_string())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_form_data_bodies_are_multipart() {
        assert_eq!(multipart_boundary("multipart/form-data; boundary=abc").as_deref(), Some("abc"));
        assert_eq!(multipart_boundary("multipart/form-data; boundary=\"a b\"").as_deref(), Some("a b"));
        assert_eq!(multipart_boundary("application/octet-stream"), None);
    }

    #[test]
    fn a_full_disk_is_507_and_a_stalled_upload_408() {
        assert_eq!(refused(RpcError::new(Code::ResourceExhausted, "full")).status, 507);
        assert_eq!(refused(RpcError::new(Code::DeadlineExceeded, "slow")).status, 408);
        assert_eq!(refused(RpcError::not_found("gone")).status, 404);
    }
}
