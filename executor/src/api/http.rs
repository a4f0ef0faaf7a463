//! Minimal HTTP/1.1 over a Unix socket: read one request (head + body with
//! Content-Length), write one response. No I/O beyond the socket; routing is
//! elsewhere. Keep-alive is the HTTP/1.1 default; chunked request bodies are
//! refused (no client of ours sends them).

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;

/// Largest request head and body accepted.
pub const MAX_HEAD: usize = 64 * 1024;
pub const MAX_BODY: usize = 1 << 20;

#[derive(Debug)]
pub struct Request {
    pub method: String,
    pub path: String,
    pub query: String,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    pub keep_alive: bool,
}

impl Request {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }

    pub fn query_param(&self, key: &str) -> Option<String> {
        self.query.split('&').find_map(|kv| {
            let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
            (k == key).then(|| percent_decode(v))
        })
    }
}

/// A request that could not be read; `status` is what to answer (if the
/// connection is still usable at all).
#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    #[error("connection closed")]
    Closed,
    #[error("read request")]
    Io(#[from] std::io::Error),
    #[error("{message}")]
    Bad { status: u16, message: String },
}

fn bad(status: u16, message: impl Into<String>) -> HttpError {
    HttpError::Bad { status, message: message.into() }
}

pub fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' && i + 2 < b.len() {
            let hex = |c: u8| (c as char).to_digit(16);
            if let (Some(h), Some(l)) = (hex(b[i + 1]), hex(b[i + 2])) {
                out.push((h * 16 + l) as u8);
                i += 3;
                continue;
            }
        }
        out.push(if b[i] == b'+' { b' ' } else { b[i] });
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Read the next request. `Err(Closed)` when the peer closed between requests.
pub fn read_request(r: &mut BufReader<UnixStream>) -> Result<Request, HttpError> {
    let mut head = Vec::with_capacity(512);
    loop {
        let before = head.len();
        let n = r.by_ref().take((MAX_HEAD + 1 - head.len()) as u64).read_until(b'\n', &mut head)?;
        if n == 0 {
            if head.is_empty() {
                return Err(HttpError::Closed);
            }
            return Err(bad(400, "truncated request head"));
        }
        if head.len() > MAX_HEAD {
            return Err(bad(431, format!("request head exceeds {MAX_HEAD} bytes")));
        }
        let line = &head[before..];
        if line == b"\r\n" || line == b"\n" {
            if before == 0 {
                // Tolerate stray blank lines between requests (RFC 9112 §2.2).
                head.clear();
                continue;
            }
            break;
        }
    }
    let mut hbuf = [httparse::EMPTY_HEADER; 64];
    let mut req = httparse::Request::new(&mut hbuf);
    match req.parse(&head) {
        Ok(httparse::Status::Complete(_)) => {}
        Ok(httparse::Status::Partial) => return Err(bad(400, "incomplete request head")),
        Err(e) => return Err(bad(400, format!("malformed request: {e}"))),
    }
    let method = req.method.unwrap_or("").to_string();
    let target = req.path.unwrap_or("/");
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    let headers: Vec<(String, String)> =
        req.headers.iter().map(|h| (h.name.to_string(), String::from_utf8_lossy(h.value).into_owned())).collect();
    let version = req.version.unwrap_or(1);
    let mut out = Request {
        method,
        path: path.to_string(),
        query: query.to_string(),
        headers,
        body: Vec::new(),
        keep_alive: version == 1,
    };
    if let Some(c) = out.header("connection") {
        let c = c.to_ascii_lowercase();
        if c.contains("close") {
            out.keep_alive = false;
        } else if c.contains("keep-alive") {
            out.keep_alive = true;
        }
    }
    if out.header("transfer-encoding").is_some() {
        return Err(bad(411, "chunked request bodies are not supported; send Content-Length"));
    }
    // Two lengths make the body's end ambiguous (request smuggling; RFC
    // 9112 §6.3): refused, even when they agree.
    if out.headers.iter().filter(|(k, _)| k.eq_ignore_ascii_case("content-length")).count() > 1 {
        return Err(bad(400, "more than one Content-Length header"));
    }
    let len = match out.header("content-length") {
        None => 0,
        Some(v) => v.trim().parse::<usize>().map_err(|_| bad(400, format!("bad Content-Length {v:?}")))?,
    };
    if len > MAX_BODY {
        return Err(bad(413, format!("request body of {len} bytes exceeds {MAX_BODY}")));
    }
    out.body = vec![0; len];
    r.read_exact(&mut out.body).map_err(|_| bad(400, "truncated request body"))?;
    Ok(out)
}

pub fn reason(status: u16) -> &'static str {
    match status {
        101 => "Switching Protocols",
        200 => "OK",
        201 => "Created",
        204 => "No Content",
        400 => "Bad Request",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        409 => "Conflict",
        411 => "Length Required",
        413 => "Payload Too Large",
        429 => "Too Many Requests",
        431 => "Request Header Fields Too Large",
        502 => "Bad Gateway",
        507 => "Insufficient Storage",
        _ => "Internal Server Error",
    }
}

pub fn write_response(w: &mut impl Write, status: u16, body: &[u8], keep_alive: bool) -> std::io::Result<()> {
    write_response_with(w, status, body, keep_alive, &[])
}

/// [`write_response`] with extra headers (e.g. `Allow` on a 405).
pub fn write_response_with(
    w: &mut impl Write,
    status: u16,
    body: &[u8],
    keep_alive: bool,
    extra: &[(&str, &str)],
) -> std::io::Result<()> {
    let mut head = format!("HTTP/1.1 {status} {}\r\n", reason(status));
    for (k, v) in extra {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    if !body.is_empty() {
        head.push_str("Content-Type: application/json\r\n");
    }
    head.push_str(&format!("Content-Length: {}\r\n", body.len()));
    if !keep_alive {
        head.push_str("Connection: close\r\n");
    }
    head.push_str("\r\n");
    let mut all = head.into_bytes();
    all.extend_from_slice(body);
    w.write_all(&all)?;
    w.flush()
}

pub const UPGRADE_PROTOCOL: &str = "strata-exec";

pub fn write_upgrade(w: &mut impl Write) -> std::io::Result<()> {
    w.write_all(
        format!("HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: {UPGRADE_PROTOCOL}\r\n\r\n")
            .as_bytes(),
    )?;
    w.flush()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(raw: &[u8]) -> Result<Request, HttpError> {
        let (mut a, b) = UnixStream::pair().unwrap();
        a.write_all(raw).unwrap();
        drop(a);
        read_request(&mut BufReader::new(b))
    }

    #[test]
    fn parses_request_with_body_and_query() {
        let r = parse(b"POST /v1/x?stream=1&a=b%20c HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}").unwrap();
        assert_eq!((r.method.as_str(), r.path.as_str()), ("POST", "/v1/x"));
        assert_eq!(r.query_param("a").as_deref(), Some("b c"));
        assert_eq!(r.body, b"{}");
        assert!(r.keep_alive);
    }

    #[test]
    fn refuses_bad_requests() {
        let status = |raw: &[u8]| match parse(raw) {
            Err(HttpError::Bad { status, .. }) => status,
            other => panic!("{other:?}"),
        };
        assert_eq!(status(b"GARBAGE\r\n\r\n"), 400);
        assert_eq!(status(b"POST / HTTP/1.1\r\nContent-Length: x\r\n\r\n"), 400);
        assert_eq!(status(b"POST / HTTP/1.1\r\nContent-Length: 99999999\r\n\r\n"), 413);
        assert_eq!(status(b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"), 411);
        assert_eq!(status(b"POST / HTTP/1.1\r\nContent-Length: 5\r\n\r\nab"), 400);
        assert_eq!(status(b"POST / HTTP/1.1\r\nContent-Length: 2\r\nContent-Length: 5\r\n\r\n{}abc"), 400);
        assert_eq!(status(b"POST / HTTP/1.1\r\nContent-Length: 2\r\ncontent-length: 2\r\n\r\n{}"), 400);
        let huge = format!("GET / HTTP/1.1\r\nX: {}\r\n\r\n", "a".repeat(MAX_HEAD));
        assert_eq!(status(huge.as_bytes()), 431);
        assert!(matches!(parse(b""), Err(HttpError::Closed)));
    }

    #[test]
    fn percent_decoding() {
        assert_eq!(percent_decode("busybox%3Alatest"), "busybox:latest");
        assert_eq!(percent_decode("a%2"), "a%2");
    }
}
