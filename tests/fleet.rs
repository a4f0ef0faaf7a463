//! Hosts of a fleet sharing one catalog (the suite's own PostgreSQL,
//! whatever `STRATA_TEST_DATABASE` says): each registers and heartbeats,
//! sees the others, adopts only its own sandboxes, can be drained from
//! another host, and is marked down (its sandboxes reported lost) when its
//! heartbeats stop. With a fleet registry (the suite's loopback
//! `docker-registry`), a snapshot made on one host resumes or forks on
//! another, which brings the layers it lacks itself.

use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::{json, Value};
use strata_tests::{create, pg, registry, sh, stdout, strata_bin, wait_for, wait_until, ClientError, TestEnv};

/// Heartbeat every second; down after three without one.
const BEAT: [&str; 4] = ["--heartbeat", "1s", "--host-deadline", "3s"];

fn hosts(env: &TestEnv) -> Vec<Value> {
    env.client().call("GET", "/v1/hosts", None::<&()>).expect("GET /v1/hosts")
}

fn host(env: &TestEnv, id: &str) -> Value {
    env.client().call("GET", &format!("/v1/hosts/{id}"), None::<&()>).expect("GET /v1/hosts/ID")
}

/// Wait (at most 10 s) until `by` sees host `id` marked down; its row.
fn marked_down(by: &TestEnv, id: &str) -> Value {
    wait_for(
        &format!("{id} marked down"),
        Duration::from_secs(10),
        || {
            let h = host(by, id);
            (h["state"] == "down").then_some(h)
        },
        || host(by, id),
    )
}

fn sandboxes(env: &TestEnv) -> Vec<String> {
    let list: Vec<Value> = env.client().call("GET", "/v1/sandboxes", None::<&()>).unwrap();
    list.iter().map(|s| s["id"].as_str().unwrap().to_string()).collect()
}

#[test]
fn hosts_of_one_catalog_see_each_other_and_keep_to_their_own_sandboxes() {
    strata_tests::require_root();
    let url = pg::database();
    let mut a = TestEnv::start_in_fleet(&url, "host-a", &BEAT);
    let mut b = TestEnv::start_in_fleet(&url, "host-b", &BEAT);

    // Both registered, ready, with the capacity of their last heartbeat.
    let both = wait_for(
        "both hosts listed with their capacity",
        Duration::from_secs(5),
        || {
            let h = hosts(&b);
            (h.len() == 2 && h.iter().all(|h| h["capacity"].is_object())).then(|| Value::from(h))
        },
        || Value::from(hosts(&b)),
    );
    let ids: Vec<&str> = both.as_array().unwrap().iter().map(|h| h["id"].as_str().unwrap()).collect();
    assert_eq!(ids, ["host-a", "host-b"]);
    for h in both.as_array().unwrap() {
        assert_eq!(h["state"], "ready", "{h:#}");
        assert_eq!(h["capacity"]["host_id"], h["id"], "{h:#}");
        assert!(h["deadline_at_ms"].as_i64() > h["heartbeat_at_ms"].as_i64(), "{h:#}");
    }
    let info: Value = a.client().call("GET", "/v1/info", None::<&()>).unwrap();
    assert_eq!(info["host_id"], "host-a");

    // A sandbox on A is A's: B does not list it, the catalog places it on A.
    a.import_busybox();
    let sb = create(&a, serde_json::json!({"image": "busybox:latest"}));
    assert_eq!(sandboxes(&a), std::slice::from_ref(&sb));
    assert!(sandboxes(&b).is_empty());
    assert_eq!(host(&b, "host-a")["sandboxes"], serde_json::json!([sb]));
    assert_eq!(host(&b, "host-b")["sandboxes"], serde_json::json!([]));
    // Asked of B, a call about it is a 409 naming A, not a 404; an id no
    // host runs is still a 404.
    let refused_by = |env: &TestEnv, method: &str, path: &str, body: Option<Value>| -> String {
        match env.client().request(method, path, body.as_ref()) {
            Err(ClientError::Api { status: 409, message, .. }) => message,
            other => panic!("{method} {path}: {other:?}"),
        }
    };
    for (method, path, body) in [
        ("GET", format!("/v1/sandboxes/{sb}"), None),
        ("POST", format!("/v1/sandboxes/{sb}/exec"), Some(json!({"argv": ["true"]}))),
        ("POST", format!("/v1/sandboxes/{sb}/checkpoint"), Some(json!({}))),
        ("DELETE", format!("/v1/sandboxes/{sb}"), None),
    ] {
        let message = refused_by(&b, method, &path, body);
        assert_eq!(message, format!("sandbox {sb} runs on host host-a; ask that host"), "{method} {path}");
    }
    match b.client().request("GET", "/v1/sandboxes/0123456789abcdef", None::<&Value>) {
        Err(ClientError::Api { status: 404, .. }) => {}
        other => panic!("an unknown sandbox: {other:?}"),
    }

    // Without a fleet registry a snapshot can only be local: refused
    // before anything is captured.
    let r =
        a.client().request("POST", &format!("/v1/sandboxes/{sb}/checkpoint"), Some(&json!({"type": "distributed"})));
    match r {
        Err(ClientError::Api { status: 409, message, .. }) => {
            assert!(message.contains("no fleet registry"), "{message}")
        }
        other => panic!("a distributed checkpoint without a registry: {other:?}"),
    }
    assert_eq!(a.cli_ok(&["snapshot", "ls"]).lines().count(), 1, "a refused checkpoint left a snapshot");

    // B restarting adopts (or reaps) only its own: A's sandbox lives on.
    b.stop_daemon();
    assert_eq!(host(&a, "host-b")["state"], "down");
    assert_eq!(host(&a, "host-b")["reason"], "stopped");
    b.start_daemon();
    assert_eq!(host(&b, "host-b")["state"], "ready");
    assert_eq!(sandboxes(&a), std::slice::from_ref(&sb));
    assert_eq!(stdout(&sh(&a, &sb, "echo alive")), "alive\n");
    assert_eq!(host(&b, "host-a")["sandboxes"], serde_json::json!([sb]));

    // Drained through A, B stops taking work at its next heartbeat; and
    // takes it again once the drain ends.
    assert_eq!(a.cli_ok(&["drain", "host-b", "--reason", "kernel upgrade"]).trim(), "draining");
    wait_for(
        "host-b draining",
        Duration::from_secs(3),
        || {
            let i: Value = b.client().call("GET", "/v1/info", None::<&()>).unwrap();
            (i["state"] == "draining" && i["draining_reason"] == "kernel upgrade").then_some(i)
        },
        || -> Value { b.client().call("GET", "/v1/info", None::<&()>).unwrap() },
    );
    assert_eq!(a.cli_ok(&["drain", "host-b", "--off"]).trim(), "ready");
    wait_for(
        "host-b ready again",
        Duration::from_secs(3),
        || {
            let i: Value = b.client().call("GET", "/v1/info", None::<&()>).unwrap();
            (i["state"] == "ready").then_some(i)
        },
        || -> Value { b.client().call("GET", "/v1/info", None::<&()>).unwrap() },
    );
    let out = a.cli(&["drain", "host-z"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("no host \"host-z\""), "{out:?}");

    // A second daemon cannot take a live host's id.
    let c = tempfile::Builder::new().prefix("strata-test-").tempdir().unwrap();
    let out = Command::new(strata_bin())
        .arg("--socket")
        .arg(c.path().join("api.sock"))
        .args(["daemon", "--root"])
        .arg(c.path().join("root"))
        .args(["--cgroup-parent", &format!("strata-test-{}-c", std::process::id())])
        .args(["--database", &url, "--host-id", "host-a"])
        .stdin(Stdio::null())
        .output()
        .expect("run a third daemon");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("host id \"host-a\" is held by a live daemon"), "{err}");

    // A killed host is marked down past its deadline; its sandboxes are
    // reported lost by the host that noticed.
    let gone = create(&a, json!({"image": "busybox:latest"}));
    a.kill_daemon();
    let down = marked_down(&b, "host-a");
    assert!(down["reason"].as_str().unwrap().starts_with("no heartbeat for"), "{down:#}");
    assert_eq!(down["sandboxes"], serde_json::json!([sb, gone]));
    // B logs it after its mark commits (the row may be seen first).
    wait_for(
        "host-a's loss logged",
        Duration::from_secs(5),
        || {
            let log = b.daemon_log();
            (log.contains("host host-a is down") && log.contains(&sb)).then_some(())
        },
        || b.daemon_log(),
    );
    let message = refused_by(&b, "GET", &format!("/v1/sandboxes/{sb}"), None);
    assert!(
        message.starts_with(&format!("sandbox {sb} runs on host host-a, which is down (no heartbeat")),
        "{message}"
    );
    // Removed through B meanwhile: accepted (202), gone to the fleet at
    // once, and removed by A when it is back.
    let r = b.client().raw("DELETE", &format!("/v1/sandboxes/{gone}?wait=true"), b"", &[]).unwrap();
    let deferred: Value = serde_json::from_slice(&r.body).unwrap();
    assert_eq!((r.status, &deferred["id"], &deferred["host"]), (202, &json!(gone), &json!("host-a")), "{deferred}");
    assert!(deferred["host_down"].as_str().unwrap().starts_with("no heartbeat"), "{deferred}");
    match b.client().request("GET", &format!("/v1/sandboxes/{gone}"), None::<&Value>) {
        Err(ClientError::Api { status: 404, .. }) => {}
        other => panic!("a sandbox removed while its host was down: {other:?}"),
    }
    let out = b.cli(&["rm", &gone]);
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("not found"), "{out:?}");
    assert!(!strata_tests::processes_matching(&gone).is_empty(), "it runs on while its host is down");

    // Back, it is ready and its sandbox is adopted again; the removed one is gone.
    a.start_daemon();
    assert_eq!(host(&b, "host-a")["state"], "ready");
    assert_eq!(sandboxes(&a), std::slice::from_ref(&sb));
    assert_eq!(strata_tests::processes_matching(&gone), vec![], "its shim and processes are gone");
    assert_eq!(stdout(&sh(&a, &sb, "echo back")), "back\n");

    a.finish();
    assert_eq!(host(&b, "host-a")["reason"], "stopped");
    b.finish();
}

fn post(env: &TestEnv, path: &str, body: Value) -> Value {
    env.client().call("POST", path, Some(&body)).unwrap_or_else(|e| panic!("POST {path}: {e}\n{}", env.daemon_log()))
}

/// Files in a host's layer store.
fn layers_on(env: &TestEnv) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(env.root.join("layers"))
        .map(|rd| rd.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default();
    v.sort();
    v
}

#[test]
fn snapshots_resolve_from_any_host_through_the_fleet_registry() {
    strata_tests::require_root();
    let url = pg::database();
    let reg = registry::Registry::start();
    let fleet = format!("{}/fleet", reg.addr());
    let extra = ["--registry", &fleet, "--insecure-registry", BEAT[0], BEAT[1], BEAT[2], BEAT[3]];
    let mut a = TestEnv::start_in_fleet(&url, "host-a", &extra);
    let b = TestEnv::start_in_fleet(&url, "host-b", &extra);
    let c = TestEnv::start_in_fleet(&url, "host-c", &extra);
    // Only A has the image's files; the catalog (its rows) is everyone's.
    a.import_busybox();

    // A: work context wc-1, write, suspend: distributed (a fleet registry).
    let sa = create(&a, json!({"image": "busybox", "work_context": "wc-1"}));
    sh(&a, &sa, "echo from-a > /root/a.txt");
    let susp = post(&a, &format!("/v1/sandboxes/{sa}/suspend"), json!({}));
    assert_eq!((susp["type"].as_str(), susp["host"].as_str()), (Some("distributed"), Some("host-a")), "{susp:#}");
    assert_eq!(susp["registry"].as_str().unwrap(), format!("{fleet}:{}", susp["id"].as_str().unwrap()));

    // B resumes wc-1 and has A's files, brought by itself from the registry.
    assert!(layers_on(&b).is_empty());
    let rb = post(&b, "/v1/lineages/wc-1/resume", json!({}));
    let sb = rb["id"].as_str().unwrap().to_string();
    assert_eq!(stdout(&sh(&b, &sb, "cat /root/a.txt")), "from-a\n");
    assert!(b.daemon_log().contains(&format!("of snapshot {} from {fleet}", susp["id"].as_str().unwrap())));
    assert!(!layers_on(&b).is_empty());

    // B's next checkpoint, distributed: C forks it and sees both hosts' files.
    sh(&b, &sb, "echo from-b > /root/b.txt");
    let cp = post(&b, &format!("/v1/sandboxes/{sb}/checkpoint"), json!({"type": "distributed"}));
    assert_eq!((cp["type"].as_str(), cp["host"].as_str()), (Some("distributed"), Some("host-b")), "{cp:#}");
    assert_eq!(cp["parent"], susp["id"]);
    let forks = post(&c, &format!("/v1/snapshots/{}/fork", cp["id"].as_str().unwrap()), json!({}));
    let fc = forks[0]["id"].as_str().unwrap().to_string();
    assert_eq!(stdout(&sh(&c, &fc, "cat /root/a.txt /root/b.txt")), "from-a\nfrom-b\n");

    // Its availability: the hosts holding its layers (as their heartbeats
    // say), besides where it was made and where it is published.
    let susp_id = susp["id"].as_str().unwrap().to_string();
    wait_for(
        "A's suspend held by hosts a, b and c",
        Duration::from_secs(6),
        || {
            let v: Value = a.client().call("GET", &format!("/v1/snapshots/{susp_id}"), None::<&()>).unwrap();
            (v["hosts"] == json!(["host-a", "host-b", "host-c"])).then_some(v)
        },
        || -> Value { a.client().call("GET", &format!("/v1/snapshots/{susp_id}"), None::<&()>).unwrap() },
    );

    // Published in the background: answered at once, `publishing` until
    // done, then any host restores it. async needs a distributed snapshot.
    let r = b.client().request(
        "POST",
        &format!("/v1/sandboxes/{sb}/checkpoint"),
        Some(&json!({"type": "local", "async": true})),
    );
    assert!(matches!(r, Err(ClientError::Api { status: 400, .. })), "{r:?}");
    sh(&b, &sb, "echo later > /root/c.txt");
    let bg = post(&b, &format!("/v1/sandboxes/{sb}/checkpoint"), json!({"type": "distributed", "async": true}));
    let bg_id = bg["id"].as_str().unwrap().to_string();
    assert!(bg["publishing"] == true || bg["registry"].is_string(), "{bg:#}");
    wait_for(
        "the async publication done",
        Duration::from_secs(10),
        || {
            let v: Value = b.client().call("GET", &format!("/v1/snapshots/{bg_id}"), None::<&()>).unwrap();
            (v["publishing"] == false && v["type"] == "distributed").then_some(v)
        },
        || -> Value { b.client().call("GET", &format!("/v1/snapshots/{bg_id}"), None::<&()>).unwrap() },
    );
    let forks = post(&c, &format!("/v1/snapshots/{bg_id}/fork"), json!({}));
    let fbg = forks[0]["id"].as_str().unwrap().to_string();
    assert_eq!(stdout(&sh(&c, &fbg, "cat /root/c.txt")), "later\n");

    // A local snapshot of a stopped host: resuming it elsewhere fails,
    // naming it, its missing layers and where it looked; nothing stays. A
    // snapshot promoted before the stop resumes anywhere.
    let s2 = create(&a, json!({"image": "busybox"}));
    sh(&a, &s2, "echo one > /root/t");
    let local = post(&a, &format!("/v1/sandboxes/{s2}/checkpoint"), json!({}));
    assert_eq!(local["type"], "local");
    assert!(local.get("registry").is_none(), "{local:#}");
    sh(&a, &s2, "echo two > /root/t");
    let later = post(&a, &format!("/v1/sandboxes/{s2}/checkpoint"), json!({}));
    let later_id = later["id"].as_str().unwrap().to_string();
    let published = a.cli_ok(&["snapshot", "promote", &later_id]);
    assert_eq!(published.trim(), format!("{fleet}:{later_id}"));
    a.stop_daemon();
    let local_id = local["id"].as_str().unwrap();
    let before = layers_on(&b);
    let r = b.client().request("POST", &format!("/v1/snapshots/{local_id}/resume"), Some(&json!({})));
    match r {
        Err(ClientError::Api { status: 409, message, .. }) => {
            for needle in
                [local_id, local["layer"].as_str().unwrap(), "host host-a", "down: stopped", "not published", "promote"]
            {
                assert!(message.contains(needle), "{needle:?} not in: {message}");
            }
        }
        other => panic!("a local snapshot of a stopped host resumed elsewhere: {other:?}"),
    }
    assert_eq!(layers_on(&b), before, "a failed resolution left layers");
    assert!(std::fs::read_dir(b.root.join("tmp")).map(|d| d.count()).unwrap_or(0) == 0, "tmp not empty");
    let rl = post(&b, &format!("/v1/snapshots/{later_id}/resume"), json!({}));
    let sl = rl["id"].as_str().unwrap().to_string();
    assert_eq!(stdout(&sh(&b, &sl, "cat /root/t")), "two\n");

    // A snapshot a sandbox of another host started from cannot be removed
    // here, even with its lineage retired (this host has no user of it).
    let wc2 = later["work_context"].as_str().unwrap();
    post(&c, &format!("/v1/lineages/{wc2}/retire"), json!({}));
    let r = c.client().request("DELETE", &format!("/v1/snapshots/{later_id}"), None::<&()>);
    match r {
        Err(ClientError::Api { status: 409, message, .. }) => {
            assert!(message.contains(&format!("sandbox {sl} on host host-b")), "{message}")
        }
        other => panic!("a snapshot another host's sandbox uses was removed: {other:?}"),
    }
    // Once nothing uses it, its removal deletes its manifest from the
    // fleet registry too (its blobs are the registry's to collect).
    let registry = strata::registry::Client::new(&reg.addr(), true, None);
    assert!(registry.get_manifest("fleet", &later_id).is_ok());
    b.client().request("DELETE", &format!("/v1/sandboxes/{sl}?wait=true"), None::<&()>).unwrap();
    c.client().request("DELETE", &format!("/v1/snapshots/{later_id}"), None::<&()>).unwrap();
    wait_for(
        "the removed snapshot's manifest deleted",
        Duration::from_secs(5),
        || {
            let m = registry.get_manifest("fleet", &later_id);
            matches!(m, Err(strata::registry::RegistryError::NotFound { .. })).then_some(())
        },
        || format!("{:?}", registry.get_manifest("fleet", &later_id).map(|(_, _, digest)| digest)),
    );
    // The host logs it once the registry has answered (after the 404 above, maybe).
    let deleted = format!("snapshot {later_id} removed; its manifest {fleet}:{later_id} deleted");
    c.wait_logged(&deleted, Duration::from_secs(5));

    // A delete the registry misses (it is down) stays queued in the
    // catalog and is tried again: while the host runs, and by its next
    // start after a stop.
    let (mut reg, mut c) = (reg, c);
    let manifest_gone = |id: &str| {
        wait_for(
            "the manifest deleted once the registry is back",
            Duration::from_secs(20),
            || {
                matches!(registry.get_manifest("fleet", id), Err(strata::registry::RegistryError::NotFound { .. }))
                    .then_some(())
            },
            || format!("{:?}", registry.get_manifest("fleet", id).map(|(_, _, digest)| digest)),
        )
    };
    for (round, sandbox) in [("running", &fc), ("restarted", &fbg)] {
        let cp = post(&c, &format!("/v1/sandboxes/{sandbox}/checkpoint"), json!({"type": "distributed"}));
        let id = cp["id"].as_str().unwrap().to_string();
        if let Some(wc) = cp["work_context"].as_str() {
            post(&c, &format!("/v1/lineages/{wc}/retire"), json!({}));
        }
        assert!(registry.get_manifest("fleet", &id).is_ok(), "{round}: published");
        reg.stop();
        c.client().request("DELETE", &format!("/v1/snapshots/{id}"), None::<&()>).unwrap();
        let missed = format!("snapshot {id} removed; deleting its manifest {fleet}:{id} failed (attempt 1;");
        c.wait_logged(&missed, Duration::from_secs(10));
        let queued = c.catalog().manifest_deletes().unwrap();
        assert!(
            queued
                .iter()
                .any(|(m, error)| m.snapshot == id && error.as_deref().is_some_and(|e| e.contains(&reg.addr()))),
            "{round}: {queued:?}"
        );
        if round == "restarted" {
            c.stop_daemon();
            reg.restart();
            c.start_daemon();
        } else {
            reg.restart();
        }
        manifest_gone(&id);
        wait_until("the queue to empty", Duration::from_secs(5), || c.catalog().manifest_deletes().unwrap().is_empty());
    }

    // B killed: marked down, and its lineage resumes on C from its last
    // durable (distributed) checkpoint.
    let mut b = b;
    b.kill_daemon();
    marked_down(&c, "host-b");
    let rc = post(&c, "/v1/lineages/wc-1/resume", json!({}));
    let sc = rc["id"].as_str().unwrap().to_string();
    assert_eq!(stdout(&sh(&c, &sc, "cat /root/a.txt /root/b.txt")), "from-a\nfrom-b\n");

    b.start_daemon();
    a.start_daemon();
    a.finish();
    b.finish();
    c.finish();
}

#[test]
fn two_hosts_racing_resumes_of_one_lineage_start_one_sandbox_and_a_stale_host_is_fenced() {
    strata_tests::require_root();
    let url = pg::database();
    let reg = registry::Registry::start();
    let fleet = format!("{}/fleet", reg.addr());
    let extra = ["--registry", &fleet, "--insecure-registry", BEAT[0], BEAT[1], BEAT[2], BEAT[3]];
    let a = TestEnv::start_in_fleet(&url, "host-a", &extra);
    let b = TestEnv::start_in_fleet(&url, "host-b", &extra);
    a.import_busybox();
    let s = create(&a, json!({"image": "busybox", "work_context": "race"}));
    sh(&a, &s, "echo start > /root/n");
    post(&a, &format!("/v1/sandboxes/{s}/suspend"), json!({}));

    // Each round both hosts resume the lineage at once: one sandbox starts
    // (201), the other launch is refused (409) naming it and its host. The
    // winner writes, appends and goes.
    const ROUNDS: usize = 30;
    let mut winners = Vec::new();
    for round in 0..ROUNDS {
        let results: Vec<Result<Value, ClientError>> = std::thread::scope(|scope| {
            let racers: Vec<_> = [&a, &b]
                .iter()
                .map(|env| {
                    let client = env.client();
                    scope.spawn(move || {
                        let mut client = client;
                        client.call::<Value>("POST", "/v1/lineages/race/resume", Some(&json!({})))
                    })
                })
                .collect();
            racers.into_iter().map(|r| r.join().unwrap()).collect()
        });
        let won: Vec<usize> = results.iter().enumerate().filter(|(_, r)| r.is_ok()).map(|(i, _)| i).collect();
        assert_eq!(won.len(), 1, "round {round}: {results:?}");
        let (w, env) = (won[0], [&a, &b][won[0]]);
        let id = results[w].as_ref().unwrap()["id"].as_str().unwrap().to_string();
        let host = ["host-a", "host-b"][w];
        match &results[1 - w] {
            Err(ClientError::Api { status: 409, message, .. }) => assert!(
                message.contains(&format!("held by live sandbox {id} on host {host}")),
                "round {round}: {message}"
            ),
            other => panic!("round {round}: the loser got {other:?}"),
        }
        sh(env, &id, &format!("echo {round} > /root/n"));
        let snap = post(env, &format!("/v1/sandboxes/{id}/checkpoint"), json!({"type": "distributed"}));
        winners.push(snap["id"].as_str().unwrap().to_string());
        env.client().request("DELETE", &format!("/v1/sandboxes/{id}"), None::<&()>).unwrap();
    }

    // One head, the last winner; a gap-free sequence of suspend + winners.
    let lineage: Value = a.client().call("GET", "/v1/lineages/race", None::<&()>).unwrap();
    assert_eq!(lineage["head"].as_str(), winners.last().map(String::as_str), "{lineage:#}");
    let appended: Vec<&Value> =
        lineage["checkpoints"].as_array().unwrap().iter().filter(|c| c["sequence"].is_i64()).collect();
    let seqs: Vec<i64> = appended.iter().map(|c| c["sequence"].as_i64().unwrap()).collect();
    assert_eq!(seqs, (1..=ROUNDS as i64 + 1).collect::<Vec<_>>(), "{lineage:#}");
    assert_eq!(appended.iter().filter(|c| c["state"] == "ready").count(), 1, "{lineage:#}");

    // A's lease lasts while A heartbeats. A stopped (SIGSTOP: its sandbox
    // runs on, its heartbeats stop) is marked down, and B may resume the
    // lineage and move its head; A back, its stale sandbox's append is
    // fenced and leaves nothing.
    let x = post(&a, "/v1/lineages/race/resume", json!({}))["id"].as_str().unwrap().to_string();
    let holder = |env: &TestEnv| -> Value {
        env.client().call::<Value>("GET", "/v1/lineages/race", None::<&()>).unwrap()["holder"].clone()
    };
    assert_eq!(holder(&b), json!({"sandbox": x, "host": "host-a"}));
    let listed: Vec<Value> = b.client().call("GET", "/v1/lineages", None::<&()>).unwrap();
    assert_eq!(listed[0]["holder"]["sandbox"], x.as_str(), "{listed:?}");
    sh(&a, &x, "echo stale > /root/n");
    let a_pid = nix::unistd::Pid::from_raw(a.daemon.as_ref().unwrap().id() as i32);
    nix::sys::signal::kill(a_pid, nix::sys::signal::Signal::SIGSTOP).unwrap();
    marked_down(&b, "host-a");
    assert!(holder(&b).is_null(), "a down host's sandbox still holds its lineage");
    let y = post(&b, "/v1/lineages/race/resume", json!({}))["id"].as_str().unwrap().to_string();
    let moved = post(&b, &format!("/v1/sandboxes/{y}/checkpoint"), json!({"type": "distributed"}));
    nix::sys::signal::kill(a_pid, nix::sys::signal::Signal::SIGCONT).unwrap();
    a.wait_logged("it is up again", Duration::from_secs(10));
    let count = |sub: &str| std::fs::read_dir(a.root.join(sub)).unwrap().count();
    let (layers, blobs) = (count("layers"), count("blobs/sha256"));
    match a.client().request("POST", &format!("/v1/sandboxes/{x}/checkpoint"), Some(&json!({}))) {
        Err(ClientError::Api { status: 409, message, .. }) => assert!(message.contains("moved on"), "{message}"),
        other => panic!("a stale host's append: {other:?}"),
    }
    assert_eq!((count("layers"), count("blobs/sha256")), (layers, blobs), "a fenced append left an artifact");
    assert_eq!(stdout(&sh(&a, &x, "cat /root/n")), "stale\n", "the stale sandbox runs on");
    let lineage: Value = b.client().call("GET", "/v1/lineages/race", None::<&()>).unwrap();
    assert_eq!(lineage["head"], moved["id"], "{lineage:#}");
    // Both hold now (A is up again): a third launch is refused.
    assert!(!holder(&b).is_null());
    let third = b.client().request("POST", "/v1/lineages/race/resume", Some(&json!({})));
    assert!(matches!(third, Err(ClientError::Api { status: 409, .. })), "{third:?}");
    for (env, id) in [(&a, &x), (&b, &y)] {
        env.client().request("DELETE", &format!("/v1/sandboxes/{id}"), None::<&()>).unwrap();
    }

    // No orphan on either host: every layer and blob file is one the
    // catalog lists.
    let mut db = postgres::Client::connect(&url, postgres::NoTls).unwrap();
    let mut listed = |sql: &str| -> std::collections::HashSet<String> {
        db.query(sql, &[]).unwrap().iter().map(|r| r.get::<_, String>(0)).collect()
    };
    let layers = listed("SELECT layer_id FROM snapshots UNION SELECT layer_id FROM image_layers");
    let blobs = listed(
        "SELECT substr(blob_digest, 8) FROM snapshots WHERE blob_digest != '' \
         UNION SELECT substr(blob_digest, 8) FROM image_layers",
    );
    for env in [&a, &b] {
        for (dir, known) in [("layers", &layers), ("blobs/sha256", &blobs)] {
            for e in std::fs::read_dir(env.root.join(dir)).unwrap() {
                let name = e.unwrap().file_name().to_string_lossy().into_owned();
                assert!(known.contains(&name), "{dir}/{name} on {} is listed by no row", env.root.display());
            }
        }
    }
    a.finish();
    b.finish();
}

/// The same story on one host with no fleet (SQLite unless the suite runs
/// on PostgreSQL): suspend, resume the work context, checkpoint, fork.
#[test]
fn the_same_story_on_one_host_needs_no_fleet() {
    let env = TestEnv::start();
    env.import_busybox();
    let s = create(&env, json!({"image": "busybox", "work_context": "wc-1"}));
    sh(&env, &s, "echo from-a > /root/a.txt");
    let susp = post(&env, &format!("/v1/sandboxes/{s}/suspend"), json!({}));
    assert_eq!(susp["type"], "local", "{susp:#}");
    let r = post(&env, "/v1/lineages/wc-1/resume", json!({}));
    let id = r["id"].as_str().unwrap().to_string();
    assert_eq!(stdout(&sh(&env, &id, "cat /root/a.txt")), "from-a\n");
    sh(&env, &id, "echo from-b > /root/b.txt");
    let cp = post(&env, &format!("/v1/sandboxes/{id}/checkpoint"), json!({}));
    let forks = post(&env, &format!("/v1/snapshots/{}/fork", cp["id"].as_str().unwrap()), json!({}));
    let f = forks[0]["id"].as_str().unwrap().to_string();
    assert_eq!(stdout(&sh(&env, &f, "cat /root/a.txt /root/b.txt")), "from-a\nfrom-b\n");
    assert!(!env.daemon_log().contains("brought"), "a single host fetched layers");
    env.finish();
}

/// Two hosts pull one snapshot by hand (`snapshot pull`, no fleet
/// registry): each waits on its own unpack of it, never on the other's.
#[test]
fn a_snapshot_pulled_by_two_hosts_is_unpacked_on_each() {
    strata_tests::require_root();
    let url = pg::database();
    let reg = registry::Registry::start();
    let a = TestEnv::start_in_fleet(&url, "host-a", &BEAT);
    let mut b = TestEnv::start_in_fleet(&url, "host-b", &BEAT);
    let c = TestEnv::start_in_fleet(&url, "host-c", &BEAT);
    // B's first unpack of a pulled layer waits 3 s: C pulls and resumes
    // meanwhile, and must not take B's wait for its own.
    b.stop_daemon();
    b.daemon_env.push(("STRATA_FAILPOINTS".into(), "hydrate:unpack=sleep-once:3000".into()));
    b.start_daemon();
    a.import_busybox();
    let s = create(&a, json!({"image": "busybox"}));
    sh(&a, &s, "echo pulled > /root/p");
    let cp = post(&a, &format!("/v1/sandboxes/{s}/checkpoint"), json!({}));
    let id = cp["id"].as_str().unwrap();
    let reference = format!("{}/moved:v1", reg.addr());
    a.cli_ok(&["snapshot", "push", id, &reference, "--insecure"]);
    b.cli_ok(&["snapshot", "pull", &reference, "--insecure"]);
    c.cli_ok(&["snapshot", "pull", &reference, "--insecure"]);
    // (Forks: A's sandbox still works in the snapshot's lineage.)
    for env in [&c, &b] {
        let r = post(env, &format!("/v1/snapshots/{id}/fork"), json!({}));
        let sb = r[0]["id"].as_str().unwrap().to_string();
        assert_eq!(stdout(&sh(env, &sb, "cat /root/p")), "pulled\n", "on {}", env.root.display());
    }
    assert!(b.daemon_log().contains("failpoint hydrate:unpack reached"), "{}", b.daemon_log());
    a.finish();
    b.finish();
    c.finish();
}

/// One E2B API call over loopback TCP (`X-API-Key: key-one`, the
/// connection closed after): the status and the JSON body (null if none).
fn e2b_call(addr: &str, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
    use std::io::{Read, Write};
    let body = body.map(|b| b.to_string()).unwrap_or_default();
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nX-API-Key: key-one\r\nConnection: close\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let status = out.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    let json = out.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    (status, serde_json::from_str(json).unwrap_or(Value::Null))
}

#[test]
fn an_e2b_sandbox_is_changed_only_where_it_runs_and_a_lost_one_is_removed_when_its_host_is_back() {
    strata_tests::require_root();
    let url = pg::database();
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys");
    std::fs::write(&keys, "key-one\n").unwrap();
    let addr = || std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().to_string();
    let (addr_a, addr_b) = (addr(), addr());
    // A fleet registry: a paused sandbox resumes on any host.
    let reg = registry::Registry::start();
    let fleet = format!("{}/fleet", reg.addr());
    let e2b = |listen: &str| -> Vec<String> {
        let keys = keys.to_str().unwrap();
        let args =
            ["--e2b-listen", listen, "--e2b-api-keys", keys, "--e2b-domain", "strata.test", "--registry", &fleet];
        args.iter().chain(&["--insecure-registry"]).chain(&BEAT).map(|s| s.to_string()).collect()
    };
    let (args_a, args_b) = (e2b(&addr_a), e2b(&addr_b));
    let a = TestEnv::start_in_fleet(&url, "host-a", &args_a.iter().map(String::as_str).collect::<Vec<_>>());
    let mut b = TestEnv::start_in_fleet(&url, "host-b", &args_b.iter().map(String::as_str).collect::<Vec<_>>());
    let image = strata_tests::image("e2b");
    a.cli_ok(&["image", "import", image.to_str().unwrap(), "--name", "base"]);
    let (status, made) = e2b_call(&addr_a, "POST", "/sandboxes", Some(json!({"templateID": "base", "timeout": 300})));
    assert_eq!(status, 201, "{made}");
    let id = made["sandboxID"].as_str().unwrap().to_string();

    // Host B sees it running (the catalog is one), lists it, and refuses
    // to change it: it runs on A.
    let (status, got) = e2b_call(&addr_b, "GET", &format!("/sandboxes/{id}"), None);
    assert_eq!((status, got["state"].as_str()), (200, Some("running")), "{got}");
    let (_, listed) = e2b_call(&addr_b, "GET", "/v2/sandboxes", None);
    assert!(listed.as_array().unwrap().iter().any(|s| s["sandboxID"] == id.as_str()), "{listed}");
    for (method, path, body) in [
        ("POST", format!("/sandboxes/{id}/pause"), Some(json!({}))),
        ("POST", format!("/sandboxes/{id}/connect"), Some(json!({"timeout": 60}))),
        ("POST", format!("/sandboxes/{id}/timeout"), Some(json!({"timeout": 60}))),
        ("DELETE", format!("/sandboxes/{id}"), None),
    ] {
        let (status, err) = e2b_call(&addr_b, method, &path, body);
        assert_eq!(status, 409, "{method} {path}: {err}");
        assert!(err["message"].as_str().unwrap_or("").contains("runs on host host-a"), "{method} {path}: {err}");
    }
    // On A nothing changed.
    let (status, got) = e2b_call(&addr_a, "GET", &format!("/sandboxes/{id}"), None);
    assert_eq!((status, got["state"].as_str()), (200, Some("running")), "{got}");
    let live = |env: &TestEnv| -> usize {
        let v: Vec<Value> = env.client().call("GET", "/v1/sandboxes", None::<&()>).unwrap();
        v.len()
    };
    assert_eq!(live(&a), 1);
    // Paused on A, it resumes on B (its layers from the fleet registry),
    // and now A is the host that refers to B.
    assert_eq!(e2b_call(&addr_a, "POST", &format!("/sandboxes/{id}/pause"), Some(json!({}))).0, 204);
    let (status, got) = e2b_call(&addr_b, "GET", &format!("/sandboxes/{id}"), None);
    assert_eq!((status, got["state"].as_str()), (200, Some("paused")), "{got}");
    let (status, resumed) =
        e2b_call(&addr_b, "POST", &format!("/sandboxes/{id}/connect"), Some(json!({"timeout": 60})));
    assert_eq!(status, 201, "{resumed}");
    assert_eq!((live(&a), live(&b)), (0, 1));
    let (status, err) = e2b_call(&addr_a, "POST", &format!("/sandboxes/{id}/pause"), Some(json!({})));
    assert!(status == 409 && err["message"].as_str().unwrap_or("").contains("runs on host host-b"), "{err}");
    // B dies and is marked down: its sandbox is lost to the fleet; A's
    // kill forgets it (its row and work context) and marks its catalog
    // row stopped, which B carries out at its next start.
    let lost = sandboxes(&b).pop().unwrap();
    let host_b_down = |a: &TestEnv| drop(marked_down(a, "host-b"));
    b.kill_daemon();
    host_b_down(&a);
    // Its Strata sandbox removed through A's API first (202: B removes it
    // when back), the E2B kill still forgets the E2B sandbox.
    let r = a.client().raw("DELETE", &format!("/v1/sandboxes/{lost}"), b"", &[]).unwrap();
    assert_eq!(r.status, 202, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(e2b_call(&addr_a, "DELETE", &format!("/sandboxes/{id}"), None).0, 204);
    assert_eq!(e2b_call(&addr_a, "GET", &format!("/sandboxes/{id}"), None).0, 404);
    assert!(!strata_tests::processes_matching(&lost).is_empty(), "the lost sandbox runs on while B is down");
    // Killed, it is gone to the fleet: A's API says not found, not "runs on host-b".
    match a.client().request("GET", &format!("/v1/sandboxes/{lost}"), None::<&Value>) {
        Err(ClientError::Api { status: 404, .. }) => {}
        other => panic!("a killed sandbox of a down host: {other:?}"),
    }
    b.start_daemon();
    assert_eq!(live(&b), 0, "B back removed the sandbox killed while it was down");
    assert_eq!(strata_tests::processes_matching(&lost), vec![], "its shim and processes are gone");

    // A host only late (marked down, its daemon never stopped: here
    // SIGSTOPped) removes such a sandbox at its next heartbeat.
    let (status, made) = e2b_call(&addr_b, "POST", "/sandboxes", Some(json!({"templateID": "base", "timeout": 300})));
    assert_eq!(status, 201, "{made}");
    let id = made["sandboxID"].as_str().unwrap().to_string();
    let lost = sandboxes(&b).pop().unwrap();
    let daemon_b = nix::unistd::Pid::from_raw(b.daemon.as_ref().unwrap().id() as i32);
    /// SIGCONT for a stopped daemon, however the test goes on.
    struct Continue(nix::unistd::Pid);
    impl Drop for Continue {
        fn drop(&mut self) {
            let _ = nix::sys::signal::kill(self.0, nix::sys::signal::Signal::SIGCONT);
        }
    }
    nix::sys::signal::kill(daemon_b, nix::sys::signal::Signal::SIGSTOP).unwrap();
    let stopped = Continue(daemon_b);
    host_b_down(&a);
    assert_eq!(e2b_call(&addr_a, "DELETE", &format!("/sandboxes/{id}"), None).0, 204);
    drop(stopped);
    wait_for(
        "B to remove the sandbox killed while it was late",
        Duration::from_secs(10),
        || (live(&b) == 0 && strata_tests::processes_matching(&lost).is_empty()).then_some(()),
        || format!("{:?} {:?}", sandboxes(&b), strata_tests::processes_matching(&lost)),
    );
    b.wait_logged("another host removed it while this host was down", Duration::from_secs(5));
    assert_eq!(e2b_call(&addr_a, "GET", &format!("/sandboxes/{id}"), None).0, 404);
    a.finish();
    b.finish();
}

/// The last restore of lineage `wc`, as `env` reads it.
fn last_restore(env: &TestEnv, wc: &str) -> Value {
    let l: Value = env.client().call("GET", &format!("/v1/lineages/{wc}"), None::<&()>).unwrap();
    l["restores"].as_array().unwrap().last().unwrap().clone()
}

#[test]
fn the_ladder_passes_a_head_the_fleet_registry_cannot_give() {
    strata_tests::require_root();
    let url = pg::database();
    let mut reg = registry::Registry::start();
    let fleet = format!("{}/fleet", reg.addr());
    let extra = ["--registry", &fleet, "--insecure-registry", BEAT[0], BEAT[1], BEAT[2], BEAT[3]];
    let a = TestEnv::start_in_fleet(&url, "host-a", &extra);
    let b = TestEnv::start_in_fleet(&url, "host-b", &extra);
    a.import_busybox();
    // The lineage begins on A; B resumes it once (which brings it the
    // image's layers) and lets it go.
    let s = create(&a, json!({"image": "busybox", "work_context": "ladder"}));
    sh(&a, &s, "echo one > /root/n");
    post(&a, &format!("/v1/sandboxes/{s}/suspend"), json!({}));
    let first = post(&b, "/v1/lineages/ladder/resume", json!({}))["id"].as_str().unwrap().to_string();
    assert_eq!(stdout(&sh(&b, &first, "cat /root/n")), "one\n");
    b.cli_ok(&["rm", &first]);
    // A moves the head on; its layer is on A and in the fleet registry.
    let on_a = post(&a, "/v1/lineages/ladder/resume", json!({}))["id"].as_str().unwrap().to_string();
    sh(&a, &on_a, "echo two > /root/n");
    let head = post(&a, &format!("/v1/sandboxes/{on_a}/suspend"), json!({}));
    let (s2, blob) = (head["id"].as_str().unwrap().to_string(), head["blob_digest"].as_str().unwrap().to_string());

    // The registry down, then a blob that does not match its digest: each
    // time B passes the head (recording why) and starts from the image.
    let corrupt = |reg: &mut registry::Registry, round: usize| {
        if round == 0 {
            reg.stop();
        } else {
            reg.restart();
            let data = reg.blob_data(&blob);
            let len = std::fs::metadata(&data).unwrap().len() as usize;
            std::fs::write(&data, vec![0x5a; len]).unwrap();
        }
    };
    for round in 0..2 {
        corrupt(&mut reg, round);
        let id = post(&b, "/v1/lineages/ladder/resume", json!({}))["id"].as_str().unwrap().to_string();
        assert_eq!(stdout(&sh(&b, &id, "cat /root/n 2>/dev/null || echo none")), "none\n", "round {round}");
        let r = last_restore(&b, "ladder");
        assert_eq!(r["rung"], "image", "round {round}: {r}");
        let fell = r["fell"][0].as_str().unwrap_or_default();
        assert!(fell.starts_with(&format!("head {s2}: ")) && fell.contains("registry"), "round {round}: {r}");
        b.cli_ok(&["rm", &id]);
    }
    a.finish();
    b.finish();
}
