//! The containerd shim v2 (`containerd-shim-strata-v2`), end to end (root
//! only): Debian's containerd in a temporary root with its own socket, its
//! CRI plugin off, and `ctr run --runtime io.containerd.strata.v2` of the
//! busybox image against a Strata daemon of the test's. Each containerd
//! task is a Strata sandbox on the snapshotter's root; the daemon sees it.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

use serde_json::Value;
use strata_tests::*;

const NS: &str = "strata-test";
const IMAGE: &str = "docker.io/library/busybox:latest";
const RUNTIME: &str = "io.containerd.strata.v2";

/// A containerd of the test's: its own root, state and socket.
struct Containerd {
    child: Child,
    dir: tempfile::TempDir,
    sock: PathBuf,
}

impl Containerd {
    /// Started against the daemon of `env`, the shim found on its PATH;
    /// none (the test says it skipped) where containerd is not installed.
    fn start(env: &TestEnv, test: &str) -> Option<Containerd> {
        for tool in ["containerd", "ctr"] {
            if !Command::new("sh").args(["-c", &format!("command -v {tool}")]).status().is_ok_and(|s| s.success()) {
                skipped(test, &format!("{tool} is not installed (scripts/install-deps.sh installs it)"));
                return None;
            }
        }
        let dir = tempfile::Builder::new().prefix("strata-ctd.").tempdir_in("/tmp").unwrap();
        let d = dir.path();
        let sock = d.join("c.sock");
        let config = format!(
            r#"version = 2
root = "{root}"
state = "{state}"
disabled_plugins = ["io.containerd.grpc.v1.cri", "io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.zfs", "io.containerd.tracing.processor.v1.otlp",
  "io.containerd.internal.v1.tracing"]
[grpc]
  address = "{sock}"
[ttrpc]
  address = "{sock}.ttrpc"
[plugins."io.containerd.internal.v1.opt"]
  path = "{opt}"
"#,
            root = d.join("root").display(),
            state = d.join("state").display(),
            sock = sock.display(),
            opt = d.join("opt").display(),
        );
        std::fs::write(d.join("config.toml"), config).unwrap();
        let log = std::fs::File::create(d.join("containerd.log")).unwrap();
        let path = format!("{}:{}", bin_dir().display(), std::env::var("PATH").unwrap_or_default());
        let child = Command::new("containerd")
            .arg("--config")
            .arg(d.join("config.toml"))
            .env("PATH", path)
            .env("STRATA_SOCKET", &env.socket)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        let c = Containerd { child, dir, sock };
        wait_until("containerd's socket", Duration::from_secs(20), || {
            c.sock.exists() && c.ctr(&["version"]).status.success()
        });
        Some(c)
    }

    fn ctr(&self, args: &[&str]) -> Output {
        Command::new("ctr").arg("--address").arg(&self.sock).args(["-n", NS]).args(args).output().unwrap()
    }

    /// `ctr ARGS`, which must succeed: its stdout.
    fn ctr_ok(&self, args: &[&str]) -> String {
        let out = self.ctr(args);
        assert!(out.status.success(), "ctr {args:?}: {}\n{}", String::from_utf8_lossy(&out.stderr), self.log());
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    fn log(&self) -> String {
        let log = std::fs::read_to_string(self.dir.path().join("containerd.log")).unwrap_or_default();
        let tail: Vec<&str> = log.lines().rev().take(40).collect();
        tail.into_iter().rev().collect::<Vec<_>>().join("\n")
    }

    /// Import the test's busybox OCI layout as [`IMAGE`].
    fn import_busybox(&self) {
        let tar = self.dir.path().join("busybox.tar");
        let ok = Command::new("tar").arg("-C").arg(image("busybox")).arg("-cf").arg(&tar).arg(".").status().unwrap();
        assert!(ok.success());
        self.ctr_ok(&["images", "import", "--base-name", "docker.io/library/busybox", tar.to_str().unwrap()]);
    }

    /// A task's state as `ctr task ls` shows it.
    fn task_status(&self, id: &str) -> Option<String> {
        let out = self.ctr_ok(&["task", "ls"]);
        out.lines()
            .find(|l| l.split_whitespace().next() == Some(id))
            .and_then(|l| l.split_whitespace().nth(2).map(String::from))
    }
}

impl Drop for Containerd {
    fn drop(&mut self) {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.child.id() as i32), nix::sys::signal::SIGTERM);
        if wait_for_exit(&mut self.child, Duration::from_secs(10)).is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        // Shims outlive their containerd by design: those of this one (its
        // address in their arguments: a path of this test's) are ended,
        // their sockets removed.
        let address = self.sock.to_string_lossy().into_owned();
        for (pid, cmd) in processes_matching(&format!("-address {address} ")) {
            if !cmd.contains("containerd-shim-strata-v2") {
                continue;
            }
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::SIGKILL);
            if let Some(sock) = cmd.split_whitespace().find_map(|a| a.strip_prefix("unix://")) {
                let _ = std::fs::remove_file(sock);
            }
        }
        // What it mounted under its root (the snapshotter's) goes with it.
        let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        let prefix = self.dir.path().to_string_lossy().into_owned();
        let mut mounts: Vec<&str> =
            info.lines().filter_map(|l| l.split_whitespace().nth(4)).filter(|m| m.starts_with(&prefix)).collect();
        mounts.sort_by_key(|m| std::cmp::Reverse(m.len()));
        for m in mounts {
            let _ = nix::mount::umount2(Path::new(m), nix::mount::MntFlags::MNT_DETACH);
        }
    }
}

fn wait_for_exit(child: &mut Child, limit: Duration) -> Option<std::process::ExitStatus> {
    let until = std::time::Instant::now() + limit;
    while std::time::Instant::now() < until {
        if let Ok(Some(s)) = child.try_wait() {
            return Some(s);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    None
}

fn sandboxes(env: &TestEnv) -> Vec<Value> {
    env.client().call("GET", "/v1/sandboxes", None::<&()>).unwrap()
}

/// `ctr run` on Strata: output and exit codes, a detached task's exec,
/// ps, pause and resume, metrics, kill and delete, and a task that joins a
/// network namespace it is handed (`--with-ns`); each task a sandbox of the
/// daemon's on the snapshotter's root, gone with the task. (A terminal,
/// `-t`, is refused by the shim: its unit tests; ctr needs a console.)
#[test]
fn ctr_runs_tasks_on_strata() {
    let env = TestEnv::start();
    let Some(ctd) = Containerd::start(&env, "ctr_runs_tasks_on_strata") else { return };
    ctd.import_busybox();

    // Run to its end: its output, its exit code; nothing left after --rm.
    let out =
        ctd.ctr(&["run", "--rm", "--runtime", RUNTIME, IMAGE, "t1", "sh", "-c", "echo hello; echo oops >&2; exit 3"]);
    assert_eq!(out.status.code(), Some(3), "{}\n{}", String::from_utf8_lossy(&out.stderr), ctd.log());
    assert_eq!(String::from_utf8_lossy(&out.stdout), "hello\n");
    assert!(String::from_utf8_lossy(&out.stderr).contains("oops"));
    assert_eq!(sandboxes(&env).len(), 0, "the task's sandbox outlived it");
    let ok = ctd.ctr(&["run", "--rm", "--runtime", RUNTIME, IMAGE, "t0", "true"]);
    assert_eq!(ok.status.code(), Some(0), "{}", String::from_utf8_lossy(&ok.stderr));

    // A detached task: a sandbox on containerd's root.
    ctd.ctr_ok(&["run", "-d", "--runtime", RUNTIME, IMAGE, "t2", "sh", "-c", "echo up > /tmp/up; exec sleep 1000"]);
    wait_until("t2 running", Duration::from_secs(20), || ctd.task_status("t2").as_deref() == Some("RUNNING"));
    let listed = sandboxes(&env);
    assert_eq!(listed.len(), 1, "{listed:?}");
    let sb = listed[0]["id"].as_str().unwrap().to_string();
    assert_eq!(listed[0]["image"], "strata/rootfs:v1");
    // An exec: its output and exit code.
    let exec = ctd.ctr(&["task", "exec", "--exec-id", "e1", "t2", "sh", "-c", "cat /tmp/up; exit 4"]);
    assert_eq!(exec.status.code(), Some(4), "{}", String::from_utf8_lossy(&exec.stderr));
    assert_eq!(String::from_utf8_lossy(&exec.stdout), "up\n");
    // ps: the task's process by its host pid.
    let ps = ctd.ctr_ok(&["task", "ps", "t2"]);
    let pid: i32 = ps.lines().nth(1).and_then(|l| l.split_whitespace().next()).and_then(|p| p.parse().ok()).expect(&ps);
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    assert!(String::from_utf8_lossy(&cmdline).starts_with("sleep"), "pid {pid}: {cmdline:?}");
    // Pause and resume: the sandbox's too.
    ctd.ctr_ok(&["task", "pause", "t2"]);
    assert_eq!(ctd.task_status("t2").as_deref(), Some("PAUSED"));
    let info: Value = env.client().call("GET", &format!("/v1/sandboxes/{sb}"), None::<&()>).unwrap();
    assert_eq!(info["state"], "paused");
    ctd.ctr_ok(&["task", "resume", "t2"]);
    assert_eq!(ctd.task_status("t2").as_deref(), Some("RUNNING"));
    // Metrics: the sandbox's cgroup.
    let metrics = ctd.ctr_ok(&["task", "metrics", "t2"]);
    assert!(metrics.contains("memory.usage_in_bytes"), "{metrics}");
    // Kill: it stops; delete: its sandbox goes, its root is unmounted.
    ctd.ctr_ok(&["task", "kill", "-s", "SIGKILL", "t2"]);
    wait_until("t2 stopped", Duration::from_secs(20), || ctd.task_status("t2").as_deref() == Some("STOPPED"));
    ctd.ctr_ok(&["task", "delete", "t2"]);
    ctd.ctr_ok(&["container", "delete", "t2"]);
    assert_eq!(sandboxes(&env).len(), 0);
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(!info.contains("io.containerd.runtime.v2.task"), "a task's root is still mounted");

    // A network namespace it is handed (a pod's): the task sees its link.
    let ns = format!("strata-ctd{}", std::process::id());
    let ip = |args: &[&str]| assert!(Command::new("ip").args(args).status().unwrap().success(), "ip {args:?}");
    ip(&["netns", "add", &ns]);
    ip(&["-n", &ns, "link", "add", "pod0", "type", "veth", "peer", "name", "pod1"]);
    let with = format!("network:/var/run/netns/{ns}");
    let out = ctd.ctr(&["run", "--rm", "--runtime", RUNTIME, "--with-ns", &with, IMAGE, "t3", "cat", "/proc/net/dev"]);
    let _ = Command::new("ip").args(["netns", "del", &ns]).status();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("pod0"), "{}", String::from_utf8_lossy(&out.stdout));

    assert_eq!(sandboxes(&env).len(), 0);
    // Every shim of this containerd ends with its task (Shutdown).
    let address = format!("-address {} ", ctd.sock.display());
    wait_until("the shims to end with their tasks", Duration::from_secs(10), || {
        processes_matching(&address).is_empty()
    });
    drop(ctd);
    env.finish();
}
