//! Sandbox networking in a world of the test's own ([`NetWorld`]): the
//! daemon in a network namespace the test made, a veth to a second one
//! that plays the internet with the test's servers, no route anywhere
//! else. No packet of these tests leaves the machine.

use std::io::{Read, Write};
use std::net::Ipv4Addr;
use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::{json, Value};
use strata_tests::networld::{NetWorld, ALLOWED, DENIED, HOST, HOST_SERVICE_PORT, METADATA, PORT};
use strata_tests::*;

const SINK_PORT: u16 = 9999;

/// `spoof SRC DST PORT TEXT`: one UDP datagram with any source address,
/// written whole (IP header included) to a raw socket.
const SPOOF: &str = r#"
#include <arpa/inet.h>
#include <netinet/ip.h>
#include <netinet/udp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
int main(int argc, char **argv) {
    if (argc != 5) return 2;
    char pkt[1500];
    memset(pkt, 0, sizeof pkt);
    struct iphdr *ip = (struct iphdr *)pkt;
    struct udphdr *udp = (struct udphdr *)(pkt + sizeof *ip);
    size_t len = strlen(argv[4]);
    memcpy(pkt + sizeof *ip + sizeof *udp, argv[4], len);
    ip->version = 4; ip->ihl = 5; ip->ttl = 64; ip->protocol = IPPROTO_UDP;
    ip->tot_len = htons(sizeof *ip + sizeof *udp + len);
    ip->saddr = inet_addr(argv[1]); ip->daddr = inet_addr(argv[2]);
    udp->source = htons(40000); udp->dest = htons(atoi(argv[3]));
    udp->len = htons(sizeof *udp + len); udp->check = 0;
    int s = socket(AF_INET, SOCK_RAW, IPPROTO_RAW);
    if (s < 0) { perror("socket"); return 1; }
    struct sockaddr_in to = { .sin_family = AF_INET, .sin_addr.s_addr = ip->daddr };
    if (sendto(s, pkt, ntohs(ip->tot_len), 0, (struct sockaddr *)&to, sizeof to) < 0) { perror("sendto"); return 1; }
    return 0;
}
"#;

fn status_of<T>(r: Result<T, ClientError>) -> u16 {
    match r {
        Err(e) => e.status().unwrap_or_else(|| panic!("transport error {e}")),
        Ok(_) => 200,
    }
}

/// What sandbox `id` reads from `ip:port` over TCP, or why it could not.
fn reach(env: &TestEnv, id: &str, ip: Ipv4Addr, port: u16) -> Result<String, String> {
    let v = sh(env, id, &format!("nc -w 3 {ip} {port} </dev/null"));
    let out = stdout(&v);
    if v["exit_code"] == 0 && out.starts_with("hello") {
        Ok(out.trim().to_string())
    } else {
        Err(format!("exit {} stdout {out:?} stderr {:?}", v["exit_code"], v["stderr"]))
    }
}

fn assert_reaches(env: &TestEnv, id: &str, ip: Ipv4Addr) {
    let got = reach(env, id, ip, PORT).unwrap_or_else(|e| panic!("{id} should reach {ip}: {e}"));
    assert_eq!(got, format!("hello from {ip}"));
}

fn assert_blocked(env: &TestEnv, id: &str, ip: Ipv4Addr, port: u16) {
    if let Ok(got) = reach(env, id, ip, port) {
        panic!("{id} reached {ip}:{port} ({got:?}), which its policy denies");
    }
}

fn egress(env: &TestEnv, allow: &[&str], deny: &[&str]) -> (String, Value) {
    let body = json!({"image": "busybox:latest",
        "network": {"mode": "egress", "allow_out": allow, "deny_out": deny}});
    let v: Value = env.client().call("POST", "/v1/sandboxes", Some(&body)).expect("create an egress sandbox");
    (v["id"].as_str().unwrap().to_string(), v)
}

fn address(v: &Value) -> Ipv4Addr {
    v["network"]["address"].as_str().unwrap_or_else(|| panic!("no address in {v}")).parse().unwrap()
}

fn lookup(env: &TestEnv, id: &str, name: &str) -> Value {
    sh(env, id, &format!("nslookup {name}"))
}

#[test]
fn egress_follows_cidr_and_domain_rules_allowed_over_denied_and_never_reaches_the_host_or_metadata() {
    let mut world = NetWorld::new();
    let env = world.daemon(&[]);
    env.import_busybox();

    // No lists: everything but the always-denied.
    let (open, v) = egress(&env, &[], &[]);
    let gateway = Ipv4Addr::from(u32::from(address(&v)) - 1);
    let conf = stdout(&sh(&env, &open, "cat /etc/resolv.conf; ip -4 addr show eth0"));
    assert!(conf.contains(&format!("nameserver {gateway}")), "{conf}");
    assert!(conf.contains(&address(&v).to_string()), "{conf}");
    assert_reaches(&env, &open, ALLOWED);
    assert_reaches(&env, &open, DENIED);
    let looked = lookup(&env, &open, "denied.test");
    assert!(stdout(&looked).contains(&DENIED.to_string()), "{looked}");
    // The metadata address, the host's services on any of its addresses
    // (its resolver answers DNS only) stay shut.
    assert_blocked(&env, &open, METADATA, PORT);
    assert_blocked(&env, &open, HOST, HOST_SERVICE_PORT);
    assert_blocked(&env, &open, gateway, HOST_SERVICE_PORT);
    assert!(world.fetch_from_host((HOST, HOST_SERVICE_PORT).into()).unwrap().contains("hello from the host"));
    // An allowed metadata address is still denied.
    let (meta, _) = egress(&env, &["169.254.169.254", "198.18.0.0/15"], &[]);
    assert_blocked(&env, &meta, METADATA, PORT);
    assert_reaches(&env, &meta, ALLOWED);

    // CIDR rules: allowed wins over denied.
    let (cidr, _) = egress(&env, &["198.18.1.0/24"], &["0.0.0.0/0"]);
    assert_reaches(&env, &cidr, ALLOWED);
    assert_blocked(&env, &cidr, DENIED, PORT);
    let (denylist, _) = egress(&env, &[], &["198.18.2.1"]);
    assert_reaches(&env, &denylist, ALLOWED);
    assert_blocked(&env, &denylist, DENIED, PORT);

    // Domain rules follow what the sandbox looked up through the resolver.
    let (names, _) = egress(&env, &["allowed.test", "*.wild.test"], &["0.0.0.0/0"]);
    assert_blocked(&env, &names, ALLOWED, PORT);
    let refused = lookup(&env, &names, "denied.test");
    assert!(!stdout(&refused).contains(&DENIED.to_string()), "a denied name resolved: {refused}");
    assert_blocked(&env, &names, DENIED, PORT);
    let wild = lookup(&env, &names, "a.wild.test");
    assert!(stdout(&wild).contains(&ALLOWED.to_string()), "{wild}");
    assert_reaches(&env, &names, ALLOWED);
    assert_blocked(&env, &names, DENIED, PORT);
    // `*.wild.test` is its subdomains, not the name itself.
    let (apex, _) = egress(&env, &["*.wild.test"], &["0.0.0.0/0"]);
    let bare = lookup(&env, &apex, "wild.test");
    assert!(!stdout(&bare).contains(&ALLOWED.to_string()), "{bare}");
    assert_blocked(&env, &apex, ALLOWED, PORT);

    // Sandboxes cannot reach each other, and nothing new enters a
    // sandbox's veth from the host: ports in go through the daemon.
    let (server, sv) = egress(&env, &[], &[]);
    sh(&env, &server, "mkdir -p /www && echo hello from a sandbox >/www/index.html && httpd -p 8000 -h /www");
    let sv_addr = address(&sv);
    assert_blocked(&env, &open, sv_addr, 8000);
    assert!(world.fetch_from_host((sv_addr, 8000).into()).is_err(), "the host reached a sandbox's port directly");
    // A sandbox cannot claim another's address: with CAP_NET_RAW (in the
    // default set) it can write any source, and only its own leaves.
    let sink = world.udp_sink(ALLOWED, SINK_PORT);
    let work = tempfile::Builder::new().prefix("strata-test-spoof-").tempdir().unwrap();
    let helper = compile_c(work.path(), "spoof", SPOOF, &["-static", "-O1"]);
    env.cli_ok(&["cp", helper.to_str().unwrap(), &format!("{open}:/bin/spoof")]);
    let own = address(&v);
    for (src, what) in [(sv_addr, "spoofed"), (Ipv4Addr::new(198, 18, 0, 9), "foreign"), (own, "honest")] {
        let r = sh(&env, &open, &format!("spoof {src} {ALLOWED} {SINK_PORT} {what}"));
        assert_eq!(r["exit_code"], 0, "{r}");
    }
    wait_for(
        "the honest datagram",
        Duration::from_secs(5),
        || sink.lock().unwrap().iter().any(|(_, p)| p == "honest").then_some(()),
        || format!("{:?}", sink.lock().unwrap()),
    );
    std::thread::sleep(Duration::from_millis(200));
    let seen = sink.lock().unwrap().clone();
    assert!(seen.iter().all(|(_, p)| p == "honest"), "a spoofed source got through: {seen:?}");

    env.finish();
    assert!(!world.host_tables().iter().any(|t| t.contains("strata")), "{:?}", world.host_tables());
}

#[test]
fn a_live_policy_change_takes_effect_at_once_and_is_checked() {
    let world = NetWorld::new();
    let env = world.daemon(&[]);
    env.import_busybox();
    let (id, _) = egress(&env, &["198.18.1.1"], &["0.0.0.0/0"]);
    assert_reaches(&env, &id, ALLOWED);
    assert_blocked(&env, &id, DENIED, PORT);

    let body = json!({"allow_out": ["198.18.2.0/24"], "deny_out": ["0.0.0.0/0"]});
    let info: Value = env.client().call("PUT", &format!("/v1/sandboxes/{id}/network"), Some(&body)).unwrap();
    assert_eq!(info["network"]["policy"]["allow_out"], json!(["198.18.2.0/24"]), "{info}");
    assert_reaches(&env, &id, DENIED);
    assert_blocked(&env, &id, ALLOWED, PORT);
    let got: Value = env.client().call("GET", &format!("/v1/sandboxes/{id}"), None::<&()>).unwrap();
    assert_eq!(got["network"]["policy"], info["network"]["policy"]);

    // The CLI: no flags opens it up.
    env.cli_ok(&["network", &id]);
    assert_reaches(&env, &id, ALLOWED);

    // Bad input is refused and changes nothing.
    let c = || env.client();
    let put = |body: Value| status_of(c().request("PUT", &format!("/v1/sandboxes/{id}/network"), Some(&body)));
    assert_eq!(put(json!({"allow_out": ["10.0.0.0/33"]})), 400);
    assert_eq!(put(json!({"deny_out": ["example.test"]})), 400, "a domain in deny_out");
    assert_eq!(put(json!({"allow_out": ["2001:db8::/32"]})), 400, "IPv6 is not forwarded");
    assert_eq!(put(json!({"mode": "none"})), 400);
    assert_eq!(put(json!({"allow": ["x"]})), 400);
    assert_reaches(&env, &id, DENIED);
    let none = create(&env, json!({"image": "busybox:latest"}));
    assert_eq!(put_on(&env, &none), 409, "a sandbox without a network has no policy");
    assert_eq!(status_of(c().request("POST", &format!("/v1/sandboxes/{id}/network"), None::<&()>)), 405);

    // Create-time checks: nothing is made.
    let before: Vec<Value> = c().call("GET", "/v1/sandboxes", None::<&()>).unwrap();
    for network in [
        json!({"mode": "egress", "allow_out": ["300.1.1.1"]}),
        json!({"mode": "none", "allow_out": ["198.18.1.1"]}),
        json!({"mode": "bridge"}),
        json!({"allow_out": ["*"]}),
    ] {
        let body = json!({"image": "busybox:latest", "network": network});
        assert_eq!(status_of(c().request("POST", "/v1/sandboxes", Some(&body))), 400, "{network}");
    }
    let after: Vec<Value> = c().call("GET", "/v1/sandboxes", None::<&()>).unwrap();
    assert_eq!(before.len(), after.len());
    env.finish();
}

fn put_on(env: &TestEnv, id: &str) -> u16 {
    let body = json!({"allow_out": ["198.18.1.1"]});
    status_of(env.client().request("PUT", &format!("/v1/sandboxes/{id}/network"), Some(&body)))
}

#[test]
fn a_sandbox_port_is_reached_through_the_api_and_the_cli() {
    let world = NetWorld::new();
    let env = world.daemon(&[]);
    env.import_busybox();
    // With no network at all too: the stream is made inside its namespace.
    for network in ["none", "egress"] {
        let id = create(&env, json!({"image": "busybox:latest", "network": {"mode": network}}));
        sh(
            &env,
            &id,
            &format!("mkdir -p /www && echo port of {network} >/www/index.html && httpd -p 127.0.0.1:8000 -h /www"),
        );
        let (mut early, mut s) = env.client().port(&id, 8000).expect("a port stream");
        s.write_all(b"GET /index.html HTTP/1.0\r\n\r\n").unwrap();
        let mut reply = String::new();
        early.read_to_string(&mut reply).unwrap();
        s.read_to_string(&mut reply).unwrap();
        assert!(reply.starts_with("HTTP/1.1 200") && reply.contains(&format!("port of {network}")), "{reply}");

        let mut cli = Command::new(strata_bin())
            .env("STRATA_SOCKET", &env.socket)
            .args(["port", &id, "8000"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        cli.stdin.take().unwrap().write_all(b"GET /index.html HTTP/1.0\r\n\r\n").unwrap();
        let out = cli.wait_with_output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success() && text.contains(&format!("port of {network}")), "{text} {out:?}");
    }
    let id = create(&env, json!({"image": "busybox:latest"}));
    let closed = env.client().port(&id, 8001).map(|_| ());
    assert_eq!(status_of(closed), 409, "nothing listens on 8001");
    let no_upgrade = env.client().request("GET", &format!("/v1/sandboxes/{id}/ports/8000"), None::<&()>);
    assert_eq!(status_of(no_upgrade), 400);
    assert_eq!(status_of(env.client().port(&id, 0).map(|_| ())), 400);
    assert_eq!(status_of(env.client().port("nosuch", 80).map(|_| ())), 404);
    env.finish();
}

/// Links of the daemon's namespace that are sandbox veths.
fn veths(world: &NetWorld) -> Vec<String> {
    let mut v: Vec<String> = world.host_links().into_iter().filter(|l| l.starts_with("stv")).collect();
    v.sort();
    v
}

/// Per-sandbox chains of Strata's table.
fn sandbox_chains(world: &NetWorld) -> Vec<String> {
    let mut v: Vec<String> = world.host_chains().into_iter().filter(|c| c.starts_with('f') && c != "forward").collect();
    v.sort();
    v
}

#[test]
fn the_policy_survives_restart_fork_and_suspend_and_a_killed_daemon_leaves_no_link_or_rule() {
    let world = NetWorld::new();
    // No warm shims: every link and chain counted here is a sandbox's.
    let mut env = world.daemon(&["--warm-pool", "0"]);
    env.import_busybox();
    let (a, av) = egress(&env, &["198.18.1.1"], &["0.0.0.0/0"]);
    let (b, _) = egress(&env, &[], &[]);
    let (gone, _) = egress(&env, &[], &[]);
    assert_eq!(veths(&world).len(), 3);
    assert_eq!(sandbox_chains(&world).len(), 3);

    // kill -9 the daemon, and the shim of one sandbox with it: the next
    // start adopts the two left, with their policies, and sweeps the rest.
    let shim: Value = env.client().call("GET", &format!("/v1/sandboxes/{gone}"), None::<&()>).unwrap();
    let shim_pid = shim["shim_pid"].as_i64().unwrap_or_else(|| panic!("no pid in {shim}"));
    env.kill_daemon();
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(shim_pid as i32), nix::sys::signal::Signal::SIGKILL).unwrap();
    env.start_daemon();
    let ids: Vec<String> = env
        .client()
        .call::<Vec<Value>>("GET", "/v1/sandboxes", None::<&()>)
        .unwrap()
        .iter()
        .filter(|s| s["state"] == "running")
        .map(|s| s["id"].as_str().unwrap().to_string())
        .collect();
    assert!(ids.contains(&a) && ids.contains(&b) && !ids.contains(&gone), "{ids:?}");
    assert_eq!(veths(&world).len(), 2, "{:?}", veths(&world));
    assert_eq!(sandbox_chains(&world).len(), 2, "{:?}", sandbox_chains(&world));
    let again: Value = env.client().call("GET", &format!("/v1/sandboxes/{a}"), None::<&()>).unwrap();
    assert_eq!(again["network"], av["network"], "the address and policy kept");
    assert_reaches(&env, &a, ALLOWED);
    assert_blocked(&env, &a, DENIED, PORT);
    assert_reaches(&env, &b, DENIED);

    // A fork gets its own address and the same policy.
    let snap: Value = env.client().call("POST", &format!("/v1/sandboxes/{a}/checkpoint"), Some(&json!({}))).unwrap();
    let s = snap["id"].as_str().unwrap();
    let forks: Vec<Value> =
        env.client().call("POST", &format!("/v1/snapshots/{s}/fork"), Some(&json!({"count": 1}))).unwrap();
    let f = forks[0]["id"].as_str().unwrap();
    assert_ne!(address(&forks[0]), address(&av));
    assert_eq!(forks[0]["network"]["policy"], av["network"]["policy"], "{}", forks[0]);
    assert_reaches(&env, f, ALLOWED);
    assert_blocked(&env, f, DENIED, PORT);
    // An evaluation of that snapshot (untrusted code) has no network.
    let body = json!({"name": "net", "version": "1", "argv": ["ls", "/sys/class/net"]});
    let eval: Value = env.client().call("POST", &format!("/v1/snapshots/{s}/evaluate"), Some(&body)).unwrap();
    assert_eq!(eval["output"]["stdout"], "lo\n", "{eval}");

    // Suspend then resume: the policy again, even after a live change.
    let body = json!({"allow_out": ["198.18.2.1"], "deny_out": ["0.0.0.0/0"]});
    env.client().call::<Value>("PUT", &format!("/v1/sandboxes/{b}/network"), Some(&body)).unwrap();
    let susp: Value = env.client().call("POST", &format!("/v1/sandboxes/{b}/suspend"), None::<&()>).unwrap();
    let ss = susp["id"].as_str().unwrap_or_else(|| panic!("{susp}"));
    let r: Value = env.client().call("POST", &format!("/v1/snapshots/{ss}/resume"), Some(&json!({}))).unwrap();
    let rid = r["id"].as_str().unwrap();
    assert_eq!(r["network"]["policy"], json!({"allow_out": ["198.18.2.1/32"], "deny_out": ["0.0.0.0/0"]}), "{r}");
    assert_reaches(&env, rid, DENIED);
    assert_blocked(&env, rid, ALLOWED, PORT);

    // SIGTERM: the table and every veth go (nothing enforces a policy
    // without the daemon, so nothing is left to route).
    let st = env.stop_daemon();
    assert!(st.success());
    assert!(veths(&world).is_empty(), "{:?}", veths(&world));
    assert!(!world.host_tables().iter().any(|t| t.contains("strata")), "{:?}", world.host_tables());
    env.start_daemon();
    assert_eq!(veths(&world).len(), 3, "the three running sandboxes networked again");
    assert_reaches(&env, rid, DENIED);
    env.finish();
    assert!(veths(&world).is_empty());
}

/// The host end of the veth of the sandbox at `address` (the default range).
fn interface_of(address: Ipv4Addr) -> String {
    format!("stv{}", (u32::from(address) - u32::from(Ipv4Addr::new(10, 89, 0, 0))) / 2)
}

/// Wait until the daemon's namespace holds `n` sandbox veths.
fn settle_veths(world: &NetWorld, n: usize) -> Vec<String> {
    let t0 = std::time::Instant::now();
    loop {
        let v = veths(world);
        if v.len() == n || t0.elapsed() > Duration::from_secs(20) {
            return v;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn an_egress_create_takes_a_wired_warm_shim_and_fills_its_policy_and_a_kill_leaks_none() {
    let world = NetWorld::new();
    let mut env = world.daemon(&["--warm-pool", "2"]);
    env.import_busybox();
    // Two warm shims wired ahead of any create (and two plain ones).
    let wired = settle_veths(&world, 2);
    assert_eq!(wired.len(), 2, "{wired:?}");
    assert_eq!(sandbox_chains(&world).len(), 2, "{:?}", sandbox_chains(&world));
    // Each on the fast path: GRO on (else the veth has no NAPI to thread)
    // and its NAPI in a kernel thread.
    for l in &wired {
        assert_eq!(world.host_link_attr(l, "threaded"), "1", "{l}");
    }

    // The create takes one of them, and its policy is what holds there.
    let (id, v) = egress(&env, &["198.18.1.1"], &["0.0.0.0/0"]);
    let took = interface_of(address(&v));
    assert!(wired.contains(&took), "{took} is not one of the wired {wired:?}");
    assert_reaches(&env, &id, ALLOWED);
    assert_blocked(&env, &id, DENIED, PORT);
    assert_blocked(&env, &id, METADATA, PORT);
    // The empty policy of a second one, once the pool is full again:
    // everything but the always-denied.
    let wired = settle_veths(&world, 3);
    let (open, v) = egress(&env, &[], &[]);
    assert!(wired.contains(&interface_of(address(&v))), "{wired:?}: {v}");
    assert_reaches(&env, &open, DENIED);
    assert_blocked(&env, &open, METADATA, PORT);
    // A `none` create never takes (nor throws away) a wired shim.
    let before = settle_veths(&world, 4);
    let none: Value = env.client().call("POST", "/v1/sandboxes", Some(&json!({"image": "busybox:latest"}))).unwrap();
    let links = sh(&env, none["id"].as_str().unwrap(), "ls /sys/class/net");
    assert_eq!(stdout(&links), "lo\n", "{links}");
    let after = veths(&world);
    assert!(before.iter().all(|l| after.contains(l)), "a wired shim went: {before:?} -> {after:?}");

    // A kill -9 then a start leaves the two sandboxes' veths and two new
    // wired ones, nothing of the dead daemon's pool.
    env.kill_daemon();
    env.start_daemon();
    let after = settle_veths(&world, 4);
    assert_eq!(after.len(), 4, "{after:?}");
    assert_eq!(sandbox_chains(&world).len(), 4, "{:?}", sandbox_chains(&world));
    assert_reaches(&env, &id, ALLOWED);
    assert_blocked(&env, &id, DENIED, PORT);
    let st = env.stop_daemon();
    assert!(st.success());
    assert!(veths(&world).is_empty(), "a stop tears the wired warm shims down: {:?}", veths(&world));
    env.start_daemon();
    env.finish();
    assert!(veths(&world).is_empty());
}

/// A user namespace on the host (the VM lane's store is a tmpfs, which
/// 6.1 cannot idmap, so this one runs here only).
#[test]
fn egress_works_in_a_user_namespace() {
    let world = NetWorld::new();
    let env = world.daemon(&[]);
    env.import_busybox();
    let body = json!({"image": "busybox:latest", "userns": true,
        "network": {"allow_out": ["198.18.1.1"], "deny_out": ["0.0.0.0/0"]}});
    let v: Value = env.client().call("POST", "/v1/sandboxes", Some(&body)).unwrap();
    let id = v["id"].as_str().unwrap();
    assert_eq!(v["network"]["mode"], "egress", "a policy alone means egress: {v}");
    assert!(v["userns"].is_object(), "{v}");
    assert_reaches(&env, id, ALLOWED);
    assert_blocked(&env, id, DENIED, PORT);
    assert_blocked(&env, id, METADATA, PORT);
    env.finish();
}

#[test]
fn an_operator_can_open_the_always_denied_and_a_daemon_without_networking_refuses_egress() {
    let world = NetWorld::new();
    // The operator opens the metadata address: policies decide again.
    let env = world.daemon(&["--network-permit", "169.254.169.254/32"]);
    env.import_busybox();
    let (closed, _) = egress(&env, &["198.18.1.1"], &["0.0.0.0/0"]);
    assert_reaches(&env, &closed, ALLOWED);
    assert_blocked(&env, &closed, METADATA, PORT);
    let (open, _) = egress(&env, &[], &[]);
    assert_reaches(&env, &open, METADATA);
    assert_blocked(&env, &open, HOST, HOST_SERVICE_PORT);
    env.finish();

    let off = TestEnv::start_with(&["--network", "off"]);
    off.import_busybox();
    let body = json!({"image": "busybox:latest", "network": {"mode": "egress"}});
    let r = off.client().request("POST", "/v1/sandboxes", Some(&body));
    assert_eq!(status_of(r), 400);
    let list: Vec<Value> = off.client().call("GET", "/v1/sandboxes", None::<&()>).unwrap();
    assert!(list.is_empty());
    let ok = create(&off, json!({"image": "busybox:latest", "network": {"mode": "none"}}));
    assert_eq!(stdout(&sh(&off, &ok, "ls /sys/class/net")).trim(), "lo");
    off.finish();
}

#[test]
fn the_e2b_sdk_gets_its_network_options_and_port_urls() {
    let python = e2b_python();
    let world = NetWorld::new();
    let dir = tempfile::Builder::new().prefix("strata-test-e2bnet-").tempdir().unwrap();
    let keys = dir.path().join("keys");
    std::fs::write(&keys, "key-one\n").unwrap();
    // The world's host namespace is the test's own: any port is free.
    let addr = "127.0.0.1:40080";
    let env =
        world.daemon(&["--e2b-listen", addr, "--e2b-api-keys", keys.to_str().unwrap(), "--e2b-domain", "strata.test"]);
    let image = image("e2b");
    env.cli_ok(&["image", "import", image.to_str().unwrap(), "--name", "base"]);
    let url = format!("http://{addr}");
    let mut python_in_world = Command::new("nsenter");
    python_in_world.arg(format!("--net={}", world.host.display())).arg(&python);
    let out = e2b_script(python_in_world, "sdk_network_test.py", &url)
        .env("STRATA_BUSYBOX", "/bin/busybox")
        .output()
        .expect("run the SDK network script");
    assert_script_passed(&out, "ALL E2B NETWORK CHECKS PASSED", &env);
    env.finish();
}
