//! The lineage verbs (`lineage ls`, `show`, `retire`, `close`): what a
//! scheduler reads of its lineages and how it ends one. Ending one is
//! terminal (no resume, no append, its checkpoints out of restore
//! position), and the database enforces it (`catalog/lineages.rs`).

use crate::catalog::WorkContextRow;
use crate::daemon::lineage::LineageError;
use crate::daemon::{lock, Daemon};
use crate::model::LineageState;
use crate::types::{LineageInfo, LineageSummary};

impl Daemon {
    /// Every lineage, oldest first, with its head and holder.
    pub fn list_lineages(&self) -> Result<Vec<LineageSummary>, LineageError> {
        let db = lock(&self.db);
        let mut images = std::collections::HashMap::new();
        db.lineages()?.into_iter().map(|(wc, holder)| summary(&db, &mut images, wc, holder)).collect()
    }

    pub fn lineage(&self, id: &str) -> Result<LineageInfo, LineageError> {
        let wc = self.work_context_row(id)?;
        let db = lock(&self.db);
        let checkpoints =
            db.lineage_snapshots(id)?.iter().map(|r| self.snapshot_info_locked(&db, r)).collect::<Result<_, _>>()?;
        let holder = db.lineage_holder(id, None)?;
        Ok(LineageInfo {
            lineage: summary(&db, &mut Default::default(), wc, holder)?,
            checkpoints,
            restores: db.restores(id)?,
        })
    }

    /// Retire a finished lineage: its checkpoints leave restore
    /// eligibility (they stay until removed or collected).
    pub fn retire_lineage(&self, id: &str) -> Result<LineageInfo, LineageError> {
        self.work_context_row(id)?;
        lock(&self.db).retire_work_context(id)?;
        self.forget_secrets(id);
        self.lineage(id)
    }

    /// Close an active lineage with its work's outcome (`completed`,
    /// `cancelled`, `failed`): terminal as a retirement is (no resume, no
    /// append, its checkpoints out of restore position and collected after
    /// retention from now), and the outcome stays on record. A lineage
    /// that has ended already is 409 with its state.
    pub fn close_lineage(&self, id: &str, outcome: LineageState) -> Result<LineageInfo, LineageError> {
        if matches!(outcome, LineageState::Active | LineageState::Retired) {
            return Err(LineageError::BadOutcome(outcome));
        }
        self.work_context_row(id)?;
        if let Err(state) = lock(&self.db).close_work_context(id, outcome)? {
            return Err(LineageError::Ended(id.to_string(), state));
        }
        self.forget_secrets(id);
        self.lineage(id)
    }
}

/// A lineage's row as the API shows it (`images`: names looked up so far).
fn summary(
    db: &crate::catalog::Db,
    images: &mut std::collections::HashMap<i64, String>,
    wc: WorkContextRow,
    holder: Option<crate::catalog::Holder>,
) -> Result<LineageSummary, LineageError> {
    let image = match images.get(&wc.image_id) {
        Some(name) => name.clone(),
        None => {
            let name = db.image_by_id(wc.image_id)?.map(|i| i.name.to_string()).unwrap_or_default();
            images.insert(wc.image_id, name.clone());
            name
        }
    };
    Ok(LineageSummary {
        id: wc.id,
        state: wc.state,
        image,
        start_kind: wc.start_kind,
        start: wc.start_id,
        head: wc.head_id,
        head_seq: wc.head_seq,
        holder,
        created_at: wc.created_at,
        used_at: wc.used_at,
        retired_at: wc.retired_at,
    })
}
