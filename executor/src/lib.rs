//! Strata: a sandbox executor for agent platforms. This crate is the daemon
//! (`strata daemon`) and its CLI client; `strata-shim` is the sandbox's PID 1.
//!
//! Modules, top down (imports go one way; `tests/imports.rs` checks it):
//! `cli` (the command line; `cli/daemon.rs` starts the daemon) and
//! `client` (the API client); `api` (HTTP on the Unix socket) and `e2b`
//! (the E2B-compatible listener); `daemon` (one file per verb over shared
//! steps: lookup, launch, capture); `sandbox` (live sandboxes: create,
//! exec, checkpoint capture, cgroups, user namespaces, the shim client,
//! safe copies), `image` + `oci` (import and safe layer unpacking),
//! `registry`, `worker` (capture workers), `net` (veths, nft, the
//! sandboxes' resolver); `catalog` (the metadata database, one file per
//! table family), `store` (the on-disk layout: layers, leases, tar
//! writing, stamps, extents, disk caps); and at the bottom the shared
//! vocabulary: `types` (API bodies), `records`, `spec`, `model`, `ids`,
//! `units`, `error`, `stream` (attached exec frames).

#![forbid(unsafe_code)]

pub mod api;
pub mod catalog;
pub mod cli;
pub mod client;
pub mod daemon;
pub mod e2b;
pub mod error;
pub mod export;
pub mod failpoint;
pub mod gitcheck;
pub mod ids;
pub mod image;
pub mod model;
pub mod net;
pub mod oci;
pub mod records;
pub mod registry;
pub mod sandbox;
pub mod spec;
pub mod store;
pub mod stream;
pub mod types;
pub mod units;
pub mod worker;
