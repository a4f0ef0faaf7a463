//! Baselines: clean repository states that new work starts from
//! (DESIGN.md invariants 2 and 3). `publish` validates a repository with
//! git inside the sandbox (nothing of the sandbox's runs on the host), seals
//! the sandbox's tree as a snapshot of class `baseline` with the evidence,
//! and makes it the ready baseline of its key (owner, repo, image, ref) by a
//! compare-and-swap on the ready baseline it observed when it began, so an
//! older concurrent publisher never replaces a newer one. A checkpoint is
//! never promoted: a baseline is always a capture of its own.
//!
//! The repository is validated twice, before the capture and after it (the
//! capture is kept only if both agree), so a sandbox that changes its tree
//! while a publish runs gets a refusal, not a baseline of a state nobody
//! checked.

use std::time::Instant;

use serde::{Deserialize, Serialize};

use crate::daemon::snapshots::CaptureError;
use crate::daemon::{lock, sandbox_info, Daemon};
use crate::db::{Baseline, LayerRow, SnapshotRow};
use crate::error::{Classify, ErrorKind};
use crate::store::{remove_tree, BlobCompression};
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
}

/// One validation check, as the evidence keeps it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Check {
    pub name: String,
    pub ok: bool,
    pub detail: String,
}

/// The checks, run by `sh` in the sandbox: `$1` the repository, `$2` the
/// ref, `$3` the remote. One `name<TAB>ok|fail<TAB>detail` line each. git
/// runs without optional locks (it writes nothing) and with fsmonitor off
/// (a repository's config cannot make it run a program).
const CHECKS: &str = r#"
ok() { printf '%s\tok\t%s\n' "$1" "$2"; }
fail() { printf '%s\tfail\t%s\n' "$1" "$2"; }
g() { git --no-optional-locks -c safe.directory='*' -c core.fsmonitor=false "$@"; }
command -v git >/dev/null 2>&1 || { fail git "git is not installed in the sandbox"; exit 0; }
cd "$1" 2>/dev/null || { fail repository "$1 is not a directory"; exit 0; }
gitdir=$(g rev-parse --git-dir 2>/dev/null) || { fail repository "$1 is not a git repository"; exit 0; }
ok repository "$1"
ref=$2
remote=$3
rc=$(g rev-parse --verify --quiet "refs/remotes/$remote/$ref^{commit}")
if [ -n "$rc" ]; then ok remote_ref_resolves "$rc"; else fail remote_ref_resolves "refs/remotes/$remote/$ref does not resolve"; fi
head=$(g rev-parse --verify --quiet 'HEAD^{commit}')
if [ -n "$head" ] && [ "$head" = "$rc" ]; then ok head_equals_remote "$head"
else fail head_equals_remote "HEAD is ${head:-unborn}, $remote/$ref is ${rc:-missing}"; fi
branch=$(g symbolic-ref --quiet HEAD)
if [ "$branch" = "refs/heads/$ref" ]; then ok branch_checked_out "$branch"
else fail branch_checked_out "HEAD is ${branch:-detached}, not refs/heads/$ref"; fi
if g diff --cached --quiet 2>/dev/null; then ok nothing_staged ""
else fail nothing_staged "staged: $(g diff --cached --name-only | head -5 | tr '\n' ' ')"; fi
if g diff --quiet 2>/dev/null; then ok no_tracked_modification ""
else fail no_tracked_modification "modified: $(g diff --name-only | head -5 | tr '\n' ' ')"; fi
u=$(g ls-files --others --exclude-standard | head -5 | tr '\n' ' ')
if [ -z "$u" ]; then ok no_untracked_files ""; else fail no_untracked_files "untracked, not ignored: $u"; fi
ops=""
for f in MERGE_HEAD CHERRY_PICK_HEAD REVERT_HEAD BISECT_LOG rebase-merge rebase-apply; do
  [ -e "$gitdir/$f" ] && ops="$ops $f"
done
if [ -z "$ops" ]; then ok no_operation_in_progress ""; else fail no_operation_in_progress "in progress:$ops"; fi
ok git_version "$(git --version)"
"#;

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
    /// {0}
    BadKey(String),
    /// the repository checks did not run to the end ({status}): {stderr}
    ChecksDidNotRun { status: String, stderr: String },
    /// the repository checks printed nothing
    ChecksSilent,
    /// baseline refused, failed checks: {0}
    ChecksFailed(String),
    /// baseline refused: the repository changed while it was being published
    Changed,
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
    Capture(#[from] crate::daemon::snapshots::CaptureError),
    /// {0}
    Snapshot(#[from] crate::daemon::snapshots::SnapshotLookupError),
    /// {0}
    Lineage(#[from] crate::daemon::lineage::LineageError),
    /// {0}
    Launch(#[from] crate::daemon::LaunchError),
    /// {0}
    Store(#[from] crate::store::StoreError),
    /// {0}
    Db(#[from] crate::db::DbError),
}

impl Classify for BaselineError {
    fn kind(&self) -> ErrorKind {
        use BaselineError as B;
        match self {
            B::BadRepo(_) | B::BadNames | B::BadRef(_) | B::BadKey(_) | B::ImageName(_) => ErrorKind::InvalidArgument,
            B::ChecksDidNotRun { .. } | B::ChecksFailed(_) | B::Changed | B::Superseded { .. } => ErrorKind::Conflict,
            B::NoImage(_) | B::NoBaseline { .. } | B::Gone(_) => ErrorKind::NotFound,
            B::ChecksSilent | B::NoImageRow => ErrorKind::Internal,
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
    /// Run the checks in the sandbox.
    fn validate_repo(
        &self,
        sb: &crate::sandbox::Sandbox,
        repo: &str,
        git_ref: &str,
        remote: &str,
    ) -> Result<Vec<Check>, BaselineError> {
        let req = crate::sandbox::ExecRequest {
            argv: ["sh", "-c", CHECKS, "strata-baseline-checks", repo, git_ref, remote].map(str::to_string).to_vec(),
            env: vec![],
            cwd: Some("/".into()),
            user: Some("0:0".into()),
            timeout: Some(std::time::Duration::from_secs(60)),
            tty: false,
            size: (0, 0),
        };
        let out = sb.exec_buffered(&req, Vec::new())?;
        if out.timed_out || out.status.shell_code() != 0 {
            return Err(BaselineError::ChecksDidNotRun {
                status: format!("{:?}", out.status),
                stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
            });
        }
        let checks: Vec<Check> = String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| {
                let mut f = l.splitn(3, '\t');
                let (name, ok, detail) = (f.next()?, f.next()?, f.next().unwrap_or(""));
                Some(Check { name: name.into(), ok: ok == "ok", detail: detail.into() })
            })
            .collect();
        if checks.is_empty() {
            return Err(BaselineError::ChecksSilent);
        }
        Ok(checks)
    }

    /// Validate, capture and publish a baseline of sandbox `id`.
    pub fn publish_baseline(&self, id: &str, req: PublishRequest) -> Result<SnapshotInfo, BaselineError> {
        let owner = req.owner.clone().unwrap_or_else(|| "local".into());
        let remote = req.remote.clone().unwrap_or_else(|| "origin".into());
        let repo_name = req.repo.trim_end_matches('/').rsplit('/').next().unwrap_or_default().to_string();
        if !req.repo.starts_with('/') || req.repo.contains('\0') || !valid_name(&repo_name) {
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
        let checks = self.validate_repo(&sb, &req.repo, &req.git_ref, &remote)?;
        let failed: Vec<String> =
            checks.iter().filter(|c| !c.ok).map(|c| format!("{}: {}", c.name, c.detail)).collect();
        if !failed.is_empty() {
            return Err(BaselineError::ChecksFailed(failed.join("; ")));
        }
        crate::failpoint::hit("baseline:validated");
        let commit =
            checks.iter().find(|c| c.name == "head_equals_remote").map(|c| c.detail.clone()).unwrap_or_default();
        let evidence = serde_json::json!({
            "checks": checks,
            "repo_path": req.repo,
            "remote": remote,
            "validated_at": crate::db::now(),
        });
        let baseline = Baseline { owner, repo: repo_name, git_ref: req.git_ref.clone(), commit, evidence };
        let key = format!("{}/{}@{}", baseline.owner, baseline.repo, baseline.git_ref);
        // The tree must be the one validated: check again after the capture,
        // before the row is written.
        let recheck = || -> Result<(), CaptureError> {
            let again = self.validate_repo(&sb, &req.repo, &req.git_ref, &remote).map_err(Box::new)?;
            if again != checks {
                return Err(Box::new(BaselineError::Changed).into());
            }
            Ok(())
        };
        let publish = |db: &mut crate::db::Db, row: &mut SnapshotRow, layer: &LayerRow| {
            row.baseline = Some(baseline.clone());
            match db.publish_baseline(row, layer, observed.as_deref())? {
                Ok(()) => Ok(()),
                Err(current) => Err(Box::new(BaselineError::Superseded {
                    key: key.clone(),
                    current: current.as_deref().unwrap_or("none").to_string(),
                    observed: observed.as_deref().unwrap_or("none").to_string(),
                })
                .into()),
            }
        };
        let work = self.rt.store.new_tmp("baseline")?;
        let result = self.leased(|lease| {
            self.capture_in(&sb, &work, BlobCompression::Zstd, started, Some(&recheck), &publish, lease)
        });
        let _ = remove_tree(&work);
        let info = result?;
        tracing::info!("published baseline {} for {key}", info.id);
        Ok(info)
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
    }
}
