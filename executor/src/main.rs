//! `strata`: the daemon and its command-line client in one binary.

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let cli = strata::cli::Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_env("STRATA_LOG").unwrap_or_else(|_| {
            // rtnetlink's parser warns of every attribute a newer kernel
            // added; not ours to act on.
            "info,netlink_packet_route=error".into()
        }))
        .with_writer(std::io::stderr)
        .init();
    match strata::cli::run(cli) {
        Ok(code) => ExitCode::from(u8::try_from(code.clamp(0, 255)).unwrap_or(1)),
        Err(e) => {
            eprintln!("strata: {e:#}");
            ExitCode::from(1)
        }
    }
}
