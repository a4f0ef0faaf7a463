//! Unit tests of `exec`.

use super::*;

/// A pump over fresh pipes: (the pump, stdout's, stderr's and the
/// status pipe's write ends).
fn pump() -> (Pump, std::fs::File, std::fs::File, std::fs::File) {
    let (out_r, out_w) = pipe().unwrap();
    let (err_r, err_w) = pipe().unwrap();
    let (st_r, st_w) = pipe().unwrap();
    let outputs = vec![(out_r, FrameKind::Stdout), (err_r, FrameKind::Stderr)];
    let p = Pump::new(7, Events::Status(std::fs::File::from(st_r)), outputs, None);
    (p, out_w.into(), err_w.into(), st_w.into())
}

fn exited(code: i32) -> Vec<u8> {
    serde_json::to_vec(&ShimEvent::Exited { id: 7, status: ExitStatus::Code(code) }).unwrap()
}

#[test]
fn a_pump_run_until_a_time_gives_back_and_goes_on_where_it_was() {
    let id: SandboxId = "0123456789abcdef".parse().unwrap();
    let (mut p, mut out, err, mut status) = pump();
    let mut got = Vec::new();
    out.write_all(b"early ").unwrap();
    let t = Instant::now();
    let r = p.run(&id, &|| panic!("no kill"), Some(t + Duration::from_millis(30)), &mut |_, d| {
        got.extend_from_slice(d);
        true
    });
    assert!(matches!(r, Ok(None)), "still running at the time given");
    assert!(t.elapsed() >= Duration::from_millis(30) && t.elapsed() < Duration::from_millis(500));
    assert_eq!(got, b"early ");
    out.write_all(b"late").unwrap();
    drop((out, err));
    status.write_all(&exited(3)).unwrap();
    let fin = p.run(&id, &|| panic!("no kill"), None, &mut |_, d| {
        got.extend_from_slice(d);
        true
    });
    assert_eq!(fin.unwrap().map(|f| f.status), Some(ExitStatus::Code(3)));
    assert_eq!(got, b"early late");
}

#[test]
fn after_the_exit_a_pipe_held_open_ends_the_wait_after_a_quiet_pause_not_before_until() {
    let id: SandboxId = "0123456789abcdef".parse().unwrap();
    let (mut p, _out, _err, mut status) = pump();
    status.write_all(&exited(0)).unwrap();
    // A time before the quiet pause is over: given back, not finished.
    let t = Instant::now();
    let r = p.run(&id, &|| {}, Some(t + Duration::from_millis(5)), &mut |_, _| true);
    assert!(matches!(r, Ok(None)), "finished before the quiet pause was over");
    // Without one: finished once nothing came for QUIET.
    let fin = p.run(&id, &|| {}, None, &mut |_, _| true).unwrap();
    assert_eq!(fin.map(|f| f.status), Some(ExitStatus::Code(0)));
    assert!(t.elapsed() >= QUIET, "ended {:?} after the exit", t.elapsed());
}
