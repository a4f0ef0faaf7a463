//! `strata lineage` and `strata baseline`: lineages and the baselines new
//! work starts from.

use anyhow::Result;
use clap::Subcommand;

use super::{client, Cli, NO_BODY};
use crate::types::SnapshotInfo;

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

/// `strata lineage`: list, show, retire, close.
pub(super) fn run(cli: &Cli, cmd: &LineageCmd) -> Result<i32> {
    match cmd {
        LineageCmd::Ls { active } => {
            let list: Vec<crate::types::LineageSummary> = client(cli)?.call("GET", "/v1/lineages", NO_BODY)?;
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
        LineageCmd::Show { id } => {
            let l: crate::types::LineageInfo = client(cli)?.call("GET", &format!("/v1/lineages/{id}"), NO_BODY)?;
            print_lineage(&l);
            Ok(0)
        }
        LineageCmd::Retire { id } => {
            let l: crate::types::LineageInfo =
                client(cli)?.call("POST", &format!("/v1/lineages/{id}/retire"), NO_BODY)?;
            print_lineage(&l);
            Ok(0)
        }
        LineageCmd::Close { id, outcome } => {
            let body = crate::types::CloseLineageRequest { outcome: *outcome };
            let l: crate::types::LineageInfo =
                client(cli)?.call("POST", &format!("/v1/lineages/{id}/close"), Some(&body))?;
            print_lineage(&l);
            Ok(0)
        }
    }
}

/// `strata baseline`: publish a clean repository as a baseline.
pub(super) fn baseline(cli: &Cli, cmd: &BaselineCmd) -> Result<i32> {
    match cmd {
        BaselineCmd::Publish { id, repo, git_ref, owner, remote, commit } => {
            let req = crate::daemon::publish::PublishRequest {
                repo: repo.clone(),
                git_ref: git_ref.clone(),
                owner: owner.clone(),
                remote: remote.clone(),
                commit: commit.clone(),
            };
            let s: SnapshotInfo = client(cli)?.call("POST", &format!("/v1/sandboxes/{id}/baseline"), Some(&req))?;
            println!("{}", s.id);
            Ok(0)
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
