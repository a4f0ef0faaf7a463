//! Escape tests (root only): code in a sandbox tries to reach the host, the
//! daemon or the shim, and each attempt must fail safely and leave the host
//! unchanged. See docs/security.md for the defence each one exercises.

use serde_json::json;
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
    let id = create(&env, json!({"image": "busybox"}));
    // The shim is PID 1 here: its memory, fds and environment are closed
    // to the sandbox's root (no CAP_SYS_PTRACE; the shim is not dumpable).
    for probe in ["cat /proc/1/environ", "readlink /proc/1/fd/0", "head -c1 /proc/1/mem", "readlink /proc/1/exe"] {
        let (code, out) = attempt(&env, &id, &format!("{probe} >/dev/null"));
        assert_ne!(code, 0, "{probe} worked: {out}");
        assert!(out.is_empty() || out.contains("ermission denied") || out.contains("not permitted"), "{probe}: {out}");
    }
    // None of its descriptors (the daemon connection, the store's log) can
    // be followed or reopened.
    let (code, out) = attempt(
        &env,
        &id,
        "for f in /proc/1/fd/*; do readlink $f && exit 1; cat $f </dev/null && exit 1; done; exit 0",
    );
    assert_eq!(code, 0, "a shim fd could be followed: {out}");
    // Host processes are not visible, so not signalled: the daemon's pid
    // (and the host's init) name nothing, or the sandbox's own PID 1.
    let daemon = env.daemon.as_ref().unwrap().id();
    let (code, out) = attempt(&env, &id, &format!("kill -9 {daemon}"));
    assert_ne!(code, 0, "kill of the daemon's pid worked: {out}");
    assert!(std::path::Path::new(&format!("/proc/{daemon}")).exists(), "daemon died");
    let (code, out) = attempt(&env, &id, "ps -o pid,comm | wc -l");
    assert_eq!(code, 0, "{out}");
    // ps, its shell and the shim (and a header line): nothing of the host.
    assert!(out.trim().parse::<u32>().unwrap() <= 5, "{out}");
    // The daemon's socket is not in the sandbox's file system.
    let (_, out) = attempt(&env, &id, "find / -xdev -type s 2>/dev/null; echo end");
    assert_eq!(out, "end\n", "sockets visible: {out}");
    env.finish();
}

#[test]
fn a_sandbox_cannot_mount_load_modules_or_write_kernel_settings() {
    let env = TestEnv::start();
    env.import_busybox();
    let id = create(&env, json!({"image": "busybox"}));
    let host_hostname = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap();
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
        let (code, out) = attempt(&env, &id, script);
        assert_ne!(code, 0, "{what}: it worked: {out}");
    }
    // The host is unchanged.
    assert_eq!(std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap(), host_hostname);
    // And the sandbox still works.
    assert_eq!(stdout(&sh(&env, &id, "echo ok")), "ok\n");
    env.finish();
}
