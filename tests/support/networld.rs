//! A network world of the test's own, so that no packet leaves the
//! machine: two network namespaces joined by a veth, and no other link.
//!
//! - `host` (198.18.0.1/30, default route via 198.18.0.2) is where the
//!   daemon runs ([`NetWorld::daemon`]), as it would on a real host;
//! - `internet` (198.18.0.2/30) plays the internet: the test's TCP servers
//!   on [`ALLOWED`], [`DENIED`] and [`METADATA`] (addresses of its
//!   loopback), and dnsmasq answering `allowed.test`, `denied.test` and
//!   `*.wild.test`.
//!
//! 198.18.0.0/15 is the benchmarking range (RFC 2544): never routed on the
//! internet, and reachable here only inside these namespaces. Drop stops
//! every server and deletes both namespaces.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::{TestEnv, PREFIX};

/// The daemon's namespace's address on the link.
pub const HOST: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 1);
/// The internet's router (and its resolver).
pub const ROUTER: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 2);
/// A server a policy lets in (`allowed.test`, `a.wild.test`).
pub const ALLOWED: Ipv4Addr = Ipv4Addr::new(198, 18, 1, 1);
/// A server a policy keeps out (`denied.test`).
pub const DENIED: Ipv4Addr = Ipv4Addr::new(198, 18, 2, 1);
/// The cloud metadata address, served by the internet, never reachable.
pub const METADATA: Ipv4Addr = Ipv4Addr::new(169, 254, 169, 254);
/// The port every internet server listens on.
pub const PORT: u16 = 80;
/// A service of the daemon's host, on all its addresses.
pub const HOST_SERVICE_PORT: u16 = 8080;

/// Datagrams a [`NetWorld::udp_sink`] received.
pub type Sink = Arc<std::sync::Mutex<Vec<(SocketAddr, String)>>>;

static WORLDS: AtomicUsize = AtomicUsize::new(0);

pub struct NetWorld {
    /// `/run/netns/<name>` of the daemon's namespace.
    pub host: PathBuf,
    /// `/run/netns/<name>` of the internet's.
    pub internet: PathBuf,
    names: Vec<String>,
    stop: Arc<AtomicBool>,
    servers: Vec<JoinHandle<()>>,
    children: Vec<Child>,
    dir: tempfile::TempDir,
}

fn run(cmd: &mut Command) {
    let out = cmd.stdin(Stdio::null()).output().expect("run a network set-up command");
    assert!(out.status.success(), "{cmd:?} failed: {}", String::from_utf8_lossy(&out.stderr));
}

fn ip(ns: &str, args: &str) {
    run(Command::new("ip").arg("-n").arg(ns).args(args.split_whitespace()));
}

impl NetWorld {
    pub fn new() -> NetWorld {
        crate::require_root();
        let n = WORLDS.fetch_add(1, Ordering::SeqCst);
        let base = format!("{PREFIX}-net-{}-{n}", std::process::id());
        let (h, i) = (format!("{base}-h"), format!("{base}-i"));
        let dir = tempfile::Builder::new().prefix(&format!("{PREFIX}-net-")).tempdir().expect("tempdir");
        let mut world = NetWorld {
            host: PathBuf::from(format!("/run/netns/{h}")),
            internet: PathBuf::from(format!("/run/netns/{i}")),
            names: Vec::new(),
            stop: Arc::new(AtomicBool::new(false)),
            servers: Vec::new(),
            children: Vec::new(),
            dir,
        };
        for name in [&h, &i] {
            run(Command::new("ip").args(["netns", "add", name]));
            world.names.push(name.clone());
            ip(name, "link set lo up");
        }
        // Made from inside `host`, both ends in their namespaces at once:
        // the link never exists in the machine's own namespace.
        run(Command::new("ip")
            .args(["-n", &h, "link", "add", "uplink", "type", "veth", "peer", "name", "downlink"])
            .args(["netns", &i]));
        ip(&h, &format!("addr add {HOST}/30 dev uplink"));
        ip(&h, "link set uplink up");
        ip(&h, &format!("route add default via {ROUTER}"));
        ip(&i, &format!("addr add {ROUTER}/30 dev downlink"));
        ip(&i, "link set downlink up");
        for a in [ALLOWED, DENIED, METADATA] {
            ip(&i, &format!("addr add {a}/32 dev lo"));
        }
        let internet = world.internet.clone();
        for a in [ALLOWED, DENIED, METADATA] {
            world.serve(&internet, SocketAddr::from((a, PORT)), &format!("hello from {a}"));
        }
        let host = world.host.clone();
        world.serve(&host, SocketAddr::from(([0, 0, 0, 0], HOST_SERVICE_PORT)), "hello from the host");
        world.start_dns();
        world
    }

    /// A TCP server in namespace `ns` on `addr` that greets each client with
    /// `greeting` and a newline, then closes. It runs on a thread that
    /// entered `ns` (its socket stays there).
    pub fn serve(&mut self, ns: &Path, addr: SocketAddr, greeting: &str) {
        let ns = std::fs::File::open(ns).expect("open the namespace");
        let (stop, greeting) = (self.stop.clone(), format!("{greeting}\n"));
        let (tx, rx) = std::sync::mpsc::channel();
        let h = std::thread::spawn(move || {
            nix::sched::setns(&ns, nix::sched::CloneFlags::CLONE_NEWNET).expect("setns");
            let l = TcpListener::bind(addr).expect("bind a world server");
            l.set_nonblocking(true).unwrap();
            tx.send(()).unwrap();
            while !stop.load(Ordering::SeqCst) {
                match l.accept() {
                    Ok((mut s, _)) => {
                        let _ = s.set_nonblocking(false);
                        let _ = s.write_all(greeting.as_bytes());
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
        });
        rx.recv_timeout(Duration::from_secs(5)).expect("the world server to listen");
        self.servers.push(h);
    }

    /// A UDP socket on `ip:port` of the internet recording every datagram
    /// (its source as the internet sees it, its text).
    pub fn udp_sink(&mut self, ip: Ipv4Addr, port: u16) -> Sink {
        let ns = std::fs::File::open(&self.internet).expect("open the namespace");
        let (stop, got) = (self.stop.clone(), Sink::default());
        let seen = got.clone();
        let (tx, rx) = std::sync::mpsc::channel();
        let h = std::thread::spawn(move || {
            nix::sched::setns(&ns, nix::sched::CloneFlags::CLONE_NEWNET).expect("setns");
            let s = std::net::UdpSocket::bind((ip, port)).expect("bind the sink");
            s.set_read_timeout(Some(Duration::from_millis(20))).unwrap();
            tx.send(()).unwrap();
            let mut buf = [0u8; 2048];
            while !stop.load(Ordering::SeqCst) {
                if let Ok((n, from)) = s.recv_from(&mut buf) {
                    seen.lock().unwrap().push((from, String::from_utf8_lossy(&buf[..n]).into_owned()));
                }
            }
        });
        rx.recv_timeout(Duration::from_secs(5)).expect("the sink to bind");
        self.servers.push(h);
        got
    }

    fn start_dns(&mut self) {
        let log = self.dir.path().join("dnsmasq.log");
        let child = Command::new("nsenter")
            .arg(format!("--net={}", self.internet.display()))
            .args(["dnsmasq", "--keep-in-foreground", "--conf-file=/dev/null", "--no-resolv", "--no-hosts"])
            .args(["--bind-interfaces", "--pid-file=", "--user=root"])
            .arg(format!("--listen-address={ROUTER}"))
            .arg(format!("--log-facility={}", log.display()))
            .arg(format!("--address=/allowed.test/{ALLOWED}"))
            .arg(format!("--address=/denied.test/{DENIED}"))
            .arg(format!("--address=/wild.test/{ALLOWED}"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("run dnsmasq (Debian's dnsmasq-base; scripts/install-deps.sh installs it)");
        self.children.push(child);
        let start = Instant::now();
        while !std::fs::read_to_string(&log).unwrap_or_default().contains("started") {
            if let Some(st) = self.children.last_mut().unwrap().try_wait().unwrap() {
                panic!("dnsmasq exited with {st}: {}", std::fs::read_to_string(&log).unwrap_or_default());
            }
            assert!(start.elapsed() < Duration::from_secs(10), "dnsmasq did not start");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// A daemon in the world's host namespace, resolving through its router.
    pub fn daemon(&self, extra: &[&str]) -> TestEnv {
        let upstream = format!("{ROUTER}:53");
        let args: Vec<&str> = ["--dns-upstream", &upstream].into_iter().chain(extra.iter().copied()).collect();
        TestEnv::start_in_netns(&self.host, &args)
    }

    /// Run `cmd` in the world's host namespace (as the daemon's host sees it).
    pub fn in_host(&self, cmd: &str, args: &[&str]) -> std::process::Output {
        Command::new("nsenter")
            .arg(format!("--net={}", self.host.display()))
            .arg(cmd)
            .args(args)
            .stdin(Stdio::null())
            .output()
            .expect("nsenter")
    }

    /// What a TCP client in the host namespace reads from `addr`.
    pub fn fetch_from_host(&self, addr: SocketAddr) -> std::io::Result<String> {
        let ns = std::fs::File::open(&self.host)?;
        std::thread::spawn(move || {
            nix::sched::setns(&ns, nix::sched::CloneFlags::CLONE_NEWNET)?;
            let mut s = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(3))?;
            let mut out = String::new();
            s.read_to_string(&mut out)?;
            Ok(out)
        })
        .join()
        .unwrap()
    }

    /// The names of links of the daemon's namespace.
    pub fn host_links(&self) -> Vec<String> {
        let out = self.in_host("ip", &["-o", "link", "show"]);
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| l.split(": ").nth(1))
            .map(|n| n.split('@').next().unwrap_or(n).to_string())
            .collect()
    }

    /// A sysfs attribute of a link of the daemon's namespace (`ip netns
    /// exec` mounts a sysfs of that namespace for the command it runs).
    pub fn host_link_attr(&self, link: &str, attr: &str) -> String {
        let ns = &self.names[0];
        let path = format!("/sys/class/net/{link}/{attr}");
        let out = Command::new("ip").args(["netns", "exec", ns, "cat", &path]).output().expect("ip netns exec");
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }

    /// The nft tables of the daemon's namespace (`inet strata` when a
    /// networked daemon runs there).
    pub fn host_tables(&self) -> Vec<String> {
        let out = self.in_host("nft", &["list", "tables"]);
        String::from_utf8_lossy(&out.stdout).lines().map(|l| l.trim().to_string()).collect()
    }

    /// The chains of Strata's table in the daemon's namespace.
    pub fn host_chains(&self) -> Vec<String> {
        let out = self.in_host("nft", &["-j", "list", "chains", "inet"]);
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
        v["nftables"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|e| e.get("chain"))
            .filter(|c| c["table"] == "strata")
            .filter_map(|c| c["name"].as_str().map(str::to_string))
            .collect()
    }
}

impl Default for NetWorld {
    fn default() -> NetWorld {
        NetWorld::new()
    }
}

impl Drop for NetWorld {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        for h in self.servers.drain(..) {
            let _ = h.join();
        }
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
        for name in &self.names {
            let _ = Command::new("ip").args(["netns", "del", name]).status();
        }
    }
}
