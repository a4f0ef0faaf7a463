//! The Connect protocol as envd speaks it, JSON codec only: unary calls
//! (a JSON body each way) and server streams (enveloped messages, then an
//! end-of-stream envelope that may carry an error). Client streams
//! (`StreamInput`) are a request body of envelopes read to its end.

use bytes::Bytes;
use serde_json::{json, Value};

/// A Connect error code (connectrpc.com/docs/protocol#error-codes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Code {
    Canceled,
    InvalidArgument,
    DeadlineExceeded,
    NotFound,
    AlreadyExists,
    PermissionDenied,
    ResourceExhausted,
    FailedPrecondition,
    Unimplemented,
    Internal,
    Unavailable,
    Unauthenticated,
}

impl Code {
    pub fn as_str(self) -> &'static str {
        match self {
            Code::Canceled => "canceled",
            Code::InvalidArgument => "invalid_argument",
            Code::DeadlineExceeded => "deadline_exceeded",
            Code::NotFound => "not_found",
            Code::AlreadyExists => "already_exists",
            Code::PermissionDenied => "permission_denied",
            Code::ResourceExhausted => "resource_exhausted",
            Code::FailedPrecondition => "failed_precondition",
            Code::Unimplemented => "unimplemented",
            Code::Internal => "internal",
            Code::Unavailable => "unavailable",
            Code::Unauthenticated => "unauthenticated",
        }
    }

    /// The HTTP status of a unary error (the protocol's table).
    pub fn status(self) -> u16 {
        match self {
            Code::Canceled => 499,
            Code::InvalidArgument => 400,
            Code::DeadlineExceeded => 504,
            Code::NotFound => 404,
            Code::AlreadyExists => 409,
            Code::PermissionDenied => 403,
            Code::ResourceExhausted => 429,
            Code::FailedPrecondition => 412,
            Code::Unimplemented => 501,
            Code::Internal => 500,
            Code::Unavailable => 503,
            Code::Unauthenticated => 401,
        }
    }
}

/// An RPC's error: its code and a message for the caller.
#[derive(Debug, Clone, PartialEq)]
pub struct RpcError {
    pub code: Code,
    pub message: String,
}

impl RpcError {
    pub fn new(code: Code, message: impl Into<String>) -> RpcError {
        RpcError { code, message: message.into() }
    }
    pub fn invalid(message: impl Into<String>) -> RpcError {
        RpcError::new(Code::InvalidArgument, message)
    }
    pub fn not_found(message: impl Into<String>) -> RpcError {
        RpcError::new(Code::NotFound, message)
    }
    pub fn internal(message: impl Into<String>) -> RpcError {
        RpcError::new(Code::Internal, message)
    }
    /// `{"code": "...", "message": "..."}`: a unary error's body, and
    /// the `error` of an end-of-stream envelope.
    pub fn to_json(&self) -> Value {
        json!({"code": self.code.as_str(), "message": self.message})
    }
}

/// The largest message accepted in a request envelope.
pub const MAX_MESSAGE: usize = 16 << 20;

const FLAG_COMPRESSED: u8 = 0x01;
const FLAG_END: u8 = 0x02;

fn envelope(flags: u8, body: &[u8]) -> Bytes {
    let mut b = Vec::with_capacity(5 + body.len());
    b.push(flags);
    b.extend_from_slice(&(body.len() as u32).to_be_bytes());
    b.extend_from_slice(body);
    Bytes::from(b)
}

/// One message of a stream.
pub fn message(v: &Value) -> Bytes {
    envelope(0, v.to_string().as_bytes())
}

/// The end of a stream: `{}`, or `{"error": ...}`.
pub fn end(error: Option<&RpcError>) -> Bytes {
    let v = match error {
        None => json!({}),
        Some(e) => json!({ "error": e.to_json() }),
    };
    envelope(FLAG_END, v.to_string().as_bytes())
}

/// The messages of a request body of envelopes (a stream's request:
/// exactly one for a server stream, any number for a client stream).
pub fn messages(mut body: &[u8]) -> Result<Vec<Value>, RpcError> {
    let mut out = Vec::new();
    while !body.is_empty() {
        if body.len() < 5 {
            return Err(RpcError::invalid("truncated envelope"));
        }
        let flags = body[0];
        let len = u32::from_be_bytes([body[1], body[2], body[3], body[4]]) as usize;
        if flags & FLAG_COMPRESSED != 0 {
            return Err(RpcError::new(Code::Unimplemented, "compressed messages are not supported"));
        }
        if len > MAX_MESSAGE || body.len() - 5 < len {
            return Err(RpcError::invalid(format!("envelope of {len} bytes is truncated or too large")));
        }
        let msg = &body[5..5 + len];
        body = &body[5 + len..];
        if flags & FLAG_END != 0 {
            break;
        }
        out.push(parse(msg)?);
    }
    Ok(out)
}

/// A request message in proto3 JSON (an object; empty is `{}`).
pub fn parse(body: &[u8]) -> Result<Value, RpcError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(json!({}));
    }
    match serde_json::from_slice::<Value>(body) {
        Ok(v @ Value::Object(_)) => Ok(v),
        Ok(_) => Err(RpcError::invalid("the request message must be a JSON object")),
        Err(e) => Err(RpcError::invalid(format!("invalid JSON message: {e}"))),
    }
}

/// Proto3 JSON readers: a missing field (or `null`) is its zero value.
pub mod field {
    use base64::Engine;
    use serde_json::Value;

    use super::RpcError;

    pub fn str<'a>(v: &'a Value, key: &str) -> Result<&'a str, RpcError> {
        match v.get(key) {
            None | Some(Value::Null) => Ok(""),
            Some(Value::String(s)) => Ok(s),
            Some(_) => Err(RpcError::invalid(format!("{key} must be a string"))),
        }
    }

    pub fn opt_str<'a>(v: &'a Value, key: &str) -> Result<Option<&'a str>, RpcError> {
        match v.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(_) => Err(RpcError::invalid(format!("{key} must be a string"))),
        }
    }

    /// An unsigned integer, as a number or (int64 style) a string.
    pub fn uint(v: &Value, key: &str) -> Result<u64, RpcError> {
        match v.get(key) {
            None | Some(Value::Null) => Ok(0),
            Some(Value::Number(n)) => n.as_u64().ok_or_else(|| RpcError::invalid(format!("{key} must be unsigned"))),
            Some(Value::String(s)) => s.parse().map_err(|_| RpcError::invalid(format!("{key} must be unsigned"))),
            Some(_) => Err(RpcError::invalid(format!("{key} must be a number"))),
        }
    }

    pub fn bool(v: &Value, key: &str) -> Result<bool, RpcError> {
        match v.get(key) {
            None | Some(Value::Null) => Ok(false),
            Some(Value::Bool(b)) => Ok(*b),
            Some(_) => Err(RpcError::invalid(format!("{key} must be true or false"))),
        }
    }

    /// A `bytes` field (standard or URL-safe base64, padding optional).
    pub fn bytes(v: &Value, key: &str) -> Result<Vec<u8>, RpcError> {
        let s = str(v, key)?;
        let e = base64::engine::general_purpose::STANDARD_NO_PAD;
        let u = base64::engine::general_purpose::URL_SAFE_NO_PAD;
        let t = s.trim_end_matches('=');
        e.decode(t).or_else(|_| u.decode(t)).map_err(|_| RpcError::invalid(format!("{key} is not base64")))
    }

    /// A `map<string, string>` field.
    pub fn map(v: &Value, key: &str) -> Result<Vec<(String, String)>, RpcError> {
        match v.get(key) {
            None | Some(Value::Null) => Ok(Vec::new()),
            Some(Value::Object(m)) => m
                .iter()
                .map(|(k, v)| match v {
                    Value::String(s) => Ok((k.clone(), s.clone())),
                    _ => Err(RpcError::invalid(format!("{key}.{k} must be a string"))),
                })
                .collect(),
            Some(_) => Err(RpcError::invalid(format!("{key} must be an object"))),
        }
    }

    pub fn base64(data: &[u8]) -> String {
        base64::engine::general_purpose::STANDARD.encode(data)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envelopes_round_trip_and_the_end_carries_the_error() {
        let mut body = message(&json!({"a": 1})).to_vec();
        body.extend_from_slice(&message(&json!({"b": 2})));
        body.extend_from_slice(&end(None));
        assert_eq!(messages(&body).unwrap(), vec![json!({"a": 1}), json!({"b": 2})]);
        let e = end(Some(&RpcError::not_found("no such process")));
        assert_eq!(e[0], FLAG_END);
        let v: Value = serde_json::from_slice(&e[5..]).unwrap();
        assert_eq!(v, json!({"error": {"code": "not_found", "message": "no such process"}}));
    }

    #[test]
    fn bad_envelopes_are_refused() {
        assert!(messages(&[0, 0, 0, 0]).is_err());
        assert!(messages(&[0, 0, 0, 0, 9, b'{']).is_err());
        assert!(messages(&[FLAG_COMPRESSED, 0, 0, 0, 2, b'{', b'}']).is_err());
        assert!(messages(&[0, 0, 0, 0, 2, b'[', b']']).is_err());
    }

    #[test]
    fn proto3_fields_default_and_check_their_types() {
        let v = json!({"pid": "12", "n": 3, "s": "x", "b": "aGk=", "m": {"A": "1"}});
        assert_eq!(field::uint(&v, "pid").unwrap(), 12);
        assert_eq!(field::uint(&v, "missing").unwrap(), 0);
        assert_eq!(field::bytes(&v, "b").unwrap(), b"hi");
        assert_eq!(field::map(&v, "m").unwrap(), vec![("A".into(), "1".into())]);
        assert!(field::str(&v, "n").is_err());
        assert!(!field::bool(&v, "missing").unwrap());
    }
}
