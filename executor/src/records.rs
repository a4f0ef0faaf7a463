//! The records the API shows as the catalog keeps them: an exec record, an
//! evaluation, a lineage's restore and holder, a baseline's key. The
//! catalog stores them and the API's bodies embed them, so both name them
//! here, and neither depends on the other for them.

use serde::{Deserialize, Serialize};

use crate::ids::SnapshotId;
use crate::model::{KeptOutput, Rung};

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
