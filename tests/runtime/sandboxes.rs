//! A sandbox: exec, limits, metrics, the API's errors, pause, a daemon's
//! kill and restart.

use super::*;

#[test]
fn exec_semantics() {
    let env = TestEnv::start();
    env.import_busybox();
    let id = create(&env, json!({"image": "busybox", "env": ["FROM_CREATE=1"]}));

    let v = sh(&env, &id, "exit 3");
    assert_eq!(v["exit_code"], 3, "{v}");
    let v = exec(&env, &id, json!({"argv": ["no-such-command"]}));
    assert_eq!(v["exit_code"], 127, "{v}");
    assert!(stdout(&json!({"stdout": v["stderr"]})).contains("not found"), "{v}");
    // The child reports every failure before exec itself (it shares the
    // shim's memory until then): by path, not executable, bad cwd.
    let v = exec(&env, &id, json!({"argv": ["/no/such"]}));
    assert_eq!(
        (v["exit_code"].as_i64(), v["stderr"].as_str()),
        (Some(127), Some("strata: exec /no/such: No such file or directory\n"))
    );
    sh(&env, &id, "printf 'echo hi' > /tmp/plain; chmod 644 /tmp/plain");
    let v = exec(&env, &id, json!({"argv": ["/tmp/plain"]}));
    assert_eq!(
        (v["exit_code"].as_i64(), v["stderr"].as_str()),
        (Some(126), Some("strata: exec /tmp/plain: Permission denied\n"))
    );
    let v = exec(&env, &id, json!({"argv": ["true"], "cwd": "/no/dir"}));
    assert_eq!(
        (v["exit_code"].as_i64(), v["stderr"].as_str()),
        (Some(126), Some("strata: chdir /no/dir: No such file or directory\n"))
    );
    // A long argv and env arrive whole.
    let long = "x".repeat(60_000);
    let v = exec(
        &env,
        &id,
        json!({"argv": ["sh", "-c", "echo ${#1} ${#LONG}", "sh", long], "env": [format!("LONG={long}")]}),
    );
    assert_eq!(stdout(&v), "60000 60000\n");
    let v = sh(&env, &id, "kill -9 $$");
    assert_eq!((v["exit_code"].as_i64(), v["signal"].as_i64()), (Some(137), Some(9)));

    // stdin, env, cwd, user.
    let v = exec(&env, &id, json!({"argv": ["cat"], "stdin": "piped\n"}));
    assert_eq!(stdout(&v), "piped\n");
    let v = exec(
        &env,
        &id,
        json!({"argv": ["sh", "-c", "echo $FROM_CREATE $X; pwd; id -u; id -g"], "env": ["X=2"], "cwd": "/tmp", "user": "65534:65534"}),
    );
    assert_eq!(stdout(&v), "1 2\n/tmp\n65534\n65534\n");
    let v = sh(&env, &id, "echo out; echo err >&2");
    assert_eq!((stdout(&v).as_str(), v["stderr"].as_str().unwrap()), ("out\n", "err\n"));

    // A timeout kills the whole process group, background children included.
    let t = Instant::now();
    let v = exec(&env, &id, json!({"argv": ["sh", "-c", "sleep 100 & sleep 100"], "timeout": 1}));
    assert!(v["timed_out"].as_bool().unwrap(), "{v}");
    assert!(t.elapsed() < Duration::from_secs(5));
    let left = stdout(&sh(&env, &id, "ps -o comm | grep -c sleep || true"));
    assert_eq!(left.trim(), "0", "timed-out group survived");

    // Several execs at once in one sandbox.
    let t = Instant::now();
    let handles: Vec<_> = (0..4)
        .map(|i| {
            let sock = env.socket.clone();
            let id = id.clone();
            std::thread::spawn(move || {
                let mut c = Client::connect(&sock).unwrap();
                let v: Value = c
                    .call(
                        "POST",
                        &format!("/v1/sandboxes/{id}/exec"),
                        Some(&json!({"argv": ["sh", "-c", format!("sleep 2; echo {i}")]})),
                    )
                    .unwrap();
                stdout(&v)
            })
        })
        .collect();
    // Meanwhile the API answers: a buffered exec waits on an async worker
    // for 2 ms at most, and never on all of them. (Held up by them, the
    // answer would come after 1.7 s; a loaded machine's slowness is far
    // below that.)
    std::thread::sleep(Duration::from_millis(300));
    let asked = Instant::now();
    let _: Value = env.client().call("GET", "/v1/version", None::<&()>).unwrap();
    let answered = asked.elapsed();
    let outs: Vec<String> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    assert_eq!(outs, vec!["0\n", "1\n", "2\n", "3\n"]);
    assert!(t.elapsed() < Duration::from_secs(5), "execs ran one after another");
    assert!(answered < Duration::from_secs(1), "GET /v1/version took {answered:?} while 4 execs ran");
    // Output before and after that first wait arrives whole, in order.
    let v = sh(&env, &id, "echo early; sleep 0.05; echo late; echo err >&2");
    assert_eq!((stdout(&v).as_str(), v["stderr"].as_str().unwrap()), ("early\nlate\n", "err\n"));

    // The CLI streams, forwards stdin with -i, and exits with the command's code.
    let out = env.cli(&["exec", &id, "--", "sh", "-c", "echo streamed; exit 7"]);
    assert_eq!(out.status.code(), Some(7));
    assert_eq!(String::from_utf8_lossy(&out.stdout), "streamed\n");
    let mut child = std::process::Command::new(strata_bin())
        .env("STRATA_SOCKET", &env.socket)
        .args(["exec", "-i", &id, "--", "tr", "a-z", "A-Z"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    child.stdin.take().unwrap().write_all(b"hello\n").unwrap();
    let out = child.wait_with_output().unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "HELLO\n");
    assert_eq!(out.status.code(), Some(0));
    env.finish();
}

#[test]
fn exec_with_a_tty() {
    let env = TestEnv::start();
    env.import_busybox();
    let id = create(&env, json!({"image": "busybox"}));
    let body = json!({"argv": ["sh", "-c", "tty; stty size"], "tty": true, "rows": 33, "cols": 101});
    let mut conn = env.client().attach(&format!("/v1/sandboxes/{id}/exec"), &body).unwrap().reader;
    let mut out = Vec::new();
    let code = loop {
        match strata::stream::read_frame(&mut conn).unwrap() {
            Some((strata::stream::FrameKind::Stdout, d)) => out.extend(d),
            Some((strata::stream::FrameKind::Exit, d)) => break i32::from_be_bytes([d[0], d[1], d[2], d[3]]),
            Some(_) => {}
            None => panic!("no exit frame"),
        }
    };
    let text = String::from_utf8_lossy(&out);
    assert_eq!(code, 0, "{text}");
    assert!(text.contains("/dev/pts/"), "{text}");
    assert!(text.contains("33 101"), "{text}");
    env.finish();
}

#[test]
fn default_limits_apply_and_maximums_refuse() {
    // No warm pool: its refill makes sandbox dirs of its own at any time,
    // and the count below is of what the refused creates left.
    let env = TestEnv::start_with(&[
        "--max-pids",
        "4096",
        "--default-memory",
        "256m",
        "--max-memory",
        "512m",
        "--warm-pool",
        "0",
    ]);
    env.import_busybox();
    let v2 = Path::new("/sys/fs/cgroup/cgroup.controllers").exists();
    let memory = |id: &str| cgroup_file(&env, id, if v2 { "memory.max" } else { "memory.limit_in_bytes" });
    // Asking for nothing: podman's 2048 pids and the daemon's memory default.
    let id = create(&env, json!({"image": "busybox"}));
    assert_eq!(cgroup_file(&env, &id, "pids.max"), "2048");
    assert_eq!(memory(&id), (256u64 << 20).to_string());
    let info: Value = env.client().call("GET", &format!("/v1/sandboxes/{id}"), None::<&()>).unwrap();
    assert_eq!((info["limits"]["pids"].as_u64(), info["limits"]["memory"].as_u64()), (Some(2048), Some(256 << 20)));
    // Lower, or higher up to the maximums.
    let id = create(&env, json!({"image": "busybox", "pids": 64, "memory": 512 << 20}));
    assert_eq!(cgroup_file(&env, &id, "pids.max"), "64");
    assert_eq!(memory(&id), (512u64 << 20).to_string());
    // Past them: 400, naming the flag; nothing made.
    let before = std::fs::read_dir(env.root.join("sandboxes")).unwrap().count();
    for (body, flag) in [
        (json!({"image": "busybox", "pids": 4097}), "--max-pids"),
        (json!({"image": "busybox", "memory": (512u64 << 20) + 1}), "--max-memory"),
    ] {
        match env.client().request("POST", "/v1/sandboxes", Some(&body)) {
            Err(ClientError::Api { status: 400, message, .. }) => assert!(message.contains(flag), "{message}"),
            other => panic!("expected 400 for {body}, got {:?}", other.map(|_| ())),
        }
    }
    assert_eq!(std::fs::read_dir(env.root.join("sandboxes")).unwrap().count(), before);
    env.finish();
}

#[test]
fn checkpoint_and_suspend_racing_rm_answer_404_or_409() {
    let env = TestEnv::start();
    env.import_busybox();
    let mut seen = std::collections::BTreeMap::new();
    for i in 0..60 {
        let id = create(&env, json!({"image": "busybox"}));
        sh(&env, &id, "echo x > /tmp/x");
        let verb = if i % 2 == 0 { "checkpoint" } else { "suspend" };
        let sock = env.socket.clone();
        let path = format!("/v1/sandboxes/{id}/{verb}");
        let racer = std::thread::spawn(move || {
            let r = Client::connect(&sock).unwrap().request("POST", &path, None::<&()>);
            match r {
                Ok(_) => (200, String::new()),
                Err(e) => (e.status().unwrap_or(0), e.to_string()),
            }
        });
        std::thread::sleep(std::time::Duration::from_micros(200 * (i % 10)));
        let rm = env.client().request("DELETE", &format!("/v1/sandboxes/{id}"), None::<&()>);
        let rm = rm.map(|_| 200).unwrap_or_else(|e| e.status().unwrap_or(0));
        let (status, message) = racer.join().unwrap();
        assert!(matches!(status, 200 | 404 | 409), "{verb} racing rm: {status} {message}");
        assert!(matches!(rm, 200 | 204 | 404 | 409), "rm racing {verb}: {rm}");
        *seen.entry((verb, status)).or_insert(0) += 1;
    }
    eprintln!("outcomes: {seen:?}");
    env.finish();
}

#[test]
fn a_warm_shim_that_died_is_never_handed_out() {
    let env = TestEnv::start_with(&["--warm-pool", "2"]);
    env.import_busybox();
    // Wait for the pool's two shims (cgroups no sandbox owns), then kill them.
    let warm_pids = || -> Vec<i32> {
        let mut pids = Vec::new();
        for d in env.cgroup_dirs() {
            for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
                let procs = std::fs::read_to_string(e.path().join("cgroup.procs")).unwrap_or_default();
                pids.extend(procs.lines().filter_map(|l| l.trim().parse::<i32>().ok()));
            }
        }
        pids.sort();
        pids.dedup();
        pids
    };
    let start = std::time::Instant::now();
    let mut pids = warm_pids();
    while pids.len() < 2 {
        assert!(start.elapsed().as_secs() < 20, "the warm pool never filled: {pids:?}");
        std::thread::sleep(std::time::Duration::from_millis(50));
        pids = warm_pids();
    }
    for pid in &pids {
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(*pid), nix::sys::signal::Signal::SIGKILL).unwrap();
    }
    std::thread::sleep(std::time::Duration::from_millis(200));
    // Creates succeed (a live shim, warm or cold) and run.
    for _ in 0..3 {
        let id = create(&env, json!({"image": "busybox"}));
        assert_eq!(stdout(&sh(&env, &id, "echo up")), "up\n");
    }
    assert!(env.daemon_log().contains("is gone; not used"), "the dead warm shims were not noticed");
    env.finish();
}

/// A shim that exits before it answers (here a stand-in that says why on
/// stderr, as the real one does when it cannot stage /proc, /dev and /sys)
/// fails the create with that reason, and leaves no sandbox, slot or
/// directory behind.
#[test]
fn a_shim_that_exits_before_setup_fails_the_create_with_its_reason() {
    let work = tempfile::Builder::new().prefix("strata-test-shim-").tempdir().unwrap();
    let dies = "#include <stdio.h>\nint main(void) { fputs(\"strata-shim: stage /proc: the reason it gave\\n\", stderr); return 4; }\n";
    let shim = compile_c(work.path(), "strata-shim", dies, &[]);
    for warm in ["0", "2"] {
        let env = TestEnv::start_with(&["--shim", shim.to_str().unwrap(), "--warm-pool", warm]);
        env.import_busybox();
        match env.client().request("POST", "/v1/sandboxes", Some(&json!({"image": "busybox"}))) {
            Err(ClientError::Api { status: 500, message, .. }) => {
                assert!(
                    message.contains("the shim's log ends: strata-shim: stage /proc: the reason it gave"),
                    "{message}"
                )
            }
            other => panic!("expected a 500 naming the shim's reason (warm pool {warm}), got {other:?}"),
        }
        let list: Vec<Value> = env.client().call("GET", "/v1/sandboxes", None::<&()>).unwrap();
        assert!(list.is_empty(), "{list:?}");
        let info: Value = env.client().call("GET", "/v1/info", None::<&()>).unwrap();
        assert_eq!(info["slots_used"], 0, "{info}");
        env.finish();
    }
}

#[test]
fn an_attached_exec_ends_when_its_shim_dies_or_the_sandbox_is_removed() {
    let env = TestEnv::start();
    env.import_busybox();
    for how in ["kill the shim", "rm the sandbox"] {
        let id = create(&env, json!({"image": "busybox"}));
        let mut child = std::process::Command::new(strata_bin())
            .env("STRATA_SOCKET", &env.socket)
            .args(["exec", &id, "--", "sleep", "1000"])
            .stdin(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        // Wait until the command runs.
        let start = std::time::Instant::now();
        while stdout(&sh(&env, &id, "ps -o comm | grep -c '^sleep'")).trim() != "1" {
            assert!(start.elapsed().as_secs() < 10, "sleep never started");
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        if how == "kill the shim" {
            let info: Value = env.client().call("GET", &format!("/v1/sandboxes/{id}"), None::<&()>).unwrap();
            let shim = info["shim_pid"].as_i64().unwrap() as i32;
            nix::sys::signal::kill(nix::unistd::Pid::from_raw(shim), nix::sys::signal::Signal::SIGKILL).unwrap();
        } else {
            env.cli_ok(&["rm", &id]);
        }
        let start = std::time::Instant::now();
        let status = loop {
            if let Some(st) = child.try_wait().unwrap() {
                break st;
            }
            if start.elapsed().as_secs() >= 15 {
                let _ = child.kill();
                let _ = child.wait();
                panic!("{how}: the attached exec did not return");
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        };
        let mut err = String::new();
        std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut err).unwrap();
        assert!(!status.success(), "{how}: {status}");
        assert!(err.contains("no running init process"), "{how}: {err}");
    }
    env.finish();
}

/// `PUT /v1/sandboxes/{id}/limits` (`strata update`): limits change in
/// the cgroup at once, a left-out one stays, `null` is the daemon's default
/// again, bad ones and the disk cap are refused with nothing changed, and
/// the new limits hold across a daemon restart.
#[test]
fn limits_change_live_and_survive_a_daemon_restart() {
    let mut env = TestEnv::start_with(&["--max-memory", "512m", "--warm-pool", "0"]);
    env.import_busybox();
    let v2 = Path::new("/sys/fs/cgroup/cgroup.controllers").exists();
    let id = create(&env, json!({"image": "busybox", "memory": 64 << 20, "pids": 64}));
    let cg = |env: &TestEnv| {
        let mem = cgroup_file(env, &id, if v2 { "memory.max" } else { "memory.limit_in_bytes" });
        let cpu = if v2 { cgroup_file(env, &id, "cpu.max") } else { cgroup_file(env, &id, "cpu.cfs_quota_us") };
        (mem, cgroup_file(env, &id, "pids.max"), cpu)
    };
    let unlimited_cpu = if v2 { "max 100000" } else { "-1" };
    assert_eq!(cg(&env), ((64u64 << 20).to_string(), "64".into(), unlimited_cpu.into()));
    let put =
        |env: &TestEnv, body: Value| env.client().request("PUT", &format!("/v1/sandboxes/{id}/limits"), Some(&body));

    // Memory and cpus change; pids, left out, stays.
    let info: Value = serde_json::from_slice(&put(&env, json!({"memory": 128 << 20, "cpus": 0.5})).unwrap()).unwrap();
    assert_eq!(info["limits"]["memory"], 128 << 20);
    assert_eq!(info["limits"]["cpus"], 0.5);
    assert_eq!(info["limits"]["pids"], 64);
    let cpu_half = if v2 { "50000 100000" } else { "50000" };
    assert_eq!(cg(&env), ((128u64 << 20).to_string(), "64".into(), cpu_half.into()));
    // The sandbox runs under them: a fork bomb stops at a lowered pids limit.
    put(&env, json!({"pids": 16})).unwrap();
    let r =
        exec(&env, &id, json!({"argv": ["sh", "-c", "for i in $(seq 40); do sleep 3 & done; wait"], "timeout": 20}));
    let events = cgroup_file(&env, &id, "pids.events");
    let hits: u64 = events.strip_prefix("max ").and_then(|n| n.parse().ok()).unwrap_or(0);
    assert!(hits > 0, "16 pids held 40 sleeps: {events}, {r}");

    // Refused, naming why; nothing changes.
    let before = cg(&env);
    for (body, status, needle) in [
        (json!({"memory": 1024}), 400, "minimum"),
        (json!({"memory": (512u64 << 20) + 1}), 400, "--max-memory"),
        (json!({"cpus": 0}), 400, "cpus"),
        (json!({"pids": 0}), 400, "pids"),
        (json!({"disk": 1 << 30}), 400, "disk cap"),
        (json!({"swap": 1}), 400, "swap"),
    ] {
        match put(&env, body.clone()) {
            Err(ClientError::Api { status: s, message, .. }) => {
                assert_eq!(s, status, "{body}: {message}");
                assert!(message.contains(needle), "{body}: {message}");
            }
            other => panic!("expected {status} for {body}, got {:?}", other.map(|_| ())),
        }
        assert_eq!(cg(&env), before, "{body} changed the cgroup");
    }
    match env.client().request("PUT", "/v1/sandboxes/0123456789abcdef/limits", Some(&json!({"pids": 8}))) {
        Err(ClientError::Api { status: 404, .. }) => {}
        other => panic!("expected 404 for an unknown sandbox, got {:?}", other.map(|_| ())),
    }

    // `null`: the daemon's default again (pids 2048, no cpu quota); the
    // CLI says the same.
    let out = env.cli_ok(&["update", &id, "--pids", "default", "--cpus", "default", "--memory", "96m"]);
    let shown: Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(
        (shown["pids"].as_u64(), shown["memory"].as_u64(), shown["cpus"].as_f64()),
        (Some(2048), Some(96 << 20), None)
    );
    assert_eq!(cg(&env), ((96u64 << 20).to_string(), "2048".into(), unlimited_cpu.into()));

    // Kept in its spec: a restarted daemon adopts the sandbox with them.
    env.stop_daemon();
    env.start_daemon();
    let info: Value = env.client().call("GET", &format!("/v1/sandboxes/{id}"), None::<&()>).unwrap();
    assert_eq!((info["limits"]["memory"].as_u64(), info["limits"]["pids"].as_u64()), (Some(96 << 20), Some(2048)));
    assert_eq!(cg(&env), ((96u64 << 20).to_string(), "2048".into(), unlimited_cpu.into()));
    env.finish();
}

#[test]
fn limits_are_enforced() {
    let env = TestEnv::start();
    env.import_busybox();
    let id = create(&env, json!({"image": "busybox", "memory": 32 << 20, "pids": 32, "cpus": 0.5}));

    // cpu: quota visible in the cgroup (v1 cfs_quota_us or v2 cpu.max).
    let v2 = Path::new("/sys/fs/cgroup/cgroup.controllers").exists();
    if v2 {
        assert_eq!(cgroup_file(&env, &id, "cpu.max"), "50000 100000");
        assert_eq!(cgroup_file(&env, &id, "memory.max"), (32u64 << 20).to_string());
    } else {
        assert_eq!(cgroup_file(&env, &id, "cpu.cfs_quota_us"), "50000");
        assert_eq!(cgroup_file(&env, &id, "memory.limit_in_bytes"), (32u64 << 20).to_string());
    }
    assert_eq!(cgroup_file(&env, &id, "pids.max"), "32");

    // A memory hog is OOM-killed; sandbox and daemon live on.
    let v = exec(&env, &id, json!({"argv": ["tail", "/dev/zero"], "timeout": 60}));
    assert_eq!(v["exit_code"], 137, "memory hog not OOM-killed: {v}");
    assert!(!v["timed_out"].as_bool().unwrap());
    assert_eq!(stdout(&sh(&env, &id, "echo alive")), "alive\n");

    // A fork bomb stops at the pids limit; the host is unharmed.
    let v = exec(
        &env,
        &id,
        json!({"argv": ["sh", "-c", "bomb() { bomb | bomb & }; bomb; sleep 2; echo survived"], "timeout": 10}),
    );
    let peak: u64 = cgroup_file(&env, &id, "pids.current").parse().unwrap();
    assert!(peak <= 32, "pids.current {peak} above the limit");
    assert!(v["exit_code"].is_i64(), "bomb exec returned: {v}");
    let events = cgroup_file(&env, &id, "pids.events");
    let hits: u64 = events.strip_prefix("max ").and_then(|n| n.parse().ok()).unwrap_or(0);
    assert!(hits > 0, "fork bomb never hit the pids limit: {events}");
    // The daemon still answers while the bomb is contained.
    let _: Value = env.client().call("GET", "/v1/version", None::<&()>).unwrap();
    // Clean up the bomb, then the sandbox still works.
    env.cli_ok(&["rm", &id]);
    let id2 = create(&env, json!({"image": "busybox"}));
    assert_eq!(stdout(&sh(&env, &id2, "echo fine")), "fine\n");
    env.finish();
}

#[test]
fn metrics_come_from_the_sandboxs_cgroup() {
    let env = TestEnv::start();
    env.import_busybox();
    let id = create(&env, json!({"image": "busybox", "memory": 64 << 20, "cpus": 1}));
    // Some CPU, 8 MiB written, 16 MiB in memory (a tmpfs file is charged
    // to it as shmem).
    let v = sh(
        &env,
        &id,
        "i=0; while [ $i -lt 300000 ]; do i=$((i+1)); done; \
         dd if=/dev/urandom of=/data bs=1M count=8 2>/dev/null && sync && \
         dd if=/dev/zero of=/dev/shm/m bs=1M count=16 2>/dev/null && echo done",
    );
    assert_eq!(stdout(&v), "done\n", "{v}");
    let m: Value = env.client().call("GET", &format!("/v1/sandboxes/{id}/metrics"), None::<&()>).unwrap();
    let n = |k: &str| m[k].as_u64().unwrap_or_else(|| panic!("{k} in {m}"));
    assert_eq!(n("cpu_count"), 1, "{m}");
    assert!(n("cpu_usage_ns") > 50_000_000, "a busy loop used no CPU: {m}");
    let pct = m["cpu_used_pct"].as_f64().unwrap();
    assert!((0.0..=100.0).contains(&pct), "{m}");
    assert_eq!(n("mem_total"), 64 << 20, "{m}");
    assert!(n("mem_used") >= 16 << 20 && n("mem_used") <= 64 << 20, "16 MiB of shmem not charged: {m}");
    // No disk cap: the daemon's filesystem, holding the 8 MiB.
    assert!(n("disk_used") >= 8 << 20 && n("disk_used") <= n("disk_total"), "{m}");
    let later: Value = env.client().call("GET", &format!("/v1/sandboxes/{id}/metrics"), None::<&()>).unwrap();
    assert!(later["timestamp"].as_i64() > m["timestamp"].as_i64().map(|t| t - 1), "{later}");
    assert!(later["cpu_usage_ns"].as_u64() >= m["cpu_usage_ns"].as_u64(), "{later}");

    // Without limits: the host's CPUs and memory, the daemon's filesystem.
    let free = create(&env, json!({"image": "busybox"}));
    let f: Value = env.client().call("GET", &format!("/v1/sandboxes/{free}/metrics"), None::<&()>).unwrap();
    let host_cpus = std::thread::available_parallelism().unwrap().get() as u64;
    assert_eq!(f["cpu_count"].as_u64(), Some(host_cpus), "{f}");
    assert!(f["mem_total"].as_u64().unwrap() > 64 << 20, "{f}");
    assert_eq!(f["disk_total"], m["disk_total"], "both on the daemon's filesystem");

    // The CLI: a table of the running ones, or JSON lines.
    let table = env.cli_ok(&["stats"]);
    assert!(table.starts_with("ID ") && table.contains(&id) && table.contains(&free), "{table}");
    let line = env.cli_ok(&["stats", "--json", &id]);
    let j: Value = serde_json::from_str(line.trim()).unwrap();
    assert_eq!(j["id"], id.as_str());
    assert_eq!(j["metrics"]["mem_total"], 64 << 20);
    assert!(!env.cli(&["stats", "nosuch"]).status.success());

    // The daemon's Prometheus text: sandboxes by state, requests by
    // operation and status, execs, capture bytes, the store.
    let _: Value = env.client().call("POST", &format!("/v1/sandboxes/{free}/checkpoint"), Some(&json!({}))).unwrap();
    let text = String::from_utf8(env.client().request("GET", "/metrics", None::<&()>).unwrap()).unwrap();
    let value = |series: &str| -> f64 {
        let line = text.lines().find(|l| l.starts_with(series)).unwrap_or_else(|| panic!("no {series} in:\n{text}"));
        line.rsplit(' ').next().unwrap().parse().unwrap()
    };
    assert_eq!(value("strata_sandboxes{state=\"running\"}"), 2.0, "{text}");
    assert!(value("strata_api_requests_total{operation=\"create_sandbox\",status=\"20") >= 2.0, "{text}");
    assert!(value("strata_api_request_seconds_count{operation=\"create_sandbox\"}") >= 2.0, "{text}");
    assert!(value("strata_exec_seconds_count") >= 1.0, "{text}");
    assert!(value("strata_capture_bytes_total") > 0.0, "{text}");
    assert!(value("strata_store_bytes{kind=\"image_layers\"}") > 0.0, "{text}");
    assert_eq!(status_of(env.client().request("POST", "/metrics", None::<&()>)), 405);

    assert_eq!(status_of(env.client().request("GET", "/v1/sandboxes/nosuch/metrics", None::<&()>)), 404);
    assert_eq!(status_of(env.client().request("POST", &format!("/v1/sandboxes/{id}/metrics"), None::<&()>)), 405);
    env.finish();
}

#[test]
fn metrics_of_a_sandbox_with_a_disk_cap_are_its_own_filesystems() {
    let env = TestEnv::start();
    env.import_busybox();
    let id = create(&env, json!({"image": "busybox", "disk": 64 << 20}));
    let v = sh(&env, &id, "dd if=/dev/urandom of=/data bs=1M count=8 2>/dev/null && sync && echo done");
    assert_eq!(stdout(&v), "done\n", "{v}");
    let m: Value = env.client().call("GET", &format!("/v1/sandboxes/{id}/metrics"), None::<&()>).unwrap();
    let n = |k: &str| m[k].as_u64().unwrap_or_else(|| panic!("{k} in {m}"));
    // The cap less ext4's own, with the 8 MiB in it.
    assert!(n("disk_total") <= 64 << 20 && n("disk_total") >= 48 << 20, "{m}");
    assert!(n("disk_used") >= 8 << 20 && n("disk_used") <= n("disk_total"), "{m}");
    env.finish();
}

#[test]
fn api_errors() {
    // No warm pool here: the test counts cgroups to prove nothing half-made.
    let env = TestEnv::start_with(&["--max-sandboxes", "1", "--warm-pool", "0"]);
    env.import_busybox();
    let mut c = env.client();
    let none = None::<&()>;
    // 404: unknown sandbox, malformed id, unknown image, unknown route.
    assert_eq!(status_of(c.request("GET", "/v1/sandboxes/0123456789abcdef", none)), 404);
    assert_eq!(status_of(c.request("DELETE", "/v1/sandboxes/..%2F..%2Fetc", none)), 404);
    assert_eq!(
        status_of(c.request("POST", "/v1/sandboxes/0123456789abcdef/exec", Some(&json!({"argv": ["true"]})))),
        404
    );
    assert_eq!(status_of(c.request("POST", "/v1/sandboxes", Some(&json!({"image": "nope"})))), 404);
    assert_eq!(status_of(c.request("GET", "/v2/nothing", none)), 404);
    assert_eq!(status_of(c.request("GET", "/v1images", none)), 404);
    // 405: a known path with the wrong method.
    assert_eq!(status_of(c.request("PUT", "/v1/sandboxes", none)), 405);
    for (path, allow) in [("/v1/sandboxes", "GET, POST"), ("/v1/snapshots/0123456789abcdef", "GET, DELETE")] {
        let r = c.raw("PATCH", path, b"", &[]).unwrap();
        assert_eq!(r.status, 405);
        let got = r.headers.iter().find(|(k, _)| k == "allow").map(|(_, v)| v.trim());
        assert_eq!(got, Some(allow), "Allow header of {path}: {:?}", r.headers);
    }
    // 400: malformed JSON, unknown field, bad values.
    let r = c.raw("POST", "/v1/sandboxes", b"{not json", &[]).unwrap();
    assert_eq!(r.status, 400);
    let err: Value = serde_json::from_slice(&r.body).unwrap();
    assert_eq!(err["error"]["code"], "invalid_argument");
    assert!(err["error"]["message"].as_str().unwrap().contains("JSON"));
    for bad in [
        json!({"image": "busybox", "bogus": 1}),
        json!({"image": "busybox", "memory": 10}),
        json!({"image": "busybox", "pids": 0}),
        json!({"image": "busybox", "cpus": -1}),
        json!({"image": "busybox", "hostname": "bad host!"}),
        json!({"image": "busybox", "env": ["NOEQUALS"]}),
        json!({"image": "Not A Name"}),
        json!({"memory": 1}),
    ] {
        assert_eq!(status_of(c.request("POST", "/v1/sandboxes", Some(&bad))), 400, "{bad}");
    }
    assert_eq!(status_of(c.request("POST", "/v1/images/import", Some(&json!({"path": "relative", "name": "x"})))), 400);
    // Nothing was made by any of the refused creates.
    assert_eq!(std::fs::read_dir(env.root.join("sandboxes")).unwrap().count(), 0);

    // 409: importing a taken name; removing an image in use.
    let img = image("busybox");
    let r = c.request("POST", "/v1/images/import", Some(&json!({"path": img, "name": "busybox"})));
    assert_eq!(status_of(r), 409);
    let id = create(&env, json!({"image": "busybox"}));
    assert_eq!(status_of(c.request("DELETE", "/v1/images/busybox:latest", none)), 409);
    let r = c.request("POST", &format!("/v1/sandboxes/{id}/exec"), Some(&json!({"argv": []})));
    assert_eq!(status_of(r), 400);
    // An env every exec would fail to carry is refused at create, with the
    // limit; an exec too large for the shim's message is refused (400, not
    // a 500 from sendmsg), and the sandbox runs on.
    let huge = format!("BIG={}", "x".repeat(100 << 10));
    match c.request("POST", "/v1/sandboxes", Some(&json!({"image": "busybox", "env": [huge]}))) {
        Err(ClientError::Api { status: 400, message, .. }) => assert!(message.contains("at most 65536"), "{message}"),
        other => panic!("expected 400, got {:?}", other.map(|_| ())),
    }
    let r =
        c.request("POST", &format!("/v1/sandboxes/{id}/exec"), Some(&json!({"argv": ["echo", "x".repeat(200_000)]})));
    match r {
        Err(ClientError::Api { status: 400, message, .. }) => assert!(message.contains("at most 131072"), "{message}"),
        other => panic!("expected 400, got {:?}", other.map(|_| ())),
    }
    assert_eq!(stdout(&sh(&env, &id, "echo ok")), "ok\n");
    // Two Content-Length headers: 400, not silence.
    {
        use std::io::{Read, Write};
        let mut s = std::os::unix::net::UnixStream::connect(&env.socket).unwrap();
        s.set_read_timeout(Some(std::time::Duration::from_secs(10))).unwrap();
        s.write_all(b"POST /v1/sandboxes HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 20\r\n\r\n{}")
            .unwrap();
        let mut buf = [0u8; 64];
        let n = s.read(&mut buf).unwrap();
        assert!(buf[..n].starts_with(b"HTTP/1.1 400"), "{:?}", String::from_utf8_lossy(&buf[..n]));
    }

    // 429: past --max-sandboxes, with the cap in the message and nothing half-made.
    match c.request("POST", "/v1/sandboxes", Some(&json!({"image": "busybox"}))) {
        Err(ClientError::Api { status: 429, message, .. }) => assert!(message.contains('1'), "{message}"),
        other => panic!("expected 429, got {:?}", other.map(|_| ())),
    }
    assert_eq!(std::fs::read_dir(env.root.join("sandboxes")).unwrap().count(), 1);
    let children: usize = env
        .cgroup_dirs()
        .iter()
        .map(|d| std::fs::read_dir(d).unwrap().flatten().filter(|e| e.path().is_dir()).count())
        .max()
        .unwrap_or(0);
    assert_eq!(children, 1, "a refused create left a cgroup");

    // After rm, the image can go, and its layers with it.
    env.cli_ok(&["rm", &id]);
    assert_eq!(status_of(c.request("DELETE", "/v1/images/busybox:latest", none)), 200);
    assert_eq!(std::fs::read_dir(env.root.join("layers")).unwrap().count(), 0);
    env.finish();
}

#[test]
fn one_daemon_per_root_and_tmp_is_swept() {
    let mut env = TestEnv::start();
    let out = std::process::Command::new(strata_bin())
        .args([
            "--socket",
            env.root.join("second.sock").to_str().unwrap(),
            "daemon",
            "--root",
            env.root.to_str().unwrap(),
        ])
        .arg("--cgroup-parent")
        .arg(&env.cgroup_parent)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("already running"), "{err}");

    std::fs::write(env.root.join("tmp/leftover"), b"x").unwrap();
    std::fs::create_dir_all(env.root.join("layers").join("f".repeat(64)).join("fs")).unwrap();
    env.stop_daemon();
    assert!(!env.socket.exists(), "socket removed on SIGTERM");
    env.start_daemon();
    assert!(!env.root.join("tmp/leftover").exists(), "tmp/ not swept");
    assert!(!env.root.join("layers").join("f".repeat(64)).exists(), "unknown layer dir not swept");
    // SIGTERM stops it even when its socket's path is gone.
    std::fs::remove_file(&env.socket).unwrap();
    let st = env.stop_daemon();
    assert!(st.success(), "{st}");
    env.start_daemon();
    env.finish();
}

#[test]
fn sandboxes_survive_a_daemon_kill() {
    let mut env = TestEnv::start();
    env.import_busybox();
    let id = create(&env, json!({"image": "busybox"}));
    sh(&env, &id, "echo kept > /tmp/state; (sleep 1000 >/dev/null 2>&1 &)");
    let v: Value = env.client().call("GET", &format!("/v1/sandboxes/{id}"), None::<&()>).unwrap();
    let shim = v["shim_pid"].as_i64().unwrap();

    // The daemon's warm shims (started ahead of creates) at the time of the kill.
    std::thread::sleep(Duration::from_millis(300));
    let warm: Vec<i32> = processes_matching("strata-shim")
        .into_iter()
        .map(|(pid, _)| pid)
        .filter(|pid| *pid != shim as i32)
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap_or_default().contains(&env.cgroup_parent)
        })
        .collect();
    assert!(!warm.is_empty(), "expected warm shims");
    env.kill_daemon();
    std::thread::sleep(Duration::from_millis(200));
    assert!(alive(shim as i32), "shim died with the daemon");

    env.start_daemon();
    env.reap_orphans();
    for pid in &warm {
        assert!(!alive(*pid), "warm shim {pid} of the killed daemon survived its restart");
    }
    let ps = env.cli_ok(&["ps"]);
    assert!(ps.contains(&id), "{ps}");
    assert_eq!(stdout(&sh(&env, &id, "cat /tmp/state")), "kept\n");
    assert!(stdout(&sh(&env, &id, "ps -o comm")).contains("sleep"), "background process lost");
    env.cli_ok(&["rm", &id]);
    assert!(!alive(shim as i32), "shim survived rm");
    env.reap_orphans();
    assert!(!Path::new(&format!("/proc/{shim}")).exists(), "orphaned shim not reaped");
    env.finish();
}

#[test]
fn pause_freezes_in_place_and_writes_nothing() {
    let mut env = TestEnv::start();
    env.import_busybox();
    let id = create(&env, json!({"image": "busybox"}));
    sh(&env, &id, "(i=0; while true; do i=$((i+1)); echo $i > /tmp/c; sleep 0.02; done) >/dev/null 2>&1 &");
    let counter = env.root.join("sandboxes").join(&id).join("upper/tmp/c");
    // `echo > file` truncates before it writes: retry a read that lands in between.
    let read = || {
        for _ in 0..200 {
            if let Ok(n) = std::fs::read_to_string(&counter).unwrap_or_default().trim().parse::<u64>() {
                return n;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        0
    };
    std::thread::sleep(Duration::from_millis(200));
    assert!(read() > 0, "counter never ran");

    let mut c = env.client();
    let none = None::<&()>;
    c.request("POST", &format!("/v1/sandboxes/{id}/pause"), none).unwrap();
    let v: Value = c.call("GET", &format!("/v1/sandboxes/{id}"), none).unwrap();
    assert_eq!(v["state"], "paused");
    // Frozen between truncate and write, the file stays empty: compare raw bytes.
    let raw = || std::fs::read(&counter).unwrap_or_default();
    let frozen_raw = raw();
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(raw(), frozen_raw, "a paused sandbox kept running");
    let frozen_at = String::from_utf8_lossy(&frozen_raw).trim().parse::<u64>().unwrap_or(0);
    // Exec into a paused sandbox is refused with a clear error; so is a second pause.
    match c.request("POST", &format!("/v1/sandboxes/{id}/exec"), Some(&json!({"argv": ["true"]}))) {
        Err(ClientError::Api { status: 409, message, .. }) => assert!(message.contains("paused"), "{message}"),
        other => panic!("exec into a paused sandbox: {:?}", other.map(|_| ())),
    }
    assert_eq!(status_of(c.request("POST", &format!("/v1/sandboxes/{id}/pause"), none)), 409);

    // Paused survives a daemon restart.
    env.kill_daemon();
    env.start_daemon();
    let mut c = env.client();
    let v: Value = c.call("GET", &format!("/v1/sandboxes/{id}"), none).unwrap();
    assert_eq!(v["state"], "paused");
    env.cli_ok(&["unpause", &id]);
    wait_until("unpause to resume the counter", Duration::from_secs(5), || read() > frozen_at);

    // A thousand pauses add nothing to the store.
    let count = |d: &str| std::fs::read_dir(env.root.join(d)).unwrap().count();
    let (layers, tmp) = (count("layers"), count("tmp"));
    let t = Instant::now();
    for _ in 0..1000 {
        c.request("POST", &format!("/v1/sandboxes/{id}/pause"), none).unwrap();
        c.request("POST", &format!("/v1/sandboxes/{id}/unpause"), none).unwrap();
    }
    eprintln!("1000 pause/unpause cycles in {:?}", t.elapsed());
    assert_eq!((count("layers"), count("tmp")), (layers, tmp));
    assert_eq!(stdout(&sh(&env, &id, "echo ok")), "ok\n");

    // A paused sandbox can be removed (frozen tasks are thawed to die).
    env.cli_ok(&["pause", &id]);
    env.cli_ok(&["rm", &id]);
    assert_eq!(status_of(c.request("POST", &format!("/v1/sandboxes/{id}/unpause"), none)), 404);
    env.finish();
}

/// `/v1/sandboxes/{id}/processes`: a command with the caller's stdio (host
/// files and FIFOs, as containerd hands a task's), its pid at once, its end
/// by a wait, signals, and forgetting it; bad paths, a FIFO nobody reads
/// and unknown processes are refused.
#[test]
fn processes_get_the_callers_stdio_and_report_their_end() {
    use std::os::unix::fs::OpenOptionsExt;
    let env = TestEnv::start();
    env.import_busybox();
    let id = create(&env, json!({"image": "busybox"}));
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("out");
    nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
    // Our read end first, as containerd opens it.
    let mut reader = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK).open(&fifo).unwrap();
    let err_file = dir.path().join("err");
    std::fs::write(&err_file, "").unwrap();
    let post =
        |path: &str, body: Value| env.client().request("POST", &format!("/v1/sandboxes/{id}{path}"), Some(&body));
    let started: Value = serde_json::from_slice(
        &post(
            "/processes",
            json!({"argv": ["sh", "-c", "echo out; echo err >&2; exit 3"], "stdout": fifo, "stderr": err_file}),
        )
        .unwrap(),
    )
    .unwrap();
    assert!(started["pid"].as_i64().unwrap() > 1, "{started}");
    let n = started["id"].as_u64().unwrap();
    let ended: Value =
        env.client().call("GET", &format!("/v1/sandboxes/{id}/processes/{n}?wait=20"), None::<&()>).unwrap();
    assert_eq!((ended["running"].as_bool(), ended["exit_code"].as_i64()), (Some(false), Some(3)), "{ended}");
    assert!(ended["exited_at"].as_i64().unwrap() >= started["started_at"].as_i64().unwrap());
    let mut out = String::new();
    std::io::Read::read_to_string(&mut reader, &mut out).unwrap();
    assert_eq!(out, "out\n");
    assert_eq!(std::fs::read_to_string(&err_file).unwrap(), "err\n");
    // It is in the exec log, as every command is.
    wait_until("the process in the exec log", Duration::from_secs(10), || {
        let log: Value = env.client().call("GET", &format!("/v1/sandboxes/{id}/logs"), None::<&()>).unwrap();
        log.as_array()
            .is_some_and(|l| l.iter().any(|r| r["argv"][2] == "echo out; echo err >&2; exit 3" && r["exit_code"] == 3))
    });

    // A signal ends a running one; until it has, it cannot be forgotten.
    let sleeper: Value =
        serde_json::from_slice(&post("/processes", json!({"argv": ["sleep", "100"]})).unwrap()).unwrap();
    let m = sleeper["id"].as_u64().unwrap();
    // A running one's host pid is the one whose innermost pid is `pid`
    // (one that ended before the daemon looked has none).
    let host = sleeper["host_pid"].as_i64().expect("a running process's host pid");
    let status = std::fs::read_to_string(format!("/proc/{host}/status")).unwrap();
    let inner = status.lines().find(|l| l.starts_with("NSpid:")).and_then(|l| l.split_whitespace().last());
    assert_eq!(inner, Some(sleeper["pid"].to_string().as_str()), "{sleeper}");
    let running: Value =
        env.client().call("GET", &format!("/v1/sandboxes/{id}/processes/{m}?wait=0"), None::<&()>).unwrap();
    assert_eq!(running["running"], true);
    match env.client().request("DELETE", &format!("/v1/sandboxes/{id}/processes/{m}"), None::<&()>) {
        Err(ClientError::Api { status: 409, message, .. }) => assert!(message.contains("still running"), "{message}"),
        other => panic!("expected 409 forgetting a running process, got {:?}", other.map(|_| ())),
    }
    post(&format!("/processes/{m}/signal"), json!({"signal": 15})).unwrap();
    let killed: Value =
        env.client().call("GET", &format!("/v1/sandboxes/{id}/processes/{m}?wait=20"), None::<&()>).unwrap();
    assert_eq!((killed["signal"].as_i64(), killed["exit_code"].as_i64()), (Some(15), Some(143)), "{killed}");
    let listed: Value = env.client().call("GET", &format!("/v1/sandboxes/{id}/processes"), None::<&()>).unwrap();
    assert_eq!(listed.as_array().unwrap().len(), 2);
    env.client().request("DELETE", &format!("/v1/sandboxes/{id}/processes/{m}"), None::<&()>).unwrap();
    assert_eq!(status_of(env.client().request("GET", &format!("/v1/sandboxes/{id}/processes/{m}"), None::<&()>)), 404);

    // Refused, starting nothing.
    let lonely = dir.path().join("lonely");
    nix::unistd::mkfifo(&lonely, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
    for (body, status, needle) in [
        (json!({"argv": ["true"], "stdout": "relative/out"}), 400, "absolute"),
        (json!({"argv": ["true"], "stdout": lonely}), 400, "nobody reads"),
        (json!({"argv": ["true"], "stdin": dir.path().join("missing")}), 400, "No such file"),
        (json!({"argv": []}), 400, "argv"),
        (json!({"argv": ["true"], "tty": true}), 400, "tty"),
    ] {
        match post("/processes", body.clone()) {
            Err(ClientError::Api { status: s, message, .. }) => {
                assert_eq!(s, status, "{body}: {message}");
                assert!(message.contains(needle), "{body}: {message}");
            }
            other => panic!("expected {status} for {body}, got {:?}", other.map(|_| ())),
        }
    }
    let listed: Value = env.client().call("GET", &format!("/v1/sandboxes/{id}/processes"), None::<&()>).unwrap();
    assert_eq!(listed.as_array().unwrap().len(), 1, "{listed}");
    for (method, path, status) in [
        ("GET", format!("/v1/sandboxes/{id}/processes/{n}?wait=61"), 400),
        ("GET", format!("/v1/sandboxes/{id}/processes/999"), 404),
        ("GET", format!("/v1/sandboxes/{id}/processes/x"), 400),
        ("PUT", format!("/v1/sandboxes/{id}/processes"), 405),
    ] {
        assert_eq!(status_of(env.client().request(method, &path, None::<&()>)), status, "{method} {path}");
    }
    let bad_signal = post(&format!("/processes/{n}/signal"), json!({"signal": 99}));
    assert_eq!(status_of(bad_signal), 400);
    // The sandbox's removal takes its processes with it.
    env.cli_ok(&["rm", &id]);
    assert_eq!(status_of(env.client().request("GET", &format!("/v1/sandboxes/{id}/processes"), None::<&()>)), 404);
    env.finish();
}

/// `rootfs`: a sandbox on a host directory as it is (containerd's mounted
/// root). Its commands see the directory's files and write into it; the
/// verbs that read Strata's layers refuse it (409); the directory stays
/// when the sandbox goes; a bad one is refused (400) and makes nothing.
#[test]
fn a_sandbox_runs_on_a_host_directory_as_it_is() {
    let env = TestEnv::start();
    env.import_busybox();
    // A root of our own: a copy of busybox's unpacked layer.
    let layer = std::fs::read_dir(env.root.join("layers"))
        .unwrap()
        .flatten()
        .map(|e| e.path().join("fs"))
        .find(|fs| fs.join("bin/busybox").exists())
        .expect("busybox's layer in the store");
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("rootfs");
    let copied = std::process::Command::new("cp").arg("-a").arg(&layer).arg(&root).status().unwrap();
    assert!(copied.success());
    std::fs::write(root.join("hello.txt"), "from the host\n").unwrap();

    let id = create(&env, json!({"rootfs": root}));
    let info: Value = env.client().call("GET", &format!("/v1/sandboxes/{id}"), None::<&()>).unwrap();
    assert_eq!(info["image"], "strata/rootfs:v1");
    assert_eq!(stdout(&sh(&env, &id, "cat /hello.txt; echo written > /from-inside")), "from the host\n");
    assert_eq!(std::fs::read_to_string(root.join("from-inside")).unwrap(), "written\n");
    // Its root is the directory, not an overlay of the store's layers.
    assert!(stdout(&sh(&env, &id, "grep ' / ' /proc/self/mountinfo")).lines().all(|l| !l.contains("overlay")));

    // What reads Strata's layers of it is refused, naming why.
    let c = |method: &str, path: String, body: Option<Value>| env.client().request(method, &path, body.as_ref());
    for (method, path, body) in [
        ("POST", format!("/v1/sandboxes/{id}/checkpoint"), Some(json!({}))),
        ("POST", format!("/v1/sandboxes/{id}/suspend"), None),
        ("GET", format!("/v1/sandboxes/{id}/diff"), None),
        ("POST", format!("/v1/sandboxes/{id}/baseline"), Some(json!({"repo": "/src/app", "ref": "main"}))),
    ] {
        match c(method, path.clone(), body) {
            Err(ClientError::Api { status: 409, message, .. }) => {
                assert!(message.contains("host directory"), "{message}")
            }
            other => panic!("expected 409 for {method} {path}, got {:?}", other.map(|_| ())),
        }
    }
    // With an image: its config (env, user, cwd) for the commands.
    let with_image = create(&env, json!({"rootfs": root, "image": "busybox"}));
    assert_eq!(stdout(&sh(&env, &with_image, "cat /hello.txt")), "from the host\n");
    env.cli_ok(&["rm", &id, &with_image]);
    assert_eq!(std::fs::read_to_string(root.join("hello.txt")).unwrap(), "from the host\n");

    // Refused, and nothing made.
    std::fs::write(dir.path().join("file"), "").unwrap();
    for (body, needle) in [
        (json!({"rootfs": "relative/root"}), "absolute"),
        (json!({"rootfs": dir.path().join("file")}), "not a directory"),
        (json!({"rootfs": dir.path().join("missing")}), "No such file"),
        (json!({"rootfs": root, "baseline": "acme/app@main"}), "baseline"),
        (json!({"rootfs": root, "userns": true}), "user namespace"),
        (json!({"rootfs": root, "image": "nope"}), "not found"),
    ] {
        match env.client().request("POST", "/v1/sandboxes", Some(&body)) {
            Err(ClientError::Api { status, message, .. }) => {
                assert!(status == 400 || status == 404, "{body}: {status} {message}");
                assert!(message.contains(needle), "{body}: {message}");
            }
            other => panic!("expected a refusal for {body}, got {:?}", other.map(|_| ())),
        }
    }
    let listed: Value = env.client().call("GET", "/v1/sandboxes", None::<&()>).unwrap();
    assert_eq!(listed.as_array().map(|a| a.len()), Some(0), "{listed}");
    env.finish();
}
