//! Image references as Docker and containerd spell them:
//! `[registry[:port]/]repository[:tag][@sha256:<hex>]`.
//!
//! The first path component is a registry when it contains a `.` or a `:`
//! or is `localhost`; otherwise the reference names Docker Hub, where
//! one-component repositories live under `library/`.

use std::fmt;

use crate::oci::Digest;

/// Docker Hub's API host.
pub const DOCKER_HUB: &str = "registry-1.docker.io";

/// A parsed reference. Exactly one of `tag` and `digest` is used to fetch;
/// when both are given the digest wins (and the tag is kept for display).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reference {
    pub registry: String,
    pub repository: String,
    pub tag: Option<String>,
    pub digest: Option<Digest>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ReferenceError {
    #[error("reference {0:?} is empty")]
    Empty(String),
    #[error("reference {reference:?}: {why}")]
    Invalid { reference: String, why: &'static str },
}

fn invalid(reference: &str, why: &'static str) -> ReferenceError {
    ReferenceError::Invalid { reference: reference.to_string(), why }
}

impl Reference {
    pub fn parse(s: &str) -> Result<Reference, ReferenceError> {
        if s.is_empty() {
            return Err(ReferenceError::Empty(s.to_string()));
        }
        if s.len() > 512 || s.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err(invalid(s, "too long or contains whitespace"));
        }
        let (rest, digest) = match s.split_once('@') {
            Some((r, d)) => (r, Some(d.parse::<Digest>().map_err(|_| invalid(s, "digest must be sha256:<64 hex>"))?)),
            None => (s, None),
        };
        // A tag follows the last ':' after the last '/' (a port comes before it).
        let last_slash = rest.rfind('/').map_or(0, |i| i + 1);
        let (name, tag) = match rest[last_slash..].rfind(':') {
            Some(i) => (&rest[..last_slash + i], Some(&rest[last_slash + i + 1..])),
            None => (rest, None),
        };
        if let Some(t) = tag {
            let ok = !t.is_empty()
                && t.len() <= 128
                && !t.starts_with(['.', '-'])
                && t.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
            if !ok {
                return Err(invalid(s, "tag must be 1-128 of [A-Za-z0-9._-], not starting with . or -"));
            }
        }
        let (registry, repository) = match name.split_once('/') {
            Some((first, path)) if first.contains(['.', ':']) || first == "localhost" => {
                (first.to_string(), path.to_string())
            }
            _ if !name.contains('/') => (DOCKER_HUB.to_string(), format!("library/{name}")),
            _ => (DOCKER_HUB.to_string(), name.to_string()),
        };
        let component_ok = |c: &str| {
            !c.is_empty()
                && c.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-".contains(&b))
                && c.as_bytes()[0].is_ascii_alphanumeric()
                && c.as_bytes()[c.len() - 1].is_ascii_alphanumeric()
        };
        if repository.len() > 255 || !repository.split('/').all(component_ok) {
            return Err(invalid(s, "repository must be lowercase [a-z0-9._-] components separated by /"));
        }
        if registry.is_empty() || !registry.bytes().all(|b| b.is_ascii_alphanumeric() || b".:-[]".contains(&b)) {
            return Err(invalid(s, "registry must be a host name with an optional port"));
        }
        let tag = match (&tag, &digest) {
            (None, None) => Some("latest".to_string()),
            _ => tag.map(str::to_string),
        };
        Ok(Reference { registry, repository, tag, digest })
    }

    /// What to put after `/manifests/`: the digest if any, else the tag.
    pub fn manifest_ref(&self) -> String {
        match (&self.digest, &self.tag) {
            (Some(d), _) => d.to_string(),
            (None, Some(t)) => t.clone(),
            (None, None) => "latest".into(),
        }
    }
}

impl fmt::Display for Reference {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.registry, self.repository)?;
        if let Some(t) = &self.tag {
            write!(f, ":{t}")?;
        }
        if let Some(d) = &self.digest {
            write!(f, "@{d}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(s: &str) -> Reference {
        Reference::parse(s).unwrap()
    }

    #[test]
    fn parses_registries_ports_tags_and_digests() {
        let r = p("127.0.0.1:5000/strata/snap:v1");
        assert_eq!(
            (r.registry.as_str(), r.repository.as_str(), r.tag.as_deref()),
            ("127.0.0.1:5000", "strata/snap", Some("v1"))
        );
        let r = p("localhost/a");
        assert_eq!((r.registry.as_str(), r.repository.as_str(), r.tag.as_deref()), ("localhost", "a", Some("latest")));
        let r = p("busybox");
        assert_eq!((r.registry.as_str(), r.repository.as_str()), (DOCKER_HUB, "library/busybox"));
        let r = p("org/app:1.0");
        assert_eq!((r.registry.as_str(), r.repository.as_str()), (DOCKER_HUB, "org/app"));
        let hex = "a".repeat(64);
        let r = p(&format!("ghcr.io/o/r@sha256:{hex}"));
        assert_eq!(r.tag, None);
        assert_eq!(r.manifest_ref(), format!("sha256:{hex}"));
        assert_eq!(r.to_string(), format!("ghcr.io/o/r@sha256:{hex}"));
        assert_eq!(p("reg.io:443/x:t").to_string(), "reg.io:443/x:t");
    }

    #[test]
    fn refuses_malformed_references() {
        for bad in [
            "",
            "UPPER/case",
            "reg.io/a//b",
            "reg.io/a:",
            "reg.io/a:-x",
            "reg.io/a@sha256:zz",
            "a b",
            "reg.io/-a",
            "reg.io/a/",
            "reg.io/a:t@md5:00",
        ] {
            assert!(Reference::parse(bad).is_err(), "{bad:?} accepted");
        }
    }
}
