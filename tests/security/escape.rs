//! Code in a sandbox reaching out: the shim, the daemon, host processes,
//! mounts and kernel settings, descriptors smuggled past a suspend, a
//! command stopped before it execs.

use super::*;

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
