//! Escape tests (root only): code in a sandbox tries to reach the host, the
//! daemon or the shim, and each attempt must fail safely and leave the host
//! unchanged. See docs/security.md for the defence each one exercises.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use strata_tests::*;

/// Run `script` in the sandbox; returns (exit code, stdout + stderr).
fn attempt(env: &TestEnv, id: &str, script: &str) -> (i64, String) {
    let v = sh(env, id, script);
    (v["exit_code"].as_i64().unwrap(), format!("{}{}", stdout(&v), v["stderr"].as_str().unwrap_or("")))
}

#[test]
fn a_sandbox_cannot_reach_the_shim_the_daemon_or_host_processes() {
    let env = TestEnv::start();
    env.import_busybox();
    // With and without a user namespace (there the shim and the commands
    // are the same host id, so only non-dumpability keeps them apart).
    for userns in [false, true] {
        reach_attempts(&env, &create(&env, json!({"image": "busybox", "userns": userns})));
    }
    env.finish();
}

fn reach_attempts(env: &TestEnv, id: &str) {
    // The shim is PID 1 here: its memory, fds and environment are closed
    // to the sandbox's root (no CAP_SYS_PTRACE; the shim is not dumpable).
    for probe in ["cat /proc/1/environ", "readlink /proc/1/fd/0", "head -c1 /proc/1/mem", "readlink /proc/1/exe"] {
        let (code, out) = attempt(env, id, &format!("{probe} >/dev/null"));
        assert_ne!(code, 0, "{probe} worked: {out}");
        assert!(out.is_empty() || out.contains("ermission denied") || out.contains("not permitted"), "{probe}: {out}");
    }
    // None of its descriptors (the daemon connection, the store's log) can
    // be followed or reopened.
    let (code, out) =
        attempt(env, id, "for f in /proc/1/fd/*; do readlink $f && exit 1; cat $f </dev/null && exit 1; done; exit 0");
    assert_eq!(code, 0, "a shim fd could be followed: {out}");
    // Host processes are not visible, so not signalled: the daemon's pid
    // (and the host's init) name nothing, or the sandbox's own PID 1.
    let daemon = env.daemon.as_ref().unwrap().id();
    let (code, out) = attempt(env, id, &format!("kill -9 {daemon}"));
    assert_ne!(code, 0, "kill of the daemon's pid worked: {out}");
    assert!(std::path::Path::new(&format!("/proc/{daemon}")).exists(), "daemon died");
    let (code, out) = attempt(env, id, "ps -o pid,comm | wc -l");
    assert_eq!(code, 0, "{out}");
    // ps, its shell and the shim (and a header line): nothing of the host.
    assert!(out.trim().parse::<u32>().unwrap() <= 5, "{out}");
    // The daemon's socket is not in the sandbox's file system.
    let (_, out) = attempt(env, id, "find / -xdev -type s 2>/dev/null; echo end");
    assert_eq!(out, "end\n", "sockets visible: {out}");
}

#[test]
fn a_sandbox_cannot_mount_load_modules_or_write_kernel_settings() {
    let env = TestEnv::start();
    env.import_busybox();
    let host_hostname = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap();
    for userns in [false, true] {
        let id = create(&env, json!({"image": "busybox", "userns": userns}));
        mount_and_kernel_attempts(&env, &id);
    }
    // The host is unchanged.
    assert_eq!(std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap(), host_hostname);
    env.finish();
}

fn mount_and_kernel_attempts(env: &TestEnv, id: &str) {
    for (what, script) in [
        ("mount a tmpfs", "mkdir -p /m && mount -t tmpfs none /m"),
        ("remount / read-write elsewhere", "mount -o remount,rw /"),
        ("mount proc again", "mkdir -p /p && mount -t proc proc /p"),
        ("bind the host's root", "mkdir -p /h && mount --bind / /h"),
        ("write /proc/sys", "echo evil > /proc/sys/kernel/hostname"),
        ("write /proc/sysrq-trigger", "echo h > /proc/sysrq-trigger"),
        ("write /sys", "echo 1 > /sys/kernel/mm/ksm/run"),
        ("read /proc/kcore", "head -c1 /proc/kcore | wc -c | grep -q 1"),
        ("make a device node", "mknod /tmp/sda b 8 0"),
        ("load a module", "insmod /nonexistent.ko || modprobe dummy"),
        ("unshare a user namespace", "unshare -U true"),
        ("chroot out via a new mount namespace", "unshare -m true"),
    ] {
        let (code, out) = attempt(env, id, script);
        assert_ne!(code, 0, "{what}: it worked: {out}");
    }
    // And the sandbox still works.
    assert_eq!(stdout(&sh(env, id, "echo ok")), "ok\n");
}

/// `strata cp` with the CLI; returns (success, stderr).
fn cp(env: &TestEnv, src: &str, dst: &str) -> (bool, String) {
    let out = env.cli(&["cp", src, dst]);
    (out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned())
}

#[test]
fn cp_copies_files_trees_and_tar_streams_in_and_out() {
    use std::os::unix::fs::PermissionsExt;
    let env = TestEnv::start();
    env.import_busybox();
    let id = create(&env, json!({"image": "busybox"}));
    let work = tempfile::Builder::new().prefix("strata-test-cp-").tempdir().unwrap();
    let tree = work.path().join("tree");
    std::fs::create_dir_all(tree.join("sub")).unwrap();
    std::fs::write(tree.join("a"), "alpha\n").unwrap();
    std::fs::write(tree.join("sub/b"), "beta\n").unwrap();
    std::os::unix::fs::symlink("sub/b", tree.join("link")).unwrap();
    // A tree into an existing directory, a file to a new name.
    let (ok, err) = cp(&env, tree.to_str().unwrap(), &format!("{id}:/tmp"));
    assert!(ok, "{err}");
    let (ok, err) = cp(&env, tree.join("a").to_str().unwrap(), &format!("{id}:/etc/renamed"));
    assert!(ok, "{err}");
    let v = sh(&env, &id, "cat /tmp/tree/a /tmp/tree/sub/b /etc/renamed; readlink /tmp/tree/link");
    assert_eq!(stdout(&v), "alpha\nbeta\nalpha\nsub/b\n", "{v}");
    // Out again: the same tree; a setuid file loses its setuid bit.
    assert_eq!(sh(&env, &id, "cp /bin/busybox /tmp/tree/suid && chmod 4755 /tmp/tree/suid")["exit_code"], 0);
    let back = work.path().join("back");
    let (ok, err) = cp(&env, &format!("{id}:/tmp/tree"), back.to_str().unwrap());
    assert!(ok, "{err}");
    assert_eq!(std::fs::read_to_string(back.join("sub/b")).unwrap(), "beta\n");
    assert_eq!(std::fs::read_link(back.join("link")).unwrap().to_str().unwrap(), "sub/b");
    assert_eq!(std::fs::metadata(back.join("suid")).unwrap().permissions().mode() & 0o7777, 0o755);
    // Tar streams: out to stdout, in from stdin.
    let out = std::process::Command::new(strata_bin())
        .env("STRATA_SOCKET", &env.socket)
        .args(["cp", &format!("{id}:/tmp/tree/sub"), "-"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let mut names: Vec<String> = tar::Archive::new(&out.stdout[..])
        .entries()
        .unwrap()
        .map(|e| e.unwrap().path().unwrap().to_string_lossy().trim_end_matches('/').to_string())
        .collect();
    names.sort();
    assert_eq!(names, ["sub", "sub/b"]);
    let mut child = std::process::Command::new(strata_bin())
        .env("STRATA_SOCKET", &env.socket)
        .args(["cp", "-", &format!("{id}:/root")])
        .stdin(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::io::Write::write_all(child.stdin.as_mut().unwrap(), &out.stdout).unwrap();
    drop(child.stdin.take());
    assert!(child.wait().unwrap().success());
    assert_eq!(stdout(&sh(&env, &id, "cat /root/sub/b")), "beta\n");
    // A symlink to a host path comes out as it is (as with docker cp), or
    // not at all with --no-symlinks.
    assert_eq!(
        sh(&env, &id, "mkdir /tmp/links && echo f > /tmp/links/f && ln -s /etc/shadow /tmp/links/s")["exit_code"],
        0
    );
    for (flag, expect) in [(None, true), (Some("--no-symlinks"), false)] {
        let dest = work.path().join(format!("links-{}", flag.is_some()));
        let mut args = vec!["cp"];
        args.extend(flag);
        let src = format!("{id}:/tmp/links");
        args.extend([src.as_str(), dest.to_str().unwrap()]);
        let out = env.cli(&args);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        assert_eq!(std::fs::read_to_string(dest.join("f")).unwrap(), "f\n");
        assert_eq!(std::fs::symlink_metadata(dest.join("s")).is_ok(), expect, "{flag:?}");
        if !expect {
            assert!(String::from_utf8_lossy(&out.stderr).contains("left out 1 symlinks"), "{out:?}");
        }
    }
    env.finish();
}

#[test]
fn cp_never_leaves_the_sandbox_root() {
    let env = TestEnv::start();
    env.import_busybox();
    let id = create(&env, json!({"image": "busybox"}));
    // A host directory with a secret; the sandbox knows its path.
    let host = tempfile::Builder::new().prefix("strata-test-cp-host-").tempdir().unwrap();
    let hdir = host.path().to_str().unwrap().to_string();
    std::fs::write(host.path().join("secret"), "host secret\n").unwrap();
    let out = host.path().join("got");
    let input = host.path().join("input");
    std::fs::write(&input, "from the host\n").unwrap();
    let untouched = |what: &str| {
        let mut names: Vec<String> = std::fs::read_dir(host.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n != "got")
            .collect();
        names.sort();
        assert_eq!(names, ["input", "secret"], "{what}: the host directory changed");
        if let Ok(got) = std::fs::read_to_string(&out) {
            assert!(!got.contains("host secret"), "{what}: the host secret was read");
        }
    };
    // `..` stops at the sandbox's root.
    let (ok, err) = cp(&env, &format!("{id}:/../../../../..{hdir}/secret"), out.to_str().unwrap());
    assert!(!ok, "read through ..");
    assert!(err.contains("No such file"), "{err}");
    untouched("..");
    // Symlinks planted by the sandbox resolve inside it: an absolute link
    // to the host path, a link to /, a magic link to the shim's root.
    let v = sh(
        &env,
        &id,
        &format!("ln -s {hdir} /tmp/abs && ln -s / /tmp/root && ln -s /proc/1/root /tmp/magic && ln -s ../../../../.. /tmp/up"),
    );
    assert_eq!(v["exit_code"], 0, "{v}");
    for link in ["/tmp/abs/secret", &format!("/tmp/root{hdir}/secret"), &format!("/tmp/up{hdir}/secret")] {
        let (ok, _) = cp(&env, &format!("{id}:{link}"), out.to_str().unwrap());
        assert!(!ok, "read through {link}");
        untouched(link);
        let (ok, _) = cp(&env, input.to_str().unwrap(), &format!("{id}:{link}-new"));
        assert!(!ok, "wrote through {link}");
        untouched(link);
    }
    let (ok, err) = cp(&env, &format!("{id}:/tmp/magic/etc/hostname"), out.to_str().unwrap());
    assert!(!ok, "read through a magic link");
    assert!(err.contains("leaves the sandbox's root file system"), "{err}");
    // /proc, /sys and /dev are other mounts: not reachable.
    let (ok, _) = cp(&env, &format!("{id}:/proc/1/environ"), out.to_str().unwrap());
    assert!(!ok, "read the shim's environment");
    // A FIFO cannot hang the daemon.
    assert_eq!(sh(&env, &id, "mkfifo /tmp/fifo")["exit_code"], 0);
    let (ok, err) = cp(&env, &format!("{id}:/tmp/fifo"), out.to_str().unwrap());
    assert!(!ok && err.contains("FIFO"), "{err}");
    // The swap race: the sandbox swaps /tmp/x between a directory and a
    // symlink to the host directory while the host copies through it.
    let v = sh(
        &env,
        &id,
        &format!(
            "(while :; do rm -rf /tmp/x; mkdir /tmp/x; echo decoy > /tmp/x/secret; rm -rf /tmp/x; ln -s {hdir} /tmp/x; done) \
             >/dev/null 2>&1 & echo started"
        ),
    );
    assert_eq!(stdout(&v), "started\n", "{v}");
    let (mut wrote, mut read) = (0, 0);
    for _ in 0..150 {
        wrote += cp(&env, input.to_str().unwrap(), &format!("{id}:/tmp/x/planted")).0 as u32;
        let _ = std::fs::remove_file(&out);
        read += cp(&env, &format!("{id}:/tmp/x/secret"), out.to_str().unwrap()).0 as u32;
        untouched("swap race");
    }
    // Some copies went through (into the decoy directory), none left it.
    assert!(wrote + read > 0, "the race never let a copy through: the test proves nothing");
    env.finish();
}

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

/// `tmp/` entries of the store, waiting up to `secs` for it to hold only `keep`.
fn tmp_entries_settle(env: &TestEnv, keep: &[&str], secs: u64) -> Vec<String> {
    let start = std::time::Instant::now();
    loop {
        let names: Vec<String> = std::fs::read_dir(env.root.join("tmp"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| !keep.contains(&n.as_str()))
            .collect();
        if names.is_empty() || start.elapsed().as_secs() >= secs {
            return names;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

#[test]
fn a_tree_40000_levels_deep_is_removed_and_the_daemon_restarts() {
    let mut env = TestEnv::start();
    env.import_busybox();
    // 40,000 levels from inside (80 steps of 500), the issue's reproduction.
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

/// Import the single-layer image made of `tar` (gzipped) as `name`.
fn import_layer(env: &TestEnv, name: &str, blob: corpus::LayerBlob) -> std::process::Output {
    let dir = tempfile::Builder::new().prefix("strata-test-layer-").tempdir().unwrap();
    corpus::write_layout_blobs(dir.path(), &[blob]);
    env.cli(&["image", "import", dir.path().to_str().unwrap(), "--name", name])
}

/// Names under a store directory.
fn entries(env: &TestEnv, sub: &str) -> usize {
    std::fs::read_dir(env.root.join(sub)).map(|d| d.count()).unwrap_or(0)
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

#[test]
fn connections_past_the_limit_get_429_until_idle_ones_close() {
    let env = TestEnv::start_with(&["--max-connections", "64"]);
    // Fill every connection slot with connections that never send anything.
    // The daemon counts a closed connection until its task has seen the
    // close, so the start-up probe may still hold a slot for a moment and
    // one of these be refused: a refused connection that sends nothing is
    // answered 429 after 1 s (serve::REFUSE_READ), so wait longer than
    // that and open replacements until 64 are held.
    // On a loaded host a refusal can come after the check below: a request
    // then finds the slot it left, and the connections are topped up again.
    let mut idle: Vec<UnixStream> = Vec::new();
    let start = Instant::now();
    loop {
        while idle.len() < 64 {
            idle.extend((idle.len()..64).map(|_| UnixStream::connect(&env.socket).unwrap()));
            std::thread::sleep(Duration::from_millis(1300));
            idle.retain_mut(|s| !refused_at_once(s));
            assert!(start.elapsed() < Duration::from_secs(20), "the daemon does not hold 64 idle connections");
        }
        // One more is answered 429 once it has sent its request (a client
        // reading an answer before it has asked drops it) and closed.
        let t = Instant::now();
        match env.client().request("GET", "/v1/version", None::<&()>) {
            Err(strata::client::ClientError::Api { status: 429, message, .. }) => {
                assert!(message.contains("64"), "{message}");
                assert!(t.elapsed() < Duration::from_millis(750), "the 429 took {:?}", t.elapsed());
                // A body larger than the socket's buffer is read too (not
                // cut by the close): its sender gets the 429 as well.
                let big = json!({"image": "busybox", "hostname": "x".repeat(900 << 10)});
                match env.client().request("POST", "/v1/sandboxes", Some(&big)) {
                    Err(strata::client::ClientError::Api { status: 429, .. }) => break,
                    // A late refusal left a slot free: served, not refused.
                    _ if idle.iter_mut().any(refused_at_once) => idle.retain_mut(|s| !refused_at_once(s)),
                    other => panic!("expected 429 for a large body, got {other:?}"),
                }
            }
            Ok(_) if idle.iter_mut().any(refused_at_once) => idle.retain_mut(|s| !refused_at_once(s)),
            other => panic!("expected 429, got {other:?}"),
        }
    }
    // Slots come back when the idle ones go.
    drop(idle);
    let start = Instant::now();
    loop {
        match env.client().request("GET", "/v1/version", None::<&()>) {
            Ok(_) => break,
            Err(e) => assert!(start.elapsed().as_secs() < 10, "the daemon did not recover: {e}"),
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    env.finish();
}

/// Threads of a running process.
fn threads(pid: u32) -> usize {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status.lines().find_map(|l| l.strip_prefix("Threads:")).unwrap().trim().parse().unwrap()
}

/// Whether the daemon has answered `s`, which sent nothing (a refusal),
/// without waiting.
fn refused_at_once(s: &mut UnixStream) -> bool {
    s.set_nonblocking(true).unwrap();
    let mut buf = [0u8; 1];
    let answered = !matches!(s.read(&mut buf), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock);
    s.set_nonblocking(false).unwrap();
    answered
}

/// Whether the daemon has closed `s` (EOF or reset), without waiting.
fn closed_by_daemon(s: &mut UnixStream) -> bool {
    s.set_nonblocking(true).unwrap();
    let mut buf = [0u8; 512];
    match s.read(&mut buf) {
        Ok(0) => true,
        Ok(_) => closed_by_daemon(s),
        Err(e) => e.kind() != std::io::ErrorKind::WouldBlock,
    }
}

#[test]
fn idle_and_half_sent_connections_cannot_starve_the_daemon() {
    let env = TestEnv::start_with(&["--header-timeout", "6s", "--idle-timeout", "12s", "--body-timeout", "2s"]);
    env.import_busybox();
    let daemon = env.daemon.as_ref().unwrap().id();
    let opened = Instant::now();
    let mut idle: Vec<UnixStream> = (0..2000).map(|_| UnixStream::connect(&env.socket).unwrap()).collect();
    let mut half: Vec<UnixStream> = (0..200)
        .map(|_| {
            let mut s = UnixStream::connect(&env.socket).unwrap();
            s.write_all(b"GET /v1/version HTTP/1.1\r\nHost: strata\r\nX-Slow: ").unwrap();
            s
        })
        .collect();
    // A kept-alive client that has had its answer.
    let mut kept = env.client();
    kept.request("GET", "/v1/version", None::<&()>).unwrap();

    // A new client is served at once (starved, it would wait for the 6 s
    // header timeout to free a place), and real work goes through.
    let t = Instant::now();
    env.client().request("GET", "/v1/version", None::<&()>).unwrap();
    let took = t.elapsed();
    assert!(took < Duration::from_secs(1), "GET /v1/version took {took:?} with 2200 connections open");
    let id = create(&env, json!({"image": "busybox"}));
    assert_eq!(stdout(&sh(&env, &id, "echo ok")), "ok\n");
    env.cli_ok(&["rm", &id]);
    let n = threads(daemon);
    assert!(n < 64, "the daemon runs {n} threads with 2200 connections open");
    assert!(
        opened.elapsed() < Duration::from_secs(6),
        "the checks took {:?}: past the header timeout, so they did not run against open connections",
        opened.elapsed()
    );

    // A body sent at 1 byte/s is cut by the body timeout: 408, then closed.
    let mut slow = UnixStream::connect(&env.socket).unwrap();
    slow.write_all(b"POST /v1/sandboxes HTTP/1.1\r\nHost: strata\r\nContent-Length: 100\r\n\r\n{").unwrap();
    let mut trickle = slow.try_clone().unwrap();
    let writer = std::thread::spawn(move || {
        for _ in 0..20 {
            std::thread::sleep(Duration::from_secs(1));
            if trickle.write_all(b" ").is_err() {
                return;
            }
        }
    });
    slow.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let t = Instant::now();
    let mut answer = Vec::new();
    let _ = slow.read_to_end(&mut answer);
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("request_timeout"), "{answer}");
    assert!(t.elapsed() < Duration::from_secs(5), "the slow body was cut after {:?}", t.elapsed());
    writer.join().unwrap();

    // Past the header timeout: the idle and the half-sent connections are
    // closed; the kept-alive one is not (its limit is the idle timeout).
    std::thread::sleep(Duration::from_secs(7).saturating_sub(opened.elapsed()));
    let open_idle = idle.iter_mut().map(closed_by_daemon).filter(|closed| !closed).count();
    let open_half = half.iter_mut().map(closed_by_daemon).filter(|closed| !closed).count();
    assert_eq!((open_idle, open_half), (0, 0), "connections still open past the header timeout");
    kept.request("GET", "/v1/version", None::<&()>).expect("a kept-alive connection closed before its idle timeout");
    // Past the idle timeout it is closed too.
    std::thread::sleep(Duration::from_secs(13));
    assert!(kept.request("GET", "/v1/version", None::<&()>).is_err(), "an idle connection outlived the idle timeout");
    env.finish();
}

#[test]
fn sigterm_lets_requests_in_flight_finish() {
    let mut env = TestEnv::start();
    env.import_busybox();
    let id = create(&env, json!({"image": "busybox"}));
    let socket = env.socket.clone();
    let sid = id.clone();
    let slow = std::thread::spawn(move || {
        let mut c = strata::client::Client::connect(&socket).unwrap();
        c.call::<Value>(
            "POST",
            &format!("/v1/sandboxes/{sid}/exec"),
            Some(&json!({"argv": ["sh", "-c", "sleep 2; echo done"]})),
        )
    });
    // The request is in flight: its command runs.
    strata_tests::wait_until("the slow command to start", Duration::from_secs(10), || {
        stdout(&sh(&env, &id, "ps -o comm | grep -c '^sleep'")).trim() == "1"
    });
    let idle = UnixStream::connect(&env.socket).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    let status = env.stop_daemon();
    assert!(status.success(), "{status}");
    let r = slow.join().unwrap().expect("the request in flight was cut by SIGTERM");
    assert_eq!(r["stdout"], "done\n");
    drop(idle);
    env.start_daemon();
    env.finish();
}

/// Mode, owner and extended attributes of a file, to compare before and after.
fn file_identity(path: &std::path::Path) -> String {
    use std::os::unix::fs::MetadataExt;
    use strata_shim::sys;
    let m = std::fs::symlink_metadata(path).unwrap();
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    let xattrs: Vec<String> = sys::llistxattr(&c)
        .unwrap()
        .iter()
        .map(|name| {
            let n = std::ffi::CString::new(name.clone()).unwrap();
            format!("{}={:?}", String::from_utf8_lossy(name), sys::lgetxattr(&c, &n))
        })
        .collect();
    format!("mode {:o} owner {}:{} size {} xattrs {xattrs:?}", m.mode(), m.uid(), m.gid(), m.size())
}

/// A library that, preloaded into a program whose executable is not on the
/// sandbox's root file system (that is: the shim run inside), tries to
/// change that executable through /proc/self/exe and logs each result.
const PRELOAD_ATTACK: &str = r#"
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/xattr.h>
#include <unistd.h>
__attribute__((constructor)) static void attack(void) {
    struct stat exe, root;
    int fd = open("/proc/self/exe", O_RDONLY);
    if (fd < 0 || fstat(fd, &exe) != 0 || stat("/", &root) != 0 || exe.st_dev == root.st_dev) return;
    unsigned char cap[20] = {0x00, 0x00, 0x00, 0x02, 0xff, 0xff, 0xff, 0xff};
    int chmod_r = fchmod(fd, 04755);
    int chown_r = fchown(fd, 65534, 65534);
    int cap_r = fsetxattr(fd, "security.capability", cap, sizeof cap, 0);
    int user_r = fsetxattr(fd, "user.strata-attack", "x", 1, 0);
    int w = open("/proc/self/exe", O_WRONLY);
    int trunc_r = w >= 0 ? ftruncate(w, 0) : -1;
    FILE *log = fopen("/tmp/attack.log", "a");
    if (log) {
        fprintf(log, "chmod=%d chown=%d cap=%d user=%d open_w=%d trunc=%d\n", chmod_r, chown_r, cap_r, user_r, w >= 0, trunc_r);
        fclose(log);
    }
}
"#;

/// Whether an ELF executable names a dynamic loader (a PT_INTERP header).
fn dynamically_linked(path: &Path) -> bool {
    let b = std::fs::read(path).unwrap();
    let u16_at = |o: usize| u16::from_le_bytes([b[o], b[o + 1]]) as usize;
    let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap()) as usize;
    assert_eq!(&b[..5], b"\x7fELF\x02", "{} is no 64-bit ELF file", path.display());
    let (phoff, phentsize, phnum) = (u64_at(0x20), u16_at(0x36), u16_at(0x38));
    (0..phnum).any(|i| u32::from_le_bytes(b[phoff + i * phentsize..][..4].try_into().unwrap()) == 3)
}

/// A glibc build of strata-shim (what scripts/build-shim.sh falls back
/// to without the musl target), in a target directory of its own.
fn glibc_shim() -> PathBuf {
    let target = bin_dir().parent().unwrap().join("glibc-shim");
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let st = std::process::Command::new(option_env!("CARGO").unwrap_or("cargo"))
        .current_dir(workspace)
        .args(["build", "-p", "strata-shim", "--features", "binary", "--target-dir"])
        .arg(&target)
        .status()
        .unwrap();
    assert!(st.success(), "cargo build of the glibc shim failed");
    let shim = target.join("debug/strata-shim");
    assert!(dynamically_linked(&shim), "{} is not a glibc build", shim.display());
    shim
}

#[test]
fn a_sandbox_cannot_change_the_shim_binary_through_proc_self_exe() {
    let work = tempfile::Builder::new().prefix("strata-test-exe-").tempdir().unwrap();
    let lib = compile_c(work.path(), "attack.so", PRELOAD_ATTACK, &["-shared", "-fPIC", "-O1"]);
    // The installed shim (static when scripts/build-shim.sh had the musl
    // target: no dynamic loader, so no preload ever runs in it), then a
    // glibc build, where the preloaded code runs as the shim's binary and
    // only the read-only overlay stops it.
    let installed = bin_dir().join("strata-shim");
    let mut shims = vec![(installed.clone(), dynamically_linked(&installed))];
    if !shims[0].1 {
        shims.push((glibc_shim(), true));
    }
    for (shim, loader) in shims {
        let env = TestEnv::start_with(&["--shim", shim.to_str().unwrap()]);
        shim_survives_its_sandboxes(&env, &shim, &lib, loader);
        env.finish();
    }
}

/// Arm the preload attack (attack.so) in a sandbox and run both
/// triggers; with a `loader` it must run in the shim's binary twice and
/// fail at every change, without one it cannot run. Either way the shim
/// file and the daemon's copy stay as they were.
fn shim_survives_its_sandboxes(env: &TestEnv, installed: &Path, lib: &Path, loader: bool) {
    env.import_image("debian-git");
    let copies: Vec<std::path::PathBuf> =
        std::fs::read_dir(env.root.join("shim")).unwrap().map(|e| e.unwrap().path().join("bin/strata-shim")).collect();
    assert_eq!(copies.len(), 1, "{copies:?}");
    let watched: Vec<std::path::PathBuf> = std::iter::once(installed.to_path_buf()).chain(copies).collect();
    let before: Vec<String> = watched.iter().map(|p| file_identity(p)).collect();

    for userns in [false, true] {
        let id = create(env, json!({"image": "debian-git", "userns": userns}));
        let (ok, err) = cp(env, lib.to_str().unwrap(), &format!("{id}:/usr/local/lib/attack.so"));
        assert!(ok, "{err}");
        let v = sh(
            env,
            &id,
            "set -e; echo /usr/local/lib/attack.so > /etc/ld.so.preload; \
             printf '#!/proc/self/exe\\n' > /usr/local/bin/selfexe; chmod 755 /usr/local/bin/selfexe; \
             ln -sf /proc/self/exe /usr/local/bin/sh; echo armed",
        );
        assert_eq!(stdout(&v), "armed\n", "{v}");
        // Both triggers: a command resolving to /proc/self/exe through PATH
        // (`sh` is now /usr/local/bin/sh), and an interpreter line naming it.
        for argv in [json!(["sh", "-c", "echo hello"]), json!(["/usr/local/bin/selfexe"])] {
            let v = exec(env, &id, json!({ "argv": argv }));
            assert_ne!(v["exit_code"], 0, "the shim was run as {argv}: {v}");
        }
        let v = exec(env, &id, json!({"argv": ["/bin/cat", "/tmp/attack.log"]}));
        let log = stdout(&v);
        if loader {
            // The attack ran, twice, inside the shim's binary, and every change failed.
            assert_eq!(log.lines().count(), 2, "the preloaded attack did not run as expected (userns {userns}): {v}");
            for line in log.lines() {
                assert_eq!(line, "chmod=-1 chown=-1 cap=-1 user=-1 open_w=0 trunc=-1", "userns {userns}: {log}");
            }
        } else {
            assert_eq!(log, "", "a preload ran in the static shim (userns {userns}): {v}");
        }
    }
    let after: Vec<String> = watched.iter().map(|p| file_identity(p)).collect();
    assert_eq!(before, after, "the shim binary changed: {watched:?}");
    // Later sandboxes still start.
    let id = create(env, json!({"image": "debian-git"}));
    assert_eq!(stdout(&sh(env, &id, "echo fine")), "fine\n");
}

/// Two programs that pass descriptors over a Unix socket (SCM_RIGHTS):
/// `fdpass send SOCK FILE DIR` serves an O_RDWR descriptor of FILE and one
/// of directory DIR to the first client; `fdpass recv SOCK GO` takes them,
/// says `got` next to SOCK, waits for GO to exist, then writes through
/// both (overwrites FILE, creates `planted` in DIR), says how that went
/// (`wrote-W-planted-P`, 1 for success) and `done`.
const FDPASS: &str = r#"
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>
static void say(const char *sock, const char *what) {
    char p[256];
    snprintf(p, sizeof p, "%s.%s", sock, what);
    int fd = open(p, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) close(fd);
}
int main(int argc, char **argv) {
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    strncpy(a.sun_path, argv[2], sizeof a.sun_path - 1);
    int s = socket(AF_UNIX, SOCK_STREAM, 0);
    char byte = 'x';
    struct iovec iov = {.iov_base = &byte, .iov_len = 1};
    union { struct cmsghdr h; char buf[CMSG_SPACE(2 * sizeof(int))]; } u;
    struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.buf, .msg_controllen = sizeof u.buf};
    if (strcmp(argv[1], "send") == 0 && argc == 5) {
        int fds[2] = {open(argv[3], O_RDWR), open(argv[4], O_RDONLY | O_DIRECTORY)};
        if (fds[0] < 0 || fds[1] < 0 || bind(s, (struct sockaddr *)&a, sizeof a) || listen(s, 1)) return 2;
        int c = accept(s, 0, 0);
        struct cmsghdr *h = CMSG_FIRSTHDR(&m);
        h->cmsg_level = SOL_SOCKET;
        h->cmsg_type = SCM_RIGHTS;
        h->cmsg_len = CMSG_LEN(sizeof fds);
        memcpy(CMSG_DATA(h), fds, sizeof fds);
        if (c < 0 || sendmsg(c, &m, 0) != 1) return 3;
        pause();
        return 0;
    }
    if (strcmp(argv[1], "recv") == 0 && argc == 4) {
        for (int i = 0; connect(s, (struct sockaddr *)&a, sizeof a) != 0; i++) {
            if (i > 1000) return 4;
            usleep(10000);
        }
        if (recvmsg(s, &m, 0) != 1) return 5;
        struct cmsghdr *h = CMSG_FIRSTHDR(&m);
        if (!h || h->cmsg_type != SCM_RIGHTS) return 6;
        int fds[2];
        memcpy(fds, CMSG_DATA(h), sizeof fds);
        say(argv[2], "got");
        struct stat st;
        while (stat(argv[3], &st) != 0) usleep(10000);
        int w = pwrite(fds[0], "forged\n", 7, 0) == 7 && ftruncate(fds[0], 7) == 0;
        int p = openat(fds[1], "planted", O_WRONLY | O_CREAT, 0644);
        char line[64];
        snprintf(line, sizeof line, "%s.wrote-%d-planted-%d", argv[2], w, p >= 0);
        say(line, "");
        say(argv[2], "done");
        pause();
        return 0;
    }
    return 1;
}
"#;

/// Wait up to 20 s for `path` to exist.
fn wait_for(path: &std::path::Path) {
    wait_until(&format!("{} never appeared", path.display()), Duration::from_secs(20), || path.exists());
}

#[test]
fn descriptors_passed_through_a_cache_cannot_change_a_suspended_snapshot() {
    let env = TestEnv::start();
    env.import_busybox();
    let work = tempfile::Builder::new().prefix("strata-test-fdpass-").tempdir().unwrap();
    let helper = compile_c(work.path(), "fdpass", FDPASS, &["-static", "-O1"]);

    // Two sandboxes share the cache `c` (host dir ROOT/caches/c).
    let [p1, p2] = [(); 2].map(|_| create(&env, json!({"image": "busybox", "cache": ["c:/cache"]})));
    for id in [&p1, &p2] {
        let (ok, err) = cp(&env, helper.to_str().unwrap(), &format!("{id}:/bin/fdpass"));
        assert!(ok, "{err}");
    }
    let v = sh(
        &env,
        &p1,
        "mkdir /data /data/dir && echo original > /data/file && \
        (fdpass send /cache/s /data/file /data/dir </dev/null >/dev/null 2>&1 &)",
    );
    assert_eq!(v["exit_code"], 0, "{v}");
    let v = sh(&env, &p2, "(fdpass recv /cache/s /cache/go </dev/null >/dev/null 2>&1 &)");
    assert_eq!(v["exit_code"], 0, "{v}");
    let cache = env.root.join("caches/c");
    wait_for(&cache.join("s.got"));

    // P1 is suspended; then P2 writes through P1's descriptors.
    let snap = env.cli_ok(&["suspend", &p1]).trim().to_string();
    std::fs::write(cache.join("go"), "").unwrap();
    wait_for(&cache.join("s.done"));
    // The write went through (to an inode no tree holds); the directory may
    // already be gone, with the sandbox's dir, so `planted` may have failed.
    let said: Vec<String> =
        std::fs::read_dir(&cache).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    assert!(said.iter().any(|n| n.starts_with("s.wrote-1-planted-")), "{said:?}");

    // The sealed layer and a sandbox resumed from it have the original.
    let info: serde_json::Value = env.client().call("GET", &format!("/v1/snapshots/{snap}"), None::<&()>).unwrap();
    let layer = env.root.join("layers").join(info["layer"].as_str().unwrap()).join("fs");
    assert_eq!(std::fs::read_to_string(layer.join("data/file")).unwrap(), "original\n");
    assert!(!layer.join("data/dir/planted").exists(), "a file was planted in the sealed layer");
    let resumed = env.cli_ok(&["resume", &snap]).trim().to_string();
    assert_eq!(stdout(&sh(&env, &resumed, "cat /data/file; ls /data/dir")), "original\n");
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

/// Code in a sandbox may stop any process of it, also a command's child
/// between its clone and its execve, while the shim (PID 1) sleeps until
/// that child execs (CLONE_VFORK). The child's own deadline kills it: PID
/// 1 wakes, that exec ends (SIGKILL), and timeouts and execs work again.
#[test]
fn a_command_stopped_before_it_execs_cannot_hold_the_shim() {
    let env = TestEnv::start();
    env.import_busybox();
    let id = create(&env, json!({"image": "busybox"}));
    let path = format!("/v1/sandboxes/{id}/exec");
    // Stop everything it may, without end, until its timeout.
    let stopper = {
        let (mut c, path) = (env.client(), path.clone());
        let body = json!({"argv": ["sh", "-c", "while :; do kill -STOP -1; done"], "timeout": 12});
        std::thread::spawn(move || c.call::<Value>("POST", &path, Some(&body)).unwrap())
    };
    std::thread::sleep(Duration::from_millis(500));
    // 5000 directories that do not exist on the PATH: 5000 failed execve
    // calls before `true`, a window the stopper does not miss.
    let dirs: Vec<String> = (0..5000).map(|i| format!("/n{i}")).collect();
    let body = json!({"argv": ["true"], "env": [format!("PATH={}:/bin", dirs.join(":"))], "timeout": 30});
    let (tx, rx) = std::sync::mpsc::channel();
    let mut c = env.client();
    let t = Instant::now();
    std::thread::spawn(move || tx.send(c.call::<Value>("POST", &path, Some(&body))));
    let v = rx
        .recv_timeout(Duration::from_secs(20))
        .expect("the exec never ended: PID 1 sleeps behind its stopped child")
        .unwrap();
    let took = t.elapsed();
    assert_eq!(v["signal"].as_i64(), Some(9), "{v}");
    assert!(v["stderr"].as_str().unwrap().contains("stopped before it could start"), "{v}");
    assert!(took >= Duration::from_secs(4) && took < Duration::from_secs(10), "{took:?}");
    let s = stopper.join().unwrap();
    assert!(s["timed_out"].as_bool().unwrap(), "{s}");
    assert_eq!(stdout(&sh(&env, &id, "echo alive")), "alive\n");
    env.finish();
}
