//! Identifiers, validated once when parsed (from the API, a registry's
//! label or a database row) so the rest of the code can use them in paths
//! without re-checking. Each reads from and writes to SQLite as its text,
//! and reading one that is malformed is an error, never a silent default.

use std::fmt;
use std::str::FromStr;

/// What every id needs besides `model::text_conversions`: `as_str`, and its text
/// wherever text is taken.
macro_rules! text_id {
    ($name:ident) => {
        impl $name {
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        crate::model::text_conversions!($name);

        // An id is its text wherever text is taken (a path component, a
        // query parameter, a map key looked up by `&str`): validated once,
        // read as `&str` after.
        impl std::ops::Deref for $name {
            type Target = str;
            fn deref(&self) -> &str {
                &self.0
            }
        }

        impl std::borrow::Borrow<str> for $name {
            fn borrow(&self) -> &str {
                &self.0
            }
        }

        impl AsRef<str> for $name {
            fn as_ref(&self) -> &str {
                &self.0
            }
        }

        impl PartialEq<str> for $name {
            fn eq(&self, other: &str) -> bool {
                self.0 == other
            }
        }

        impl PartialEq<String> for $name {
            fn eq(&self, other: &String) -> bool {
                self.0 == *other
            }
        }

        impl PartialEq<&str> for $name {
            fn eq(&self, other: &&str) -> bool {
                self.0 == *other
            }
        }
    };
}

/// An id of 16 lowercase hex characters (64 random bits), with its error.
macro_rules! random_hex_id {
    ($(#[$meta:meta])* $name:ident, $bad:ident, $what:literal) => {
        $(#[$meta])*
        #[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name(String);
        text_id!($name);

        #[derive(Debug, thiserror::Error, PartialEq)]
        #[error("invalid {} {:?}: expected 16 lowercase hex characters", $what, .0)]
        pub struct $bad(pub String);

        impl $name {
            pub fn random() -> Self {
                $name(format!("{:016x}", rand::random::<u64>()))
            }
        }

        impl FromStr for $name {
            type Err = $bad;
            fn from_str(s: &str) -> Result<Self, Self::Err> {
                if is_hex(s, 16) {
                    Ok($name(s.to_string()))
                } else {
                    Err($bad(s.to_string()))
                }
            }
        }
    };
}

fn is_hex(s: &str, len: usize) -> bool {
    s.len() == len && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

random_hex_id!(
    /// A sandbox id: 16 lowercase hex characters (64 random bits).
    SandboxId,
    BadSandboxId,
    "sandbox id"
);

random_hex_id!(
    /// A snapshot id: 16 lowercase hex characters (64 random bits), made
    /// by the host that took it and kept across push and pull.
    SnapshotId,
    BadSnapshotId,
    "snapshot id"
);

/// A layer id, its directory under `layers/`: the diff_id's sha256 hex
/// for a layer named by its content, or `s<snapshot id>` for a suspended
/// sandbox's upper moved in before it is hashed.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LayerId(String);
text_id!(LayerId);

#[derive(Debug, thiserror::Error, PartialEq)]
#[error("invalid layer id {0:?}: expected 64 lowercase hex characters, or s and a snapshot id")]
pub struct BadLayerId(pub String);

impl LayerId {
    /// The id of the layer whose tar has this sha256 hex (its diff_id).
    pub fn content(diff_id_hex: &str) -> Result<Self, BadLayerId> {
        if is_hex(diff_id_hex, 64) {
            Ok(LayerId(diff_id_hex.to_string()))
        } else {
            Err(BadLayerId(diff_id_hex.to_string()))
        }
    }

    /// The diff_id a layer named by its content has; none for a suspended
    /// upper (its diff_id is known once it is sealed).
    pub fn digest(&self) -> Option<crate::oci::Digest> {
        format!("sha256:{}", self.0).parse().ok()
    }

    /// The id under which a suspend moves a sandbox's upper in.
    pub fn suspended(snapshot: &SnapshotId) -> Self {
        LayerId(format!("s{snapshot}"))
    }
}

/// A layer named by its content: the digest of its tar (a diff_id).
impl From<&crate::oci::Digest> for LayerId {
    fn from(d: &crate::oci::Digest) -> Self {
        LayerId(d.hex().to_string())
    }
}

impl FromStr for LayerId {
    type Err = BadLayerId;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.strip_prefix('s') {
            Some(snap) if is_hex(snap, 16) => Ok(LayerId(s.to_string())),
            _ => LayerId::content(s),
        }
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

/// A work context id: 1-64 chars of `[A-Za-z0-9._-]`, not starting with a
/// dot or a dash (it is a scheduler's task id, say).
pub fn valid_work_context(id: &str) -> bool {
    (1..=64).contains(&id.len())
        && id.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
        && !id.starts_with(['.', '-'])
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
    fn snapshot_and_layer_ids() {
        let snap = SnapshotId::random();
        assert_eq!(snap.as_str().parse::<SnapshotId>().unwrap(), snap);
        let suspended = LayerId::suspended(&snap);
        assert_eq!(suspended.as_str().parse::<LayerId>().unwrap(), suspended);
        let hex = "ab".repeat(32);
        assert_eq!(hex.parse::<LayerId>().unwrap(), LayerId::content(&hex).unwrap());
        for bad in ["", "s", "s0123", "S0123456789abcdef", "../x", &"AB".repeat(32), &"a".repeat(63)] {
            assert!(bad.parse::<LayerId>().is_err(), "{bad}");
        }
        assert!("0123456789abcdeg".parse::<SnapshotId>().is_err());
        // A row holding a malformed id is an error when read, not a value.
        let db = rusqlite::Connection::open_in_memory().unwrap();
        let read = |v: &str| db.query_row("SELECT ?1", [v], |r| r.get::<_, SnapshotId>(0));
        assert_eq!(read(snap.as_str()).unwrap(), snap);
        assert!(read("../../etc").is_err());
        let json = serde_json::to_string(&suspended).unwrap();
        assert_eq!(serde_json::from_str::<LayerId>(&json).unwrap(), suspended);
        assert!(serde_json::from_str::<LayerId>("\"x\"").is_err());
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

    #[test]
    fn work_context_ids() {
        for ok in ["a", "task-42", "T_1.2", &"x".repeat(64)] {
            assert!(valid_work_context(ok), "{ok}");
        }
        for bad in ["", "-a", ".a", "a/b", "a b", "é", &"x".repeat(65)] {
            assert!(!valid_work_context(bad), "{bad}");
        }
    }
}
