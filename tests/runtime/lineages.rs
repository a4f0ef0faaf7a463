//! Lineages and baselines: fences, the ladder, one live sandbox per
//! lineage, ends, secrets, what a baseline carries and who may forge one.

use super::*;

/// Secret env reaches every command, after a daemon restart and a resume
/// of its lineage too, and is never in the catalog, an exec record, a
/// checkpoint or the API's answers: only in its lineage's root-only file,
/// which goes when the lineage ends. A fork does not inherit it.
#[test]
fn secret_env_reaches_commands_and_is_kept_only_in_a_root_only_file() {
    use sha2::{Digest, Sha256};
    use std::os::unix::fs::MetadataExt;
    let mut env = TestEnv::start();
    env.import_busybox();
    const SECRET: &str = "hunter2-7f3a9c51";
    // Commands compare digests: neither argv nor output carries the value.
    let digest = |v: &str| format!("{}  -\n", hex::encode(Sha256::digest(v)));
    let seen = |env: &TestEnv, id: &str| stdout(&sh(env, id, "printf %s \"$API_TOKEN\" | sha256sum"));
    let body = json!({
        "image": "busybox", "work_context": "task-secret", "env": ["PLAIN=visible"],
        "secret_env": [format!("API_TOKEN={SECRET}")],
    });
    let a = create(&env, body);
    assert_eq!(seen(&env, &a), digest(SECRET));
    assert_eq!(stdout(&sh(&env, &a, "echo $PLAIN")), "visible\n");
    let info: Value = env.client().call("GET", &format!("/v1/sandboxes/{a}"), None::<&()>).unwrap();
    assert_eq!(info["secret_env"], json!(["API_TOKEN"]));
    let file = env.root.join("secrets/task-secret");
    let m = std::fs::metadata(&file).unwrap();
    assert_eq!((m.mode() & 0o777, m.uid()), (0o600, 0), "the secrets file");
    assert_eq!(std::fs::metadata(file.parent().unwrap()).unwrap().mode() & 0o777, 0o700);
    let s1 = env.cli_ok(&["checkpoint", &a]).trim().to_string();
    // A restarted daemon adopts the sandbox with its secrets.
    env.kill_daemon();
    env.start_daemon();
    assert_eq!(seen(&env, &a), digest(SECRET));
    // A resume of the lineage finds them; one naming its own replaces them.
    env.client().call::<Value>("POST", &format!("/v1/sandboxes/{a}/suspend"), Some(&json!({}))).unwrap();
    let b = env.cli_ok(&["resume", "--work-context", "task-secret"]).trim().to_string();
    assert_eq!(seen(&env, &b), digest(SECRET));
    env.cli_ok(&["rm", &b]);
    let out = std::process::Command::new(strata_bin())
        .env("STRATA_SOCKET", &env.socket)
        .env("API_TOKEN", "rotated-2")
        .args(["resume", "--work-context", "task-secret", "--secret-env", "API_TOKEN"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let c = String::from_utf8(out.stdout).unwrap().trim().to_string();
    assert_eq!(seen(&env, &c), digest("rotated-2"));
    // A fork is another task's lineage: none.
    let f = env.cli_ok(&["fork", &s1]).trim().to_string();
    assert_eq!(seen(&env, &f), digest(""));
    let info: Value = env.client().call("GET", &format!("/v1/sandboxes/{f}"), None::<&()>).unwrap();
    assert_eq!(info["secret_env"], json!([]));
    // Nowhere but its file: not the catalog (its rows, and for SQLite its
    // files), exec records, layers, blobs or sandbox directories.
    for value in [SECRET, "rotated-2"] {
        let holding = files_holding(&env.root, value.as_bytes());
        // The file holds the rotated value only (and the scan finds it).
        let expected = if value == SECRET { vec![] } else { vec![file.clone()] };
        assert_eq!(holding, expected, "where {value} is");
        let rows = env.catalog().list_sandboxes().unwrap();
        assert!(!format!("{rows:?}").contains(value), "a sandbox row holds {value}");
    }
    // A bad entry is refused without its value in the message.
    let r = env.client().request(
        "POST",
        "/v1/sandboxes",
        Some(&json!({"image": "busybox", "secret_env": ["X=\u{0}leak-me"]})),
    );
    match r {
        Err(ClientError::Api { status: 400, message, .. }) => assert!(!message.contains("leak-me"), "{message}"),
        other => panic!("a bad secret env: {other:?}"),
    }
    // The lineage's end takes the file with it.
    env.cli_ok(&["lineage", "close", "task-secret", "--as", "completed"]);
    assert!(!file.exists(), "the secrets outlived their lineage");
    // Ended in the catalog by someone else (another host of the fleet):
    // the next gc here removes this host's copy.
    let other = create(&env, json!({"image": "busybox", "work_context": "task-elsewhere", "secret_env": ["K=v1"]}));
    let elsewhere = env.root.join("secrets/task-elsewhere");
    assert!(elsewhere.exists());
    env.catalog().close_work_context("task-elsewhere", strata::model::LineageState::Failed).unwrap().unwrap();
    env.cli_ok(&["gc"]);
    assert!(!elsewhere.exists(), "gc left the secrets of a lineage ended elsewhere");
    env.cli_ok(&["rm", &other]);
    env.finish();
}

/// A lineage closed with its outcome is terminal: no resume, append or
/// fork, its checkpoints retired and collected after retention; a second
/// close, a close as `retired` or `active`, and an unknown lineage are
/// refused with what is wrong.
#[test]
fn a_closed_lineage_is_terminal_and_keeps_its_outcome() {
    let env = TestEnv::start();
    env.import_busybox();
    let mut c = env.client();
    let none = None::<&()>;
    let refused = |r: Result<Vec<u8>, ClientError>| match r {
        Err(ClientError::Api { status, message, .. }) => (status, message),
        other => panic!("not refused: {other:?}"),
    };
    let a = create(&env, json!({"image": "busybox", "work_context": "task-done"}));
    sh(&env, &a, "echo work > /root/out");
    let s1 = env.cli_ok(&["checkpoint", &a]).trim().to_string();
    let out = env.cli_ok(&["lineage", "close", "task-done", "--as", "completed"]);
    assert!(out.contains("work context task-done (completed)"), "{out}");
    let l: Value = c.call("GET", "/v1/lineages/task-done", none).unwrap();
    assert_eq!((l["state"].as_str(), l["checkpoints"][0]["state"].as_str()), (Some("completed"), Some("retired")));
    assert!(l["retired_at"].as_i64().is_some(), "{l}");
    // Terminal: nothing continues it, not even its own live sandbox.
    for (path, body) in [
        ("/v1/lineages/task-done/resume".to_string(), json!({})),
        (format!("/v1/sandboxes/{a}/checkpoint"), json!({})),
        (format!("/v1/snapshots/{s1}/resume"), json!({})),
        (format!("/v1/snapshots/{s1}/fork"), json!({})),
        ("/v1/lineages/task-done/close".to_string(), json!({"outcome": "failed"})),
    ] {
        let (status, message) = refused(c.request("POST", &path, Some(&body)));
        assert_eq!(status, 409, "{path}: {message}");
        assert!(message.contains("task-done") && message.contains("completed"), "{path}: {message}");
    }
    // What a close may say, and to whom.
    let other = create(&env, json!({"image": "busybox", "work_context": "task-other"}));
    for (path, body, status) in [
        ("/v1/lineages/task-other/close", json!({"outcome": "retired"}), 400),
        ("/v1/lineages/task-other/close", json!({"outcome": "active"}), 400),
        ("/v1/lineages/task-other/close", json!({"outcome": "done"}), 400),
        ("/v1/lineages/task-other/close", json!({"outcome": "failed", "why": "x"}), 400),
        ("/v1/lineages/nope/close", json!({"outcome": "failed"}), 404),
    ] {
        assert_eq!(refused(c.request("POST", path, Some(&body))).0, status, "{path} {body}");
    }
    assert_eq!(status_of(c.request("GET", "/v1/lineages/task-other/close", none)), 405);
    assert_eq!(env.client().call::<Value>("GET", "/v1/lineages/task-other", none).unwrap()["state"], "active");
    let l: Value = c.call("POST", "/v1/lineages/task-other/close", Some(&json!({"outcome": "cancelled"}))).unwrap();
    assert_eq!(l["state"], "cancelled");
    // A retired lineage cannot be closed after the fact.
    create(&env, json!({"image": "busybox", "work_context": "task-old"}));
    env.cli_ok(&["lineage", "retire", "task-old"]);
    let (status, message) =
        refused(c.request("POST", "/v1/lineages/task-old/close", Some(&json!({"outcome": "failed"}))));
    assert_eq!(status, 409);
    assert!(message.contains("is retired"), "{message}");
    // Retention counts from the close: its checkpoint is collected.
    for id in [&a, &other] {
        env.cli_ok(&["rm", id]);
    }
    env.cli_ok(&["gc", "--retention", "0s"]);
    assert_eq!(status_of(c.request("GET", &format!("/v1/snapshots/{s1}"), none)), 404);
    assert_eq!(env.client().call::<Value>("GET", "/v1/lineages/task-done", none).unwrap()["state"], "completed");
    env.finish();
}

#[test]
fn lineages_fence_appends_and_restore_by_the_ladder() {
    let env = TestEnv::start();
    env.import_busybox();
    let mut c = env.client();
    let none = None::<&()>;
    let resume_wc = |wc: &str| -> Value {
        env.client().call("POST", &format!("/v1/lineages/{wc}/resume"), Some(&json!({}))).unwrap()
    };
    let lineage = |wc: &str| -> Value { env.client().call("GET", &format!("/v1/lineages/{wc}"), none).unwrap() };

    // Run A dirties its tree and checkpoints.
    let a = create(&env, json!({"image": "busybox", "work_context": "run-a"}));
    sh(&env, &a, "echo dirty > /tmp/a-dirty");
    let s1 = env.cli_ok(&["checkpoint", &a]).trim().to_string();
    // Run B is unrelated work: it starts from the image, never from A's tree.
    let b = create(&env, json!({"image": "busybox", "work_context": "run-b"}));
    assert!(stdout(&sh(&env, &b, "ls /tmp")).is_empty(), "run B inherited run A's tree");
    // One live sandbox works in a lineage: while A runs, a resume of run-a
    // (by the lineage or by its checkpoint) is refused, naming A.
    let held = |r: Result<Vec<u8>, ClientError>, who: &str| match r {
        Err(ClientError::Api { status: 409, message, .. }) => {
            assert!(message.contains(&format!("held by live sandbox {who}")), "{message}")
        }
        other => panic!("a second live sandbox in a lineage: {other:?}"),
    };
    held(c.request("POST", "/v1/lineages/run-a/resume", Some(&json!({}))), &a);
    held(c.request("POST", &format!("/v1/snapshots/{s1}/resume"), Some(&json!({}))), &a);
    assert_eq!(lineage("run-a")["holder"]["sandbox"], a.as_str());
    let all: Vec<Value> = c.call("GET", "/v1/lineages", none).unwrap();
    let holders: Vec<(&str, &str)> =
        all.iter().map(|l| (l["id"].as_str().unwrap(), l["holder"]["sandbox"].as_str().unwrap_or("-"))).collect();
    assert_eq!(holders, [("run-a", a.as_str()), ("run-b", b.as_str())]);
    env.cli_ok(&["rm", &a, &b]);
    assert!(lineage("run-a")["holder"].is_null());
    // Run C continues A: the ladder's first rung, A's head.
    let x = resume_wc("run-a");
    assert_eq!((x["restored"]["rung"].as_str(), x["restored"]["snapshot"].as_str()), (Some("head"), Some(s1.as_str())));
    let x = x["id"].as_str().unwrap().to_string();
    assert_eq!(stdout(&sh(&env, &x, "cat /tmp/a-dirty")), "dirty\n");
    // B has no head and began from the image: the ladder's last rung.
    let b2 = resume_wc("run-b");
    assert_eq!(b2["restored"]["rung"], "image", "{b2}");
    assert!(b2["restored"]["snapshot"].is_null());
    // X holds run-a now. (A stale sandbox's append, which the fence
    // refuses, needs a host that was down: tests/fleet.rs.)
    held(c.request("POST", &format!("/v1/snapshots/{s1}/resume"), Some(&json!({}))), &x);
    let s2 = env.cli_ok(&["checkpoint", &x]).trim().to_string();
    let l = lineage("run-a");
    assert_eq!(l["head"], s2.as_str(), "{l}");
    let seq: Vec<(i64, &str, &str)> = l["checkpoints"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| (c["sequence"].as_i64().unwrap(), c["id"].as_str().unwrap(), c["state"].as_str().unwrap()))
        .collect();
    assert_eq!(seq, vec![(1, s1.as_str(), "superseded"), (2, s2.as_str(), "ready")]);
    assert_eq!(l["checkpoints"][1]["predecessor"], s1.as_str());
    let rungs: Vec<&str> = l["restores"].as_array().unwrap().iter().map(|r| r["rung"].as_str().unwrap()).collect();
    assert_eq!(rungs, vec!["image", "head"], "{l}");
    // X's next checkpoint appends again (its observed head moved with it).
    let s3 = env.cli_ok(&["checkpoint", &x]).trim().to_string();
    assert_eq!(lineage("run-a")["head"], s3.as_str());
    // A suspend releases the lineage: a resume of an older checkpoint by id
    // continues it, fenced on the head it observes now.
    let s4 = env.cli_ok(&["suspend", &x]).trim().to_string();
    let y: Value = c.call("POST", &format!("/v1/snapshots/{s2}/resume"), Some(&json!({}))).unwrap();
    assert_eq!(y["restored"]["rung"], "snapshot");
    let y = y["id"].as_str().unwrap().to_string();
    let s5: Value = c.call("POST", &format!("/v1/sandboxes/{y}/checkpoint"), none).unwrap();
    assert_eq!((s5["predecessor"].as_str(), s5["sequence"].as_i64()), (Some(s4.as_str()), Some(5)), "{s5}");
    let s3 = s5["id"].as_str().unwrap().to_string();
    assert_eq!(lineage("run-a")["head"], s3.as_str());

    // A fork is an explicit branch: a lineage of its own, origin recorded;
    // its ladder falls to the origin, never to the parent's head.
    let forks: Vec<Value> = c.call("POST", &format!("/v1/snapshots/{s2}/fork"), Some(&json!({"count": 2}))).unwrap();
    let f_wc: Vec<String> = forks.iter().map(|f| f["work_context"].as_str().unwrap().to_string()).collect();
    assert!(f_wc[0] != f_wc[1] && !f_wc.contains(&"run-a".to_string()), "{forks:?}");
    let fl = lineage(&f_wc[0]);
    assert_eq!((fl["start_kind"].as_str(), fl["start"].as_str()), (Some("fork"), Some(s2.as_str())), "{fl}");
    env.cli_ok(&["rm", forks[0]["id"].as_str().unwrap(), forks[1]["id"].as_str().unwrap()]);
    let f2 = resume_wc(&f_wc[0]);
    assert_eq!(
        (f2["restored"]["rung"].as_str(), f2["restored"]["snapshot"].as_str()),
        (Some("fork"), Some(s2.as_str()))
    );
    let fchild = env.cli_ok(&["checkpoint", f2["id"].as_str().unwrap()]).trim().to_string();
    assert_eq!(lineage("run-a")["head"], s3.as_str(), "a child's checkpoint reached the parent's lineage");
    assert_eq!(lineage(&f_wc[0])["head"], fchild.as_str());

    // Ids: taken, malformed, unknown.
    let dup = c.request("POST", "/v1/sandboxes", Some(&json!({"image": "busybox", "work_context": "run-a"})));
    assert_eq!(status_of(dup), 409);
    let bad = c.request("POST", "/v1/sandboxes", Some(&json!({"image": "busybox", "work_context": "../x"})));
    assert_eq!(status_of(bad), 400);
    assert_eq!(status_of(c.request("GET", "/v1/lineages/nope", none)), 404);

    // Retired: its checkpoints leave restore eligibility; live sandboxes of
    // it can no longer append.
    env.cli_ok(&["lineage", "retire", "run-a"]);
    assert_eq!(lineage("run-a")["state"], "retired");
    assert_eq!(status_of(c.request("POST", "/v1/lineages/run-a/resume", Some(&json!({})))), 409);
    assert_eq!(status_of(c.request("POST", &format!("/v1/snapshots/{s3}/resume"), Some(&json!({})))), 409);
    assert_eq!(status_of(c.request("POST", &format!("/v1/snapshots/{s2}/fork"), Some(&json!({})))), 409);
    let r = c.request("POST", &format!("/v1/sandboxes/{y}/checkpoint"), none);
    assert!(matches!(&r, Err(ClientError::Api { status: 409, message, .. }) if message.contains("retired")), "{r:?}");
    // No rung restores a retired lineage's checkpoint: the fork lineage with
    // no head of its own falls past its origin (s2, of run-a) to the image.
    let f3 = resume_wc(&f_wc[1]);
    assert_eq!(f3["restored"]["rung"], "image", "{f3}");
    let fell = lineage(&f_wc[1])["restores"].as_array().unwrap().last().unwrap()["fell"].clone();
    assert!(fell[0].as_str().unwrap().starts_with(&format!("fork {s2}: ")), "{fell}");
    assert!(fell[0].as_str().unwrap().contains("retired"), "{fell}");
    env.finish();
}

/// A baseline keeps the canonical history only: another task's branch, a
/// stash, a commit only a reflog reaches, another remote's refs and the
/// credentials in the config stay behind, in its layer and in new work.
#[test]
fn a_baseline_carries_only_the_canonical_history() {
    let env = TestEnv::start();
    env.import_image("debian-git");
    let p = create(&env, json!({"image": "debian-git"}));
    assert_eq!(sh(&env, &p, CLEAN_REPO)["exit_code"], 0);
    let mess = "set -e; cd /src/app; export HOME=/root; git tag -a v1 -m release; \
        git checkout -qb other-task; echo theirs > b; git add b; git commit -qm other-task-work; git tag off-branch; \
        git rev-parse HEAD; git checkout -q main; echo dropped > a; git commit -qam dropped; git rev-parse HEAD; \
        git reset -q --hard HEAD~1; echo stashed > a; git stash -q; git update-ref refs/remotes/upstream/main HEAD; \
        git remote set-url origin https://bot:tok-SECRET-1@forge.invalid/app.git; \
        git config http.extraheader 'Authorization: Bearer HDR-SECRET-2'; git pack-refs --all";
    let v = sh(&env, &p, mess);
    assert_eq!(v["exit_code"], 0, "{v}");
    let out = stdout(&v);
    let shas: Vec<&str> = out.lines().collect();
    assert_eq!(shas.len(), 2, "{out}");
    let body = json!({"repo": "/src/app", "ref": "main", "owner": "acme"});
    let b: Value = env.client().call("POST", &format!("/v1/sandboxes/{p}/baseline"), Some(&body)).unwrap();
    let checks = b["baseline"]["evidence"]["checks"].as_array().unwrap();
    assert!(checks.iter().any(|c| c["name"] == "canonical_history" && c["ok"] == true), "{checks:?}");
    // Its layer: a git directory of the canonical branch alone.
    let git = env.root.join("layers").join(b["layer"].as_str().unwrap()).join("fs/src/app/.git");
    for gone in ["logs", "refs/stash", "refs/heads/other-task", "refs/remotes/upstream", "packed-refs", "hooks"] {
        assert!(!git.join(gone).exists(), ".git/{gone} is in the baseline");
    }
    let config = std::fs::read_to_string(git.join("config")).unwrap();
    assert!(!config.contains("SECRET") && config.contains("https://forge.invalid/app.git"), "{config}");
    // New work from it sees exactly that.
    let w = create(&env, json!({"image": "debian-git", "baseline": "acme/app@main"}));
    let look = format!(
        "cd /src/app; export HOME=/root; git for-each-ref --format='%(refname)'; echo --; git stash list; \
         git reflog; git config --get http.extraheader; git log --format=%s; echo --; \
         for c in {} {}; do git cat-file -e $c 2>/dev/null && echo has $c; done; git status --porcelain; cat a",
        shas[0], shas[1]
    );
    assert_eq!(
        stdout(&sh(&env, &w, &look)),
        "refs/heads/main\nrefs/remotes/origin/main\nrefs/tags/v1\n--\none\n--\nv1\n",
        "what new work sees of the repository"
    );
    env.finish();
}

#[test]
fn baselines_are_validated_published_by_compare_and_swap_and_start_new_work() {
    let mut env = TestEnv::start();
    env.import_image("debian-git");
    let img = "debian-git";
    let mut c = env.client();
    let none = None::<&()>;
    fn publish(env: &TestEnv, id: &str) -> Result<Vec<u8>, ClientError> {
        let body = json!({"repo": "/src/app", "ref": "main", "owner": "acme"});
        env.client().request("POST", &format!("/v1/sandboxes/{id}/baseline"), Some(&body))
    }
    let refused = |id: &str, check: &str| match publish(&env, id) {
        Err(ClientError::Api { status: 409, message, .. }) => assert!(message.contains(check), "{check}: {message}"),
        other => panic!("{check}: a dirty repository was published: {other:?}"),
    };
    let p = create(&env, json!({"image": img, "work_context": "publisher"}));
    let v = sh(&env, &p, CLEAN_REPO);
    assert_eq!(v["exit_code"], 0, "{v}");

    // Each dirty state is refused, naming its check; nothing is published.
    let dirty = [
        ("echo x >> a", "no_tracked_modification"),
        ("echo x > new", "no_untracked_files"),
        ("echo x >> a; git add a", "nothing_staged"),
        ("git checkout -q --detach", "branch_checked_out"),
        ("git checkout -q -b task-7", "branch_checked_out"),
        ("echo v2 > a; git commit -qam two", "head_equals_remote"),
        (
            "git checkout -q -b side; echo s > a; git commit -qam s; git checkout -q main; echo m > a; \
          git commit -qam m; git merge -q side || true",
            "no_operation_in_progress",
        ),
    ];
    for (make, check) in dirty {
        let setup = format!("cd /src/app && export HOME=/root && {make}");
        sh(&env, &p, &setup);
        refused(&p, check);
        let undo = "cd /src/app && export HOME=/root && (git merge --abort 2>/dev/null; true) && git checkout -q -f main \
                    && git reset -q --hard origin/main && git clean -qfd -e build && (git branch -qD task-7 side 2>/dev/null; true)";
        assert_eq!(sh(&env, &p, undo)["exit_code"], 0);
    }
    let snaps: Vec<Value> = c.call("GET", "/v1/snapshots", none).unwrap();
    assert!(snaps.is_empty(), "{snaps:?}");
    // A clean checkpoint is still no baseline.
    env.cli_ok(&["checkpoint", &p]);
    let r = c.request("POST", "/v1/sandboxes", Some(&json!({"image": img, "baseline": "acme/app@main"})));
    assert_eq!(status_of(r), 404, "a checkpoint satisfied a baseline lookup");

    // Clean (an ignored build cache may stay): published, with its evidence.
    let b1: Value = publish(&env, &p).map(|b| serde_json::from_slice(&b).unwrap()).unwrap();
    assert_eq!((b1["class"].as_str(), b1["state"].as_str()), (Some("baseline"), Some("ready")), "{b1}");
    let ev = &b1["baseline"];
    assert_eq!(
        (ev["owner"].as_str(), ev["repo"].as_str(), ev["ref"].as_str()),
        (Some("acme"), Some("app"), Some("main"))
    );
    assert_eq!(ev["commit"].as_str().unwrap().len(), 40, "{ev}");
    assert!(ev["evidence"]["checks"].as_array().unwrap().iter().all(|c| c["ok"] == true), "{ev}");

    // Ten concurrent creates from it: ten lineages, each on the clean tree.
    let threads: Vec<_> = (0..10)
        .map(|_| {
            let socket = env.socket.clone();
            std::thread::spawn(move || {
                let mut c = Client::connect(&socket).unwrap();
                c.call::<Value>(
                    "POST",
                    "/v1/sandboxes",
                    Some(&json!({"image": "debian-git", "baseline": "acme/app@main"})),
                )
            })
        })
        .collect();
    let made: Vec<Value> = threads.into_iter().map(|t| t.join().unwrap().unwrap()).collect();
    let wcs: std::collections::HashSet<&str> = made.iter().map(|m| m["work_context"].as_str().unwrap()).collect();
    assert_eq!(wcs.len(), 10, "{made:?}");
    for m in &made {
        assert_eq!(
            (m["restored"]["rung"].as_str(), m["restored"]["snapshot"].as_str()),
            (Some("baseline"), b1["id"].as_str())
        );
    }
    let w = made[0]["id"].as_str().unwrap();
    assert_eq!(stdout(&sh(&env, w, "cd /src/app && git status --porcelain && cat a build/o")), "v1\ncache\n");
    // A lineage that began from the baseline falls back to it.
    let wc0 = made[0]["work_context"].as_str().unwrap();
    for m in &made {
        env.cli_ok(&["rm", m["id"].as_str().unwrap()]);
    }
    let again: Value = c.call("POST", &format!("/v1/lineages/{wc0}/resume"), Some(&json!({}))).unwrap();
    assert_eq!(again["restored"]["rung"], "baseline");
    env.cli_ok(&["rm", again["id"].as_str().unwrap()]);

    // Two racing publishers of newer commits from one history: p (two)
    // began first and observed b1; q (three, forked from p's checkpoint)
    // publishes first; p, older, never replaces it.
    sh(&env, &p, "cd /src/app && export HOME=/root && echo v2 > a && git commit -qam two && git push -q origin main && git fetch -q");
    let s2 = env.cli_ok(&["checkpoint", &p]).trim().to_string();
    let q = env.cli_ok(&["fork", &s2]).trim().to_string();
    sh(&env, &q, "cd /src/app && export HOME=/root && echo v3 > a && git commit -qam three && git push -q origin main && git fetch -q");
    // The older publisher validates first, then is held at the failpoint
    // while the newer one publishes.
    env.stop_daemon();
    env.daemon_env = vec![("STRATA_FAILPOINTS".into(), "baseline:validated=sleep-once:3000".into())];
    env.start_daemon();
    let older = {
        let socket = env.socket.clone();
        let p = p.clone();
        std::thread::spawn(move || {
            let body = json!({"repo": "/src/app", "ref": "main", "owner": "acme"});
            Client::connect(&socket).unwrap().request("POST", &format!("/v1/sandboxes/{p}/baseline"), Some(&body))
        })
    };
    env.wait_logged("failpoint baseline:validated reached", Duration::from_secs(30));
    let newer: Value = publish(&env, &q).map(|b| serde_json::from_slice(&b).unwrap()).unwrap();
    match older.join().unwrap() {
        Err(ClientError::Api { status: 409, message, .. }) => {
            assert!(message.contains("never replaces a newer baseline"), "{message}")
        }
        other => panic!("the older publisher replaced a newer baseline: {other:?}"),
    }
    // (A new connection: the daemon was restarted.)
    let mut c = env.client();
    let b1_now: Value = c.call("GET", &format!("/v1/snapshots/{}", b1["id"].as_str().unwrap()), none).unwrap();
    assert_eq!(b1_now["state"], "superseded");
    let made: Value =
        c.call("POST", "/v1/sandboxes", Some(&json!({"image": img, "baseline": "acme/app@main"}))).unwrap();
    assert_eq!(made["restored"]["snapshot"], newer["id"]);
    assert_eq!(stdout(&sh(&env, made["id"].as_str().unwrap(), "cat /src/app/a")), "v3\n");

    // An older commit after a newer one: refused, the ready baseline kept.
    // q goes back to two (its repository knows three); p never fetched three.
    sh(&env, &q, "cd /src/app && git update-ref refs/remotes/origin/main HEAD~1 && git reset -q --hard HEAD~1");
    match publish(&env, &q) {
        Err(ClientError::Api { status: 409, message, .. }) => assert!(message.contains("is older than"), "{message}"),
        other => panic!("an older commit replaced a newer baseline: {other:?}"),
    }
    match publish(&env, &p) {
        Err(ClientError::Api { status: 409, message, .. }) => {
            assert!(message.contains("fetch, then publish"), "{message}")
        }
        other => panic!("a repository that never saw the ready commit published: {other:?}"),
    }
    // The same commit again: the ready baseline, unchanged.
    sh(&env, &q, "cd /src/app && git fetch -q && git reset -q --hard origin/main");
    let same: Value = publish(&env, &q).map(|b| serde_json::from_slice(&b).unwrap()).unwrap();
    assert_eq!(same["id"], newer["id"]);
    let snaps: Vec<Value> = c.call("GET", "/v1/snapshots", none).unwrap();
    let ready: Vec<&Value> = snaps.iter().filter(|s| s["class"] == "baseline" && s["state"] == "ready").collect();
    assert_eq!(ready.len(), 1, "{snaps:?}");
    assert_eq!(ready[0]["id"], newer["id"]);
    env.finish();
}

/// Entry names of a zstd layer blob in the store.
fn blob_entries(env: &TestEnv, digest: &str) -> Vec<String> {
    let blob = env.root.join("blobs/sha256").join(digest.trim_start_matches("sha256:"));
    let out = std::process::Command::new("sh")
        .args(["-c", &format!("zstd -dc {} | tar -t", blob.display())])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    String::from_utf8_lossy(&out.stdout).lines().map(str::to_string).collect()
}

#[test]
fn a_sandbox_cannot_forge_a_baseline() {
    let env = TestEnv::start();
    env.import_image("debian-git");
    let none = None::<&()>;
    let publish = |id: &str| {
        let body = json!({"repo": "/src/app", "ref": "main", "owner": "acme"});
        env.client().request("POST", &format!("/v1/sandboxes/{id}/baseline"), Some(&body))
    };
    let p = create(&env, json!({"image": "debian-git", "work_context": "task-a"}));
    assert_eq!(sh(&env, &p, CLEAN_REPO)["exit_code"], 0);

    // A git that always says "clean", and a dirty tracked file: refused,
    // naming the file (the sandbox's git never runs).
    let fake = "cp /usr/bin/git /usr/bin/git.real && printf '#!/bin/sh\nexit 0\n' > /usr/bin/git && \
                cp /usr/bin/git /usr/local/bin/git && echo dirty >> /src/app/a";
    assert_eq!(sh(&env, &p, fake)["exit_code"], 0);
    match publish(&p) {
        Err(ClientError::Api { status: 409, message, .. }) => {
            assert!(message.contains("no_tracked_modification: modified: a"), "{message}")
        }
        other => panic!("a dirty tree was published past a fake git: {other:?}"),
    }
    let undo = "rm /usr/local/bin/git && mv /usr/bin/git.real /usr/bin/git && cd /src/app && git checkout -q a";
    assert_eq!(sh(&env, &p, undo)["exit_code"], 0);

    // A repository whose config, hooks and attributes would run commands:
    // fsmonitor, a hook run when the index is written, a required clean
    // filter. The sandbox's own git runs them (its canary appears); the
    // publish runs none of them on the host.
    let canary = std::env::temp_dir().join(format!("strata-canary-{}", std::process::id()));
    let _ = std::fs::remove_file(&canary);
    let c = canary.display();
    let evil = format!(
        "set -e; export HOME=/root; cd /src/app; mkdir -p /tmp; \
         git config core.fsmonitor 'touch {c}; false'; \
         printf '#!/bin/sh\ntouch {c}\n' > .git/hooks/post-index-change; chmod +x .git/hooks/post-index-change; \
         git config filter.evil.clean 'touch {c}; cat'; git config filter.evil.smudge cat; \
         git config filter.evil.required true; echo 'a filter=evil' > .gitattributes; \
         git add .gitattributes a; git commit -qm attrs; git push -q origin main; git fetch -q; \
         git config --unset core.fsmonitor; git status --porcelain; git config core.fsmonitor 'touch {c}; false'; \
         test -e {c}"
    );
    let v = sh(&env, &p, &evil);
    assert_eq!(v["exit_code"], 0, "{v}");
    // Secrets and another repository outside the repository.
    let other = "mkdir -p /root/.ssh /srv && echo KEY > /root/.ssh/id_rsa && git init -q /srv/other-repo && \
                 echo o > /srv/other-repo/f && echo outside > /outside-of-repo";
    assert_eq!(sh(&env, &p, other)["exit_code"], 0);
    // A canonical commit from the caller that HEAD is not at: refused.
    let body = json!({"repo": "/src/app", "ref": "main", "owner": "acme", "commit": "0".repeat(40)});
    match env.client().request("POST", &format!("/v1/sandboxes/{p}/baseline"), Some(&body)) {
        Err(ClientError::Api { status: 409, message, .. }) => {
            assert!(message.contains("canonical_commit"), "{message}")
        }
        other => panic!("a HEAD other than the canonical commit was published: {other:?}"),
    }
    let b: Value = serde_json::from_slice(&publish(&p).unwrap()).unwrap();
    assert!(!canary.exists(), "publishing ran a command the repository configured");
    assert_eq!(b["class"], "baseline");
    assert!(b["parent"].is_null(), "a baseline sits on the image alone: {b}");
    let entries = blob_entries(&env, b["blob_digest"].as_str().unwrap());
    assert!(entries.iter().any(|e| e == "src/app/a"), "{entries:?}");
    assert!(entries.iter().any(|e| e.starts_with("src/app/.git/")), "{entries:?}");
    for e in &entries {
        assert!(
            e == "src" || e == "src/app" || e.starts_with("src/app/"),
            "{e} is outside the repository: {entries:?}"
        );
    }
    let w = create(&env, json!({"image": "debian-git", "baseline": "acme/app@main"}));
    let v = sh(
        &env,
        &w,
        "test ! -e /root/.ssh/id_rsa && test ! -e /srv/other-repo && test ! -e /outside-of-repo && \
         test ! -e /remote.git && cd /src/app && git status --porcelain && cat a",
    );
    assert_eq!((v["exit_code"].as_i64(), stdout(&v).as_str()), (Some(0), "v1\n"), "{v}");

    // A baseline published from a sandbox resumed from a checkpoint of
    // another lineage: new work from it has none of that lineage's files
    // outside the repository.
    let s1 = env.cli_ok(&["checkpoint", &p]).trim().to_string();
    env.cli_ok(&["rm", &p]);
    let r = env.cli_ok(&["resume", &s1]).trim().to_string();
    sh(&env, &r, "cd /src/app && export HOME=/root && echo v2 > a && git commit -qam two && git push -q origin main && git fetch -q");
    let b2: Value = serde_json::from_slice(&publish(&r).unwrap()).unwrap();
    assert!(b2["parent"].is_null(), "{b2}");
    let w2 = create(&env, json!({"image": "debian-git", "baseline": "acme/app@main"}));
    let v = sh(&env, &w2, "test ! -e /outside-of-repo && test ! -e /root/.ssh/id_rsa && cat /src/app/a");
    assert_eq!((v["exit_code"].as_i64(), stdout(&v).as_str()), (Some(0), "v2\n"), "{v}");
    let lineage: Value = env.client().call("GET", &format!("/v1/lineages/{}", "task-a"), none).unwrap();
    assert!(lineage["checkpoints"].as_array().unwrap().iter().all(|c| c["id"] != b2["id"]), "{lineage}");

    // The ladder falls through: w's lineage began from b (now superseded by
    // b2); its head's layer is deleted from the store; its resume falls to
    // b, and the restore says why. gc keeps b while the lineage records it.
    let wc: Value = env.client().call("GET", &format!("/v1/sandboxes/{w}"), none).unwrap();
    let wc = wc["work_context"].as_str().unwrap().to_string();
    sh(&env, &w, "echo work > /src/app/w");
    let h = env.cli_ok(&["checkpoint", &w]).trim().to_string();
    env.cli_ok(&["rm", &w]);
    let hs: Value = env.client().call("GET", &format!("/v1/snapshots/{h}"), none).unwrap();
    let top = hs["layers"].as_array().unwrap().last().unwrap().as_str().unwrap().trim_start_matches("sha256:");
    std::fs::remove_dir_all(env.root.join("layers").join(top)).unwrap();
    env.cli_ok(&["gc", "--retention", "0s"]);
    let r: Value = env.client().call("POST", &format!("/v1/lineages/{wc}/resume"), Some(&json!({}))).unwrap();
    assert_eq!(
        (r["restored"]["rung"].as_str(), r["restored"]["snapshot"].as_str()),
        (Some("baseline"), b["id"].as_str())
    );
    let v = sh(&env, r["id"].as_str().unwrap(), "cat /src/app/a; test ! -e /src/app/w");
    assert_eq!((v["exit_code"].as_i64(), stdout(&v).as_str()), (Some(0), "v1\n"), "{v}");
    let shown = env.cli_ok(&["lineage", "show", &wc]);
    assert!(shown.contains(&format!("passed head {h}: layer {top} is missing from the store")), "{shown}");
    let _ = std::fs::remove_file(&canary);
    env.finish();
}

#[test]
fn a_pulled_baseline_is_checked_before_it_serves_new_work() {
    let reg = registry::Registry::start();
    let a = TestEnv::start();
    let b = TestEnv::start();
    a.import_image("debian-git");
    b.import_image("debian-git");
    let publish = |id: &str| -> Value {
        let body = json!({"repo": "/src/app", "ref": "main", "owner": "acme"});
        a.client().call("POST", &format!("/v1/sandboxes/{id}/baseline"), Some(&body)).unwrap()
    };
    let p = create(&a, json!({"image": "debian-git"}));
    assert_eq!(sh(&a, &p, CLEAN_REPO)["exit_code"], 0);
    let b1 = publish(&p);
    sh(&a, &p, "cd /src/app && export HOME=/root && echo v2 > a && git commit -qam two && git push -q origin main && git fetch -q");
    let b2 = publish(&p);
    for (snap, tag) in [(&b1, "v1"), (&b2, "v2")] {
        push_snapshot(&a, &reg, snap["id"].as_str().unwrap(), &format!("strata/base:{tag}")).unwrap();
    }
    // Checked on arrival: clean, at the commit it claims, newest: ready.
    let pulled = pull_snapshot(&b, &reg, "strata/base:v2").unwrap();
    let s = &pulled["snapshot"];
    assert_eq!(
        (s["id"].as_str(), s["class"].as_str(), s["state"].as_str()),
        (b2["id"].as_str(), Some("baseline"), Some("ready")),
        "{s}"
    );
    let w = create(&b, json!({"image": "debian-git", "baseline": "acme/app@main"}));
    assert_eq!(stdout(&sh(&b, &w, "cd /src/app && git status --porcelain && cat a")), "v2\n");
    // An older one pulled after it is kept, not eligible, and says why.
    let pulled = pull_snapshot(&b, &reg, "strata/base:v1").unwrap();
    let s = &pulled["snapshot"];
    assert_eq!((s["id"].as_str(), s["state"].as_str()), (b1["id"].as_str(), Some("superseded")), "{s}");
    let why = s["info"]["ineligible"].as_str().unwrap_or_default();
    assert!(why.starts_with("pulled: ") && why.contains("fetch, then publish"), "{s}");
    let made: Value = b
        .client()
        .call("POST", "/v1/sandboxes", Some(&json!({"image": "debian-git", "baseline": "acme/app@main"})))
        .unwrap();
    assert_eq!(made["restored"]["snapshot"], b2["id"]);
    a.finish();
    b.finish();
}
