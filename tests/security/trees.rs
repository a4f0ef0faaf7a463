//! Hostile trees a sandbox writes: deep ones, sparse files, and a
//! checkpoint of a sandbox that is removed under it.

use super::*;

#[test]
fn a_deep_tree_in_a_sandbox_cannot_crash_the_daemon() {
    let env = TestEnv::start();
    env.import_busybox();
    let id = create(&env, json!({"image": "busybox"}));
    // A checkpoint first: the lineage's head until the suspend below.
    sh(&env, &id, "echo first > /marker");
    let first = env.cli_ok(&["checkpoint", &id]).trim().to_string();
    // 4000 levels (8 KiB of path, twice PATH_MAX), made from inside in
    // steps: walkers that recurse or join host paths meet a depth their
    // stack or PATH_MAX cannot take.
    let v = sh(
        &env,
        &id,
        "set -e; p=$(printf 'd/%.0s' $(seq 500)); cd /tmp; for i in 1 2 3 4 5 6 7 8; do mkdir -p $p; cd -P $p; done; \
         echo bottom > f; echo ok",
    );
    assert_eq!(stdout(&v), "ok\n", "{v}");
    // A checkpoint and a diff are refused (409, saying why); the daemon
    // lives on and the sandbox keeps running.
    for (method, route) in [("POST", "checkpoint"), ("GET", "diff")] {
        let e = env.client().request(method, &format!("/v1/sandboxes/{id}/{route}"), None::<&()>).unwrap_err();
        let log = env.daemon_log();
        let tail: String = log.chars().rev().take(2000).collect::<Vec<_>>().into_iter().rev().collect();
        assert_eq!(e.status(), Some(409), "{route}: {e}\ndaemon log:\n{tail}");
        assert!(e.to_string().contains("directories deep"), "{route}: {e}");
    }
    assert_eq!(stdout(&sh(&env, &id, "echo alive")), "alive\n");
    // A suspend moves the tree without reading it; its blob can never be
    // written: the snapshot says why (not "sealing" forever), resumes, and
    // a push fails at once with the reason (before any registry is asked).
    let snap = env.cli_ok(&["suspend", &id]).trim().to_string();
    let start = std::time::Instant::now();
    let info = loop {
        let info: serde_json::Value = env.client().call("GET", &format!("/v1/snapshots/{snap}"), None::<&()>).unwrap();
        if info["sealing"] == false {
            break info;
        }
        assert!(start.elapsed().as_secs() < 60, "still sealing: {info}");
        std::thread::sleep(std::time::Duration::from_millis(100));
    };
    assert!(info["info"]["seal_error"].as_str().unwrap_or("").contains("directories deep"), "{info}");
    // It says so in its state, and it is not its lineage's head: the
    // checkpoint it replaced is again, and a resume of the work context
    // lands there.
    assert_eq!(info["state"], "failed", "{info}");
    let wc = info["work_context"].as_str().unwrap().to_string();
    let lineage: serde_json::Value = env.client().call("GET", &format!("/v1/lineages/{wc}"), None::<&()>).unwrap();
    assert_eq!(lineage["head"], first.as_str(), "{lineage}");
    let first_info: serde_json::Value =
        env.client().call("GET", &format!("/v1/snapshots/{first}"), None::<&()>).unwrap();
    assert_eq!(first_info["state"], "ready", "{first_info}");
    let w = env.cli_ok(&["resume", "--work-context", &wc]).trim().to_string();
    assert_eq!(stdout(&sh(&env, &w, "cat /marker; test -e /tmp/d && echo deep || echo shallow")), "first\nshallow\n");
    // By id it still resumes, as it was (once w leaves the lineage).
    env.cli_ok(&["rm", &w]);
    let r = env.cli_ok(&["resume", &snap]).trim().to_string();
    assert_eq!(stdout(&sh(&env, &r, "echo resumed")), "resumed\n");
    let e = env
        .client()
        .request(
            "POST",
            &format!("/v1/snapshots/{snap}/push"),
            Some(&json!({"reference": "127.0.0.1:9/never/contacted:t", "insecure": true})),
        )
        .unwrap_err();
    assert_eq!(e.status(), Some(409), "{e}");
    assert!(e.to_string().contains("never will"), "{e}");
    env.finish();
}

/// Make `depth` nested directories `d` under `top` by descriptor (far past
/// PATH_MAX), as a crashed daemon would leave a sandbox's tree in `tmp/`.
fn deep_tree_at(top: &std::path::Path, depth: usize) {
    use std::os::fd::{AsFd, OwnedFd};
    std::fs::create_dir_all(top).unwrap();
    let mut cur: OwnedFd = std::fs::File::open(top).unwrap().into();
    for _ in 0..depth {
        nix::sys::stat::mkdirat(
            Some(std::os::fd::AsRawFd::as_raw_fd(&cur)),
            "d",
            nix::sys::stat::Mode::from_bits_truncate(0o755),
        )
        .unwrap();
        cur = strata_shim::sys::openat(cur.as_fd(), c"d", libc::O_RDONLY | libc::O_DIRECTORY, 0).unwrap();
    }
}

#[test]
fn a_tree_40000_levels_deep_is_removed_and_the_daemon_restarts() {
    let mut env = TestEnv::start();
    env.import_busybox();
    // 40,000 levels from inside (80 steps of 500), the reproduction.
    let make = "set -e; p=$(printf 'd/%.0s' $(seq 500)); cd /tmp; for i in $(seq 80); do mkdir -p $p; cd -P $p; done; \
                echo bottom > f; echo ok";
    let a = create(&env, json!({"image": "busybox"}));
    let v = sh(&env, &a, make);
    assert_eq!(stdout(&v), "ok\n", "{v}");
    env.cli_ok(&["rm", &a]);
    assert_eq!(tmp_entries_settle(&env, &[], 120), Vec::<String>::new(), "the removed sandbox's tree is still in tmp/");
    assert!(env.daemon.as_mut().unwrap().try_wait().unwrap().is_none(), "daemon died:\n{}", env.daemon_log());

    // A sandbox with such a tree survives a daemon kill; the restart finds
    // another one left in tmp/ and an entry it cannot remove (immutable).
    let b = create(&env, json!({"image": "busybox"}));
    assert_eq!(stdout(&sh(&env, &b, make)), "ok\n");
    env.kill_daemon();
    deep_tree_at(&env.root.join("tmp/rm-left-by-a-crash"), 40_000);
    let stuck = env.root.join("tmp/stuck");
    std::fs::create_dir(&stuck).unwrap();
    std::fs::write(stuck.join("immutable"), "x").unwrap();
    let st = std::process::Command::new("chattr").arg("+i").arg(stuck.join("immutable")).status().unwrap();
    assert!(st.success(), "chattr +i failed");
    env.start_daemon();
    let left = tmp_entries_settle(&env, &["stuck"], 5);
    let unstick = || std::process::Command::new("chattr").arg("-i").arg(stuck.join("immutable")).status();
    if !left.is_empty() {
        let _ = unstick();
        panic!("the start-up sweep left {left:?}");
    }
    assert!(env.daemon_log().contains("sweep: could not remove"), "no log of the entry it could not remove");
    assert!(unstick().unwrap().success());
    assert_eq!(
        stdout(&sh(&env, &b, "test -d /tmp/d/d/d/d && echo kept")),
        "kept\n",
        "the adopted sandbox lost its tree"
    );
    env.cli_ok(&["rm", &b]);
    assert_eq!(tmp_entries_settle(&env, &["stuck"], 120), Vec::<String>::new());
    std::fs::remove_dir_all(&stuck).unwrap();
    // And it restarts once more with nothing to sweep.
    env.kill_daemon();
    env.start_daemon();
    env.finish();
}

#[test]
fn a_sparse_file_costs_the_daemon_its_data_not_its_size() {
    let env = TestEnv::start();
    env.import_busybox();
    let daemon = env.daemon.as_ref().unwrap().id();
    // 16 GiB claimed, 4 KiB of it data; under a 100 MiB disk cap (seals by
    // copy) and without one (seals by moving the upper, hashed after).
    let make =
        "truncate -s 16G /sparse && echo tail | dd of=/sparse bs=4096 seek=2097152 conv=notrunc 2>/dev/null && echo ok";
    let check = "ls -l /sparse | awk '{print $5}'; du -k /sparse | cut -f1; dd if=/sparse bs=4096 skip=2097152 count=1 2>/dev/null | head -c 4";
    for (disk, verb) in
        [(Some(100u64 << 20), "checkpoint"), (Some(100 << 20), "suspend"), (None, "checkpoint"), (None, "suspend")]
    {
        let mut body = json!({"image": "busybox"});
        if let Some(d) = disk {
            body["disk"] = json!(d);
        }
        let id = create(&env, body);
        assert_eq!(stdout(&sh(&env, &id, make)), "ok\n");
        let before = cpu_seconds(daemon);
        let snap = env.cli_ok(&[verb, &id]).trim().to_string();
        let info = sealed(&env, &snap);
        let used = cpu_seconds(daemon) - before;
        // Before: 61-106 s of daemon CPU for each (16 GiB of zeros read,
        // hashed, compressed, unpacked).
        assert!(used < 5.0, "{verb} (disk {disk:?}) took {used:.1} s of daemon CPU");
        assert!(info["blob_size"].as_u64().unwrap() < 1 << 20, "{verb} (disk {disk:?}): {info}");
        // (A checkpoint's sandbox still works in the lineage: a fork.)
        let resumed = env.cli_ok(&[if verb == "checkpoint" { "fork" } else { "resume" }, &snap]).trim().to_string();
        let got = stdout(&sh(&env, &resumed, check));
        let lines: Vec<&str> = got.lines().collect();
        assert_eq!(lines[0], "17179869184", "{verb} (disk {disk:?}): {got}");
        assert!(lines[1].parse::<u64>().unwrap() < 1024, "{verb} (disk {disk:?}): written out: {got}");
        assert_eq!(lines[2], "tail", "{verb} (disk {disk:?}): {got}");
        let layer = env.root.join("layers").join(info["layer"].as_str().unwrap()).join("fs/sparse");
        let m = std::fs::metadata(&layer).unwrap();
        assert!(std::os::unix::fs::MetadataExt::blocks(&m) < 2048, "{}: {m:?}", layer.display());
        env.cli_ok(&["rm", &resumed]);
        if verb == "checkpoint" {
            env.cli_ok(&["rm", &id]);
        }
    }
    env.finish();
}

#[test]
fn a_checkpoint_stops_when_its_sandbox_is_removed() {
    let env = TestEnv::start();
    env.import_busybox();
    let daemon = env.daemon.as_ref().unwrap().id();
    let id = create(&env, json!({"image": "busybox"}));
    // 2 GiB of data: seconds of copying, compressing and hashing.
    let v = sh(&env, &id, "dd if=/dev/zero of=/big bs=1M count=2048 2>/dev/null && echo ok");
    assert_eq!(stdout(&v), "ok\n", "{v}");
    std::thread::sleep(std::time::Duration::from_millis(1100)); // old enough to be pre-copied
    let socket = env.socket.clone();
    let sid = id.clone();
    let checkpoint = std::thread::spawn(move || {
        let mut client = strata::client::Client::connect(&socket).unwrap();
        let r = client.call::<serde_json::Value>("POST", &format!("/v1/sandboxes/{sid}/checkpoint"), Some(&json!({})));
        (r, std::time::Instant::now())
    });
    // The checkpoint has begun (its capture is listed) before the removal.
    strata_tests::wait_until("the checkpoint to begin", std::time::Duration::from_secs(10), || {
        let list: Vec<serde_json::Value> = env.client().call("GET", "/v1/snapshots", None::<&()>).unwrap();
        list.iter().any(|s| s["state"] == "capturing")
    });
    // Removal is refused (409) only while the sandbox is frozen.
    let start = std::time::Instant::now();
    loop {
        match env.client().request("DELETE", &format!("/v1/sandboxes/{id}"), None::<&()>) {
            Ok(_) => break,
            Err(strata::client::ClientError::Api { status: 409, .. }) if start.elapsed().as_secs() < 20 => {
                std::thread::sleep(std::time::Duration::from_millis(20))
            }
            Err(e) => panic!("rm: {e}"),
        }
    }
    let removed = std::time::Instant::now();
    let (r, ended) = checkpoint.join().unwrap();
    match r {
        Err(strata::client::ClientError::Api { status: 409, message, .. }) => {
            assert!(message.contains("removed"), "{message}")
        }
        other => panic!("the checkpoint of a removed sandbox went on: {other:?}"),
    }
    let late = ended.saturating_duration_since(removed);
    assert!(late.as_millis() < 1500, "the checkpoint ended {late:?} after the removal");
    // Nothing goes on, nothing is recorded, nothing is left.
    let before = cpu_seconds(daemon);
    std::thread::sleep(std::time::Duration::from_secs(1));
    let used = cpu_seconds(daemon) - before;
    assert!(used < 0.3, "the daemon used {used:.2} s of CPU after the checkpoint ended");
    let snaps: Vec<serde_json::Value> = env.client().call("GET", "/v1/snapshots", None::<&()>).unwrap();
    assert!(only_failed_captures(&snaps), "{snaps:?}");
    assert_eq!(tmp_entries_settle(&env, &[], 10), Vec::<String>::new());
    env.finish();
}
