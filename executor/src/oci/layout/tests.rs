//! Unit tests of `layout`.

use super::*;
use crate::oci::corpus::{self, TarBuilder};
use serde_json::json;

fn one_layer() -> Vec<Vec<u8>> {
    vec![TarBuilder::new().file("hello", b"hi").finish()]
}

fn layout(layers: &[Vec<u8>], compress: bool) -> (tempfile::TempDir, corpus::WrittenLayout) {
    let dir = tempfile::tempdir().unwrap();
    let written = corpus::write_layout(dir.path(), layers, compress);
    (dir, written)
}

fn write_index(dir: &Path, manifests: serde_json::Value) {
    let index = json!({"schemaVersion": 2, "mediaType": MEDIA_OCI_INDEX, "manifests": manifests});
    fs::write(dir.join("index.json"), index.to_string()).unwrap();
}

fn manifest_desc(dir: &Path, written: &corpus::WrittenLayout) -> serde_json::Value {
    let size = fs::metadata(blob_path(dir, &written.manifest.parse().unwrap())).unwrap().len();
    json!({"mediaType": MEDIA_OCI_MANIFEST, "digest": written.manifest, "size": size})
}

#[test]
fn reads_a_layout_directory() {
    let layers = vec![TarBuilder::new().file("a", b"1").finish(), TarBuilder::new().file("b", b"2").finish()];
    let (dir, written) = layout(&layers, true);
    let img = open_dir(dir.path(), None).unwrap();
    assert_eq!(img.manifest_digest.as_str(), written.manifest);
    assert_eq!(img.config_digest.as_str(), written.config);
    assert_eq!(Digest::sha256(&img.config_json), img.config_digest);
    assert_eq!(Digest::sha256(&img.manifest_json), img.manifest_digest);
    assert_eq!(img.layers.len(), 2);
    for (i, l) in img.layers.iter().enumerate() {
        assert_eq!(l.digest.as_str(), written.blobs[i]);
        assert_eq!(l.diff_id, Digest::sha256(&layers[i]));
        assert_eq!(l.compression, Compression::Gzip);
        assert_eq!(l.size, fs::metadata(&l.blob_path).unwrap().len());
    }
    assert_eq!(img.config.env, vec!["PATH=/usr/bin:/bin".to_owned()]);
    assert_eq!(img.config.cmd, vec!["/bin/sh".to_owned()]);
    assert_eq!(img.config.working_dir.as_deref(), Some("/work"));
    assert_eq!(img.config.user, None);
    // The scratch dir is untouched for directory input.
    let scratch = tempfile::tempdir().unwrap();
    assert_eq!(open(dir.path(), scratch.path(), Some("latest")).unwrap(), img);
    assert_eq!(fs::read_dir(scratch.path()).unwrap().count(), 0);
}

#[test]
fn image_config_round_trips_through_serde() {
    let c = ImageConfig {
        env: vec!["A=1".into()],
        working_dir: Some("/w".into()),
        user: Some("1000:1000".into()),
        entrypoint: vec!["/init".into()],
        cmd: vec![],
    };
    let back: ImageConfig = serde_json::from_str(&serde_json::to_string(&c).unwrap()).unwrap();
    assert_eq!(back, c);
    assert_eq!(serde_json::from_str::<ImageConfig>("{}").unwrap(), ImageConfig::default());
}

#[test]
fn selects_by_tag_and_refuses_ambiguity() {
    let (dir, written) = layout(&one_layer(), false);
    let mut a = manifest_desc(dir.path(), &written);
    let mut b = a.clone();
    a["annotations"] = json!({REF_NAME: "v1"});
    b["annotations"] = json!({REF_NAME: "v2"});
    write_index(dir.path(), json!([a, b]));
    assert!(open_dir(dir.path(), Some("v2")).is_ok());
    match open_dir(dir.path(), Some("v3")) {
        Err(LayoutError::TagNotFound { available, .. }) => assert_eq!(available, ["v1", "v2"]),
        other => panic!("{other:?}"),
    }
    match open_dir(dir.path(), None) {
        Err(e @ LayoutError::Ambiguous { count: 2, .. }) => {
            assert!(e.to_string().ends_with(r#"choose one by tag (PATH:TAG): ["v1", "v2"]"#), "{e}")
        }
        other => panic!("{other:?}"),
    }
    write_index(dir.path(), json!([]));
    assert!(matches!(open_dir(dir.path(), None), Err(LayoutError::NoManifest)));
}

#[test]
fn follows_a_nested_index_to_the_host_platform() {
    let (dir, written) = layout(&one_layer(), true);
    let (os, arch) = host_platform();
    let mut host = manifest_desc(dir.path(), &written);
    host["platform"] = json!({"os": os, "architecture": arch});
    // A decoy for another platform that points at a missing blob: picking
    // it would fail.
    let decoy = json!({"mediaType": MEDIA_OCI_MANIFEST, "size": 10,
        "digest": format!("sha256:{}", "0".repeat(64)),
        "platform": {"os": "linux", "architecture": "s390x-not-this"}});
    let nested = json!({"schemaVersion": 2, "mediaType": MEDIA_OCI_INDEX, "manifests": [decoy, host]});
    let nested = nested.to_string().into_bytes();
    let nested_digest = corpus::write_blob(dir.path(), &nested);
    write_index(
        dir.path(),
        json!([{"mediaType": MEDIA_OCI_INDEX, "digest": nested_digest, "size": nested.len(),
            "annotations": {REF_NAME: "latest"}}]),
    );
    let img = open_dir(dir.path(), Some("latest")).unwrap();
    assert_eq!(img.manifest_digest.as_str(), written.manifest);

    // Only another platform on offer: refused, not guessed.
    let only_decoy = json!({"schemaVersion": 2, "manifests": [{"mediaType": MEDIA_OCI_MANIFEST,
        "size": 10, "digest": format!("sha256:{}", "0".repeat(64)),
        "platform": {"os": "linux", "architecture": "s390x-not-this"}}]});
    let only_decoy = only_decoy.to_string().into_bytes();
    let d = corpus::write_blob(dir.path(), &only_decoy);
    write_index(dir.path(), json!([{"mediaType": MEDIA_OCI_INDEX, "digest": d, "size": only_decoy.len()}]));
    assert!(matches!(open_dir(dir.path(), None), Err(LayoutError::NoPlatform { .. })));
    // A descriptor without the media type the spec requires: refused.
    write_index(dir.path(), json!([{"digest": d, "size": only_decoy.len()}]));
    assert!(matches!(open_dir(dir.path(), None), Err(LayoutError::Parse { what: "index.json", .. })));
}

#[test]
fn accepts_docker_v2s2_media_types() {
    let dir = tempfile::tempdir().unwrap();
    let tar = TarBuilder::new().file("x", b"y").finish();
    let blob = corpus::gzip(&tar);
    let layer = corpus::write_blob(dir.path(), &blob);
    let config = json!({"architecture": "amd64", "os": "linux", "config": {"Cmd": null, "User": ""},
        "rootfs": {"type": "layers", "diff_ids": [corpus::sha256(&tar)]}})
    .to_string()
    .into_bytes();
    let config_digest = corpus::write_blob(dir.path(), &config);
    let manifest = json!({"schemaVersion": 2, "mediaType": MEDIA_DOCKER_MANIFEST,
        "config": {"mediaType": MEDIA_DOCKER_CONFIG, "digest": config_digest, "size": config.len()},
        "layers": [{"mediaType": "application/vnd.docker.image.rootfs.diff.tar.gzip",
            "digest": layer, "size": blob.len()}]})
    .to_string()
    .into_bytes();
    let m = corpus::write_blob(dir.path(), &manifest);
    fs::write(dir.path().join("oci-layout"), r#"{"imageLayoutVersion":"1.0.0"}"#).unwrap();
    write_index(dir.path(), json!([{"mediaType": MEDIA_DOCKER_MANIFEST, "digest": m, "size": manifest.len()}]));
    let img = open_dir(dir.path(), None).unwrap();
    assert_eq!(img.layers[0].compression, Compression::Gzip);
    assert_eq!(img.config, ImageConfig::default());
}

#[test]
fn refuses_blobs_that_do_not_match_their_descriptor() {
    let (dir, written) = layout(&one_layer(), false);
    let mpath = blob_path(dir.path(), &written.manifest.parse().unwrap());
    let good = fs::read(&mpath).unwrap();

    // Same size, different content.
    let mut bad = good.clone();
    let last = bad.len() - 2;
    bad[last] = b' ';
    fs::write(&mpath, &bad).unwrap();
    assert!(matches!(open_dir(dir.path(), None), Err(LayoutError::BlobDigest { .. })));

    // Different size.
    let mut longer = good.clone();
    longer.push(b'\n');
    fs::write(&mpath, &longer).unwrap();
    assert!(matches!(open_dir(dir.path(), None), Err(LayoutError::BlobSize { .. })));

    // A symlink in place of the blob is not followed.
    fs::remove_file(&mpath).unwrap();
    let elsewhere = dir.path().join("elsewhere");
    fs::write(&elsewhere, &good).unwrap();
    std::os::unix::fs::symlink(&elsewhere, &mpath).unwrap();
    assert!(matches!(open_dir(dir.path(), None), Err(LayoutError::OpenBlob { .. })));
}

#[test]
fn refuses_bad_digests_before_touching_the_file_system() {
    let (dir, written) = layout(&one_layer(), false);
    for digest in [
        "sha512:00".to_owned(),
        format!("sha256:../../../../etc/passwd{}", "0".repeat(38)),
        written.manifest.to_uppercase(),
    ] {
        write_index(dir.path(), json!([{"mediaType": MEDIA_OCI_MANIFEST, "digest": digest, "size": 1}]));
        // oci-spec's descriptor refuses most as it parses; what it
        // accepts (another algorithm) is refused as not sha256.
        let r = open_dir(dir.path(), None);
        assert!(
            matches!(r, Err(LayoutError::InvalidDigest { .. } | LayoutError::Parse { what: "index.json", .. })),
            "{digest}: {r:?}"
        );
    }
}

#[test]
fn refuses_layer_count_mismatch_and_unknown_layer_types() {
    let dir = tempfile::tempdir().unwrap();
    let tar = TarBuilder::new().file("x", b"y").finish();
    let layer = corpus::write_blob(dir.path(), &tar);
    let write = |diff_ids: serde_json::Value, layer_type: &str| {
        let config =
            json!({"architecture": "amd64", "os": "linux", "rootfs": {"type": "layers", "diff_ids": diff_ids}})
                .to_string();
        let cd = corpus::write_blob(dir.path(), config.as_bytes());
        let manifest = json!({"schemaVersion": 2, "mediaType": MEDIA_OCI_MANIFEST,
            "config": {"mediaType": MEDIA_OCI_CONFIG, "digest": cd, "size": config.len()},
            "layers": [{"mediaType": layer_type, "digest": layer, "size": tar.len()}]})
        .to_string();
        let m = corpus::write_blob(dir.path(), manifest.as_bytes());
        fs::write(dir.path().join("oci-layout"), r#"{"imageLayoutVersion":"1.0.0"}"#).unwrap();
        write_index(dir.path(), json!([{"mediaType": MEDIA_OCI_MANIFEST, "digest": m, "size": manifest.len()}]));
    };
    let tar_type = "application/vnd.oci.image.layer.v1.tar";
    write(json!([]), tar_type);
    assert!(matches!(open_dir(dir.path(), None), Err(LayoutError::LayerCount { layers: 1, diff_ids: 0 })));
    write(json!([corpus::sha256(&tar)]), "application/vnd.example.unknown");
    assert!(matches!(open_dir(dir.path(), None), Err(LayoutError::MediaType { what: "layer", .. })));
    write(json!([corpus::sha256(&tar)]), tar_type);
    let img = open_dir(dir.path(), None).unwrap();
    assert_eq!(img.layers[0].compression, Compression::None);
}

#[test]
fn refuses_other_layout_versions() {
    let (dir, _) = layout(&one_layer(), false);
    fs::write(dir.path().join("oci-layout"), r#"{"imageLayoutVersion":"2.0.0"}"#).unwrap();
    assert!(matches!(open_dir(dir.path(), None), Err(LayoutError::LayoutVersion { .. })));
}

/// Tars a layout directory the way `skopeo copy oci-archive:` does.
fn tar_dir(dir: &Path) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    b.append_dir_all(".", dir).unwrap();
    b.into_inner().unwrap()
}

#[test]
fn reads_an_oci_archive() {
    let (dir, written) = layout(&one_layer(), true);
    let work = tempfile::tempdir().unwrap();
    let archive = work.path().join("image.tar");
    fs::write(&archive, tar_dir(dir.path())).unwrap();
    let scratch = work.path().join("scratch");
    fs::create_dir(&scratch).unwrap();
    let img = open(&archive, &scratch, None).unwrap();
    assert_eq!(img.manifest_digest.as_str(), written.manifest);
    assert!(img.layers[0].blob_path.starts_with(&scratch));

    // The scratch dir must be empty.
    assert!(matches!(open(&archive, &scratch, None), Err(LayoutError::ScratchNotEmpty { .. })));
}

#[test]
fn refuses_hostile_archive_entries() {
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (TarBuilder::new().symlink("blobs", "/etc").finish(), "symlink"),
        (TarBuilder::new().hardlink("index.json", "/etc/passwd").finish(), "hard link"),
        (TarBuilder::new().file("../escape", b"x").finish(), "'..'"),
        (TarBuilder::new().file("/escape", b"x").finish(), "absolute"),
        (TarBuilder::new().char_dev("dev", 1, 1).finish(), "character device"),
        (TarBuilder::new().fifo("fifo").finish(), "fifo"),
    ];
    for (tar, want) in cases {
        let work = tempfile::tempdir().unwrap();
        let archive = work.path().join("a.tar");
        fs::write(&archive, tar).unwrap();
        let scratch = work.path().join("scratch");
        fs::create_dir(&scratch).unwrap();
        let err = extract_archive(&archive, &scratch).unwrap_err().to_string();
        assert!(err.contains(want), "{err}");
        assert!(!work.path().join("escape").exists());
    }
}

#[test]
fn refuses_a_truncated_archive() {
    let (dir, _) = layout(&one_layer(), false);
    let mut tar = tar_dir(dir.path());
    // Cut inside the data of the last blob entry.
    let cut = tar.len() - 1024 - 100;
    tar.truncate(cut);
    let work = tempfile::tempdir().unwrap();
    let archive = work.path().join("a.tar");
    fs::write(&archive, tar).unwrap();
    let scratch = work.path().join("scratch");
    fs::create_dir(&scratch).unwrap();
    let err = extract_archive(&archive, &scratch).unwrap_err();
    assert!(matches!(err, LayoutError::ArchiveTruncated { .. } | LayoutError::ReadArchive { .. }), "{err:?}");
}
