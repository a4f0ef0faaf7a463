//! The catalog's closed vocabularies: a snapshot's class and state, how a
//! lineage started and whether it is active, which rung of the restore
//! ladder started a sandbox. Each is an enum whose text form is the one the
//! database's CHECK constraints and the API use; reading a value that is
//! not one of them (a row written by a newer version, a corrupt database)
//! is an error, never a silent default.
#![forbid(unsafe_code)]

/// A text value that names none of a vocabulary's members.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{value:?} is not a {kind} (one of {})", .allowed.join(", "))]
pub struct UnknownValue {
    pub kind: &'static str,
    pub value: String,
    pub allowed: &'static [&'static str],
}

/// `Display`, serde and SQLite for a type that is its text: written as
/// its `as_str()`, read back with its `FromStr`, so a malformed value read
/// from the database or a peer is an error, never a default. Used by the
/// vocabularies here and the ids (`ids.rs`).
macro_rules! text_conversions {
    ($name:ident) => {
        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl serde::Serialize for $name {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(self.as_str())
            }
        }

        impl<'de> serde::Deserialize<'de> for $name {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let s = <std::borrow::Cow<'de, str> as serde::Deserialize>::deserialize(d)?;
                s.parse().map_err(serde::de::Error::custom)
            }
        }

        impl rusqlite::types::ToSql for $name {
            fn to_sql(&self) -> rusqlite::Result<rusqlite::types::ToSqlOutput<'_>> {
                Ok(rusqlite::types::ToSqlOutput::from(self.as_str()))
            }
        }

        impl rusqlite::types::FromSql for $name {
            fn column_result(v: rusqlite::types::ValueRef<'_>) -> rusqlite::types::FromSqlResult<Self> {
                v.as_str()?.parse().map_err(|e| rusqlite::types::FromSqlError::Other(Box::new(e)))
            }
        }
    };
}
pub(crate) use text_conversions;

/// An enum of unit variants, each with its text form, and the conversions
/// every vocabulary needs: `as_str`, `FromStr` (failing on an unknown
/// text), and [`text_conversions`].
macro_rules! vocabulary {
    ($(#[$meta:meta])* $name:ident ($kind:literal) { $($(#[$vmeta:meta])* $variant:ident = $text:literal,)+ }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum $name {
            $($(#[$vmeta])* $variant,)+
        }

        impl $name {
            pub fn as_str(self) -> &'static str {
                match self {
                    $($name::$variant => $text,)+
                }
            }
        }

        impl std::str::FromStr for $name {
            type Err = UnknownValue;
            fn from_str(s: &str) -> Result<Self, UnknownValue> {
                match s {
                    $($text => Ok($name::$variant),)+
                    _ => Err(UnknownValue {
                        kind: $kind,
                        value: s.to_string(),
                        allowed: &[$($text),+],
                    }),
                }
            }
        }

        text_conversions!($name);
    };
}

vocabulary! {
    /// How a snapshot's blob is compressed.
    BlobCompression ("blob compression") {
        /// zstd level 1: the default, for speed.
        Zstd = "zstd",
        /// gzip level 1, for tools that predate zstd layers.
        Gzip = "gzip",
    }
}

// Not derived: `vocabulary!` derives the same traits for every enum, and
// only this one has a default.
#[allow(clippy::derivable_impls)]
impl Default for BlobCompression {
    fn default() -> Self {
        BlobCompression::Zstd
    }
}

vocabulary! {
    /// A sandbox's state as the database keeps it (across restarts).
    SandboxState ("sandbox state") {
        Creating = "creating",
        Running = "running",
        Paused = "paused",
        Stopped = "stopped",
    }
}

vocabulary! {
    /// What a snapshot is for.
    SnapshotClass ("snapshot class") {
        /// Work: appended to a lineage (checkpoint or suspend).
        Checkpoint = "checkpoint",
        /// A repository's clean state that new work starts from.
        Baseline = "baseline",
    }
}

vocabulary! {
    /// Where a snapshot is in its life; set by the database's lineage rules.
    SnapshotState ("snapshot state") {
        Capturing = "capturing",
        /// A lineage's head, or a live baseline.
        Ready = "ready",
        /// Replaced by a later head or baseline; restorable by id.
        Superseded = "superseded",
        /// Its lineage was retired.
        Retired = "retired",
        /// Its layer could never be sealed (`info.seal_error`).
        Failed = "failed",
        Deleting = "deleting",
    }
}

vocabulary! {
    /// How a lineage (work context) started.
    StartKind ("lineage start") {
        Image = "image",
        Baseline = "baseline",
        Fork = "fork",
    }
}

vocabulary! {
    /// Whether a lineage takes new checkpoints.
    LineageState ("lineage state") {
        Active = "active",
        /// Retired by `retire` or by gc (stale): its work is abandoned.
        Retired = "retired",
        /// Closed by its owner (`close`): the task's work is done, ...
        Completed = "completed",
        /// ... was called off, ...
        Cancelled = "cancelled",
        /// ... or failed. All four are terminal.
        Failed = "failed",
    }
}

vocabulary! {
    /// Which rung of the restore ladder started a sandbox.
    Rung ("restore rung") {
        /// Its lineage's head.
        Head = "head",
        /// The baseline its lineage started from.
        Baseline = "baseline",
        /// The snapshot its lineage was forked from.
        Fork = "fork",
        /// The image, nothing else being restorable.
        Image = "image",
        /// A snapshot asked for by id.
        Snapshot = "snapshot",
        /// A rollback to a snapshot of its own lineage.
        Rollback = "rollback",
    }
}

vocabulary! {
    /// What happens to a sandbox when its deadline passes.
    OnTimeout ("timeout action") {
        /// Removed, its slot released.
        Remove = "remove",
        /// Suspended into its lineage (`resume --work-context` continues it).
        Suspend = "suspend",
    }
}

vocabulary! {
    /// Where a snapshot can be restored (`daemon/fleet.rs`).
    SnapshotType ("snapshot type") {
        /// On the host that made it (and hosts that brought its layers).
        Local = "local",
        /// Also published to the fleet registry: any host can restore it.
        Distributed = "distributed",
    }
}

// Not derived: see BlobCompression.
#[allow(clippy::derivable_impls)]
impl Default for SnapshotType {
    fn default() -> Self {
        SnapshotType::Local
    }
}

// Not derived: see BlobCompression.
#[allow(clippy::derivable_impls)]
impl Default for OnTimeout {
    fn default() -> Self {
        OnTimeout::Remove
    }
}

/// What the exec log keeps of a command's output: the first bytes of its
/// stdout and stderr, up to the daemon's per-exec limit for both together,
/// and how many bytes past that limit were cut (not kept). In JSON each
/// stream is a string when it is UTF-8, else `{"base64": "..."}`: readable
/// where it can be, lossless always.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct KeptOutput {
    #[serde(with = "bytes_text")]
    pub stdout: Vec<u8>,
    #[serde(with = "bytes_text")]
    pub stderr: Vec<u8>,
    /// Bytes of output past the limit, not kept (0: all of it is here).
    pub cut: u64,
}

impl KeptOutput {
    /// Keep what of `data` (from stdout, or else stderr) fits in `limit`
    /// bytes of both streams together; count the rest as cut.
    pub fn keep(&mut self, limit: usize, stdout: bool, data: &[u8]) {
        let room = limit.saturating_sub(self.stdout.len() + self.stderr.len());
        let n = data.len().min(room);
        let buf = if stdout { &mut self.stdout } else { &mut self.stderr };
        buf.extend_from_slice(&data[..n]);
        self.cut += (data.len() - n) as u64;
    }
}

/// Bytes as JSON text when they are UTF-8, else as `{"base64": ...}`.
mod bytes_text {
    use base64::Engine as _;
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    #[derive(Serialize, Deserialize)]
    #[serde(untagged)]
    enum Text {
        Utf8(String),
        Binary { base64: String },
    }

    pub fn serialize<S: Serializer>(v: &[u8], s: S) -> Result<S::Ok, S::Error> {
        match std::str::from_utf8(v) {
            Ok(t) => Text::Utf8(t.to_string()),
            Err(_) => Text::Binary { base64: base64::engine::general_purpose::STANDARD.encode(v) },
        }
        .serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        match Text::deserialize(d)? {
            Text::Utf8(t) => Ok(t.into_bytes()),
            Text::Binary { base64 } => {
                base64::engine::general_purpose::STANDARD.decode(base64).map_err(serde::de::Error::custom)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_forms_round_trip_and_unknown_ones_are_errors() {
        for s in [SnapshotState::Ready, SnapshotState::Failed, SnapshotState::Deleting] {
            assert_eq!(s.as_str().parse::<SnapshotState>(), Ok(s));
            assert_eq!(serde_json::to_string(&s).unwrap(), format!("\"{s}\""));
        }
        let err = "bogus".parse::<SnapshotState>().unwrap_err();
        assert_eq!(
            err.to_string(),
            r#""bogus" is not a snapshot state (one of capturing, ready, superseded, retired, failed, deleting)"#
        );
        assert!(serde_json::from_str::<Rung>("\"ladder\"").is_err());
        assert_eq!(serde_json::from_str::<Rung>("\"rollback\"").unwrap(), Rung::Rollback);
    }

    #[test]
    fn the_database_refuses_to_read_an_unknown_value() {
        let db = rusqlite::Connection::open_in_memory().unwrap();
        let read = |v: &str| db.query_row("SELECT ?1", [v], |r| r.get::<_, StartKind>(0));
        assert_eq!(read("fork").unwrap(), StartKind::Fork);
        assert!(read("spawn").is_err());
        let back: String = db.query_row("SELECT ?1", [LineageState::Retired], |r| r.get(0)).unwrap();
        assert_eq!(back, "retired");
    }

    #[test]
    fn kept_output_is_bounded_and_round_trips_binary() {
        let mut k = KeptOutput::default();
        k.keep(8, true, b"hello");
        k.keep(8, false, b"\xff\xfeworld");
        assert_eq!((k.stdout.as_slice(), k.stderr.as_slice(), k.cut), (&b"hello"[..], &b"\xff\xfew"[..], 4));
        let j = serde_json::to_value(&k).unwrap();
        assert_eq!(j["stdout"], "hello");
        assert_eq!(j["stderr"]["base64"], "//53");
        assert_eq!(serde_json::from_value::<KeptOutput>(j).unwrap(), k);
    }
}
