//! `strata create`, `exec`, `ps`, `inspect`, `stats`, `logs`, `cp`,
//! `pause`, `unpause`, `timeout`, `update`, `port`, `network`, `rm`: the
//! sandbox verbs.

use anyhow::Result;
use clap::Subcommand;

use super::{client, print_output, whole_seconds, Cli, CreateArgs, NO_BODY};
use crate::types::{CreateRequest, SandboxInfo};

#[derive(Subcommand, Debug)]
pub enum SandboxCmd {
    /// Create a sandbox and print its id.
    Create(Box<CreateArgs>),
    /// Run a command in a sandbox; exits with the command's exit code.
    Exec(super::exec::ExecArgs),
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
    /// The exec log of a sandbox, or the one sealed with a snapshot.
    Logs {
        id: String,
        /// Print each command's output as kept (stdout, then stderr).
        #[arg(long)]
        output: bool,
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
    /// Freeze every process of a sandbox in place (nothing is written).
    Pause { id: String },
    /// Thaw a paused sandbox.
    Unpause { id: String },
    /// Give a sandbox a new deadline, this long from now (30s, 15m, 2h).
    Timeout {
        id: String,
        #[arg(value_parser = crate::units::parse_duration)]
        timeout: std::time::Duration,
        /// remove or suspend (default: as before).
        #[arg(long)]
        on_timeout: Option<crate::model::OnTimeout>,
    },
    /// Change a running sandbox's limits in place (left out: unchanged;
    /// `default`: the daemon's default again); prints them.
    Update {
        id: String,
        /// Memory limit in bytes (suffixes k, m, g) or `default`.
        #[arg(long)]
        memory: Option<String>,
        /// Maximum number of processes, or `default`.
        #[arg(long)]
        pids: Option<String>,
        /// CPU bandwidth in CPUs (e.g. 0.5), or `default` (none).
        #[arg(long)]
        cpus: Option<String>,
    },
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

/// The sandbox verbs: make, run in, watch, copy to and from, end.
pub(super) fn run(cli: &Cli, cmd: &SandboxCmd) -> Result<i32> {
    match cmd {
        SandboxCmd::Create(a) => {
            let l = a.launch.request(None);
            let req = CreateRequest {
                image: a.image.clone().unwrap_or_default(),
                rootfs: a.rootfs.clone(),
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
                netns: l.netns,
            };
            let info: SandboxInfo = client(cli)?.call("POST", "/v1/sandboxes", Some(&req))?;
            println!("{}", info.id);
            Ok(0)
        }
        SandboxCmd::Exec(a) => super::exec::run_exec(cli, a),
        SandboxCmd::Ps => {
            let list: Vec<SandboxInfo> = client(cli)?.call("GET", "/v1/sandboxes", NO_BODY)?;
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
        SandboxCmd::Inspect { id } => {
            let info: SandboxInfo = client(cli)?.call("GET", &format!("/v1/sandboxes/{id}"), NO_BODY)?;
            println!("{}", serde_json::to_string_pretty(&info)?);
            Ok(0)
        }
        SandboxCmd::Stats { ids, json } => stats(cli, ids, *json),
        SandboxCmd::Logs { id, output } => {
            let recs: Vec<crate::catalog::ExecRecord> =
                client(cli)?.call("GET", &format!("/v1/sandboxes/{id}/logs?output={output}"), NO_BODY)?;
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
        SandboxCmd::Cp { src, dst, no_symlinks } => super::cp::run_cp(cli, src, dst, *no_symlinks),
        SandboxCmd::Pause { id } => {
            client(cli)?.request("POST", &format!("/v1/sandboxes/{id}/pause"), NO_BODY)?;
            Ok(0)
        }
        SandboxCmd::Unpause { id } => {
            client(cli)?.request("POST", &format!("/v1/sandboxes/{id}/unpause"), NO_BODY)?;
            Ok(0)
        }
        SandboxCmd::Timeout { id, timeout, on_timeout } => {
            let body = crate::types::TimeoutRequest { timeout: whole_seconds(*timeout), on_timeout: *on_timeout };
            let info: SandboxInfo = client(cli)?.call("POST", &format!("/v1/sandboxes/{id}/timeout"), Some(&body))?;
            println!("{}", info.lifetime.deadline_ms.unwrap_or(0));
            Ok(0)
        }
        SandboxCmd::Update { id, memory, pids, cpus } => {
            let body = crate::types::LimitsRequest {
                memory: setting(memory.as_deref(), crate::units::parse_bytes)?,
                pids: setting(pids.as_deref(), |v| v.parse::<u64>().map_err(|e| e.to_string()))?,
                cpus: setting(cpus.as_deref(), |v| v.parse::<f64>().map_err(|e| e.to_string()))?,
                disk: None,
            };
            let info: SandboxInfo = client(cli)?.call("PUT", &format!("/v1/sandboxes/{id}/limits"), Some(&body))?;
            println!("{}", serde_json::to_string(&info.limits)?);
            Ok(0)
        }
        SandboxCmd::Port { id, port, listen } => super::exec::run_port(cli, id, *port, *listen),
        SandboxCmd::Network { id, allow_out, deny_out } => {
            let body =
                crate::types::NetworkRequest { mode: None, allow_out: allow_out.clone(), deny_out: deny_out.clone() };
            let info: SandboxInfo = client(cli)?.call("PUT", &format!("/v1/sandboxes/{id}/network"), Some(&body))?;
            println!("{}", serde_json::to_string(&info.network.policy)?);
            Ok(0)
        }
        SandboxCmd::Rm { ids, no_wait } => {
            let mut c = client(cli)?;
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

/// An `update` flag: left out, `default`, or a value.
fn setting<T>(v: Option<&str>, parse: impl Fn(&str) -> Result<T, String>) -> Result<Option<Option<T>>> {
    match v {
        None => Ok(None),
        Some("default") => Ok(Some(None)),
        Some(v) => parse(v).map(|x| Some(Some(x))).map_err(|e| anyhow::anyhow!("{v:?}: {e}")),
    }
}
