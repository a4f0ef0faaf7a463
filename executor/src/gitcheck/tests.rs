//! Unit tests of `gitcheck`.

use super::*;

/// Run the host's git in `dir` with a throwaway identity.
fn git(dir: &Path, args: &[&str]) {
    let out = Command::new("git")
        .args(["-c", "user.name=t", "-c", "user.email=t@example.com", "-c", "init.defaultBranch=main"])
        .args(args)
        .current_dir(dir)
        .env("HOME", dir)
        .env("GIT_CONFIG_NOSYSTEM", "1")
        .output()
        .unwrap();
    assert!(out.status.success(), "git {args:?}: {out:?}");
}

/// A clean repository at `<tmp>/app` whose `origin/main` is its HEAD.
fn clean_repo(t: &Path) -> PathBuf {
    let app = t.join("app");
    fs::create_dir(&app).unwrap();
    git(&app, &["init", "-q"]);
    fs::write(app.join("a"), "v1\n").unwrap();
    git(&app, &["add", "a"]);
    git(&app, &["commit", "-qm", "one"]);
    git(&app, &["update-ref", "refs/remotes/origin/main", "HEAD"]);
    app
}

fn run(app: &Path, t: &Path) -> Result<Vec<Check>, Check> {
    let scratch = tempfile::tempdir_in(t).unwrap();
    Repo::open(app, scratch.path()).unwrap().map(|r| r.checks("main", "origin").unwrap())
}

fn failed(checks: &[Check]) -> Vec<(String, String)> {
    checks.iter().filter(|c| !c.ok).map(|c| (c.name.clone(), c.detail.clone())).collect()
}

/// `git ARGS` in `dir` (no identity needed); its stdout, or None.
fn read(dir: &Path, args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).current_dir(dir).env("GIT_CONFIG_NOSYSTEM", "1").output().unwrap();
    out.status.success().then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

#[test]
fn the_canonical_repository_keeps_the_branch_its_tags_and_nothing_else() {
    let t = tempfile::tempdir().unwrap();
    let app = clean_repo(t.path());
    git(&app, &["tag", "-a", "v1", "-m", "release"]);
    // Another task's branch, a commit only a reflog reaches, a stash,
    // a tag off the branch, and credentials in the config.
    git(&app, &["checkout", "-qb", "other-task"]);
    fs::write(app.join("b"), "theirs\n").unwrap();
    git(&app, &["add", "b"]);
    git(&app, &["commit", "-qm", "another task's work"]);
    git(&app, &["tag", "off-branch"]);
    let other = read(&app, &["rev-parse", "HEAD"]).unwrap().trim().to_string();
    git(&app, &["checkout", "-q", "main"]);
    fs::write(app.join("a"), "dropped\n").unwrap();
    git(&app, &["commit", "-qam", "reset away"]);
    let dropped = read(&app, &["rev-parse", "HEAD"]).unwrap().trim().to_string();
    git(&app, &["reset", "-q", "--hard", "HEAD~1"]);
    fs::write(app.join("a"), "stashed\n").unwrap();
    git(&app, &["stash", "-q"]);
    git(&app, &["config", "remote.origin.url", "https://bot:tok-SECRET@forge.invalid/o/app.git"]);
    git(&app, &["config", "http.extraheader", "Authorization: Bearer HDR-SECRET"]);
    let scratch = tempfile::tempdir_in(t.path()).unwrap();
    let repo = Repo::open(&app, scratch.path()).unwrap().unwrap();
    let head = read(&app, &["rev-parse", "HEAD"]).unwrap().trim().to_string();
    let why = repo.canonical_shape("main", "origin", &head).unwrap();
    assert!(why.is_some(), "the repository as it was passed as canonical");
    let out = t.path().join("canonical");
    fs::create_dir(&out).unwrap();
    assert_eq!(repo.write_canonical("main", "origin", &head, &out).unwrap(), vec!["v1".to_string()]);
    // Swapped in: the repository is the canonical one, and clean.
    fs::remove_dir_all(app.join(".git")).unwrap();
    fs::rename(&out, app.join(".git")).unwrap();
    let refs = read(&app, &["for-each-ref", "--format=%(refname)"]).unwrap();
    assert_eq!(refs, "refs/heads/main\nrefs/remotes/origin/main\nrefs/tags/v1\n");
    for gone in [&other, &dropped] {
        assert!(read(&app, &["cat-file", "-e", gone]).is_none(), "{gone} is still there");
    }
    assert_eq!(read(&app, &["stash", "list"]).unwrap(), "");
    assert!(!app.join(".git/logs").exists() && !app.join(".git/hooks").exists());
    let config = fs::read_to_string(app.join(".git/config")).unwrap();
    assert!(!config.contains("SECRET") && config.contains("url = https://forge.invalid/o/app.git"), "{config}");
    assert!(read(&app, &["fsck", "--no-dangling"]).is_some(), "fsck failed");
    assert_eq!(read(&app, &["status", "--porcelain"]).unwrap(), "");
    let checks = run(&app, t.path()).unwrap();
    assert!(failed(&checks).is_empty(), "{checks:?}");
    // As written, it has the canonical shape; an object more, not.
    let shape = |t: &Path| {
        let scratch = tempfile::tempdir_in(t).unwrap();
        Repo::open(&app, scratch.path()).unwrap().unwrap().canonical_shape("main", "origin", &head).unwrap()
    };
    assert_eq!(shape(t.path()), None);
    fs::write(app.join("extra"), "smuggled\n").unwrap();
    git(&app, &["hash-object", "-w", "extra"]);
    fs::remove_file(app.join("extra")).unwrap();
    assert!(shape(t.path()).is_some_and(|w| w.contains(".git/objects/")), "a loose object passed");
}

#[test]
fn urls_lose_their_credentials() {
    for (url, kept) in [
        ("https://bot:tok@forge.invalid/o/r.git", Some("https://forge.invalid/o/r.git")),
        ("https://tok@forge.invalid", Some("https://forge.invalid")),
        ("ssh://git@forge.invalid:22/r", Some("ssh://git@forge.invalid:22/r")),
        ("ssh://git:pw@forge.invalid/r", Some("ssh://git@forge.invalid/r")),
        ("git@forge.invalid:o/r.git", Some("git@forge.invalid:o/r.git")),
        ("/srv/repos/r.git", Some("/srv/repos/r.git")),
        ("https://forge.invalid/r\n[core]", None),
        ("", None),
    ] {
        assert_eq!(without_credentials(url).as_deref(), kept, "{url}");
    }
}

#[test]
fn a_clean_repository_passes_and_a_dirty_one_names_its_files() {
    let t = tempfile::tempdir().unwrap();
    let app = clean_repo(t.path());
    let checks = run(&app, t.path()).unwrap();
    assert!(failed(&checks).is_empty(), "{checks:?}");
    fs::write(app.join("a"), "v2\n").unwrap();
    fs::write(app.join("new"), "n\n").unwrap();
    let f = failed(&run(&app, t.path()).unwrap());
    assert_eq!(
        f,
        [
            ("no_tracked_modification".to_string(), "modified: a".to_string()),
            ("no_untracked_files".to_string(), "untracked, not ignored: new".to_string())
        ]
    );
}

#[test]
fn the_repository_configuration_runs_nothing() {
    let t = tempfile::tempdir().unwrap();
    let app = clean_repo(t.path());
    // Committed first (so this test's own git runs no filter), then
    // the configuration that would run commands.
    fs::write(app.join(".gitattributes"), "a filter=evil\n").unwrap();
    git(&app, &["add", ".gitattributes"]);
    git(&app, &["commit", "-qm", "attrs"]);
    git(&app, &["update-ref", "refs/remotes/origin/main", "HEAD"]);
    let canary = t.path().join("canary");
    let touch = format!("touch {}; cat", canary.display());
    git(&app, &["config", "filter.evil.clean", &touch]);
    git(&app, &["config", "filter.evil.required", "true"]);
    git(&app, &["config", "core.fsmonitor", &touch]);
    git(&app, &["config", "core.pager", &touch]);
    fs::write(app.join(".git/hooks/post-index-change"), format!("#!/bin/sh\n{touch}\n")).unwrap();
    let hook: fs::Permissions = std::os::unix::fs::PermissionsExt::from_mode(0o755);
    fs::set_permissions(app.join(".git/hooks/post-index-change"), hook).unwrap();
    // Touch the file so git must read it again (through the filter, if
    // it had one).
    fs::write(app.join("a"), "v1\n").unwrap();
    let checks = run(&app, t.path()).unwrap();
    assert!(failed(&checks).is_empty(), "{checks:?}");
    assert!(!canary.exists(), "a command the repository configured ran");
}

#[test]
fn index_flags_and_self_ignoring_rules_hide_nothing() {
    let t = tempfile::tempdir().unwrap();
    let app = clean_repo(t.path());
    fs::write(app.join("a"), "changed\n").unwrap();
    git(&app, &["update-index", "--assume-unchanged", "a"]);
    fs::create_dir(app.join("d")).unwrap();
    fs::write(app.join("d/.gitignore"), "*\n").unwrap();
    fs::write(app.join("d/secret"), "s").unwrap();
    // The repository's own git calls it clean.
    let own = Command::new("git").args(["status", "--porcelain"]).current_dir(&app).output().unwrap();
    assert!(own.stdout.is_empty(), "{own:?}");
    let f = failed(&run(&app, t.path()).unwrap());
    assert_eq!(
        f,
        [
            ("no_tracked_modification".to_string(), "modified: a".to_string()),
            (
                "no_self_ignored_rules".to_string(),
                "untracked ignore or attribute files that ignore themselves: d/.gitignore".to_string()
            )
        ]
    );
}

#[test]
fn links_out_of_the_repository_are_refused() {
    let t = tempfile::tempdir().unwrap();
    let app = clean_repo(t.path());
    std::os::unix::fs::symlink("/etc", app.join(".git/refs/tags/out")).unwrap();
    let c = run(&app, t.path()).unwrap_err();
    assert!(c.detail.contains(".git/refs/tags/out is a symlink"), "{c:?}");
    fs::remove_file(app.join(".git/refs/tags/out")).unwrap();
    fs::write(app.join(".git/objects/info/alternates"), "/elsewhere/objects\n").unwrap();
    let c = run(&app, t.path()).unwrap_err();
    assert!(c.detail.contains("alternates"), "{c:?}");
    fs::remove_file(app.join(".git/objects/info/alternates")).unwrap();
    git(&app, &["config", "extensions.partialclone", "origin"]);
    git(&app, &["config", "core.repositoryformatversion", "1"]);
    let c = run(&app, t.path()).unwrap_err();
    assert!(c.detail.contains("extensions.partialclone"), "{c:?}");
}

#[test]
fn fifos_sockets_and_devices_in_the_git_directory_are_refused_before_git_runs() {
    let t = tempfile::tempdir().unwrap();
    let app = clean_repo(t.path());
    let object = {
        let dir = fs::read_dir(app.join(".git/objects"))
            .unwrap()
            .map(|e| e.unwrap().path())
            .find(|p| p.file_name().is_some_and(|n| n.len() == 2))
            .unwrap();
        fs::read_dir(dir).unwrap().next().unwrap().unwrap().path()
    };
    let config = app.join(".git/config");
    for (path, kind) in [(&config, "a FIFO"), (&object, "a FIFO"), (&app.join(".git/sock"), "a socket")] {
        let saved = path.exists().then(|| fs::read(path).unwrap());
        let _ = fs::remove_file(path);
        let _listener;
        if kind == "a FIFO" {
            nix::unistd::mkfifo(path.as_path(), nix::sys::stat::Mode::from_bits_truncate(0o644)).unwrap();
        } else {
            _listener = std::os::unix::net::UnixListener::bind(path).unwrap();
        }
        let started = Instant::now();
        let c = run(&app, t.path()).unwrap_err();
        let rel = path.strip_prefix(&app).unwrap().display().to_string();
        assert!(c.detail.contains(&format!("{rel} is {kind}")), "{c:?}");
        assert!(started.elapsed() < Duration::from_secs(5), "held {:?}", started.elapsed());
        fs::remove_file(path).unwrap();
        if let Some(bytes) = saved {
            fs::write(path, bytes).unwrap();
        }
    }
    assert!(failed(&run(&app, t.path()).unwrap()).is_empty(), "the repository is whole again");
}

#[test]
fn ancestry_of_commits() {
    let t = tempfile::tempdir().unwrap();
    let app = clean_repo(t.path());
    let head = |app: &Path| {
        let out = Command::new("git").args(["rev-parse", "HEAD"]).current_dir(app).output().unwrap();
        String::from_utf8(out.stdout).unwrap().trim().to_string()
    };
    let one = head(&app);
    fs::write(app.join("a"), "v2\n").unwrap();
    git(&app, &["commit", "-qam", "two"]);
    let two = head(&app);
    let scratch = tempfile::tempdir_in(t.path()).unwrap();
    let repo = Repo::open(&app, scratch.path()).unwrap().unwrap();
    assert_eq!(repo.ancestry(&one, &two).unwrap(), Ancestry::Ancestor);
    assert_eq!(repo.ancestry(&two, &one).unwrap(), Ancestry::NotAncestor);
    assert_eq!(repo.ancestry(&one, &"0".repeat(40)).unwrap(), Ancestry::Unknown);
}
