//! `containerd-shim-strata-v2`: containerd's runtime `io.containerd.strata.v2`.
//!
//! containerd starts one of these per task (`start`), talks to it over
//! ttrpc (the Task service), and runs it with `delete` to clean up after a
//! shim that died. Each task is a Strata sandbox made through the local
//! daemon's API: the shim holds no sandbox state of its own beyond which
//! sandbox and processes are its task's (`service.rs`). The OCI bundle's
//! spec maps onto a create request in `spec.rs`.

mod service;
mod spec;

fn main() {
    containerd_shim::run::<service::Service>(service::RUNTIME, None)
}
