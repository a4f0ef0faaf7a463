//! Library side of `strata-shim`: the daemon ⇄ shim protocol ([`proto`]) and the
//! few raw syscalls that need `unsafe` ([`sys`]). The executor links this crate
//! so both processes share one definition of every message and syscall wrapper.
//!
//! The shim binary itself (`main.rs`, `setup.rs`, `supervise.rs`) is synchronous
//! and single-threaded: no tokio, no HTTP.

pub mod proto;
pub mod sys;
