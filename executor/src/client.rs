//! A small blocking client for the daemon's API, used by the CLI, the
//! integration tests and the benchmark. One `Client` is one kept-alive
//! connection.

use std::io::{BufReader, Read};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::types::ErrorBody;

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("connect to strata daemon at {path} (is `strata daemon` running? set --socket or STRATA_SOCKET)")]
    Connect {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("talk to daemon")]
    Io(#[from] std::io::Error),
    #[error("talk to daemon")]
    Http(#[from] hyper::Error),
    #[error("bad response from daemon: {0}")]
    Protocol(String),
    #[error("{message}")]
    Api { status: u16, code: String, message: String },
}

impl ClientError {
    pub fn status(&self) -> Option<u16> {
        match self {
            ClientError::Api { status, .. } => Some(*status),
            _ => None,
        }
    }
}

pub struct Client {
    /// Drives the connection while a call waits (a current-thread runtime:
    /// the CLI and the tests call from plain threads).
    rt: tokio::runtime::Runtime,
    send: hyper::client::conn::http1::SendRequest<Full<Bytes>>,
}

pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

type Io = hyper_util::rt::TokioIo<tokio::net::UnixStream>;

impl Client {
    pub fn connect(path: &Path) -> Result<Client, ClientError> {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        let send = rt.block_on(async {
            let s = tokio::net::UnixStream::connect(path)
                .await
                .map_err(|source| ClientError::Connect { path: path.into(), source })?;
            let (send, conn) = hyper::client::conn::http1::handshake::<Io, Full<Bytes>>(TokioIo::new(s)).await?;
            tokio::spawn(conn.with_upgrades());
            Ok::<_, ClientError>(send)
        })?;
        Ok(Client { rt, send })
    }

    /// Send one request and return the response with its body unread.
    fn send(
        &mut self,
        method: &str,
        path: &str,
        body: Vec<u8>,
        headers: &[(&str, &str)],
    ) -> Result<hyper::Response<Incoming>, ClientError> {
        let method = hyper::Method::from_bytes(method.as_bytes())
            .map_err(|e| ClientError::Protocol(format!("method {method:?}: {e}")))?;
        let mut req = hyper::Request::builder().method(method).uri(path).header(hyper::header::HOST, "strata");
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let req = req.body(Full::new(Bytes::from(body))).map_err(|e| ClientError::Protocol(e.to_string()))?;
        let send = &mut self.send;
        Ok(self.rt.block_on(async move {
            send.ready().await?;
            send.send_request(req).await
        })?)
    }

    fn read(&mut self, r: hyper::Response<Incoming>) -> Result<Response, ClientError> {
        let (parts, body) = r.into_parts();
        let body = self.rt.block_on(body.collect())?.to_bytes().to_vec();
        let headers = parts
            .headers
            .iter()
            .map(|(k, v)| (k.as_str().to_string(), String::from_utf8_lossy(v.as_bytes()).into_owned()))
            .collect();
        Ok(Response { status: parts.status.as_u16(), headers, body })
    }

    /// Send raw bytes as a request body, with extra `Name: value` headers
    /// (for tests of malformed input).
    pub fn raw(
        &mut self,
        method: &str,
        path: &str,
        body: &[u8],
        extra_headers: &[(&str, &str)],
    ) -> Result<Response, ClientError> {
        let r = self.send(method, path, body.to_vec(), extra_headers)?;
        self.read(r)
    }

    /// A request answered with a progress stream (`progress: true` on push
    /// and pull): `on_progress` sees each progress line, the last line is
    /// the result (or the error).
    pub fn call_streamed<T: DeserializeOwned>(
        &mut self,
        path: &str,
        body: &impl Serialize,
        on_progress: &mut dyn FnMut(crate::types::Progress),
    ) -> Result<T, ClientError> {
        let bytes = serde_json::to_vec(body).map_err(|e| ClientError::Protocol(e.to_string()))?;
        let r = self.send("POST", path, bytes, &[("content-type", "application/json")])?;
        let ndjson = r
            .headers()
            .get(hyper::header::CONTENT_TYPE)
            .is_some_and(|v| v.as_bytes().starts_with(b"application/x-ndjson"));
        if !ndjson {
            let b = check(self.read(r)?)?;
            return serde_json::from_slice(&b).map_err(|e| ClientError::Protocol(format!("decode response: {e}")));
        }
        #[derive(serde::Deserialize)]
        struct Line {
            progress: Option<crate::types::Progress>,
            status: Option<u16>,
            result: Option<serde_json::Value>,
            error: Option<crate::types::ErrorDetail>,
        }
        let mut body = r.into_body();
        let mut pending: Vec<u8> = Vec::new();
        loop {
            let Some(end) = pending.iter().position(|b| *b == b'\n') else {
                match self.rt.block_on(body.frame()) {
                    None => return Err(ClientError::Protocol("progress stream ended without a result".into())),
                    Some(frame) => {
                        if let Ok(data) = frame?.into_data() {
                            pending.extend_from_slice(&data);
                        }
                        continue;
                    }
                }
            };
            let line: Vec<u8> = pending.drain(..=end).collect();
            let l: Line =
                serde_json::from_slice(&line).map_err(|e| ClientError::Protocol(format!("decode progress: {e}")))?;
            if let Some(p) = l.progress {
                on_progress(p);
                continue;
            }
            if let Some(e) = l.error {
                return Err(ClientError::Api { status: l.status.unwrap_or(500), code: e.code, message: e.message });
            }
            let v = l.result.unwrap_or_default();
            return serde_json::from_value(v).map_err(|e| ClientError::Protocol(format!("decode response: {e}")));
        }
    }

    /// One request; a non-2xx answer becomes [`ClientError::Api`].
    pub fn request(&mut self, method: &str, path: &str, body: Option<&impl Serialize>) -> Result<Vec<u8>, ClientError> {
        let bytes = match body {
            Some(b) => serde_json::to_vec(b).map_err(|e| ClientError::Protocol(e.to_string()))?,
            None => Vec::new(),
        };
        let extra: &[(&str, &str)] = if bytes.is_empty() { &[] } else { &[("content-type", "application/json")] };
        let r = self.raw(method, path, &bytes, extra)?;
        check(r)
    }

    pub fn call<T: DeserializeOwned>(
        &mut self,
        method: &str,
        path: &str,
        body: Option<&impl Serialize>,
    ) -> Result<T, ClientError> {
        let bytes = self.request(method, path, body)?;
        serde_json::from_slice(&bytes).map_err(|e| ClientError::Protocol(format!("decode response: {e}")))
    }

    /// Start an attached exec; on success the connection is upgraded and
    /// returned as a frame stream (see `stream.rs`). The reader keeps any
    /// frames that arrived together with the 101.
    pub fn attach(mut self, path: &str, body: &impl Serialize) -> Result<Attached, ClientError> {
        let bytes = serde_json::to_vec(body).map_err(|e| ClientError::Protocol(e.to_string()))?;
        let headers = [
            ("content-type", "application/json"),
            ("connection", "Upgrade"),
            ("upgrade", crate::api::http::UPGRADE_PROTOCOL),
        ];
        let (early, stream) = self.upgrade("POST", path, bytes, &headers)?;
        Ok(Attached { reader: BufReader::new(early.chain(stream.try_clone()?)), writer: stream })
    }

    /// A stream to a sandbox's TCP port (`strata port`): what arrived with
    /// the 101, and the connection.
    pub fn port(mut self, id: &str, port: u16) -> Result<(std::io::Cursor<Vec<u8>>, UnixStream), ClientError> {
        let headers = [("connection", "Upgrade"), ("upgrade", crate::api::http::PORT_UPGRADE)];
        self.upgrade("GET", &format!("/v1/sandboxes/{id}/ports/{port}"), Vec::new(), &headers)
    }

    fn upgrade(
        &mut self,
        method: &str,
        path: &str,
        body: Vec<u8>,
        headers: &[(&str, &str)],
    ) -> Result<(std::io::Cursor<Vec<u8>>, UnixStream), ClientError> {
        let r = self.send(method, path, body, headers)?;
        if r.status() != hyper::StatusCode::SWITCHING_PROTOCOLS {
            check(self.read(r)?)?;
            return Err(ClientError::Protocol("daemon did not upgrade the connection".into()));
        }
        let upgraded = self.rt.block_on(hyper::upgrade::on(r))?;
        let parts = upgraded
            .downcast::<Io>()
            .map_err(|_| ClientError::Protocol("upgraded connection of an unexpected type".into()))?;
        let stream = parts.io.into_inner().into_std()?;
        stream.set_nonblocking(false)?;
        Ok((std::io::Cursor::new(parts.read_buf.to_vec()), stream))
    }
}

/// An upgraded exec connection: read frames from `reader`, write to `writer`.
pub struct Attached {
    pub reader: BufReader<std::io::Chain<std::io::Cursor<Vec<u8>>, UnixStream>>,
    pub writer: UnixStream,
}

fn check(r: Response) -> Result<Vec<u8>, ClientError> {
    if (200..300).contains(&r.status) {
        return Ok(r.body);
    }
    match serde_json::from_slice::<ErrorBody>(&r.body) {
        Ok(e) => Err(ClientError::Api { status: r.status, code: e.error.code, message: e.error.message }),
        Err(_) => Err(ClientError::Api {
            status: r.status,
            code: "unknown".into(),
            message: String::from_utf8_lossy(&r.body).into_owned(),
        }),
    }
}
