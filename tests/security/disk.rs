//! A disk cap: ENOSPC inside, and the host and other sandboxes spared.

use super::*;

/// Bytes available to root on the file system of `path`.
fn free_bytes(path: &std::path::Path) -> u64 {
    let s = nix::sys::statvfs::statvfs(path).unwrap();
    s.blocks_available() as u64 * s.fragment_size() as u64
}

#[test]
fn a_disk_cap_gives_enospc_inside_and_spares_the_host_and_other_sandboxes() {
    let env = TestEnv::start();
    env.import_busybox();
    // Bad caps are refused before anything is made: out of range, or past
    // the size of the store's whole file system.
    let st = nix::sys::statvfs::statvfs(&env.root).unwrap();
    let store_size = st.blocks() as u64 * st.fragment_size() as u64;
    for bad in [json!(1000), json!(-1), json!("big"), json!(1u64 << 50), json!(store_size + 4096)] {
        let r = env.client().request("POST", "/v1/sandboxes", Some(&json!({"image": "busybox", "disk": bad})));
        assert!(matches!(r, Err(strata::client::ClientError::Api { status: 400, .. })), "disk {bad}: {r:?}");
    }
    assert!(!env.root.join("sandboxes").read_dir().unwrap().any(|e| {
        let p = e.unwrap().path();
        p.join("rw").exists() || p.join("disk.img").exists()
    }));

    let before = free_bytes(&env.root);
    let a = create(&env, json!({"image": "busybox", "disk": 32 << 20}));
    let b = create(&env, json!({"image": "busybox", "disk": 32 << 20}));
    let c = create(&env, json!({"image": "busybox"}));
    // A writes past its cap: ENOSPC inside, a file no larger than the cap.
    let (code, out) = attempt(&env, &a, "dd if=/dev/zero of=/fill bs=1M count=64");
    assert_ne!(code, 0, "wrote 64 MiB under a 32 MiB cap: {out}");
    assert!(out.contains("No space left on device"), "{out}");
    let size: u64 = stdout(&sh(&env, &a, "stat -c %s /fill")).trim().parse().unwrap();
    assert!((24 << 20..=32 << 20).contains(&size), "filled {size} bytes of a 32 MiB cap");
    // The other sandboxes write as before, with or without a cap of their own.
    for id in [&b, &c] {
        let (code, out) = attempt(&env, id, "dd if=/dev/zero of=/f bs=1M count=8 2>&1 && echo ok");
        assert_eq!(code, 0, "{out}");
    }
    // The host lost what was written (the images are sparse), no more.
    let used = before.saturating_sub(free_bytes(&env.root));
    assert!(used < 72 << 20, "host free space dropped by {used} bytes for 48 MiB written");
    // Room comes back when A deletes; A works on.
    let (code, out) = attempt(&env, &a, "rm /fill && echo again > /again && cat /again");
    assert_eq!((code, out.as_str()), (0, "again\n"));

    // A checkpoint reads the upper off the disk; a suspend copies it off
    // (another file system) and releases the disk.
    sh(&env, &a, "mkdir -p /d && echo kept > /d/kept && rm /bin/true");
    let cp = env.cli_ok(&["checkpoint", &a]).trim().to_string();
    let snap = env.cli_ok(&["suspend", &a]).trim().to_string();
    assert!(!env.root.join("sandboxes").join(&a).exists());
    // Resumed with a cap again: same files, new empty disk.
    let r = env.cli_ok(&["resume", &snap, "--disk", "16m"]).trim().to_string();
    assert_eq!(stdout(&sh(&env, &r, "cat /d/kept /again; test -e /bin/true || echo gone")), "kept\nagain\ngone\n");
    let (code, out) = attempt(&env, &r, "dd if=/dev/zero of=/fill bs=1M count=32");
    assert!(code != 0 && out.contains("No space left on device"), "{out}");
    // A rollback keeps the cap.
    env.cli_ok(&["rollback", &r, "--to", &cp]);
    let info: serde_json::Value = env.client().call("GET", &format!("/v1/sandboxes/{r}"), None::<&()>).unwrap();
    assert_eq!(info["limits"]["disk"], 16 << 20, "{info}");
    let (code, out) = attempt(&env, &r, "cat /d/kept; dd if=/dev/zero of=/fill bs=1M count=32");
    assert!(code != 0 && out.starts_with("kept\n") && out.contains("No space left on device"), "{out}");
    // A suspend off a disk that cannot seal (an escaping symlink, unpacked
    // while 8 MiB of B's data is still to come down the pipe) says why,
    // not that the pipe broke.
    sh(&env, &b, "ln -s ../../../.. /a-esc");
    let r2 = env.client().request("POST", &format!("/v1/sandboxes/{b}/suspend"), None::<&()>);
    match r2 {
        Err(strata::client::ClientError::Api { status: 409, message, .. }) => {
            assert!(message.contains("cannot be sealed") && !message.contains("pipe"), "{message}")
        }
        other => panic!("suspend with an escaping symlink: {other:?}"),
    }
    // Removing a capped sandbox unmounts its disk and frees its loop device,
    // even when a warm shim was started (with a copy of the host's mounts,
    // this disk's among them) after the disk was mounted.
    let d = create(&env, json!({"image": "busybox"}));
    std::thread::sleep(std::time::Duration::from_millis(500)); // the pool refills
    let loops = loop_devices_under(&env.root);
    assert_eq!(loops.len(), 2, "{loops:?}");
    env.cli_ok(&["rm", &r]);
    wait_until("the disk of a removed sandbox is still attached", Duration::from_secs(10), || {
        loop_devices_under(&env.root).len() == 1
    });
    env.cli_ok(&["rm", &b, &c, &d]);
    assert!(mounts_under(&env.root).is_empty(), "{:?}", mounts_under(&env.root));
    env.finish();
}
