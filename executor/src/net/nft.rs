//! Strata's nftables table, written as `nft -f` scripts: one transaction
//! each, so a sandbox's rules appear (or go) whole, and the kernel applies
//! them atomically. They run through libnftables (what Debian's `nftables`
//! package's `nft` is a front end of), loaded in the daemon, or `nft -f -`
//! where it does not load; the `nftables` crate would only wrap the same
//! binary's JSON, and the text here is what an operator reads back with
//! `nft list table inet strata`.
//!
//! The table (family `inet`, one per daemon network namespace):
//! - `forward`: replies to what a sandbox opened pass; nothing new enters
//!   a sandbox's veth (ports in go through the daemon, and no sandbox
//!   reaches another); a sandbox's own packets jump to its chain `f<n>`
//!   through the verdict map `egress`, and a veth with no chain drops.
//! - `f<n>`: its source address only (no spoofing), at most `conntrack`
//!   tracked connections, the always-denied set (but what the operator
//!   opened in `permit`), then its allowed CIDRs
//!   `a<n>`, the addresses its allowed domains resolved to `d<n>`, its
//!   denied CIDRs `x<n>` (allowed wins over denied), else accept.
//! - `input` / `i<n>`: of the host itself a sandbox reaches its resolver
//!   (DNS on its gateway address) and nothing else: not the API, the E2B
//!   port, PostgreSQL or a registry, on any address of the host.
//! - `output`: the host's own processes do not open connections into a
//!   sandbox either (its ports are reached through the daemon, which
//!   connects inside the sandbox's namespace); replies pass.
//! - `postrouting`: the sandboxes' range is masqueraded out of the host.
//!
//! Denied traffic is rejected (administratively prohibited), so a client
//! in the sandbox fails at once instead of waiting for a timeout.

use std::io::Write;
use std::net::Ipv4Addr;
use std::process::{Command, Stdio};

use super::policy::{Cidr, Policy};

/// The veth host ends' name prefix (`stv<n>`); rules match on it.
pub const IFPREFIX: &str = "stv";

const REJECT: &str = "reject with icmpx type admin-prohibited";

#[derive(Debug, thiserror::Error)]
pub enum NftError {
    #[error("run nft (install Debian's nftables package)")]
    Spawn(#[source] std::io::Error),
    #[error("nft -f refused the rules: {stderr}")]
    Refused { stderr: String },
}

/// One sandbox's part of the table.
#[derive(Debug, Clone)]
pub struct SandboxRules<'a> {
    pub slot: u32,
    pub address: Ipv4Addr,
    pub gateway: Ipv4Addr,
    pub policy: &'a Policy,
    pub conntrack: u32,
}

fn elements<'a>(cidrs: impl Iterator<Item = &'a Cidr>) -> String {
    cidrs.map(|c| c.to_string()).collect::<Vec<_>>().join(", ")
}

/// The whole table, rebuilt from nothing (a daemon's start): the sandboxes
/// it adopted get their part with [`add_sandbox`] after it.
pub fn base(table: &str, range: Cidr, always_denied: &[Cidr], permit: &[Cidr]) -> String {
    let deny = elements(always_denied.iter().chain(std::iter::once(&range)));
    let permit = match elements(permit.iter()) {
        e if e.is_empty() => String::new(),
        e => format!(" elements = {{ {e} }};"),
    };
    format!(
        "table inet {table}\n\
         delete table inet {table}\n\
         table inet {table} {{\n\
         \tmap egress {{ type ifname : verdict; }}\n\
         \tmap host_in {{ type ifname : verdict; }}\n\
         \tset always_deny {{ type ipv4_addr; flags interval; auto-merge; elements = {{ {deny} }}; }}\n\
         \tset permit {{ type ipv4_addr; flags interval; auto-merge;{permit} }}\n\
         \tchain forward {{\n\
         \t\ttype filter hook forward priority filter; policy accept;\n\
         \t\toifname \"{IFPREFIX}*\" ct state established,related accept\n\
         \t\toifname \"{IFPREFIX}*\" {REJECT}\n\
         \t\tiifname \"{IFPREFIX}*\" ct state established,related accept\n\
         \t\tiifname \"{IFPREFIX}*\" meta nfproto ipv6 drop\n\
         \t\tiifname vmap @egress\n\
         \t\tiifname \"{IFPREFIX}*\" drop\n\
         \t}}\n\
         \tchain input {{\n\
         \t\ttype filter hook input priority filter; policy accept;\n\
         \t\tiifname \"{IFPREFIX}*\" ct state established,related accept\n\
         \t\tiifname vmap @host_in\n\
         \t\tiifname \"{IFPREFIX}*\" drop\n\
         \t}}\n\
         \tchain output {{\n\
         \t\ttype filter hook output priority filter; policy accept;\n\
         \t\toifname \"{IFPREFIX}*\" ct state established,related accept\n\
         \t\toifname \"{IFPREFIX}*\" {REJECT}\n\
         \t}}\n\
         \tchain postrouting {{\n\
         \t\ttype nat hook postrouting priority srcnat; policy accept;\n\
         \t\tip saddr {range} oifname != \"{IFPREFIX}*\" masquerade\n\
         \t}}\n\
         }}\n"
    )
}

/// Remove the table (a daemon's stop); absent already is fine.
pub fn remove_table(table: &str) -> String {
    format!("table inet {table}\ndelete table inet {table}\n")
}

/// The sets' contents of a policy: flushed and refilled, so a change
/// takes effect for the next connection (replies of open ones pass in
/// `forward` before any set is read).
fn fill(table: &str, s: &SandboxRules<'_>, out: &mut String) {
    let n = s.slot;
    for set in ["a", "x", "d"] {
        out.push_str(&format!("flush set inet {table} {set}{n}\n"));
    }
    let allow = elements(s.policy.allowed_cidrs());
    if !allow.is_empty() {
        out.push_str(&format!("add element inet {table} a{n} {{ {allow} }}\n"));
    }
    let deny = elements(s.policy.deny_out.iter());
    if !deny.is_empty() {
        out.push_str(&format!("add element inet {table} x{n} {{ {deny} }}\n"));
    }
}

/// A sandbox's chains, sets and map entries.
pub fn add_sandbox(table: &str, s: &SandboxRules<'_>) -> String {
    let n = s.slot;
    let (ip, gw, max) = (s.address, s.gateway, s.conntrack);
    let mut out = format!(
        "add set inet {table} a{n} {{ type ipv4_addr; flags interval; auto-merge; }}\n\
         add set inet {table} x{n} {{ type ipv4_addr; flags interval; auto-merge; }}\n\
         add set inet {table} d{n} {{ type ipv4_addr; size 65536; }}\n\
         add chain inet {table} f{n}\n\
         add chain inet {table} i{n}\n\
         flush chain inet {table} f{n}\n\
         flush chain inet {table} i{n}\n"
    );
    fill(table, s, &mut out);
    for rule in [
        format!("ip saddr != {ip} drop"),
        format!("ct count over {max} {REJECT}"),
        format!("ip daddr @always_deny ip daddr != @permit {REJECT}"),
        format!("ip daddr @a{n} accept"),
        format!("ip daddr @d{n} accept"),
        format!("ip daddr @x{n} {REJECT}"),
        "accept".to_string(),
    ] {
        out.push_str(&format!("add rule inet {table} f{n} {rule}\n"));
    }
    for rule in [
        format!("ip saddr != {ip} drop"),
        format!("ip daddr {gw} udp dport 53 accept"),
        format!("ip daddr {gw} tcp dport 53 accept"),
        REJECT.to_string(),
    ] {
        out.push_str(&format!("add rule inet {table} i{n} {rule}\n"));
    }
    out.push_str(&format!(
        "add element inet {table} egress {{ \"{IFPREFIX}{n}\" : jump f{n} }}\n\
         add element inet {table} host_in {{ \"{IFPREFIX}{n}\" : jump i{n} }}\n"
    ));
    out
}

/// A live policy change: the sets only (the chains read them).
pub fn update_sandbox(table: &str, s: &SandboxRules<'_>) -> String {
    let mut out = String::new();
    fill(table, s, &mut out);
    out
}

/// Everything [`add_sandbox`] made, in one transaction.
pub fn remove_sandbox(table: &str, slot: u32) -> String {
    let n = slot;
    format!(
        "delete element inet {table} egress {{ \"{IFPREFIX}{n}\" }}\n\
         delete element inet {table} host_in {{ \"{IFPREFIX}{n}\" }}\n\
         flush chain inet {table} f{n}\n\
         flush chain inet {table} i{n}\n\
         delete chain inet {table} f{n}\n\
         delete chain inet {table} i{n}\n\
         delete set inet {table} a{n}\n\
         delete set inet {table} x{n}\n\
         delete set inet {table} d{n}\n"
    )
}

/// Addresses an allowed domain resolved to, let in for that sandbox.
pub fn add_resolved(table: &str, slot: u32, ips: &[Ipv4Addr]) -> String {
    let list = ips.iter().map(|i| i.to_string()).collect::<Vec<_>>().join(", ");
    format!("add element inet {table} d{slot} {{ {list} }}\n")
}

/// libnftables in this process, when it loads (one context, one
/// transaction at a time).
static LIBRARY: std::sync::OnceLock<Option<std::sync::Mutex<strata_shim::sys::Nftables>>> = std::sync::OnceLock::new();

fn library() -> Option<&'static std::sync::Mutex<strata_shim::sys::Nftables>> {
    LIBRARY.get_or_init(|| strata_shim::sys::Nftables::load().map(std::sync::Mutex::new)).as_ref()
}

/// How scripts run here: `libnftables` or `nft -f`.
pub fn engine() -> &'static str {
    if library().is_some() {
        "libnftables"
    } else {
        "nft -f"
    }
}

/// Run a script as one transaction: through libnftables where it loads,
/// else by `nft -f -`.
pub fn apply(script: &str) -> Result<(), NftError> {
    if let Some(nft) = library() {
        let script = std::ffi::CString::new(script).map_err(|_| NftError::Refused { stderr: "a NUL byte".into() })?;
        let mut nft = nft.lock().unwrap_or_else(|p| p.into_inner());
        return nft.run(&script).map_err(|stderr| NftError::Refused { stderr: brief(&stderr) });
    }
    spawn(script)
}

/// An error text's first lines, on one.
fn brief(stderr: &str) -> String {
    stderr.lines().filter(|l| !l.trim().is_empty()).take(6).collect::<Vec<_>>().join("; ")
}

/// `nft -f -` with `script` on its stdin.
fn spawn(script: &str) -> Result<(), NftError> {
    let mut child = Command::new("nft")
        .args(["-f", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(NftError::Spawn)?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin.write_all(script.as_bytes()).map_err(NftError::Spawn)?;
    }
    let out = child.wait_with_output().map_err(NftError::Spawn)?;
    if out.status.success() {
        return Ok(());
    }
    Err(NftError::Refused { stderr: brief(&String::from_utf8_lossy(&out.stderr)) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sandbox_chain_checks_spoofing_limits_and_allowed_before_denied() {
        let policy = Policy::parse(&["198.18.1.0/24".into(), "a.test".into()], &["0.0.0.0/0".into()]).unwrap();
        let s = SandboxRules {
            slot: 5,
            address: "10.89.0.11".parse().unwrap(),
            gateway: "10.89.0.10".parse().unwrap(),
            policy: &policy,
            conntrack: 100,
        };
        let script = add_sandbox("strata", &s);
        let rules: Vec<&str> = script.lines().filter(|l| l.starts_with("add rule inet strata f5")).collect();
        assert_eq!(rules[0], "add rule inet strata f5 ip saddr != 10.89.0.11 drop");
        assert!(rules[1].contains("ct count over 100"));
        let pos = |needle: &str| rules.iter().position(|r| r.contains(needle)).unwrap();
        assert!(pos("@always_deny") < pos("@a5") && pos("@a5") < pos("@x5"));
        assert!(script.contains("add element inet strata a5 { 198.18.1.0/24 }"));
        assert!(script.contains("add element inet strata x5 { 0.0.0.0/0 }"));
        assert!(script.contains("\"stv5\" : jump f5"));
        // An update only refills the sets.
        let update = update_sandbox("strata", &s);
        assert!(update.lines().all(|l| l.starts_with("flush set") || l.starts_with("add element")));
    }
}
