//! A small blocking client for the daemon's API, used by the CLI, the
//! integration tests and the benchmark. One `Client` is one kept-alive
//! connection.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::api::types::ErrorBody;

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
    writer: UnixStream,
    reader: BufReader<UnixStream>,
}

pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Client {
    pub fn connect(path: &Path) -> Result<Client, ClientError> {
        let s = UnixStream::connect(path).map_err(|source| ClientError::Connect { path: path.into(), source })?;
        let reader = BufReader::new(s.try_clone()?);
        Ok(Client { writer: s, reader })
    }

    /// Send raw bytes as a request body (for tests of malformed input).
    pub fn raw(&mut self, method: &str, path: &str, body: &[u8], extra_headers: &str) -> Result<Response, ClientError> {
        let head = format!(
            "{method} {path} HTTP/1.1\r\nHost: strata\r\nContent-Length: {}\r\n{extra_headers}\r\n",
            body.len()
        );
        let mut msg = head.into_bytes();
        msg.extend_from_slice(body);
        self.writer.write_all(&msg)?;
        self.read_response()
    }

    fn read_response(&mut self) -> Result<Response, ClientError> {
        let (status, headers) = self.read_head()?;
        let len = headers
            .iter()
            .find(|(k, _)| k == "content-length")
            .and_then(|(_, v)| v.trim().parse::<usize>().ok())
            .unwrap_or(0);
        let mut body = vec![0; if status == 101 { 0 } else { len }];
        self.reader.read_exact(&mut body)?;
        Ok(Response { status, headers, body })
    }

    /// A request answered with a progress stream (`progress: true` on push
    /// and pull): `on_progress` sees each progress line, the last line is
    /// the result (or the error).
    pub fn call_streamed<T: DeserializeOwned>(
        &mut self,
        path: &str,
        body: &impl Serialize,
        on_progress: &mut dyn FnMut(crate::api::types::Progress),
    ) -> Result<T, ClientError> {
        let bytes = serde_json::to_vec(body).map_err(|e| ClientError::Protocol(e.to_string()))?;
        let head = format!(
            "POST {path} HTTP/1.1\r\nHost: strata\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
            bytes.len()
        );
        self.writer.write_all(head.as_bytes())?;
        self.writer.write_all(&bytes)?;
        let (status, headers) = self.read_head()?;
        let ndjson = headers.iter().any(|(k, v)| k == "content-type" && v.starts_with("application/x-ndjson"));
        if !ndjson {
            let len = headers
                .iter()
                .find(|(k, _)| k == "content-length")
                .and_then(|(_, v)| v.trim().parse::<usize>().ok())
                .unwrap_or(0);
            let mut body = vec![0; len];
            self.reader.read_exact(&mut body)?;
            let b = check(Response { status, headers, body })?;
            return serde_json::from_slice(&b).map_err(|e| ClientError::Protocol(format!("decode response: {e}")));
        }
        #[derive(serde::Deserialize)]
        struct Line {
            progress: Option<crate::api::types::Progress>,
            status: Option<u16>,
            result: Option<serde_json::Value>,
            error: Option<crate::api::types::ErrorDetail>,
        }
        let mut line = String::new();
        loop {
            line.clear();
            if self.reader.read_line(&mut line)? == 0 {
                return Err(ClientError::Protocol("progress stream ended without a result".into()));
            }
            let l: Line =
                serde_json::from_str(&line).map_err(|e| ClientError::Protocol(format!("decode progress: {e}")))?;
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

    fn read_head(&mut self) -> Result<(u16, Vec<(String, String)>), ClientError> {
        let mut head = Vec::new();
        loop {
            let n = self.reader.read_until(b'\n', &mut head)?;
            if n == 0 {
                return Err(ClientError::Protocol("connection closed before a response".into()));
            }
            if head.ends_with(b"\r\n\r\n") {
                break;
            }
            if head.len() > 64 * 1024 {
                return Err(ClientError::Protocol("response head too large".into()));
            }
        }
        let mut hbuf = [httparse::EMPTY_HEADER; 32];
        let mut resp = httparse::Response::new(&mut hbuf);
        resp.parse(&head).map_err(|e| ClientError::Protocol(e.to_string()))?;
        let status = resp.code.unwrap_or(0);
        let headers: Vec<(String, String)> = resp
            .headers
            .iter()
            .map(|h| (h.name.to_ascii_lowercase(), String::from_utf8_lossy(h.value).into_owned()))
            .collect();
        Ok((status, headers))
    }

    /// One request; a non-2xx answer becomes [`ClientError::Api`].
    pub fn request(&mut self, method: &str, path: &str, body: Option<&impl Serialize>) -> Result<Vec<u8>, ClientError> {
        let bytes = match body {
            Some(b) => serde_json::to_vec(b).map_err(|e| ClientError::Protocol(e.to_string()))?,
            None => Vec::new(),
        };
        let extra = if bytes.is_empty() { "" } else { "Content-Type: application/json\r\n" };
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
        let extra = format!("Connection: Upgrade\r\nUpgrade: {}\r\n", crate::api::http::UPGRADE_PROTOCOL);
        let r = self.raw("POST", path, &bytes, &extra)?;
        if r.status != 101 {
            check(r)?;
            return Err(ClientError::Protocol("daemon did not upgrade the connection".into()));
        }
        Ok(Attached { reader: self.reader, writer: self.writer })
    }
}

/// An upgraded exec connection: read frames from `reader`, write to `writer`.
pub struct Attached {
    pub reader: BufReader<UnixStream>,
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
