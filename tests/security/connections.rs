//! The daemon's socket under pressure: connections past the limit, idle
//! and half-sent ones, and a SIGTERM with requests in flight.

use super::*;

#[test]
fn connections_past_the_limit_get_429_until_idle_ones_close() {
    let env = TestEnv::start_with(&["--max-connections", "64"]);
    // Fill every connection slot with connections that never send anything.
    // The daemon counts a closed connection until its task has seen the
    // close, so the start-up probe may still hold a slot for a moment and
    // one of these be refused: a refused connection that sends nothing is
    // answered 429 after 1 s (serve::REFUSE_READ), so wait longer than
    // that and open replacements until 64 are held.
    // On a loaded host a refusal can come after the check below: a request
    // then finds the slot it left, and the connections are topped up again.
    let mut idle: Vec<UnixStream> = Vec::new();
    let start = Instant::now();
    loop {
        while idle.len() < 64 {
            idle.extend((idle.len()..64).map(|_| UnixStream::connect(&env.socket).unwrap()));
            std::thread::sleep(Duration::from_millis(1300));
            idle.retain_mut(|s| !refused_at_once(s));
            assert!(start.elapsed() < Duration::from_secs(20), "the daemon does not hold 64 idle connections");
        }
        // One more is answered 429 once it has sent its request (a client
        // reading an answer before it has asked drops it) and closed.
        let t = Instant::now();
        match env.client().request("GET", "/v1/version", None::<&()>) {
            Err(strata::client::ClientError::Api { status: 429, message, .. }) => {
                assert!(message.contains("64"), "{message}");
                assert!(t.elapsed() < Duration::from_millis(750), "the 429 took {:?}", t.elapsed());
                // A body larger than the socket's buffer is read too (not
                // cut by the close): its sender gets the 429 as well.
                let big = json!({"image": "busybox", "hostname": "x".repeat(900 << 10)});
                match env.client().request("POST", "/v1/sandboxes", Some(&big)) {
                    Err(strata::client::ClientError::Api { status: 429, .. }) => break,
                    // A late refusal left a slot free: served, not refused.
                    _ if idle.iter_mut().any(refused_at_once) => idle.retain_mut(|s| !refused_at_once(s)),
                    other => panic!("expected 429 for a large body, got {other:?}"),
                }
            }
            Ok(_) if idle.iter_mut().any(refused_at_once) => idle.retain_mut(|s| !refused_at_once(s)),
            other => panic!("expected 429, got {other:?}"),
        }
    }
    // Slots come back when the idle ones go.
    drop(idle);
    let start = Instant::now();
    loop {
        match env.client().request("GET", "/v1/version", None::<&()>) {
            Ok(_) => break,
            Err(e) => assert!(start.elapsed().as_secs() < 10, "the daemon did not recover: {e}"),
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    env.finish();
}

/// Threads of a running process.
fn threads(pid: u32) -> usize {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status.lines().find_map(|l| l.strip_prefix("Threads:")).unwrap().trim().parse().unwrap()
}

/// Whether the daemon has answered `s`, which sent nothing (a refusal),
/// without waiting.
fn refused_at_once(s: &mut UnixStream) -> bool {
    s.set_nonblocking(true).unwrap();
    let mut buf = [0u8; 1];
    let answered = !matches!(s.read(&mut buf), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock);
    s.set_nonblocking(false).unwrap();
    answered
}

/// Whether the daemon has closed `s` (EOF or reset), without waiting.
fn closed_by_daemon(s: &mut UnixStream) -> bool {
    s.set_nonblocking(true).unwrap();
    let mut buf = [0u8; 512];
    match s.read(&mut buf) {
        Ok(0) => true,
        Ok(_) => closed_by_daemon(s),
        Err(e) => e.kind() != std::io::ErrorKind::WouldBlock,
    }
}

#[test]
fn idle_and_half_sent_connections_cannot_starve_the_daemon() {
    let env = TestEnv::start_with(&["--header-timeout", "6s", "--idle-timeout", "12s", "--body-timeout", "2s"]);
    env.import_busybox();
    let daemon = env.daemon.as_ref().unwrap().id();
    let opened = Instant::now();
    let mut idle: Vec<UnixStream> = (0..2000).map(|_| UnixStream::connect(&env.socket).unwrap()).collect();
    let mut half: Vec<UnixStream> = (0..200)
        .map(|_| {
            let mut s = UnixStream::connect(&env.socket).unwrap();
            s.write_all(b"GET /v1/version HTTP/1.1\r\nHost: strata\r\nX-Slow: ").unwrap();
            s
        })
        .collect();
    // A kept-alive client that has had its answer.
    let mut kept = env.client();
    kept.request("GET", "/v1/version", None::<&()>).unwrap();

    // A new client is served at once (starved, it would wait for the 6 s
    // header timeout to free a place), and real work goes through.
    let t = Instant::now();
    env.client().request("GET", "/v1/version", None::<&()>).unwrap();
    let took = t.elapsed();
    assert!(took < Duration::from_secs(1), "GET /v1/version took {took:?} with 2200 connections open");
    let id = create(&env, json!({"image": "busybox"}));
    assert_eq!(stdout(&sh(&env, &id, "echo ok")), "ok\n");
    env.cli_ok(&["rm", &id]);
    let n = threads(daemon);
    assert!(n < 64, "the daemon runs {n} threads with 2200 connections open");
    assert!(
        opened.elapsed() < Duration::from_secs(6),
        "the checks took {:?}: past the header timeout, so they did not run against open connections",
        opened.elapsed()
    );

    // A body sent at 1 byte/s is cut by the body timeout: 408, then closed.
    let mut slow = UnixStream::connect(&env.socket).unwrap();
    slow.write_all(b"POST /v1/sandboxes HTTP/1.1\r\nHost: strata\r\nContent-Length: 100\r\n\r\n{").unwrap();
    let mut trickle = slow.try_clone().unwrap();
    let writer = std::thread::spawn(move || {
        for _ in 0..20 {
            std::thread::sleep(Duration::from_secs(1));
            if trickle.write_all(b" ").is_err() {
                return;
            }
        }
    });
    slow.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let t = Instant::now();
    let mut answer = Vec::new();
    let _ = slow.read_to_end(&mut answer);
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("request_timeout"), "{answer}");
    assert!(t.elapsed() < Duration::from_secs(5), "the slow body was cut after {:?}", t.elapsed());
    writer.join().unwrap();

    // Past the header timeout: the idle and the half-sent connections are
    // closed; the kept-alive one is not (its limit is the idle timeout).
    std::thread::sleep(Duration::from_secs(7).saturating_sub(opened.elapsed()));
    let open_idle = idle.iter_mut().map(closed_by_daemon).filter(|closed| !closed).count();
    let open_half = half.iter_mut().map(closed_by_daemon).filter(|closed| !closed).count();
    assert_eq!((open_idle, open_half), (0, 0), "connections still open past the header timeout");
    kept.request("GET", "/v1/version", None::<&()>).expect("a kept-alive connection closed before its idle timeout");
    // Past the idle timeout it is closed too.
    std::thread::sleep(Duration::from_secs(13));
    assert!(kept.request("GET", "/v1/version", None::<&()>).is_err(), "an idle connection outlived the idle timeout");
    env.finish();
}

#[test]
fn sigterm_lets_requests_in_flight_finish() {
    let mut env = TestEnv::start();
    env.import_busybox();
    let id = create(&env, json!({"image": "busybox"}));
    let socket = env.socket.clone();
    let sid = id.clone();
    let slow = std::thread::spawn(move || {
        let mut c = strata::client::Client::connect(&socket).unwrap();
        c.call::<Value>(
            "POST",
            &format!("/v1/sandboxes/{sid}/exec"),
            Some(&json!({"argv": ["sh", "-c", "sleep 2; echo done"]})),
        )
    });
    // The request is in flight: its command runs.
    strata_tests::wait_until("the slow command to start", Duration::from_secs(10), || {
        stdout(&sh(&env, &id, "ps -o comm | grep -c '^sleep'")).trim() == "1"
    });
    let idle = UnixStream::connect(&env.socket).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    let status = env.stop_daemon();
    assert!(status.success(), "{status}");
    let r = slow.join().unwrap().expect("the request in flight was cut by SIGTERM");
    assert_eq!(r["stdout"], "done\n");
    drop(idle);
    env.start_daemon();
    env.finish();
}
