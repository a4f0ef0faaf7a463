//! The `strata` command line: `strata daemon` and the client subcommands,
//! one file per command group (`daemon.rs` starts and stops the daemon).
//! Client subcommands are thin: parse, one or two API calls, print.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};

use crate::client::Client;
use crate::types::LaunchRequest;

mod cp;
mod daemon;
mod exec;
mod host;
mod images;
mod lineage;
mod sandboxes;
mod snapshots;

use daemon::DaemonArgs;
use images::ImageCmd;
use lineage::{BaselineCmd, LineageCmd};
use snapshots::SnapshotCmd;

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
    /// Manage snapshots.
    #[command(subcommand)]
    Snapshot(SnapshotCmd),
    /// Show or retire a lineage (work context).
    #[command(subcommand)]
    Lineage(LineageCmd),
    /// Publish a sandbox's clean repository as a baseline.
    #[command(subcommand)]
    Baseline(BaselineCmd),
    #[command(flatten)]
    Sandbox(sandboxes::SandboxCmd),
    #[command(flatten)]
    Capture(Box<snapshots::CaptureCmd>),
    #[command(flatten)]
    Host(host::HostCmd),
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
    /// The image (with --rootfs: whose config its commands get).
    #[arg(long, required_unless_present = "rootfs")]
    pub image: Option<String>,
    /// Run on this host directory as it is instead of the image's layers
    /// (no checkpoint, suspend, diff or publish of it).
    #[arg(long)]
    pub rootfs: Option<String>,
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
    /// Join this network namespace (e.g. /var/run/netns/NAME, a pod's)
    /// instead of having one of its own; not with --network egress.
    #[arg(long)]
    pub netns: Option<String>,
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
            netns: self.netns.clone(),
        }
    }
}

/// A duration as whole seconds, rounded up (the API takes seconds).
fn whole_seconds(d: std::time::Duration) -> u64 {
    d.as_secs() + u64::from(d.subsec_nanos() > 0)
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
        Command::Daemon(a) => daemon::run(&cli, a),
        Command::Worker => Ok(crate::worker::main()),
        Command::Image(c) => images::run(&cli, c),
        Command::Snapshot(c) => snapshots::snapshot(&cli, c),
        Command::Lineage(c) => lineage::run(&cli, c),
        Command::Baseline(c) => lineage::baseline(&cli, c),
        Command::Sandbox(c) => sandboxes::run(&cli, c),
        Command::Capture(c) => snapshots::run(&cli, c),
        Command::Host(c) => host::run(&cli, c),
    }
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
