//! `cp` in and out of a sandbox: files, trees and tar streams, and never
//! a path outside the sandbox's root.

use super::*;

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
