//! Strata: a sandbox executor for agent platforms. This crate is the daemon
//! (`strata daemon`) and its CLI client; `strata-shim` is the sandbox's PID 1.
//!
//! Modules: `api` (HTTP on the Unix socket), `daemon` (operations and the
//! execution pool), `sandbox` (create/exec/destroy of live sandboxes),
//! `image` + `oci` (import and safe layer unpacking), `store` (on-disk
//! layout), `db` (SQLite metadata), `cgroups` (limits), `net` (veths, nft, the sandboxes' resolver), `shim_client`
//! (daemon ⇄ shim), `stream` (attached exec frames), `client` (API client).

#![forbid(unsafe_code)]

pub mod api;
pub mod cgroups;
pub mod cli;
pub mod client;
pub mod copy;
pub mod daemon;
pub mod db;
pub mod diff;
pub mod direct;
pub mod disk;
pub mod e2b;
pub mod error;
pub mod export;
pub mod extents;
pub mod failpoint;
pub mod gitcheck;
pub mod ids;
pub mod image;
pub mod model;
pub mod net;
pub mod oci;
pub mod patch;
pub mod registry;
pub mod sandbox;
pub mod server;
pub mod shim_client;
pub mod spec;
pub mod stamps;
pub mod store;
pub mod stream;
pub mod tree;
pub mod types;
pub mod units;
pub mod userns;
pub mod worker;
