//! What a sandbox is made with: its spec as the database keeps it (JSON,
//! so later versions add fields without a migration), how it was started,
//! and the mounts declared for it. Below both `db` (which stores it) and
//! `sandbox` (which runs it).
#![forbid(unsafe_code)]

use serde::{Deserialize, Serialize};

use crate::ids::{LayerId, SnapshotId};
use crate::model::Rung;

/// What a sandbox was created with; stored as JSON so later schema versions
/// can add fields without a migration.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Default)]
pub struct SandboxSpec {
    pub image: String,
    /// The layer chain it runs on (layer ids), bottom first: the image's
    /// layers, then those of the snapshot chain it was resumed from.
    #[serde(default)]
    pub layers: Vec<LayerId>,
    /// The snapshot it was resumed or forked from.
    #[serde(default)]
    pub snapshot: Option<SnapshotId>,
    /// The lineage it works for (none only for sandboxes made before
    /// lineages existed: their first checkpoint makes one).
    #[serde(default)]
    pub work_context: Option<String>,
    /// The head it observed at activation or at its last append: its next
    /// append is fenced on it. The database row is the truth; appends
    /// update it in the same transaction.
    #[serde(default)]
    pub observed_head: Option<SnapshotId>,
    /// How it was started: the ladder's rung and the snapshot used.
    #[serde(default)]
    pub restored: Option<Restored>,
    /// Scratch and cache mounts (never captured).
    #[serde(default)]
    pub mounts: Vec<MountDecl>,
    /// Started without the seccomp filter (`--seccomp unconfined`).
    #[serde(default)]
    pub seccomp_unconfined: bool,
    /// Its own user namespace (`--userns`) and the host range it maps to.
    #[serde(default)]
    pub userns: Option<crate::spec::UsernsMap>,
    pub limits: crate::spec::Limits,
    /// The host directory it runs on (a create's `rootfs`), instead of an
    /// overlay of `layers` and its upper.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub root_dir: Option<std::path::PathBuf>,
    /// The network namespace it joined (`netns`), instead of one of its own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub netns: Option<std::path::PathBuf>,
    pub env: Vec<String>,
    pub hostname: String,
    pub cgroup: String,
    /// Its deadline and idle timeout, as last set (a renewal rewrites it).
    #[serde(default)]
    pub lifetime: Lifetime,
    /// Its exec log is the log of `snapshot` and then its own records
    /// after this id: a rollback keeps the records it discarded (the
    /// snapshots taken before it name them) but not in its log.
    #[serde(default)]
    pub log_from: i64,
    /// Its network (`none`: loopback only), egress policy and address.
    #[serde(default)]
    pub network: crate::net::NetworkSpec,
    /// The names of its secret env; the values are never in the spec
    /// (`daemon/secrets.rs`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub secret_names: Vec<String>,
}

/// How long a sandbox lives (the scheduler's contract): a deadline after
/// which it is removed or suspended, and an idle timeout after which it
/// is suspended. Neither: it lives until removed.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Lifetime {
    /// When its deadline passes (unix milliseconds).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deadline_ms: Option<i64>,
    /// What happens then.
    #[serde(default)]
    pub on_timeout: crate::model::OnTimeout,
    /// Seconds with no exec running, no attached session and no API call
    /// naming it, after which it is suspended into its lineage.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idle_timeout: Option<u64>,
}

/// The longest timeout or idle timeout a sandbox may be given (seconds):
/// a year.
pub const MAX_TIMEOUT_SECS: u64 = 365 * 24 * 3600;

/// Now, in unix milliseconds.
pub fn now_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as i64).unwrap_or(0)
}

/// How a sandbox was started for its lineage.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Restored {
    pub rung: Rung,
    /// The snapshot it started from (none for `image`).
    pub snapshot: Option<SnapshotId>,
}

/// A mount declared for a sandbox that is never captured in a snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MountDecl {
    /// A size-limited tmpfs: scratch space that is thrown away.
    Scratch { path: String, size: u64 },
    /// The host cache directory `caches/<name>`, shared by every sandbox
    /// that names it and rebuilt (empty) when lost.
    Cache { name: String, path: String },
}

/// Default size of a scratch tmpfs.
pub const DEFAULT_SCRATCH: u64 = 64 << 20;

/// A mount target: absolute, normalised, not `/` and not under the
/// runtime's own /proc, /sys or /dev.
fn valid_target(path: &str) -> Result<(), String> {
    let ok_component = |c: &str| !c.is_empty() && c != "." && c != ".." && !c.contains('\0');
    let comps: Vec<&str> = path.strip_prefix('/').map(|p| p.split('/').collect()).unwrap_or_default();
    if !path.starts_with('/') || comps.is_empty() || !comps.iter().all(|c| ok_component(c)) || path.len() > 4096 {
        return Err(format!("mount path {path:?} must be an absolute, normalised path other than /"));
    }
    if matches!(comps[0], "proc" | "sys" | "dev") {
        return Err(format!("mount path {path:?} is under /{} (the runtime's own)", comps[0]));
    }
    Ok(())
}

impl MountDecl {
    /// `PATH[:SIZE]` (size in bytes or with a k, m, g suffix).
    pub fn parse_scratch(s: &str) -> Result<MountDecl, String> {
        let (path, size) = match s.rsplit_once(':') {
            Some((p, sz)) => (p, crate::units::parse_bytes(sz)?),
            None => (s, DEFAULT_SCRATCH),
        };
        valid_target(path)?;
        if size < 4096 {
            return Err(format!("scratch size {size} is below one page"));
        }
        Ok(MountDecl::Scratch { path: path.to_string(), size })
    }

    /// `NAME:PATH`.
    pub fn parse_cache(s: &str) -> Result<MountDecl, String> {
        let (name, path) = s.split_once(':').ok_or_else(|| format!("cache {s:?} must be NAME:PATH"))?;
        let name_ok = !name.is_empty()
            && name.len() <= 63
            && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'.' | b'_' | b'-'))
            && !name.starts_with(['.', '-']);
        if !name_ok {
            return Err(format!("cache name {name:?} must be 1-63 chars of [a-z0-9._-]"));
        }
        valid_target(path)?;
        Ok(MountDecl::Cache { name: name.to_string(), path: path.to_string() })
    }

    pub fn path(&self) -> &str {
        match self {
            MountDecl::Scratch { path, .. } | MountDecl::Cache { path, .. } => path,
        }
    }

    /// Whether processes of other sandboxes can reach this mount, and so
    /// receive descriptors (SCM_RIGHTS over a socket in it) that outlive
    /// this sandbox's processes: a cache is the one such channel (each
    /// sandbox has its own network namespace, so abstract sockets are
    /// private too, and scratch is its own tmpfs).
    pub fn passes_descriptors(&self) -> bool {
        matches!(self, MountDecl::Cache { .. })
    }
}

/// Resource limits of one sandbox; `None` means unlimited.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq)]
pub struct Limits {
    /// Memory limit in bytes (memory.limit_in_bytes / memory.max).
    pub memory: Option<u64>,
    /// Maximum number of processes (pids.max).
    pub pids: Option<u64>,
    /// CPU bandwidth in CPUs, e.g. 0.5 (cpu.cfs_quota_us / cpu.max).
    pub cpus: Option<f64>,
    /// Cap on what the sandbox can write, in bytes: the size of its own
    /// filesystem for the upper ([`crate::store::disk`]); not a cgroup limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk: Option<u64>,
}

/// A sandbox's id mapping: `0..size` inside is `host_id..host_id+size`.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
pub struct UsernsMap {
    pub host_id: u32,
    pub size: u32,
}
/// A lifetime asked for by a create, resume, fork or renewal: checked.
pub fn lifetime(
    timeout: Option<u64>,
    on_timeout: Option<crate::model::OnTimeout>,
    idle_timeout: Option<u64>,
    default_on_timeout: crate::model::OnTimeout,
) -> Result<Lifetime, String> {
    for (what, v) in [("timeout", timeout), ("idle_timeout", idle_timeout)] {
        if let Some(v) = v {
            if !(1..=MAX_TIMEOUT_SECS).contains(&v) {
                return Err(format!("{what} must be 1 to {MAX_TIMEOUT_SECS} seconds, not {v}"));
            }
        }
    }
    if on_timeout.is_some() && timeout.is_none() {
        return Err("on_timeout needs a timeout".into());
    }
    Ok(Lifetime {
        deadline_ms: timeout.map(|t| now_ms() + (t as i64) * 1000),
        on_timeout: on_timeout.unwrap_or(default_on_timeout),
        idle_timeout,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::OnTimeout;

    #[test]
    fn mount_declarations() {
        assert_eq!(
            MountDecl::parse_scratch("/scratch:16m"),
            Ok(MountDecl::Scratch { path: "/scratch".into(), size: 16 << 20 })
        );
        assert_eq!(MountDecl::parse_scratch("/s"), Ok(MountDecl::Scratch { path: "/s".into(), size: DEFAULT_SCRATCH }));
        assert_eq!(
            MountDecl::parse_cache("pip:/root/.cache/pip"),
            Ok(MountDecl::Cache { name: "pip".into(), path: "/root/.cache/pip".into() })
        );
        for bad in ["relative", "/", "/a/../b", "/proc/x", "/dev", "//x", "/a/./b", "/x:0"] {
            assert!(MountDecl::parse_scratch(bad).is_err(), "{bad}");
        }
        for bad in ["nopath", "Bad:/x", "../x:/x", "c:relative", ".hidden:/x"] {
            assert!(MountDecl::parse_cache(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn lifetimes_are_checked() {
        let l = lifetime(Some(2), None, Some(5), OnTimeout::Suspend).unwrap();
        assert_eq!((l.on_timeout, l.idle_timeout), (OnTimeout::Suspend, Some(5)));
        assert!((l.deadline_ms.unwrap() - now_ms() - 2000).abs() < 1000);
        assert_eq!(lifetime(None, None, None, OnTimeout::Remove).unwrap(), Lifetime::default());
        for (t, o, i) in [
            (Some(0), None, None),
            (None, None, Some(0)),
            (Some(MAX_TIMEOUT_SECS + 1), None, None),
            (None, Some(OnTimeout::Remove), None),
        ] {
            assert!(lifetime(t, o, i, OnTimeout::Remove).is_err(), "{t:?} {o:?} {i:?}");
        }
    }
}
