//! `strata-shim`: PID 1 of one sandbox.
//!
//! The daemon starts it with `clone3` in fresh mount, PID, UTS, IPC and
//! network namespaces, inside the sandbox's cgroup, with a listening
//! `SOCK_SEQPACKET` socket at fd 3. The shim accepts the daemon's connection,
//! reads a [`SetupSpec`](strata_shim::proto::SetupSpec), builds the sandbox
//! (see `setup.rs`), answers `Ready`, then supervises commands until it is
//! killed (see `supervise.rs`). Exit codes are [`ShimExit`].

#![forbid(unsafe_code)]

mod seccomp;
mod setup;
mod supervise;

use std::process::ExitCode;

use strata_shim::proto::{self, ShimEvent, ShimRequest};

/// Why the shim exited (its exit code), so the daemon's log says which step failed.
#[derive(Debug, Clone, Copy)]
#[repr(u8)]
enum ShimExit {
    /// Not started by the daemon (no listener at fd 3).
    NoListener = 2,
    /// The daemon's first message never arrived or was not `Setup`.
    Handshake = 3,
    /// Sandbox setup failed; the error chain was sent to the daemon.
    Setup = 4,
    /// The supervision loop hit an unrecoverable error.
    Supervise = 5,
}

impl From<ShimExit> for ExitCode {
    fn from(e: ShimExit) -> Self {
        ExitCode::from(e as u8)
    }
}

fn chain(e: &dyn std::error::Error) -> Vec<String> {
    let mut out = vec![e.to_string()];
    let mut cur = e.source();
    while let Some(s) = cur {
        out.push(s.to_string());
        cur = s.source();
    }
    out
}

fn main() -> ExitCode {
    // Not dumpable: the sandbox's processes (uid 0 too, but without
    // CAP_SYS_PTRACE) cannot ptrace the shim or open its /proc files (fds,
    // memory, environ); children are dumpable again once they exec.
    if let Err(e) = nix::sys::prctl::set_dumpable(false) {
        eprintln!("strata-shim: PR_SET_DUMPABLE: {e}");
    }
    let listener = match strata_shim::sys::inherited_listener() {
        Ok(l) => l,
        Err(e) => {
            eprintln!("strata-shim: no listening socket at fd 3 ({e}); it is started by `strata daemon`");
            return ShimExit::NoListener.into();
        }
    };
    // The network namespace is ours from the start: `lo` goes up now, so a
    // warm shim (started ahead of any create) has it done before it is used.
    let loopback = strata_shim::sys::loopback_up();
    // Given the sandbox's root mount point (not with a user namespace), its
    // /proc, /dev and /sys are made now too (see setup::stage).
    // One that fails exits here: a warm shim that cannot be set up must not
    // be handed to a create (the daemon sees it dead and discards it).
    let staged = match std::env::args_os().nth(2).map(|at| setup::stage(std::path::Path::new(&at))) {
        Some(Err(e)) => {
            eprintln!("strata-shim: stage /proc, /dev and /sys: {}", chain(&e).join(": "));
            return ShimExit::Setup.into();
        }
        Some(Ok(staged)) => Some(staged),
        None => None,
    };
    let conn = match supervise::accept(&listener) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("strata-shim: accept daemon connection: {e}");
            return ShimExit::Handshake.into();
        }
    };
    let (spec, rootfs) = match proto::recv::<ShimRequest>(&conn) {
        Ok((ShimRequest::Setup(spec), fds)) => (spec, fds.into_iter().next()),
        Ok((other, _)) => {
            eprintln!("strata-shim: expected Setup, got {other:?}");
            return ShimExit::Handshake.into();
        }
        Err(e) => {
            eprintln!("strata-shim: read setup: {e}");
            return ShimExit::Handshake.into();
        }
    };
    // A warm shim was started by the daemon's low-priority pool thread and
    // inherited its nice value; a sandbox in use runs at normal priority.
    let _ = strata_shim::sys::set_thread_nice(0);
    // From here on the sandbox outlives its daemon (see sys::spawn_in_namespaces).
    if let Err(e) = strata_shim::sys::clear_parent_death_signal() {
        eprintln!("strata-shim: clear parent death signal: {e}");
    }
    if let Err(e) = setup::run(&spec, rootfs, loopback, staged) {
        let chain = chain(&e);
        eprintln!("strata-shim: setup failed: {}", chain.join(": "));
        let _ = proto::send(&conn, &ShimEvent::SetupFailed { chain }, &[]);
        return ShimExit::Setup.into();
    }
    if let Err(e) = proto::send(&conn, &ShimEvent::ReadyWith { features: proto::features() }, &[]) {
        eprintln!("strata-shim: report ready: {e}");
    }
    match supervise::run(listener, conn) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("strata-shim: {}", chain(&e).join(": "));
            ShimExit::Supervise.into()
        }
    }
}
