//! Unit tests of `api`.

use std::time::Duration;

use super::*;

#[test]
fn an_idempotency_fingerprint_holds_no_secret_value() {
    let with = |v: &str| format!(r#"{{"image": "a", "secret_env": ["TOKEN={v}"], "env": ["A=1"]}}"#);
    let (a, b) = (with("one"), with("two"));
    let cut = without_secret_values(a.as_bytes());
    assert!(!String::from_utf8_lossy(&cut).contains("one"));
    assert_eq!(cut, without_secret_values(b.as_bytes()));
    assert!(String::from_utf8_lossy(&cut).contains("TOKEN") && String::from_utf8_lossy(&cut).contains("A=1"));
    assert_eq!(&*without_secret_values(b"not json"), b"not json");
}

fn req(method: &str, path: &str, body: &str) -> http::Request {
    let (path, query) = path.split_once('?').unwrap_or((path, ""));
    http::Request {
        method: method.into(),
        path: path.into(),
        query: query.into(),
        body: body.as_bytes().to_vec(),
        ..Default::default()
    }
}

fn parsed(method: &str, path: &str, body: &str) -> Result<Action, ApiError> {
    parse(&req(method, path, body))
}

#[test]
fn each_route_parses_to_its_operation() {
    assert!(matches!(parsed("GET", "/v1/version", ""), Ok(Action::Version)));
    assert!(matches!(parsed("GET", "/v1/sandboxes/", ""), Ok(Action::ListSandboxes)));
    assert!(matches!(parsed("GET", "/v1/hosts", ""), Ok(Action::ListHosts)));
    assert!(matches!(parsed("GET", "/v1/hosts/h1", ""), Ok(Action::GetHost(h)) if h == "h1"));
    assert!(matches!(
        parsed("POST", "/v1/hosts/h1/drain", r#"{"reason":"r"}"#),
        Ok(Action::DrainHost(h, Some(r))) if h == "h1" && r.reason.as_deref() == Some("r")
    ));
    assert!(matches!(parsed("DELETE", "/v1/hosts/h1/drain", ""), Ok(Action::DrainHost(_, None))));
    assert!(
        matches!(parsed("POST", "/v1/sandboxes", r#"{"image":"x"}"#), Ok(Action::CreateSandbox(c)) if c.image == "x")
    );
    assert!(matches!(parsed("DELETE", "/v1/sandboxes/abc", ""), Ok(Action::RemoveSandbox(id, false)) if id == "abc"));
    assert!(matches!(parsed("DELETE", "/v1/sandboxes/abc?wait=true", ""), Ok(Action::RemoveSandbox(_, true))));
    assert!(parsed("DELETE", "/v1/sandboxes/abc?wait=soon", "").is_err());
    assert!(matches!(parsed("GET", "/v1/images/a%2Fb:1", ""), Ok(Action::GetImage(n)) if n == "a/b:1"));
    assert!(matches!(parsed("GET", "/v1/snapshots/s1/logs", ""), Ok(Action::Logs(id, false)) if id == "s1"));
    assert!(matches!(parsed("GET", "/v1/sandboxes/s1/logs?output=true", ""), Ok(Action::Logs(_, true))));
    assert!(parsed("GET", "/v1/sandboxes/s1/logs?output=yes", "").is_err());
    assert!(matches!(
        parsed("GET", "/v1/snapshots?label=a%3Db&label=c", ""),
        Ok(Action::ListSnapshots(l)) if l == ["a=b", "c"]
    ));
    assert!(matches!(
        parsed("GET", "/v1/snapshots/s1/diff?patch=true&against=s0", ""),
        Ok(Action::Patch(id, Some(a))) if id == "s1" && a == "s0"
    ));
    assert!(matches!(parsed("GET", "/v1/snapshots/s1/diff", ""), Ok(Action::SnapshotDiff(_))));
    assert!(matches!(
        parsed("POST", "/v1/snapshots/s1/evaluate", r#"{"name":"t","version":"1","argv":["true"]}"#),
        Ok(Action::Evaluate(_, e)) if e.name == "t" && !e.again
    ));
    assert!(matches!(parsed("POST", "/v1/snapshots/s1/release", ""), Ok(Action::Retain(_, false))));
    assert!(matches!(parsed("GET", "/v1/snapshots/s1/result", ""), Ok(Action::SealedResult(_))));
    assert!(
        matches!(parsed("POST", "/v1/snapshots/s1/fork", ""), Ok(Action::Fork(id, l)) if id == "s1" && l.count.is_none())
    );
    assert!(matches!(
        parsed("POST", "/v1/gc", r#"{"retention_secs":5}"#),
        Ok(Action::Gc { retention: Some(r), stale_after: None }) if r == Duration::from_secs(5)
    ));
    assert!(matches!(
        parsed("POST", "/v1/sandboxes/abc/checkpoint", ""),
        Ok(Action::Checkpoint(id, c)) if id == "abc" && c.compression.is_none()
    ));
}

#[test]
fn a_wrong_method_is_405_with_allow_and_an_unknown_path_404() {
    for (m, p, allow) in [
        ("POST", "/v1/version", "GET"),
        ("PUT", "/v1/sandboxes", "GET, POST"),
        ("POST", "/v1/sandboxes/abc", "GET, DELETE"),
        ("GET", "/v1/sandboxes/abc/exec", "POST"),
        ("DELETE", "/v1/sandboxes/abc/pause", "POST"),
        ("POST", "/v1/sandboxes/abc/logs", "GET"),
        ("PUT", "/v1/snapshots/abc/diff", "GET"),
        ("GET", "/v1/lineages/w/retire", "POST"),
        ("POST", "/v1/lineages", "GET"),
        ("POST", "/v1/hosts", "GET"),
        ("DELETE", "/v1/hosts/h1", "GET"),
        ("GET", "/v1/hosts/h1/drain", "POST, DELETE"),
    ] {
        let e = parsed(m, p, "").unwrap_err();
        assert_eq!((e.kind, e.allow), (ErrorKind::MethodNotAllowed, Some(allow)), "{m} {p}");
    }
    for (m, p) in [("GET", "/version"), ("GET", "/v1/nope"), ("POST", "/v1/sandboxes/abc/nope"), ("GET", "/v1x")] {
        assert_eq!(parsed(m, p, "").unwrap_err().kind, ErrorKind::NotFound, "{m} {p}");
    }
}

#[test]
fn bodies_are_checked_before_anything_runs() {
    for (p, body) in [
        ("/v1/sandboxes", "[]"),
        ("/v1/sandboxes", r#"{"image":"x","bogus":1}"#),
        ("/v1/sandboxes/abc/exec", r#"{"argv":["true"],"timeout":-1}"#),
        ("/v1/gc", r#"{"retention_secs":18446744073709551615}"#),
        ("/v1/sandboxes/abc/rollback", ""),
    ] {
        assert_eq!(parsed("POST", p, body).unwrap_err().kind, ErrorKind::InvalidArgument, "{p} {body}");
    }
}

#[test]
fn an_operations_error_keeps_its_kind_and_its_doc_comment_message() {
    use crate::daemon::{CreateError, LaunchError};
    let e = ApiError::from(CreateError::Launch(LaunchError::Full { live: 3, max: 3 }));
    assert_eq!(e.kind, ErrorKind::LimitReached);
    assert_eq!(e.message, "sandbox limit reached: 3 of 3 live (daemon --max-sandboxes)");
    let e = ApiError::from(CreateError::NoImage("busybox".parse().unwrap()));
    assert_eq!((e.kind, e.message.as_str()), (ErrorKind::NotFound, "image busybox:latest not found"));
    let bad = "nope:".parse::<crate::ids::ImageName>().unwrap_err();
    let e = ApiError::from(CreateError::Name(bad));
    assert_eq!(e.kind, ErrorKind::InvalidArgument);
    assert!(e.message.starts_with("invalid image name \"nope:\""), "{}", e.message);
}

#[test]
fn an_exec_is_attached_only_when_it_asks_for_the_exec_protocol() {
    let mut r = req("POST", "/v1/sandboxes/abc/exec", r#"{"argv":["sh"]}"#);
    assert!(matches!(parse(&r), Ok(Action::Exec(id, e, stdin)) if id == "abc" && e.argv == ["sh"] && stdin.is_empty()));
    r.headers.push(("Upgrade".into(), http::UPGRADE_PROTOCOL.into()));
    assert!(matches!(parse(&r), Ok(Action::Attach(id, _)) if id == "abc"));
    r.body = br#"{"argv":["sh"],"stdin":"x"}"#.to_vec();
    assert_eq!(parse(&r).unwrap_err().kind, ErrorKind::InvalidArgument);
    r.headers[0].1 = "websocket".into();
    r.body = br#"{"argv":["sh"]}"#.to_vec();
    assert_eq!(parse(&r).unwrap_err().kind, ErrorKind::InvalidArgument);
}

#[test]
fn the_route_table_is_what_parse_routes() {
    use super::parse::ROUTES;
    for (pattern, allow) in ROUTES {
        let path = format!("/v1/{}", pattern.replace("**", "busybox").replace('*', "0123456789abcdef"));
        let methods: Vec<&str> = allow.split(", ").collect();
        for m in ["GET", "POST", "PUT", "DELETE", "PATCH"] {
            let got = parsed(m, &path, "");
            if methods.contains(&m) {
                // Routed: it may still be bad input (no body), never 404 or 405.
                if let Err(e) = got {
                    assert!(
                        !matches!(e.kind, ErrorKind::MethodNotAllowed | ErrorKind::NotFound),
                        "{m} {path} is in the table but parse answers {:?}: {}",
                        e.kind,
                        e.message
                    );
                }
            } else {
                let e = got.err().unwrap_or_else(|| panic!("{m} {path} is routed, but the table allows only {allow}"));
                assert_eq!((e.kind, e.allow), (ErrorKind::MethodNotAllowed, Some(*allow)), "{m} {path}");
            }
        }
    }
}
