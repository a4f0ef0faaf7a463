//! `publish`: a sandbox's repository becomes the ready baseline of its
//! key (docs/design.md invariants 2 and 3), made so that the sandbox it
//! comes from cannot forge one (docs/security.md, "Baselines").
//!
//! The repository directory, and nothing else, is copied out of the
//! sandbox's layers while the sandbox is frozen
//! (`store::layers::layer_of_dir`): that copy is the baseline's layer, on
//! the image's chain alone (never on the checkpoint the sandbox may have
//! been resumed from). The checks are read from that copy (`baseline`'s
//! `judge`), its git directory is replaced by the canonical history
//! alone, and it is recorded by a compare-and-swap on the ready baseline
//! observed when the publish began. A checkpoint is never promoted.

use std::path::{Path, PathBuf};
use std::time::Instant;

use serde::{Deserialize, Serialize};

use crate::catalog::{Baseline, LayerRow, SnapshotRow};
use crate::daemon::baseline::{repo_path, valid_name, valid_ref, BaselineError, Check, Key, Verdict};
use crate::daemon::capture::{mark_userns, merge_stats, worker_err, CaptureError};
use crate::daemon::{lock, Daemon};
use crate::ids::LayerId;
use crate::store::{remove_tree, BlobCompression, Lease};
use crate::types::SnapshotInfo;

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PublishRequest {
    /// Absolute path of the repository inside the sandbox; its last
    /// component is the key's repository name.
    pub repo: String,
    /// The canonical branch, e.g. `main`.
    #[serde(rename = "ref")]
    pub git_ref: String,
    /// Default `local`.
    #[serde(default)]
    pub owner: Option<String>,
    /// The remote whose tracking ref is canonical (default `origin`).
    #[serde(default)]
    pub remote: Option<String>,
    /// The commit the caller knows the canonical ref to be at (a scheduler
    /// that asked the remote): HEAD must be it. Without it, the
    /// remote-tracking ref in the sandbox's repository is taken as the
    /// canonical ref, which is the sandbox's claim (docs/security.md).
    #[serde(default)]
    pub commit: Option<String>,
}

impl Daemon {
    /// Validate, capture and publish a baseline of sandbox `id`.
    pub fn publish_baseline(&self, id: &str, req: PublishRequest) -> Result<SnapshotInfo, BaselineError> {
        let owner = req.owner.clone().unwrap_or_else(|| "local".into());
        let remote = req.remote.clone().unwrap_or_else(|| "origin".into());
        let rel = repo_path(&req.repo).ok_or_else(|| BaselineError::BadRepo(req.repo.clone()))?;
        let repo_name = rel.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        if !valid_name(&repo_name) {
            return Err(BaselineError::BadRepo(req.repo.clone()));
        }
        if !valid_name(&owner) || !valid_name(&remote) {
            return Err(BaselineError::BadNames);
        }
        if !valid_ref(&req.git_ref) {
            return Err(BaselineError::BadRef(req.git_ref.clone()));
        }
        let sb = self.sandbox(id)?;
        sb.own_layers("publish")?;
        let started = Instant::now();
        let image = lock(&self.db).image_by_name(&sb.spec.image.parse()?)?.ok_or(BaselineError::NoImageRow)?;
        // The compare-and-swap's expected value: the ready baseline now.
        let observed = lock(&self.db).ready_baseline(&owner, &repo_name, image.id, &req.git_ref)?;
        if let Some(c) = &req.commit {
            if !(c.len() == 40 || c.len() == 64) || !c.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
                return Err(BaselineError::BadCommit(c.clone()));
            }
        }
        let key = Key {
            owner,
            repo: repo_name,
            git_ref: req.git_ref.clone(),
            remote,
            path: req.repo.clone(),
            expected: req.commit.clone(),
        };
        let work = self.rt.store.new_tmp("baseline")?;
        let result = self.leased(|lease| self.publish_in(&sb, &work, &rel, &key, image.id, observed, started, lease));
        let _ = remove_tree(&work);
        let info = result?;
        tracing::info!("published baseline {} for {}", info.id, key.shown());
        Ok(info)
    }

    /// The publish proper, in `work` (scratch), what it writes held by
    /// `lease` until its row is recorded.
    #[allow(clippy::too_many_arguments)]
    fn publish_in(
        &self,
        sb: &crate::sandbox::Sandbox,
        work: &Path,
        rel: &Path,
        key: &Key,
        image_id: i64,
        observed: Option<String>,
        started: Instant,
        lease: &Lease,
    ) -> Result<SnapshotInfo, BaselineError> {
        let store = &self.rt.store;
        // The repository directory of the sandbox's merged view, copied
        // whole while the sandbox is frozen: the baseline's layer.
        let mut layers = vec![sb.dirs(store).upper];
        layers.extend(sb.spec.layers.iter().rev().map(|l| store.layer_dir(l.as_str()).join("fs")));
        let layer_dir = work.join("layer");
        let fs_dir = layer_dir.join("fs");
        let scratch = work.join("git");
        for d in [&fs_dir, &scratch] {
            std::fs::create_dir_all(d).map_err(|source| CaptureError::Io { step: "create the layer", source })?;
        }
        let frozen = Instant::now();
        sb.while_frozen("publish", || {
            crate::store::layers::layer_of_dir(&layers, rel, &fs_dir).map_err(crate::sandbox::SandboxError::Capture)
        })?;
        let frozen = frozen.elapsed();

        // The evidence, read from that copy.
        let (mut checks, commit) = match self.judge(&fs_dir.join(rel), &scratch, key, observed.as_deref())? {
            Verdict::New { checks, commit } => (checks, commit),
            Verdict::Same(current) => return Ok(self.snapshot_info_locked(&lock(&self.db), &current)?),
        };
        // What the baseline keeps of the repository: its canonical history.
        checks.push(canonicalize(&fs_dir.join(rel), work, key, &commit)?);
        crate::failpoint::hit("baseline:validated");

        // Sealed: the layer's blob, in a worker charged to the sandbox.
        let tmp = store.new_blob_path();
        let ((stats, diff_id, blob_hex, blob_size), cpu) = crate::worker::seal(&fs_dir, &tmp, sb).map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            worker_err(e)
        })?;
        store.place_blob(&tmp, &blob_hex, lease).map_err(CaptureError::Store)?;
        let layer =
            LayerRow::content(LayerId::content(&diff_id).map_err(CaptureError::from)?, stats.bytes, stats.entries);
        store.commit_layer(&layer_dir, &diff_id, false, lease).map_err(CaptureError::Store)?;
        crate::failpoint::hit("baseline:layer-committed");
        // Layer and blob are on disk before the row names them.
        store.sync()?;

        let mut info = crate::records::SnapshotMeta::default();
        info.show("frozen_ms", frozen.as_secs_f64() * 1000.0);
        info.show("total_ms", started.elapsed().as_secs_f64() * 1000.0);
        info.show("worker_cpu_ms", cpu.as_secs_f64() * 1000.0);
        merge_stats(&mut info, &stats);
        mark_userns(&mut info, sb);
        let mut row = SnapshotRow::new(image_id, None, &layer, &sb.id, info);
        (row.blob_digest, row.blob_size, row.compression) =
            (Some(format!("sha256:{blob_hex}").parse().map_err(CaptureError::from)?), blob_size, BlobCompression::Zstd);
        row.baseline = Some(Baseline {
            owner: key.owner.clone(),
            repo: key.repo.clone(),
            git_ref: key.git_ref.clone(),
            commit,
            evidence: serde_json::json!({
                "checks": checks,
                "repo_path": key.path,
                "remote": key.remote,
                "validated_at": crate::catalog::now(),
                "checked_by": "the daemon, with the host's git, on the sealed layer",
            }),
        });
        let recorded = lock(&self.db).publish_baseline(&mut row, &layer, observed.as_deref())?;
        if let Err(current) = recorded {
            return Err(BaselineError::Superseded {
                key: key.shown(),
                current: current.as_deref().unwrap_or("none").to_string(),
                observed: observed.as_deref().unwrap_or("none").to_string(),
            });
        }
        crate::failpoint::hit("baseline:appended");
        Ok(self.snapshot_info_locked(&lock(&self.db), &row)?)
    }
}

/// Replace the git directory of the copy at `repo_dir` (checked clean at
/// `commit`) with the canonical one ([`crate::gitcheck::Repo::write_canonical`]),
/// owned as the worktree is, then check the result as a publish checks:
/// what a sandbox started from the baseline sees is what was checked.
fn canonicalize(repo_dir: &Path, work: &Path, key: &Key, commit: &str) -> Result<Check, BaselineError> {
    let scratch = |name: &str| -> Result<PathBuf, BaselineError> {
        let d = work.join(name);
        std::fs::create_dir(&d).map_err(|source| CaptureError::Io { step: "create git's scratch", source })?;
        Ok(d)
    };
    let refused = |c: Check| BaselineError::ChecksFailed(format!("{}: {}", c.name, c.detail));
    let repo = crate::gitcheck::Repo::open(repo_dir, &scratch("git-canonical")?)?.map_err(refused)?;
    let out = scratch("canonical-git")?;
    let tags = repo.write_canonical(&key.git_ref, &key.remote, commit, &out)?;
    let owner = std::fs::symlink_metadata(repo_dir)
        .map_err(|source| CaptureError::Io { step: "read the repository's owner", source })?;
    chown_tree(&out, std::os::unix::fs::MetadataExt::uid(&owner), std::os::unix::fs::MetadataExt::gid(&owner))
        .map_err(|source| CaptureError::Io { step: "own the canonical repository", source })?;
    let gitdir = repo_dir.join(".git");
    remove_tree(&gitdir).map_err(CaptureError::Store)?;
    std::fs::rename(&out, &gitdir)
        .map_err(|source| CaptureError::Io { step: "place the canonical repository", source })?;
    let repo = crate::gitcheck::Repo::open(repo_dir, &scratch("git-recheck")?)?.map_err(refused)?;
    let failed: Vec<String> = repo
        .checks(&key.git_ref, &key.remote)?
        .into_iter()
        .filter(|c| !c.ok)
        .map(|c| format!("{}: {}", c.name, c.detail))
        .collect();
    if !failed.is_empty() {
        return Err(BaselineError::ChecksFailed(format!("the canonical repository: {}", failed.join("; "))));
    }
    Ok(Check {
        name: "canonical_history".into(),
        ok: true,
        detail: format!(
            "kept refs/heads/{r} and refs/remotes/{m}/{r} at {commit}, {} tag(s) it reaches, the objects they reach; \
             no other ref, stash or reflog; config rewritten without credentials",
            tags.len(),
            r = key.git_ref,
            m = key.remote
        ),
    })
}

/// `lchown` everything under `dir` (and itself) to `uid:gid`.
fn chown_tree(dir: &Path, uid: u32, gid: u32) -> std::io::Result<()> {
    std::os::unix::fs::lchown(dir, Some(uid), Some(gid))?;
    for e in std::fs::read_dir(dir)? {
        let e = e?;
        if e.file_type()?.is_dir() {
            chown_tree(&e.path(), uid, gid)?;
        } else {
            std::os::unix::fs::lchown(e.path(), Some(uid), Some(gid))?;
        }
    }
    Ok(())
}
