//! Named pauses in the daemon's multi-step work, for crash and race tests:
//! `STRATA_FAILPOINTS=name[,name...]` in the daemon's environment makes it
//! log `failpoint NAME reached` and stop there (sleep until killed) when it
//! gets to one; `name=sleep-once:MS` makes only the first arrival wait MS
//! milliseconds and go on; `name=stop-after:N` passes N times and stops at
//! the next arrival (a crash in a second checkpoint, say); `name=fail`
//! makes [`fails`] answer true there (the step fails as it would on its
//! own), `name=fail-once` only at the first arrival (a retry then works). Unset, a point costs one load
//! of an initialised static.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

enum Action {
    Stop,
    /// Passes while the count is above zero (counting it down), then stops.
    StopAfter(AtomicU64),
    SleepOnce(Duration, AtomicBool),
    Fail,
    /// Fails the first time (the flag says it has).
    FailOnce(AtomicBool),
}

static POINTS: OnceLock<Vec<(String, Action)>> = OnceLock::new();

fn armed() -> &'static [(String, Action)] {
    POINTS.get_or_init(|| std::env::var("STRATA_FAILPOINTS").map(|v| parse(&v)).unwrap_or_default())
}

/// Whether the step at `name` is to fail (armed as `name=fail`).
pub fn fails(name: &str) -> bool {
    let fail = armed().iter().any(|(point, action)| {
        point == name
            && match action {
                Action::Fail => true,
                Action::FailOnce(done) => !done.swap(true, Ordering::AcqRel),
                _ => false,
            }
    });
    if fail {
        tracing::warn!("failpoint {name} failing");
    }
    fail
}

/// Stop or wait here if `name` is armed.
pub fn hit(name: &str) {
    for (point, action) in armed() {
        if point != name {
            continue;
        }
        tracing::warn!("failpoint {name} reached");
        match action {
            Action::Stop => stop(),
            Action::StopAfter(left) => {
                if left.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1)).is_err() {
                    stop()
                }
            }
            Action::SleepOnce(d, done) => {
                if !done.swap(true, Ordering::AcqRel) {
                    std::thread::sleep(*d);
                }
            }
            Action::Fail | Action::FailOnce(_) => {}
        }
    }
}

/// Sleep until the daemon is killed.
fn stop() -> ! {
    loop {
        std::thread::sleep(Duration::from_secs(3600));
    }
}

fn parse(v: &str) -> Vec<(String, Action)> {
    v.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| {
            if let Some((name, ms)) = s.split_once("=sleep-once:") {
                let ms = ms.parse().unwrap_or(0);
                (name.to_string(), Action::SleepOnce(Duration::from_millis(ms), AtomicBool::new(false)))
            } else if let Some((name, n)) = s.split_once("=stop-after:") {
                (name.to_string(), Action::StopAfter(AtomicU64::new(n.parse().unwrap_or(0))))
            } else if let Some(name) = s.strip_suffix("=fail-once") {
                (name.to_string(), Action::FailOnce(AtomicBool::new(false)))
            } else if let Some(name) = s.strip_suffix("=fail") {
                (name.to_string(), Action::Fail)
            } else {
                (s.to_string(), Action::Stop)
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_a_list() {
        let p = parse(" a, b=sleep-once:250,,c,d=stop-after:1,e=fail,f=fail-once ");
        let names: Vec<&str> = p.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["a", "b", "c", "d", "e", "f"]);
        assert!(matches!(&p[5].1, Action::FailOnce(done) if !done.load(Ordering::Relaxed)));
        assert!(matches!(&p[3].1, Action::StopAfter(n) if n.load(Ordering::Relaxed) == 1));
        assert!(matches!(p[4].1, Action::Fail));
        assert!(matches!(p[1].1, Action::SleepOnce(d, _) if d == Duration::from_millis(250)));
        assert!(matches!(p[0].1, Action::Stop));
        assert!(parse("").is_empty());
    }
}
