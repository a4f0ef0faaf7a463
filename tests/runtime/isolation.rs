//! What a sandbox cannot reach: the host's files and kernel interfaces,
//! user namespaces (seccomp), devices, the API socket; user namespaces of
//! its own where idmapped mounts work.

use super::*;

#[test]
fn sandbox_is_isolated_and_writes_stay_in_its_upper() {
    let env = TestEnv::start();
    env.import_busybox();
    let id = env.cli_ok(&["create", "--image", "busybox", "--hostname", "box-one"]).trim().to_string();
    assert_eq!(id.len(), 16);

    // PID namespace: only the sandbox's own processes, the shim is PID 1.
    let ps = stdout(&sh(&env, &id, "ps -o pid,comm"));
    let lines: Vec<&str> = ps.lines().skip(1).collect();
    assert!(lines.iter().any(|l| l.split_whitespace().collect::<Vec<_>>() == ["1", "strata-shim"]), "{ps}");
    assert!(lines.len() <= 3, "only shim, sh and ps expected: {ps}");

    // UTS and network namespaces.
    assert_eq!(stdout(&sh(&env, &id, "hostname")).trim(), "box-one");
    assert_eq!(stdout(&sh(&env, &id, "ls /sys/class/net")).trim(), "lo");
    let lo = stdout(&sh(&env, &id, "ip link show lo"));
    assert!(lo.contains("UP"), "loopback is up: {lo}");

    // Minimal /dev, read-only /sys, Docker's capability set, no_new_privs.
    let dev = stdout(&sh(&env, &id, "ls /dev | tr '\\n' ' '"));
    assert_eq!(dev.trim(), "fd full null ptmx pts random shm stderr stdin stdout tty urandom zero", "{dev}");
    let v = sh(&env, &id, "echo 1 > /sys/kernel/profiling 2>/dev/null && echo wrote || echo refused");
    assert_eq!(stdout(&v).trim(), "refused", "/sys is writable");
    let status = stdout(&sh(&env, &id, "grep -E '^(CapBnd|CapEff|NoNewPrivs)' /proc/self/status"));
    // Docker's default set without CAP_MKNOD (bit 27): no devices cgroup yet.
    assert!(status.contains("CapBnd:\t00000000a00425fb"), "bounding set: {status}");
    assert!(status.contains("CapEff:\t00000000a00425fb"), "{status}");
    let v = sh(&env, &id, "mknod /tmp/disk b 8 0 2>&1; echo rc=$?");
    assert!(stdout(&v).contains("rc=1"), "mknod allowed in a sandbox: {v}");
    assert!(status.contains("NoNewPrivs:\t1"), "{status}");

    // PID 1 reaps orphans: a background child whose parent already exited.
    sh(&env, &id, "(sleep 0.2 &) ; true");
    std::thread::sleep(Duration::from_millis(600));
    let stats = stdout(&sh(&env, &id, "ps -o stat | grep -c Z || true"));
    assert_eq!(stats.trim(), "0", "zombies left in the sandbox");

    // The host's files are not visible.
    let probe = env.root.display().to_string();
    let v = sh(&env, &id, &format!("test -e {probe} && echo visible || echo hidden"));
    assert_eq!(stdout(&v).trim(), "hidden");
    let v = sh(&env, &id, "cat /etc/passwd");
    assert!(!stdout(&v).contains("systemd"), "host /etc/passwd leaked in");

    // The root is an overlay that never syncs its upper (`volatile`): the
    // daemon syncs what it keeps of it. A sync inside still succeeds.
    let line = stdout(&sh(&env, &id, "sync && awk '$5 == \"/\"' /proc/self/mountinfo"));
    let (_, fs) = line.split_once(" - ").unwrap_or_else(|| panic!("no root mount: {line}"));
    let fields: Vec<&str> = fs.split_whitespace().collect();
    assert_eq!(fields.first(), Some(&"overlay"), "{line}");
    let opts: Vec<&str> = fields.get(2).map_or(vec![], |o| o.split(',').collect());
    // (Newer kernels show it as `fsync=volatile`.)
    let volatile = opts.iter().any(|o| ["volatile", "fsync=volatile"].contains(o));
    assert!(volatile && opts.iter().any(|o| o.starts_with("upperdir=")), "{line}");

    // Writes land in this sandbox's upper only.
    let other = create(&env, json!({"image": "busybox"}));
    sh(&env, &id, "echo secret > /tmp/written && rm /bin/true");
    let upper = env.root.join("sandboxes").join(&id).join("upper");
    assert_eq!(std::fs::read_to_string(upper.join("tmp/written")).unwrap(), "secret\n");
    let meta = std::fs::symlink_metadata(upper.join("bin/true")).unwrap();
    assert!(std::os::unix::fs::FileTypeExt::is_char_device(&meta.file_type()), "deletion is a whiteout");
    for layer in std::fs::read_dir(env.root.join("layers")).unwrap() {
        let fs = layer.unwrap().path().join("fs");
        assert!(!fs.join("tmp/written").exists(), "write reached a lower");
        assert!(
            fs.join("bin/true").exists() || std::fs::symlink_metadata(fs.join("bin/true")).is_ok(),
            "lower lost a file"
        );
    }
    let v = sh(&env, &other, "cat /tmp/written 2>&1; ls /bin/true");
    assert!(!stdout(&v).contains("secret"), "other sandbox saw the write");
    assert!(stdout(&v).contains("/bin/true"), "other sandbox lost /bin/true");

    // The overlay is mounted only inside the sandbox's mount namespace.
    assert!(mounts_under(&env.root).is_empty(), "sandbox mounts leaked to the host: {:?}", mounts_under(&env.root));

    // Removal leaves nothing: no dirs, cgroup, processes.
    let shim_pid = {
        let v: Value = env.client().call("GET", &format!("/v1/sandboxes/{id}"), None::<&()>).unwrap();
        v["shim_pid"].as_i64().unwrap() as i32
    };
    env.cli_ok(&["rm", &id]);
    assert!(!env.root.join("sandboxes").join(&id).exists());
    assert!(env.cgroup_dirs().iter().all(|d| !d.join(&id).exists()));
    assert!(!alive(shim_pid), "shim still running");
    env.finish();
}

#[test]
fn kernel_interfaces_are_masked_or_read_only() {
    let env = TestEnv::start();
    env.import_busybox();
    let id = create(&env, json!({"image": "busybox", "hostname": "masked"}));
    // Masked: host memory, keys, timers, scheduler internals, firmware read
    // as empty.
    let v = sh(
        &env,
        &id,
        "for f in /proc/kcore /proc/keys /proc/timer_list /proc/sched_debug; do \
           [ -e $f ] && printf '%s=%s ' $f $(wc -c < $f); done; echo; ls -A /sys/firmware | wc -l",
    );
    let out = stdout(&v);
    // (Which of them exist depends on the kernel's configuration.)
    assert!(out.contains("/proc/keys=0 ") || out.contains("/proc/timer_list=0 "), "{out}");
    assert!(!out.split_whitespace().any(|w| w.contains('=') && !w.ends_with("=0")), "{out}");
    assert!(out.ends_with("\n0\n"), "/sys/firmware is not empty: {out}");
    // Read-only: sysctls, sysrq, irq, bus. (The write tried is to the
    // sandbox's own UTS hostname: harmless even if it went through.)
    let v = sh(
        &env,
        &id,
        "(echo other > /proc/sys/kernel/hostname) 2>&1; echo rc=$?; hostname; n=0; \
         for p in /proc/sys /proc/sysrq-trigger /proc/irq /proc/bus; do [ -e $p ] && n=$((n+1)); done; \
         ro=$(awk '$5 ~ /^\\/proc\\/(sys|sysrq-trigger|irq|bus)$/ && $6 ~ /^ro/' /proc/self/mountinfo | wc -l); \
         echo present=$n ro=$ro",
    );
    let out = stdout(&v);
    assert!(out.contains("Read-only file system") && out.contains("rc=1\nmasked\n"), "{out}");
    let counts: Vec<&str> = out.lines().last().unwrap().split(' ').map(|kv| kv.split('=').nth(1).unwrap()).collect();
    assert_eq!(counts[0], counts[1], "not every read-only path is read-only: {out}");
    assert_ne!(counts[0], "0");
    // Readable still, and the masks cannot be lifted from inside.
    assert_eq!(stdout(&sh(&env, &id, "cat /proc/sys/kernel/hostname")), "masked\n");
    let v = sh(&env, &id, "umount /proc/kcore 2>&1; echo rc=$?; umount /proc/sys 2>&1; echo rc=$?");
    assert!(!stdout(&v).contains("rc=0"), "a mask was lifted: {v}");
    // A boot id of its own, read-only, new with each start: not the
    // host's, not another sandbox's, not the one before a suspend.
    let boot_id = |id: &str| stdout(&sh(&env, id, "cat /proc/sys/kernel/random/boot_id"));
    let host = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap();
    let first = boot_id(&id);
    let shape = |b: &str| {
        let parts: Vec<usize> = b.trim_end().split('-').map(str::len).collect();
        parts == [8, 4, 4, 4, 12] && b.as_bytes()[14] == b'4' && b.ends_with('\n')
    };
    assert!(shape(&first), "not a UUID: {first:?}");
    assert_ne!(first, host);
    let v = sh(&env, &id, "(echo x > /proc/sys/kernel/random/boot_id) 2>&1; echo rc=$?; umount /proc/sys/kernel/random/boot_id 2>&1; echo rc=$?");
    assert!(!stdout(&v).contains("rc=0") && boot_id(&id) == first, "the boot id changed from inside: {v}");
    let other = create(&env, json!({"image": "busybox"}));
    assert!(![first.clone(), host.clone()].contains(&boot_id(&other)));
    let snap = env.cli_ok(&["suspend", &id]).trim().to_string();
    let resumed: Value = env.client().call("POST", &format!("/v1/snapshots/{snap}/resume"), Some(&json!({}))).unwrap();
    let again = boot_id(resumed["id"].as_str().unwrap());
    assert!(shape(&again) && ![first, host].contains(&again), "{again:?}");
    env.finish();
}

#[test]
fn seccomp_denies_user_namespaces_unless_unconfined() {
    let env = TestEnv::start();
    env.import_busybox();
    let probe = "unshare -U true 2>&1; echo rc=$?; grep -E '^Seccomp(_filters)?:' /proc/self/status";
    let id = create(&env, json!({"image": "busybox"}));
    let out = stdout(&sh(&env, &id, probe));
    assert!(out.contains("Operation not permitted\nrc=1\n"), "a user namespace was made: {out}");
    assert!(out.contains("Seccomp:\t2\nSeccomp_filters:\t1\n"), "{out}");
    let info: Value = env.client().call("GET", &format!("/v1/sandboxes/{id}"), None::<&()>).unwrap();
    assert_eq!(info["seccomp"], "default");
    // Relaxed explicitly, per sandbox.
    let u = create(&env, json!({"image": "busybox", "seccomp": "unconfined"}));
    let out = stdout(&sh(&env, &u, probe));
    assert!(out.starts_with("rc=0\nSeccomp:\t0\n"), "{out}");
    let bad = env.client().request("POST", "/v1/sandboxes", Some(&json!({"image": "busybox", "seccomp": "off"})));
    assert_eq!(status_of(bad), 400);
    env.finish();
}

/// Runs last (tests run in name order with --test-threads=1): the whole
/// suite left no mount, cgroup or process behind.
#[test]
fn device_nodes_outside_the_minimal_set_cannot_be_opened() {
    let env = TestEnv::start();
    env.import_busybox();
    let id = create(&env, json!({"image": "busybox"}));
    let info: Value = env.client().call("GET", &format!("/v1/sandboxes/{id}"), None::<&()>).unwrap();
    let shim = info["shim_pid"].as_i64().unwrap();
    // Host root plants /dev/fuse (10:229) in the sandbox's /dev: layers
    // cannot carry device nodes and the sandbox cannot mknod, so this
    // stands for a node that got in some other way. The devices cgroup (v1)
    // or eBPF filter (v2) refuses it with EPERM before any driver is asked
    // (without it: opened on the host, ENODEV where no fuse module is).
    let planted = format!("/proc/{shim}/root/dev/fuse");
    nix::sys::stat::mknod(
        planted.as_str(),
        nix::sys::stat::SFlag::S_IFCHR,
        nix::sys::stat::Mode::from_bits_truncate(0o666),
        nix::sys::stat::makedev(10, 229),
    )
    .unwrap();
    let v = sh(&env, &id, "exec 3<>/dev/fuse && echo opened");
    assert_ne!(v["exit_code"], 0, "fuse opened: {v}");
    assert!(v["stderr"].as_str().unwrap().contains("not permitted"), "{v}");
    // The minimal set works: null, zero, urandom, and a pty.
    let v = sh(
        &env,
        &id,
        "echo x > /dev/null && head -c4 /dev/zero | wc -c && head -c4 /dev/urandom | wc -c && exec 3<>/dev/ptmx && echo pty",
    );
    assert_eq!(v["exit_code"], 0, "{v}");
    assert_eq!(stdout(&v), "4\n4\npty\n");
    env.finish();
}

/// In the VM lane (6.1, store on tmpfs, which gets idmapped mounts only in
/// 6.3) this takes the error branch; on this host the other.
#[test]
fn userns_works_where_idmapped_mounts_do_and_says_why_elsewhere() {
    let env = TestEnv::start_with(&["--warm-pool", "0"]);
    env.import_busybox();
    let r: Result<Value, ClientError> =
        env.client().call("POST", "/v1/sandboxes", Some(&json!({"image": "busybox", "userns": true})));
    match r {
        Ok(info) => {
            let id = info["id"].as_str().unwrap();
            let host_id = info["userns"]["host_id"].as_u64().unwrap();
            let out = stdout(&sh(&env, id, "id -u; cat /proc/self/uid_map"));
            let words: Vec<&str> = out.split_whitespace().collect();
            assert_eq!(words, ["0", "0", &host_id.to_string(), "65536"], "{out}");
        }
        Err(e) => {
            assert_eq!(e.status(), Some(500), "{e}");
            let msg = e.to_string();
            assert!(msg.contains("idmapped mount") && msg.contains("--userns needs"), "unclear error: {msg}");
            // Nothing was left of the attempt.
            let left: Vec<_> = std::fs::read_dir(env.root.join("sandboxes")).unwrap().collect();
            assert!(left.is_empty(), "{left:?}");
            assert!(mounts_under(&env.root).is_empty(), "{:?}", mounts_under(&env.root));
        }
    }
    // Either way, sandboxes without a user namespace are unaffected.
    let id = create(&env, json!({"image": "busybox"}));
    assert_eq!(stdout(&sh(&env, &id, "id -u")), "0\n");
    env.finish();
}

#[test]
fn the_api_socket_admits_root_and_its_group_only() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let env = TestEnv::start_with(&["--socket-group", "4242"]);
    let meta = std::fs::metadata(&env.socket).unwrap();
    assert_eq!(meta.mode() & 0o777, 0o660, "socket mode");
    assert_eq!((meta.uid(), meta.gid()), (0, 4242), "socket owner");
    // The store (database with exec logs, layers, uppers) is root's alone.
    let store = std::fs::metadata(&env.root).unwrap();
    assert_eq!(store.mode() & 0o777, 0o700, "store root mode");
    // Let others reach the socket and (for this test only) open its file
    // to everyone, so that what refuses below is the daemon's check of the
    // peer's credentials, not the file mode.
    let dir = env.socket.parent().unwrap();
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o711)).unwrap();
    std::fs::set_permissions(&env.socket, std::fs::Permissions::from_mode(0o666)).unwrap();
    let as_nobody = |gid: &str, groups: &str| {
        std::process::Command::new("setpriv")
            .args(["--reuid", "65534", "--regid", gid])
            .args(if groups.is_empty() { vec!["--clear-groups"] } else { vec!["--groups", groups] })
            .arg(strata_bin())
            .arg("--socket")
            .arg(&env.socket)
            .arg("ps")
            .output()
            .unwrap()
    };
    // In the group by its gid, or by a supplementary group: admitted.
    let out = as_nobody("4242", "");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let out = as_nobody("4243", "4242");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // Neither: refused with 403, saying why.
    let out = as_nobody("4243", "4244");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("not root and not in the socket group 4242"), "{err}");
    assert!(env.daemon_log().contains("refused API request GET /v1/sandboxes"), "{}", env.daemon_log());
    // Root always is.
    env.cli_ok(&["ps"]);
    env.finish();
}

/// A network namespace the test made: that of a `sleep` it started in a
/// new one (`unshare -n`), known by `/proc/PID/ns/net`, with a veth pair
/// inside; it goes when the `sleep` is killed on drop, even by a failing
/// assertion.
struct TestNetns(std::process::Child);

impl TestNetns {
    fn new() -> TestNetns {
        let child = std::process::Command::new("unshare").args(["-n", "sleep", "600"]).spawn().unwrap();
        let ns = TestNetns(child);
        // Until the sleep runs in it, the pid's namespace is ours.
        let ours = std::fs::read_link("/proc/self/ns/net").unwrap();
        wait_until("the new namespace", Duration::from_secs(5), || {
            std::fs::read_link(ns.path()).is_ok_and(|l| l != ours)
                && std::fs::read_to_string(format!("/proc/{}/comm", ns.0.id())).is_ok_and(|c| c.trim() == "sleep")
        });
        // A veth pair inside it (this kernel may have no dummy module).
        ns.ip(&["link", "add", "strata0", "type", "veth", "peer", "name", "strata1"]);
        ns.ip(&["addr", "add", "10.251.0.1/24", "dev", "strata0"]);
        ns.ip(&["link", "set", "strata0", "up"]);
        ns
    }

    /// `ip ARGS` inside it, which must succeed: its stdout.
    fn ip(&self, args: &[&str]) -> String {
        let pid = self.0.id().to_string();
        let out = std::process::Command::new("nsenter").args(["-t", &pid, "-n", "ip"]).args(args).output().unwrap();
        assert!(out.status.success(), "ip {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    fn path(&self) -> String {
        format!("/proc/{}/ns/net", self.0.id())
    }

    /// Its links, by name, sorted.
    fn links(&self) -> Vec<String> {
        let mut links: Vec<String> = self
            .ip(&["-o", "link"])
            .lines()
            .filter_map(|l| l.split(": ").nth(1))
            .map(|n| n.split('@').next().unwrap_or(n).to_string())
            .collect();
        links.sort();
        links
    }
}

impl Drop for TestNetns {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `netns`: a sandbox joins a network namespace it is handed (a pod's,
/// made by CNI) instead of having one of its own. It sees that
/// namespace's interfaces and addresses, Strata adds nothing to it and
/// leaves it when the sandbox goes; what is not a network namespace, a
/// relative path, or a join with network egress is refused (400) and
/// makes nothing.
#[test]
fn a_sandbox_joins_a_network_namespace_it_is_handed() {
    let env = TestEnv::start_with(&["--warm-pool", "2"]);
    env.import_busybox();
    let ns = TestNetns::new();
    let id = create(&env, json!({"image": "busybox", "netns": ns.path()}));
    let info: Value = env.client().call("GET", &format!("/v1/sandboxes/{id}"), None::<&()>).unwrap();
    assert_eq!(info["netns"], ns.path());
    // The shim is in that namespace, not one of its own.
    let shim = info["shim_pid"].as_i64().unwrap();
    let theirs = std::fs::read_link(format!("/proc/{shim}/ns/net")).unwrap();
    let target = std::fs::metadata(ns.path()).unwrap();
    assert_eq!(theirs.to_string_lossy(), format!("net:[{}]", std::os::unix::fs::MetadataExt::ino(&target)));
    // Its commands see the namespace's link and address.
    let v = sh(&env, &id, "cat /proc/net/dev; cat /proc/net/fib_trie");
    assert!(stdout(&v).contains("strata0") && stdout(&v).contains("10.251.0.1"), "{v}");
    // A second sandbox may join it too (a pod's containers share one).
    let other = env.cli_ok(&["create", "--image", "busybox", "--netns", &ns.path()]).trim().to_string();
    assert!(stdout(&sh(&env, &other, "cat /proc/net/dev")).contains("strata0"));
    // Strata added nothing to it, and both sandboxes leave it as it was.
    assert_eq!(ns.links(), ["lo", "strata0", "strata1"]);
    env.cli_ok(&["rm", &id, &other]);
    assert_eq!(ns.links(), ["lo", "strata0", "strata1"]);

    // Refused, and nothing made.
    for (netns, network, needle) in [
        (ns.path(), json!({"mode": "egress"}), "egress"),
        ("var/run/netns/x".to_string(), Value::Null, "absolute"),
        ("/etc/hostname".to_string(), Value::Null, "not a network namespace"),
        ("/proc/self/ns/no-such-namespace".to_string(), Value::Null, "No such file"),
    ] {
        let mut body = json!({"image": "busybox", "netns": netns});
        if !network.is_null() {
            body["network"] = network;
        }
        match env.client().request("POST", "/v1/sandboxes", Some(&body)) {
            Err(ClientError::Api { status: 400, message, .. }) => {
                assert!(message.contains(needle), "{body}: {message}")
            }
            other => panic!("expected 400 for {body}, got {:?}", other.map(|_| ())),
        }
    }
    let listed: Value = env.client().call("GET", "/v1/sandboxes", None::<&()>).unwrap();
    assert_eq!(listed.as_array().map(|a| a.len()), Some(0), "a refused create left a sandbox: {listed}");
    env.finish();
}
