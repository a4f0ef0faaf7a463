//! A PostgreSQL server for the suite: Debian's `postgresql-15`, `initdb`
//! and `pg_ctl` in a temporary directory as the `postgres` user, listening
//! on a Unix socket only. One server per test process (started by the
//! first test that asks), one fresh database per daemon. It is stopped
//! when the test process exits, and by a watchdog if the process is
//! killed.
//!
//! Test-only settings: `fsync=off` (a crash of the test host loses
//! nothing the suite needs) and `trust` authentication on the socket
//! (only root and postgres can reach its directory).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

use crate::PREFIX;

pub struct Server {
    pub dir: PathBuf,
    pub data: PathBuf,
    pub socket_dir: PathBuf,
}

static SERVER: OnceLock<Server> = OnceLock::new();
/// The watchdog (ended at exit once the server is stopped).
static WATCHDOG: std::sync::Mutex<Option<std::process::Child>> = std::sync::Mutex::new(None);
static DATABASES: AtomicUsize = AtomicUsize::new(0);

/// Whether the suite runs its daemons on PostgreSQL
/// (`STRATA_TEST_DATABASE=postgres`).
pub fn enabled() -> bool {
    std::env::var("STRATA_TEST_DATABASE").is_ok_and(|v| v == "postgres")
}

/// The directory of PostgreSQL's programs (the newest installed).
pub fn bin_dir() -> PathBuf {
    let mut versions: Vec<u32> = std::fs::read_dir("/usr/lib/postgresql")
        .expect("PostgreSQL is not installed (scripts/install-deps.sh installs postgresql-15)")
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect();
    versions.sort();
    let v = versions.last().expect("no PostgreSQL under /usr/lib/postgresql");
    PathBuf::from(format!("/usr/lib/postgresql/{v}/bin"))
}

fn as_postgres(program: &str, args: &[&str]) {
    let out = Command::new("runuser")
        .args(["-u", "postgres", "--"])
        .arg(bin_dir().join(program))
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("run {program} as postgres: {e}"));
    assert!(
        out.status.success(),
        "{program} {args:?}: {}\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The suite's server, started on first use.
pub fn server() -> &'static Server {
    SERVER.get_or_init(|| {
        crate::require_root();
        let dir = std::env::temp_dir().join(format!("{PREFIX}-pg-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let (data, socket_dir) = (dir.join("data"), dir.join("sock"));
        std::fs::create_dir_all(&socket_dir).unwrap();
        let chown = Command::new("chown").args(["-R", "postgres:postgres"]).arg(&dir).status().unwrap();
        assert!(chown.success(), "chown {}", dir.display());
        let s = |p: &Path| p.display().to_string();
        as_postgres("initdb", &["-D", &s(&data), "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync"]);
        let opts = format!("-k {} -c listen_addresses= -c fsync=off -c max_connections=200", s(&socket_dir));
        let log = s(&dir.join("server.log"));
        as_postgres("pg_ctl", &["-D", &s(&data), "-o", &opts, "-l", &log, "-w", "start"]);
        watchdog(&dir, &data);
        // SAFETY: registers a plain extern "C" function, once.
        unsafe { libc::atexit(stop_at_exit) };
        Server { dir, data, socket_dir }
    })
}

/// Stop the server when this process is gone, whatever ends it.
fn watchdog(dir: &Path, data: &Path) {
    let script = format!(
        "while kill -0 {pid} 2>/dev/null; do sleep 1; done; \
         runuser -u postgres -- {pg_ctl} -D '{data}' -m immediate stop >/dev/null 2>&1; rm -rf '{dir}'",
        pid = std::process::id(),
        pg_ctl = bin_dir().join("pg_ctl").display(),
        data = data.display(),
        dir = dir.display(),
    );
    let child = Command::new("setsid")
        .args(["sh", "-c", &script])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("start the PostgreSQL watchdog");
    *WATCHDOG.lock().unwrap_or_else(|e| e.into_inner()) = Some(child);
}

extern "C" fn stop_at_exit() {
    if let Some(s) = SERVER.get() {
        let _ = Command::new("runuser")
            .args(["-u", "postgres", "--"])
            .arg(bin_dir().join("pg_ctl"))
            .arg("-D")
            .arg(&s.data)
            .args(["-m", "fast", "-w", "stop"])
            .output();
        let _ = std::fs::remove_dir_all(&s.dir);
    }
    if let Some(mut w) = WATCHDOG.lock().unwrap_or_else(|e| e.into_inner()).take() {
        let _ = w.kill();
        let _ = w.wait();
    }
}

/// A fresh, empty database on the suite's server; its connection string.
pub fn database() -> String {
    let s = server();
    let name = format!("strata_{}_{}", std::process::id(), DATABASES.fetch_add(1, Ordering::SeqCst));
    as_postgres("createdb", &["-h", &s.socket_dir.display().to_string(), "-U", "postgres", &name]);
    format!("host={} user=postgres dbname={name}", s.socket_dir.display())
}
