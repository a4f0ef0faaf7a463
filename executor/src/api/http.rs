//! The request as routing sees it: method, path, query, headers and the
//! whole body, already read (by `serve`, under its size and time limits).
//! Nothing here does I/O.

/// Largest request head and body accepted.
pub const MAX_HEAD: usize = 64 * 1024;
pub const MAX_BODY: usize = 1 << 20;

/// The `Upgrade` protocol of an attached exec (frames both ways after 101).
pub const UPGRADE_PROTOCOL: &str = "strata-exec";
/// The `Upgrade` protocol of a port stream (`GET /v1/sandboxes/{id}/ports/{port}`).
pub const PORT_UPGRADE: &str = "tcp";

#[derive(Debug, Default)]
pub struct Request {
    pub method: String,
    pub path: String,
    pub query: String,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Request {
    /// From hyper's parts and the body read so far. Header values that are
    /// not UTF-8 are read lossily (no route takes such a header).
    pub fn from_parts(parts: &::http::request::Parts, body: Vec<u8>) -> Request {
        Request {
            method: parts.method.as_str().to_string(),
            path: parts.uri.path().to_string(),
            query: parts.uri.query().unwrap_or("").to_string(),
            headers: parts
                .headers
                .iter()
                .map(|(k, v)| (k.as_str().to_string(), String::from_utf8_lossy(v.as_bytes()).into_owned()))
                .collect(),
            body,
        }
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }

    pub fn query_param(&self, key: &str) -> Option<String> {
        self.query_params(key).into_iter().next()
    }

    /// Every value of a repeated query parameter, in order.
    pub fn query_params(&self, key: &str) -> Vec<String> {
        self.query
            .split('&')
            .filter_map(|kv| {
                let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
                (k == key).then(|| percent_decode(v))
            })
            .collect()
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_and_headers() {
        let (parts, ()) = ::http::Request::builder()
            .method("POST")
            .uri("/v1/x?stream=1&a=b%20c")
            .header("X-Thing", "yes")
            .body(())
            .unwrap()
            .into_parts();
        let r = Request::from_parts(&parts, b"{}".to_vec());
        assert_eq!((r.method.as_str(), r.path.as_str()), ("POST", "/v1/x"));
        assert_eq!(r.query_param("a").as_deref(), Some("b c"));
        assert_eq!(r.header("x-thing"), Some("yes"));
        assert_eq!(r.body, b"{}");
    }

    #[test]
    fn percent_decoding() {
        assert_eq!(percent_decode("busybox%3Alatest"), "busybox:latest");
        assert_eq!(percent_decode("a%2"), "a%2");
    }
}
