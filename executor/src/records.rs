//! The records the API shows as the catalog keeps them: an exec record, an
//! evaluation, a lineage's restore and holder, a baseline's key, what a
//! snapshot records about itself. The
//! catalog stores them and the API's bodies embed them, so both name them
//! here, and neither depends on the other for them.

use serde::{Deserialize, Serialize};

use crate::ids::SnapshotId;
use crate::model::{KeptOutput, Rung};

/// What a snapshot records about itself (its row's `info`, shown as
/// `info` by the API): what the daemon reads back, typed, and what it only
/// shows (sizes, times, how it was captured) as it was written. A row whose
/// info does not decode is an error (`DbError::Decode`), never a default:
/// a log segment names both its ends or neither.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SnapshotMeta {
    /// The exec log segment it seals: its source sandbox's records with
    /// ids in `(log_from, log_upto]` (see `log_segment`). Neither: it
    /// seals no log (a baseline).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub log_from: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub log_upto: Option<i64>,
    /// Its segment is the records its pull inserted, whatever sandbox ran
    /// them.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub log_pulled: bool,
    /// Captured in a user namespace: its chain runs only in one.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub userns: bool,
    /// The network (mode and policy) of the sandbox it was taken of.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<crate::net::NetworkSpec>,
    /// It folded its chain into its own layer.
    #[serde(default)]
    pub compacted: bool,
    /// Its sandbox's CPU quota, for the worker that seals its blob.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpus: Option<f64>,
    /// Why its capture failed (it holds nothing).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capture_error: Option<String>,
    /// Why its blob could not be sealed (its files stay restorable here).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seal_error: Option<String>,
    /// The registry reference it was pulled from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pulled_from: Option<String>,
    /// A pulled baseline not yet eligible for new work, and why.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ineligible: Option<String>,
    /// A pulled checkpoint kept outside its lineage, and why.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outside_lineage: Option<String>,
    /// What it only shows.
    #[serde(flatten)]
    pub shown: serde_json::Map<String, serde_json::Value>,
}

impl SnapshotMeta {
    /// Record a measurement it only shows.
    pub fn show(&mut self, key: &str, value: impl Into<serde_json::Value>) {
        self.shown.insert(key.to_string(), value.into());
    }

    /// The exec log segment it seals, `(from, upto]`; `None`: none.
    pub fn log_segment(&self) -> Option<(i64, i64)> {
        self.log_from.zip(self.log_upto)
    }

    /// Decode a row's info, refusing a log segment with one end only.
    pub fn decode(json: &str) -> Result<SnapshotMeta, serde_json::Error> {
        let meta: SnapshotMeta = serde_json::from_str(json)?;
        if meta.log_from.is_some() != meta.log_upto.is_some() {
            return Err(serde::de::Error::custom("a log segment names both log_from and log_upto, or neither"));
        }
        Ok(meta)
    }
}

/// What makes a snapshot a baseline: its key (owner, repo, the snapshot's
/// image, canonical ref), the commit it was validated at, and the evidence.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Baseline {
    pub owner: String,
    pub repo: String,
    #[serde(rename = "ref")]
    pub git_ref: String,
    pub commit: String,
    pub evidence: serde_json::Value,
}

/// One command run in a sandbox, as the exec log keeps it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExecRecord {
    pub id: i64,
    pub sandbox_id: String,
    pub argv: Vec<String>,
    pub cwd: String,
    /// Unix time, seconds.
    pub started_at: f64,
    pub duration_ms: f64,
    /// Shell convention (128 + signal).
    pub exit_code: i32,
    pub output_bytes: u64,
    /// Its output as kept (absent unless asked for, or from before
    /// outputs were kept).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output: Option<KeptOutput>,
}

/// A command run against a sealed snapshot (in a throwaway sandbox forked
/// from it) and what it found.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Evaluation {
    pub id: i64,
    pub snapshot: String,
    pub name: String,
    pub version: String,
    pub argv: Vec<String>,
    /// Shell convention (128 + signal; 137 after a timeout's kill).
    pub exit_code: i32,
    pub timed_out: bool,
    pub duration_ms: f64,
    pub output: KeptOutput,
    /// The JSON the command wrote to `$STRATA_RESULT`, if it wrote any.
    pub result: Option<serde_json::Value>,
    /// Why what it wrote there is not kept (not JSON, too large, not a file).
    pub result_error: Option<String>,
    pub created_at: i64,
    /// Answered from the record of an earlier run (same snapshot, name and
    /// version), not run now. Not stored.
    #[serde(default)]
    pub recorded: bool,
}

/// One activation of a lineage: which snapshot (or the image) seeded which
/// sandbox, by which rung of the ladder.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RestoreRow {
    pub id: i64,
    pub work_context: String,
    pub sandbox_id: String,
    pub rung: Rung,
    pub snapshot_id: Option<SnapshotId>,
    /// The head the sandbox observed: its next append is fenced on it.
    pub observed_head: Option<SnapshotId>,
    pub created_at: i64,
    /// The rungs above this one that could not be restored, and why
    /// (`head 0123456789abcdef: layer ... is missing from the store`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub fell: Vec<String>,
}

/// The live sandbox working in a lineage.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Holder {
    pub sandbox: String,
    /// Its host (`None`: a daemon outside a fleet).
    pub host: Option<String>,
}

impl std::fmt::Display for Holder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.host {
            Some(h) => write!(f, "sandbox {} on host {h}", self.sandbox),
            None => write!(f, "sandbox {}", self.sandbox),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_snapshots_info_decodes_typed_or_not_at_all() {
        let stored = r#"{"log_from":3,"log_upto":9,"userns":true,"compacted":false,"frozen_ms":1.5,"entries":7,
            "network":{"mode":"egress"},"pulled_from":"r/x:1"}"#;
        let meta = SnapshotMeta::decode(stored).unwrap();
        assert_eq!((meta.log_segment(), meta.userns, meta.pulled_from.as_deref()), (Some((3, 9)), true, Some("r/x:1")));
        assert_eq!(meta.network.as_ref().map(|n| n.mode), Some(crate::net::NetworkMode::Egress));
        // What it only shows comes back as it was written.
        assert_eq!((meta.shown["frozen_ms"].as_f64(), meta.shown["entries"].as_u64()), (Some(1.5), Some(7)));
        let again = SnapshotMeta::decode(&serde_json::to_string(&meta).unwrap()).unwrap();
        assert_eq!(again, meta);
        // No log: none (a baseline); half a segment, or a typed key of the
        // wrong type, is an error, not a 0 or a false.
        assert_eq!(SnapshotMeta::decode("{}").unwrap().log_segment(), None);
        for bad in
            [r#"{"log_from":3}"#, r#"{"log_upto":3}"#, r#"{"userns":"yes"}"#, r#"{"log_upto":"9","log_from":1}"#, "[]"]
        {
            assert!(SnapshotMeta::decode(bad).is_err(), "{bad} decoded");
        }
    }
}
