//! Snapshots across hosts through a registry, and its failures.

use super::*;

#[test]
fn a_snapshot_pushed_from_one_host_forks_on_another() {
    let reg = registry::Registry::start();
    let a = TestEnv::start();
    let b = TestEnv::start();
    a.import_busybox();
    b.import_busybox();
    let id = create(&a, json!({"image": "busybox", "work_context": "moved-1"}));
    let v = sh(
        &a,
        &id,
        "set -e; echo one > /tmp/one; head -c 2097152 /dev/urandom > /tmp/random; rm /bin/true; \
         mkdir -p /work/d; ln -s ../tmp/one /work/link; echo g >> /etc/group",
    );
    assert_eq!(v["exit_code"], 0, "{v}");
    let want = tree(&a, &id);
    let snap = a.cli_ok(&["checkpoint", &id, "--compression", "gzip"]).trim().to_string();
    let a_info: Value = a.client().call("GET", &format!("/v1/snapshots/{snap}"), None::<&()>).unwrap();

    // Push with the CLI (progress on stderr, REF@digest on stdout).
    let out = a.cli_ok(&["snapshot", "push", &snap, &format!("{}/strata/moved:v1", reg.addr()), "--insecure"]);
    assert!(out.trim().starts_with(&format!("{}/strata/moved:v1@sha256:", reg.addr())), "{out}");
    // A second push sends nothing but the manifest.
    let again = push_snapshot(&a, &reg, &snap, "strata/moved:v1").unwrap();
    assert_eq!(again["uploaded_blobs"], 0, "{again}");

    // Host B has the image: it fetches the config and the snapshot's blob only.
    let pulled = pull_snapshot(&b, &reg, "strata/moved:v1").unwrap();
    let image_layers = a_info["layers"].as_array().unwrap().len() - 1;
    assert_eq!(pulled["reused_layers"], image_layers, "{pulled}");
    assert_eq!(pulled["fetched_blobs"], 2, "{pulled}");
    let config_max = 64 * 1024;
    let fetched = pulled["fetched_bytes"].as_u64().unwrap();
    let blob = a_info["blob_size"].as_u64().unwrap();
    assert!(fetched >= blob && fetched < blob + config_max, "fetched {fetched}, blob {blob}");
    let s = &pulled["snapshot"];
    for k in ["id", "diff_id", "blob_digest", "class", "work_context", "sequence", "layers"] {
        assert_eq!(s[k], a_info[k], "{k}: {s} vs {a_info}");
    }
    assert_eq!(s["state"], "ready", "{s}");
    assert_eq!(pulled["image"]["name"], "busybox:latest", "{pulled}");
    // Its layer is unpacked in the background; the pull did not wait.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let info: Value = b.client().call("GET", &format!("/v1/snapshots/{snap}"), None::<&()>).unwrap();
        if info["hydrating"] == false {
            break;
        }
        assert!(Instant::now() < deadline, "still hydrating: {info}");
        std::thread::sleep(Duration::from_millis(50));
    }

    // Three forks on B see exactly the tree A checkpointed.
    let forks: Vec<Value> =
        b.client().call("POST", &format!("/v1/snapshots/{snap}/fork"), Some(&json!({"count": 3}))).unwrap();
    assert_eq!(forks.len(), 3);
    for f in &forks {
        assert_eq!(tree(&b, f["id"].as_str().unwrap()), want);
    }
    // The lineage continues on B by the ladder.
    let lineage: Value = b.client().call("GET", "/v1/lineages/moved-1", None::<&()>).unwrap();
    assert_eq!(lineage["head"], json!(snap), "{lineage}");

    // A moves on (a new checkpoint of the same upper: its parent is the
    // image) and B follows the lineage.
    assert_eq!(sh(&a, &id, "echo two > /tmp/two")["exit_code"], 0);
    let snap2 = a.cli_ok(&["checkpoint", &id, "--compression", "gzip"]).trim().to_string();
    push_snapshot(&a, &reg, &snap2, "strata/moved:v2").unwrap();
    let pulled2 = pull_snapshot(&b, &reg, "strata/moved:v2").unwrap();
    assert_eq!(pulled2["snapshot"]["predecessor"], json!(snap), "{pulled2}");
    let lineage: Value = b.client().call("GET", "/v1/lineages/moved-1", None::<&()>).unwrap();
    assert_eq!(lineage["head"], json!(snap2), "{lineage}");
    // A fork of the first snapshot, checkpointed on A: its chain holds the
    // first snapshot's layer, which B reuses; only the new layer is fetched.
    let fork: Vec<Value> = a.client().call("POST", &format!("/v1/snapshots/{snap}/fork"), Some(&json!({}))).unwrap();
    let fid = fork[0]["id"].as_str().unwrap().to_string();
    assert_eq!(sh(&a, &fid, "echo three > /tmp/three")["exit_code"], 0);
    let snap3 = a.cli_ok(&["checkpoint", &fid]).trim().to_string();
    push_snapshot(&a, &reg, &snap3, "strata/moved:v3").unwrap();
    let pulled3 = pull_snapshot(&b, &reg, "strata/moved:v3").unwrap();
    assert_eq!(pulled3["reused_layers"], image_layers + 1, "{pulled3}");
    assert_eq!(pulled3["fetched_blobs"], 2, "{pulled3}");
    assert_eq!(pulled3["snapshot"]["parent"], json!(snap), "{pulled3}");
    let r: Value = b.client().call("POST", &format!("/v1/snapshots/{snap3}/resume"), Some(&json!({}))).unwrap();
    assert_eq!(stdout(&sh(&b, r["id"].as_str().unwrap(), "cat /tmp/one /tmp/three")), "one\nthree\n");
    // B pushes what it pulled to another repository of the same registry:
    // the layers are mounted from the first, not uploaded (the config is
    // new: it records where the chain was pulled from; so is the small
    // blob of its logs in that repository).
    let moved: Value = push_snapshot(&b, &reg, &snap, "strata/elsewhere:v1").unwrap();
    assert_eq!(moved["mounted_blobs"], image_layers + 1, "{moved}");
    assert_eq!(moved["uploaded_blobs"], 2, "{moved}");
    // Pulling what B has is a no-op that fetches no layer.
    let again = pull_snapshot(&b, &reg, "strata/moved:v1").unwrap();
    assert_eq!(again["fetched_blobs"], 1, "{again}");

    // The pushed snapshot is an ordinary image: skopeo reads it and copies
    // it to an OCI layout that umoci unpacks to the tree the sandbox saw.
    let url = format!("docker://{}/strata/moved:v1", reg.addr());
    let st = std::process::Command::new("skopeo").args(["inspect", "--tls-verify=false", &url]).output().unwrap();
    assert!(st.status.success(), "skopeo inspect: {}", String::from_utf8_lossy(&st.stderr));
    let inspected: Value = serde_json::from_slice(&st.stdout).unwrap();
    assert!(inspected["Labels"]["dev.strata.chain"].is_string(), "{inspected}");
    let work = tempfile::Builder::new().prefix("strata-test-skopeo-").tempdir().unwrap();
    let layout = work.path().join("layout");
    let st = std::process::Command::new("skopeo")
        .args(["copy", "--src-tls-verify=false", &url, &format!("oci:{}:v1", layout.display())])
        .output()
        .unwrap();
    assert!(st.status.success(), "skopeo copy: {}", String::from_utf8_lossy(&st.stderr));
    let got = umoci_tree(&format!("{}:v1", layout.display()), &work.path().join("bundle"));
    assert_eq!(got, want, "umoci's tree differs from the sandbox's");
    a.finish();
    b.finish();
}

#[test]
fn registry_failures_are_clean_and_leave_nothing_partial() {
    let mut reg = registry::Registry::start();
    let a = TestEnv::start_with_env(&[("STRATA_FAILPOINTS", "push.blob-sent=sleep-once:3000")]);
    let b = TestEnv::start();
    a.import_busybox();
    let id = create(&a, json!({"image": "busybox"}));
    assert_eq!(sh(&a, &id, "head -c 4194304 /dev/urandom > /tmp/big")["exit_code"], 0);
    let snap = a.cli_ok(&["checkpoint", &id]).trim().to_string();

    // The registry dies mid-push: a clean 502 naming it; pushing again
    // after it is back resumes (what it had is not sent again).
    let a_socket = a.socket.clone();
    let (r_addr, snap2) = (reg.addr(), snap.clone());
    let push = std::thread::spawn(move || {
        strata::client::Client::connect(&a_socket).unwrap().call::<Value>(
            "POST",
            &format!("/v1/snapshots/{snap2}/push"),
            Some(&json!({"reference": format!("{r_addr}/s/x:1"), "insecure": true})),
        )
    });
    // Stopped once the first blob is sent (the failpoint then holds the push).
    a.wait_logged("failpoint push.blob-sent reached", Duration::from_secs(30));
    reg.stop();
    let e = push.join().unwrap().unwrap_err();
    assert_eq!(e.status(), Some(502), "{e}");
    assert!(e.to_string().contains(&reg.addr()), "{e}");
    reg.restart();
    let resumed = push_snapshot(&a, &reg, &snap, "s/x:1").unwrap();
    assert!(resumed["present_blobs"].as_u64().unwrap() >= 1, "{resumed}");

    // A missing tag is 404 naming the registry.
    let e = pull_snapshot(&b, &reg, "s/x:nope").unwrap_err();
    assert_eq!(e.status(), Some(404), "{e}");
    assert!(e.to_string().contains(&reg.addr()), "{e}");

    // A blob with the wrong content, then a missing blob: the pull fails
    // naming digest and registry; B's store and database are unchanged.
    let info: Value = a.client().call("GET", &format!("/v1/snapshots/{snap}"), None::<&()>).unwrap();
    let digest = info["blob_digest"].as_str().unwrap().to_string();
    let data = reg.blob_data(&digest);
    let good = std::fs::read(&data).unwrap();
    let (layers, blobs) = (store_entries(&b, "layers"), store_entries(&b, "blobs/sha256"));
    let mut bad = good.clone();
    let n = bad.len();
    bad[n / 2] ^= 0xff;
    std::fs::write(&data, &bad).unwrap();
    let e = pull_snapshot(&b, &reg, "s/x:1").unwrap_err();
    assert_eq!(e.status(), Some(502), "{e}");
    assert!(e.to_string().contains(&digest) && e.to_string().contains(&reg.addr()), "{e}");
    std::fs::remove_file(&data).unwrap();
    let e = pull_snapshot(&b, &reg, "s/x:1").unwrap_err();
    assert!(e.to_string().contains(&digest) && e.to_string().contains(&reg.addr()), "{e}");
    assert_eq!(store_entries(&b, "layers"), layers);
    assert_eq!(store_entries(&b, "blobs/sha256"), blobs);
    assert!(store_entries(&b, "tmp").is_empty());
    let snaps: Vec<Value> = b.client().call("GET", "/v1/snapshots", None::<&()>).unwrap();
    assert!(snaps.is_empty(), "{snaps:?}");
    let images: Vec<Value> = b.client().call("GET", "/v1/images", None::<&()>).unwrap();
    assert!(images.is_empty(), "{images:?}");
    // Restored, the same pull succeeds.
    std::fs::write(&data, &good).unwrap();
    pull_snapshot(&b, &reg, "s/x:1").unwrap();

    // A plain image is not a snapshot.
    let busybox = image("busybox");
    let st = std::process::Command::new("skopeo")
        .args([
            "copy",
            "--dest-tls-verify=false",
            &format!("oci:{}", busybox.display()),
            &format!("docker://{}/library/busybox:1", reg.addr()),
        ])
        .output()
        .unwrap();
    assert!(st.status.success(), "skopeo copy: {}", String::from_utf8_lossy(&st.stderr));
    let e = pull_snapshot(&b, &reg, "library/busybox:1").unwrap_err();
    assert_eq!(e.status(), Some(400), "{e}");
    assert!(e.to_string().contains("not a Strata snapshot"), "{e}");
    a.finish();
    b.finish();
}
