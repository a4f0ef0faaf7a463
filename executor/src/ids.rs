//! Identifiers, validated once when parsed so the rest of the code can use
//! them in paths without re-checking.

use std::fmt;
use std::str::FromStr;

/// A sandbox id: 16 lowercase hex characters (64 random bits).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SandboxId(String);

#[derive(Debug, thiserror::Error, PartialEq)]
#[error("invalid sandbox id {0:?}: expected 16 lowercase hex characters")]
pub struct BadSandboxId(pub String);

impl SandboxId {
    pub fn random() -> Self {
        SandboxId(format!("{:016x}", rand::random::<u64>()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl FromStr for SandboxId {
    type Err = BadSandboxId;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.len() == 16 && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) {
            Ok(SandboxId(s.to_string()))
        } else {
            Err(BadSandboxId(s.to_string()))
        }
    }
}

impl fmt::Display for SandboxId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// An image reference `NAME[:TAG]`, stored normalised as `name:tag`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ImageName(String);

#[derive(Debug, thiserror::Error, PartialEq)]
#[error("invalid image name {0:?}: expected NAME[:TAG] of [a-z0-9._/-] (tag [A-Za-z0-9._-], at most 128 chars)")]
pub struct BadImageName(pub String);

impl FromStr for ImageName {
    type Err = BadImageName;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || BadImageName(s.to_string());
        let (name, tag) = match s.rsplit_once(':') {
            Some((n, t)) if !t.contains('/') => (n, t),
            _ => (s, "latest"),
        };
        let name_ok = !name.is_empty()
            && name.len() <= 255
            && name.bytes().all(|b| matches!(b, b'a'..=b'z' | b'0'..=b'9' | b'.' | b'_' | b'-' | b'/'))
            && !name.starts_with(['.', '-', '/'])
            && !name.contains("//");
        let tag_ok = !tag.is_empty()
            && tag.len() <= 128
            && tag.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
            && !tag.starts_with(['.', '-']);
        if name_ok && tag_ok {
            Ok(ImageName(format!("{name}:{tag}")))
        } else {
            Err(bad())
        }
    }
}

impl ImageName {
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for ImageName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sandbox_ids() {
        let id = SandboxId::random();
        assert_eq!(id.as_str().parse::<SandboxId>().unwrap(), id);
        for bad in ["", "../../etc", "0123456789ABCDEF", "0123456789abcde", "0123456789abcdef0"] {
            assert!(bad.parse::<SandboxId>().is_err(), "{bad}");
        }
    }

    #[test]
    fn image_names() {
        assert_eq!("busybox".parse::<ImageName>().unwrap().as_str(), "busybox:latest");
        assert_eq!("a/b:1.0".parse::<ImageName>().unwrap().as_str(), "a/b:1.0");
        assert_eq!("localhost.x/a:t".parse::<ImageName>().unwrap().as_str(), "localhost.x/a:t");
        for bad in ["", "Busybox", "../x", "a:", "a:b:c/d", "/abs", "a b"] {
            assert!(bad.parse::<ImageName>().is_err(), "{bad}");
        }
    }
}
