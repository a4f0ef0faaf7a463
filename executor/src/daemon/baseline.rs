//! Baselines: clean repository states that new work starts from
//! (docs/design.md invariants 2 and 3), made so that the sandbox they come from
//! cannot forge one (docs/security.md, "Baselines").
//!
//! `publish` copies the repository directory, and nothing else, out of the
//! sandbox's layers while the sandbox is frozen (`diff::layer_of_dir`):
//! that copy is the baseline's layer, on the image's chain alone (never on
//! the checkpoint the sandbox may have been resumed from). The daemon then
//! reads the evidence from that copy with the host's git, configured by
//! us and not by the repository (`gitcheck.rs`): what is checked is what
//! is stored, and none of the sandbox's programs runs. A clean repository
//! becomes the ready baseline of its key (owner, repo, image, ref) by a
//! compare-and-swap on the ready baseline observed when the publish began,
//! and only if its commit is not older: the same commit is a no-op that
//! answers the existing baseline, an ancestor of the ready one's commit (or
//! a repository that never fetched it) is refused. A checkpoint is never
//! promoted.

use std::path::{Path, PathBuf};
use std::time::Instant;

use serde::{Deserialize, Serialize};

use crate::catalog::{Baseline, LayerRow, SnapshotRow};
use crate::daemon::capture::{mark_userns, merge_stats, worker_err, CaptureError};
use crate::daemon::{lock, sandbox_info, Daemon};
use crate::error::{Classify, ErrorKind};
use crate::gitcheck::Ancestry;
use crate::ids::{LayerId, SnapshotId};
use crate::store::{remove_tree, BlobCompression, Lease};
use crate::types::{LaunchRequest, SandboxInfo, SnapshotInfo};

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

pub use crate::gitcheck::Check;

/// A key part (owner, repository name): 1-100 chars of `[A-Za-z0-9._-]`,
/// not starting with `.` or `-`.
fn valid_name(s: &str) -> bool {
    (1..=100).contains(&s.len())
        && s.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
        && !s.starts_with(['.', '-'])
}

/// A branch name git would accept, restricted to a safe alphabet.
fn valid_ref(s: &str) -> bool {
    (1..=200).contains(&s.len())
        && s.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-' | b'/'))
        && !s.starts_with(['.', '-', '/'])
        && !s.ends_with(['/', '.'])
        && !s.contains("..")
        && !s.contains("//")
        && !s.ends_with(".lock")
}

/// `OWNER/REPO@REF`, the key `create --baseline` names.
pub fn parse_key(s: &str) -> Result<(String, String, String), String> {
    let bad = || format!("baseline {s:?} must be OWNER/REPO@REF");
    let (or, git_ref) = s.split_once('@').ok_or_else(bad)?;
    let (owner, repo) = or.split_once('/').ok_or_else(bad)?;
    if !valid_name(owner) || !valid_name(repo) || !valid_ref(git_ref) {
        return Err(bad());
    }
    Ok((owner.into(), repo.into(), git_ref.into()))
}

/// Why a baseline could not be validated, published, or started from.
#[derive(Debug, thiserror::Error, displaydoc::Display)]
pub enum BaselineError {
    /// repo {0:?} must be an absolute path whose last part is a name
    BadRepo(String),
    /// owner and remote must be 1-100 chars of [A-Za-z0-9._-]
    BadNames,
    /// ref {0:?} is not a branch name
    BadRef(String),
    /// commit {0:?} must be a full object id (40 or 64 lowercase hex characters)
    BadCommit(String),
    /// {0}
    BadKey(String),
    /// baseline refused, failed checks: {0}
    ChecksFailed(String),
    /// baseline refused: commit {commit} is older than {key}'s ready baseline at {current} (an ancestor of it)
    Older { key: String, commit: String, current: String },
    /// baseline refused: {key}'s ready baseline is at {current}, which this repository does not have: fetch, then publish
    NotFetched { key: String, current: String },
    /// baseline refused: commit {commit} does not descend from {key}'s ready baseline at {current} (diverged history)
    Diverged { key: String, commit: String, current: String },
    /// {0}
    Git(#[from] crate::gitcheck::GitCheckError),
    /// baseline refused: {key} is now {current} (published after this publish began, from {observed}); an older publisher never replaces a newer baseline
    Superseded { key: String, current: String, observed: String },
    /// image {0} not found
    NoImage(crate::ids::ImageName),
    /// the sandbox's image row is missing
    NoImageRow,
    /// no ready baseline {key} for image {image}
    NoBaseline { key: String, image: String },
    /// baseline {0} not found
    Gone(String),
    /// {0}
    ImageName(#[from] crate::ids::BadImageName),
    /// {0}
    Sandbox(#[from] crate::daemon::SandboxOpError),
    /// {0}
    Exec(#[from] crate::sandbox::SandboxError),
    /// {0}
    Capture(#[from] crate::daemon::capture::CaptureError),
    /// {0}
    Snapshot(#[from] crate::daemon::lookup::SnapshotLookupError),
    /// {0}
    Lineage(#[from] crate::daemon::lineage::LineageError),
    /// {0}
    Launch(#[from] crate::daemon::LaunchError),
    /// {0}
    Store(#[from] crate::store::StoreError),
    /// {0}
    Db(#[from] crate::catalog::DbError),
}

impl Classify for BaselineError {
    fn kind(&self) -> ErrorKind {
        use BaselineError as B;
        match self {
            B::BadRepo(_) | B::BadNames | B::BadRef(_) | B::BadCommit(_) | B::BadKey(_) | B::ImageName(_) => {
                ErrorKind::InvalidArgument
            }
            B::ChecksFailed(_) | B::Older { .. } | B::NotFetched { .. } | B::Diverged { .. } | B::Superseded { .. } => {
                ErrorKind::Conflict
            }
            B::NoImage(_) | B::NoBaseline { .. } | B::Gone(_) => ErrorKind::NotFound,
            B::NoImageRow => ErrorKind::Internal,
            B::Git(_) => ErrorKind::of_host_failure(self),
            B::Sandbox(e) => e.kind(),
            B::Exec(e) => e.kind(),
            B::Capture(e) => e.kind(),
            B::Snapshot(e) => e.kind(),
            B::Lineage(e) => e.kind(),
            B::Launch(e) => e.kind(),
            B::Store(_) => ErrorKind::of_host_failure(self),
            B::Db(e) => e.kind(),
        }
    }
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

    /// Check the repository at `repo_dir` (in a sealed layer) for `key`,
    /// against the ready baseline `observed`: the checks, then newer
    /// commit wins. `scratch` is an empty directory for git's.
    fn judge(
        &self,
        repo_dir: &Path,
        scratch: &Path,
        key: &Key,
        observed: Option<&str>,
    ) -> Result<Verdict, BaselineError> {
        let repo = match crate::gitcheck::Repo::open(repo_dir, scratch)? {
            Ok(repo) => repo,
            Err(c) => return Err(BaselineError::ChecksFailed(format!("{}: {}", c.name, c.detail))),
        };
        let mut checks = repo.checks(&key.git_ref, &key.remote)?;
        if let Some(want) = &key.expected {
            let head = checks.iter().find(|c| c.name == "head_equals_remote").map(|c| c.detail.as_str());
            let ok = head == Some(want.as_str());
            let detail = if ok { want.clone() } else { format!("HEAD is not the canonical commit {want}") };
            checks.push(crate::gitcheck::Check { name: "canonical_commit".into(), ok, detail });
        }
        let failed: Vec<String> =
            checks.iter().filter(|c| !c.ok).map(|c| format!("{}: {}", c.name, c.detail)).collect();
        if !failed.is_empty() {
            return Err(BaselineError::ChecksFailed(failed.join("; ")));
        }
        let commit =
            checks.iter().find(|c| c.name == "head_equals_remote").map(|c| c.detail.clone()).unwrap_or_default();
        if let Some(current) = observed.map(|id| self.snapshot_row(id)).transpose()? {
            let current_commit = current.baseline.as_ref().map(|b| b.commit.clone()).unwrap_or_default();
            if current_commit == commit {
                return Ok(Verdict::Same(Box::new(current)));
            }
            // Only a descendant of the ready commit replaces it.
            if repo.ancestry(&current_commit, &commit)? != Ancestry::Ancestor {
                return Err(match repo.ancestry(&commit, &current_commit)? {
                    Ancestry::Ancestor => BaselineError::Older { key: key.shown(), commit, current: current_commit },
                    Ancestry::NotAncestor => {
                        BaselineError::Diverged { key: key.shown(), commit, current: current_commit }
                    }
                    Ancestry::Unknown => BaselineError::NotFetched { key: key.shown(), current: current_commit },
                });
            }
        }
        Ok(Verdict::New { checks, commit })
    }

    /// A pulled baseline becomes eligible for new work only once this host
    /// checked it as a publish is checked: its layer alone on its image,
    /// holding only the repository its evidence names, clean, at the
    /// commit it claims, and not older than the ready one. Else it stays
    /// superseded, its info saying why (`ineligible`). Never fails the pull.
    pub(crate) fn admit_pulled_baseline(&self, id: &SnapshotId) {
        let work = match self.rt.store.new_tmp("baseline-check") {
            Ok(w) => w,
            Err(e) => return tracing::warn!("pulled baseline {id}: {e}"),
        };
        let verdict = self.check_pulled_baseline(id, &work);
        let _ = remove_tree(&work);
        let why = match verdict {
            Ok(None) => return tracing::info!("pulled baseline {id} checked: ready"),
            Ok(Some(why)) => why,
            Err(e) => crate::error::chain(&e),
        };
        tracing::warn!("pulled baseline {id} is not eligible for new work: {why}");
        if let Err(e) = lock(&self.db).mark_ineligible(id.as_str(), &format!("pulled: {why}")) {
            tracing::warn!("pulled baseline {id}: {e}");
        }
    }

    /// `Ok(None)` if admitted, `Ok(Some(why))` if not.
    fn check_pulled_baseline(&self, id: &SnapshotId, work: &Path) -> Result<Option<String>, BaselineError> {
        let row = self.snapshot_row(id.as_str())?;
        let Some(b) = row.baseline.clone() else { return Ok(Some("not a baseline".into())) };
        if row.parent_id.is_some() {
            return Ok(Some("it sits on another snapshot; a baseline holds the repository alone on its image".into()));
        }
        let path = b.evidence["repo_path"].as_str().unwrap_or_default().to_string();
        let Some(rel) = repo_path(&path) else {
            return Ok(Some(format!("its evidence names no repository path ({path:?})")));
        };
        let remote = b.evidence["remote"].as_str().unwrap_or("origin").to_string();
        if !valid_name(&remote) || rel.file_name().and_then(|n| n.to_str()) != Some(b.repo.as_str()) {
            return Ok(Some("its evidence does not match its key".into()));
        }
        let _pin = self.pin_snapshot(&row.id)?;
        // Hydrated now if the pull left it for later.
        self.snapshot_base(&row)?;
        let fs_dir = self.rt.store.layer_dir(row.layer.as_str()).join("fs");
        if let Some(stray) = outside(&fs_dir, &rel)? {
            return Ok(Some(format!("its layer holds {stray}, outside the repository")));
        }
        let observed = lock(&self.db).ready_baseline(&b.owner, &b.repo, row.image_id, &b.git_ref)?;
        let key = Key {
            owner: b.owner.clone(),
            repo: b.repo.clone(),
            git_ref: b.git_ref.clone(),
            remote,
            path,
            expected: None,
        };
        let scratch = work.join("git");
        std::fs::create_dir_all(&scratch)
            .map_err(|source| CaptureError::Io { step: "create the scratch dir", source })?;
        let verdict = match self.judge(&fs_dir.join(&rel), &scratch, &key, observed.as_deref()) {
            Ok(v) => v,
            Err(
                e @ (BaselineError::ChecksFailed(_) | BaselineError::Older { .. } | BaselineError::NotFetched { .. }),
            ) => return Ok(Some(e.to_string())),
            Err(e) => return Err(e),
        };
        match verdict {
            Verdict::Same(current) => Ok(Some(format!("the ready baseline {} is at the same commit", current.id))),
            Verdict::New { commit, .. } if commit != b.commit => {
                Ok(Some(format!("it claims commit {}, its tree is at {commit}", b.commit)))
            }
            Verdict::New { commit, .. } => {
                // Stored as it came: it must already be only the canonical
                // history (a publishing host trims it; see `canonicalize`).
                let scratch = work.join("git-shape");
                std::fs::create_dir_all(&scratch)
                    .map_err(|source| CaptureError::Io { step: "create the scratch dir", source })?;
                let repo = match crate::gitcheck::Repo::open(&fs_dir.join(&rel), &scratch)? {
                    Ok(repo) => repo,
                    Err(c) => return Ok(Some(format!("{}: {}", c.name, c.detail))),
                };
                if let Some(why) = repo.canonical_shape(&key.git_ref, &key.remote, &commit)? {
                    return Ok(Some(why));
                }
                self.admit_checked(id, observed.as_deref())
            }
        }
    }

    /// Make a checked pulled baseline its key's ready one, unless another
    /// became ready meanwhile.
    fn admit_checked(&self, id: &SnapshotId, observed: Option<&str>) -> Result<Option<String>, BaselineError> {
        match lock(&self.db).admit_baseline(id.as_str(), observed)? {
            Ok(()) => Ok(None),
            Err(current) => Ok(Some(format!(
                "{} became the ready baseline while it was checked",
                current.as_deref().unwrap_or("none")
            ))),
        }
    }

    /// `create --baseline OWNER/REPO@REF`: new work from the key's ready
    /// baseline, in a lineage of its own that began from it.
    pub fn create_from_baseline(
        &self,
        key: &str,
        image: &str,
        work_context: Option<&str>,
        launch: LaunchRequest,
    ) -> Result<SandboxInfo, BaselineError> {
        let (owner, repo, git_ref) = parse_key(key).map_err(BaselineError::BadKey)?;
        let launch = self.launch_spec(launch)?;
        let name: crate::ids::ImageName = image.parse()?;
        let image = lock(&self.db).image_by_name(&name)?.ok_or(BaselineError::NoImage(name))?;
        let id = lock(&self.db)
            .ready_baseline(&owner, &repo, image.id, &git_ref)?
            .ok_or_else(|| BaselineError::NoBaseline { key: key.to_string(), image: image.name.to_string() })?;
        let row = lock(&self.db).snapshot(&id)?.ok_or_else(|| BaselineError::Gone(id.to_string()))?;
        let _pin = self.pin_snapshot(&row.id)?;
        let mut base = self.snapshot_base(&row)?;
        let wc = self.new_lineage(work_context, image.id, crate::model::StartKind::Baseline, Some(&row.id))?;
        (base.work_context, base.observed_head, base.rung) = (wc.clone(), None, crate::model::Rung::Baseline);
        match self.launch(&base, launch) {
            Ok(sb) => Ok(sandbox_info(&sb)),
            Err(e) => {
                let _ = lock(&self.db).delete_unused_work_context(&wc);
                Err(e.into())
            }
        }
    }
}

/// What [`Daemon::judge`] found.
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

enum Verdict {
    /// Clean, and not older than the ready baseline.
    New { checks: Vec<Check>, commit: String },
    /// At the ready baseline's commit: that baseline.
    Same(Box<SnapshotRow>),
}

/// The first path of the layer tree `fs` outside `rel` and its ancestors,
/// or one of those that is not a real directory (a symlink is never
/// followed).
fn outside(fs: &Path, rel: &Path) -> Result<Option<String>, BaselineError> {
    let mut dir = fs.to_path_buf();
    let mut shown = PathBuf::new();
    for c in rel.components() {
        let entries = std::fs::read_dir(&dir).map_err(|source| CaptureError::Io { step: "read the layer", source })?;
        for e in entries {
            let e = e.map_err(|source| CaptureError::Io { step: "read the layer", source })?;
            if e.file_name() != c.as_os_str() {
                return Ok(Some(format!("/{}", shown.join(e.file_name()).display())));
            }
        }
        dir.push(c);
        shown.push(c);
        if !std::fs::symlink_metadata(&dir).is_ok_and(|m| m.is_dir()) {
            return Ok(Some(format!("/{} (not a directory)", shown.display())));
        }
    }
    Ok(None)
}

/// What a publish is for.
struct Key {
    owner: String,
    repo: String,
    git_ref: String,
    remote: String,
    /// The repository's path in the sandbox, as asked.
    path: String,
    /// The canonical commit, if the caller knows it.
    expected: Option<String>,
}

impl Key {
    fn shown(&self) -> String {
        format!("{}/{}@{}", self.owner, self.repo, self.git_ref)
    }
}

/// The repository's path relative to the sandbox's root: absolute, plain
/// components only (no `.`, `..` or empty ones), not the root.
fn repo_path(repo: &str) -> Option<PathBuf> {
    let rest = repo.strip_prefix('/')?.trim_end_matches('/');
    if rest.is_empty() || repo.contains('\0') {
        return None;
    }
    let mut p = PathBuf::new();
    for c in rest.split('/') {
        if c.is_empty() || c == "." || c == ".." {
            return None;
        }
        p.push(c);
    }
    Some(p)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_and_refs() {
        assert_eq!(parse_key("acme/app@main").unwrap(), ("acme".into(), "app".into(), "main".into()));
        assert_eq!(parse_key("acme/app@release/1.2").unwrap().2, "release/1.2");
        for bad in ["acme/app", "app@main", "acme/app@", "/app@main", "acme/app@../x", "acme/a b@main", "a/b@-x"] {
            assert!(parse_key(bad).is_err(), "{bad}");
        }
        assert!(!valid_ref("main.lock") && !valid_ref("a//b") && !valid_ref("a/"));
        assert_eq!(repo_path("/src/app/"), Some(PathBuf::from("src/app")));
        for bad in ["src/app", "/", "/src/../etc", "/src//app", "/./app"] {
            assert_eq!(repo_path(bad), None, "{bad}");
        }
    }
}
