//! Shared harness for the root-only integration tests: a [`TestEnv`] runs a
//! real `strata daemon` on a temporary root, socket and uniquely named cgroup
//! parent, and on drop kills what it started, unmounts by mountinfo and
//! removes its cgroups. [`TestEnv::finish`] additionally asserts that nothing
//! was left behind.

pub mod corpus;
pub mod networld;
pub mod pg;
pub mod registry;

use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

pub use strata::client::{Client, ClientError};

/// Root tests must run as root; a skipped root test must never pass.
pub fn require_root() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "this integration test needs root (real mounts, namespaces, cgroups): run scripts/test.sh as root"
    );
}

/// Record that `test` checked nothing here because `why` (a prerequisite
/// this machine lacks): printed as `skipped`, and appended to the file
/// `STRATA_TEST_SKIPS` names, which scripts/test.sh counts and lists, so a
/// skip is never reported as a pass.
pub fn skipped(test: &str, why: &str) {
    let line = format!("skipped: {test}: {why}");
    eprintln!("{line}");
    if let Some(path) = std::env::var_os("STRATA_TEST_SKIPS") {
        use std::io::Write;
        let f = std::fs::OpenOptions::new().create(true).append(true).open(&path);
        if let Err(e) = f.and_then(|mut f| writeln!(f, "{line}")) {
            panic!("record a skip in {}: {e}", PathBuf::from(path).display());
        }
    }
}

/// Directory of the built binaries (target/<profile>), found from the test binary.
pub fn bin_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    exe.parent().and_then(|d| d.parent()).expect("target dir").to_path_buf()
}

pub fn strata_bin() -> PathBuf {
    bin_dir().join("strata")
}

pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

/// The test image directory, building the images if they are missing.
pub fn image(name: &str) -> PathBuf {
    let base =
        std::env::var_os("STRATA_TEST_IMAGES").map(PathBuf::from).unwrap_or_else(|| repo_root().join("images/out"));
    let dir = base.join(name);
    if !dir.join("index.json").exists() {
        let script = repo_root().join(format!("images/{name}/build.sh"));
        let st = Command::new(&script).arg(&dir).status().expect("run image build script");
        assert!(st.success(), "{} failed", script.display());
    }
    dir
}

/// The E2B SDK venv's python: `STRATA_E2B_PYTHON`, else made by
/// scripts/e2b-venv.sh (the pinned SDK from PyPI).
pub fn e2b_python() -> String {
    if let Ok(p) = std::env::var("STRATA_E2B_PYTHON") {
        return p;
    }
    let out = Command::new(repo_root().join("scripts/e2b-venv.sh")).output().expect("run scripts/e2b-venv.sh");
    assert!(out.status.success(), "scripts/e2b-venv.sh failed:\n{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

static COUNTER: AtomicUsize = AtomicUsize::new(0);

/// `--database` for a fresh PostgreSQL database when the suite runs on
/// PostgreSQL (`STRATA_TEST_DATABASE=postgres`); nothing for SQLite.
fn database_args() -> Vec<String> {
    if pg::enabled() {
        vec!["--database".into(), pg::database()]
    } else {
        Vec::new()
    }
}

/// Prefix of everything the suite creates (cgroups, temp dirs).
pub const PREFIX: &str = "strata-test";

pub struct TestEnv {
    pub root: PathBuf,
    pub socket: PathBuf,
    pub cgroup_parent: String,
    pub daemon: Option<Child>,
    pub extra_args: Vec<String>,
    /// Environment of the daemon (e.g. `STRATA_FAILPOINTS`), kept across
    /// restarts until cleared.
    pub daemon_env: Vec<(String, String)>,
    /// The root is a file system of its own (see `start_on_tmpfs`).
    own_fs: bool,
    /// The network namespace the daemon runs in (`NetWorld::daemon`);
    /// none: the host's, with `--network off` (the suite never changes
    /// the host's own network).
    pub netns: Option<PathBuf>,
    _tmp: tempfile::TempDir,
}

impl TestEnv {
    pub fn start() -> TestEnv {
        TestEnv::start_with(&[])
    }

    pub fn start_with(extra: &[&str]) -> TestEnv {
        TestEnv::start_inner(extra, None, &[])
    }

    /// A daemon of a fleet: host `host` on the shared catalog `database`
    /// (whatever `STRATA_TEST_DATABASE` says), with `extra` flags.
    pub fn start_in_fleet(database: &str, host: &str, extra: &[&str]) -> TestEnv {
        let args: Vec<String> =
            ["--database", database, "--host-id", host].iter().chain(extra).map(|s| s.to_string()).collect();
        TestEnv::start_args(args, None, &[])
    }

    /// A daemon with extra environment variables.
    pub fn start_with_env(vars: &[(&str, &str)]) -> TestEnv {
        TestEnv::start_inner(&[], None, vars)
    }

    /// Both: daemon flags `extra` and environment `vars`.
    pub fn start_with_flags_and_env(extra: &[&str], vars: &[(&str, &str)]) -> TestEnv {
        TestEnv::start_inner(extra, None, vars)
    }

    /// A daemon whose whole root (layers, blobs, tmp, uppers, database) is a
    /// tmpfs of `size` bytes, to run out of space on purpose.
    pub fn start_on_tmpfs(size: u64) -> TestEnv {
        TestEnv::start_inner(&[], Some(size), &[])
    }

    fn start_inner(extra: &[&str], tmpfs: Option<u64>, vars: &[(&str, &str)]) -> TestEnv {
        let args = extra.iter().map(|s| s.to_string()).chain(database_args()).collect();
        TestEnv::start_args(args, tmpfs, vars)
    }

    fn start_args(extra_args: Vec<String>, tmpfs: Option<u64>, vars: &[(&str, &str)]) -> TestEnv {
        TestEnv::start_in(extra_args, tmpfs, vars, None)
    }

    /// A daemon in the network namespace `netns` (a bind mount under
    /// /run/netns), with networking on.
    pub fn start_in_netns(netns: &Path, extra: &[&str]) -> TestEnv {
        let args = extra.iter().map(|s| s.to_string()).chain(database_args()).collect();
        TestEnv::start_in(args, None, &[], Some(netns.to_path_buf()))
    }

    fn start_in(extra_args: Vec<String>, tmpfs: Option<u64>, vars: &[(&str, &str)], netns: Option<PathBuf>) -> TestEnv {
        require_root();
        // Shims orphaned by a killed daemon reparent to us instead of the
        // host's init (which may not reap them), and `reap_orphans` reaps them.
        nix::sys::prctl::set_child_subreaper(true).expect("PR_SET_CHILD_SUBREAPER");
        let n = COUNTER.fetch_add(1, Ordering::SeqCst);
        let tmp = tempfile::Builder::new().prefix(&format!("{PREFIX}-")).tempdir().expect("tempdir");
        let root = tmp.path().to_path_buf();
        let mut env = TestEnv {
            socket: root.join("api.sock"),
            root: root.join("root"),
            cgroup_parent: format!("{PREFIX}-{}-{n}", std::process::id()),
            daemon: None,
            extra_args,
            daemon_env: vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
            own_fs: tmpfs.is_some(),
            netns,
            _tmp: tmp,
        };
        if let Some(size) = tmpfs {
            std::fs::create_dir(&env.root).unwrap();
            nix::mount::mount(
                Some("strata-test"),
                &env.root,
                Some("tmpfs"),
                nix::mount::MsFlags::MS_NOSUID | nix::mount::MsFlags::MS_NODEV,
                Some(format!("size={size},mode=0700").as_str()),
            )
            .expect("mount tmpfs root");
        }
        env.start_daemon();
        env
    }

    /// Start (or restart) the daemon and wait until it answers.
    pub fn start_daemon(&mut self) {
        assert!(self.daemon.is_none(), "daemon already running");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.root.with_file_name("daemon.log"))
            .expect("daemon log");
        // In a namespace of the test's: `nsenter --net` enters it and execs
        // the daemon (the same pid). Elsewhere: networking off.
        let mut cmd = match &self.netns {
            Some(ns) => {
                let mut c = Command::new("nsenter");
                c.arg(format!("--net={}", ns.display())).arg(strata_bin());
                c
            }
            None => Command::new(strata_bin()),
        };
        let network_off = self.netns.is_none() && !self.extra_args.iter().any(|a| a == "--network");
        let child = cmd
            .arg("--socket")
            .arg(&self.socket)
            .arg("daemon")
            .arg("--root")
            .arg(&self.root)
            .arg("--cgroup-parent")
            .arg(&self.cgroup_parent)
            .args(&self.extra_args)
            .args(if network_off { &["--network", "off"][..] } else { &[] })
            .envs(self.daemon_env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("spawn strata daemon");
        self.daemon = Some(child);
        let start = Instant::now();
        loop {
            if let Ok(mut c) = Client::connect(&self.socket) {
                if c.request("GET", "/v1/version", None::<&()>).is_ok() {
                    return;
                }
            }
            if let Some(st) = self.daemon.as_mut().unwrap().try_wait().unwrap() {
                panic!("daemon exited with {st} at start:\n{}", self.daemon_log());
            }
            assert!(start.elapsed() < Duration::from_secs(20), "daemon did not start:\n{}", self.daemon_log());
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn daemon_log(&self) -> String {
        std::fs::read_to_string(self.root.with_file_name("daemon.log")).unwrap_or_default()
    }

    /// Wait up to `limit` for the daemon to log `needle` (what it logs
    /// after an answer, on another thread, or at a failpoint).
    pub fn wait_logged(&self, needle: &str, limit: Duration) {
        wait_for(
            &format!("the daemon to log {needle:?}"),
            limit,
            || self.daemon_log().contains(needle).then_some(()),
            || self.daemon_log(),
        )
    }

    /// SIGKILL the daemon (sandboxes must survive).
    pub fn kill_daemon(&mut self) {
        if let Some(mut c) = self.daemon.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGTERM the daemon and wait for it (at most 30 s, then it is killed
    /// and the test fails).
    pub fn stop_daemon(&mut self) -> std::process::ExitStatus {
        let mut c = self.daemon.take().expect("daemon running");
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(c.id() as i32), nix::sys::signal::Signal::SIGTERM).unwrap();
        let start = std::time::Instant::now();
        loop {
            if let Some(st) = c.try_wait().unwrap() {
                return st;
            }
            if start.elapsed() > Duration::from_secs(30) {
                let _ = c.kill();
                let _ = c.wait();
                panic!("the daemon did not stop within 30 s of SIGTERM");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// A connection of the test's own to the daemon's catalog: its
    /// `--database`, or `ROOT/strata.db`.
    pub fn catalog(&self) -> strata::catalog::Db {
        let url = self.extra_args.iter().skip_while(|a| *a != "--database").nth(1);
        match url {
            Some(url) => strata::catalog::Db::open_postgres(url).expect("open the PostgreSQL catalog"),
            None => strata::catalog::Db::open(&self.root.join("strata.db")).expect("open strata.db"),
        }
    }

    pub fn client(&self) -> Client {
        Client::connect(&self.socket).expect("connect to daemon")
    }

    /// Run the `strata` CLI against this daemon.
    pub fn cli(&self, args: &[&str]) -> Output {
        Command::new(strata_bin())
            .env("STRATA_SOCKET", &self.socket)
            .args(args)
            .stdin(Stdio::null())
            .output()
            .expect("run strata")
    }

    /// Run the CLI and return stdout; panics with stderr on failure.
    pub fn cli_ok(&self, args: &[&str]) -> String {
        let out = self.cli(args);
        assert!(
            out.status.success(),
            "strata {args:?} failed ({:?}):\nstdout: {}\nstderr: {}\ndaemon log:\n{}",
            out.status.code().or(out.status.signal()),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
            self.daemon_log()
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    pub fn import_busybox(&self) {
        self.import_image("busybox");
    }

    /// Import test image `name` (built under images/out if missing) as `name:latest`.
    pub fn import_image(&self, name: &str) {
        let dir = image(name);
        self.cli_ok(&["image", "import", dir.to_str().unwrap(), "--name", &format!("{name}:latest")]);
    }

    /// Cgroup directories of this env, in every mounted hierarchy.
    pub fn cgroup_dirs(&self) -> Vec<PathBuf> {
        cgroup_dirs_named(&self.cgroup_parent)
    }

    /// Kill every process still in this env's cgroups (the daemon may be
    /// dead), thawing frozen ones so the kill takes effect.
    fn kill_cgroup_procs(&self) {
        for dir in self.cgroup_dirs() {
            for_each_cgroup(&dir, &mut |cg| {
                let _ = std::fs::write(cg.join("freezer.state"), "THAWED");
                let _ = std::fs::write(cg.join("cgroup.freeze"), "0");
            });
        }
        for dir in self.cgroup_dirs() {
            for_each_cgroup(&dir, &mut |cg| {
                if let Ok(procs) = std::fs::read_to_string(cg.join("cgroup.procs")) {
                    for pid in procs.lines().filter_map(|l| l.trim().parse::<i32>().ok()) {
                        let _ =
                            nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL);
                    }
                }
            });
        }
    }

    /// Reap zombie `strata-shim` processes reparented to this test process.
    pub fn reap_orphans(&self) {
        // A zombie has an empty cmdline; match on comm and parent instead.
        let me = std::process::id().to_string();
        for e in std::fs::read_dir("/proc").unwrap().flatten() {
            let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else { continue };
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            let is_shim = stat.contains("(strata-shim)");
            let fields: Vec<&str> = stat.rsplit_once(") ").map(|(_, r)| r.split(' ').collect()).unwrap_or_default();
            if is_shim && fields.len() > 1 && fields[1] == me {
                let _ = nix::sys::wait::waitpid(
                    nix::unistd::Pid::from_raw(pid),
                    Some(nix::sys::wait::WaitPidFlag::WNOHANG),
                );
            }
        }
    }

    fn cleanup(&mut self) {
        // Prefer the daemon's own removal path.
        if self.daemon.is_some() {
            if let Ok(mut c) = Client::connect(&self.socket) {
                if let Ok(list) = c.call::<Vec<serde_json::Value>>("GET", "/v1/sandboxes", None::<&()>) {
                    for s in list {
                        if let Some(id) = s["id"].as_str() {
                            let _ = c.request("DELETE", &format!("/v1/sandboxes/{id}"), None::<&()>);
                        }
                    }
                }
            }
        }
        self.kill_daemon();
        self.kill_cgroup_procs();
        std::thread::sleep(Duration::from_millis(50));
        self.reap_orphans();
        for m in mounts_under(&self.root).into_iter().rev() {
            let _ = nix::mount::umount2(Path::new(&m), nix::mount::MntFlags::MNT_DETACH);
        }
        for dir in self.cgroup_dirs() {
            remove_cgroup_tree(&dir);
        }
    }

    /// Tear down and assert nothing is left: no mount under the root, no
    /// cgroup, no live process of this env.
    pub fn finish(mut self) {
        // A clean daemon-side removal must leave nothing: remove every
        // sandbox, stop the daemon (it tears its warm shims down), then look.
        if self.daemon.is_some() {
            let list: Vec<serde_json::Value> = self.client().call("GET", "/v1/sandboxes", None::<&()>).unwrap();
            for s in &list {
                let id = s["id"].as_str().unwrap();
                self.client().request("DELETE", &format!("/v1/sandboxes/{id}"), None::<&()>).unwrap();
            }
            let st = self.stop_daemon();
            assert!(st.success(), "daemon exited with {st} on SIGTERM:\n{}", self.daemon_log());
        }
        self.reap_orphans();
        let mut cgroups = Vec::new();
        for d in self.cgroup_dirs() {
            for_each_cgroup(&d, &mut |cg| {
                if cg != d {
                    cgroups.push(cg.display().to_string());
                }
            });
        }
        let own = self.root.display().to_string();
        let mounts: Vec<String> =
            mounts_under(&self.root).into_iter().filter(|m| !(self.own_fs && *m == own)).collect();
        let shims: Vec<_> = processes_matching("strata-shim")
            .into_iter()
            .filter(|(pid, _)| {
                std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap_or_default().contains(&self.cgroup_parent)
            })
            .collect();
        // Loop devices of --disk sandboxes detach themselves after the
        // last unmount (the kernel may take a moment).
        let mut loops = loop_devices_under(&self.root);
        for _ in 0..50 {
            if loops.is_empty() {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
            loops = loop_devices_under(&self.root);
        }
        self.cleanup();
        assert!(loops.is_empty(), "loop devices left: {loops:?}");
        assert!(cgroups.is_empty(), "sandbox cgroups left after removing every sandbox: {cgroups:?}");
        assert!(mounts.is_empty(), "mounts left under {}: {mounts:?}", self.root.display());
        assert!(shims.is_empty(), "shims left running: {shims:?}");
        assert!(self.cgroup_dirs().iter().all(|d| std::fs::remove_dir(d).is_ok() || !d.exists()), "cgroup parent left");
    }
}

impl Drop for TestEnv {
    fn drop(&mut self) {
        self.cleanup();
    }
}

/// Compile the C program `source` with gcc and `flags` into `dir/name`
/// (stand-ins and attack helpers); its path.
pub fn compile_c(dir: &Path, name: &str, source: &str, flags: &[&str]) -> PathBuf {
    let src = dir.join(format!("{name}.c"));
    std::fs::write(&src, source).unwrap();
    let out = dir.join(name);
    let st = Command::new("gcc").args(flags).arg("-o").arg(&out).arg(&src).status().expect("run gcc");
    assert!(st.success(), "gcc failed to build {name}");
    out
}

/// Poll `found` every 10 ms until it gives a value, and return that; once
/// `limit` has passed, fail with `what` and the state `last` shows.
pub fn wait_for<T, D: std::fmt::Display>(
    what: &str,
    limit: Duration,
    mut found: impl FnMut() -> Option<T>,
    last: impl FnOnce() -> D,
) -> T {
    let start = Instant::now();
    loop {
        if let Some(v) = found() {
            return v;
        }
        if start.elapsed() >= limit {
            panic!("{what} (after {limit:?}); last seen: {:#}", last());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Poll `done` until it holds ([`wait_for`] with no state to show).
pub fn wait_until(what: &str, limit: Duration, mut done: impl FnMut() -> bool) {
    wait_for(what, limit, || done().then_some(()), || "not yet")
}

/// Loop devices whose backing file is under `root` (`--disk` images).
pub fn loop_devices_under(root: &Path) -> Vec<String> {
    let Ok(dir) = std::fs::read_dir("/sys/block") else { return vec![] };
    let root = root.display().to_string();
    dir.flatten()
        .filter_map(|e| {
            let backing = std::fs::read_to_string(e.path().join("loop/backing_file")).ok()?;
            backing.starts_with(&root).then(|| format!("{}: {}", e.file_name().to_string_lossy(), backing.trim()))
        })
        .collect()
}

/// `<mount>/<name>` for every cgroup hierarchy (v1 controllers and v2).
pub fn cgroup_dirs_named(name: &str) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let base = Path::new("/sys/fs/cgroup");
    if base.join(name).is_dir() {
        out.push(base.join(name));
    }
    if let Ok(rd) = std::fs::read_dir(base) {
        for e in rd.flatten() {
            let p = e.path().join(name);
            if p.is_dir() && !out.contains(&p) {
                out.push(p);
            }
        }
    }
    out
}

fn for_each_cgroup(dir: &Path, f: &mut dyn FnMut(&Path)) {
    f(dir);
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd.flatten() {
            if e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                for_each_cgroup(&e.path(), f);
            }
        }
    }
}

fn remove_cgroup_tree(dir: &Path) {
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd.flatten() {
            if e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                remove_cgroup_tree(&e.path());
            }
        }
    }
    for _ in 0..100 {
        if std::fs::remove_dir(dir).is_ok() || !dir.exists() {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

pub use strata::store::tree::mounts_under;

/// Every process whose command line mentions `needle` (for leak checks).
pub fn processes_matching(needle: &str) -> Vec<(i32, String)> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else { continue };
        if let Ok(cmd) = std::fs::read(format!("/proc/{pid}/cmdline")) {
            let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
            if cmd.contains(needle) {
                out.push((pid, cmd));
            }
        }
    }
    out
}

/// A buffered exec in sandbox `id` (POST /v1/sandboxes/{id}/exec).
pub fn exec(env: &TestEnv, id: &str, body: serde_json::Value) -> serde_json::Value {
    env.client().call("POST", &format!("/v1/sandboxes/{id}/exec"), Some(&body)).expect("exec")
}

/// `sh -c script` in sandbox `id`.
pub fn sh(env: &TestEnv, id: &str, script: &str) -> serde_json::Value {
    exec(env, id, serde_json::json!({"argv": ["sh", "-c", script]}))
}

/// An exec result's stdout.
pub fn stdout(v: &serde_json::Value) -> String {
    v["stdout"].as_str().unwrap().to_string()
}

/// Create a sandbox; returns its id.
pub fn create(env: &TestEnv, body: serde_json::Value) -> String {
    let v: serde_json::Value = env.client().call("POST", "/v1/sandboxes", Some(&body)).expect("create");
    v["id"].as_str().unwrap().to_string()
}

/// CPU time (user + system, seconds) process `pid` has used so far.
pub fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // Fields after the command's closing parenthesis; utime and stime are
    // the 14th and 15th of the whole line.
    let rest: Vec<&str> = stat[stat.rfind(')').unwrap() + 2..].split(' ').collect();
    let ticks: u64 = rest[11].parse::<u64>().unwrap() + rest[12].parse::<u64>().unwrap();
    ticks as f64 / nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK).unwrap().unwrap() as f64
}

/// Whether every listed snapshot is a capture that failed: listed with
/// its reason, no place in its lineage, no blob (it holds nothing).
pub fn only_failed_captures(snaps: &[serde_json::Value]) -> bool {
    snaps.iter().all(|s| {
        s["state"] == "failed"
            && s["info"]["capture_error"].is_string()
            && s["sequence"].is_null()
            && s["blob_digest"] == ""
    })
}

/// Wait up to 60 s for a snapshot's background seal to end.
pub fn sealed(env: &TestEnv, snap: &str) -> serde_json::Value {
    let start = std::time::Instant::now();
    loop {
        let info: serde_json::Value = env.client().call("GET", &format!("/v1/snapshots/{snap}"), None::<&()>).unwrap();
        if info["sealing"] != true {
            return info;
        }
        assert!(start.elapsed().as_secs() < 60, "still sealing: {info}");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

/// CPU seconds used in the capture cgroup beside sandbox cgroup `cg`, and
/// its CPU quota as the kernel has it (v1 `cpu.cfs_quota_us`, v2
/// `cpu.max`); `None` once it is gone.
pub fn capture_cgroup_cpu(cg: &str) -> Option<(f64, String)> {
    let base = std::path::Path::new("/sys/fs/cgroup");
    let unified = base.join(format!("{cg}.capture"));
    if unified.join("cpu.stat").is_file() {
        let stat = std::fs::read_to_string(unified.join("cpu.stat")).ok()?;
        let usec: f64 = stat.lines().find_map(|l| l.strip_prefix("usage_usec "))?.trim().parse().ok()?;
        let max = std::fs::read_to_string(unified.join("cpu.max")).ok()?;
        return Some((usec / 1e6, max.trim().to_string()));
    }
    let ns: f64 =
        std::fs::read_to_string(base.join(format!("cpuacct/{cg}.capture/cpuacct.usage"))).ok()?.trim().parse().ok()?;
    let quota = std::fs::read_to_string(base.join(format!("cpu/{cg}.capture/cpu.cfs_quota_us"))).ok()?;
    Some((ns / 1e9, quota.trim().to_string()))
}

/// `python` (a command that runs the SDK venv's Python) set to run
/// `tests/e2b/<script>` against the E2B listener at `url` with the key
/// `key-one`, none of the caller's E2B debug or domain settings leaking in.
pub fn e2b_script(mut python: Command, script: &str, url: &str) -> Command {
    python
        .arg(repo_root().join("tests/e2b").join(script))
        .env("E2B_API_URL", url)
        .env("E2B_SANDBOX_URL", url)
        .env("E2B_API_KEY", "key-one")
        .env_remove("E2B_DEBUG")
        .env_remove("E2B_DOMAIN");
    python
}

/// Assert that a script run by [`e2b_script`] succeeded and printed
/// `marker`; else fail with its output and `env`'s daemon log.
pub fn assert_script_passed(out: &Output, marker: &str, env: &TestEnv) {
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains(marker),
        "the script did not print {marker:?} ({}):\n{stdout}\n{}\ndaemon log:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr),
        env.daemon_log()
    );
}

/// Every file under `dir` (not following links) holding `needle`.
pub fn files_holding(dir: &Path, needle: &[u8]) -> Vec<std::path::PathBuf> {
    let mut found = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else { return found };
    for e in entries.flatten() {
        let (p, Ok(m)) = (e.path(), e.metadata()) else { continue };
        if m.is_dir() {
            found.extend(files_holding(&p, needle));
        } else if m.is_file()
            && m.len() < 256 << 20
            && std::fs::read(&p).is_ok_and(|b| b.windows(needle.len()).any(|w| w == needle))
        {
            found.push(p);
        }
    }
    found
}
