//! An OCI bundle's spec (containerd's `config.json`) as the daemon's
//! requests: the root and what a create takes from `linux` (the network
//! namespace a pod's CNI made, the cgroup limits, the hostname), and a
//! `process` (the task's, or an exec's) as a process request.

use std::path::{Path, PathBuf};

use oci_spec::runtime::{LinuxNamespaceType, LinuxResources, Process, Spec};
use serde_json::{json, Value};

#[derive(Debug, thiserror::Error)]
pub enum SpecError {
    #[error("the spec has no process")]
    NoProcess,
    #[error("the process has no args")]
    NoArgs,
    #[error("a terminal (ctr run -t, a pod's tty) is not supported by the Strata shim yet: run without one")]
    Terminal,
    #[error("decode the exec's process spec: {0}")]
    Decode(#[from] serde_json::Error),
}

/// The command of a spec's `process`.
#[derive(Debug, Clone, PartialEq)]
pub struct Command {
    pub argv: Vec<String>,
    pub env: Vec<String>,
    pub cwd: String,
    /// `UID:GID` inside the sandbox.
    pub user: String,
}

impl Command {
    pub fn of(p: &Process) -> Result<Command, SpecError> {
        if p.terminal().unwrap_or(false) {
            return Err(SpecError::Terminal);
        }
        let argv = p.args().clone().unwrap_or_default();
        if argv.is_empty() {
            return Err(SpecError::NoArgs);
        }
        Ok(Command {
            argv,
            env: p.env().clone().unwrap_or_default(),
            cwd: p.cwd().display().to_string(),
            user: format!("{}:{}", p.user().uid(), p.user().gid()),
        })
    }

    /// An exec's process (`ExecProcessRequest.spec`: an OCI `Process` as JSON).
    pub fn of_json(json: &[u8]) -> Result<Command, SpecError> {
        Command::of(&serde_json::from_slice::<Process>(json)?)
    }

    /// `POST /v1/sandboxes/{id}/processes` of it with these stdio paths
    /// (containerd's FIFOs; empty: none).
    pub fn request(&self, stdin: &str, stdout: &str, stderr: &str) -> Value {
        json!({
            "argv": self.argv,
            "env": self.env,
            "cwd": self.cwd,
            "user": self.user,
            "stdin": stdin,
            "stdout": stdout,
            "stderr": stderr,
        })
    }
}

/// The task's command: the spec's process.
pub fn task_command(spec: &Spec) -> Result<Command, SpecError> {
    Command::of(spec.process().as_ref().ok_or(SpecError::NoProcess)?)
}

/// Where the spec's root is: `root.path`, relative to the bundle.
pub fn root_path(spec: &Spec, bundle: &Path) -> PathBuf {
    let path = spec.root().as_ref().map_or_else(|| PathBuf::from("rootfs"), |r| r.path().clone());
    if path.is_absolute() {
        path
    } else {
        bundle.join(path)
    }
}

/// A hostname Strata takes (1-63 of `[A-Za-z0-9.-]`, not starting with
/// `-` or `.`); containerd's default, the task id, is often longer.
fn valid_hostname(h: &str) -> bool {
    (1..=63).contains(&h.len())
        && h.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.')
        && !h.starts_with(['-', '.'])
}

/// What a create asks of the daemon for `spec`, with its root at `root`.
pub fn create_request(spec: &Spec, root: &Path, host_cpus: usize) -> Value {
    let mut req = json!({ "rootfs": root });
    if let Some(h) = spec.hostname().as_deref().filter(|h| valid_hostname(h)) {
        req["hostname"] = json!(h);
    }
    let Some(linux) = spec.linux() else { return req };
    let netns = linux.namespaces().iter().flatten().find(|n| n.typ() == LinuxNamespaceType::Network);
    if let Some(path) = netns.and_then(|n| n.path().as_ref()) {
        req["netns"] = json!(path);
    }
    if let Some(r) = linux.resources() {
        for (k, v) in limits(r, host_cpus) {
            req[k] = v;
        }
    }
    req
}

/// The limits of `r` the daemon takes: a memory limit, a CPU quota over
/// its period (at most the host's CPUs), a pids limit. One that is unset
/// or not positive is left out.
pub fn limits(r: &LinuxResources, host_cpus: usize) -> Vec<(&'static str, Value)> {
    let mut out = Vec::new();
    if let Some(m) = r.memory().as_ref().and_then(|m| m.limit()).filter(|m| *m > 0) {
        out.push(("memory", json!(m)));
    }
    if let Some(cpu) = r.cpu() {
        if let (Some(q), Some(p)) = (cpu.quota().filter(|q| *q > 0), cpu.period().filter(|p| *p > 0)) {
            let cpus = (q as f64 / p as f64).clamp(0.01, host_cpus.max(1) as f64);
            out.push(("cpus", json!((cpus * 100.0).round() / 100.0)));
        }
    }
    if let Some(p) = r.pids().as_ref().map(|p| p.limit()).filter(|p| *p > 0) {
        out.push(("pids", json!(p)));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(json: Value) -> Spec {
        serde_json::from_value(json).unwrap()
    }

    #[test]
    fn a_pods_spec_asks_for_its_namespace_limits_and_root() {
        let s = spec(json!({
            "ociVersion": "1.0.2",
            "root": {"path": "rootfs"},
            "hostname": "web-1",
            "process": {"args": ["sh", "-c", "echo hi"], "cwd": "/srv", "env": ["A=1"], "user": {"uid": 1000, "gid": 100}},
            "linux": {
                "namespaces": [{"type": "pid"}, {"type": "network", "path": "/var/run/netns/cni-1"}],
                "resources": {"memory": {"limit": 67108864}, "cpu": {"quota": 50000, "period": 100000}, "pids": {"limit": 64}}
            }
        }));
        let root = root_path(&s, Path::new("/run/bundle"));
        assert_eq!(root, Path::new("/run/bundle/rootfs"));
        let req = create_request(&s, &root, 2);
        assert_eq!(
            req,
            json!({"rootfs": "/run/bundle/rootfs", "hostname": "web-1", "netns": "/var/run/netns/cni-1",
                   "memory": 67108864, "cpus": 0.5, "pids": 64})
        );
        let c = task_command(&s).unwrap();
        assert_eq!((c.argv.len(), c.cwd.as_str(), c.user.as_str()), (3, "/srv", "1000:100"));
        assert_eq!(c.request("", "/f/out", "")["stdout"], "/f/out");
    }

    #[test]
    fn what_a_spec_leaves_out_or_strata_cannot_take_is_left_out() {
        let long = "a".repeat(64);
        let s = spec(json!({
            "ociVersion": "1.0.2",
            "root": {"path": "/abs/root"},
            "hostname": long,
            "process": {"args": ["true"], "cwd": "/", "user": {"uid": 0, "gid": 0}},
            "linux": {"namespaces": [{"type": "network"}], "resources": {"cpu": {"quota": 800000, "period": 100000}, "pids": {"limit": 0}}}
        }));
        let root = root_path(&s, Path::new("/run/bundle"));
        assert_eq!(root, Path::new("/abs/root"));
        // No netns path: a namespace of its own; 8 CPUs capped at the host's 2.
        assert_eq!(create_request(&s, &root, 2), json!({"rootfs": "/abs/root", "cpus": 2.0}));
    }

    #[test]
    fn a_terminal_or_an_empty_process_is_refused() {
        let tty: Process =
            serde_json::from_value(json!({"args": ["sh"], "cwd": "/", "terminal": true, "user": {"uid": 0, "gid": 0}}))
                .unwrap();
        assert!(matches!(Command::of(&tty), Err(SpecError::Terminal)));
        assert!(matches!(
            Command::of_json(br#"{"args": [], "cwd": "/", "user": {"uid": 0, "gid": 0}}"#),
            Err(SpecError::NoArgs)
        ));
        assert!(matches!(Command::of_json(b"{"), Err(SpecError::Decode(_))));
    }
}
