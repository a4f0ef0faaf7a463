//! `--userns`: root inside is an unprivileged host range, and layers
//! stay shared.

use super::*;

/// The `Uid:` line of /proc/<pid>/status: real, effective, saved, fs.
fn host_uids(pid: i32) -> String {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status.lines().find_map(|l| l.strip_prefix("Uid:")).unwrap().split_whitespace().collect::<Vec<_>>().join(" ")
}

#[test]
fn userns_maps_root_to_an_unprivileged_host_range_and_keeps_layers_shared() {
    let env = TestEnv::start();
    env.import_busybox();
    let plain = create(&env, json!({"image": "busybox"}));
    let a = create(&env, json!({"image": "busybox", "userns": true}));
    let b = create(&env, json!({"image": "busybox", "userns": true}));
    let info = |id: &str| -> serde_json::Value {
        env.client().call("GET", &format!("/v1/sandboxes/{id}"), None::<&()>).unwrap()
    };
    let (ia, ib) = (info(&a), info(&b));
    let (base_a, base_b) = (ia["userns"]["host_id"].as_u64().unwrap(), ib["userns"]["host_id"].as_u64().unwrap());
    assert!(base_a >= 65536 && base_b >= 65536 && base_a.abs_diff(base_b) >= 65536, "{ia} {ib}");
    assert!(info(&plain).get("userns").is_none());

    // Root inside; the shim and every command are the range's first id on
    // the host.
    assert_eq!(stdout(&sh(&env, &a, "id -u; id -g")), "0\n0\n");
    let map = stdout(&sh(&env, &a, "cat /proc/self/uid_map"));
    assert_eq!(map.split_whitespace().collect::<Vec<_>>(), ["0", &base_a.to_string(), "65536"], "{map}");
    let shim = ia["shim_pid"].as_i64().unwrap() as i32;
    assert_eq!(host_uids(shim), format!("{base_a} {base_a} {base_a} {base_a}"));
    // The image's files are root's inside (layers are seen through an
    // idmapped mount, not copied or chowned).
    assert_eq!(stdout(&sh(&env, &a, "stat -c '%u:%g' /bin/busybox /")), "0:0\n0:0\n");
    // What the sandbox writes is stored unshifted: owner 0 (and 1234) on disk.
    let v = sh(&env, &a, "echo hi > /f && touch /g && chown 1234:5678 /g && mkdir -p /d && chmod 700 /d");
    assert_eq!(v["exit_code"], 0, "{v}");
    let upper = env.root.join("sandboxes").join(&a).join("rw/upper");
    let meta = |p: &str| {
        let m = std::fs::metadata(upper.join(p)).unwrap();
        (std::os::unix::fs::MetadataExt::uid(&m), std::os::unix::fs::MetadataExt::gid(&m))
    };
    assert_eq!((meta("f"), meta("g"), meta("d")), ((0, 0), (1234, 5678), (0, 0)));
    // Root inside has no power over host ids: ids outside the map cannot be
    // set, and the layers on disk stayed root's.
    let (code, out) = attempt(&env, &a, "chown 70000 /f");
    assert_ne!(code, 0, "chown to an unmapped id worked: {out}");
    let layer = std::fs::read_dir(env.root.join("layers")).unwrap().next().unwrap().unwrap().path();
    let m = std::fs::metadata(layer.join("fs/bin/busybox")).unwrap();
    assert_eq!(std::os::unix::fs::MetadataExt::uid(&m), 0);
    // The plain sandbox shares the same layers and sees the same owners.
    assert_eq!(stdout(&sh(&env, &plain, "stat -c '%u:%g' /bin/busybox")), "0:0\n");

    // What root wrote in a user namespace must never run as host root: a
    // snapshot captured in one resumes, forks and continues only in one
    // (inherited when not asked; refused when asked without).
    // (Forks here: a resume waits until a leaves the lineage, below.)
    let snap = env.cli_ok(&["checkpoint", &a]).trim().to_string();
    let r = env.cli_ok(&["fork", &snap]).trim().to_string();
    assert!(info(&r)["userns"]["host_id"].as_u64().is_some(), "{}", info(&r));
    assert_eq!(stdout(&sh(&env, &r, "cat /f; stat -c '%u:%g' /g /d")), "hi\n1234:5678\n0:0\n");
    let r = env.client().request("POST", &format!("/v1/snapshots/{snap}/fork"), Some(&json!({"userns": false})));
    assert!(matches!(r, Err(strata::client::ClientError::Api { status: 400, .. })), "fork: {r:?}");
    let r2 = env.cli_ok(&["fork", &snap, "--userns"]).trim().to_string();
    assert_eq!(stdout(&sh(&env, &r2, "cat /f; stat -c '%u:%g' /g")), "hi\n1234:5678\n");
    // A later checkpoint of the plain sandbox is not affected.
    let plain_snap = env.cli_ok(&["checkpoint", &plain]).trim().to_string();
    let p2 = env.cli_ok(&["fork", &plain_snap]).trim().to_string();
    assert!(info(&p2).get("userns").is_none());

    // Files in and out.
    let tmp = tempfile::tempdir().unwrap();
    std::fs::write(tmp.path().join("in"), "copied\n").unwrap();
    env.cli_ok(&["cp", tmp.path().join("in").to_str().unwrap(), &format!("{a}:/in")]);
    assert_eq!(stdout(&sh(&env, &a, "cat /in; stat -c %u /in")), "copied\n0\n");
    env.cli_ok(&["cp", &format!("{a}:/f"), tmp.path().join("out").to_str().unwrap()]);
    assert_eq!(std::fs::read_to_string(tmp.path().join("out")).unwrap(), "hi\n");

    // Suspend and rollback keep working; a rollback keeps the range.
    env.cli_ok(&["rollback", &a, "--to", &snap]);
    assert_eq!(info(&a)["userns"]["host_id"].as_u64(), Some(base_a));
    assert_eq!(stdout(&sh(&env, &a, "cat /f; id -u")), "hi\n0\n");
    let s2 = env.cli_ok(&["suspend", &b]).trim().to_string();
    let r3 = env.cli_ok(&["resume", &s2, "--userns"]).trim().to_string();
    assert_eq!(stdout(&sh(&env, &r3, "id -u")), "0\n");
    // a gone, its snapshot resumes: only in a user namespace.
    env.cli_ok(&["rm", &a]);
    let r = env.client().request("POST", &format!("/v1/snapshots/{snap}/resume"), Some(&json!({"userns": false})));
    assert!(matches!(r, Err(strata::client::ClientError::Api { status: 400, .. })), "resume: {r:?}");
    let r4 = env.cli_ok(&["resume", &snap]).trim().to_string();
    assert_eq!(stdout(&sh(&env, &r4, "cat /f; stat -c '%u:%g' /g; id -u")), "hi\n1234:5678\n0\n");
    assert!(info(&r4)["userns"]["host_id"].as_u64().is_some(), "{}", info(&r4));

    // With a disk cap too: the idmapped upper is the disk's root.
    let both = create(&env, json!({"image": "busybox", "userns": true, "disk": 32 << 20}));
    let (code, out) = attempt(&env, &both, "echo x > /x && id -u && dd if=/dev/zero of=/fill bs=1M count=64");
    assert!(code != 0 && out.starts_with("0\n") && out.contains("No space left on device"), "{out}");
    let m = std::fs::metadata(env.root.join("sandboxes").join(&both).join("rw/upper/x")).unwrap();
    assert_eq!(std::os::unix::fs::MetadataExt::uid(&m), 0);

    // Caches are host directories: refused with a user namespace.
    let r = env.client().request(
        "POST",
        "/v1/sandboxes",
        Some(&json!({"image": "busybox", "userns": true, "cache": ["c:/c"]})),
    );
    assert!(matches!(r, Err(strata::client::ClientError::Api { status: 400, .. })), "{r:?}");
    env.finish();
}
