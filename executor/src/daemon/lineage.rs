//! Lineages (work contexts) and the rules that keep one task's tree out of
//! another's (docs/design.md "Lineage invariants"). The rules live in the
//! database (`catalog/`: the CHECKs, the partial unique indexes, the fenced
//! append); this module picks what a sandbox starts from:
//!
//! - `create` starts a new lineage from the image;
//! - `resume SNAPSHOT` continues the snapshot's own lineage;
//! - `resume --work-context ID` follows the ladder: the lineage's head, else
//!   the snapshot it began from (its baseline or fork origin), else the
//!   image. A rung that cannot be restored (layers missing, hydration
//!   failing, layers the fleet registry cannot give: it is down, a blob is
//!   missing or does not match its digest; a fork origin whose lineage was
//!   retired) is passed, and why is recorded with the restore (`lineage
//!   show`); only "no rung left" is an error. It never falls to another
//!   lineage's head;
//! - `fork` gives each child a new lineage whose origin is the snapshot;
//! - every activation is recorded (`restores`), and the sandbox observes
//!   the lineage's head then: its appends are fenced on it.

use crate::catalog::{DbError, SnapshotRow, WorkContextRow};
use crate::daemon::{lock, Daemon};
use crate::error::{Classify, ErrorKind};
use crate::ids::{SandboxId, SnapshotId};
use crate::model::{LineageState, SnapshotState, StartKind};

/// Why a lineage operation failed (making one for a launch, looking one
/// up, resuming, showing or retiring one, or the fence of an append).
#[derive(Debug, thiserror::Error, displaydoc::Display)]
pub enum LineageError {
    /// work context {0:?} must be 1-64 chars of [A-Za-z0-9._-], not starting with . or -
    BadId(String),
    /// work context {0} exists: continue it with `resume --work-context {0}`
    Exists(String),
    /// work context {0:?} not found
    NotFound(String),
    /// snapshot {id} is a {class}, not a checkpoint of a lineage
    NotACheckpoint { id: SnapshotId, class: crate::model::SnapshotClass },
    /// snapshot {id} of work context {work_context} is {state}: not restorable
    RetiredSnapshot { id: SnapshotId, work_context: String, state: String },
    /// work context {0} is {1}
    Ended(String, LineageState),
    /// a lineage closes as completed, cancelled or failed, not {0} (retire it with POST /v1/lineages/ID/retire)
    BadOutcome(LineageState),
    /// suspend refused: {0}
    Fenced(crate::catalog::Fence),
    /// count is for fork
    Count,
    /// the work context's image row is missing
    NoImageRow,
    /// {0}
    Snapshot(#[from] crate::daemon::lookup::SnapshotLookupError),
    /// {0}
    Launch(#[from] crate::daemon::LaunchError),
    /// {0}
    Db(#[from] DbError),
}

impl Classify for LineageError {
    fn kind(&self) -> ErrorKind {
        match self {
            LineageError::BadId(_) | LineageError::Count | LineageError::BadOutcome(_) => ErrorKind::InvalidArgument,
            LineageError::NotFound(_) => ErrorKind::NotFound,
            LineageError::NoImageRow => ErrorKind::Internal,
            LineageError::Snapshot(e) => e.kind(),
            LineageError::Launch(e) => e.kind(),
            LineageError::Db(e) => e.kind(),
            _ => ErrorKind::Conflict,
        }
    }
}

impl Daemon {
    /// Make a new lineage (with the given id, or a random one). A taken id
    /// is a conflict: an existing lineage is continued with `resume`.
    pub(crate) fn new_lineage(
        &self,
        id: Option<&str>,
        image_id: i64,
        start_kind: StartKind,
        start_id: Option<&SnapshotId>,
    ) -> Result<String, LineageError> {
        let id = match id {
            Some(id) if !crate::ids::valid_work_context(id) => return Err(LineageError::BadId(id.to_string())),
            Some(id) => id.to_string(),
            None => SandboxId::random().to_string(),
        };
        if !lock(&self.db).insert_work_context(&WorkContextRow::new(&id, image_id, start_kind, start_id))? {
            return Err(LineageError::Exists(id));
        }
        Ok(id)
    }

    pub(crate) fn work_context_row(&self, id: &str) -> Result<WorkContextRow, LineageError> {
        lock(&self.db).work_context(id)?.ok_or_else(|| LineageError::NotFound(id.to_string()))
    }

    /// The lineage a resume or fork of `row` continues or branches from;
    /// refused if it is retired (its checkpoints left restore eligibility).
    pub(crate) fn eligible_lineage(&self, row: &SnapshotRow) -> Result<WorkContextRow, LineageError> {
        let Some(wc) = &row.work_context else {
            return Err(LineageError::NotACheckpoint { id: row.id.clone(), class: row.class });
        };
        let wc = self.work_context_row(wc)?;
        if wc.state != LineageState::Active || row.state == SnapshotState::Retired {
            // The lineage's end, or the snapshot's own retirement.
            let state = if wc.state != LineageState::Active { wc.state.to_string() } else { "retired".into() };
            return Err(LineageError::RetiredSnapshot { id: row.id.clone(), work_context: wc.id, state });
        }
        Ok(wc)
    }

    /// Refuse early (before a rung is hydrated or a sandbox started) a
    /// launch in a lineage another live sandbox holds; the launch's own
    /// transaction checks again ([`crate::catalog::Db::activate_sandbox`]).
    pub(crate) fn lineage_free(&self, wc: &str) -> Result<(), LineageError> {
        match lock(&self.db).lineage_holder(wc, None)? {
            Some(holder) => Err(DbError::LineageHeld { work_context: wc.into(), holder }.into()),
            None => Ok(()),
        }
    }

    /// Refuse early if an append for this sandbox would be refused.
    pub(crate) fn check_fence(&self, sandbox: &SandboxId) -> Result<(), LineageError> {
        match lock(&self.db).append_fence(sandbox)? {
            Some(f) => Err(LineageError::Fenced(f)),
            None => Ok(()),
        }
    }
}
