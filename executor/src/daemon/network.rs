//! The network verbs on a live sandbox: its policy changed in place
//! (`PUT /v1/sandboxes/{id}/network`), and a TCP stream to one of its
//! ports (`GET /v1/sandboxes/{id}/ports/{port}`, `strata port`).

use std::time::Duration;

use crate::daemon::{lock, sandbox_info, Daemon};
use crate::error::{Classify, ErrorKind};
use crate::ids::SandboxId;
use crate::types::{NetworkRequest, SandboxInfo};

/// How long a connection to a sandbox's port may take to open.
pub const PORT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Why a network verb failed.
#[derive(Debug, thiserror::Error, displaydoc::Display)]
pub enum NetworkOpError {
    /// {0}
    Sandbox(#[from] crate::daemon::SandboxOpError),
    /// {0}
    Policy(#[from] crate::net::PolicyError),
    /// sandbox {0} has no network (it was started with network none); its policy cannot be set
    NoNetwork(SandboxId),
    /// a sandbox's network mode is fixed when it starts (resume or fork it with another)
    Mode,
    /// sandbox {0} is going away
    Gone(SandboxId),
    /// apply the policy: {0}
    Apply(#[from] crate::net::NetError),
    /// nothing listens on port {port} of sandbox {id}
    Connect {
        id: SandboxId,
        port: u16,
        #[source]
        source: std::io::Error,
    },
    /// port {0}: use 1-65535
    Port(u16),
    /// {0}
    Db(#[from] crate::catalog::DbError),
}

impl Classify for NetworkOpError {
    fn kind(&self) -> ErrorKind {
        match self {
            NetworkOpError::Sandbox(e) => e.kind(),
            NetworkOpError::Policy(_) | NetworkOpError::Mode | NetworkOpError::Port(_) => ErrorKind::InvalidArgument,
            NetworkOpError::NoNetwork(_) | NetworkOpError::Gone(_) => ErrorKind::Conflict,
            NetworkOpError::Connect { .. } => ErrorKind::Conflict,
            NetworkOpError::Apply(e) => e.kind(),
            NetworkOpError::Db(e) => e.kind(),
        }
    }
}

impl Daemon {
    /// Whether sandboxes may have a network here (`--network on`).
    pub fn networked(&self) -> bool {
        self.net.is_some()
    }

    /// Replace a live sandbox's egress policy: new connections follow it at
    /// once, open ones keep going; kept in its spec (restarts, suspends,
    /// forks).
    pub fn set_network(&self, id: &str, req: NetworkRequest) -> Result<SandboxInfo, NetworkOpError> {
        let sb = self.sandbox(id)?;
        if req.mode.is_some_and(|m| m != sb.spec.network.mode) {
            return Err(NetworkOpError::Mode);
        }
        let policy = crate::net::Policy::parse(&req.allow_out, &req.deny_out)?;
        let Some(net) = sb.network() else { return Err(NetworkOpError::NoNetwork(sb.id.clone())) };
        let old = net.policy();
        net.set_policy(&policy)?;
        let spec = sb.network_spec();
        match lock(&self.db).set_sandbox_network(&sb.id, &spec) {
            Ok(true) => {}
            Ok(false) => return Err(NetworkOpError::Gone(sb.id.clone())),
            Err(e) => {
                let _ = net.set_policy(&old);
                return Err(e.into());
            }
        }
        tracing::info!(
            "sandbox {}: network policy now allow_out {:?} deny_out {:?}",
            sb.id,
            policy.allow_out.iter().map(|t| t.to_string()).collect::<Vec<_>>(),
            policy.deny_out.iter().map(|c| c.to_string()).collect::<Vec<_>>()
        );
        Ok(sandbox_info(&sb))
    }

    /// A TCP connection to `127.0.0.1:port` inside a sandbox, whatever its
    /// network mode.
    pub fn connect_port(&self, id: &str, port: u16) -> Result<std::net::TcpStream, NetworkOpError> {
        if port == 0 {
            return Err(NetworkOpError::Port(port));
        }
        let sb = self.sandbox(id)?;
        if sb.gone().is_set() {
            return Err(NetworkOpError::Gone(sb.id.clone()));
        }
        sb.connect_port(port, PORT_CONNECT_TIMEOUT).map_err(|source| NetworkOpError::Connect {
            id: sb.id.clone(),
            port,
            source,
        })
    }
}
