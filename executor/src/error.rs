//! Error kinds shared by every module, and the one place that maps them to
//! HTTP status codes (containerd's errdefs).

/// What went wrong, as far as a client is concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// The named object does not exist (404).
    NotFound,
    /// The request or its input (a layer, a field) is malformed (400).
    InvalidArgument,
    /// The request conflicts with current state (409).
    Conflict,
    /// A configured limit is reached (429).
    LimitReached,
    /// The path exists but not with this method (405).
    MethodNotAllowed,
    /// A bug or a host failure (500).
    Internal,
    /// The store's file system or quota is full (507).
    NoSpace,
    /// The API peer is not allowed to use the daemon (403).
    PermissionDenied,
    /// A registry (or other upstream server) failed, refused the
    /// credentials or served bad data (502).
    Upstream,
    /// A request body larger than the API takes (413).
    TooLarge,
    /// A request body that did not arrive in time (408).
    RequestTimeout,
    /// Well-formed, but at odds with an earlier request it names (422: an
    /// `Idempotency-Key` reused with another body).
    Unprocessable,
}

impl ErrorKind {
    pub fn status(self) -> u16 {
        match self {
            ErrorKind::NotFound => 404,
            ErrorKind::InvalidArgument => 400,
            ErrorKind::Conflict => 409,
            ErrorKind::LimitReached => 429,
            ErrorKind::MethodNotAllowed => 405,
            ErrorKind::Internal => 500,
            ErrorKind::NoSpace => 507,
            ErrorKind::Upstream => 502,
            ErrorKind::PermissionDenied => 403,
            ErrorKind::TooLarge => 413,
            ErrorKind::RequestTimeout => 408,
            ErrorKind::Unprocessable => 422,
        }
    }

    pub fn code(self) -> &'static str {
        match self {
            ErrorKind::NotFound => "not_found",
            ErrorKind::InvalidArgument => "invalid_argument",
            ErrorKind::Conflict => "conflict",
            ErrorKind::LimitReached => "limit_reached",
            ErrorKind::MethodNotAllowed => "method_not_allowed",
            ErrorKind::Internal => "internal",
            ErrorKind::NoSpace => "no_space",
            ErrorKind::Upstream => "upstream",
            ErrorKind::PermissionDenied => "permission_denied",
            ErrorKind::TooLarge => "too_large",
            ErrorKind::RequestTimeout => "request_timeout",
            ErrorKind::Unprocessable => "unprocessable",
        }
    }

    /// A host failure's kind: `NoSpace` if the file system or a quota ran
    /// out of space anywhere in `e`'s chain, else `Internal`.
    pub fn of_host_failure(e: &(dyn std::error::Error + 'static)) -> ErrorKind {
        let mut cur = Some(e);
        while let Some(c) = cur {
            if let Some(io) = c.downcast_ref::<std::io::Error>() {
                if matches!(io.raw_os_error(), Some(libc::ENOSPC) | Some(libc::EDQUOT)) {
                    return ErrorKind::NoSpace;
                }
            }
            cur = c.source();
        }
        ErrorKind::Internal
    }
}

/// A failure that knows what kind it is: each daemon operation's error
/// enum, and the library errors they wrap. `api` maps the kind to a status
/// and the error's chain ([`chain`]) to the message; nothing else does.
pub trait Classify: std::error::Error + 'static {
    fn kind(&self) -> ErrorKind;
}

/// Render an error and its sources as one line: "outer: inner: root cause".
pub fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        let m = c.to_string();
        if !s.ends_with(&m) {
            s.push_str(": ");
            s.push_str(&m);
        }
        cur = c.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("write blob")]
    struct Outer(#[source] std::io::Error);

    #[test]
    fn a_full_disk_anywhere_in_the_chain_is_no_space() {
        let full = Outer(std::io::Error::from_raw_os_error(libc::ENOSPC));
        assert_eq!(ErrorKind::of_host_failure(&full), ErrorKind::NoSpace);
        assert_eq!(ErrorKind::NoSpace.status(), 507);
        let other = Outer(std::io::Error::from_raw_os_error(libc::EIO));
        assert_eq!(ErrorKind::of_host_failure(&other), ErrorKind::Internal);
    }
}
