//! `strata image`: import, pull, list, remove.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Subcommand;

use super::{client, split_tag, Cli, RegistryArgs, NO_BODY};
use crate::types::{ImageInfo, ImportRequest};

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

/// `strata image`: import, pull, list, remove.
pub(super) fn run(cli: &Cli, cmd: &ImageCmd) -> Result<i32> {
    match cmd {
        ImageCmd::Import { path, name } => {
            let (path, tag) = split_tag(path);
            let path = std::fs::canonicalize(&path).with_context(|| format!("resolve {}", path.display()))?;
            let req = ImportRequest { path: path.to_string_lossy().into_owned(), name: name.clone(), tag };
            let info: ImageInfo = client(cli)?.call("POST", "/v1/images/import", Some(&req))?;
            println!("{}", info.name);
            Ok(0)
        }
        ImageCmd::Pull { reference, name, registry } => {
            let req = registry.request(reference, name.clone())?;
            let r: crate::types::PullResult =
                client(cli)?.call_streamed("/v1/images/pull", &req, &mut registry.printer())?;
            eprintln!(
                "fetched {} blobs, {} bytes; {} layers reused",
                r.fetched_blobs, r.fetched_bytes, r.reused_layers
            );
            println!("{}", r.image.name);
            Ok(0)
        }
        ImageCmd::Ls => {
            let images: Vec<ImageInfo> = client(cli)?.call("GET", "/v1/images", NO_BODY)?;
            println!("{:<32} {:<20} LAYERS", "NAME", "MANIFEST");
            for i in images {
                let short = i.manifest_digest.trim_start_matches("sha256:").chars().take(12).collect::<String>();
                println!("{:<32} {:<20} {}", i.name, short, i.layers.len());
            }
            Ok(0)
        }
        ImageCmd::Rm { name } => {
            client(cli)?.request("DELETE", &format!("/v1/images/{name}"), NO_BODY)?;
            Ok(0)
        }
    }
}
