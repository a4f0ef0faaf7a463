//! `strata checkpoint`, `suspend`, `resume`, `fork`, `rollback`, `evaluate`,
//! `diff`, and `strata snapshot ...`: capturing and starting from snapshots.

use std::path::PathBuf;

use anyhow::Result;
use clap::Subcommand;

use super::{client, compression_arg, query_encode, shown_name, Cli, LaunchArgs, RegistryArgs, NO_BODY};
use crate::types::{CheckpointRequest, SandboxInfo, SnapshotInfo};

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

#[derive(Subcommand, Debug)]
pub enum CaptureCmd {
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
}

/// The snapshot verbs at the top level: capture, start from, roll back to, evaluate, compare.
pub(super) fn run(cli: &Cli, cmd: &CaptureCmd) -> Result<i32> {
    match cmd {
        CaptureCmd::Checkpoint { id, compression, whole, kind, background } => {
            let compression = compression_arg(compression.as_deref());
            let snap: SnapshotInfo = client(cli)?.call(
                "POST",
                &format!("/v1/sandboxes/{id}/checkpoint"),
                Some(&CheckpointRequest { compression, whole: *whole, kind: *kind, background: *background }),
            )?;
            println!("{}", snap.id);
            Ok(0)
        }
        CaptureCmd::Suspend { id } => {
            let snap: SnapshotInfo = client(cli)?.call("POST", &format!("/v1/sandboxes/{id}/suspend"), NO_BODY)?;
            println!("{}", snap.id);
            Ok(0)
        }
        CaptureCmd::Resume { snapshot, work_context, launch } => {
            let path = match (snapshot, work_context) {
                (Some(s), _) => format!("/v1/snapshots/{s}/resume"),
                (None, Some(wc)) => format!("/v1/lineages/{wc}/resume"),
                (None, None) => unreachable!("clap requires one"),
            };
            let info: SandboxInfo = client(cli)?.call("POST", &path, Some(&launch.request(None)))?;
            if let Some(r) = &info.restored {
                eprintln!("resumed from {} ({})", r.snapshot.as_deref().unwrap_or("the image"), r.rung);
            }
            println!("{}", info.id);
            Ok(0)
        }
        CaptureCmd::Fork { snapshot, count, launch } => {
            let list: Vec<SandboxInfo> = client(cli)?.call(
                "POST",
                &format!("/v1/snapshots/{snapshot}/fork"),
                Some(&launch.request(Some(*count))),
            )?;
            for s in list {
                println!("{}", s.id);
            }
            Ok(0)
        }
        CaptureCmd::Rollback { id, to } => {
            let req = crate::types::RollbackRequest { to: to.clone() };
            let info: SandboxInfo = client(cli)?.call("POST", &format!("/v1/sandboxes/{id}/rollback"), Some(&req))?;
            println!("{}", info.id);
            Ok(0)
        }
        CaptureCmd::Evaluate { snapshot, name, version, timeout, again, env, argv } => {
            let req = crate::types::EvaluateRequest {
                name: name.clone(),
                version: version.clone(),
                argv: argv.clone(),
                env: env.clone(),
                timeout: timeout.map(|t| t.as_secs().max(1)),
                again: *again,
            };
            let e: crate::catalog::Evaluation =
                client(cli)?.call("POST", &format!("/v1/snapshots/{snapshot}/evaluate"), Some(&req))?;
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
        CaptureCmd::Diff { id, patch: true, against } => {
            let q = against.as_ref().map(|a| format!("&against={}", query_encode(a))).unwrap_or_default();
            let p: crate::store::patch::Patch =
                client(cli)?.call("GET", &format!("/v1/snapshots/{id}/diff?patch=true{q}"), NO_BODY)?;
            print!("{}", p.patch);
            if p.truncated {
                eprintln!("patch cut at {} bytes; later files are not shown", crate::store::patch::MAX_PATCH);
            }
            Ok(0)
        }
        CaptureCmd::Diff { id, .. } => {
            let mut c = client(cli)?;
            let changes: Vec<crate::store::layers::Change> =
                match c.call("GET", &format!("/v1/sandboxes/{id}/diff"), NO_BODY) {
                    Err(e) if e.status() == Some(404) => c.call("GET", &format!("/v1/snapshots/{id}/diff"), NO_BODY)?,
                    r => r?,
                };
            for ch in changes {
                println!("{} {}", ch.kind, shown_name(&ch.path));
            }
            Ok(0)
        }
    }
}

/// `strata snapshot`: list, label, retain, inspect, promote, push, pull, export, remove.
pub(super) fn snapshot(cli: &Cli, cmd: &SnapshotCmd) -> Result<i32> {
    match cmd {
        SnapshotCmd::Ls { label } => {
            let q: Vec<String> = label.iter().map(|l| format!("label={}", query_encode(l))).collect();
            let list: Vec<SnapshotInfo> =
                client(cli)?.call("GET", &format!("/v1/snapshots?{}", q.join("&")), NO_BODY)?;
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
                    s.info.shown.get("frozen_ms").and_then(serde_json::Value::as_f64).unwrap_or(0.0),
                    if s.retained { "(retained) " } else { "" },
                    labels.join(",")
                );
            }
            Ok(0)
        }
        SnapshotCmd::Label { id, labels } => {
            let mut req = crate::types::LabelRequest::default();
            for l in labels {
                match (l.split_once('='), l.strip_suffix('-')) {
                    (Some((k, v)), _) => req.labels.insert(k.to_string(), Some(v.to_string())),
                    (None, Some(k)) => req.labels.insert(k.to_string(), None),
                    (None, None) => anyhow::bail!("{l:?}: give KEY=VALUE to set a label or KEY- to remove it"),
                };
            }
            let s: SnapshotInfo = client(cli)?.call("POST", &format!("/v1/snapshots/{id}/labels"), Some(&req))?;
            for (k, v) in s.labels {
                println!("{k}={v}");
            }
            Ok(0)
        }
        SnapshotCmd::Retain { id } | SnapshotCmd::Release { id } => {
            let op = if matches!(cmd, SnapshotCmd::Retain { .. }) { "retain" } else { "release" };
            let _: SnapshotInfo = client(cli)?.call("POST", &format!("/v1/snapshots/{id}/{op}"), NO_BODY)?;
            Ok(0)
        }
        SnapshotCmd::Evaluations { id } => {
            let v: serde_json::Value = client(cli)?.call("GET", &format!("/v1/snapshots/{id}/evaluations"), NO_BODY)?;
            println!("{}", serde_json::to_string_pretty(&v)?);
            Ok(0)
        }
        SnapshotCmd::Result { id } => {
            let v: serde_json::Value = client(cli)?.call("GET", &format!("/v1/snapshots/{id}/result"), NO_BODY)?;
            println!("{}", serde_json::to_string_pretty(&v)?);
            Ok(0)
        }
        SnapshotCmd::Inspect { id } => {
            let s: SnapshotInfo = client(cli)?.call("GET", &format!("/v1/snapshots/{id}"), NO_BODY)?;
            println!("{}", serde_json::to_string_pretty(&s)?);
            Ok(0)
        }
        SnapshotCmd::Promote { id } => {
            let snap: SnapshotInfo = client(cli)?.call("POST", &format!("/v1/snapshots/{id}/promote"), NO_BODY)?;
            println!("{}", snap.registry.unwrap_or_default());
            Ok(0)
        }
        SnapshotCmd::Push { id, reference, registry } => {
            let req = registry.request(reference, None)?;
            let r: crate::types::PushResult =
                client(cli)?.call_streamed(&format!("/v1/snapshots/{id}/push"), &req, &mut registry.printer())?;
            eprintln!(
                "uploaded {} blobs ({} bytes); {} present, {} mounted",
                r.uploaded_blobs, r.uploaded_bytes, r.present_blobs, r.mounted_blobs
            );
            println!("{}@{}", r.reference, r.manifest_digest);
            Ok(0)
        }
        SnapshotCmd::Pull { reference, registry } => {
            let req = registry.request(reference, None)?;
            let r: crate::types::PullResult =
                client(cli)?.call_streamed("/v1/snapshots/pull", &req, &mut registry.printer())?;
            eprintln!(
                "fetched {} blobs, {} bytes; {} layers reused",
                r.fetched_blobs, r.fetched_bytes, r.reused_layers
            );
            println!("{}", r.snapshot.map(|s| s.id.to_string()).unwrap_or_default());
            Ok(0)
        }
        SnapshotCmd::Export { id, dir, compression } => {
            let dir = if dir.is_absolute() { dir.clone() } else { std::env::current_dir()?.join(dir) };
            let req = crate::types::ExportRequest {
                path: dir.to_string_lossy().into_owned(),
                compression: compression_arg(compression.as_deref()),
            };
            let out: crate::export::Exported =
                client(cli)?.call("POST", &format!("/v1/snapshots/{id}/export"), Some(&req))?;
            println!("{} {}", out.path, out.manifest_digest);
            Ok(0)
        }
        SnapshotCmd::Rm { id } => {
            client(cli)?.request("DELETE", &format!("/v1/snapshots/{id}"), NO_BODY)?;
            Ok(0)
        }
    }
}
