//! Hostile layers: huge, looping and bombed ones are handled without
//! harm and leave nothing behind.

use super::*;

/// Import the single-layer image made of `tar` (gzipped) as `name`.
fn import_layer(env: &TestEnv, name: &str, blob: corpus::LayerBlob) -> std::process::Output {
    let dir = tempfile::Builder::new().prefix("strata-test-layer-").tempdir().unwrap();
    corpus::write_layout_blobs(dir.path(), &[blob]);
    env.cli(&["image", "import", dir.path().to_str().unwrap(), "--name", name])
}

#[test]
fn large_and_looping_layers_are_handled_without_harm() {
    // On a tmpfs store: creating 100 000 files is quick there.
    let env = TestEnv::start_on_tmpfs(512 << 20);
    // 100 000 entries import (and are counted).
    let mut many = corpus::TarBuilder::new();
    for i in 0..1000 {
        many.dir(&format!("d{i}"));
        for j in 0..99 {
            many.file(&format!("d{i}/f{j}"), b"");
        }
    }
    let out = import_layer(&env, "many", corpus::LayerBlob::new(&many.finish(), true));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let images: Vec<serde_json::Value> = env.client().call("GET", "/v1/images", None::<&()>).unwrap();
    assert_eq!(images.len(), 1);
    // A long symlink chain and a symlink loop are stored, never followed.
    let mut links = corpus::TarBuilder::new();
    for i in 0..100 {
        links.symlink(&format!("l{i}"), &format!("l{}", i + 1));
    }
    links.symlink("l100", "/etc/shadow").symlink("loop-a", "loop-b").symlink("loop-b", "loop-a");
    let out = import_layer(&env, "links", corpus::LayerBlob::new(&links.finish(), true));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let layer = std::fs::read_dir(env.root.join("layers"))
        .unwrap()
        .map(|e| e.unwrap().path().join("fs"))
        .find(|p| p.join("l0").symlink_metadata().is_ok())
        .unwrap();
    assert_eq!(std::fs::read_link(layer.join("l100")).unwrap().to_str().unwrap(), "/etc/shadow");
    env.finish();
}

/// A gzip bomb: one 1 GiB file of `byte`, a few MiB compressed.
fn bomb(byte: u8) -> corpus::LayerBlob {
    use std::io::Write;
    let size: u64 = 1 << 30;
    let mut header = tar::Header::new_gnu();
    header.set_path("bomb").unwrap();
    header.set_size(size);
    header.set_mode(0o644);
    header.set_uid(0);
    header.set_gid(0);
    header.set_mtime(corpus::MTIME);
    header.set_entry_type(tar::EntryType::Regular);
    header.set_cksum();
    let mut tar_hash = sha2::Sha256::default();
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    let mut feed = |bytes: &[u8]| {
        sha2::Digest::update(&mut tar_hash, bytes);
        gz.write_all(bytes).unwrap();
    };
    feed(header.as_bytes());
    let chunk = vec![byte; 1 << 20];
    for _ in 0..(size >> 20) {
        feed(&chunk);
    }
    feed(&[0u8; 1024]);
    let blob = gz.finish().unwrap();
    assert!(blob.len() < 8 << 20, "the bomb is {} bytes", blob.len());
    let diff_id = format!("sha256:{}", hex::encode(sha2::Digest::finalize(tar_hash)));
    corpus::LayerBlob { blob, media_type: corpus::LAYER_GZIP, diff_id }
}

#[test]
fn a_gzip_bomb_fills_nothing_but_the_store_and_leaves_nothing() {
    // The store holds 192 MiB.
    let env = TestEnv::start_on_tmpfs(192 << 20);
    // 1 GiB of zeros is unpacked sparse: it imports and takes no space.
    let out = import_layer(&env, "zeros", bomb(0));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let st = nix::sys::statvfs::statvfs(&env.root).unwrap();
    let used = (st.blocks() - st.blocks_free()) * st.fragment_size();
    assert!(used < 32 << 20, "the sparse bomb takes {used} bytes");
    env.cli_ok(&["image", "rm", "zeros"]);
    // 1 GiB of 'A's fills the store: a clean 507, nothing of it left.
    let out = import_layer(&env, "bomb", bomb(b'A'));
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("No space left"), "{err}");
    assert_eq!((entries(&env, "layers"), entries(&env, "blobs/sha256")), (0, 0));
    wait_until("tmp/ not emptied", Duration::from_secs(10), || entries(&env, "tmp") == 0);
    env.cli_ok(&["image", "ls"]);
    env.finish();
}
