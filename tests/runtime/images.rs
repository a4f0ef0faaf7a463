//! Image import and pull: whiteouts, shared layers, hostile layers, old
//! archive formats, registries with and without credentials.

use super::*;

#[test]
fn hostile_layers_are_refused_and_leave_nothing() {
    let env = TestEnv::start();
    let work = tempfile::Builder::new().prefix("strata-test-corpus-").tempdir().unwrap();
    let mut cases: Vec<(String, std::path::PathBuf, Option<&str>, String)> = Vec::new();
    for (name, layers, escape) in corpus::hostile_cases() {
        let dir = work.path().join(name);
        corpus::write_layout(&dir, &layers, true);
        cases.push((name.to_string(), dir, escape, corpus::expected_message(name).to_string()));
    }
    for (name, make, expect) in corpus::layout_cases() {
        let dir = work.path().join(name);
        make(&dir);
        cases.push((name.to_string(), dir, None, expect.to_string()));
    }
    assert!(cases.len() >= 10, "corpus too small");
    let mut c = env.client();
    for (name, dir, escape, expect) in cases {
        let r = c.request("POST", "/v1/images/import", Some(&json!({"path": dir, "name": "hostile"})));
        match r {
            Err(ClientError::Api { status: 400, message, .. }) => {
                assert!(message.contains(&expect), "{name}: message {message:?} lacks {expect:?}");
            }
            Err(e) => panic!("{name}: expected 400, got {e:?}"),
            Ok(_) => panic!("{name}: hostile layer was accepted"),
        }
        assert_eq!(std::fs::read_dir(env.root.join("layers")).unwrap().count(), 0, "{name}: layer left");
        assert_eq!(std::fs::read_dir(env.root.join("tmp")).unwrap().count(), 0, "{name}: tmp left");
        if let Some(p) = escape {
            assert!(!Path::new(p).exists(), "{name}: escaped to {p}");
        }
    }
    let images: Vec<Value> = c.call("GET", "/v1/images", None::<&()>).unwrap();
    assert!(images.is_empty());
    env.finish();
}

#[test]
fn import_converts_whiteouts_and_shares_layers() {
    let env = TestEnv::start();
    let work = tempfile::Builder::new().prefix("strata-test-img-").tempdir().unwrap();
    // Lower layer: files, a hardlink, a symlink, a setuid file, an owned file.
    let mut base = corpus::TarBuilder::new();
    base.dir("a").file("a/x", b"gone").file("a/keep", b"kept").dir("b").file("b/y", b"hidden");
    base.hardlink("a/link", "a/keep").symlink("a/sym", "/a/keep").file_mode("a/suid", b"s", 0o4755);
    let base = base.finish();
    // Upper layer: delete a/x, make b opaque with a new file.
    let top = corpus::TarBuilder::new().file("a/.wh.x", b"").file("b/.wh..wh..opq", b"").file("b/z", b"new").finish();
    let busybox = image("busybox");
    // Put busybox underneath so the sandbox has a shell.
    let bb_layer = {
        let index: Value = serde_json::from_slice(&std::fs::read(busybox.join("index.json")).unwrap()).unwrap();
        let m = index["manifests"][0]["digest"].as_str().unwrap().trim_start_matches("sha256:").to_string();
        let manifest: Value =
            serde_json::from_slice(&std::fs::read(busybox.join("blobs/sha256").join(m)).unwrap()).unwrap();
        let l = manifest["layers"][0]["digest"].as_str().unwrap().trim_start_matches("sha256:").to_string();
        let gz = std::fs::read(busybox.join("blobs/sha256").join(l)).unwrap();
        let mut tar = Vec::new();
        std::io::Read::read_to_end(&mut flate2::read::GzDecoder::new(&gz[..]), &mut tar).unwrap();
        tar
    };
    let dir = work.path().join("layered");
    corpus::write_layout(&dir, &[bb_layer, base, top], true);
    env.cli_ok(&["image", "import", dir.to_str().unwrap(), "--name", "layered"]);
    let id = create(&env, json!({"image": "layered"}));
    let v = sh(&env, &id, "ls /a /b; cat /a/link; readlink /a/sym; stat -c %a /a/suid");
    // a/x deleted by a whiteout, b/y hidden by the opaque marker, the link kept.
    assert_eq!(stdout(&v), "/a:\nkeep\nlink\nsuid\nsym\n\n/b:\nz\nkept/a/keep\n4755\n", "{v}");
    let v = sh(&env, &id, "stat -c %h /a/keep");
    assert_eq!(stdout(&v).trim(), "2", "hardlink kept");

    // The same image as an OCI archive (written by skopeo) under a second name
    // shares every layer: nothing new is hydrated.
    let before = std::fs::read_dir(env.root.join("layers")).unwrap().count();
    let archive = work.path().join("busybox.tar");
    let st = std::process::Command::new("skopeo")
        .args([
            "copy",
            &format!("oci:{}:latest", busybox.display()),
            &format!("oci-archive:{}:latest", archive.display()),
        ])
        .status()
        .expect("skopeo");
    assert!(st.success());
    env.cli_ok(&["image", "import", archive.to_str().unwrap(), "--name", "bb-archive"]);
    assert_eq!(std::fs::read_dir(env.root.join("layers")).unwrap().count(), before, "shared layer was hydrated twice");
    let id2 = create(&env, json!({"image": "bb-archive"}));
    assert_eq!(stdout(&sh(&env, &id2, "echo ok")), "ok\n");
    assert_eq!(std::fs::read_dir(env.root.join("tmp")).unwrap().count(), 0);
    env.finish();
}

#[test]
fn an_image_built_by_umoci_with_deletions_imports_right() {
    let env = TestEnv::start();
    let work = tempfile::Builder::new().prefix("strata-test-umoci-").tempdir().unwrap();
    let layout = work.path().join("layout");
    let bundle = work.path().join("bundle");
    let run = |args: &[&str]| {
        let out = std::process::Command::new("umoci").args(args).output().unwrap();
        assert!(out.status.success(), "umoci {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    };
    let cp = std::process::Command::new("cp").arg("-a").arg(image("busybox")).arg(&layout).status().unwrap();
    assert!(cp.success());
    let img = format!("{}:latest", layout.display());
    run(&["unpack", "--image", &img, bundle.to_str().unwrap()]);
    let root = bundle.join("rootfs");
    // A deleted file, a deleted directory re-created with other contents, a new file.
    std::fs::remove_file(root.join("bin/true")).unwrap();
    std::fs::remove_dir_all(root.join("etc")).unwrap();
    std::fs::create_dir(root.join("etc")).unwrap();
    std::fs::write(root.join("etc/only"), b"umoci\n").unwrap();
    std::fs::write(root.join("added"), b"new\n").unwrap();
    run(&["repack", "--image", &img, bundle.to_str().unwrap()]);
    env.cli_ok(&["image", "import", layout.to_str().unwrap(), "--name", "umoci-built"]);
    let id = create(&env, json!({"image": "umoci-built"}));
    let v = sh(&env, &id, "ls /etc; cat /etc/only /added; ls /bin/true 2>&1; ls /bin/sh");
    assert_eq!(stdout(&v), "only\numoci\nnew\nls: /bin/true: No such file or directory\n/bin/sh\n", "{v}");
    env.finish();
}

#[test]
fn images_pull_from_registries_with_and_without_credentials() {
    let reg = registry::Registry::start_with_auth("strata", "s3cret pass");
    let env = TestEnv::start();
    let busybox = image("busybox");
    let st = std::process::Command::new("skopeo")
        .args([
            "copy",
            "--dest-tls-verify=false",
            "--dest-creds",
            "strata:s3cret pass",
            &format!("oci:{}", busybox.display()),
            &format!("docker://{}/library/busybox:1", reg.addr()),
        ])
        .output()
        .unwrap();
    assert!(st.status.success(), "skopeo copy: {}", String::from_utf8_lossy(&st.stderr));
    let reference = format!("{}/library/busybox:1", reg.addr());
    let pull = |user: Option<&str>, password: &str| {
        let mut cmd = std::process::Command::new(strata_bin());
        cmd.env("STRATA_SOCKET", &env.socket).args(["image", "pull", &reference, "--insecure"]);
        if let Some(u) = user {
            cmd.env("STRATA_REGISTRY_USERNAME", u).env("STRATA_REGISTRY_PASSWORD", password);
        }
        cmd.output().unwrap()
    };
    // No credentials, then wrong ones: refused, clearly, nothing recorded.
    let out = pull(None, "");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("refused the credentials (none were given)"), "{out:?}");
    let out = pull(Some("strata"), "wrong");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("refused the credentials"), "{out:?}");
    assert!(env.cli_ok(&["image", "ls"]).lines().count() == 1);
    // Right ones: the image is pulled, with progress, and runs.
    let out = pull(Some("strata"), "s3cret pass");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "library/busybox:1");
    assert!(String::from_utf8_lossy(&out.stderr).contains("fetch "), "{}", String::from_utf8_lossy(&out.stderr));
    let id = create(&env, json!({"image": "library/busybox:1"}));
    assert_eq!(stdout(&sh(&env, &id, "echo pulled")), "pulled\n");
    // The same image under another name reuses every layer.
    let again: Value = env
        .client()
        .call(
            "POST",
            "/v1/images/pull",
            Some(&json!({"reference": reference, "insecure": true, "name": "copy:1",
                         "username": "strata", "password": "s3cret pass"})),
        )
        .unwrap();
    assert_eq!(again["fetched_blobs"], 1, "{again}");
    assert_eq!(again["reused_layers"], again["image"]["layers"].as_array().unwrap().len(), "{again}");
    // The imported image's layers match the layout's: same diff_ids.
    let local: Value = env.client().call("GET", "/v1/images/library/busybox:1", None::<&()>).unwrap();
    assert_eq!(local["layers"], again["image"]["layers"]);
    env.finish();
}

#[test]
fn a_pulled_layer_that_lies_or_is_hostile_is_refused() {
    use strata::registry::Client as Registry;
    let reg = registry::Registry::start();
    let a = TestEnv::start();
    let b = TestEnv::start();
    a.import_busybox();
    b.import_busybox();
    let id = create(&a, json!({"image": "busybox"}));
    assert_eq!(sh(&a, &id, "echo fine > /tmp/fine")["exit_code"], 0);
    let snap = a.cli_ok(&["checkpoint", &id, "--compression", "gzip"]).trim().to_string();
    push_snapshot(&a, &reg, &snap, "s/real:1").unwrap();

    // Forge snapshots from the real one: its last layer replaced by `tar`,
    // its config claiming `diff_id`, under a new snapshot id.
    let client = Registry::new(&reg.addr(), true, None);
    let (_, manifest, _) = client.get_manifest("s/real", "1").unwrap();
    let manifest: Value = serde_json::from_slice(&manifest).unwrap();
    let cdesc = &manifest["config"];
    let mut config = Vec::new();
    let cdigest: strata::oci::Digest = cdesc["digest"].as_str().unwrap().parse().unwrap();
    client.get_blob("s/real", &cdigest, cdesc["size"].as_u64().unwrap(), &mut config, &mut |_| {}).unwrap();
    let forge = |tag: &str, snapshot_id: &str, tar: &[u8], diff_id: &str| {
        let blob = corpus::gzip(tar);
        let digest: strata::oci::Digest = corpus::sha256(&blob).parse().unwrap();
        client.push_bytes("s/real", &digest, &blob).unwrap();
        let mut cfg: Value = serde_json::from_slice(&config).unwrap();
        let n = cfg["rootfs"]["diff_ids"].as_array().unwrap().len();
        cfg["rootfs"]["diff_ids"][n - 1] = json!(diff_id);
        let mut chain: Value =
            serde_json::from_str(cfg["config"]["Labels"]["dev.strata.chain"].as_str().unwrap()).unwrap();
        let last = chain["snapshots"].as_array().unwrap().len() - 1;
        chain["snapshots"][last]["id"] = json!(snapshot_id);
        chain["snapshots"][last]["work_context"] = json!(format!("forged-{tag}"));
        // The real chain's logs name the real snapshot ids: not this one's.
        chain.as_object_mut().unwrap().remove("records");
        cfg["config"]["Labels"]["dev.strata.chain"] = json!(chain.to_string());
        let cfg = serde_json::to_vec(&cfg).unwrap();
        let cd: strata::oci::Digest = corpus::sha256(&cfg).parse().unwrap();
        client.push_bytes("s/real", &cd, &cfg).unwrap();
        let mut m = manifest.clone();
        m["config"] = json!({"mediaType": "application/vnd.oci.image.config.v1+json", "digest": cd, "size": cfg.len()});
        let n = m["layers"].as_array().unwrap().len();
        m["layers"][n - 1] =
            json!({"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": digest, "size": blob.len()});
        client
            .put_manifest("s/real", tag, "application/vnd.oci.image.manifest.v1+json", &serde_json::to_vec(&m).unwrap())
            .unwrap();
    };
    let before = (store_entries(&b, "layers"), store_entries(&b, "blobs/sha256"));

    // A layer whose content is not what the config says: refused by the
    // pull itself, naming the registry; nothing recorded or left.
    let tar = corpus::TarBuilder::new().file("tmp/x", b"x\n").finish();
    forge("lies", "00000000000000a1", &tar, &corpus::sha256(b"something else"));
    let e = pull_snapshot(&b, &reg, "s/real:lies").unwrap_err();
    assert_eq!(e.status(), Some(502), "{e}");
    assert!(e.to_string().contains("diff_id") && e.to_string().contains(&reg.addr()), "{e}");
    assert_eq!((store_entries(&b, "layers"), store_entries(&b, "blobs/sha256")), before);

    // A hostile layer (an entry climbing out of the tree) that is what its
    // config says: the pull records it, its unpack refuses it, a resume is
    // refused with the reason, and nothing of it is unpacked anywhere.
    let tar = corpus::TarBuilder::new().file("../escaped", b"x\n").finish();
    forge("hostile", "00000000000000a2", &tar, &corpus::sha256(&tar));
    let pulled = pull_snapshot(&b, &reg, "s/real:hostile").unwrap();
    assert_eq!(pulled["snapshot"]["id"], "00000000000000a2", "{pulled}");
    let e = b.client().call::<Value>("POST", "/v1/snapshots/00000000000000a2/resume", Some(&json!({}))).unwrap_err();
    assert_eq!(e.status(), Some(400), "{e}");
    assert!(e.to_string().contains("cannot be unpacked"), "{e}");
    let layer = corpus::sha256(&tar)[7..].to_string();
    assert!(!b.root.join("layers").join(&layer).exists());
    assert!(!b.root.join("escaped").exists() && !b.root.join("layers/escaped").exists());
    // It can be removed like any snapshot, and then nothing of it is left.
    b.client().call::<Value>("POST", "/v1/lineages/forged-hostile/retire", None::<&()>).unwrap();
    b.client().request("DELETE", "/v1/snapshots/00000000000000a2", None::<&()>).unwrap();
    assert_eq!((store_entries(&b, "layers"), store_entries(&b, "blobs/sha256")), before);
    a.finish();
    b.finish();
}

/// The content of `path` in image `name`'s bottom layer, as hydrated.
fn bottom_layer_file(env: &TestEnv, name: &str, path: &str) -> String {
    let info: Value = env.client().call("GET", &format!("/v1/images/{name}"), None::<&()>).unwrap();
    let diff_id = info["layers"][0].as_str().unwrap().trim_start_matches("sha256:").to_string();
    std::fs::read_to_string(env.root.join("layers").join(diff_id).join("fs").join(path)).unwrap()
}

#[test]
fn a_layout_with_several_tags_imports_the_one_named() {
    let env = TestEnv::start();
    let work = tempfile::Builder::new().prefix("strata-test-tags-").tempdir().unwrap();
    let layout = work.path().join("multi");
    std::fs::create_dir(&layout).unwrap();
    // Three images in one layout, each layer saying which it is.
    let mut manifests = Vec::new();
    for tag in ["one", "two", "three"] {
        let tar = corpus::TarBuilder::new().dir("etc").file("etc/which", tag.as_bytes()).finish();
        corpus::write_layout(&layout, &[tar], true);
        let index: Value = serde_json::from_slice(&std::fs::read(layout.join("index.json")).unwrap()).unwrap();
        let mut m = index["manifests"][0].clone();
        m["annotations"]["org.opencontainers.image.ref.name"] = json!(tag);
        manifests.push(m);
    }
    let index =
        json!({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json", "manifests": manifests});
    std::fs::write(layout.join("index.json"), index.to_string()).unwrap();
    let which = |name: &str| bottom_layer_file(&env, name, "etc/which");

    // Without a tag: refused, and the error says which tags there are.
    let out = env.cli(&["image", "import", layout.to_str().unwrap(), "--name", "x:untagged"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains(r#"["one", "two", "three"]"#), "{err}");
    // DIR:TAG on the CLI, `tag` in the API, ARCHIVE:TAG.
    env.cli_ok(&["image", "import", &format!("{}:two", layout.display()), "--name", "x:two"]);
    assert_eq!(which("x:two"), "two");
    let body = json!({"path": layout.to_str().unwrap(), "tag": "three", "name": "x:three"});
    let _: Value = env.client().call("POST", "/v1/images/import", Some(&body)).unwrap();
    assert_eq!(which("x:three"), "three");
    // As `docker save` (Docker 25 and later) writes it: the layout plus
    // Docker's own manifest.json and repositories, which are not read.
    std::fs::write(layout.join("manifest.json"), r#"[{"Config":"blobs/sha256/0","RepoTags":["x:one"],"Layers":[]}]"#)
        .unwrap();
    std::fs::write(layout.join("repositories"), r#"{"x":{"one":"0"}}"#).unwrap();
    let archive = work.path().join("multi.tar");
    let st = std::process::Command::new("tar").arg("-cf").arg(&archive).arg("-C").arg(&layout).arg(".").status();
    assert!(st.unwrap().success());
    env.cli_ok(&["image", "import", &format!("{}:one", archive.display()), "--name", "x:one"]);
    assert_eq!(which("x:one"), "one");
    // A tag it does not hold: 400 listing those it does, nothing stored.
    let body = json!({"path": layout.to_str().unwrap(), "tag": "four", "name": "x:four"});
    match env.client().call::<Value>("POST", "/v1/images/import", Some(&body)) {
        Err(strata::client::ClientError::Api { status: 400, message, .. }) => {
            assert!(message.contains("four") && message.contains(r#"["one", "two", "three"]"#), "{message}")
        }
        other => panic!("{other:?}"),
    }
    let images: Value = env.client().call("GET", "/v1/images", None::<&()>).unwrap();
    assert_eq!(images.as_array().unwrap().len(), 3, "{images}");
    env.finish();
}

#[test]
fn a_docker_save_archive_of_the_old_format_imports() {
    let env = TestEnv::start();
    let work = tempfile::Builder::new().prefix("strata-test-docker-save-").tempdir().unwrap();
    // As `docker save` wrote it before Docker 25: manifest.json, a config
    // file per image and `<id>/layer.tar` per layer; no index.json.
    let dir = work.path().join("saved");
    let mut images = Vec::new();
    for which in ["a", "b"] {
        let tar = corpus::TarBuilder::new().dir("etc").file("etc/which", which.as_bytes()).finish();
        let id = corpus::sha256(&tar)[7..].to_string();
        std::fs::create_dir_all(dir.join(&id)).unwrap();
        std::fs::write(dir.join(&id).join("layer.tar"), &tar).unwrap();
        let config = json!({"architecture": "amd64", "os": "linux", "config": {"Env": ["PATH=/bin"]},
                            "rootfs": {"type": "layers", "diff_ids": [format!("sha256:{id}")]}})
        .to_string();
        let config_file = format!("{}.json", &corpus::sha256(config.as_bytes())[7..]);
        std::fs::write(dir.join(&config_file), &config).unwrap();
        images.push(json!({"Config": config_file, "RepoTags": [format!("legacy:{which}")], "Layers": [format!("{id}/layer.tar")]}));
    }
    let archive = |name: &str, manifest: &Value| {
        std::fs::write(dir.join("manifest.json"), manifest.to_string()).unwrap();
        let path = work.path().join(name);
        let st = std::process::Command::new("tar").arg("-cf").arg(&path).arg("-C").arg(&dir).arg(".").status();
        assert!(st.unwrap().success());
        path
    };
    let both = archive("both.tar", &json!(images));
    let which = |name: &str| bottom_layer_file(&env, name, "etc/which");
    // Two images: a tag picks one (the tag alone on the CLI, NAME:TAG in the API).
    let out = env.cli(&["image", "import", both.to_str().unwrap(), "--name", "x:none"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains(r#"["legacy:a", "legacy:b"]"#), "{err}");
    env.cli_ok(&["image", "import", &format!("{}:a", both.display()), "--name", "x:a"]);
    assert_eq!(which("x:a"), "a");
    let body = json!({"path": both.to_str().unwrap(), "tag": "legacy:b", "name": "x:b"});
    let _: Value = env.client().call("POST", "/v1/images/import", Some(&body)).unwrap();
    assert_eq!(which("x:b"), "b");
    // A layer path out of the archive is refused, and nothing is stored.
    let mut bad = images[0].clone();
    bad["Layers"] = json!(["../../etc/passwd"]);
    let hostile = archive("hostile.tar", &json!([bad]));
    let body = json!({"path": hostile.to_str().unwrap(), "name": "x:bad"});
    match env.client().call::<Value>("POST", "/v1/images/import", Some(&body)) {
        Err(strata::client::ClientError::Api { status: 400, message, .. }) => {
            assert!(message.contains(".."), "{message}")
        }
        other => panic!("{other:?}"),
    }
    let images: Value = env.client().call("GET", "/v1/images", None::<&()>).unwrap();
    assert_eq!(images.as_array().unwrap().len(), 2, "{images}");
    env.finish();
}
