//! `strata gc`, `info`, `df`, `hosts`, `drain`: the host and the fleet.

use anyhow::Result;
use clap::Subcommand;

use super::{client, Cli, NO_BODY};

#[derive(Subcommand, Debug)]
pub enum HostCmd {
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
}

/// The host and the fleet: capacity, store, collection, hosts and drains.
pub(super) fn run(cli: &Cli, cmd: &HostCmd) -> Result<i32> {
    match cmd {
        HostCmd::Gc { retention, stale_after } => {
            let req = crate::types::GcRequest {
                retention_secs: retention.map(|d| d.as_secs()),
                stale_after_secs: stale_after.map(|d| d.as_secs()),
            };
            let r: crate::types::GcReport = client(cli)?.call("POST", "/v1/gc", Some(&req))?;
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
        HostCmd::Info => {
            let info: serde_json::Value = client(cli)?.call("GET", "/v1/info", NO_BODY)?;
            println!("{}", serde_json::to_string_pretty(&info)?);
            Ok(0)
        }
        HostCmd::Df => {
            let u: crate::types::DiskUsage = client(cli)?.call("GET", "/v1/df", NO_BODY)?;
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
        HostCmd::Hosts { json } => {
            let hosts: Vec<crate::types::HostEntry> = client(cli)?.call("GET", "/v1/hosts", NO_BODY)?;
            if *json {
                println!("{}", serde_json::to_string_pretty(&hosts)?);
                return Ok(0);
            }
            let now = crate::catalog::now_ms();
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
        HostCmd::Drain { host, reason, off } => {
            let body = (!*off).then(|| crate::types::DrainRequest { reason: reason.clone() });
            let method = if *off { "DELETE" } else { "POST" };
            let state = match host {
                Some(h) => {
                    if !crate::daemon::host::valid_host_id(h) {
                        anyhow::bail!("host id {h:?} must be 1-64 chars of [A-Za-z0-9._-]");
                    }
                    let path = format!("/v1/hosts/{h}/drain");
                    client(cli)?.call::<crate::types::HostEntry>(method, &path, body.as_ref())?.state
                }
                None => client(cli)?.call::<crate::types::HostInfo>(method, "/v1/drain", body.as_ref())?.state,
            };
            println!("{state}");
            Ok(0)
        }
    }
}
