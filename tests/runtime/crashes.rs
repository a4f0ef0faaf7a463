//! A daemon killed or a disk full at every point of a capture or a
//! baseline publish: each snapshot whole or gone, nothing orphaned.

use super::*;

#[test]
fn a_daemon_killed_mid_checkpoint_leaves_no_partial_snapshot() {
    // The capture holds the sandbox frozen for 5 s: a capture written
    // ahead (and confirmed while frozen) can be frozen for less than the
    // poll below takes to see it.
    let mut env = TestEnv::start_with_env(&[("STRATA_FAILPOINTS", "checkpoint:frozen=sleep-once:5000")]);
    env.import_busybox();
    let id = create(&env, json!({"image": "busybox"}));
    // Enough data that the capture takes a while: in files under 1 MiB,
    // which are copied while frozen (larger ones are pre-copied before).
    sh(&env, &id, "for i in $(seq 256); do head -c 196608 /dev/urandom > /tmp/f$i; done");
    let layers_before = std::fs::read_dir(env.root.join("layers")).unwrap().count();
    let socket = env.socket.clone();
    let sid = id.clone();
    let t = std::thread::spawn(move || {
        let mut c = Client::connect(&socket).unwrap();
        c.request("POST", &format!("/v1/sandboxes/{sid}/checkpoint"), None::<&()>).map(|_| ())
    });
    // Kill the daemon while the sandbox is frozen for the capture.
    let state = env.cgroup_dirs().into_iter().find_map(|d| {
        let v1 = d.join(&id).join("freezer.state");
        let v2 = d.join(&id).join("cgroup.events");
        if v1.exists() {
            Some(v1)
        } else if v2.exists() {
            Some(v2)
        } else {
            None
        }
    });
    let state = state.expect("freezer state file");
    wait_until("sandbox never froze", Duration::from_secs(20), || {
        let s = std::fs::read_to_string(&state).unwrap_or_default();
        s.contains("FROZEN") || s.contains("frozen 1")
    });
    env.kill_daemon();
    assert!(t.join().unwrap().is_err(), "checkpoint finished before the kill");

    env.daemon_env.clear();
    env.start_daemon();
    // The sandbox runs again (thawed at adoption); nothing partial is left.
    assert_eq!(stdout(&sh(&env, &id, "echo alive")), "alive\n");
    let snaps: Vec<Value> = env.client().call("GET", "/v1/snapshots", None::<&()>).unwrap();
    assert!(only_failed_captures(&snaps), "{snaps:?}");
    assert_eq!(std::fs::read_dir(env.root.join("layers")).unwrap().count(), layers_before);
    assert_eq!(snapshot_blobs(&env), 0);
    assert_eq!(std::fs::read_dir(env.root.join("tmp")).unwrap().count(), 0);
    // And a checkpoint now works.
    env.cli_ok(&["checkpoint", &id]);
    env.finish();
}

#[test]
fn a_checkpoint_on_a_full_disk_fails_cleanly_and_the_sandbox_runs_on() {
    // The whole store is a 96 MiB tmpfs; the delta is 16 MiB of random
    // bytes, and a checkpoint needs three copies of it at once (the frozen
    // tar, the blob compressed beside it, the hydrated layer). Ballast
    // leaves room for less than one, less than two and less than three
    // copies: the disk fills up while the sandbox is frozen (tar and blob
    // racing for the last bytes) and, last, during hydration.
    const MIB: u64 = 1 << 20;
    let env = TestEnv::start_on_tmpfs(96 * MIB);
    env.import_busybox();
    let id = create(&env, json!({"image": "busybox"}));
    let sum = "md5sum /tmp/big | cut -d' ' -f1";
    let v = sh(&env, &id, &format!("head -c {} /dev/urandom > /tmp/big && {sum}", 16 * MIB));
    assert_eq!(v["exit_code"], 0, "{v}");
    let want = stdout(&v);
    let count = |sub: &str| std::fs::read_dir(env.root.join(sub)).unwrap().count();
    let ballast = env.root.join("ballast");
    // Three full disks for the first checkpoint; then, after it worked, one
    // for the second, an increment (the sandbox wrote another 4 MiB).
    let mut first = None;
    let mut want2 = String::new();
    for room in [8 * MIB, 24 * MIB, 40 * MIB, 0, 2 * MIB] {
        if room == 0 {
            // With room again, the same checkpoint works.
            std::fs::remove_file(&ballast).unwrap();
            first = Some(env.cli_ok(&["checkpoint", &id]).trim().to_string());
            let v = sh(
                &env,
                &id,
                &format!("head -c {} /dev/urandom > /tmp/big2 && {}", 4 * MIB, sum.replace("big", "big2")),
            );
            want2 = stdout(&v);
            continue;
        }
        let layers_before = count("layers");
        let blobs_before = snapshot_blobs(&env);
        let _ = std::fs::remove_file(&ballast);
        let st = nix::sys::statvfs::statvfs(&env.root).unwrap();
        let free = st.blocks_available() * st.fragment_size();
        let f = std::fs::File::create(&ballast).unwrap();
        // tmpfs has no fallocate for this, write it.
        let mut w = std::io::BufWriter::new(f);
        let chunk = vec![1u8; MIB as usize];
        for _ in 0..(free - room) / MIB {
            std::io::Write::write_all(&mut w, &chunk).unwrap();
        }
        std::io::Write::flush(&mut w).unwrap();
        drop(w);

        let r = env.client().request("POST", &format!("/v1/sandboxes/{id}/checkpoint"), None::<&()>);
        match r {
            Err(ClientError::Api { status, code, message }) => {
                assert_eq!((status, code.as_str()), (507, "no_space"), "{room}: {message}");
                assert!(message.contains("No space left"), "{room}: {message}");
            }
            other => panic!("checkpoint with {room} bytes free: {other:?}"),
        }
        // Nothing partial: no snapshot but the failed capture, no new
        // layer, no blob, nothing in tmp.
        let mut snaps: Vec<Value> = env.client().call("GET", "/v1/snapshots", None::<&()>).unwrap();
        snaps.retain(|s| s["id"].as_str() != first.as_deref());
        assert!(only_failed_captures(&snaps), "{room}: {snaps:?}");
        assert_eq!(count("layers"), layers_before, "{room}: layer left");
        assert_eq!(snapshot_blobs(&env), blobs_before, "{room}: blob left");
        wait_until(&format!("{room}: tmp/ not emptied"), Duration::from_secs(10), || count("tmp") == 0);
        // The sandbox runs on, its data intact.
        let info: Value = env.client().call("GET", &format!("/v1/sandboxes/{id}"), None::<&()>).unwrap();
        assert_eq!(info["state"], "running", "{room}");
        assert_eq!(stdout(&sh(&env, &id, sum)), want, "{room}");
    }
    // With room again, the increment works and resumes to the same data.
    std::fs::remove_file(&ballast).unwrap();
    let snap = env.cli_ok(&["checkpoint", &id]).trim().to_string();
    let info: Value = env.client().call("GET", &format!("/v1/snapshots/{snap}"), None::<&()>).unwrap();
    assert_eq!(info["parent"].as_str(), first.as_deref(), "{info}");
    assert!(info["blob_size"].as_u64().unwrap() < 5 * MIB, "{info}");
    env.cli_ok(&["rm", &id]);
    let resumed = env.cli_ok(&["resume", &snap]).trim().to_string();
    assert_eq!(stdout(&sh(&env, &resumed, sum)), want);
    assert_eq!(stdout(&sh(&env, &resumed, &sum.replace("big", "big2"))), want2);
    env.finish();
}

#[test]
fn a_daemon_killed_at_any_point_of_a_capture_leaves_it_whole_or_gone() {
    for point in [
        "checkpoint:begun",
        "checkpoint:captured",
        "checkpoint:layer-committed",
        "checkpoint:appended",
        "suspend:moved",
        "suspend:layer-committed",
        "suspend:appended",
        "seal:blob-written",
    ] {
        crash_at(point, false);
    }
    // The second checkpoint of a sandbox is an increment over the first.
    for point in ["checkpoint:begun", "checkpoint:captured", "checkpoint:layer-committed", "checkpoint:appended"] {
        crash_at(point, true);
    }
}

/// Kill the daemon at `point` of a capture (the second checkpoint, an
/// increment over the first, if `second`), restart it, and check that the
/// capture is whole or gone.
fn crash_at(point: &str, second: bool) {
    let armed = if second { format!("{point}=stop-after:1") } else { point.to_string() };
    let mut env = TestEnv::start_with_env(&[("STRATA_FAILPOINTS", &armed)]);
    env.import_busybox();
    let id = create(&env, json!({"image": "busybox", "work_context": "crash"}));
    sh(&env, &id, "mkdir /data && for i in $(seq 20); do echo $i > /data/f$i; done");
    let first = second.then(|| {
        let snap: Value = env.client().call("POST", &format!("/v1/sandboxes/{id}/checkpoint"), None::<&()>).unwrap();
        sh(&env, &id, "echo changed > /data/f20 && rm /data/f1");
        snap["id"].as_str().unwrap().to_string()
    });
    let op = if point.starts_with("checkpoint") { "checkpoint" } else { "suspend" };
    let socket = env.socket.clone();
    let sid = id.clone();
    let t = std::thread::spawn(move || {
        let mut c = Client::connect(&socket).unwrap();
        c.request("POST", &format!("/v1/sandboxes/{sid}/{op}"), None::<&()>).map(|_| ())
    });
    kill_at_failpoint(&mut env, point, usize::from(second) + 1);
    let answered = t.join().unwrap();
    assert_eq!(answered.is_ok(), point == "seal:blob-written", "{point}: {answered:?}");
    let snaps = store_matches_database(&env, "busybox:latest", point);
    let mut c = env.client();
    let none = None::<&()>;
    // Cut short before its append, a checkpoint is listed as a failed
    // capture (never restorable); a suspend leaves nothing.
    let all: Vec<Value> = c.call("GET", "/v1/snapshots", none).unwrap();
    let failed: Vec<&Value> = all.iter().filter(|s| s["state"] == "failed").collect();
    let cut_short = op == "checkpoint" && !point.ends_with("appended");
    assert_eq!(failed.len(), usize::from(cut_short), "{point}: {all:?}");
    for f in failed {
        let r = c.request("POST", &format!("/v1/snapshots/{}/fork", f["id"].as_str().unwrap()), Some(&json!({})));
        match r {
            Err(ClientError::Api { status: 409, message, .. }) => {
                assert!(message.contains("is a capture that failed"), "{point}: {message}")
            }
            other => panic!("{point}: a failed capture is not restorable: {other:?}"),
        }
    }
    // The head moved at most once, to a whole snapshot.
    let l: Value = c.call("GET", "/v1/lineages/crash", none).unwrap();
    let snaps: Vec<&Value> = snaps.iter().filter(|s| Some(s["id"].as_str().unwrap()) != first.as_deref()).collect();
    match snaps.as_slice() {
        [] => assert_eq!(l["head"].as_str(), first.as_deref(), "{point}: {l}"),
        [s] => {
            assert_eq!(l["head"], s["id"], "{point}: {l}");
            assert_eq!(s["sequence"], usize::from(second) + 1);
            // An increment over the first checkpoint, whole.
            assert_eq!(s["parent"].as_str(), first.as_deref(), "{point}: {s}");
            // (A fork: a checkpoint's sandbox still holds the lineage.)
            let r: Value =
                c.call("POST", &format!("/v1/snapshots/{}/fork", s["id"].as_str().unwrap()), Some(&json!({}))).unwrap();
            let want = if second { "changed\nno f1\n" } else { "20\n" };
            let got = stdout(&sh(&env, r[0]["id"].as_str().unwrap(), "cat /data/f20; test -e /data/f1 || echo no f1"));
            assert_eq!(got, want, "{point}");
        }
        more => panic!("{point}: {more:?}"),
    }
    // Before the append the snapshot is gone; after it, whole.
    let recorded = point.ends_with("appended") || point.starts_with("seal");
    assert_eq!(snaps.len(), usize::from(recorded), "{point}: {snaps:?}");
    // A checkpoint's sandbox runs on (re-adopted), and checkpoints again:
    // an increment over the last one that was recorded.
    if op == "checkpoint" {
        assert_eq!(stdout(&sh(&env, &id, "cat /data/f2")), "2\n", "{point}");
        let again: Value = c.call("POST", &format!("/v1/sandboxes/{id}/checkpoint"), None::<&()>).unwrap();
        let last = snaps.first().map(|s| s["id"].as_str().unwrap().to_string()).or(first.clone());
        assert_eq!(again["parent"].as_str(), last.as_deref(), "{point}: {again}");
        let r: Value =
            c.call("POST", &format!("/v1/snapshots/{}/fork", again["id"].as_str().unwrap()), Some(&json!({}))).unwrap();
        let want = if second { "changed\n" } else { "20\n" };
        assert_eq!(stdout(&sh(&env, r[0]["id"].as_str().unwrap(), "cat /data/f20")), want, "{point}");
    }
    let start = Instant::now();
    let names = |sub: &str| -> Vec<String> {
        std::fs::read_dir(env.root.join(sub)).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect()
    };
    while !names("tmp").is_empty() {
        assert!(start.elapsed() < Duration::from_secs(10), "{point}: tmp/ not emptied: {:?}", names("tmp"));
        std::thread::sleep(Duration::from_millis(20));
    }
    env.finish();
}

/// Wait until the daemon reports reaching `point` the `nth` time, kill it,
/// and restart it without failpoints.
fn kill_at_failpoint(env: &mut TestEnv, point: &str, nth: usize) {
    let start = Instant::now();
    while env.daemon_log().matches(&format!("failpoint {point} reached")).count() < nth {
        assert!(start.elapsed() < Duration::from_secs(60), "{point} never reached:\n{}", env.daemon_log());
        std::thread::sleep(Duration::from_millis(10));
    }
    env.kill_daemon();
    env.daemon_env.clear();
    env.start_daemon();
}

/// After a restart: every snapshot is whole (sealed, its blob the recorded
/// size) and every layer and blob in the store is the database's. Returns
/// the snapshots.
fn store_matches_database(env: &TestEnv, image: &str, point: &str) -> Vec<Value> {
    let mut c = env.client();
    let none = None::<&()>;
    let snaps: Vec<Value> = c.call("GET", "/v1/snapshots", none).unwrap();
    let wait_sealed = |s: &Value| -> Value {
        let start = Instant::now();
        loop {
            let v: Value =
                env.client().call("GET", &format!("/v1/snapshots/{}", s["id"].as_str().unwrap()), none).unwrap();
            if v["sealing"] == false {
                return v;
            }
            assert!(start.elapsed() < Duration::from_secs(30), "{point}: never sealed: {v}");
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    // A capture the kill cut short is `failed`, says why, and holds
    // nothing: it is not among the whole snapshots returned.
    let (failed, snaps): (Vec<Value>, Vec<Value>) = snaps.into_iter().partition(|s| s["state"] == "failed");
    for f in &failed {
        assert_eq!(f["info"]["capture_error"], "the daemon stopped during the capture", "{point}: {f}");
        assert!(f["sequence"].is_null() && f["blob_digest"] == "", "{point}: {f}");
    }
    let snaps: Vec<Value> = snaps.iter().map(wait_sealed).collect();
    let names = |sub: &str| -> std::collections::BTreeSet<String> {
        std::fs::read_dir(env.root.join(sub)).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect()
    };
    let image: Value = c.call("GET", &format!("/v1/images/{image}"), none).unwrap();
    let mut want_layers: std::collections::BTreeSet<String> = image["layers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l.as_str().unwrap().trim_start_matches("sha256:").to_string())
        .collect();
    let mut want_blobs = std::collections::BTreeSet::new();
    for s in &snaps {
        want_layers.insert(s["layer"].as_str().unwrap().to_string());
        let blob = s["blob_digest"].as_str().unwrap().trim_start_matches("sha256:").to_string();
        let len = std::fs::metadata(env.root.join("blobs/sha256").join(&blob)).map(|m| m.len());
        assert_eq!(len.ok(), s["blob_size"].as_u64(), "{point}: blob of {s}");
        want_blobs.insert(blob);
    }
    assert_eq!(names("layers"), want_layers, "{point}: layers");
    let images = image_blobs();
    let blobs: std::collections::BTreeSet<String> =
        names("blobs/sha256").into_iter().filter(|b| !images.contains(b)).collect();
    assert_eq!(blobs, want_blobs, "{point}: blobs");
    snaps
}

#[test]
fn a_daemon_killed_while_publishing_a_baseline_leaves_it_whole_or_gone() {
    for point in ["baseline:validated", "baseline:layer-committed", "baseline:appended"] {
        let mut env = TestEnv::start_with_env(&[("STRATA_FAILPOINTS", point)]);
        env.import_image("debian-git");
        let p = create(&env, json!({"image": "debian-git"}));
        assert_eq!(sh(&env, &p, CLEAN_REPO)["exit_code"], 0);
        let socket = env.socket.clone();
        let pid = p.clone();
        let t = std::thread::spawn(move || {
            let body = json!({"repo": "/src/app", "ref": "main", "owner": "acme"});
            Client::connect(&socket).unwrap().request("POST", &format!("/v1/sandboxes/{pid}/baseline"), Some(&body))
        });
        kill_at_failpoint(&mut env, point, 1);
        assert!(t.join().unwrap().is_err(), "{point}: the publish answered before the kill");
        let snaps = store_matches_database(&env, "debian-git:latest", point);
        let create_from = || {
            env.client().request(
                "POST",
                "/v1/sandboxes",
                Some(&json!({"image": "debian-git", "baseline": "acme/app@main"})),
            )
        };
        if point == "baseline:appended" {
            // Recorded before the kill: whole, ready, and new work starts from it.
            assert_eq!(snaps.len(), 1, "{point}: {snaps:?}");
            assert_eq!((snaps[0]["class"].as_str(), snaps[0]["state"].as_str()), (Some("baseline"), Some("ready")));
            let made: Value = serde_json::from_slice(&create_from().unwrap()).unwrap();
            assert_eq!(stdout(&sh(&env, made["id"].as_str().unwrap(), "cat /src/app/a")), "v1\n", "{point}");
        } else {
            assert!(snaps.is_empty(), "{point}: {snaps:?}");
            assert_eq!(status_of(create_from()), 404, "{point}: a baseline appeared");
        }
        // The publisher's sandbox runs on (re-adopted).
        assert_eq!(stdout(&sh(&env, &p, "cat /src/app/a")), "v1\n", "{point}");
        env.finish();
    }
}
