//! Daemon start-up and shut-down: check the configuration, open the
//! daemon (lock, database, sweep, adopt), bind the API socket, start the
//! background threads, serve until SIGTERM or SIGINT, stop. `cli.rs` only
//! turns flags into a [`DaemonConfig`] and calls [`run`].

use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use crate::cgroups::PolicyError;
use crate::daemon::{Daemon, DaemonConfig, DaemonError};

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error(transparent)]
    Policy(#[from] PolicyError),
    #[error("block the shutdown signals")]
    Signals(#[source] nix::Error),
    #[error(transparent)]
    Open(#[from] DaemonError),
    #[error("listen on {addr} (--e2b-listen)")]
    Tcp {
        addr: std::net::SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("{0} exists and is not a socket; refusing to replace it")]
    NotASocket(PathBuf),
    #[error("{step} {path}")]
    Socket {
        step: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Run the daemon until SIGTERM or SIGINT (sandboxes keep running and are
/// adopted at the next start); `gc_interval` zero runs no periodic gc.
pub fn run(
    cfg: DaemonConfig,
    gc_interval: Duration,
    http: crate::api::ServeConfig,
    e2b: Option<(std::net::SocketAddr, crate::e2b::E2bConfig)>,
) -> Result<(), ServeError> {
    cfg.limit_policy.check()?;
    raise_open_files(http.max_connections);
    for clash in crate::userns::host_ids_in_ranges(cfg.userns_base) {
        tracing::warn!(
            "--userns ranges from {} include a host id, {clash}: choose another --userns-base",
            cfg.userns_base
        );
    }
    // Block the shutdown signals before any thread exists so only the
    // signal thread below receives them.
    let mut sigs = nix::sys::signal::SigSet::empty();
    sigs.add(nix::sys::signal::Signal::SIGTERM);
    sigs.add(nix::sys::signal::Signal::SIGINT);
    sigs.thread_block().map_err(ServeError::Signals)?;
    let daemon = Arc::new(Daemon::open(cfg.clone())?);
    let listener = bind_socket(&cfg.socket, cfg.socket_gid)?;
    let e2b = match e2b {
        Some((addr, e2b_cfg)) => {
            let l = std::net::TcpListener::bind(addr).map_err(|source| ServeError::Tcp { addr, source })?;
            tracing::info!("E2B API on http://{addr}");
            Some((l, e2b_cfg))
        }
        None => None,
    };
    tracing::info!(
        "strata daemon on {} (root {}, max {} sandboxes)",
        cfg.socket.display(),
        cfg.root.display(),
        daemon.max_sandboxes()
    );
    let (stop, stopped) = tokio::sync::watch::channel(false);
    std::thread::spawn(move || {
        if let Ok(sig) = sigs.wait() {
            tracing::info!("{sig:?}: stopping the daemon; sandboxes keep running and are re-adopted at next start");
        }
        let _ = stop.send(true);
    });
    daemon.start_warm_pool();
    daemon.start_teardown();
    daemon.start_blob_writer();
    daemon.start_exec_log();
    daemon.start_hydrator();
    daemon.start_reaper();
    daemon.start_metrics();
    daemon.start_ready_pools();
    daemon.start_gc(gc_interval, cfg.retention, cfg.stale_after);
    daemon.start_heartbeat();
    daemon.start_publisher();
    if let Some((l, e2b_cfg)) = e2b {
        let (d, stopped) = (daemon.clone(), stopped.clone());
        std::thread::Builder::new()
            .name("e2b".into())
            .spawn(move || {
                if let Err(e) = crate::e2b::serve(d, l, e2b_cfg, stopped) {
                    tracing::error!("the E2B listener stopped: {e}");
                }
            })
            .map_err(|source| ServeError::Socket {
                step: "start the E2B listener for",
                path: cfg.socket.clone(),
                source,
            })?;
    }
    let served = crate::api::serve(daemon.clone(), listener, http, stopped);
    let _ = std::fs::remove_file(&cfg.socket);
    daemon.shutdown();
    served.map_err(|source| ServeError::Socket { step: "serve the API on", path: cfg.socket.clone(), source })
}

/// Raise the soft limit of open files to the hard one (each API connection
/// is a descriptor); warn when even that leaves too few for
/// `max_connections` and the sandboxes.
fn raise_open_files(max_connections: usize) {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE) else { return };
    if soft < hard && setrlimit(Resource::RLIMIT_NOFILE, hard, hard).is_err() {
        tracing::warn!("could not raise the open-files limit from {soft} to {hard}");
    }
    let want = max_connections as u64 + 1024;
    if hard < want {
        tracing::warn!(
            "the open-files limit ({hard}) is below --max-connections plus 1024 for sandboxes ({want}): lower --max-connections or raise the limit"
        );
    }
}

/// Bind the API socket at `path`, root:`gid` (root's group without one)
/// 0660, never connectable by others even for a moment. A socket file
/// already there is a stale one (the caller holds the root's lock).
fn bind_socket(path: &Path, gid: Option<u32>) -> Result<UnixListener, ServeError> {
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    let err = |step| move |source| ServeError::Socket { step, path: path.to_path_buf(), source };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|source| ServeError::Socket {
            step: "create",
            path: dir.to_path_buf(),
            source,
        })?;
    }
    if let Ok(m) = std::fs::symlink_metadata(path) {
        if !m.file_type().is_socket() {
            return Err(ServeError::NotASocket(path.to_path_buf()));
        }
        std::fs::remove_file(path).map_err(err("remove stale socket"))?;
    }
    // Bound with umask 0177; then root:GROUP 0660.
    let old = nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(0o177));
    let bound = UnixListener::bind(path);
    nix::sys::stat::umask(old);
    let l = bound.map_err(err("bind"))?;
    std::os::unix::fs::chown(path, Some(0), Some(gid.unwrap_or(0))).map_err(err("chown"))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660)).map_err(err("chmod"))?;
    Ok(l)
}
