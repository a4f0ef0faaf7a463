//! Deadlines and idle timeouts, idempotent calls, capacity and drains,
//! slots and removals, ready pools.

use super::*;

#[test]
fn deadlines_and_idle_timeouts_end_sandboxes_and_survive_a_restart() {
    let mut env = TestEnv::start();
    env.import_busybox();
    let none = None::<&()>;
    // Listing names no sandbox: it does not count as using one.
    let deadline = |v: &Value| v["lifetime"]["deadline_ms"].as_i64().unwrap();
    let make =
        |env: &TestEnv, body: Value| -> Value { env.client().call("POST", "/v1/sandboxes", Some(&body)).unwrap() };

    // Removed within 1 s of its deadline, not before.
    let a = make(&env, json!({"image": "busybox", "timeout": 2}));
    assert_eq!(a["lifetime"]["on_timeout"], "remove", "{a}");
    let at = gone_at(&env, a["id"].as_str().unwrap(), Duration::from_secs(10));
    assert!((0..=1000).contains(&(at - deadline(&a))), "removed {} ms after its deadline", at - deadline(&a));

    // Renewed: it outlives its first deadline, then goes at the new one.
    // Renewed 3 s before the old deadline (or at once, if the create was
    // that slow: the deadline runs from the create's start).
    let b = make(&env, json!({"image": "busybox", "timeout": 5}));
    let bid = b["id"].as_str().unwrap().to_string();
    std::thread::sleep(Duration::from_millis((deadline(&b) - 3000 - now_ms()).max(0) as u64));
    let renewed: Value =
        env.client().call("POST", &format!("/v1/sandboxes/{bid}/timeout"), Some(&json!({"timeout": 5}))).unwrap();
    assert!(deadline(&renewed) >= deadline(&b) + 1900, "{renewed}");
    std::thread::sleep(Duration::from_millis((deadline(&b) + 1000 - now_ms()).max(0) as u64));
    assert!(live(&env, &bid), "a renewed sandbox went at its old deadline");
    let at = gone_at(&env, &bid, Duration::from_secs(10));
    assert!((0..=1000).contains(&(at - deadline(&renewed))), "{}", at - deadline(&renewed));
    let bad = env.client().request("POST", "/v1/sandboxes", Some(&json!({"image": "busybox", "timeout": 0})));
    assert_eq!(status_of(bad), 400);
    // A renewal changes the lifetime only: the lineage position its
    // checkpoints moved stays, so the next checkpoint appends.
    let e = make(&env, json!({"image": "busybox", "timeout": 600, "work_context": "renewed"}));
    let eid = e["id"].as_str().unwrap().to_string();
    let checkpoint = format!("/v1/sandboxes/{eid}/checkpoint");
    let _: Value = env.client().call("POST", &checkpoint, Some(&json!({}))).unwrap();
    let _: Value =
        env.client().call("POST", &format!("/v1/sandboxes/{eid}/timeout"), Some(&json!({"timeout": 600}))).unwrap();
    let second: Result<Value, _> = env.client().call("POST", &checkpoint, Some(&json!({})));
    assert!(second.is_ok(), "a checkpoint after a renewal was refused: {second:?}");
    env.cli_ok(&["rm", &eid]);

    // Suspended into its lineage at its deadline; the lineage resumes it.
    let c = make(&env, json!({"image": "busybox", "timeout": 2, "on_timeout": "suspend", "work_context": "tc"}));
    let cid = c["id"].as_str().unwrap().to_string();
    sh(&env, &cid, "echo kept > /tmp/kept");
    let at = gone_at(&env, &cid, Duration::from_secs(15));
    assert!((0..=1000).contains(&(at - deadline(&c))), "{}", at - deadline(&c));
    let l: Value = env.client().call("GET", "/v1/lineages/tc", none).unwrap();
    assert!(l["head"].is_string(), "{l}");
    let r: Value = env.client().call("POST", "/v1/lineages/tc/resume", Some(&json!({}))).unwrap();
    assert_eq!(stdout(&sh(&env, r["id"].as_str().unwrap(), "cat /tmp/kept")), "kept\n");
    env.cli_ok(&["rm", r["id"].as_str().unwrap()]);

    // Across a restart: a deadline that passed while no daemon ran is kept
    // within 1 s of the daemon's start.
    let d = make(&env, json!({"image": "busybox", "timeout": 2}));
    env.stop_daemon();
    std::thread::sleep(Duration::from_millis((deadline(&d) + 500 - now_ms()).max(0) as u64));
    env.start_daemon();
    let started = now_ms();
    let at = gone_at(&env, d["id"].as_str().unwrap(), Duration::from_secs(10));
    assert!(at - started <= 1000, "removed {} ms after the restart", at - started);

    // Idle: not while an exec runs; suspended 2 s after the last use.
    let e = make(&env, json!({"image": "busybox", "idle_timeout": 2, "work_context": "idle"}));
    let eid = e["id"].as_str().unwrap().to_string();
    let v = sh(&env, &eid, "sleep 3; echo done");
    assert_eq!(stdout(&v), "done\n");
    let last_use = now_ms();
    assert!(live(&env, &eid), "suspended while an exec ran");
    let at = gone_at(&env, &eid, Duration::from_secs(10));
    assert!((2000..=3200).contains(&(at - last_use)), "suspended {} ms after its last use", at - last_use);
    let l: Value = env.client().call("GET", "/v1/lineages/idle", none).unwrap();
    assert!(l["head"].is_string(), "{l}");
    env.finish();
}

#[test]
fn an_idle_suspend_waits_for_a_call_in_progress() {
    let env = TestEnv::start_with_env(&[("STRATA_FAILPOINTS", "checkpoint:begun=sleep-once:7000")]);
    env.import_busybox();
    let id = create(&env, json!({"image": "busybox", "idle_timeout": 3, "work_context": "idle-call"}));
    sh(&env, &id, "echo x > /x");
    // The checkpoint waits 7 s at the failpoint, past the idle timeout:
    // no exec runs, but the sandbox is in use all along.
    let t0 = now_ms();
    let snap: Value = env.client().call("POST", &format!("/v1/sandboxes/{id}/checkpoint"), None::<&()>).unwrap();
    assert!(now_ms() - t0 >= 7000);
    assert_eq!(snap["state"], "ready", "{snap}");
    assert!(live(&env, &id), "suspended during the checkpoint");
    // Idle from its end: suspended then, into its lineage.
    gone_at(&env, &id, Duration::from_secs(10));
    let l: Value = env.client().call("GET", "/v1/lineages/idle-call", None::<&()>).unwrap();
    let cps = l["checkpoints"].as_array().unwrap();
    assert_eq!(cps.len(), 2, "{l}");
    assert_eq!(cps[0]["id"], snap["id"], "{l}");
    env.finish();
}

/// One HTTP/1.1 request with extra headers on a new connection (closed
/// after): the status and the body.
fn request_with(env: &TestEnv, method: &str, path: &str, headers: &[(&str, &str)], body: &Value) -> (u16, Value) {
    use std::io::{Read, Write};
    let body = body.to_string();
    let mut s = std::os::unix::net::UnixStream::connect(&env.socket).unwrap();
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: strata\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n", body.len());
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    s.write_all(format!("{head}\r\n{body}").as_bytes()).unwrap();
    let mut out = Vec::new();
    s.read_to_end(&mut out).unwrap();
    let text = String::from_utf8_lossy(&out).to_string();
    let status: u16 = text.split(' ').nth(1).unwrap().parse().unwrap();
    let json = text.split_once("\r\n\r\n").map(|(_, b)| b).unwrap_or("");
    (status, serde_json::from_str(json).unwrap_or(Value::Null))
}

#[test]
fn idempotent_calls_are_done_once_and_ids_can_be_chosen() {
    use std::io::Write;
    let mut env = TestEnv::start();
    env.import_busybox();
    let none = None::<&()>;
    let ps = |env: &TestEnv| -> Vec<Value> { env.client().call("GET", "/v1/sandboxes", none).unwrap() };
    let body = json!({"image": "busybox", "env": ["A=1"]});
    // The first create's client goes away before any answer.
    {
        let b = body.to_string();
        let mut s = std::os::unix::net::UnixStream::connect(&env.socket).unwrap();
        let req = format!(
            "POST /v1/sandboxes HTTP/1.1\r\nHost: strata\r\nIdempotency-Key: create-1\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{b}",
            b.len()
        );
        s.write_all(req.as_bytes()).unwrap();
    }
    // The retry gets the first create's answer: one sandbox.
    let (status, first) = request_with(&env, "POST", "/v1/sandboxes", &[("Idempotency-Key", "create-1")], &body);
    assert_eq!(status, 201, "{first}");
    let (status, again) = request_with(&env, "POST", "/v1/sandboxes", &[("Idempotency-Key", "create-1")], &body);
    assert_eq!((status, &again["id"]), (201, &first["id"]));
    let list = ps(&env);
    assert_eq!(list.len(), 1, "{list:?}");
    assert_eq!(list[0]["id"], first["id"]);
    // The same key with another body: 422, nothing made.
    let (status, err) =
        request_with(&env, "POST", "/v1/sandboxes", &[("Idempotency-Key", "create-1")], &json!({"image": "busybox"}));
    assert_eq!(status, 422, "{err}");
    assert_eq!(ps(&env).len(), 1);
    // A checkpoint retried: one snapshot.
    let id = first["id"].as_str().unwrap();
    let path = format!("/v1/sandboxes/{id}/checkpoint");
    let (s1, c1) = request_with(&env, "POST", &path, &[("Idempotency-Key", "ck-1")], &json!({}));
    let (s2, c2) = request_with(&env, "POST", &path, &[("Idempotency-Key", "ck-1")], &json!({}));
    assert_eq!((s1, s2, &c1["id"]), (201, 201, &c2["id"]));
    let snaps: Vec<Value> = env.client().call("GET", "/v1/snapshots", none).unwrap();
    assert_eq!(snaps.len(), 1, "{snaps:?}");
    // An error is an answer too (a 4xx is kept), and a bad key is refused.
    let (s, _) =
        request_with(&env, "POST", "/v1/sandboxes", &[("Idempotency-Key", "bad-1")], &json!({"image": "nope"}));
    assert_eq!(s, 404);
    let (s, _) = request_with(&env, "POST", "/v1/sandboxes", &[("Idempotency-Key", "a b")], &body);
    assert_eq!(s, 400);

    // A chosen id: used, then refused while taken.
    let chosen = "00000000000000aa";
    let made: Value =
        env.client().call("POST", "/v1/sandboxes", Some(&json!({"image": "busybox", "id": chosen}))).unwrap();
    assert_eq!(made["id"], chosen);
    let r = env.client().request("POST", "/v1/sandboxes", Some(&json!({"image": "busybox", "id": chosen})));
    assert_eq!(status_of(r), 409);
    let r = env.client().request("POST", "/v1/sandboxes", Some(&json!({"image": "busybox", "id": "ZZ"})));
    assert_eq!(status_of(r), 400);
    // An id whose exec log or snapshots outlive it stays taken.
    sh(&env, chosen, "true");
    env.cli_ok(&["rm", chosen]);
    let r = env.client().request("POST", "/v1/sandboxes", Some(&json!({"image": "busybox", "id": chosen})));
    assert_eq!(status_of(r), 409);
    // Keys hold across a restart.
    env.stop_daemon();
    env.start_daemon();
    let (status, after) = request_with(&env, "POST", "/v1/sandboxes", &[("Idempotency-Key", "create-1")], &body);
    assert_eq!((status, &after["id"]), (201, &first["id"]));
    assert_eq!(ps(&env).len(), 1);
    // A refusal of the moment is not kept: drained, then not.
    env.cli_ok(&["drain"]);
    let (s1, _) = request_with(&env, "POST", "/v1/sandboxes", &[("Idempotency-Key", "later-1")], &body);
    env.cli_ok(&["drain", "--off"]);
    let (s2, made) = request_with(&env, "POST", "/v1/sandboxes", &[("Idempotency-Key", "later-1")], &body);
    assert_eq!((s1, s2), (409, 201), "{made}");
    env.finish();
}

#[test]
fn a_host_tells_its_capacity_and_drains() {
    let mut env = TestEnv::start();
    env.import_busybox();
    let none = None::<&()>;
    let info = |env: &TestEnv| -> Value { env.client().call("GET", "/v1/info", none).unwrap() };
    let i0 = info(&env);
    assert_eq!((i0["state"].as_str(), i0["slots_used"].as_u64()), (Some("ready"), Some(0)), "{i0}");
    // Nothing allocated reads 0.0 (an empty float sum is -0.0).
    assert_eq!(i0["cpus_allocated"].to_string(), "0.0", "{i0}");
    let a = create(&env, json!({"image": "busybox", "memory": 64 << 20, "cpus": 0.5}));
    let b = create(&env, json!({"image": "busybox", "memory": 32 << 20, "cpus": 0.25}));
    let i = info(&env);
    let ps = env.cli_ok(&["ps"]);
    assert_eq!(i["slots_used"].as_u64().unwrap() as usize, ps.lines().count() - 1, "{i} vs {ps}");
    assert_eq!(i["slots_removing"], 0, "{i}");
    assert_eq!(i["memory_allocated"], 96u64 << 20, "{i}");
    assert!((i["cpus_allocated"].as_f64().unwrap() - 0.75).abs() < 1e-9, "{i}");
    assert!(i["memory_total"].as_u64().unwrap() > 0 && i["cpus_total"].as_u64().unwrap() > 0, "{i}");
    let mut layers: Vec<String> = std::fs::read_dir(env.root.join("layers"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    layers.sort();
    assert_eq!(i["layers"], json!(layers));
    assert_eq!(i["images"], json!(["busybox:latest"]));
    let vfs = nix::sys::statvfs::statvfs(&env.root).unwrap();
    let free = vfs.blocks_available() * vfs.fragment_size();
    let reported = i["store_free_bytes"].as_u64().unwrap();
    assert!(reported.abs_diff(free) < 64 << 20, "free {reported} vs {free}");

    // Draining: new sandboxes refused with the reason; running ones go on.
    let out = env.cli_ok(&["drain", "--reason", "kernel upgrade"]);
    assert_eq!(out.trim(), "draining");
    let r = env.client().request("POST", "/v1/sandboxes", Some(&json!({"image": "busybox"})));
    match r {
        Err(ClientError::Api { status: 409, message, .. }) => assert!(message.contains("kernel upgrade"), "{message}"),
        other => panic!("a draining host started a sandbox: {other:?}"),
    }
    assert_eq!(stdout(&sh(&env, &a, "echo still")), "still\n");
    let snap = env.cli_ok(&["checkpoint", &a]).trim().to_string();
    assert_eq!(status_of(env.client().request("POST", &format!("/v1/snapshots/{snap}/fork"), Some(&json!({})))), 409);
    assert_eq!(info(&env)["state"], "draining");
    env.cli_ok(&["rm", &b]);
    // The drain is kept in the catalog's host row: a restart keeps it.
    env.stop_daemon();
    env.start_daemon();
    assert_eq!(
        (info(&env)["state"].as_str(), info(&env)["draining_reason"].as_str()),
        (Some("draining"), Some("kernel upgrade"))
    );
    // The one host of its catalog, under its hostname, listed with the
    // sandbox the catalog places on it.
    let hosts: Vec<Value> = env.client().call("GET", "/v1/hosts", none).unwrap();
    assert_eq!(hosts.len(), 1, "{hosts:?}");
    assert_eq!(hosts[0]["id"], info(&env)["host_id"]);
    assert_eq!(hosts[0]["id"].as_str().unwrap(), nix::unistd::gethostname().unwrap().to_str().unwrap());
    assert_eq!((hosts[0]["state"].as_str(), hosts[0]["reason"].as_str()), (Some("draining"), Some("kernel upgrade")));
    assert_eq!(hosts[0]["sandboxes"], json!([a]));
    let table = env.cli_ok(&["hosts"]);
    assert!(table.lines().nth(1).is_some_and(|l| l.contains("draining") && l.contains("kernel upgrade")), "{table}");
    assert_eq!(env.cli_ok(&["drain", "--off"]).trim(), "ready");
    let c = create(&env, json!({"image": "busybox"}));
    for id in [&a, &c] {
        env.cli_ok(&["rm", id]);
    }
    env.finish();
}

#[test]
fn waiting_creates_get_slots_in_order_of_arrival() {
    let env = TestEnv::start_with(&["--max-sandboxes", "4"]);
    env.import_busybox();
    let t0 = Instant::now();
    let threads: Vec<_> = (0..20)
        .map(|i| {
            let socket = env.socket.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(100 * i));
                let mut c = Client::connect(&socket).unwrap();
                let made: Value =
                    c.call("POST", "/v1/sandboxes", Some(&json!({"image": "busybox", "wait": 30}))).unwrap();
                let got = t0.elapsed();
                std::thread::sleep(Duration::from_millis(1000));
                let id = made["id"].as_str().unwrap().to_string();
                let released = t0.elapsed();
                c.request("DELETE", &format!("/v1/sandboxes/{id}"), None::<&()>).unwrap();
                (got, released)
            })
        })
        .collect();
    let held: Vec<(Duration, Duration)> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    for w in held.windows(2) {
        assert!(w[0].0 <= w[1].0, "a later arrival got its slot first: {held:?}");
    }
    for (i, (got, _)) in held.iter().enumerate() {
        let at_once = held.iter().filter(|(g, r)| g <= got && got < r).count();
        assert!(at_once <= 4, "{at_once} sandboxes at once when {i} got its slot: {held:?}");
    }
    // Without wait, a full host answers 429 at once.
    let ids: Vec<String> = (0..4).map(|_| create(&env, json!({"image": "busybox"}))).collect();
    assert_eq!(status_of(env.client().request("POST", "/v1/sandboxes", Some(&json!({"image": "busybox"})))), 429);
    for id in &ids {
        env.cli_ok(&["rm", id]);
    }
    env.finish();
}

#[test]
fn a_removal_answers_once_killed_and_its_teardown_keeps_the_slot() {
    // Every teardown is held back 1.5 s, so what happens before it shows.
    let env = TestEnv::start_with_flags_and_env(
        &["--max-sandboxes", "1"],
        &[("STRATA_FAILPOINTS", "teardown:start=sleep-once:1500")],
    );
    env.import_busybox();
    let none = None::<&()>;
    let a = create(&env, json!({"image": "busybox"}));
    let info: Value = env.client().call("GET", &format!("/v1/sandboxes/{a}"), none).unwrap();
    let shim = info["shim_pid"].as_i64().unwrap() as i32;
    sh(&env, &a, "sleep 1000 >/dev/null 2>&1 &");
    // The host pid of the sandbox's `sleep`: the one in its cgroup but the shim.
    let procs = cgroup_file(&env, &a, "cgroup.procs");
    let others: Vec<i32> = procs.lines().filter_map(|l| l.parse().ok()).filter(|p| *p != shim).collect();
    assert_eq!(others.len(), 1, "{procs}");
    let child = others[0];
    let asked = Instant::now();
    env.client().request("DELETE", &format!("/v1/sandboxes/{a}"), none).unwrap();
    assert!(asked.elapsed() < Duration::from_millis(1000), "the removal waited for its teardown");
    // Gone from the API at once; killed, with every process of it, before
    // its teardown starts.
    assert_eq!(status_of(env.client().request("GET", &format!("/v1/sandboxes/{a}"), none)), 404);
    assert!(!env.cli_ok(&["ps"]).contains(&a));
    wait_until("removed sandbox still running", Duration::from_millis(1000), || !alive(shim) && !alive(child));
    // Its teardown still holds the slot and its files.
    let info: Value = env.client().call("GET", "/v1/info", none).unwrap();
    assert_eq!((info["slots_used"].as_u64(), info["slots_removing"].as_u64()), (Some(1), Some(1)), "{info}");
    assert!(env.root.join("sandboxes").join(&a).exists());
    // A create finding that slot taken waits for it instead of a 429.
    let b = create(&env, json!({"image": "busybox"}));
    assert!(asked.elapsed() >= Duration::from_millis(1400), "created before the teardown ended");
    assert!(!env.root.join("sandboxes").join(&a).exists());
    assert!(env.cgroup_dirs().iter().all(|d| !d.join(&a).exists()));
    // `strata rm` (`?wait=true`) returns with everything gone.
    env.cli_ok(&["rm", &b]);
    assert!(!env.root.join("sandboxes").join(&b).exists());
    assert!(env.cgroup_dirs().iter().all(|d| !d.join(&b).exists()));
    env.finish();
}

/// A teardown that fails keeps the slot and files of its sandbox, does not
/// hold up the removals queued after it, and is tried again until done.
#[test]
fn a_failed_teardown_keeps_its_slot_and_is_retried() {
    // The first teardown fails; its retry comes no sooner than 4 s later
    // (a 1 s backoff, then 3 s held at a failpoint).
    let env = TestEnv::start_with_flags_and_env(
        &["--max-sandboxes", "2"],
        &[("STRATA_FAILPOINTS", "teardown:destroy=fail-once,teardown:retry=sleep-once:3000")],
    );
    env.import_busybox();
    let none = None::<&()>;
    let info = || -> Value { env.client().call("GET", "/v1/info", none).unwrap() };
    let gone = |id: &str| {
        !env.root.join("sandboxes").join(id).exists() && env.cgroup_dirs().iter().all(|d| !d.join(id).exists())
    };
    let a = create(&env, json!({"image": "busybox"}));
    let b = create(&env, json!({"image": "busybox"}));
    env.client().request("DELETE", &format!("/v1/sandboxes/{a}"), none).unwrap();
    env.wait_logged("failpoint teardown:destroy failing", Duration::from_secs(5));
    // Failed: its slot and files stay, and the host says a removal holds one.
    let i = info();
    assert_eq!((i["slots_used"].as_u64(), i["slots_removing"].as_u64()), (Some(2), Some(1)), "{i}");
    assert!(!gone(&a));
    // The next removal is not queued behind the retry: it is done while
    // the failed one is still there.
    env.client().request("DELETE", &format!("/v1/sandboxes/{b}"), none).unwrap();
    wait_until("the second teardown waited", Duration::from_secs(3), || gone(&b) && info()["slots_used"] == 1);
    assert!(!gone(&a), "a's retry came before b's teardown");
    // The retry finishes it.
    wait_until("the failed teardown was never retried", Duration::from_secs(15), || {
        gone(&a) && info()["slots_used"] == 0
    });
    assert!(env.daemon_log().contains("failpoint teardown:retry reached"));
    env.finish();
}

/// A removal that waits (`strata rm`) and fails leaves the sandbox as it
/// was, its row included: no heartbeat finishes it behind the caller's
/// back (a row left stopped is a removal another host asked for).
#[test]
fn a_failed_removal_that_waits_leaves_the_sandbox_running() {
    let env =
        TestEnv::start_with_flags_and_env(&["--heartbeat", "1s"], &[("STRATA_FAILPOINTS", "rm:destroy=fail-once")]);
    env.import_busybox();
    let id = create(&env, json!({"image": "busybox"}));
    let r = env.client().request("DELETE", &format!("/v1/sandboxes/{id}?wait=true"), None::<&()>);
    assert!(matches!(&r, Err(ClientError::Api { message, .. }) if message.contains("failpoint rm:destroy")), "{r:?}");
    // Past two heartbeats it still runs, and its row says so.
    std::thread::sleep(Duration::from_millis(2500));
    assert_eq!(stdout(&sh(&env, &id, "echo still")), "still\n");
    let rows = env.catalog().list_sandboxes().unwrap();
    let states: Vec<_> = rows.iter().map(|r| (r.id.to_string(), r.state)).collect();
    assert_eq!(states, [(id.clone(), strata::catalog::SandboxState::Running)]);
    assert!(!env.daemon_log().contains("another host removed it"), "{}", env.daemon_log());
    env.cli_ok(&["rm", &id]);
    env.finish();
}

#[test]
fn ready_pools_serve_the_creates_that_fit_and_refill() {
    let env = TestEnv::start_with(&["--pool", "busybox=2", "--warm-pool", "0"]);
    env.import_busybox();
    let none = None::<&()>;
    let ready = || -> u64 {
        let i: Value = env.client().call("GET", "/v1/info", none).unwrap();
        i["ready"]["busybox:latest"].as_u64().unwrap_or(0)
    };
    let wait_ready = |n: u64| wait_until(&format!("the pool never held {n}"), Duration::from_secs(30), || ready() >= n);
    wait_ready(2);
    let pooled = |id: &str| env.daemon_log().contains(&format!("sandbox {id}: from the ready pool"));
    // A create that fits takes a ready sandbox, with its own limits and env.
    let a: Value = env
        .client()
        .call(
            "POST",
            "/v1/sandboxes",
            Some(&json!({"image": "busybox", "memory": 96 << 20, "env": ["K=v"], "work_context": "pooled"})),
        )
        .unwrap();
    let aid = a["id"].as_str().unwrap().to_string();
    assert!(pooled(&aid), "{a}");
    assert_eq!((a["limits"]["memory"].as_u64(), a["work_context"].as_str()), (Some(96 << 20), Some("pooled")), "{a}");
    assert_eq!(stdout(&sh(&env, &aid, "echo $K; hostname")), format!("v\n{}\n", &aid[..12]));
    let cg = a["cgroup"].as_str().unwrap();
    let limit = std::fs::read_to_string(format!("/sys/fs/cgroup/memory/{cg}/memory.limit_in_bytes"))
        .or_else(|_| std::fs::read_to_string(format!("/sys/fs/cgroup/{cg}/memory.max")))
        .unwrap();
    assert_eq!(limit.trim(), (96u64 << 20).to_string());
    // Its lineage and checkpoints work as for any create.
    let snap = env.cli_ok(&["checkpoint", &aid]).trim().to_string();
    let l: Value = env.client().call("GET", "/v1/lineages/pooled", none).unwrap();
    assert_eq!(l["head"], snap.as_str());
    // One that does not fit (a hostname) starts fresh: same result.
    let b: Value =
        env.client().call("POST", "/v1/sandboxes", Some(&json!({"image": "busybox", "hostname": "own"}))).unwrap();
    let bid = b["id"].as_str().unwrap().to_string();
    assert!(!pooled(&bid));
    assert_eq!(stdout(&sh(&env, &bid, "hostname")), "own\n");
    // The pool refills.
    wait_ready(2);
    for id in [&aid, &bid] {
        env.cli_ok(&["rm", id]);
    }
    // Stopping the daemon removes the ready sandboxes (finish checks that
    // nothing is left).
    env.finish();
}

#[test]
fn a_ready_sandbox_whose_image_is_removed_as_it_starts_is_not_kept() {
    let env = TestEnv::start_with_flags_and_env(
        &["--pool", "busybox=1", "--warm-pool", "0"],
        &[("STRATA_FAILPOINTS", "ready:started=sleep-once:6000")],
    );
    env.import_busybox();
    let ready = || -> u64 {
        let i: Value = env.client().call("GET", "/v1/info", None::<&()>).unwrap();
        i["ready"]["busybox:latest"].as_u64().unwrap_or(0)
    };
    // The refill has started a sandbox and waits before adding it to the
    // pool: the image goes meanwhile.
    let log_has = |s: &str| env.daemon_log().contains(s);
    wait_until("the refill started", Duration::from_secs(30), || log_has("failpoint ready:started reached"));
    env.cli_ok(&["image", "rm", "busybox:latest"]);
    wait_until("the refill saw the image go", Duration::from_secs(20), || {
        log_has("ready pool busybox:latest: the image was removed as a sandbox started for it; not kept")
    });
    assert_eq!(ready(), 0);
    // Imported again (the same layers, unpacked anew): the pool refills
    // and what it serves has its whole root.
    env.import_busybox();
    wait_until("the pool refilled", Duration::from_secs(30), || ready() >= 1);
    let id = create(&env, json!({"image": "busybox"}));
    assert!(env.daemon_log().contains(&format!("sandbox {id}: from the ready pool")));
    assert_eq!(stdout(&sh(&env, &id, "ls /bin/busybox && busybox true && echo ok")), "/bin/busybox\nok\n");
    env.cli_ok(&["rm", &id]);
    env.finish();
}
