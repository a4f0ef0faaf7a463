//! The `strata` command line: `strata daemon` and the client subcommands.
//! Client subcommands are thin: parse, one or two API calls, print.

use std::io::{IsTerminal, Read, Write};
use std::os::fd::AsFd;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};

use crate::client::{Client, ClientError};
use crate::daemon::DaemonConfig;
use crate::stream::{self, FrameKind};
use crate::types::{
    CheckpointRequest, CreateRequest, ExecRequestBody, ImageInfo, ImportRequest, LaunchRequest, SandboxInfo,
    SnapshotInfo,
};

pub const DEFAULT_ROOT: &str = "/var/lib/strata";
pub const DEFAULT_SOCKET: &str = "/run/strata/strata.sock";

#[derive(Parser, Debug)]
#[command(name = "strata", version, about = "Strata: sandboxes for agents on overlayfs, namespaces and cgroups")]
pub struct Cli {
    /// The daemon's API socket.
    #[arg(long, global = true, env = "STRATA_SOCKET", default_value = DEFAULT_SOCKET)]
    pub socket: PathBuf,
    #[command(subcommand)]
    pub cmd: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Run the daemon (as root).
    Daemon(Box<DaemonArgs>),
    /// A capture worker the daemon starts (one JSON job on stdin); not
    /// for use by hand.
    #[command(hide = true)]
    Worker,
    /// Manage images.
    #[command(subcommand)]
    Image(ImageCmd),
    /// Create a sandbox and print its id.
    Create(CreateArgs),
    /// Run a command in a sandbox; exits with the command's exit code.
    Exec(ExecArgs),
    /// List sandboxes.
    Ps,
    /// Show one sandbox as JSON.
    Inspect { id: String },
    /// Show sandboxes' CPU, memory and disk use now (all running ones
    /// without ids).
    Stats {
        ids: Vec<String>,
        /// One JSON object per line instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Seal a sandbox's changes as a snapshot (it keeps running); prints its id.
    Checkpoint {
        id: String,
        /// Blob compression: zstd (default) or gzip.
        #[arg(long, value_parser = ["zstd", "gzip"])]
        compression: Option<String>,
        /// Capture every change since the sandbox started (over its base),
        /// not only what changed since its last checkpoint.
        #[arg(long)]
        whole: bool,
        /// local (default), or distributed: also published to the fleet
        /// registry (the daemon's --registry) before the answer.
        #[arg(long = "type", default_value = "local")]
        kind: crate::model::SnapshotType,
        /// With --type distributed: answer once it is made and publish it
        /// in the background (`snapshot inspect` shows `publishing`).
        #[arg(long = "async")]
        background: bool,
    },
    /// Stop a sandbox, seal its changes by moving them into the layer store,
    /// release it; prints the snapshot id.
    Suspend { id: String },
    /// Start a sandbox whose files are exactly a snapshot's, continuing the
    /// snapshot's lineage; or, with --work-context, the lineage's head (else
    /// the snapshot it began from, else its image). Prints its id (and, on
    /// stderr, the rung used).
    Resume {
        #[arg(required_unless_present = "work_context", conflicts_with = "work_context")]
        snapshot: Option<String>,
        #[arg(long)]
        work_context: Option<String>,
        #[command(flatten)]
        launch: LaunchArgs,
    },
    /// Start N independent sandboxes from one snapshot; prints their ids.
    Fork {
        snapshot: String,
        #[arg(long, default_value_t = 1)]
        count: u32,
        #[command(flatten)]
        launch: LaunchArgs,
    },
    /// Discard a sandbox's changes and continue from a snapshot of its own
    /// lineage; its processes restart fresh.
    Rollback {
        id: String,
        #[arg(long)]
        to: String,
    },
    /// The exec log of a sandbox, or the one sealed with a snapshot.
    Logs {
        id: String,
        /// Print each command's output as kept (stdout, then stderr).
        #[arg(long)]
        output: bool,
    },
    /// Run a command against a snapshot in a throwaway sandbox forked from
    /// it (removed after) and record the outcome with the snapshot: exit
    /// code, output, and the JSON it writes to $STRATA_RESULT. Prints the
    /// evaluation as JSON; the recorded one if this name and version ran
    /// on the snapshot before (unless --again).
    Evaluate {
        snapshot: String,
        #[arg(long)]
        name: String,
        #[arg(long)]
        version: String,
        /// How long the command may run (default 10m).
        #[arg(long, value_parser = crate::units::parse_duration)]
        timeout: Option<std::time::Duration>,
        #[arg(long)]
        again: bool,
        /// KEY=VALUE for the command (repeatable).
        #[arg(long = "env", short = 'e')]
        env: Vec<String>,
        #[arg(last = true, required = true)]
        argv: Vec<String>,
    },
    /// Copy files or trees between the host and a sandbox: `cp SRC ID:DST`
    /// or `cp ID:SRC DST`; `-` on the host side is a tar stream on
    /// stdin/stdout. Sandbox paths resolve inside its root only.
    Cp {
        src: String,
        dst: String,
        /// Out of a sandbox: leave symlinks out (recreated as they are, a
        /// target such as /etc/shadow names a host file; docs/security.md).
        #[arg(long)]
        no_symlinks: bool,
    },
    /// Added (A), changed (C) and deleted (D) paths of a sandbox's or a
    /// snapshot's delta, like `docker diff`.
    Diff {
        id: String,
        /// A snapshot's changes as a unified diff (`git diff --no-index`
        /// form) instead of a list of paths.
        #[arg(long)]
        patch: bool,
        /// With --patch: compare with this snapshot instead of what the
        /// snapshot ran on.
        #[arg(long, requires = "patch")]
        against: Option<String>,
    },
    /// Manage snapshots.
    #[command(subcommand)]
    Snapshot(SnapshotCmd),
    /// Show or retire a lineage (work context).
    #[command(subcommand)]
    Lineage(LineageCmd),
    /// Publish a sandbox's clean repository as a baseline.
    #[command(subcommand)]
    Baseline(BaselineCmd),
    /// Retire stale lineages and delete superseded, retired and failed
    /// snapshots past retention (the daemon also does this periodically).
    Gc {
        /// Default: the daemon's --retention.
        #[arg(long, value_parser = crate::units::parse_duration)]
        retention: Option<std::time::Duration>,
        /// Default: the daemon's --stale-after.
        #[arg(long, value_parser = crate::units::parse_duration)]
        stale_after: Option<std::time::Duration>,
    },
    /// Freeze every process of a sandbox in place (nothing is written).
    Pause { id: String },
    /// The host's capacity as JSON: slots, memory and CPUs allocated,
    /// store use, images and layers held, ready or draining.
    Info,
    /// The store's use by images, snapshots and sandboxes, and what gc
    /// would reclaim now.
    Df,
    /// The hosts sharing the catalog: state, slots, last heartbeat,
    /// sandboxes (--json for everything, capacity included).
    Hosts {
        #[arg(long)]
        json: bool,
    },
    /// Stop starting new sandboxes on this host, or on HOST of the fleet
    /// (running ones go on); --off ends it.
    Drain {
        /// A host id from `strata hosts` (default: this daemon's host).
        host: Option<String>,
        #[arg(long)]
        reason: Option<String>,
        #[arg(long, conflicts_with = "reason")]
        off: bool,
    },
    /// Give a sandbox a new deadline, this long from now (30s, 15m, 2h).
    Timeout {
        id: String,
        #[arg(value_parser = crate::units::parse_duration)]
        timeout: std::time::Duration,
        /// remove or suspend (default: as before).
        #[arg(long)]
        on_timeout: Option<crate::model::OnTimeout>,
    },
    /// Thaw a paused sandbox.
    Unpause { id: String },
    /// A stream to TCP port PORT of a sandbox (its 127.0.0.1:PORT, reached
    /// inside its network namespace, whatever its network): stdin and
    /// stdout, or with --listen a local listener forwarding each connection.
    Port {
        id: String,
        port: u16,
        /// Listen here (e.g. 127.0.0.1:8080) instead of using stdin/stdout.
        #[arg(long)]
        listen: Option<std::net::SocketAddr>,
    },
    /// Replace a running egress sandbox's policy (new connections follow
    /// it at once); no flags: allow everything but the always-denied.
    Network {
        id: String,
        /// CIDR, address or domain it may reach (repeatable).
        #[arg(long = "allow-out")]
        allow_out: Vec<String>,
        /// CIDR or address it may not reach (repeatable).
        #[arg(long = "deny-out")]
        deny_out: Vec<String>,
    },
    /// Remove sandboxes: kill every process, delete upper, work and cgroup;
    /// returns once all of that is done.
    Rm {
        #[arg(required = true)]
        ids: Vec<String>,
        /// Return once each sandbox's processes are killed; its cgroup,
        /// mounts and files go moments later.
        #[arg(long)]
        no_wait: bool,
    },
}

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
    #[arg(long, default_value_t = crate::userns::DEFAULT_BASE, value_parser = clap::value_parser!(u32).range(65536..=4_000_000_000))]
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
    #[arg(long, default_value_t = crate::cgroups::DEFAULT_PIDS, value_parser = clap::value_parser!(u64).range(1..=crate::cgroups::MAX_PIDS))]
    pub default_pids: u64,
    /// The largest pids limit a create may ask for.
    #[arg(long, default_value_t = crate::cgroups::MAX_PIDS, value_parser = clap::value_parser!(u64).range(1..=crate::cgroups::MAX_PIDS))]
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
    s.parse::<postgres::Config>().map(|_| s.to_string()).map_err(|e| format!("{}: {e}", crate::db::redact(s)))
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

#[derive(Subcommand, Debug)]
pub enum ImageCmd {
    /// Import an OCI image layout directory or OCI archive tar, as
    /// `PATH[:TAG]` (the tag picks a manifest of its index.json).
    Import {
        path: PathBuf,
        #[arg(long)]
        name: String,
    },
    /// Pull an image from an OCI registry, fetching only the layers this
    /// host lacks.
    Pull {
        reference: String,
        /// Local name (default: REPOSITORY:TAG of the reference).
        #[arg(long)]
        name: Option<String>,
        #[command(flatten)]
        registry: RegistryArgs,
    },
    /// List images.
    Ls,
    /// Remove an image (refused while a sandbox uses it).
    Rm { name: String },
}

/// How to reach a registry.
#[derive(Args, Debug)]
pub struct RegistryArgs {
    /// Speak plain HTTP to the registry (a local test registry).
    #[arg(long)]
    pub insecure: bool,
    /// Registry user name (basic auth, or for a bearer token).
    #[arg(long, env = "STRATA_REGISTRY_USERNAME")]
    pub username: Option<String>,
    /// Read the registry password from standard input.
    #[arg(long)]
    pub password_stdin: bool,
    /// No progress lines on standard error.
    #[arg(long, short = 'q')]
    pub quiet: bool,
}

impl RegistryArgs {
    fn request(&self, reference: &str, name: Option<String>) -> Result<crate::types::RegistryRequest> {
        let password = if self.password_stdin {
            let mut p = String::new();
            std::io::stdin().read_line(&mut p).context("read password from stdin")?;
            Some(p.trim_end_matches(['\r', '\n']).to_string())
        } else {
            std::env::var("STRATA_REGISTRY_PASSWORD").ok()
        };
        if password.is_some() && self.username.is_none() {
            bail!("a password needs --username (or STRATA_REGISTRY_USERNAME)");
        }
        if self.username.is_some() && password.is_none() {
            bail!("--username needs --password-stdin (or STRATA_REGISTRY_PASSWORD)");
        }
        Ok(crate::types::RegistryRequest {
            reference: reference.to_string(),
            insecure: self.insecure,
            username: self.username.clone(),
            password,
            name,
            progress: true,
        })
    }

    /// A progress printer for standard error.
    fn printer(&self) -> impl FnMut(crate::types::Progress) {
        let quiet = self.quiet;
        move |p| {
            if quiet {
                return;
            }
            let short: String = p.digest.trim_start_matches("sha256:").chars().take(12).collect();
            let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
            match p.action.as_str() {
                "fetch" => eprintln!("fetch   {short}  {:>8.1} / {:.1} MiB", mib(p.done), mib(p.size)),
                a => eprintln!("{a:<7} {short}  {:.1} MiB", mib(p.size)),
            }
        }
    }
}

#[derive(Args, Debug)]
pub struct CreateArgs {
    #[arg(long)]
    pub image: String,
    /// The sandbox's id (16 lowercase hex characters; default: random).
    #[arg(long)]
    pub id: Option<String>,
    /// The new lineage's id (default: a random one).
    #[arg(long)]
    pub work_context: Option<String>,
    /// Start from the ready baseline OWNER/REPO@REF (of --image).
    #[arg(long)]
    pub baseline: Option<String>,
    #[command(flatten)]
    pub launch: LaunchArgs,
}

#[derive(Subcommand, Debug)]
pub enum BaselineCmd {
    /// Copy the repository at --repo out of the sandbox, check it with the
    /// host's git and, if it is clean and at the remote's --ref (and
    /// --commit), publish it as the ready baseline OWNER/REPO@REF; prints
    /// its id.
    Publish {
        id: String,
        #[arg(long)]
        repo: String,
        #[arg(long = "ref")]
        git_ref: String,
        #[arg(long)]
        owner: Option<String>,
        #[arg(long)]
        remote: Option<String>,
        /// The commit the canonical ref is at, if you know it (HEAD must
        /// be it; else the sandbox's remote-tracking ref is taken).
        #[arg(long)]
        commit: Option<String>,
    },
}

#[derive(Subcommand, Debug)]
pub enum LineageCmd {
    /// List lineages: state, head, and the live sandbox working in each.
    Ls {
        /// Only active lineages.
        #[arg(long)]
        active: bool,
    },
    /// Print a lineage: where it began, its head, its checkpoints in order
    /// and every activation.
    Show { id: String },
    /// Retire a finished lineage: its checkpoints leave restore eligibility.
    Retire { id: String },
    /// Close a lineage with its work's outcome: terminal, as a retirement
    /// is, with the outcome on record.
    Close {
        id: String,
        /// completed, cancelled or failed.
        #[arg(long = "as", value_name = "OUTCOME")]
        outcome: crate::model::LineageState,
    },
}

#[derive(Subcommand, Debug)]
pub enum SnapshotCmd {
    /// List snapshots.
    Ls {
        /// Only those labelled KEY (or KEY=VALUE); repeatable, all must match.
        #[arg(long)]
        label: Vec<String>,
    },
    /// Set labels (KEY=VALUE) or remove them (KEY-).
    Label {
        id: String,
        #[arg(required = true)]
        labels: Vec<String>,
    },
    /// Keep a snapshot whatever its age (gc skips it) until released.
    Retain { id: String },
    /// Let gc collect a retained snapshot again under the usual rules.
    Release { id: String },
    /// A snapshot's evaluations as JSON.
    Evaluations { id: String },
    /// Everything recorded of a snapshot as one JSON document: itself, its
    /// chain, provenance, exec log with output, evaluations, labels.
    Result { id: String },
    /// Show one snapshot as JSON.
    Inspect { id: String },
    /// Remove a snapshot (refused while a sandbox or a child snapshot uses it).
    Rm { id: String },
    /// Make a local snapshot distributed: publish it (its sealed blobs,
    /// not recaptured) to the fleet registry; prints its reference there.
    Promote { id: String },
    /// Push a snapshot (its image and chain) to an OCI registry as an
    /// ordinary image; blobs the registry has are not sent again.
    Push {
        id: String,
        reference: String,
        #[command(flatten)]
        registry: RegistryArgs,
    },
    /// Pull a pushed snapshot and recreate it here (same ids and digests).
    Pull {
        reference: String,
        #[command(flatten)]
        registry: RegistryArgs,
    },
    /// Write a snapshot's whole chain as an OCI image layout in a new directory.
    Export {
        id: String,
        dir: PathBuf,
        #[arg(long, value_parser = ["zstd", "gzip"])]
        compression: Option<String>,
    },
}

/// Limits and settings of a created, resumed or forked sandbox.
#[derive(Args, Debug)]
pub struct LaunchArgs {
    /// Memory limit in bytes (suffixes k, m, g accepted).
    #[arg(long, value_parser = crate::units::parse_bytes)]
    pub memory: Option<u64>,
    /// Maximum number of processes.
    #[arg(long)]
    pub pids: Option<u64>,
    /// CPU bandwidth in CPUs (e.g. 0.5).
    #[arg(long)]
    pub cpus: Option<f64>,
    /// Cap on what the sandbox can write, in bytes (suffixes k, m, g): its
    /// changes live on a filesystem of this size; past it, ENOSPC.
    #[arg(long, value_parser = crate::units::parse_bytes)]
    pub disk: Option<u64>,
    /// Environment for every exec, KEY=VALUE (repeatable).
    #[arg(long = "env", short = 'e')]
    pub env: Vec<String>,
    /// Secret environment for every exec, never stored in the catalog:
    /// KEY=VALUE, or KEY alone for the value of KEY in this command's own
    /// environment (kept off the command line). Repeatable.
    #[arg(long = "secret-env", value_name = "KEY[=VALUE]")]
    pub secret_env: Vec<String>,
    #[arg(long)]
    pub hostname: Option<String>,
    /// Scratch tmpfs, PATH[:SIZE] (repeatable); never captured.
    #[arg(long)]
    pub scratch: Vec<String>,
    /// Named host cache, NAME:PATH (repeatable); never captured.
    #[arg(long)]
    pub cache: Vec<String>,
    /// `default` (the seccomp filter) or `unconfined` (no filter).
    #[arg(long, value_parser = ["default", "unconfined"])]
    pub seccomp: Option<String>,
    /// Run in its own user namespace: root inside is an unprivileged host
    /// id (a range of 65536 per sandbox). A snapshot captured in one always
    /// runs in one.
    #[arg(long)]
    pub userns: bool,
    /// Remove (or, with --on-timeout suspend, suspend) it this long after
    /// it starts (30s, 15m, 2h); renew with `strata timeout`.
    #[arg(long, value_parser = crate::units::parse_duration)]
    pub timeout: Option<std::time::Duration>,
    /// What its deadline does: remove, or suspend into its lineage
    /// (default: the daemon's --on-timeout).
    #[arg(long, requires = "timeout")]
    pub on_timeout: Option<crate::model::OnTimeout>,
    /// Suspend it into its lineage after this long with no exec running,
    /// no attached session and no API call naming it.
    #[arg(long, value_parser = crate::units::parse_duration)]
    pub idle_timeout: Option<std::time::Duration>,
    /// When the host is at --max-sandboxes, queue this long for a slot
    /// (first come, first served) instead of failing at once.
    #[arg(long, value_parser = crate::units::parse_duration)]
    pub wait: Option<std::time::Duration>,
    /// `none` (loopback only) or `egress` (an address, a resolver, NAT
    /// out under --allow-out/--deny-out). Default for create: none; for
    /// resume and fork: as the snapshot's sandbox had it.
    #[arg(long)]
    pub network: Option<crate::net::NetworkMode>,
    /// A CIDR, address or domain (`*.` wildcards) it may reach, winning
    /// over --deny-out (repeatable; implies --network egress).
    #[arg(long = "allow-out")]
    pub allow_out: Vec<String>,
    /// A CIDR or address it may not reach; 0.0.0.0/0 denies all but
    /// --allow-out (repeatable; implies --network egress).
    #[arg(long = "deny-out")]
    pub deny_out: Vec<String>,
}

/// `--secret-env` entries as the API takes them: a bare KEY is KEY's
/// value in this process's environment (unset: sent as given, refused).
fn secret_env(entries: &[String]) -> Vec<String> {
    entries
        .iter()
        .map(|e| match std::env::var(e) {
            Ok(v) if !e.contains('=') => format!("{e}={v}"),
            _ => e.clone(),
        })
        .collect()
}

impl LaunchArgs {
    fn request(&self, count: Option<u32>) -> LaunchRequest {
        LaunchRequest {
            memory: self.memory,
            pids: self.pids,
            cpus: self.cpus,
            disk: self.disk,
            env: self.env.clone(),
            secret_env: secret_env(&self.secret_env),
            hostname: self.hostname.clone(),
            count,
            scratch: self.scratch.clone(),
            cache: self.cache.clone(),
            seccomp: self.seccomp.clone(),
            userns: self.userns.then_some(true),
            timeout: self.timeout.map(whole_seconds),
            on_timeout: self.on_timeout,
            idle_timeout: self.idle_timeout.map(whole_seconds),
            id: None,
            wait: self.wait.map(whole_seconds),
            network: (self.network.is_some() || !self.allow_out.is_empty() || !self.deny_out.is_empty()).then(|| {
                crate::types::NetworkRequest {
                    mode: self.network,
                    allow_out: self.allow_out.clone(),
                    deny_out: self.deny_out.clone(),
                }
            }),
        }
    }
}

/// `strata stats`: one line (or JSON object) per sandbox.
fn stats(cli: &Cli, ids: &[String], json: bool) -> anyhow::Result<i32> {
    let mut c = client(cli)?;
    let ids: Vec<String> = if ids.is_empty() {
        let list: Vec<SandboxInfo> = c.call("GET", "/v1/sandboxes", NO_BODY)?;
        list.into_iter().filter(|s| s.state == "running").map(|s| s.id).collect()
    } else {
        ids.to_vec()
    };
    if !json {
        println!(
            "{:<18} {:>6} {:>5} {:>21} {:>6} {:>21}",
            "ID", "CPU %", "CPUS", "MEM USED / LIMIT", "MEM %", "DISK USED / TOTAL"
        );
    }
    let mib = |b: u64| format!("{:.1}MiB", b as f64 / (1u64 << 20) as f64);
    let mut failed = 0;
    for id in ids {
        let m: crate::types::SandboxMetrics = match c.call("GET", &format!("/v1/sandboxes/{id}/metrics"), NO_BODY) {
            Ok(m) => m,
            Err(e) => {
                eprintln!("{id}: {e:#}");
                failed += 1;
                continue;
            }
        };
        if json {
            println!("{}", serde_json::to_string(&serde_json::json!({"id": id, "metrics": m}))?);
            continue;
        }
        let mem_pct = if m.mem_total == 0 { 0.0 } else { m.mem_used as f64 / m.mem_total as f64 * 100.0 };
        println!(
            "{:<18} {:>6.2} {:>5} {:>21} {:>6.2} {:>21}",
            id,
            m.cpu_used_pct,
            m.cpu_count,
            format!("{} / {}", mib(m.mem_used), mib(m.mem_total)),
            mem_pct,
            format!("{} / {}", mib(m.disk_used), mib(m.disk_total)),
        );
    }
    Ok(i32::from(failed > 0))
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

/// A duration as whole seconds, rounded up (the API takes seconds).
fn whole_seconds(d: std::time::Duration) -> u64 {
    d.as_secs() + u64::from(d.subsec_nanos() > 0)
}

#[derive(Args, Debug)]
pub struct ExecArgs {
    pub id: String,
    /// Forward stdin.
    #[arg(short = 'i', long)]
    pub interactive: bool,
    /// Allocate a pseudo-terminal.
    #[arg(short = 't', long)]
    pub tty: bool,
    #[arg(long = "env", short = 'e')]
    pub env: Vec<String>,
    #[arg(long)]
    pub cwd: Option<String>,
    /// UID[:GID]
    #[arg(long, short = 'u')]
    pub user: Option<String>,
    /// Kill the command's process group after this many seconds.
    #[arg(long)]
    pub timeout: Option<f64>,
    #[arg(last = true, required = true)]
    pub cmd: Vec<String>,
}

fn compression_arg(c: Option<&str>) -> Option<crate::store::BlobCompression> {
    // clap has checked it is one of them.
    c.and_then(|c| c.parse().ok())
}

/// A file name as one line of human output: a backslash, control
/// characters (a newline would forge another line) and DEL escaped as in C
/// (`\\`, `\n`, `\t`, `\xNN`). JSON output stays exact.
fn shown_name(name: &str) -> std::borrow::Cow<'_, str> {
    if !name.chars().any(|c| c == '\\' || c.is_control()) {
        return name.into();
    }
    let mut out = String::with_capacity(name.len() + 8);
    for c in name.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\t' => out.push_str("\\t"),
            '\r' => out.push_str("\\r"),
            c if c.is_control() => {
                let mut b = [0u8; 4];
                for byte in c.encode_utf8(&mut b).bytes() {
                    out.push_str(&format!("\\x{byte:02x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.into()
}

/// `PATH[:TAG]` (umoci's and skopeo's `oci:` convention): a path that
/// exists is taken whole; else the part after its last `:` is the tag if
/// the part before exists.
fn split_tag(arg: &std::path::Path) -> (PathBuf, Option<String>) {
    use std::os::unix::ffi::OsStrExt;
    if arg.exists() {
        return (arg.to_path_buf(), None);
    }
    let bytes = arg.as_os_str().as_bytes();
    if let Some(at) = bytes.iter().rposition(|&b| b == b':') {
        let (dir, tag) = (&bytes[..at], &bytes[at + 1..]);
        let dir = std::path::Path::new(std::ffi::OsStr::from_bytes(dir));
        if !tag.is_empty() && !tag.contains(&b'/') && dir.exists() {
            return (dir.to_path_buf(), Some(String::from_utf8_lossy(tag).into_owned()));
        }
    }
    (arg.to_path_buf(), None)
}

fn client(cli: &Cli) -> Result<Client> {
    Ok(Client::connect(&cli.socket)?)
}

const NO_BODY: Option<&()> = None;

/// Run a parsed command; returns the process exit code.
pub fn run(cli: Cli) -> Result<i32> {
    match &cli.cmd {
        Command::Daemon(a) => run_daemon(&cli, a),
        Command::Worker => Ok(crate::worker::main()),
        Command::Image(ImageCmd::Import { path, name }) => {
            let (path, tag) = split_tag(path);
            let path = std::fs::canonicalize(&path).with_context(|| format!("resolve {}", path.display()))?;
            let req = ImportRequest { path: path.to_string_lossy().into_owned(), name: name.clone(), tag };
            let info: ImageInfo = client(&cli)?.call("POST", "/v1/images/import", Some(&req))?;
            println!("{}", info.name);
            Ok(0)
        }
        Command::Image(ImageCmd::Pull { reference, name, registry }) => {
            let req = registry.request(reference, name.clone())?;
            let r: crate::types::PullResult =
                client(&cli)?.call_streamed("/v1/images/pull", &req, &mut registry.printer())?;
            eprintln!(
                "fetched {} blobs, {} bytes; {} layers reused",
                r.fetched_blobs, r.fetched_bytes, r.reused_layers
            );
            println!("{}", r.image.name);
            Ok(0)
        }
        Command::Image(ImageCmd::Ls) => {
            let images: Vec<ImageInfo> = client(&cli)?.call("GET", "/v1/images", NO_BODY)?;
            println!("{:<32} {:<20} LAYERS", "NAME", "MANIFEST");
            for i in images {
                let short = i.manifest_digest.trim_start_matches("sha256:").chars().take(12).collect::<String>();
                println!("{:<32} {:<20} {}", i.name, short, i.layers.len());
            }
            Ok(0)
        }
        Command::Image(ImageCmd::Rm { name }) => {
            client(&cli)?.request("DELETE", &format!("/v1/images/{name}"), NO_BODY)?;
            Ok(0)
        }
        Command::Create(a) => {
            let l = a.launch.request(None);
            let req = CreateRequest {
                image: a.image.clone(),
                id: a.id.clone(),
                wait: l.wait,
                memory: l.memory,
                pids: l.pids,
                cpus: l.cpus,
                disk: l.disk,
                env: l.env,
                secret_env: l.secret_env,
                hostname: l.hostname,
                scratch: l.scratch,
                cache: l.cache,
                seccomp: l.seccomp,
                userns: l.userns,
                work_context: a.work_context.clone(),
                baseline: a.baseline.clone(),
                timeout: l.timeout,
                on_timeout: l.on_timeout,
                idle_timeout: l.idle_timeout,
                network: l.network,
            };
            let info: SandboxInfo = client(&cli)?.call("POST", "/v1/sandboxes", Some(&req))?;
            println!("{}", info.id);
            Ok(0)
        }
        Command::Ps => {
            let list: Vec<SandboxInfo> = client(&cli)?.call("GET", "/v1/sandboxes", NO_BODY)?;
            println!("{:<18} {:<24} {:<8} {:<12} {:<8} CPUS", "ID", "IMAGE", "STATE", "MEMORY", "PIDS");
            let opt = |v: Option<String>| v.unwrap_or_else(|| "-".into());
            for s in list {
                println!(
                    "{:<18} {:<24} {:<8} {:<12} {:<8} {}",
                    s.id,
                    s.image,
                    s.state,
                    opt(s.limits.memory.map(|m| m.to_string())),
                    opt(s.limits.pids.map(|m| m.to_string())),
                    opt(s.limits.cpus.map(|m| m.to_string()))
                );
            }
            Ok(0)
        }
        Command::Inspect { id } => {
            let info: SandboxInfo = client(&cli)?.call("GET", &format!("/v1/sandboxes/{id}"), NO_BODY)?;
            println!("{}", serde_json::to_string_pretty(&info)?);
            Ok(0)
        }
        Command::Stats { ids, json } => stats(&cli, ids, *json),
        Command::Rm { ids, no_wait } => {
            let mut c = client(&cli)?;
            let mut failed = 0;
            for id in ids {
                match c.request("DELETE", &format!("/v1/sandboxes/{id}?wait={}", !no_wait), NO_BODY) {
                    Ok(body) => {
                        // A body: a sandbox of a down host (202), removed when it is back.
                        if let Ok(d) = serde_json::from_slice::<crate::types::RemovalDeferred>(&body) {
                            eprintln!(
                                "strata: rm {id}: its host {} is down ({}); that host removes it when back",
                                d.host, d.host_down
                            );
                        }
                        println!("{id}")
                    }
                    Err(e) => {
                        eprintln!("strata: rm {id}: {e}");
                        failed += 1;
                    }
                }
            }
            Ok(if failed > 0 { 1 } else { 0 })
        }
        Command::Checkpoint { id, compression, whole, kind, background } => {
            let compression = compression_arg(compression.as_deref());
            let snap: SnapshotInfo = client(&cli)?.call(
                "POST",
                &format!("/v1/sandboxes/{id}/checkpoint"),
                Some(&CheckpointRequest { compression, whole: *whole, kind: *kind, background: *background }),
            )?;
            println!("{}", snap.id);
            Ok(0)
        }
        Command::Suspend { id } => {
            let snap: SnapshotInfo = client(&cli)?.call("POST", &format!("/v1/sandboxes/{id}/suspend"), NO_BODY)?;
            println!("{}", snap.id);
            Ok(0)
        }
        Command::Resume { snapshot, work_context, launch } => {
            let path = match (snapshot, work_context) {
                (Some(s), _) => format!("/v1/snapshots/{s}/resume"),
                (None, Some(wc)) => format!("/v1/lineages/{wc}/resume"),
                (None, None) => unreachable!("clap requires one"),
            };
            let info: SandboxInfo = client(&cli)?.call("POST", &path, Some(&launch.request(None)))?;
            if let Some(r) = &info.restored {
                eprintln!("resumed from {} ({})", r.snapshot.as_deref().unwrap_or("the image"), r.rung);
            }
            println!("{}", info.id);
            Ok(0)
        }
        Command::Baseline(BaselineCmd::Publish { id, repo, git_ref, owner, remote, commit }) => {
            let req = crate::daemon::baseline::PublishRequest {
                repo: repo.clone(),
                git_ref: git_ref.clone(),
                owner: owner.clone(),
                remote: remote.clone(),
                commit: commit.clone(),
            };
            let s: SnapshotInfo = client(&cli)?.call("POST", &format!("/v1/sandboxes/{id}/baseline"), Some(&req))?;
            println!("{}", s.id);
            Ok(0)
        }
        Command::Gc { retention, stale_after } => {
            let req = crate::types::GcRequest {
                retention_secs: retention.map(|d| d.as_secs()),
                stale_after_secs: stale_after.map(|d| d.as_secs()),
            };
            let r: crate::types::GcReport = client(&cli)?.call("POST", "/v1/gc", Some(&req))?;
            for wc in &r.retired {
                println!("retired lineage {wc}");
            }
            for id in &r.deleted {
                println!("deleted snapshot {id}");
            }
            for (id, why) in &r.kept {
                println!("kept snapshot {id}: {why}");
            }
            if r.collected > 0 {
                println!("collected {} layers and blobs no row listed", r.collected);
            }
            Ok(0)
        }
        Command::Lineage(LineageCmd::Ls { active }) => {
            let list: Vec<crate::types::LineageSummary> = client(&cli)?.call("GET", "/v1/lineages", NO_BODY)?;
            println!("{:<24} {:<10} {:<18} {:>4} {:<18} {:<16} IMAGE", "ID", "STATE", "HEAD", "SEQ", "HOLDER", "HOST");
            for l in list.iter().filter(|l| !*active || l.state == crate::model::LineageState::Active) {
                println!(
                    "{:<24} {:<10} {:<18} {:>4} {:<18} {:<16} {}",
                    l.id,
                    l.state,
                    l.head.as_deref().unwrap_or("-"),
                    l.head_seq,
                    l.holder.as_ref().map_or("-", |h| h.sandbox.as_str()),
                    l.holder.as_ref().and_then(|h| h.host.as_deref()).unwrap_or("-"),
                    l.image
                );
            }
            Ok(0)
        }
        Command::Lineage(LineageCmd::Show { id }) => {
            let l: crate::types::LineageInfo = client(&cli)?.call("GET", &format!("/v1/lineages/{id}"), NO_BODY)?;
            print_lineage(&l);
            Ok(0)
        }
        Command::Lineage(LineageCmd::Retire { id }) => {
            let l: crate::types::LineageInfo =
                client(&cli)?.call("POST", &format!("/v1/lineages/{id}/retire"), NO_BODY)?;
            print_lineage(&l);
            Ok(0)
        }
        Command::Lineage(LineageCmd::Close { id, outcome }) => {
            let body = crate::types::CloseLineageRequest { outcome: *outcome };
            let l: crate::types::LineageInfo =
                client(&cli)?.call("POST", &format!("/v1/lineages/{id}/close"), Some(&body))?;
            print_lineage(&l);
            Ok(0)
        }
        Command::Fork { snapshot, count, launch } => {
            let list: Vec<SandboxInfo> = client(&cli)?.call(
                "POST",
                &format!("/v1/snapshots/{snapshot}/fork"),
                Some(&launch.request(Some(*count))),
            )?;
            for s in list {
                println!("{}", s.id);
            }
            Ok(0)
        }
        Command::Rollback { id, to } => {
            let req = crate::types::RollbackRequest { to: to.clone() };
            let info: SandboxInfo = client(&cli)?.call("POST", &format!("/v1/sandboxes/{id}/rollback"), Some(&req))?;
            println!("{}", info.id);
            Ok(0)
        }
        Command::Logs { id, output } => {
            let recs: Vec<crate::db::ExecRecord> =
                client(&cli)?.call("GET", &format!("/v1/sandboxes/{id}/logs?output={output}"), NO_BODY)?;
            println!("{:<18} {:>10} {:>5} {:>10} {:<12} ARGV", "SANDBOX", "DURATION", "EXIT", "OUTPUT", "CWD");
            for r in recs {
                println!(
                    "{:<18} {:>8.1}ms {:>5} {:>10} {:<12} {}",
                    r.sandbox_id,
                    r.duration_ms,
                    r.exit_code,
                    r.output_bytes,
                    r.cwd,
                    serde_json::to_string(&r.argv)?
                );
                if let Some(o) = r.output.filter(|_| *output) {
                    print_output(&o);
                }
            }
            Ok(0)
        }
        Command::Evaluate { snapshot, name, version, timeout, again, env, argv } => {
            let req = crate::types::EvaluateRequest {
                name: name.clone(),
                version: version.clone(),
                argv: argv.clone(),
                env: env.clone(),
                timeout: timeout.map(|t| t.as_secs().max(1)),
                again: *again,
            };
            let e: crate::db::Evaluation =
                client(&cli)?.call("POST", &format!("/v1/snapshots/{snapshot}/evaluate"), Some(&req))?;
            eprintln!(
                "{} {} {}: exit {}{} in {:.0} ms",
                e.name,
                e.version,
                if e.recorded { "(recorded)" } else { "(ran)" },
                e.exit_code,
                if e.timed_out { ", timed out" } else { "" },
                e.duration_ms
            );
            println!("{}", serde_json::to_string_pretty(&e)?);
            Ok(0)
        }
        Command::Diff { id, patch: true, against } => {
            let q = against.as_ref().map(|a| format!("&against={}", query_encode(a))).unwrap_or_default();
            let p: crate::patch::Patch =
                client(&cli)?.call("GET", &format!("/v1/snapshots/{id}/diff?patch=true{q}"), NO_BODY)?;
            print!("{}", p.patch);
            if p.truncated {
                eprintln!("patch cut at {} bytes; later files are not shown", crate::patch::MAX_PATCH);
            }
            Ok(0)
        }
        Command::Diff { id, .. } => {
            let mut c = client(&cli)?;
            let changes: Vec<crate::diff::Change> = match c.call("GET", &format!("/v1/sandboxes/{id}/diff"), NO_BODY) {
                Err(e) if e.status() == Some(404) => c.call("GET", &format!("/v1/snapshots/{id}/diff"), NO_BODY)?,
                r => r?,
            };
            for ch in changes {
                println!("{} {}", ch.kind, shown_name(&ch.path));
            }
            Ok(0)
        }
        Command::Snapshot(SnapshotCmd::Ls { label }) => {
            let q: Vec<String> = label.iter().map(|l| format!("label={}", query_encode(l))).collect();
            let list: Vec<SnapshotInfo> =
                client(&cli)?.call("GET", &format!("/v1/snapshots?{}", q.join("&")), NO_BODY)?;
            println!(
                "{:<18} {:<18} {:<24} {:<8} {:>12} {:<10} {:>9} LABELS",
                "ID", "PARENT", "IMAGE", "LAYERS", "BLOB_BYTES", "STATE", "FROZEN_MS"
            );
            for s in list {
                let labels: Vec<String> = s.labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
                println!(
                    "{:<18} {:<18} {:<24} {:<8} {:>12} {:<10} {:>9.1} {}{}",
                    s.id,
                    s.parent.as_deref().unwrap_or("-"),
                    s.image,
                    s.layers.len(),
                    s.blob_size,
                    s.state,
                    s.info["frozen_ms"].as_f64().unwrap_or(0.0),
                    if s.retained { "(retained) " } else { "" },
                    labels.join(",")
                );
            }
            Ok(0)
        }
        Command::Snapshot(SnapshotCmd::Label { id, labels }) => {
            let mut req = crate::types::LabelRequest::default();
            for l in labels {
                match (l.split_once('='), l.strip_suffix('-')) {
                    (Some((k, v)), _) => req.labels.insert(k.to_string(), Some(v.to_string())),
                    (None, Some(k)) => req.labels.insert(k.to_string(), None),
                    (None, None) => anyhow::bail!("{l:?}: give KEY=VALUE to set a label or KEY- to remove it"),
                };
            }
            let s: SnapshotInfo = client(&cli)?.call("POST", &format!("/v1/snapshots/{id}/labels"), Some(&req))?;
            for (k, v) in s.labels {
                println!("{k}={v}");
            }
            Ok(0)
        }
        Command::Snapshot(SnapshotCmd::Retain { id }) | Command::Snapshot(SnapshotCmd::Release { id }) => {
            let op =
                if matches!(&cli.cmd, Command::Snapshot(SnapshotCmd::Retain { .. })) { "retain" } else { "release" };
            let _: SnapshotInfo = client(&cli)?.call("POST", &format!("/v1/snapshots/{id}/{op}"), NO_BODY)?;
            Ok(0)
        }
        Command::Snapshot(SnapshotCmd::Evaluations { id }) => {
            let v: serde_json::Value =
                client(&cli)?.call("GET", &format!("/v1/snapshots/{id}/evaluations"), NO_BODY)?;
            println!("{}", serde_json::to_string_pretty(&v)?);
            Ok(0)
        }
        Command::Snapshot(SnapshotCmd::Result { id }) => {
            let v: serde_json::Value = client(&cli)?.call("GET", &format!("/v1/snapshots/{id}/result"), NO_BODY)?;
            println!("{}", serde_json::to_string_pretty(&v)?);
            Ok(0)
        }
        Command::Snapshot(SnapshotCmd::Inspect { id }) => {
            let s: SnapshotInfo = client(&cli)?.call("GET", &format!("/v1/snapshots/{id}"), NO_BODY)?;
            println!("{}", serde_json::to_string_pretty(&s)?);
            Ok(0)
        }
        Command::Snapshot(SnapshotCmd::Promote { id }) => {
            let snap: SnapshotInfo = client(&cli)?.call("POST", &format!("/v1/snapshots/{id}/promote"), NO_BODY)?;
            println!("{}", snap.registry.unwrap_or_default());
            Ok(0)
        }
        Command::Snapshot(SnapshotCmd::Push { id, reference, registry }) => {
            let req = registry.request(reference, None)?;
            let r: crate::types::PushResult =
                client(&cli)?.call_streamed(&format!("/v1/snapshots/{id}/push"), &req, &mut registry.printer())?;
            eprintln!(
                "uploaded {} blobs ({} bytes); {} present, {} mounted",
                r.uploaded_blobs, r.uploaded_bytes, r.present_blobs, r.mounted_blobs
            );
            println!("{}@{}", r.reference, r.manifest_digest);
            Ok(0)
        }
        Command::Snapshot(SnapshotCmd::Pull { reference, registry }) => {
            let req = registry.request(reference, None)?;
            let r: crate::types::PullResult =
                client(&cli)?.call_streamed("/v1/snapshots/pull", &req, &mut registry.printer())?;
            eprintln!(
                "fetched {} blobs, {} bytes; {} layers reused",
                r.fetched_blobs, r.fetched_bytes, r.reused_layers
            );
            println!("{}", r.snapshot.map(|s| s.id.to_string()).unwrap_or_default());
            Ok(0)
        }
        Command::Snapshot(SnapshotCmd::Export { id, dir, compression }) => {
            let dir = if dir.is_absolute() { dir.clone() } else { std::env::current_dir()?.join(dir) };
            let req = crate::types::ExportRequest {
                path: dir.to_string_lossy().into_owned(),
                compression: compression_arg(compression.as_deref()),
            };
            let out: crate::export::Exported =
                client(&cli)?.call("POST", &format!("/v1/snapshots/{id}/export"), Some(&req))?;
            println!("{} {}", out.path, out.manifest_digest);
            Ok(0)
        }
        Command::Snapshot(SnapshotCmd::Rm { id }) => {
            client(&cli)?.request("DELETE", &format!("/v1/snapshots/{id}"), NO_BODY)?;
            Ok(0)
        }
        Command::Cp { src, dst, no_symlinks } => run_cp(&cli, src, dst, *no_symlinks),
        Command::Pause { id } => {
            client(&cli)?.request("POST", &format!("/v1/sandboxes/{id}/pause"), NO_BODY)?;
            Ok(0)
        }
        Command::Df => {
            let u: crate::types::DiskUsage = client(&cli)?.call("GET", "/v1/df", NO_BODY)?;
            println!("{:<12} {:>6} {:>16} {:>14}", "TYPE", "COUNT", "LAYERS/UPPERS", "BLOBS");
            for (name, x) in [("images", &u.images), ("snapshots", &u.snapshots), ("sandboxes", &u.sandboxes)] {
                println!("{:<12} {:>6} {:>16} {:>14}", name, x.count, x.layer_bytes, x.blob_bytes);
            }
            println!(
                "reclaimable by gc now: {} bytes in {} snapshots; store: {} bytes used, {} free",
                u.reclaimable.bytes,
                u.reclaimable.snapshots.len(),
                u.store_used_bytes,
                u.store_free_bytes
            );
            Ok(0)
        }
        Command::Info => {
            let info: serde_json::Value = client(&cli)?.call("GET", "/v1/info", NO_BODY)?;
            println!("{}", serde_json::to_string_pretty(&info)?);
            Ok(0)
        }
        Command::Hosts { json } => {
            let hosts: Vec<crate::types::HostEntry> = client(&cli)?.call("GET", "/v1/hosts", NO_BODY)?;
            if *json {
                println!("{}", serde_json::to_string_pretty(&hosts)?);
                return Ok(0);
            }
            let now = crate::db::now_ms();
            println!("{:<24} {:<9} {:>9} {:>10} {:>9}  REASON", "HOST", "STATE", "SLOTS", "SANDBOXES", "HEARTBEAT");
            for h in hosts {
                let slots = h.capacity.as_ref().map_or("-".into(), |c| format!("{}/{}", c.slots_used, c.slots_max));
                let ago = format!("{:.1}s ago", (now - h.heartbeat_at_ms).max(0) as f64 / 1000.0);
                println!(
                    "{:<24} {:<9} {:>9} {:>10} {:>9}  {}",
                    h.id,
                    h.state,
                    slots,
                    h.sandboxes.len(),
                    ago,
                    h.reason.unwrap_or_default()
                );
            }
            Ok(0)
        }
        Command::Drain { host, reason, off } => {
            let body = (!*off).then(|| crate::types::DrainRequest { reason: reason.clone() });
            let method = if *off { "DELETE" } else { "POST" };
            let state = match host {
                Some(h) => {
                    if !crate::daemon::host::valid_host_id(h) {
                        anyhow::bail!("host id {h:?} must be 1-64 chars of [A-Za-z0-9._-]");
                    }
                    let path = format!("/v1/hosts/{h}/drain");
                    client(&cli)?.call::<crate::types::HostEntry>(method, &path, body.as_ref())?.state
                }
                None => client(&cli)?.call::<crate::types::HostInfo>(method, "/v1/drain", body.as_ref())?.state,
            };
            println!("{state}");
            Ok(0)
        }
        Command::Timeout { id, timeout, on_timeout } => {
            let body = crate::types::TimeoutRequest { timeout: whole_seconds(*timeout), on_timeout: *on_timeout };
            let info: SandboxInfo = client(&cli)?.call("POST", &format!("/v1/sandboxes/{id}/timeout"), Some(&body))?;
            println!("{}", info.lifetime.deadline_ms.unwrap_or(0));
            Ok(0)
        }
        Command::Unpause { id } => {
            client(&cli)?.request("POST", &format!("/v1/sandboxes/{id}/unpause"), NO_BODY)?;
            Ok(0)
        }
        Command::Exec(a) => run_exec(&cli, a),
        Command::Port { id, port, listen } => run_port(&cli, id, *port, *listen),
        Command::Network { id, allow_out, deny_out } => {
            let body =
                crate::types::NetworkRequest { mode: None, allow_out: allow_out.clone(), deny_out: deny_out.clone() };
            let info: SandboxInfo = client(&cli)?.call("PUT", &format!("/v1/sandboxes/{id}/network"), Some(&body))?;
            println!("{}", serde_json::to_string(&info.network.policy)?);
            Ok(0)
        }
    }
}

/// `strata port`: copy both ways between a port stream and stdin/stdout,
/// or, with `listen`, between each accepted connection and a stream of its own.
fn run_port(cli: &Cli, id: &str, port: u16, listen: Option<std::net::SocketAddr>) -> Result<i32> {
    fn join(
        mut early: std::io::Cursor<Vec<u8>>,
        stream: std::os::unix::net::UnixStream,
        mut input: impl std::io::Read + Send + 'static,
        mut output: impl std::io::Write,
    ) -> std::io::Result<()> {
        let mut up = stream.try_clone()?;
        let sender = std::thread::spawn(move || {
            let _ = std::io::copy(&mut input, &mut up);
            let _ = up.shutdown(std::net::Shutdown::Write);
        });
        std::io::copy(&mut early, &mut output)?;
        std::io::copy(&mut &stream, &mut output)?;
        output.flush()?;
        drop(sender);
        Ok(())
    }
    let Some(addr) = listen else {
        let (early, stream) = client(cli)?.port(id, port)?;
        join(early, stream, std::io::stdin(), std::io::stdout().lock())?;
        return Ok(0);
    };
    let listener = std::net::TcpListener::bind(addr).with_context(|| format!("listen on {addr}"))?;
    eprintln!("forwarding {} to port {port} of sandbox {id}", listener.local_addr()?);
    for conn in listener.incoming() {
        let conn = conn?;
        let (early, stream) = client(cli)?.port(id, port)?;
        let out = conn.try_clone()?;
        std::thread::spawn(move || {
            let _ = join(early, stream, conn, out);
        });
    }
    Ok(0)
}

fn run_daemon(cli: &Cli, a: &DaemonArgs) -> Result<i32> {
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
        limit_policy: crate::cgroups::LimitPolicy {
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
            .map(|r| crate::daemon::fleet::FleetRegistry::parse(r, a.insecure_registry))
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
    crate::server::run(cfg, a.gc_interval, http, e2b)?;
    Ok(0)
}

/// A command's kept output, as `logs --output` prints it.
fn print_output(o: &crate::model::KeptOutput) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    for (name, bytes) in [("stdout", &o.stdout), ("stderr", &o.stderr)] {
        if !bytes.is_empty() {
            let _ = writeln!(out, "  --- {name}");
            let _ = out.write_all(bytes);
            if !bytes.ends_with(b"\n") {
                let _ = writeln!(out);
            }
        }
    }
    if o.cut > 0 {
        let _ = writeln!(out, "  --- [{} more bytes of output not kept]", o.cut);
    }
}

/// A query parameter's value, percent-encoded.
fn query_encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// `ID:PATH` with a 16-hex-digit sandbox id, else a host path.
fn sandbox_side(arg: &str) -> Option<(&str, &str)> {
    let (id, path) = arg.split_once(':')?;
    (id.len() == 16 && id.bytes().all(|b| b.is_ascii_hexdigit())).then_some((id, path))
}

fn run_cp(cli: &Cli, src: &str, dst: &str, no_symlinks: bool) -> Result<i32> {
    use crate::copy::{Copied, CopyRequest, Direction};
    let staging = || -> Result<PathBuf> {
        let dir = std::env::temp_dir().join(format!("strata-cp-{:016x}", rand::random::<u64>()));
        std::os::unix::fs::DirBuilderExt::mode(&mut std::fs::DirBuilder::new(), 0o700)
            .create(&dir)
            .with_context(|| format!("create {}", dir.display()))?;
        Ok(dir)
    };
    let absolute = |p: &str| -> Result<String> {
        let p = std::path::Path::new(p);
        let abs = if p.is_absolute() { p.to_path_buf() } else { std::env::current_dir()?.join(p) };
        Ok(abs.to_string_lossy().into_owned())
    };
    let mut c = client(cli)?;
    let mut call = |id: &str, req: CopyRequest| -> Result<Copied> {
        Ok(c.call("POST", &format!("/v1/sandboxes/{id}/copy"), Some(&req))?)
    };
    if no_symlinks && sandbox_side(src).is_none() {
        bail!("--no-symlinks is for copies out of a sandbox (ID:SRC)");
    }
    let total = match (sandbox_side(src), sandbox_side(dst)) {
        (None, Some((id, path))) if src == "-" => {
            // A tar stream on stdin: unpacked into a private staging
            // directory (the tar crate keeps entries inside it), then each
            // top-level entry copied into the sandbox directory `path`.
            let stage = staging()?;
            let r = (|| -> Result<Copied> {
                tar::Archive::new(std::io::stdin().lock()).unpack(&stage).context("unpack the tar from stdin")?;
                let mut sum = Copied::default();
                for e in std::fs::read_dir(&stage)? {
                    let e = e?;
                    let req = CopyRequest {
                        direction: Direction::In,
                        path: path.to_string(),
                        host_path: e.path().to_string_lossy().into_owned(),
                        no_symlinks: false,
                    };
                    let one = call(id, req)?;
                    (sum.files, sum.dirs, sum.symlinks, sum.bytes) = (
                        sum.files + one.files,
                        sum.dirs + one.dirs,
                        sum.symlinks + one.symlinks,
                        sum.bytes + one.bytes,
                    );
                }
                Ok(sum)
            })();
            let _ = std::fs::remove_dir_all(&stage);
            r?
        }
        (None, Some((id, path))) => {
            let host_path = absolute(src)?;
            call(id, CopyRequest { direction: Direction::In, path: path.to_string(), host_path, no_symlinks: false })?
        }
        (Some((id, path)), None) if dst == "-" => {
            let stage = staging()?;
            let r = (|| -> Result<Copied> {
                let name = std::path::Path::new(path).file_name().context("the sandbox path names no file")?.to_owned();
                let host = stage.join(&name);
                let req = CopyRequest {
                    direction: Direction::Out,
                    path: path.to_string(),
                    host_path: host.to_string_lossy().into_owned(),
                    no_symlinks,
                };
                let copied = call(id, req)?;
                let mut b = tar::Builder::new(std::io::stdout().lock());
                b.follow_symlinks(false);
                if host.is_dir() {
                    b.append_dir_all(&name, &host)?;
                } else {
                    b.append_path_with_name(&host, &name)?;
                }
                b.finish()?;
                Ok(copied)
            })();
            let _ = std::fs::remove_dir_all(&stage);
            r?
        }
        (Some((id, path)), None) => {
            let host_path = absolute(dst)?;
            call(id, CopyRequest { direction: Direction::Out, path: path.to_string(), host_path, no_symlinks })?
        }
        _ => bail!("exactly one of SRC and DST must be ID:PATH (a sandbox id, 16 hex digits)"),
    };
    eprintln!("copied {} files, {} dirs, {} symlinks, {} bytes", total.files, total.dirs, total.symlinks, total.bytes);
    if total.skipped_symlinks > 0 {
        eprintln!("left out {} symlinks (--no-symlinks)", total.skipped_symlinks);
    }
    Ok(0)
}

/// Puts the local terminal in raw mode and restores it on drop.
struct RawTerminal(Option<nix::sys::termios::Termios>);

impl RawTerminal {
    fn enable() -> RawTerminal {
        use nix::sys::termios::{cfmakeraw, tcgetattr, tcsetattr, SetArg};
        let stdin = std::io::stdin();
        let Ok(orig) = tcgetattr(stdin.as_fd()) else { return RawTerminal(None) };
        let mut raw = orig.clone();
        cfmakeraw(&mut raw);
        let _ = tcsetattr(stdin.as_fd(), SetArg::TCSANOW, &raw);
        RawTerminal(Some(orig))
    }
}

impl Drop for RawTerminal {
    fn drop(&mut self) {
        if let Some(orig) = &self.0 {
            let _ = nix::sys::termios::tcsetattr(std::io::stdin().as_fd(), nix::sys::termios::SetArg::TCSANOW, orig);
        }
    }
}

fn window_size() -> (u16, u16) {
    strata_shim::sys::window_size(std::io::stdout().as_fd()).unwrap_or((24, 80))
}

fn run_exec(cli: &Cli, a: &ExecArgs) -> Result<i32> {
    let tty = a.tty && std::io::stdin().is_terminal();
    let (rows, cols) = if tty { window_size() } else { (24, 80) };
    let body = ExecRequestBody {
        argv: a.cmd.clone(),
        env: a.env.clone(),
        cwd: a.cwd.clone(),
        user: a.user.clone(),
        timeout: a.timeout,
        stdin: None,
        tty: a.tty,
        rows: Some(rows),
        cols: Some(cols),
    };
    let att = match client(cli)?.attach(&format!("/v1/sandboxes/{}/exec", a.id), &body) {
        Ok(a) => a,
        Err(e @ ClientError::Api { .. }) => {
            eprintln!("strata: {e}");
            return Ok(if e.status() == Some(404) { 125 } else { 126 });
        }
        Err(e) => return Err(e.into()),
    };
    let _raw = if tty { Some(RawTerminal::enable()) } else { None };
    let mut input = att.writer;
    if a.interactive {
        std::thread::spawn(move || {
            let mut buf = [0u8; 8192];
            let mut stdin = std::io::stdin();
            loop {
                match stdin.read(&mut buf) {
                    Ok(0) | Err(_) => {
                        let _ = stream::write_frame(&mut input, FrameKind::Stdin, &[]);
                        return;
                    }
                    Ok(n) => {
                        if stream::write_frame(&mut input, FrameKind::Stdin, &buf[..n]).is_err() {
                            return;
                        }
                    }
                }
            }
        });
    } else {
        // The command may already have finished and the daemon closed the
        // connection: a failed write here is not an error, the exit frame is.
        let _ = stream::write_frame(&mut input, FrameKind::Stdin, &[]);
    }
    let mut reader = att.reader;
    let (mut out, mut err) = (std::io::stdout(), std::io::stderr());
    loop {
        match stream::read_frame(&mut reader)? {
            Some((FrameKind::Stdout, d)) => {
                out.write_all(&d)?;
                out.flush()?;
            }
            Some((FrameKind::Stderr, d)) => {
                err.write_all(&d)?;
                err.flush()?;
            }
            Some((FrameKind::Exit, d)) if d.len() == 4 => return Ok(i32::from_be_bytes([d[0], d[1], d[2], d[3]])),
            Some((FrameKind::Error, d)) => bail!("{}", String::from_utf8_lossy(&d)),
            Some(_) => {}
            None => bail!("connection to the daemon closed before the command's exit status arrived"),
        }
    }
}

fn print_lineage(info: &crate::types::LineageInfo) {
    let l = &info.lineage;
    println!("work context {} ({}), image {}", l.id, l.state, l.image);
    println!(
        "began from   {}",
        l.start.as_deref().map_or("the image".to_string(), |s| format!("{} {s}", l.start_kind))
    );
    println!("head         {}", l.head.as_deref().unwrap_or("-"));
    println!("held by      {}", l.holder.as_ref().map_or("-".to_string(), ToString::to_string));
    println!("{:<5} {:<18} {:<11} {:<18} {:<18} SANDBOX", "SEQ", "CHECKPOINT", "STATE", "PREDECESSOR", "PARENT");
    for c in &info.checkpoints {
        println!(
            "{:<5} {:<18} {:<11} {:<18} {:<18} {}",
            c.sequence.map_or("-".to_string(), |n| n.to_string()),
            c.id,
            c.state,
            c.predecessor.as_deref().unwrap_or("-"),
            c.parent.as_deref().unwrap_or("-"),
            c.source_sandbox
        );
    }
    println!("{:<18} {:<9} {:<18} OBSERVED_HEAD", "RESTORED SANDBOX", "RUNG", "FROM");
    for r in &info.restores {
        println!(
            "{:<18} {:<9} {:<18} {}",
            r.sandbox_id,
            r.rung,
            r.snapshot_id.as_deref().unwrap_or("image"),
            r.observed_head.as_deref().unwrap_or("-")
        );
        for why in &r.fell {
            println!("  passed {why}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_in_human_output_cannot_forge_lines() {
        assert_eq!(shown_name("/etc/passwd"), "/etc/passwd");
        assert_eq!(shown_name("/tmp/x\nD /etc/shadow"), "/tmp/x\\nD /etc/shadow");
        assert_eq!(shown_name("a\\b\tc\r\u{1b}[2J\u{7f}"), "a\\\\b\\tc\\r\\x1b[2J\\x7f");
        assert_eq!(shown_name("caf\u{e9}"), "caf\u{e9}");
        assert!(!shown_name("x\ny\u{85}z").contains(['\n', '\u{85}']));
    }

    #[test]
    fn cli_parses() {
        Cli::command_debug();
    }

    impl Cli {
        fn command_debug() {
            use clap::CommandFactory;
            Cli::command().debug_assert();
        }
    }
}
