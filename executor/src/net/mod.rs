//! Sandbox networking: `none` (loopback only, the shim's own) or `egress`.
//!
//! An `egress` sandbox gets a routed /31 out of the daemon's range
//! (`--network-cidr`, default [`DEFAULT_RANGE`]): slot `n` is the pair
//! `range + 2n` (the host end `stv<n>`, the sandbox's gateway and
//! resolver) and `range + 2n + 1` (its `eth0`), a default route, the
//! daemon's resolver in its /etc/resolv.conf, and NAT out of the host
//! through Strata's nft table, under its [`Policy`].
//!
//! Owns: the table, the `stv*` links of the daemon's network namespace,
//! the resolver sockets. A daemon start rebuilds all three from the
//! sandboxes it adopts (their veths are made again: connections open
//! across a restart are reset); a stop removes them (a sandbox left
//! running without a daemon has no network, as nothing enforces its
//! policy then).

pub mod dns;
pub mod fastpath;
pub mod link;
pub mod nft;
pub mod policy;

use std::collections::HashSet;
use std::net::{Ipv4Addr, SocketAddr};
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

pub use policy::{Cidr, NetworkMode, NetworkSpec, Policy, PolicyError, Target};

/// The default sandbox range: private (RFC 1918), and clear of Docker's
/// 172.17.0.0/16 and of Podman's 10.88.0.0/16.
pub const DEFAULT_RANGE: &str = "10.89.0.0/16";
/// The default bound on a sandbox's tracked connections.
pub const DEFAULT_CONNTRACK: u32 = 4096;
/// Always denied, whatever a policy says unless the operator opens part
/// of it (`--network-permit`): link-local (and the cloud metadata address
/// in it). The sandboxes' own range is added; the host's addresses are
/// closed by the input chain; IPv6 is not forwarded at all (so neither is
/// `fd00:ec2::254`).
pub const ALWAYS_DENIED: [&str; 1] = ["169.254.0.0/16"];

#[derive(Debug, thiserror::Error)]
pub enum NetError {
    #[error("network range {0}: use an IPv4 CIDR of /8 to /30")]
    Range(String),
    #[error("no address left in the network range {0} ({1} sandboxes have one)")]
    Exhausted(Cidr, usize),
    #[error("enable IPv4 forwarding")]
    Forwarding(#[source] std::io::Error),
    #[error("sandbox link")]
    Link(#[from] link::LinkError),
    #[error("nftables")]
    Nft(#[from] nft::NftError),
    #[error("start the sandbox's resolver on {0}:53")]
    Resolver(Ipv4Addr, #[source] std::io::Error),
    #[error("start the resolver runtime")]
    Runtime(#[source] std::io::Error),
    #[error("the veths' fast path")]
    FastPath(#[from] fastpath::FastPathError),
}

impl crate::error::Classify for NetError {
    fn kind(&self) -> crate::error::ErrorKind {
        match self {
            NetError::Exhausted(..) => crate::error::ErrorKind::LimitReached,
            _ => crate::error::ErrorKind::of_host_failure(self),
        }
    }
}

/// How the daemon networks sandboxes (`strata daemon --network-*`).
#[derive(Debug, Clone)]
pub struct NetConfig {
    pub range: Cidr,
    /// Where the resolver forwards (default: the host's first nameserver).
    pub upstream: SocketAddr,
    pub conntrack: u32,
    /// Always-denied destinations the operator opened (`--network-permit`):
    /// a sandbox's own policy still decides whether it reaches them.
    pub permit: Vec<Cidr>,
    /// The nft table's name (family inet).
    pub table: String,
    /// GRO on and a NAPI thread for each host end ([`fastpath`]).
    pub napi_thread: bool,
}

impl NetConfig {
    pub fn parse_range(s: &str) -> Result<Cidr, NetError> {
        match s.parse::<Cidr>() {
            Ok(c) if (8..=30).contains(&c.prefix) => Ok(c),
            _ => Err(NetError::Range(s.to_string())),
        }
    }

    /// The host's resolver, from /etc/resolv.conf (else 127.0.0.1).
    pub fn host_upstream() -> SocketAddr {
        std::fs::read_to_string("/etc/resolv.conf")
            .ok()
            .and_then(|c| dns::upstream_from(&c))
            .unwrap_or_else(|| SocketAddr::from(([127, 0, 0, 1], 53)))
    }
}

/// The daemon's networking: its configuration, the slots in use and the
/// runtime the resolvers run on.
pub struct Network {
    cfg: NetConfig,
    fast: fastpath::FastPath,
    used: Mutex<Slots>,
    /// Taken at drop: a runtime may not be dropped on an async thread.
    rt: Option<tokio::runtime::Runtime>,
    resolvers: tokio::runtime::Handle,
}

impl Drop for Network {
    fn drop(&mut self) {
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

#[derive(Default)]
struct Slots {
    used: HashSet<u32>,
    next: u32,
}

impl Network {
    /// Take the namespace's networking over: forwarding on, the table
    /// rebuilt empty, every `stv*` link an earlier daemon left removed.
    pub fn start(cfg: NetConfig) -> Result<Arc<Network>, NetError> {
        std::fs::write("/proc/sys/net/ipv4/ip_forward", "1").map_err(NetError::Forwarding)?;
        let denied: Vec<Cidr> = ALWAYS_DENIED.iter().filter_map(|c| c.parse().ok()).collect();
        nft::apply(&nft::base(&cfg.table, cfg.range, &denied, &cfg.permit))?;
        let fast = fastpath::FastPath::open(cfg.napi_thread)?;
        let swept = link::sweep(nft::IFPREFIX)?;
        if !swept.is_empty() {
            tracing::info!("network: removed {} links an earlier daemon left: {}", swept.len(), swept.join(" "));
        }
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("resolver")
            .enable_all()
            .build()
            .map_err(NetError::Runtime)?;
        tracing::info!(
            "network: sandboxes in {}, resolver upstream {}, nft table inet {} (through {}), veths {}",
            cfg.range,
            cfg.upstream,
            cfg.table,
            nft::engine(),
            if fast.is_on() { "with GRO and a NAPI thread" } else { "on the softirq path" }
        );
        let resolvers = rt.handle().clone();
        Ok(Arc::new(Network { cfg, fast, used: Mutex::new(Slots::default()), rt: Some(rt), resolvers }))
    }

    /// Remove the table and every sandbox link (a daemon's stop).
    pub fn stop(&self) {
        if let Err(e) = nft::apply(&nft::remove_table(&self.cfg.table)) {
            tracing::warn!("network: remove table: {}", crate::error::chain(&e));
        }
        if let Err(e) = link::sweep(nft::IFPREFIX) {
            tracing::warn!("network: remove links: {}", crate::error::chain(&e));
        }
    }

    pub fn config(&self) -> &NetConfig {
        &self.cfg
    }

    fn slots(&self) -> u32 {
        (self.cfg.range.size() / 2).min(u64::from(u32::MAX)) as u32
    }

    fn pair(&self, slot: u32) -> (Ipv4Addr, Ipv4Addr) {
        let base = u32::from(self.cfg.range.addr) + 2 * slot;
        (Ipv4Addr::from(base), Ipv4Addr::from(base + 1))
    }

    fn slot_of(&self, address: Ipv4Addr) -> Option<u32> {
        let off = u32::from(address).checked_sub(u32::from(self.cfg.range.addr))?;
        (self.cfg.range.contains(address) && off % 2 == 1).then_some(off / 2)
    }

    /// A slot for a sandbox: `prefer`'s (an adopted sandbox's address) if
    /// it is free and in the range, else the next free one.
    pub fn reserve(self: &Arc<Self>, prefer: Option<Ipv4Addr>) -> Result<Reservation, NetError> {
        let mut s = self.used.lock().unwrap_or_else(|p| p.into_inner());
        let total = self.slots();
        let slot = match prefer.and_then(|a| self.slot_of(a)).filter(|n| !s.used.contains(n)) {
            Some(n) => n,
            None => {
                let free = (0..total).map(|i| (s.next + i) % total).find(|n| !s.used.contains(n));
                let n = free.ok_or(NetError::Exhausted(self.cfg.range, s.used.len()))?;
                s.next = (n + 1) % total;
                n
            }
        };
        s.used.insert(slot);
        Ok(Reservation { net: self.clone(), slot, live: true })
    }

    fn release(&self, slot: u32) {
        self.used.lock().unwrap_or_else(|p| p.into_inner()).used.remove(&slot);
    }

    /// The resolv.conf an `egress` sandbox sees.
    pub fn resolv_conf(gateway: Ipv4Addr) -> String {
        format!("# Strata: the daemon's resolver for this sandbox\nnameserver {gateway}\noptions ndots:0\n")
    }

    /// Wire the sandbox whose shim `pidfd` names into its reserved slot:
    /// its veth and its nft part (with `policy` in its sets), no resolver
    /// yet. Undone in reverse on failure, and when the [`Wired`] is dropped
    /// before [`Network::attach`] takes it.
    pub fn wire(self: &Arc<Self>, mut r: Reservation, pidfd: &OwnedFd, policy: &Policy) -> Result<Wired, NetError> {
        let slot = r.slot;
        let (gateway, address) = self.pair(slot);
        let host = format!("{}{slot}", nft::IFPREFIX);
        let t0 = std::time::Instant::now();
        // The link is made on its own thread while the rules go in here
        // (they match the link by name, so neither waits for the other).
        let making = link::create(pidfd, &link::Veth { host: host.clone(), gateway, address })?;
        let rules = nft::SandboxRules { slot, address, gateway, policy, conntrack: self.cfg.conntrack };
        let ruled = nft::apply(&nft::add_sandbox(&self.cfg.table, &rules));
        let ruled_at = t0.elapsed();
        let linked = making.wait();
        // From here the slot is the Wired's: it undoes what was made.
        r.live = false;
        let wired = Wired { net: self.clone(), slot, applied: policy.clone(), undone: AtomicBool::new(false) };
        if let Err(e) = linked {
            wired.undo_parts(ruled.is_ok(), false);
            return Err(e.into());
        }
        if let Err(e) = ruled {
            wired.undo_parts(false, true);
            return Err(e.into());
        }
        self.fast.tune(&host);
        tracing::debug!(
            "network: {host} rules in {} µs, linked by {} µs",
            ruled_at.as_micros(),
            t0.elapsed().as_micros()
        );
        Ok(wired)
    }

    /// Network the sandbox whose shim `pidfd` names: wired now if its slot
    /// is only reserved (a warm shim's may be wired already, with the
    /// empty policy), its sets filled with `policy`, its resolver started.
    pub fn attach(self: &Arc<Self>, slot: Slot, pidfd: &OwnedFd, policy: &Policy) -> Result<Attachment, NetError> {
        let wired = match slot {
            Slot::Reserved(r) => self.wire(r, pidfd, policy)?,
            Slot::Wired(w) => w,
        };
        let (gateway, address) = self.pair(wired.slot);
        if wired.applied != *policy {
            let rules = nft::SandboxRules { slot: wired.slot, address, gateway, policy, conntrack: self.cfg.conntrack };
            nft::apply(&nft::update_sandbox(&self.cfg.table, &rules))?;
        }
        let socket = std::net::UdpSocket::bind(SocketAddr::from((gateway, 53)))
            .and_then(|s| s.set_nonblocking(true).map(|()| s))
            .map_err(|e| NetError::Resolver(gateway, e))?;
        let shared = Arc::new(RwLock::new(policy.clone()));
        let cx = dns::Context {
            slot: wired.slot,
            table: self.cfg.table.clone(),
            upstream: self.cfg.upstream,
            policy: shared.clone(),
        };
        let dns = dns::serve(&self.resolvers, socket, cx);
        Ok(Attachment { wired, policy: shared, dns })
    }
}

/// The gateway (host end) of a sandbox's /31: the address below its own.
pub fn gateway_of(address: Ipv4Addr) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(address).wrapping_sub(1))
}

/// A slot taken for a sandbox being made; given back if dropped before
/// [`Network::wire`] makes its veth and rules.
pub struct Reservation {
    net: Arc<Network>,
    slot: u32,
    live: bool,
}

impl Reservation {
    pub fn address(&self) -> Ipv4Addr {
        self.net.pair(self.slot).1
    }

    pub fn gateway(&self) -> Ipv4Addr {
        self.net.pair(self.slot).0
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if self.live {
            self.net.release(self.slot);
        }
    }
}

/// What a sandbox being made networks into: a slot only reserved (the
/// veth and rules are made when its shim is up), or one a warm shim was
/// wired into ahead of it (see `daemon`'s warm pool).
pub enum Slot {
    Reserved(Reservation),
    Wired(Wired),
}

impl Slot {
    pub fn address(&self) -> Ipv4Addr {
        match self {
            Slot::Reserved(r) => r.address(),
            Slot::Wired(w) => w.net.pair(w.slot).1,
        }
    }
}

/// A slot with its veth made and its nft part in (holding `applied`),
/// and no resolver yet: undone (rules, link, slot) when dropped, or by
/// its [`Attachment`]'s detach.
pub struct Wired {
    net: Arc<Network>,
    slot: u32,
    applied: Policy,
    undone: AtomicBool,
}

impl Wired {
    fn interface(&self) -> String {
        format!("{}{}", nft::IFPREFIX, self.slot)
    }

    /// Once (later calls do nothing).
    fn undo(&self) {
        self.undo_parts(true, true);
    }

    /// Remove its rules and link, as far as they were made, and give its
    /// slot back; once.
    fn undo_parts(&self, rules: bool, link: bool) {
        if self.undone.swap(true, Ordering::SeqCst) {
            return;
        }
        if rules {
            if let Err(e) = nft::apply(&nft::remove_sandbox(&self.net.cfg.table, self.slot)) {
                tracing::warn!("network: remove rules of {}: {}", self.interface(), crate::error::chain(&e));
            }
        }
        if link {
            if let Err(e) = link::delete(&self.interface()) {
                tracing::warn!("network: remove {}: {}", self.interface(), crate::error::chain(&e));
            }
        }
        self.net.release(self.slot);
    }
}

impl Drop for Wired {
    fn drop(&mut self) {
        self.undo();
    }
}

/// A networked sandbox's part of the host: its wired slot and its
/// resolver, undone by [`Attachment::detach`] (or its drop).
pub struct Attachment {
    wired: Wired,
    policy: Arc<RwLock<Policy>>,
    dns: tokio::task::AbortHandle,
}

impl Attachment {
    pub fn address(&self) -> Ipv4Addr {
        self.wired.net.pair(self.wired.slot).1
    }

    pub fn gateway(&self) -> Ipv4Addr {
        self.wired.net.pair(self.wired.slot).0
    }

    pub fn interface(&self) -> String {
        self.wired.interface()
    }

    pub fn policy(&self) -> Policy {
        self.policy.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Replace the policy: new connections follow it at once (open ones
    /// keep going), and names resolved under the old one are forgotten.
    pub fn set_policy(&self, policy: &Policy) -> Result<(), NetError> {
        let mut held = self.policy.write().unwrap_or_else(|p| p.into_inner());
        let net = &self.wired.net;
        let rules = nft::SandboxRules {
            slot: self.wired.slot,
            address: self.address(),
            gateway: self.gateway(),
            policy,
            conntrack: net.cfg.conntrack,
        };
        nft::apply(&nft::update_sandbox(&net.cfg.table, &rules))?;
        *held = policy.clone();
        Ok(())
    }

    /// Undo [`Network::attach`]; once (later calls do nothing).
    pub fn detach(&self) {
        self.dns.abort();
        self.wired.undo();
    }
}

impl Drop for Attachment {
    fn drop(&mut self) {
        self.detach();
    }
}

/// A TCP connection to `127.0.0.1:port` inside the network namespace of
/// the process `pidfd` names (a sandbox's shim): made on a thread of its
/// own that enters that namespace, so it works with or without a network,
/// for a server bound to the sandbox's loopback too. The socket stays in
/// that namespace after the thread has ended.
pub fn connect_in(pidfd: &OwnedFd, port: u16, timeout: Duration) -> std::io::Result<std::net::TcpStream> {
    let pidfd = pidfd.try_clone()?;
    let worker = std::thread::Builder::new().name("port-connect".into()).spawn(move || {
        nix::sched::setns(pidfd.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET)?;
        std::net::TcpStream::connect_timeout(&SocketAddr::from(([127, 0, 0, 1], port)), timeout)
    })?;
    worker.join().map_err(|_| std::io::Error::other("the port-connect thread panicked"))?
}
