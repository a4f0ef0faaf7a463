//! `strata-bench`: API-level timings against a running daemon, one kept-alive
//! connection, no CLI start-up in the loop. Driven by `scripts/bench.sh`,
//! which also times runc, crun and bubblewrap in the same run.
//!
//! usage: strata-bench SOCKET IMAGE RUNS BUSYBOX_PATH [PREFIX]
//!        strata-bench --open-loop SOCKET IMAGE RATE COUNT PREFIX
//!        strata-bench --cpu SOCKET IMAGE COUNT
//!        strata-bench --cpu-spawn COUNT ARGV...
//!        strata-bench --ab SOCKET_A SOCKET_B IMAGE COUNT [cycle]
//!        strata-bench --net SOCKET IMAGE RUNS
//! Prints one line per measurement: `name median_ms p90_ms min_ms` (names
//! after PREFIX); the open loop, `PREFIXopen_create_exec_rm p50 p90 p99`:
//! COUNT create -> exec `true` -> rm, started RATE a second whatever the
//! answers (each on its own connection and thread), timed from when each
//! was due to start. `--cpu` and `--cpu-spawn` print the CPU time one
//! create -> exec `true` -> rm (one connection), or one run of ARGV
//! (spawned and waited for), costs the whole machine, in ms: busy time
//! from /proc/stat (every process and kernel thread: the daemon, the
//! shims, kworkers cleaning up namespaces) minus this process's own. Back
//! to back on a small host a start's wall time is bounded by this, not by
//! its latency on an idle machine. `--ab` times warm execs of `true` on
//! two daemons (two builds) side by side, one client alternating between
//! them, so that the machine's drift from one minute to the next hits both
//! alike: per daemon, `A|B p50_ms mean_ms daemon_cpu_us shim_cpu_us` (CPU
//! per exec of the daemon, and of the sandbox's shim with its commands).
//! With `cycle`, each is a create -> exec `true` -> rm instead, followed by
//! an untimed 10 ms pause so that its teardown (after the answer) is done
//! before the other daemon's cycle; the daemon's CPU then includes the
//! shims it reaped, and the shim column means nothing. `--net` times
//! create -> exec `true` -> rm with `network: none` and with `egress`,
//! alternating (scripts/bench-network.sh runs it in a namespace world).

use std::time::Instant;

use serde_json::{json, Value};
use strata::client::Client;

fn stats(name: &str, mut v: Vec<f64>) {
    v.sort_by(|a, b| a.total_cmp(b));
    let pct = |p: f64| v[((v.len() - 1) as f64 * p).round() as usize];
    println!("{name} {:.3} {:.3} {:.3}", pct(0.5), pct(0.9), v[0]);
}

/// One create -> exec `true` -> rm.
fn cycle(c: &mut Client, image: &str) {
    cycle_with(c, json!({"image": image, "wait": 60}));
}

/// One create (of `body`) -> exec `true` -> rm; the create's and the
/// whole cycle's ms.
fn cycle_with(c: &mut Client, body: Value) -> (f64, f64) {
    let t0 = Instant::now();
    let v: Value = c.call("POST", "/v1/sandboxes", Some(&body)).unwrap();
    let created = ms(t0);
    let id = v["id"].as_str().unwrap().to_string();
    let r: Value = c.call("POST", &format!("/v1/sandboxes/{id}/exec"), Some(&json!({"argv": ["true"]}))).unwrap();
    assert_eq!(r["exit_code"], 0);
    c.request("DELETE", &format!("/v1/sandboxes/{id}"), None::<&()>).unwrap();
    (created, ms(t0))
}

/// `--net`: RUNS cycles each without and with a network, in turn.
fn net(args: &[String]) {
    let mut c = Client::connect(args[2].as_ref()).expect("connect");
    let runs: usize = args[4].parse().expect("RUNS");
    let body = |mode: &str| json!({"image": args[3], "network": {"mode": mode}});
    for _ in 0..3 {
        cycle_with(&mut c, body("none"));
        cycle_with(&mut c, body("egress"));
    }
    let (mut none, mut egress) = ((vec![], vec![]), (vec![], vec![]));
    for _ in 0..runs {
        for (mode, out) in [("none", &mut none), ("egress", &mut egress)] {
            let (created, total) = cycle_with(&mut c, body(mode));
            out.0.push(created);
            out.1.push(total);
        }
    }
    stats("net_none_create", none.0);
    stats("net_egress_create", egress.0);
    stats("net_none_create_exec_rm", none.1);
    stats("net_egress_create_exec_rm", egress.1);
}

/// `--open-loop`: COUNT cycles started RATE a second.
fn open_loop(args: &[String]) {
    let (socket, image, prefix) = (args[2].clone(), args[3].clone(), &args[6]);
    let rate: f64 = args[4].parse().expect("RATE");
    let count: usize = args[5].parse().expect("COUNT");
    for _ in 0..3 {
        cycle(&mut Client::connect(socket.as_ref()).expect("connect"), &image);
    }
    let t0 = Instant::now();
    let threads: Vec<_> = (0..count)
        .map(|i| {
            let due = std::time::Duration::from_secs_f64(i as f64 / rate);
            if let Some(left) = due.checked_sub(t0.elapsed()) {
                std::thread::sleep(left);
            }
            let (socket, image) = (socket.clone(), image.clone());
            std::thread::spawn(move || {
                cycle(&mut Client::connect(socket.as_ref()).expect("connect"), &image);
                (t0.elapsed() - due).as_secs_f64() * 1000.0
            })
        })
        .collect();
    let mut v: Vec<f64> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    v.sort_by(|a, b| a.total_cmp(b));
    let pct = |p: f64| v[((v.len() - 1) as f64 * p).round() as usize];
    println!("{prefix}open_create_exec_rm {:.3} {:.3} {:.3}", pct(0.5), pct(0.9), pct(0.99));
}

/// The machine's busy CPU seconds (/proc/stat: user, nice, system, irq
/// and softirq over all CPUs) minus this process's own.
fn machine_cpu_but_ours() -> f64 {
    use nix::sys::resource::{getrusage, UsageWho};
    use procfs::{CurrentSI, KernelStats};
    let t = KernelStats::current().expect("read /proc/stat").total;
    let busy = t.user + t.nice + t.system + t.irq.unwrap_or(0) + t.softirq.unwrap_or(0);
    let own = getrusage(UsageWho::RUSAGE_SELF).expect("getrusage");
    let secs = |tv: nix::sys::time::TimeVal| tv.tv_sec() as f64 + tv.tv_usec() as f64 / 1e6;
    busy as f64 / procfs::ticks_per_second() as f64 - secs(own.user_time()) - secs(own.system_time())
}

/// `--cpu` and `--cpu-spawn`: `run` COUNT times after a warm-up; prints the
/// machine's CPU per run in ms.
fn cpu_per_run(count: usize, mut run: impl FnMut()) {
    for _ in 0..count.min(10) {
        run();
    }
    let before = machine_cpu_but_ours();
    for _ in 0..count {
        run();
    }
    println!("{:.3}", (machine_cpu_but_ours() - before) / count as f64 * 1000.0);
}

/// A process's CPU time so far with its reaped children's, in µs.
fn cpu_us(pid: i32) -> f64 {
    let st = procfs::process::Process::new(pid).and_then(|p| p.stat()).expect("read /proc/PID/stat");
    let ticks = st.utime + st.stime + (st.cutime + st.cstime) as u64;
    ticks as f64 * 1e6 / procfs::ticks_per_second() as f64
}

/// The pid of the process whose command line has every one of `words`.
fn pid_with(words: &[&str]) -> i32 {
    let all = procfs::process::all_processes().expect("list /proc");
    all.flatten()
        .find(|p| p.cmdline().is_ok_and(|c| words.iter().all(|w| c.iter().any(|a| a == w))))
        .map(|p| p.pid)
        .unwrap_or_else(|| panic!("no process with {words:?}"))
}

/// `--ab`: COUNT warm execs (or, with `cycle`, creates -> exec -> rm) on
/// each of two daemons, alternating.
fn ab(args: &[String]) {
    let (image, count): (&str, usize) = (&args[4], args[5].parse().expect("COUNT"));
    let cycles = match args.get(6).map(String::as_str) {
        None => false,
        Some("cycle") => true,
        Some(other) => panic!("--ab: unknown mode {other:?} (the one mode is `cycle`)"),
    };
    let exec_true = json!({"argv": ["true"]});
    struct Side {
        c: Client,
        path: String,
        daemon: i32,
        shim: i32,
        times: Vec<f64>,
        cpu: (f64, f64),
    }
    let mut sides: Vec<Side> = args[2..4]
        .iter()
        .map(|socket| {
            let mut c = Client::connect(socket.as_ref()).expect("connect");
            let v: Value = c.call("POST", "/v1/sandboxes", Some(&json!({"image": image}))).unwrap();
            let id = v["id"].as_str().unwrap().to_string();
            let (daemon, shim) = (pid_with(&["daemon", socket]), pid_with(&["strata-shim", &id]));
            Side { c, path: format!("/v1/sandboxes/{id}"), daemon, shim, times: vec![], cpu: (0.0, 0.0) }
        })
        .collect();
    let one = |s: &mut Side| {
        if cycles {
            let t = Instant::now();
            cycle(&mut s.c, image);
            let took = ms(t);
            std::thread::sleep(std::time::Duration::from_millis(10));
            return took;
        }
        let t = Instant::now();
        let r: Value = s.c.call("POST", &format!("{}/exec", s.path), Some(&exec_true)).unwrap();
        assert_eq!(r["exit_code"], 0);
        ms(t)
    };
    for _ in 0..200 {
        sides.iter_mut().for_each(|s| {
            one(s);
        });
    }
    sides.iter_mut().for_each(|s| s.cpu = (cpu_us(s.daemon), cpu_us(s.shim)));
    for i in 0..count {
        // Each goes first half of the time.
        for k in [i % 2, 1 - i % 2] {
            let t = one(&mut sides[k]);
            sides[k].times.push(t);
        }
    }
    for (s, name) in sides.iter_mut().zip(["A", "B"]) {
        let (daemon, shim) = ((cpu_us(s.daemon) - s.cpu.0) / count as f64, (cpu_us(s.shim) - s.cpu.1) / count as f64);
        s.times.sort_by(|a, b| a.total_cmp(b));
        let mean = s.times.iter().sum::<f64>() / count as f64;
        println!("{name} {:.3} {mean:.3} {daemon:.0} {shim:.0}", s.times[count / 2]);
        s.c.request("DELETE", &s.path, None::<&()>).unwrap();
    }
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1000.0
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() == 7 && args[1] == "--open-loop" {
        return open_loop(&args);
    }
    if args.len() == 5 && args[1] == "--net" {
        return net(&args);
    }
    if (6..=7).contains(&args.len()) && args[1] == "--ab" {
        return ab(&args);
    }
    if args.len() == 5 && args[1] == "--cpu" {
        let mut c = Client::connect(args[2].as_ref()).expect("connect");
        return cpu_per_run(args[4].parse().expect("COUNT"), || cycle(&mut c, &args[3]));
    }
    if args.len() > 3 && args[1] == "--cpu-spawn" {
        return cpu_per_run(args[2].parse().expect("COUNT"), || {
            let st = std::process::Command::new(&args[3]).args(&args[4..]).status().expect("spawn");
            assert!(st.success(), "{}: {st}", args[3]);
        });
    }
    if !(5..=6).contains(&args.len()) {
        eprintln!("usage: strata-bench SOCKET IMAGE RUNS BUSYBOX_PATH [PREFIX]");
        eprintln!("       strata-bench --open-loop SOCKET IMAGE RATE COUNT PREFIX");
        eprintln!("       strata-bench --cpu SOCKET IMAGE COUNT");
        eprintln!("       strata-bench --cpu-spawn COUNT ARGV...");
        eprintln!("       strata-bench --ab SOCKET_A SOCKET_B IMAGE COUNT [cycle]");
        eprintln!("       strata-bench --net SOCKET IMAGE RUNS");
        std::process::exit(2);
    }
    let (socket, image, busybox) = (&args[1], &args[2], &args[4]);
    let prefix = args.get(5).cloned().unwrap_or_default();
    let stats = |name: &str, v: Vec<f64>| stats(&format!("{prefix}{name}"), v);
    let runs: usize = args[3].parse().expect("RUNS");
    let mut c = Client::connect(socket.as_ref()).expect("connect");
    let exec_true = json!({"argv": ["true"]});

    // Warm-up: page cache, first cgroup creation.
    for _ in 0..3 {
        let v: Value = c.call("POST", "/v1/sandboxes", Some(&json!({"image": image}))).unwrap();
        let id = v["id"].as_str().unwrap().to_string();
        c.request("DELETE", &format!("/v1/sandboxes/{id}"), None::<&()>).unwrap();
    }

    let (mut total, mut create, mut exec, mut rm) = (vec![], vec![], vec![], vec![]);
    for _ in 0..runs {
        let t0 = Instant::now();
        let v: Value = c.call("POST", "/v1/sandboxes", Some(&json!({"image": image}))).unwrap();
        let id = v["id"].as_str().unwrap().to_string();
        create.push(ms(t0));
        let t1 = Instant::now();
        let r: Value = c.call("POST", &format!("/v1/sandboxes/{id}/exec"), Some(&exec_true)).unwrap();
        assert_eq!(r["exit_code"], 0);
        exec.push(ms(t1));
        let t2 = Instant::now();
        c.request("DELETE", &format!("/v1/sandboxes/{id}"), None::<&()>).unwrap();
        rm.push(ms(t2));
        total.push(ms(t0));
    }
    stats("api_create_exec_rm", total);
    stats("api_create", create);
    stats("api_exec_first", exec);
    stats("api_rm", rm);

    // Warm exec in one running sandbox, and the floor: fork+exec of busybox
    // true on the host, waited for. Taken in turn, ten of each at a time,
    // so that both see the machine at the same speed (this VM's drifts
    // within minutes: 0.6 to 0.9 ms for the same warm exec) and each still
    // runs after its own kind, as it would in a loop of its own (a floor
    // taken right after each exec measured the exec's trailing work too:
    // the exec log written on the other vCPU). Each block starts after a
    // 20 ms pause, and its first sample is not counted.
    let v: Value = c.call("POST", "/v1/sandboxes", Some(&json!({"image": image}))).unwrap();
    let id = v["id"].as_str().unwrap().to_string();
    let (mut warm, mut floor) = (vec![], vec![]);
    let block = 10;
    for round in 0..=runs.max(100).div_ceil(block) {
        std::thread::sleep(std::time::Duration::from_millis(20));
        for i in 0..block + 1 {
            let t = Instant::now();
            let r: Value = c.call("POST", &format!("/v1/sandboxes/{id}/exec"), Some(&exec_true)).unwrap();
            assert_eq!(r["exit_code"], 0);
            // The first of each block warms up (and, after the first
            // round, follows a floor).
            if i > 0 && round > 0 {
                warm.push(ms(t));
            }
        }
        // Past the exec log writer's linger (5 ms), so that no record of
        // the execs is written during the floor.
        std::thread::sleep(std::time::Duration::from_millis(20));
        for i in 0..block + 1 {
            let t = Instant::now();
            let st = std::process::Command::new(busybox).arg("true").status().unwrap();
            assert!(st.success());
            if i > 0 && round > 0 {
                floor.push(ms(t));
            }
        }
    }
    c.request("DELETE", &format!("/v1/sandboxes/{id}"), None::<&()>).unwrap();
    stats("api_warm_exec", warm);
    stats("host_fork_exec", floor);

    // Where the time goes: an API round trip that does nothing (the HTTP
    // request, parsing, the blocking pool and back).
    let mut trip = vec![];
    for i in 0..runs.max(100) + 5 {
        let t = Instant::now();
        let _: Value = c.call("GET", "/v1/version", None::<&()>).unwrap();
        if i >= 5 {
            trip.push(ms(t));
        }
    }
    stats("api_round_trip", trip);
}
