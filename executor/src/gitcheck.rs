//! The evidence a baseline is published on, gathered by the daemon from the
//! sealed tree (`daemon/baseline.rs`), never by the sandbox.
//!
//! The repository is the one in the layer about to be published (the
//! daemon's own copy, made while the sandbox was frozen), so what is
//! checked is what is stored: there is no window between the two. The
//! sandbox's own programs never run: the checks use the host's git.
//!
//! A repository is the sandbox's data, written by code we do not trust, and
//! git runs programs its configuration names (`core.fsmonitor`, hooks,
//! `filter.*.clean`, `diff.*.textconv`, `core.sshCommand`...). So git never
//! reads the repository's configuration: it runs on a scratch git
//! directory of ours, whose `config` we write, holding copies of the
//! repository's `HEAD`, refs, `packed-refs`, index, `shallow` and
//! `info/exclude` (data, not commands), with the repository's object
//! store named by `GIT_OBJECT_DIRECTORY`. System and global configuration
//! are off, `HOME` is the scratch directory, and the command line turns
//! off what a default could still start (fsmonitor, hooks, submodule
//! recursion, protocols). `.gitattributes` in the tree can name a filter
//! or a diff driver, but with no configuration defining one there is
//! nothing to run. Before that, the repository's git directory must hold
//! only regular files and directories (no symlink, which could lead git
//! out of the layer; no FIFO, socket or device, on which a read would
//! never end), no `objects/info/alternates` or `commondir`, and only
//! extensions git reads as data (`objectformat`); and every git child is
//! killed after 30 s.
//!
//! What it checks (docs/design.md, "Lineage invariants"): the canonical remote
//! ref resolves; HEAD is at its commit with the canonical branch checked
//! out; nothing staged, modified, or untracked and not ignored; no merge,
//! rebase, cherry-pick, revert or bisect in progress.
#![forbid(unsafe_code)]

use std::fs;
use std::io::Read;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// One validation check, as the evidence keeps it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Check {
    pub name: String,
    pub ok: bool,
    pub detail: String,
}

impl Check {
    fn new(name: &str, ok: bool, detail: impl Into<String>) -> Check {
        Check { name: name.into(), ok, detail: detail.into() }
    }
}

/// Why the checks could not be run (as opposed to a check that failed).
#[derive(Debug, thiserror::Error, displaydoc::Display)]
pub enum GitCheckError {
    /// git is not installed on the host (it checks baselines): install git
    NoGit,
    /// {step} {path}: {source}
    Io {
        step: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// git {args} did not finish within {secs} s
    Timeout { args: String, secs: u64 },
    /// git {args} failed ({status}): {stderr}
    Failed { args: String, status: String, stderr: String },
}

/// How long one git command may run: its inputs are files of the layer
/// (checked by type first), so only a repository far larger than a task's
/// takes this long.
const GIT_TIMEOUT: Duration = Duration::from_secs(30);

/// Where the host's git is looked for (a fixed list: not the daemon's PATH).
const GIT_PATHS: [&str; 3] = ["/usr/bin/git", "/usr/local/bin/git", "/bin/git"];

/// Paths under a git directory that mean an operation is in progress.
const IN_PROGRESS: [&str; 6] =
    ["MERGE_HEAD", "CHERRY_PICK_HEAD", "REVERT_HEAD", "BISECT_LOG", "rebase-merge", "rebase-apply"];

/// Configuration given on git's command line (through `GIT_CONFIG_*`): it
/// wins over any file, and turns off what could start a program.
const PINNED: [(&str, &str); 11] = [
    ("safe.directory", "*"),
    ("core.fsmonitor", "false"),
    ("core.hooksPath", "/dev/null"),
    ("core.untrackedCache", "false"),
    ("core.attributesFile", "/dev/null"),
    ("core.excludesFile", "/dev/null"),
    ("submodule.recurse", "false"),
    ("diff.ignoreSubmodules", "all"),
    ("protocol.allow", "never"),
    // History is read from the commits themselves, not from side files the
    // sandbox could have written.
    ("core.commitGraph", "false"),
    ("core.multiPackIndex", "false"),
];

/// A repository in a sealed tree, ready for git to read: `work` is the
/// worktree (in the layer), `scratch` our git directory.
pub struct Repo {
    git: PathBuf,
    work: PathBuf,
    gitdir: PathBuf,
    scratch: PathBuf,
}

/// Is `a` an ancestor of `b` (as git's history says)?
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ancestry {
    Ancestor,
    NotAncestor,
    /// `b` is not in the repository at all.
    Unknown,
}

impl Repo {
    /// Prepare `work` (a worktree whose `.git` is a directory) for the
    /// checks, with `scratch` (a new, empty directory) as git's directory.
    /// `Err` for a host failure; `Ok(Err(check))` when the repository
    /// cannot be read safely (the failed check says why).
    pub fn open(work: &Path, scratch: &Path) -> Result<Result<Repo, Check>, GitCheckError> {
        let git = GIT_PATHS.iter().map(PathBuf::from).find(|p| p.is_file()).ok_or(GitCheckError::NoGit)?;
        let gitdir = work.join(".git");
        let refuse = |detail: String| Ok(Err(Check::new("repository", false, detail)));
        if !fs::symlink_metadata(work).is_ok_and(|m| m.is_dir()) {
            return refuse("the repository path is not a directory (a symlink is not followed)".into());
        }
        match fs::symlink_metadata(&gitdir) {
            Ok(m) if m.is_dir() => {}
            Ok(_) => return refuse(".git is not a directory (a linked worktree or a submodule's checkout)".into()),
            Err(_) => return refuse("not a git repository (no .git directory)".into()),
        }
        // Nothing in the git directory may lead out of the layer, nor hold
        // a read: only files and directories, checked before any git runs.
        if let Some((path, kind)) = first_special(&gitdir)? {
            let rel = path.strip_prefix(work).unwrap_or(&path).display().to_string();
            return refuse(format!("{rel} is {kind}; a baseline's git directory holds only files and directories"));
        }
        for name in ["objects/info/alternates", "objects/info/http-alternates", "commondir"] {
            if fs::symlink_metadata(gitdir.join(name)).is_ok() {
                return refuse(format!(".git/{name} exists: a baseline's repository holds its own objects"));
            }
        }
        let repo = Repo { git, work: work.into(), gitdir, scratch: scratch.into() };
        // The repository's config is read as a file, never used: only the
        // extensions git needs to read it as data.
        let ext = repo.git_raw(
            &[
                "config",
                "--file",
                &path_arg(&repo.gitdir.join("config")),
                "--no-includes",
                "--get-regexp",
                r"^extensions\.",
            ],
            false,
        )?;
        let mut format = None;
        for line in String::from_utf8_lossy(&ext.1).lines() {
            let (k, v) = line.split_once(' ').unwrap_or((line, ""));
            match (k, v) {
                ("extensions.objectformat", "sha1" | "sha256") => format = Some(v.to_string()),
                ("extensions.worktreeconfig" | "extensions.preciousobjects", _) => {}
                _ => return refuse(format!("the repository uses {k} = {v}, which baselines do not support")),
            }
        }
        repo.make_scratch(format.as_deref())?;
        Ok(Ok(repo))
    }

    /// The scratch git directory: our config, copies of the data.
    fn make_scratch(&self, object_format: Option<&str>) -> Result<(), GitCheckError> {
        let mut config = String::from("[core]\n\trepositoryformatversion = 1\n\tbare = false\n");
        if let Some(f) = object_format {
            config.push_str(&format!("[extensions]\n\tobjectformat = {f}\n"));
        }
        let cfg = self.scratch.join("config");
        fs::write(&cfg, config).map_err(io("write", &cfg))?;
        // Not `info/exclude`: what is ignored comes from committed
        // `.gitignore` files only (see `checks`).
        for name in ["HEAD", "packed-refs", "index", "shallow"] {
            let src = self.gitdir.join(name);
            if fs::symlink_metadata(&src).is_ok_and(|m| m.is_file()) {
                let dst = self.scratch.join(name);
                if let Some(p) = dst.parent() {
                    fs::create_dir_all(p).map_err(io("create", p))?;
                }
                fs::copy(&src, &dst).map_err(io("copy", &src))?;
            }
        }
        copy_dir(&self.gitdir.join("refs"), &self.scratch.join("refs"))?;
        Ok(())
    }

    /// Run git with our environment; (status code, stdout).
    fn git_raw(&self, args: &[&str], strict: bool) -> Result<(i32, Vec<u8>), GitCheckError> {
        self.git_on(args, strict, None)
    }

    /// [`Repo::git_raw`] with another index file (`GIT_INDEX_FILE`).
    fn git_on(&self, args: &[&str], strict: bool, index: Option<&Path>) -> Result<(i32, Vec<u8>), GitCheckError> {
        self.git_full(args, strict, index, None)
    }

    /// [`Repo::git_on`], `input` written to git's stdin.
    fn git_full(
        &self,
        args: &[&str],
        strict: bool,
        index: Option<&Path>,
        input: Option<Vec<u8>>,
    ) -> Result<(i32, Vec<u8>), GitCheckError> {
        let mut cmd = Command::new(&self.git);
        cmd.args(args)
            .env_clear()
            .env("PATH", "/usr/bin:/bin")
            .env("HOME", &self.scratch)
            .env("LC_ALL", "C")
            .env("GIT_CONFIG_NOSYSTEM", "1")
            .env("GIT_CONFIG_GLOBAL", "/dev/null")
            .env("GIT_ATTR_NOSYSTEM", "1")
            .env("GIT_DIR", &self.scratch)
            .env("GIT_WORK_TREE", &self.work)
            .env("GIT_OBJECT_DIRECTORY", self.gitdir.join("objects"))
            .env("GIT_OPTIONAL_LOCKS", "0")
            .env("GIT_NO_REPLACE_OBJECTS", "1")
            .env("GIT_NO_LAZY_FETCH", "1")
            .env("GIT_TERMINAL_PROMPT", "0")
            .env("GIT_CONFIG_COUNT", PINNED.len().to_string())
            .current_dir(&self.scratch)
            .stdin(if input.is_some() { Stdio::piped() } else { Stdio::null() })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        for (i, (k, v)) in PINNED.iter().enumerate() {
            cmd.env(format!("GIT_CONFIG_KEY_{i}"), k).env(format!("GIT_CONFIG_VALUE_{i}"), v);
        }
        if let Some(index) = index {
            cmd.env("GIT_INDEX_FILE", index);
        }
        let shown = args.join(" ");
        let mut child =
            cmd.spawn().map_err(|source| GitCheckError::Io { step: "run", path: self.git.clone(), source })?;
        if let (Some(input), Some(mut stdin)) = (input, child.stdin.take()) {
            // On a thread: git may write before it has read it all.
            std::thread::spawn(move || {
                use std::io::Write;
                let _ = stdin.write_all(&input);
            });
        }
        // Both pipes are drained on threads so a large output cannot block git.
        let out_t = drain(child.stdout.take());
        let err_t = drain(child.stderr.take());
        let started = Instant::now();
        let status = loop {
            if let Some(s) = child.try_wait().map_err(|source| GitCheckError::Io {
                step: "wait for",
                path: self.git.clone(),
                source,
            })? {
                break s;
            }
            if started.elapsed() > GIT_TIMEOUT {
                // Our own child, by its pid.
                let _ = child.kill();
                let _ = child.wait();
                return Err(GitCheckError::Timeout { args: shown, secs: GIT_TIMEOUT.as_secs() });
            }
            std::thread::sleep(Duration::from_millis(2));
        };
        let stdout = out_t.join().unwrap_or_default();
        let stderr = err_t.join().unwrap_or_default();
        let code = status.code().unwrap_or(-1);
        if strict && code != 0 {
            let status = match status.signal() {
                Some(s) => format!("signal {s}"),
                None => format!("exit {code}"),
            };
            return Err(GitCheckError::Failed {
                args: shown,
                status,
                stderr: String::from_utf8_lossy(&stderr).trim().into(),
            });
        }
        Ok((code, stdout))
    }

    /// `git rev-parse --verify --quiet SPEC`: the object id, if it resolves.
    fn resolve(&self, spec: &str) -> Result<Option<String>, GitCheckError> {
        let (code, out) = self.git_raw(&["rev-parse", "--verify", "--quiet", spec], false)?;
        let id = String::from_utf8_lossy(&out).trim().to_string();
        Ok((code == 0 && !id.is_empty()).then_some(id))
    }

    /// The checks, every one run (a refusal names all that failed).
    pub fn checks(&self, git_ref: &str, remote: &str) -> Result<Vec<Check>, GitCheckError> {
        let mut checks = vec![Check::new("repository", true, "")];
        let remote_commit = self.resolve(&format!("refs/remotes/{remote}/{git_ref}^{{commit}}"))?;
        checks.push(match &remote_commit {
            Some(c) => Check::new("remote_ref_resolves", true, c.clone()),
            None => {
                Check::new("remote_ref_resolves", false, format!("refs/remotes/{remote}/{git_ref} does not resolve"))
            }
        });
        let head = self.resolve("HEAD^{commit}")?;
        checks.push(match (&head, &remote_commit) {
            (Some(h), Some(r)) if h == r => Check::new("head_equals_remote", true, h.clone()),
            _ => Check::new(
                "head_equals_remote",
                false,
                format!(
                    "HEAD is {}, {remote}/{git_ref} is {}",
                    head.as_deref().unwrap_or("unborn"),
                    remote_commit.as_deref().unwrap_or("missing")
                ),
            ),
        });
        let (_, branch) = self.git_raw(&["symbolic-ref", "--quiet", "HEAD"], false)?;
        let branch = String::from_utf8_lossy(&branch).trim().to_string();
        let want = format!("refs/heads/{git_ref}");
        checks.push(if branch == want {
            Check::new("branch_checked_out", true, branch)
        } else {
            let shown = if branch.is_empty() { "detached".to_string() } else { branch };
            Check::new("branch_checked_out", false, format!("HEAD is {shown}, not {want}"))
        });
        // Staged: the repository's own index against HEAD.
        let (mut staged, mut modified, mut untracked, mut hiding) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let names = |out: Vec<u8>| -> Vec<String> {
            out.split(|&b| b == 0).filter(|e| !e.is_empty()).map(|e| String::from_utf8_lossy(e).into_owned()).collect()
        };
        if head.is_some() && self.scratch.join("index").is_file() {
            let (_, out) = self
                .git_raw(&["diff-index", "--cached", "--name-only", "-z", "--ignore-submodules=all", "HEAD"], true)?;
            staged = names(out);
        }
        // The worktree against HEAD through a fresh index of ours: flags
        // the repository's index could set on an entry (assume-unchanged,
        // skip-worktree, fsmonitor-valid) hide nothing, and every tracked
        // file's content is compared.
        let fresh = self.scratch.join("fresh-index");
        if head.is_some() {
            self.git_on(&["read-tree", "HEAD"], true, Some(&fresh))?;
        }
        let (_, status) = self.git_on(
            &[
                "status",
                "--porcelain=v1",
                "-z",
                "--untracked-files=all",
                "--ignored=matching",
                "--ignore-submodules=all",
                "--no-renames",
            ],
            true,
            Some(&fresh),
        )?;
        for entry in status.split(|&b| b == 0).filter(|e| e.len() > 3) {
            let (x, y, path) = (entry[0], entry[1], String::from_utf8_lossy(&entry[3..]).into_owned());
            match (x, y) {
                (b'?', b'?') => untracked.push(path),
                // Ignored is fine (build caches), but not a `.gitignore` or
                // `.gitattributes` that is itself ignored: one that ignores
                // itself could hide any file, or change how files compare.
                (b'!', b'!') => {
                    let base = path.trim_end_matches('/').rsplit('/').next().unwrap_or("");
                    if matches!(base, ".gitignore" | ".gitattributes") {
                        hiding.push(path);
                    }
                }
                (_, b' ') => {}
                _ => modified.push(path),
            }
        }
        for (name, what, paths) in [
            ("nothing_staged", "staged", staged),
            ("no_tracked_modification", "modified", modified),
            ("no_untracked_files", "untracked, not ignored", untracked),
            ("no_self_ignored_rules", "untracked ignore or attribute files that ignore themselves", hiding),
        ] {
            checks.push(Check::new(name, paths.is_empty(), listed(what, &paths)));
        }
        let ops: Vec<&str> =
            IN_PROGRESS.iter().copied().filter(|f| fs::symlink_metadata(self.gitdir.join(f)).is_ok()).collect();
        checks.push(if ops.is_empty() {
            Check::new("no_operation_in_progress", true, "")
        } else {
            Check::new("no_operation_in_progress", false, format!("in progress: {}", ops.join(" ")))
        });
        let (_, version) = self.git_raw(&["--version"], true)?;
        checks.push(Check::new("git_version", true, String::from_utf8_lossy(&version).trim()));
        Ok(checks)
    }

    /// Write, at `out` (a new directory), the git directory a baseline
    /// keeps instead of the repository's: the canonical branch `git_ref`
    /// at `commit` (checked out, with its remote-tracking ref on `remote`)
    /// and the tags reachable from it; the objects those reach, packed
    /// anew by our git (nothing else of the object store: another task's
    /// branch, a stash, what only a reflog reached); a config of ours
    /// (the remote's URL without credentials; nothing else of the
    /// repository's: no `http.extraheader`, no credential helper); a
    /// fresh index of `commit`; and `shallow` and `info/exclude` copied as
    /// data. No reflog, stash, hook, other ref or side file. Returns the
    /// tags kept.
    pub fn write_canonical(
        &self,
        git_ref: &str,
        remote: &str,
        commit: &str,
        out: &Path,
    ) -> Result<Vec<String>, GitCheckError> {
        let failed = |what: &str| GitCheckError::Failed {
            args: "write the canonical repository".into(),
            status: "refused".into(),
            stderr: what.into(),
        };
        if !is_hex_id(commit) {
            return Err(failed("the commit is not an object id"));
        }
        // Tags whose commit the canonical one reaches (annotated: the tag
        // object itself is kept and packed).
        let (_, listed) = self.git_raw(
            &["for-each-ref", &format!("--merged={commit}"), "--format=%(objectname) %(refname)", "refs/tags"],
            true,
        )?;
        let mut tags = Vec::new();
        for line in String::from_utf8_lossy(&listed).lines() {
            let Some((id, name)) = line.split_once(' ') else { continue };
            let Some(tag) = name.strip_prefix("refs/tags/") else { continue };
            // A ref name git accepted, and a path under refs/tags/ here.
            if is_hex_id(id) && !tag.split('/').any(|c| c.is_empty() || c.starts_with('.')) {
                tags.push((id.to_string(), tag.to_string()));
            }
        }
        let (_, url) = self.git_raw(
            &[
                "config",
                "--file",
                &path_arg(&self.gitdir.join("config")),
                "--no-includes",
                "--get",
                &format!("remote.{remote}.url"),
            ],
            false,
        )?;
        let url = without_credentials(String::from_utf8_lossy(&url).trim());
        let object_format = if commit.len() == 64 { "\n[extensions]\n\tobjectformat = sha256" } else { "" };
        let version = if commit.len() == 64 { 1 } else { 0 };
        let mut config = format!(
            "[core]\n\trepositoryformatversion = {version}\n\tfilemode = true\n\tbare = false\n\tlogallrefupdates = true{object_format}\n"
        );
        if let Some(url) = &url {
            config.push_str(&format!(
                "[remote \"{remote}\"]\n\turl = {url}\n\tfetch = +refs/heads/*:refs/remotes/{remote}/*\n"
            ));
        }
        config.push_str(&format!("[branch \"{git_ref}\"]\n\tremote = {remote}\n\tmerge = refs/heads/{git_ref}\n"));
        let write = |rel: &str, data: &[u8]| -> Result<(), GitCheckError> {
            let p = out.join(rel);
            if let Some(d) = p.parent() {
                fs::create_dir_all(d).map_err(io("create", d))?;
            }
            fs::write(&p, data).map_err(io("write", &p))
        };
        for dir in ["objects/pack", "objects/info", "refs/heads", "refs/tags", "info"] {
            fs::create_dir_all(out.join(dir)).map_err(io("create", out))?;
        }
        write("config", config.as_bytes())?;
        write("HEAD", format!("ref: refs/heads/{git_ref}\n").as_bytes())?;
        write(&format!("refs/heads/{git_ref}"), format!("{commit}\n").as_bytes())?;
        write(&format!("refs/remotes/{remote}/{git_ref}"), format!("{commit}\n").as_bytes())?;
        for (id, tag) in &tags {
            write(&format!("refs/tags/{tag}"), format!("{id}\n").as_bytes())?;
        }
        for name in ["shallow", "info/exclude"] {
            let src = self.gitdir.join(name);
            if fs::symlink_metadata(&src).is_ok_and(|m| m.is_file()) {
                fs::copy(&src, out.join(name)).map_err(io("copy", &src))?;
            }
        }
        // The objects the kept refs reach, in one new pack.
        let mut revs = format!("{commit}\n");
        for (id, _) in &tags {
            revs.push_str(&format!("{id}\n"));
        }
        let base = out.join("objects/pack/pack");
        self.git_full(&["pack-objects", "--revs", "--quiet", &path_arg(&base)], true, None, Some(revs.into_bytes()))?;
        // A fresh index of the commit (the repository's may name split
        // index files or extensions of its own), refreshed against the tree.
        let index = out.join("index");
        self.git_on(&["read-tree", commit], true, Some(&index))?;
        self.git_on(&["update-index", "-q", "--refresh"], false, Some(&index))?;
        Ok(tags.into_iter().map(|(_, t)| t).collect())
    }

    /// Why this git directory is not one [`Repo::write_canonical`] could
    /// have written for `git_ref` on `remote` (a pulled baseline's, which
    /// is stored as it came and cannot be rewritten), or `None`: only the
    /// files it writes; refs only under the canonical branch, its
    /// remote-tracking ref and tags; objects in packs only, every one
    /// reached from `commit` or a kept tag; a config of only the keys it
    /// writes, the remote's URL without credentials.
    pub fn canonical_shape(&self, git_ref: &str, remote: &str, commit: &str) -> Result<Option<String>, GitCheckError> {
        let allowed_ref = |rel: &str| {
            rel == format!("refs/heads/{git_ref}")
                || rel == format!("refs/remotes/{remote}/{git_ref}")
                || rel.starts_with("refs/tags/")
        };
        let mut stray = None;
        walk(&self.gitdir, &mut |rel: &str, dir: bool| {
            let ok = match rel {
                "HEAD" | "config" | "index" | "shallow" | "info" | "info/exclude" | "objects" | "objects/pack"
                | "objects/info" | "refs" | "refs/heads" | "refs/tags" | "refs/remotes" => true,
                r if r.starts_with("objects/pack/pack-") => {
                    !dir && [".pack", ".idx", ".rev"].iter().any(|x| r.ends_with(x))
                }
                r if dir => {
                    format!("refs/heads/{git_ref}/").starts_with(&format!("{r}/"))
                        || format!("refs/remotes/{remote}/{git_ref}/").starts_with(&format!("{r}/"))
                        || r.starts_with("refs/tags/")
                }
                r => allowed_ref(r),
            };
            if !ok && stray.is_none() {
                stray = Some(format!(".git/{rel}"));
            }
        })?;
        if let Some(s) = stray {
            return Ok(Some(format!("its repository holds {s}, which a baseline's never does")));
        }
        let (_, listed) = self
            .git_raw(&["config", "--file", &path_arg(&self.gitdir.join("config")), "--no-includes", "--list"], true)?;
        for line in String::from_utf8_lossy(&listed).lines() {
            let (k, v) = line.split_once('=').unwrap_or((line, ""));
            let ok = match k {
                "core.repositoryformatversion" | "core.filemode" | "core.bare" | "core.logallrefupdates" => true,
                "extensions.objectformat" => true,
                k if k == format!("remote.{remote}.fetch") => true,
                k if k == format!("remote.{remote}.url") => without_credentials(v).as_deref() == Some(v),
                k => k == format!("branch.{git_ref}.remote") || k == format!("branch.{git_ref}.merge"),
            };
            if !ok {
                return Ok(Some(format!("its repository's config sets {k}, which a baseline's never does")));
            }
        }
        // Every object is reached from the kept refs.
        let (_, all) = self.git_raw(&["cat-file", "--batch-all-objects", "--batch-check=%(objectname)"], true)?;
        let (_, tags) = self.git_raw(&["for-each-ref", "--format=%(objectname)", "refs/tags"], true)?;
        let tags = String::from_utf8_lossy(&tags).into_owned();
        let mut args = vec!["rev-list", "--objects", commit];
        args.extend(tags.lines().filter(|t| is_hex_id(t)));
        let (_, reached) = self.git_raw(&args, true)?;
        let reached: std::collections::HashSet<&[u8]> =
            reached.split(|&b| b == b'\n').filter_map(|l| l.split(|&b| b == b' ').next()).collect();
        let extra = all.split(|&b| b == b'\n').filter(|l| !l.is_empty() && !reached.contains(l)).count();
        if extra > 0 {
            return Ok(Some(format!("its repository holds {extra} object(s) the canonical refs do not reach")));
        }
        Ok(None)
    }

    /// Is commit `a` an ancestor of commit `b`?
    pub fn ancestry(&self, a: &str, b: &str) -> Result<Ancestry, GitCheckError> {
        if !is_hex_id(a) || !is_hex_id(b) {
            return Ok(Ancestry::Unknown);
        }
        if self.resolve(&format!("{b}^{{commit}}"))?.is_none() {
            return Ok(Ancestry::Unknown);
        }
        match self.git_raw(&["merge-base", "--is-ancestor", a, b], false)?.0 {
            0 => Ok(Ancestry::Ancestor),
            1 => Ok(Ancestry::NotAncestor),
            _ => Ok(Ancestry::Unknown),
        }
    }
}

fn io(step: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> GitCheckError {
    let path = path.to_path_buf();
    move |source| GitCheckError::Io { step, path, source }
}

/// Call `f` with the path (relative to `dir`) of everything under `dir`,
/// and whether it is a directory.
fn walk(dir: &Path, f: &mut dyn FnMut(&str, bool)) -> Result<(), GitCheckError> {
    fn go(root: &Path, dir: &Path, f: &mut dyn FnMut(&str, bool)) -> Result<(), GitCheckError> {
        for e in fs::read_dir(dir).map_err(io("read", dir))? {
            let e = e.map_err(io("read", dir))?;
            let p = e.path();
            let is_dir = e.file_type().map_err(io("stat", &p))?.is_dir();
            f(&p.strip_prefix(root).unwrap_or(&p).to_string_lossy(), is_dir);
            if is_dir {
                go(root, &p, f)?;
            }
        }
        Ok(())
    }
    go(dir, dir, f)
}

/// A remote URL as a baseline keeps it: `https://user:secret@host/...`
/// loses its user information (a token, a password; over ssh the login
/// stays, its password not); an scp-like `user@host:path` keeps its user
/// (an ssh login, not a secret); a URL
/// with a control character or whitespace, which could not be written
/// back safely, is dropped.
fn without_credentials(url: &str) -> Option<String> {
    if url.is_empty() || url.chars().any(|c| c.is_control() || c.is_whitespace() || c == '"' || c == '\\') {
        return None;
    }
    if let Some((scheme, rest)) = url.split_once("://") {
        let (authority, path) = rest.split_once('/').map_or((rest, ""), |(a, p)| (a, p));
        let (user, host) = authority.rsplit_once('@').map_or((None, authority), |(u, h)| (Some(u), h));
        // Over ssh the user is a login (kept, its password not); over
        // http a user alone can be the token itself.
        let login = match user {
            Some(u) if scheme.contains("ssh") => format!("{}@", u.split(':').next().unwrap_or("")),
            _ => String::new(),
        };
        let slash = if rest.contains('/') { "/" } else { "" };
        return Some(format!("{scheme}://{login}{host}{slash}{path}"));
    }
    Some(url.to_string())
}

/// A full object id (sha1 or sha256), lowercase hex.
fn is_hex_id(s: &str) -> bool {
    matches!(s.len(), 40 | 64) && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// `what: p1 p2 ... and N more` (at most five paths), or nothing.
fn listed(what: &str, paths: &[String]) -> String {
    if paths.is_empty() {
        return String::new();
    }
    let more = if paths.len() > 5 { format!(" and {} more", paths.len() - 5) } else { String::new() };
    format!("{what}: {}{more}", paths[..paths.len().min(5)].join(" "))
}

/// Read `r` to its end on a thread of its own.
fn drain<R: Read + Send + 'static>(r: Option<R>) -> std::thread::JoinHandle<Vec<u8>> {
    std::thread::spawn(move || {
        let mut v = Vec::new();
        if let Some(mut r) = r {
            let _ = r.read_to_end(&mut v);
        }
        v
    })
}

fn path_arg(p: &Path) -> String {
    p.to_string_lossy().into_owned()
}

/// The first entry under `dir` (not following any) that is neither a
/// regular file nor a directory, with what it is: a symlink could lead git
/// out of the layer, and a FIFO, socket or device would hold git (and the
/// publish) on a read that never ends.
fn first_special(dir: &Path) -> Result<Option<(PathBuf, &'static str)>, GitCheckError> {
    use std::os::unix::fs::FileTypeExt;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in fs::read_dir(&d).map_err(io("read", &d))? {
            let e = e.map_err(io("read", &d))?;
            let t = e.file_type().map_err(io("read", &e.path()))?;
            let kind = if t.is_dir() {
                stack.push(e.path());
                continue;
            } else if t.is_file() {
                continue;
            } else if t.is_symlink() {
                "a symlink"
            } else if t.is_fifo() {
                "a FIFO"
            } else if t.is_socket() {
                "a socket"
            } else if t.is_block_device() || t.is_char_device() {
                "a device"
            } else {
                "not a regular file"
            };
            return Ok(Some((e.path(), kind)));
        }
    }
    Ok(None)
}

/// Copy the regular files and directories under `src` (which has no
/// symlink: checked before) to `dst`.
fn copy_dir(src: &Path, dst: &Path) -> Result<(), GitCheckError> {
    fs::create_dir_all(dst).map_err(io("create", dst))?;
    if !src.is_dir() {
        return Ok(());
    }
    for e in fs::read_dir(src).map_err(io("read", src))? {
        let e = e.map_err(io("read", src))?;
        let t = e.file_type().map_err(io("read", &e.path()))?;
        let to = dst.join(e.file_name());
        if t.is_dir() {
            copy_dir(&e.path(), &to)?;
        } else if t.is_file() {
            fs::copy(e.path(), &to).map_err(io("copy", &e.path()))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
