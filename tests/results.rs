//! Sealed results, end to end (root only): evaluations against a sealed
//! snapshot, labels and retention, exec output in the log (bounded, the
//! cut marked), a rollback's log, patches, the result document, and logs
//! and evaluations carried by push and pull.

use std::time::Duration;

use serde_json::{json, Value};
use strata_tests::*;

fn get(env: &TestEnv, path: &str) -> Value {
    env.client().call("GET", path, None::<&()>).unwrap_or_else(|e| panic!("GET {path}: {e}"))
}

fn post(env: &TestEnv, path: &str, body: Value) -> Value {
    env.client().call("POST", path, Some(&body)).unwrap_or_else(|e| panic!("POST {path}: {e}"))
}

fn evaluate(env: &TestEnv, snap: &str, body: Value) -> Value {
    post(env, &format!("/v1/snapshots/{snap}/evaluate"), body)
}

fn argvs(log: &Value) -> Vec<String> {
    log.as_array().unwrap().iter().map(|r| r["argv"].as_array().unwrap().last().unwrap().to_string()).collect()
}

#[test]
fn an_evaluation_runs_in_a_throwaway_fork_and_is_recorded_with_the_snapshot() {
    let env = TestEnv::start();
    env.import_busybox();
    let id = create(&env, json!({"image": "busybox"}));
    // The agent plants results where an evaluator might write them.
    sh(&env, &id, "echo original > /tmp/tree; for f in /tmp/strata-result.json /tmp/result.json; do echo '{\"passed\": 999}' > $f; done");
    let snap = env.cli_ok(&["checkpoint", &id]).trim().to_string();
    let tree_before = env.cli_ok(&["diff", &snap]);
    let sandboxes_before = get(&env, "/v1/sandboxes").as_array().unwrap().len();

    // A failing test and a passing one: two records, each with its JSON.
    let failing = evaluate(
        &env,
        &snap,
        json!({"name": "tests", "version": "1", "argv": ["sh", "-c",
            "echo '{\"passed\": 0, \"failed\": 2}' > $STRATA_RESULT; echo tampered > /tmp/tree; echo FAIL >&2; exit 3"]}),
    );
    assert_eq!(failing["exit_code"], 3, "{failing}");
    assert_eq!(failing["result"], json!({"passed": 0, "failed": 2}), "{failing}");
    assert_eq!(failing["output"]["stderr"], "FAIL\n", "{failing}");
    assert_eq!(failing["recorded"], false);
    let passing = evaluate(
        &env,
        &snap,
        json!({"name": "tests", "version": "2", "env": ["WANT=original"], "argv": ["sh", "-c",
            "test \"$(cat /tmp/tree)\" = \"$WANT\" && echo '{\"passed\": 2}' > $STRATA_RESULT"]}),
    );
    assert_eq!((passing["exit_code"].as_i64(), &passing["result"]), (Some(0), &json!({"passed": 2})), "{passing}");
    // The same name and version again: the record, not a new run; --again runs it.
    let again = evaluate(&env, &snap, json!({"name": "tests", "version": "1", "argv": ["false"]}));
    assert_eq!((&again["id"], &again["recorded"], &again["exit_code"]), (&failing["id"], &json!(true), &json!(3)));
    let out = env.cli_ok(&[
        "evaluate",
        &snap,
        "--name",
        "reward",
        "--version",
        "1",
        "--",
        "sh",
        "-c",
        "echo not json > $STRATA_RESULT",
    ]);
    let v: Value = serde_json::from_str(&out).unwrap();
    assert!(v["result"].is_null() && v["result_error"].as_str().unwrap().contains("is not JSON"), "{v}");
    // A result that is a symlink (to a host path, say) is refused, not followed.
    let escape = evaluate(
        &env,
        &snap,
        json!({"name": "escape", "version": "1", "argv": ["sh", "-c", "ln -s /etc/hostname $STRATA_RESULT"]}),
    );
    assert!(escape["result"].is_null(), "{escape}");
    assert!(escape["result_error"].as_str().unwrap().contains("symbolic links"), "{escape}");
    let timed = evaluate(&env, &snap, json!({"name": "slow", "version": "1", "timeout": 1, "argv": ["sleep", "30"]}));
    assert_eq!((&timed["timed_out"], &timed["exit_code"]), (&json!(true), &json!(137)), "{timed}");
    // An evaluator that writes nothing has no result, whatever the
    // snapshot holds: $STRATA_RESULT is a new name each run.
    assert!(timed["result"].is_null() && timed["result_error"].is_null(), "{timed}");

    let evals = get(&env, &format!("/v1/snapshots/{snap}/evaluations"));
    let names: Vec<String> = evals
        .as_array()
        .unwrap()
        .iter()
        .map(|e| format!("{}@{}", e["name"].as_str().unwrap(), e["version"].as_str().unwrap()))
        .collect();
    assert_eq!(names, ["tests@1", "tests@2", "reward@1", "escape@1", "slow@1"]);
    // The snapshot's tree is as it was; the throwaway sandboxes are gone,
    // and with them their lineages.
    assert_eq!(env.cli_ok(&["diff", &snap]), tree_before);
    let check = env.cli_ok(&["fork", &snap]).trim().to_string();
    assert_eq!(stdout(&sh(&env, &check, "cat /tmp/tree")), "original\n");
    env.cli_ok(&["rm", &check]);
    assert_eq!(get(&env, "/v1/sandboxes").as_array().unwrap().len(), sandboxes_before);

    // Bad requests change nothing.
    for bad in [
        json!({"name": "a b", "version": "1", "argv": ["true"]}),
        json!({"name": "t", "version": "1", "argv": []}),
        json!({"name": "t", "version": "1", "argv": ["true"], "timeout": 0}),
        json!({"name": "t", "version": "1", "argv": ["true"], "bogus": 1}),
    ] {
        let r = env.client().call::<Value>("POST", &format!("/v1/snapshots/{snap}/evaluate"), Some(&bad));
        assert_eq!(r.unwrap_err().status(), Some(400), "{bad}");
    }
    assert_eq!(get(&env, &format!("/v1/snapshots/{snap}/evaluations")).as_array().unwrap().len(), 5);
    env.finish();
}

#[test]
fn labels_filter_and_a_retained_snapshot_outlives_gc_until_released() {
    let env = TestEnv::start();
    env.import_busybox();
    let id = create(&env, json!({"image": "busybox"}));
    let first = env.cli_ok(&["checkpoint", &id]).trim().to_string();
    // Whole: not over `first`, which it supersedes.
    let second = env.cli_ok(&["checkpoint", "--whole", &id]).trim().to_string();
    // Idempotent: labelling twice is the same as once.
    for _ in 0..2 {
        assert_eq!(
            env.cli_ok(&["snapshot", "label", &first, "verdict=accepted", "run=7"]),
            "run=7\nverdict=accepted\n"
        );
    }
    let listed = |sel: &str| -> Vec<String> {
        env.cli_ok(&["snapshot", "ls", "--label", sel]).lines().skip(1).map(|l| l[..16].to_string()).collect()
    };
    assert_eq!(listed("verdict=accepted"), [first.as_str()]);
    assert_eq!(listed("verdict"), [first.as_str()]);
    assert!(listed("verdict=rejected").is_empty());
    env.cli_ok(&["snapshot", "label", &first, "run-"]);
    assert_eq!(get(&env, &format!("/v1/snapshots/{first}"))["labels"], json!({"verdict": "accepted"}));
    let bad = env.client().call::<Value>(
        "POST",
        &format!("/v1/snapshots/{first}/labels"),
        Some(&json!({"labels": {"a b": "x"}})),
    );
    assert_eq!(bad.unwrap_err().status(), Some(400));

    // `first` is superseded by `second`: gc takes it, unless retained.
    env.cli_ok(&["snapshot", "retain", &first]);
    env.cli_ok(&["snapshot", "retain", &first]);
    assert_eq!(get(&env, &format!("/v1/snapshots/{first}"))["retained"], true);
    env.cli_ok(&["gc", "--retention", "0s"]);
    assert_eq!(get(&env, &format!("/v1/snapshots/{first}"))["state"], "superseded");
    env.cli_ok(&["snapshot", "release", &first]);
    env.cli_ok(&["gc", "--retention", "0s"]);
    let gone = env.client().call::<Value>("GET", &format!("/v1/snapshots/{first}"), None::<&()>);
    assert_eq!(gone.unwrap_err().status(), Some(404));
    assert_eq!(get(&env, &format!("/v1/snapshots/{second}"))["state"], "ready");
    env.finish();
}

#[test]
fn logs_keep_output_up_to_the_limit_and_a_rollback_keeps_only_what_it_kept() {
    let env = TestEnv::start_with(&["--keep-output", "64"]);
    env.import_busybox();
    let id = create(&env, json!({"image": "busybox"}));
    sh(&env, &id, "echo one; echo err >&2");
    sh(&env, &id, "printf '%0200d' 0");
    let kept = env.cli_ok(&["checkpoint", &id]).trim().to_string();
    sh(&env, &id, "echo discarded");
    env.cli_ok(&["rollback", &id, "--to", &kept]);
    sh(&env, &id, "echo after");
    let log = get(&env, &format!("/v1/sandboxes/{id}/logs?output=true"));
    assert_eq!(argvs(&log), ["\"echo one; echo err >&2\"", "\"printf '%0200d' 0\"", "\"echo after\""], "{log}");
    assert_eq!(log[0]["output"], json!({"stdout": "one\n", "stderr": "err\n", "cut": 0}));
    assert_eq!(log[1]["output"]["stdout"], "0".repeat(64));
    assert_eq!(log[1]["output"]["cut"], 136);
    assert_eq!(log[1]["output_bytes"], 200);
    assert!(log[2]["output"]["stdout"] == "after\n");
    // Without ?output the records are as before; the CLI marks the cut.
    assert!(get(&env, &format!("/v1/sandboxes/{id}/logs"))[0].get("output").is_none());
    let text = env.cli_ok(&["logs", "--output", &id]);
    assert!(
        text.contains("  --- stdout\none\n  --- stderr\nerr\n") && text.contains("[136 more bytes of output not kept]"),
        "{text}"
    );
    // A checkpoint after the rollback seals the kept commands only.
    let after = env.cli_ok(&["checkpoint", &id]).trim().to_string();
    assert_eq!(argvs(&get(&env, &format!("/v1/snapshots/{after}/logs"))), argvs(&log));
    env.finish();
}

#[test]
fn a_patch_shows_what_changed_like_git_diff() {
    let env = TestEnv::start();
    env.import_busybox();
    let id = create(&env, json!({"image": "busybox"}));
    sh(&env, &id, "printf 'a\\nb\\nc\\n' > /tmp/f; echo bye > /tmp/gone; printf '\\0\\1' > /tmp/bin");
    let one = env.cli_ok(&["checkpoint", &id]).trim().to_string();
    sh(&env, &id, "printf 'a\\nB\\nc\\n' > /tmp/f; rm /tmp/gone; printf '\\0\\2' > /tmp/bin; chmod +x /tmp/f");
    let two = env.cli_ok(&["checkpoint", &id]).trim().to_string();
    let p = env.cli_ok(&["diff", &two, "--patch", "--against", &one]);
    assert!(p.contains("diff --git a/tmp/f b/tmp/f\nold mode 100644\nnew mode 100755\n--- a/tmp/f\n+++ b/tmp/f\n@@ -1,3 +1,3 @@\n a\n-b\n+B\n c\n"), "{p}");
    assert!(p.contains("diff --git a/tmp/gone b/tmp/gone\ndeleted file mode 100644\n--- a/tmp/gone\n+++ /dev/null\n@@ -1 +0,0 @@\n-bye\n"), "{p}");
    assert!(p.contains("Binary files a/tmp/bin and b/tmp/bin differ"), "{p}");
    assert!(!p.contains("etc/"), "unchanged image files are not in the patch: {p}");
    // Against what it is over (its parent, `one`: it is an increment): the same.
    assert_eq!(env.cli_ok(&["diff", &two, "--patch"]), p);
    // The first, against what it ran on (the image): everything is new.
    let p = env.cli_ok(&["diff", &one, "--patch"]);
    assert!(p.contains("new file mode 100644\n--- /dev/null\n+++ b/tmp/f\n@@ -0,0 +1,3 @@\n+a\n+b\n+c\n"), "{p}");
    assert!(p.contains("+++ b/tmp/gone"), "{p}");
    // Its own patch applies: git apply would take it; here the hunks are exact.
    let r = env.client().call::<Value>(
        "GET",
        &format!("/v1/snapshots/{two}/diff?patch=true&against=0123456789abcdef"),
        None::<&()>,
    );
    assert_eq!(r.unwrap_err().status(), Some(404));
    env.finish();
}

#[test]
fn the_result_document_and_logs_and_evaluations_travel_with_push_and_pull() {
    let reg = registry::Registry::start();
    let a = TestEnv::start();
    let b = TestEnv::start();
    a.import_busybox();
    let id = create(&a, json!({"image": "busybox"}));
    sh(&a, &id, "echo made > /tmp/work; echo built");
    let snap = a.cli_ok(&["checkpoint", &id]).trim().to_string();
    evaluate(
        &a,
        &snap,
        json!({"name": "tests", "version": "1", "argv": ["sh", "-c", "echo '{\"ok\": true}' > $STRATA_RESULT"]}),
    );
    a.cli_ok(&["snapshot", "label", &snap, "verdict=accepted"]);
    let result = get(&a, &format!("/v1/snapshots/{snap}/result"));
    assert_eq!(result["snapshot"]["id"], snap.as_str());
    assert_eq!(result["chain"], json!([snap]));
    assert_eq!(result["provenance"]["image"], "busybox:latest");
    assert_eq!(result["provenance"]["source_sandbox"], id.as_str());
    assert!(
        result["provenance"]["strata_version"].is_string() && result["provenance"]["image_manifest_digest"].is_string()
    );
    assert_eq!(result["logs"][0]["output"]["stdout"], "built\n", "{result}");
    assert_eq!(result["evaluations"][0]["result"], json!({"ok": true}));
    assert_eq!(result["labels"], json!({"verdict": "accepted"}));

    // A resumed sandbox's checkpoint carries its whole trajectory.
    a.cli_ok(&["rm", &id]);
    let resumed = a.cli_ok(&["resume", &snap]).trim().to_string();
    sh(&a, &resumed, "echo second");
    let child = a.cli_ok(&["checkpoint", &resumed]).trim().to_string();
    a.client()
        .call::<Value>(
            "POST",
            &format!("/v1/snapshots/{child}/push"),
            Some(&json!({"reference": format!("{}/strata/results:v1", reg.addr()), "insecure": true})),
        )
        .unwrap();
    let pulled: Value = b
        .client()
        .call(
            "POST",
            "/v1/snapshots/pull",
            Some(&json!({"reference": format!("{}/strata/results:v1", reg.addr()), "insecure": true})),
        )
        .unwrap();
    assert_eq!(pulled["snapshot"]["id"], child.as_str());
    let log_a = get(&a, &format!("/v1/snapshots/{child}/logs?output=true"));
    let log_b = get(&b, &format!("/v1/snapshots/{child}/logs?output=true"));
    assert_eq!(argvs(&log_b), ["\"echo made > /tmp/work; echo built\"", "\"echo second\""]);
    let strip = |l: &Value| -> Vec<Value> {
        l.as_array()
            .unwrap()
            .iter()
            .map(|r| {
                let mut r = r.clone();
                r["id"] = json!(0);
                r
            })
            .collect()
    };
    assert_eq!(strip(&log_a), strip(&log_b), "the log arrives as it was, output included");
    let evals_b = get(&b, &format!("/v1/snapshots/{snap}/evaluations"));
    assert_eq!(evals_b[0]["name"], "tests");
    assert_eq!(evals_b[0]["result"], json!({"ok": true}));
    // A second pull of the same chain adds nothing twice.
    b.client()
        .call::<Value>(
            "POST",
            "/v1/snapshots/pull",
            Some(&json!({"reference": format!("{}/strata/results:v1", reg.addr()), "insecure": true})),
        )
        .unwrap();
    assert_eq!(get(&b, &format!("/v1/snapshots/{child}/logs")).as_array().unwrap().len(), 2);
    assert_eq!(get(&b, &format!("/v1/snapshots/{snap}/evaluations")).as_array().unwrap().len(), 1);
    a.finish();
    b.finish();
}

/// Poll `GET path` until `pred` holds (10 s at most).
fn wait_for(env: &TestEnv, path: &str, pred: impl Fn(&Value) -> bool) -> Value {
    let start = std::time::Instant::now();
    loop {
        if let Ok(v) = env.client().call::<Value>("GET", path, None::<&()>) {
            if pred(&v) {
                return v;
            }
        }
        assert!(start.elapsed().as_secs() < 10, "GET {path}: never as expected\n{}", env.daemon_log());
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

fn status(r: Result<Vec<u8>, ClientError>) -> Option<u16> {
    r.err().and_then(|e| e.status())
}

#[test]
fn a_capture_in_progress_is_listed_as_capturing_and_never_restorable() {
    let env = TestEnv::start_with_env(&[("STRATA_FAILPOINTS", "checkpoint:captured=sleep-once:3000")]);
    env.import_busybox();
    let id = create(&env, json!({"image": "busybox", "work_context": "wc-capturing"}));
    sh(&env, &id, "echo x > /tmp/x");
    let socket = env.socket.clone();
    let sid = id.clone();
    let t = std::thread::spawn(move || {
        Client::connect(&socket).unwrap().call::<Value>("POST", &format!("/v1/sandboxes/{sid}/checkpoint"), None::<&()>)
    });
    let list =
        wait_for(&env, "/v1/snapshots", |l| l.as_array().is_some_and(|a| a.iter().any(|s| s["state"] == "capturing")));
    let snap = list[0]["id"].as_str().unwrap().to_string();
    assert!(list[0]["sequence"].is_null(), "{list}");
    assert!(get(&env, "/v1/lineages/wc-capturing")["head"].is_null(), "a capture is not a head");
    let mut c = env.client();
    let empty = json!({});
    for (m, p) in [("POST", "resume"), ("POST", "fork"), ("GET", "diff")] {
        let r = c.request(m, &format!("/v1/snapshots/{snap}/{p}"), if m == "POST" { Some(&empty) } else { None });
        assert_eq!(status(r), Some(409), "{p} of a capture in progress");
    }
    assert_eq!(status(c.request("DELETE", &format!("/v1/snapshots/{snap}"), None::<&()>)), Some(409));
    let done = t.join().unwrap().unwrap();
    assert_eq!(
        (done["id"].as_str(), done["state"].as_str(), done["sequence"].as_i64()),
        (Some(snap.as_str()), Some("ready"), Some(1))
    );
    assert_eq!(get(&env, "/v1/lineages/wc-capturing")["head"], snap.as_str());
    env.finish();
}

#[test]
fn a_failed_capture_and_a_failed_seal_are_failed_and_the_head_stays_the_previous_one() {
    let mut env = TestEnv::start();
    env.import_busybox();
    let id = create(&env, json!({"image": "busybox", "work_context": "wc-fail"}));
    sh(&env, &id, "echo one > /tmp/one");
    let head = env.cli_ok(&["checkpoint", &id]).trim().to_string();
    env.stop_daemon();
    env.daemon_env = vec![("STRATA_FAILPOINTS".into(), "checkpoint:record=fail,seal:write=fail".into())];
    env.start_daemon();
    // The capture fails: listed as failed with the reason, never the head.
    let r = env.client().request("POST", &format!("/v1/sandboxes/{id}/checkpoint"), None::<&()>);
    assert!(r.is_err(), "{r:?}");
    let failed: Vec<Value> =
        get(&env, "/v1/snapshots").as_array().unwrap().iter().filter(|s| s["state"] == "failed").cloned().collect();
    assert_eq!(failed.len(), 1, "{failed:?}");
    assert!(failed[0]["info"]["capture_error"].as_str().unwrap().contains("failpoint checkpoint:record"), "{failed:?}");
    assert_eq!(get(&env, "/v1/lineages/wc-fail")["head"], head.as_str());
    // The sandbox runs on; a suspend is appended, then its seal fails: it
    // is failed and the head goes back to the one before.
    assert_eq!(stdout(&sh(&env, &id, "cat /tmp/one")), "one\n");
    let s = env.cli_ok(&["suspend", &id]).trim().to_string();
    let v = wait_for(&env, &format!("/v1/snapshots/{s}"), |v| v["state"] == "failed");
    assert!(v["info"]["seal_error"].as_str().unwrap().contains("failpoint seal:write"), "{v}");
    assert_eq!(get(&env, "/v1/lineages/wc-fail")["head"], head.as_str());
    // Resuming the work context lands on the previous head.
    let r: Value = env.client().call("POST", "/v1/lineages/wc-fail/resume", Some(&json!({}))).unwrap();
    assert_eq!(r["restored"]["snapshot"], head.as_str(), "{r}");
    // gc collects both failed snapshots.
    let report = env.cli_ok(&["gc", "--retention", "0s"]);
    assert!(report.contains(failed[0]["id"].as_str().unwrap()) && report.contains(&s), "{report}");
    env.finish();
}

#[test]
fn a_removal_is_deleting_until_its_files_are_gone_and_finishes_after_a_crash() {
    let mut env = TestEnv::start_with_env(&[("STRATA_FAILPOINTS", "snapshot-rm:files-removed=sleep-once:2000")]);
    env.import_busybox();
    let id = create(&env, json!({"image": "busybox"}));
    sh(&env, &id, "echo x > /tmp/x");
    // The older of two checkpoints (an active lineage's head is kept; the
    // newer captures the whole upper, so it is not over the older).
    let snap = env.cli_ok(&["checkpoint", &id]).trim().to_string();
    sh(&env, &id, "echo z > /tmp/z");
    env.cli_ok(&["checkpoint", "--whole", &id]);
    env.cli_ok(&["rm", &id]);
    let layer = get(&env, &format!("/v1/snapshots/{snap}"))["layer"].as_str().unwrap().to_string();
    assert!(env.root.join("layers").join(&layer).exists());
    let socket = env.socket.clone();
    let sn = snap.clone();
    let t = std::thread::spawn(move || {
        Client::connect(&socket).unwrap().request("DELETE", &format!("/v1/snapshots/{sn}"), None::<&()>)
    });
    let v = wait_for(&env, &format!("/v1/snapshots/{snap}"), |v| v["state"] == "deleting");
    assert_eq!(v["state"], "deleting");
    let r = env.client().request("POST", &format!("/v1/snapshots/{snap}/resume"), Some(&json!({})));
    assert_eq!(status(r), Some(404), "a snapshot being removed is not restorable");
    t.join().unwrap().unwrap();
    assert_eq!(status(env.client().request("GET", &format!("/v1/snapshots/{snap}"), None::<&()>)), Some(404));
    assert!(!env.root.join("layers").join(&layer).exists());

    // Killed half-way: the next start finishes the removal.
    env.stop_daemon();
    env.daemon_env = vec![("STRATA_FAILPOINTS".into(), "snapshot-rm:deleting".into())];
    env.start_daemon();
    let id = create(&env, json!({"image": "busybox"}));
    sh(&env, &id, "echo y > /tmp/y");
    // The older of two checkpoints (an active lineage's head is kept; the
    // newer captures the whole upper, so it is not over the older).
    let snap = env.cli_ok(&["checkpoint", &id]).trim().to_string();
    sh(&env, &id, "echo z > /tmp/z");
    env.cli_ok(&["checkpoint", "--whole", &id]);
    env.cli_ok(&["rm", &id]);
    let layer = get(&env, &format!("/v1/snapshots/{snap}"))["layer"].as_str().unwrap().to_string();
    let socket = env.socket.clone();
    let sn = snap.clone();
    let t = std::thread::spawn(move || {
        Client::connect(&socket).unwrap().request("DELETE", &format!("/v1/snapshots/{sn}"), None::<&()>)
    });
    env.wait_logged("failpoint snapshot-rm:deleting reached", std::time::Duration::from_secs(30));
    env.kill_daemon();
    let _ = t.join();
    env.daemon_env.clear();
    env.start_daemon();
    assert_eq!(status(env.client().request("GET", &format!("/v1/snapshots/{snap}"), None::<&()>)), Some(404));
    assert!(!env.root.join("layers").join(&layer).exists());
    env.finish();
}

#[test]
fn a_compacted_chain_pushed_alone_still_carries_its_whole_log() {
    let reg = registry::Registry::start();
    let a = TestEnv::start_with(&["--compact-depth", "1"]);
    let b = TestEnv::start();
    a.import_busybox();
    let id = create(&a, json!({"image": "busybox"}));
    sh(&a, &id, "echo first");
    let s1 = a.cli_ok(&["checkpoint", &id]).trim().to_string();
    a.cli_ok(&["rm", &id]);
    let resumed = a.cli_ok(&["resume", &s1]).trim().to_string();
    sh(&a, &resumed, "echo second");
    // Its chain would be two layers deep: folded into one, s2 alone is pushed.
    let s2 = a.cli_ok(&["checkpoint", &resumed]).trim().to_string();
    let info = get(&a, &format!("/v1/snapshots/{s2}"));
    assert_eq!(
        (info["info"]["compacted"].as_bool(), info["parent"].as_str()),
        (Some(true), Some(s1.as_str())),
        "{info}"
    );
    let reference = format!("{}/strata/compacted:v1", reg.addr());
    post(&a, &format!("/v1/snapshots/{s2}/push"), json!({"reference": reference, "insecure": true}));
    let pulled = post(&b, "/v1/snapshots/pull", json!({"reference": reference, "insecure": true}));
    assert!(pulled["snapshot"]["parent"].is_null(), "B has no s1: {pulled}");
    assert_eq!(argvs(&get(&b, &format!("/v1/snapshots/{s2}/logs"))), ["\"echo first\"", "\"echo second\""]);
    a.finish();
    b.finish();
}

/// Suspend `sandbox` on `env`; the snapshot's id.
fn suspend(env: &TestEnv, sandbox: &str) -> String {
    post(env, &format!("/v1/sandboxes/{sandbox}/suspend"), json!({}))["id"].as_str().unwrap().to_string()
}

/// Resume lineage `wc` on `env`, write `line` in it and suspend it: the new head.
fn advance(env: &TestEnv, wc: &str, line: &str) -> String {
    let id = post(env, &format!("/v1/lineages/{wc}/resume"), json!({}))["id"].as_str().unwrap().to_string();
    sh(env, &id, &format!("echo {line} >> /root/log"));
    suspend(env, &id)
}

fn push_pull(from: &TestEnv, to: &TestEnv, snap: &str, reference: &str) -> Value {
    post(from, &format!("/v1/snapshots/{snap}/push"), json!({"reference": reference, "insecure": true}));
    post(to, "/v1/snapshots/pull", json!({"reference": reference, "insecure": true}))
}

#[test]
fn a_pulled_checkpoint_appends_to_a_local_lineage_only_after_its_head() {
    let reg = registry::Registry::start();
    // A folds every chain into one layer: a checkpoint is pushed alone,
    // naming a predecessor B may not have.
    let a = TestEnv::start_with(&["--compact-depth", "1"]);
    let b = TestEnv::start();
    a.import_busybox();
    let id = create(&a, json!({"image": "busybox", "work_context": "wc"}));
    sh(&a, &id, "echo s1 > /root/log");
    let s1 = suspend(&a, &id);
    let head = |env: &TestEnv| get(env, "/v1/lineages/wc")["head"].as_str().map(String::from);
    // A lineage new to B: the pull brings it, its head the pulled one.
    push_pull(&a, &b, &s1, &format!("{}/strata/wc:s1", reg.addr()));
    assert_eq!(head(&b).as_deref(), Some(s1.as_str()));
    // A's next, over s1 (B's head): appended.
    let a2 = advance(&a, "wc", "a2");
    push_pull(&a, &b, &a2, &format!("{}/strata/wc:a2", reg.addr()));
    assert_eq!(head(&b).as_deref(), Some(a2.as_str()));

    // B moves on by itself (sequence 3); A, meanwhile, to 3 and 4 over a2.
    let b3 = advance(&b, "wc", "b3");
    let _a3 = advance(&a, "wc", "a3");
    let a4 = advance(&a, "wc", "a4");
    let pulled = push_pull(&a, &b, &a4, &format!("{}/strata/wc:a4", reg.addr()));
    // a4 claims sequence 4, past B's head, but follows a3, not B's b3: it
    // is pulled (forkable) and lands outside the lineage.
    assert_eq!(head(&b).as_deref(), Some(b3.as_str()), "a registry moved B's head: {pulled}");
    let got = get(&b, &format!("/v1/snapshots/{a4}"));
    let why = got["info"]["outside_lineage"].as_str().unwrap_or_default();
    assert!(why.contains(&format!("but the head here is {b3}")), "{got}");
    let resumed = post(&b, "/v1/lineages/wc/resume", json!({}))["id"].as_str().unwrap().to_string();
    assert_eq!(stdout(&sh(&b, &resumed, "cat /root/log")), "s1\na2\nb3\n");
    let fork = post(&b, &format!("/v1/snapshots/{a4}/fork"), json!({}))[0]["id"].as_str().unwrap().to_string();
    assert_eq!(stdout(&sh(&b, &fork, "cat /root/log")), "s1\na2\na3\na4\n");
    a.finish();
    b.finish();
}

#[test]
fn df_shows_the_store_by_owner_and_what_gc_would_reclaim() {
    let env = TestEnv::start_with(&["--retention", "0s", "--gc-interval", "0s"]);
    env.import_busybox();
    let df = |env: &TestEnv| get(env, "/v1/df");
    let d = df(&env);
    assert_eq!((d["images"]["count"].as_u64(), d["snapshots"]["count"].as_u64()), (Some(1), Some(0)), "{d}");
    assert!(d["images"]["layer_bytes"].as_u64().unwrap() > 500_000 && d["images"]["blob_bytes"].as_u64().unwrap() > 0);
    let id = create(&env, json!({"image": "busybox"}));
    sh(&env, &id, "head -c 1048576 /dev/urandom > /tmp/one");
    let d = df(&env);
    assert_eq!(d["sandboxes"]["count"], 1);
    assert!(d["sandboxes"]["layer_bytes"].as_u64().unwrap() >= 1 << 20, "{d}");
    // Past the racy window (a file changed within a clock tick or two of a
    // capture is captured again by the next).
    std::thread::sleep(std::time::Duration::from_millis(50));
    let s1 = env.cli_ok(&["checkpoint", &id]).trim().to_string();
    let b1 = get(&env, &format!("/v1/snapshots/{s1}"))["bytes"].clone();
    assert!(b1["layer"].as_u64().unwrap() >= 1 << 20 && b1["blob"].as_u64().unwrap() >= 1 << 20, "{b1}");
    assert_eq!((&b1["chain_layers"], &b1["chain_blobs"]), (&b1["layer"], &b1["blob"]));
    sh(&env, &id, "head -c 1048576 /dev/urandom > /tmp/two");
    // An increment over s1 holds only the new file; a whole capture holds
    // both, and is not over s1.
    let inc = env.cli_ok(&["checkpoint", &id]).trim().to_string();
    let bi = get(&env, &format!("/v1/snapshots/{inc}"))["bytes"].clone();
    assert!(bi["layer"].as_u64().unwrap() < (1 << 20) + 4096, "{bi}");
    assert_eq!(bi["chain_layers"].as_u64().unwrap(), bi["layer"].as_u64().unwrap() + b1["layer"].as_u64().unwrap());
    let s2 = env.cli_ok(&["checkpoint", "--whole", &id]).trim().to_string();
    env.cli_ok(&["snapshot", "rm", &inc]);
    // A resumed sandbox's checkpoint: its chain holds its parent's bytes too.
    env.cli_ok(&["rm", &id]);
    let r = env.cli_ok(&["resume", &s2]).trim().to_string();
    sh(&env, &r, "echo three > /tmp/three");
    let s3 = env.cli_ok(&["checkpoint", &r]).trim().to_string();
    let (b2, b3) = (
        get(&env, &format!("/v1/snapshots/{s2}"))["bytes"].clone(),
        get(&env, &format!("/v1/snapshots/{s3}"))["bytes"].clone(),
    );
    let n = |v: &Value| v.as_u64().unwrap();
    assert_eq!(n(&b3["chain_layers"]), n(&b2["layer"]) + n(&b3["layer"]), "{b2} {b3}");
    assert_eq!(n(&b3["chain_blobs"]), n(&b2["blob"]) + n(&b3["blob"]));
    // The snapshots' total is theirs, each layer once; s1 (superseded,
    // retention 0) is what gc would take.
    let d = df(&env);
    assert_eq!(d["snapshots"]["count"], 3);
    assert_eq!(n(&d["snapshots"]["layer_bytes"]), n(&b1["layer"]) + n(&b2["layer"]) + n(&b3["layer"]), "{d}");
    assert_eq!(n(&d["snapshots"]["blob_bytes"]), n(&b1["blob"]) + n(&b2["blob"]) + n(&b3["blob"]), "{d}");
    assert_eq!(d["reclaimable"]["snapshots"], json!([s1]), "{d}");
    assert_eq!(n(&d["reclaimable"]["bytes"]), n(&b1["layer"]) + n(&b1["blob"]), "{d}");
    let text = env.cli_ok(&["df"]);
    assert!(text.contains("snapshots") && text.contains("reclaimable by gc now"), "{text}");
    env.cli_ok(&["gc"]);
    let d = df(&env);
    assert_eq!((d["snapshots"]["count"].as_u64(), d["reclaimable"]["bytes"].as_u64()), (Some(2), Some(0)), "{d}");
    assert!(d["store_used_bytes"].as_u64().unwrap() > 0 && d["store_free_bytes"].as_u64().unwrap() > 0);
    env.finish();
}

#[test]
fn a_log_pulled_back_by_the_host_that_made_it_is_not_its_live_sandboxs_own() {
    let reg = registry::Registry::start();
    let env = TestEnv::start();
    env.import_busybox();
    let id = create(&env, json!({"image": "busybox"}));
    sh(&env, &id, "echo one");
    let s1 = env.cli_ok(&["checkpoint", &id]).trim().to_string();
    sh(&env, &id, "echo two");
    env.cli_ok(&["checkpoint", "--whole", &id]);
    let reference = format!("{}/strata/back:v1", reg.addr());
    post(&env, &format!("/v1/snapshots/{s1}/push"), json!({"reference": reference, "insecure": true}));
    env.cli_ok(&["snapshot", "rm", &s1]);
    post(&env, "/v1/snapshots/pull", json!({"reference": reference, "insecure": true}));
    // The pulled snapshot has its log; the sandbox that ran it keeps its own once.
    assert_eq!(argvs(&get(&env, &format!("/v1/snapshots/{s1}/logs"))), ["\"echo one\""]);
    assert_eq!(argvs(&get(&env, &format!("/v1/sandboxes/{id}/logs"))), ["\"echo one\"", "\"echo two\""]);
    env.finish();
}

#[test]
fn exec_records_written_behind_the_answer_are_whole_wherever_they_are_read() {
    // The exec log's writer stops at its failpoint before it writes
    // anything: each record below reaches the catalog only because what
    // reads it (a log, a checkpoint, a rollback, a suspend) settles the
    // queue first, or because the daemon's stop does.
    let mut env = TestEnv::start_with_env(&[("STRATA_FAILPOINTS", "exec-log:write")]);
    env.import_busybox();
    let id = create(&env, json!({"image": "busybox"}));
    sh(&env, &id, "echo one");
    // Woken by that record, the writer stops before it writes it.
    env.wait_logged("failpoint exec-log:write reached", Duration::from_secs(10));
    assert_eq!(argvs(&get(&env, &format!("/v1/sandboxes/{id}/logs"))), ["\"echo one\""]);
    sh(&env, &id, "echo two");
    let s1 = env.cli_ok(&["checkpoint", &id]).trim().to_string();
    assert_eq!(argvs(&get(&env, &format!("/v1/snapshots/{s1}/logs"))), ["\"echo one\"", "\"echo two\""]);
    sh(&env, &id, "echo discarded");
    env.cli_ok(&["rollback", &id, "--to", &s1]);
    sh(&env, &id, "echo three");
    assert!(env.stop_daemon().success());
    let db = env.catalog();
    let written: Vec<String> =
        db.exec_records(Some(&id), 0, None, false).unwrap().into_iter().map(|r| r.argv.join(" ")).collect();
    assert_eq!(written, ["sh -c echo one", "sh -c echo two", "sh -c echo discarded", "sh -c echo three"]);
    drop(db);
    env.start_daemon();
    assert_eq!(
        argvs(&get(&env, &format!("/v1/sandboxes/{id}/logs"))),
        ["\"echo one\"", "\"echo two\"", "\"echo three\""]
    );
    sh(&env, &id, "echo four");
    let s2 = env.cli_ok(&["suspend", &id]).trim().to_string();
    assert_eq!(argvs(&get(&env, &format!("/v1/snapshots/{s2}/logs"))).last().unwrap(), "\"echo four\"");
    env.finish();
}

#[test]
fn exec_records_reach_the_catalog_with_no_one_reading_them() {
    let env = TestEnv::start();
    env.import_busybox();
    let id = create(&env, json!({"image": "busybox"}));
    let db = env.catalog();
    // The writer asleep (nothing ran yet), then lingering after a write.
    for n in 1..=3 {
        sh(&env, &id, &format!("echo {n}"));
        wait_until("the exec record written by the writer", Duration::from_secs(5), || {
            db.exec_records(Some(&id), 0, None, false).unwrap().len() == n
        });
        std::thread::sleep(Duration::from_millis(if n == 1 { 1 } else { 50 }));
    }
    drop(db);
    env.finish();
}
