//! Daemon start-up and shut-down: check the configuration, open the
//! daemon (lock, database, sweep, adopt), bind the API socket, start the
//! background threads, serve until SIGTERM or SIGINT, stop. [`run`] turns
//! `strata daemon`'s flags into a [`DaemonConfig`] and calls [`serve`].

use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args;

use super::{Cli, DEFAULT_ROOT};
use crate::daemon::{Daemon, DaemonConfig, DaemonError};
use crate::sandbox::cgroups::PolicyError;

#[derive(Args, Debug)]
pub struct DaemonArgs {
    #[arg(long, default_value = DEFAULT_ROOT)]
    pub root: PathBuf,
    /// Cap on live sandboxes (default: one per 128 MiB of host memory).
    #[arg(long)]
    pub max_sandboxes: Option<usize>,
    /// Parent cgroup for sandboxes; must start with "strata".
    #[arg(long, default_value = "strata")]
    pub cgroup_parent: String,
    /// Path of strata-shim (default: next to this executable).
    #[arg(long)]
    pub shim: Option<PathBuf>,
    /// Shims kept started ahead of `create` (namespaces, cgroup, connection),
    /// so a create pays only for its mounts. 0 disables the pool.
    #[arg(long, default_value_t = 2)]
    pub warm_pool: usize,
    /// Compact a snapshot's layer chain into one layer when sealing it
    /// would make the chain longer than this.
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u16).range(1..=400))]
    pub compact_depth: u16,
    /// First host id of the ranges `--userns` sandboxes map root to (65536
    /// ids each, one range per live sandbox).
    #[arg(long, default_value_t = crate::sandbox::userns::DEFAULT_BASE, value_parser = clap::value_parser!(u32).range(65536..=4_000_000_000))]
    pub userns_base: u32,
    /// Keep superseded, retired and failed snapshots this long (30s, 15m,
    /// 2h, 7d).
    #[arg(long, default_value = "7d", value_parser = crate::units::parse_duration)]
    pub retention: std::time::Duration,
    /// Retire an active lineage neither captured nor restored for this long.
    #[arg(long, default_value = "14d", value_parser = crate::units::parse_duration)]
    pub stale_after: std::time::Duration,
    /// Keep N sandboxes of IMAGE fully started (IMAGE=N, repeatable): a
    /// create of that image with no hostname, mounts, disk cap, user
    /// namespace or chosen id takes one instead of starting it.
    #[arg(long = "pool", value_parser = parse_pool)]
    pub pools: Vec<(crate::ids::ImageName, usize)>,
    /// What happens at a sandbox's deadline when its create does not say:
    /// remove, or suspend into its lineage.
    #[arg(long, default_value = "remove")]
    pub on_timeout: crate::model::OnTimeout,
    /// Run the collector this often (0 disables the periodic run).
    #[arg(long, default_value = "1h", value_parser = crate::units::parse_duration)]
    pub gc_interval: std::time::Duration,
    /// Group (name or gid) whose members may use the API socket; without
    /// it only root may. The socket is root:GROUP, mode 0660, and every
    /// connection's peer credentials (SO_PEERCRED) are checked.
    #[arg(long)]
    pub socket_group: Option<String>,
    /// pids limit of a sandbox that asks for none (podman's default).
    #[arg(long, default_value_t = crate::sandbox::cgroups::DEFAULT_PIDS, value_parser = clap::value_parser!(u64).range(1..=crate::sandbox::cgroups::MAX_PIDS))]
    pub default_pids: u64,
    /// The largest pids limit a create may ask for.
    #[arg(long, default_value_t = crate::sandbox::cgroups::MAX_PIDS, value_parser = clap::value_parser!(u64).range(1..=crate::sandbox::cgroups::MAX_PIDS))]
    pub max_pids: u64,
    /// Memory limit of a sandbox that asks for none (e.g. 1g; default none).
    #[arg(long, value_parser = crate::units::parse_bytes)]
    pub default_memory: Option<u64>,
    /// The largest memory limit a create may ask for (default none).
    #[arg(long, value_parser = crate::units::parse_bytes)]
    pub max_memory: Option<u64>,
    /// Close an API connection whose request head is not whole this long
    /// after its first byte (or after the connection opened).
    #[arg(long, default_value = "10s", value_parser = positive_duration)]
    pub header_timeout: std::time::Duration,
    /// Close a kept-alive API connection idle (no request in flight) this long.
    #[arg(long, default_value = "60s", value_parser = positive_duration)]
    pub idle_timeout: std::time::Duration,
    /// Answer 408 and close when a request body is not whole this long
    /// after its head.
    #[arg(long, default_value = "30s", value_parser = positive_duration)]
    pub body_timeout: std::time::Duration,
    /// API connections open at once; past it a new one is answered 429.
    #[arg(long, default_value_t = crate::api::DEFAULT_MAX_CONNECTIONS as u32, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub max_connections: u32,
    /// How much of each command's output (stdout and stderr together) its
    /// exec record keeps (e.g. 1m, 0 for none); past it, the cut is counted.
    #[arg(long, default_value = "1m", value_parser = parse_keep_output)]
    pub keep_output: usize,
    /// On SIGTERM, how long API requests in flight may take to finish.
    #[arg(long, default_value = "30s", value_parser = crate::units::parse_duration)]
    pub shutdown_grace: std::time::Duration,
    /// The catalog: empty for SQLite at ROOT/strata.db (the default), or a
    /// PostgreSQL `postgres://` URL (or `host=/run/postgresql dbname=...`)
    /// shared by a fleet of hosts.
    #[arg(long, env = "STRATA_DATABASE", value_parser = parse_database)]
    pub database: Option<String>,
    /// The fleet registry, HOST[:PORT]/REPOSITORY: distributed snapshots
    /// are published there (tagged by id), and layers a host lacks are
    /// brought from there.
    #[arg(long)]
    pub registry: Option<String>,
    /// Speak plain HTTP to the fleet registry (one on loopback).
    #[arg(long, requires = "registry")]
    pub insecure_registry: bool,
    /// Sandbox networking: `on` (sandboxes may ask for egress: veths, an
    /// nft table `inet strata`, IPv4 forwarding) or `off` (loopback only,
    /// the host's network untouched). One networked daemon per network
    /// namespace.
    #[arg(long, default_value = "on", value_parser = ["on", "off"])]
    pub network: String,
    /// The range egress sandboxes get their addresses from (a /31 each).
    #[arg(long, default_value = crate::net::DEFAULT_RANGE)]
    pub network_cidr: String,
    /// Where the sandboxes' resolver forwards, IP[:PORT] (default: the
    /// host's first nameserver in /etc/resolv.conf).
    #[arg(long)]
    pub dns_upstream: Option<String>,
    /// Connections a sandbox may have tracked at once; past it new ones
    /// are refused.
    #[arg(long, default_value_t = crate::net::DEFAULT_CONNTRACK)]
    pub sandbox_conntrack: u32,
    /// An always-denied destination (link-local, the metadata address,
    /// the sandboxes' range) the operator opens to sandboxes whose policy
    /// allows it (repeatable CIDR). The host's own addresses stay closed.
    #[arg(long = "network-permit")]
    pub network_permit: Vec<String>,
    /// GRO and a kernel NAPI thread on each sandbox veth's host end: what a
    /// sandbox sends is forwarded on another core beside it (`off`: the
    /// kernel's default, forwarded in the sender's softirq).
    #[arg(long, default_value = "on", value_parser = ["on", "off"])]
    pub network_napi_thread: String,
    /// This host's id in the catalog (default: the hostname); hosts sharing
    /// a catalog each need their own.
    #[arg(long)]
    pub host_id: Option<String>,
    /// Renew this host's row in the catalog this often.
    #[arg(long, default_value = "5s", value_parser = positive_duration)]
    pub heartbeat: std::time::Duration,
    /// Other hosts mark this one down when its row is not renewed for this
    /// long (more than --heartbeat).
    #[arg(long, default_value = "20s", value_parser = positive_duration)]
    pub host_deadline: std::time::Duration,
    /// Also serve E2B's API (control and envd) on this TCP address, e.g.
    /// 127.0.0.1:3000 (plain HTTP: keep it on loopback or behind TLS).
    #[arg(long, requires = "e2b_api_keys")]
    pub e2b_listen: Option<std::net::SocketAddr>,
    /// The API keys E2B clients may use (X-API-KEY), one per line.
    #[arg(long)]
    pub e2b_api_keys: Option<PathBuf>,
    /// Also route envd requests by `Host: 49983-<id>.<DOMAIN>`, and answer
    /// creates with this domain.
    #[arg(long)]
    pub e2b_domain: Option<String>,
    /// Connections one E2B client (source address) may keep open at once;
    /// past it its new ones are closed.
    #[arg(long, default_value_t = crate::e2b::clients::DEFAULT_CONNECTIONS, value_parser = at_least_one)]
    pub e2b_client_connections: usize,
    /// Requests one E2B client may have in flight at once; past it they
    /// are answered 429.
    #[arg(long, default_value_t = crate::e2b::clients::DEFAULT_REQUESTS, value_parser = at_least_one)]
    pub e2b_client_requests: usize,
    /// Disk cap of every sandbox E2B clients start (e.g. 10g; as a
    /// create's `disk`: needs loop devices). Default none.
    #[arg(long, value_parser = crate::units::parse_bytes)]
    pub e2b_disk: Option<u64>,
    /// An E2B `envVars` name whose value is secret: kept out of the
    /// catalog as a create's `secret_env` is (NAME, or PREFIX* for every
    /// name it begins; repeatable). Default none.
    #[arg(long, value_name = "NAME")]
    pub e2b_secret_env: Vec<String>,
}

fn at_least_one(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err(format!("{s:?}: a whole number, at least 1")),
    }
}

fn parse_database(s: &str) -> Result<String, String> {
    if !(s.starts_with("postgres://") || s.starts_with("postgresql://") || s.contains('=')) {
        return Err(format!(
            "{s:?}: expected a postgres:// URL or a key=value connection string (SQLite needs no flag)"
        ));
    }
    s.parse::<postgres::Config>().map(|_| s.to_string()).map_err(|e| format!("{}: {e}", crate::catalog::redact(s)))
}

fn parse_keep_output(s: &str) -> Result<usize, String> {
    match crate::units::parse_bytes(s)? {
        n if n <= MAX_KEEP_OUTPUT => Ok(n as usize),
        _ => Err(format!("{s:?}: at most 64m of output is kept per command")),
    }
}

/// The most `--keep-output` may keep per command (the catalog keeps each
/// in the row).
const MAX_KEEP_OUTPUT: u64 = 64 << 20;

fn positive_duration(s: &str) -> Result<std::time::Duration, String> {
    match crate::units::parse_duration(s)? {
        d if d.is_zero() => Err(format!("{s:?}: must be longer than 0s")),
        d => Ok(d),
    }
}

/// The daemon's `--network*` flags.
fn network_config(a: &DaemonArgs) -> anyhow::Result<Option<crate::net::NetConfig>> {
    if a.network == "off" {
        return Ok(None);
    }
    let range = crate::net::NetConfig::parse_range(&a.network_cidr).context("--network-cidr")?;
    let upstream = match &a.dns_upstream {
        None => crate::net::NetConfig::host_upstream(),
        Some(s) => s
            .parse::<std::net::SocketAddr>()
            .or_else(|_| s.parse::<std::net::IpAddr>().map(|ip| std::net::SocketAddr::new(ip, 53)))
            .map_err(|_| anyhow::anyhow!("--dns-upstream {s:?} is not IP[:PORT]"))?,
    };
    if a.sandbox_conntrack == 0 {
        anyhow::bail!("--sandbox-conntrack must be at least 1");
    }
    let permit = a
        .network_permit
        .iter()
        .map(|c| c.parse::<crate::net::Cidr>().with_context(|| format!("--network-permit {c:?}")))
        .collect::<anyhow::Result<Vec<_>>>()?;
    Ok(Some(crate::net::NetConfig {
        range,
        upstream,
        conntrack: a.sandbox_conntrack,
        permit,
        table: "strata".into(),
        napi_thread: a.network_napi_thread == "on",
    }))
}

/// `IMAGE=N` of `--pool`.
fn parse_pool(s: &str) -> Result<(crate::ids::ImageName, usize), String> {
    let (image, n) = s.rsplit_once('=').ok_or_else(|| format!("{s:?} is not IMAGE=N"))?;
    let n: usize = n.parse().map_err(|_| format!("{n:?} is not a count"))?;
    if !(1..=64).contains(&n) {
        return Err(format!("a pool holds 1 to 64 sandboxes, not {n}"));
    }
    Ok((image.parse().map_err(|e| format!("{e}"))?, n))
}

pub(super) fn run(cli: &Cli, a: &DaemonArgs) -> Result<i32> {
    let socket_gid = match &a.socket_group {
        None => None,
        Some(g) => Some(match g.parse::<u32>() {
            Ok(gid) => gid,
            Err(_) => nix::unistd::Group::from_name(g)
                .with_context(|| format!("look up group {g}"))?
                .with_context(|| format!("no group named {g}"))?
                .gid
                .as_raw(),
        }),
    };
    let cfg = DaemonConfig {
        root: a.root.clone(),
        socket: cli.socket.clone(),
        socket_gid,
        max_sandboxes: a.max_sandboxes,
        cgroup_parent: a.cgroup_parent.clone(),
        shim: a.shim.clone(),
        warm_pool: a.warm_pool,
        compact_depth: usize::from(a.compact_depth),
        userns_base: a.userns_base,
        retention: a.retention,
        stale_after: a.stale_after,
        limit_policy: crate::sandbox::cgroups::LimitPolicy {
            default_pids: a.default_pids,
            max_pids: a.max_pids,
            default_memory: a.default_memory,
            max_memory: a.max_memory,
        },
        on_timeout: a.on_timeout,
        pools: a.pools.clone(),
        keep_output: a.keep_output,
        database: a.database.clone(),
        host_id: a.host_id.clone().unwrap_or_else(crate::daemon::host::hostname),
        heartbeat: a.heartbeat,
        host_deadline: a.host_deadline,
        registry: a
            .registry
            .as_deref()
            .map(|r| crate::daemon::distribution::FleetRegistry::parse(r, a.insecure_registry))
            .transpose()
            .map_err(|e| anyhow::anyhow!("--registry {e}"))?,
        network: network_config(a)?,
    };
    if a.host_deadline <= a.heartbeat {
        anyhow::bail!(
            "--host-deadline ({}s) must be longer than --heartbeat ({}s)",
            a.host_deadline.as_secs(),
            a.heartbeat.as_secs()
        );
    }
    let http = crate::api::ServeConfig {
        header_timeout: a.header_timeout,
        idle_timeout: a.idle_timeout,
        body_timeout: a.body_timeout,
        max_connections: a.max_connections as usize,
        shutdown_grace: a.shutdown_grace,
    };
    let e2b = match (&a.e2b_listen, &a.e2b_api_keys) {
        (Some(addr), Some(keys)) => Some((
            *addr,
            crate::e2b::E2bConfig {
                keys: crate::e2b::read_keys(keys).with_context(|| format!("read --e2b-api-keys {}", keys.display()))?,
                domain: a.e2b_domain.clone(),
                clients: crate::e2b::ClientLimits {
                    connections: a.e2b_client_connections,
                    requests: a.e2b_client_requests,
                },
                disk: a.e2b_disk,
                secret_env: a.e2b_secret_env.clone(),
            },
        )),
        _ => None,
    };
    serve(cfg, a.gc_interval, http, e2b)?;
    Ok(0)
}

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
pub fn serve(
    cfg: DaemonConfig,
    gc_interval: Duration,
    http: crate::api::ServeConfig,
    e2b: Option<(std::net::SocketAddr, crate::e2b::E2bConfig)>,
) -> Result<(), ServeError> {
    cfg.limit_policy.check()?;
    raise_open_files(http.max_connections);
    for clash in crate::sandbox::userns::host_ids_in_ranges(cfg.userns_base) {
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
    daemon.start_background(gc_interval);
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
