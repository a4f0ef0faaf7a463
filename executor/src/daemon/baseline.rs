//! Baselines: clean repository states that new work starts from
//! (docs/design.md invariants 2 and 3), made so that the sandbox they come from
//! cannot forge one (docs/security.md, "Baselines"). This is the step the
//! `publish` verb, `create --baseline` and `pull` share.
//!
//! The daemon reads the evidence from a sealed copy of the repository with
//! the host's git, configured by us and not by the repository
//! (`gitcheck.rs`): what is checked is what is stored, and none of the
//! sandbox's programs runs (`judge`). A clean repository becomes the ready
//! baseline of its key (owner, repo, image, ref) only if its commit is not
//! older: the same commit is a no-op that answers the existing baseline, an
//! ancestor of the ready one's commit (or a repository that never fetched
//! it) is refused. A pulled baseline is judged the same way before it is
//! admitted (`admit_pulled_baseline`).

use std::path::{Path, PathBuf};

use crate::catalog::SnapshotRow;
use crate::daemon::capture::CaptureError;
use crate::daemon::{lock, sandbox_info, Daemon};
use crate::error::{Classify, ErrorKind};
use crate::gitcheck::Ancestry;
use crate::ids::SnapshotId;
use crate::store::remove_tree;
use crate::types::{LaunchRequest, SandboxInfo};

pub use crate::gitcheck::Check;

/// A key part (owner, repository name): 1-100 chars of `[A-Za-z0-9._-]`,
/// not starting with `.` or `-`.
pub(super) fn valid_name(s: &str) -> bool {
    (1..=100).contains(&s.len())
        && s.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
        && !s.starts_with(['.', '-'])
}

/// A branch name git would accept, restricted to a safe alphabet.
pub(super) fn valid_ref(s: &str) -> bool {
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
    /// Check the repository at `repo_dir` (in a sealed layer) for `key`,
    /// against the ready baseline `observed`: the checks, then newer
    /// commit wins. `scratch` is an empty directory for git's.
    pub(super) fn judge(
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
pub(super) enum Verdict {
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
pub(super) struct Key {
    pub(super) owner: String,
    pub(super) repo: String,
    pub(super) git_ref: String,
    pub(super) remote: String,
    /// The repository's path in the sandbox, as asked.
    pub(super) path: String,
    /// The canonical commit, if the caller knows it.
    pub(super) expected: Option<String>,
}

impl Key {
    pub(super) fn shown(&self) -> String {
        format!("{}/{}@{}", self.owner, self.repo, self.git_ref)
    }
}

/// The repository's path relative to the sandbox's root: absolute, plain
/// components only (no `.`, `..` or empty ones), not the root.
pub(super) fn repo_path(repo: &str) -> Option<PathBuf> {
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
