//! Named pauses in the daemon's multi-step work, for crash tests:
//! `STRATA_FAILPOINTS=name[,name...]` in the daemon's environment makes it
//! log `failpoint NAME reached` and stop there (sleep until killed) when it
//! gets to one. The crash tests kill the daemon at each point and check what
//! a restart finds. Unset, a point costs one load of an initialised static.

use std::sync::OnceLock;

static POINTS: OnceLock<Vec<String>> = OnceLock::new();

/// Stop here (until killed) if `name` is armed.
pub fn hit(name: &str) {
    let armed =
        POINTS.get_or_init(|| std::env::var("STRATA_FAILPOINTS").map(|v| parse(&v)).unwrap_or_default());
    if armed.iter().any(|p| p == name) {
        tracing::warn!("failpoint {name} reached");
        loop {
            std::thread::sleep(std::time::Duration::from_secs(3600));
        }
    }
}

fn parse(v: &str) -> Vec<String> {
    v.split(',').map(str::trim).filter(|s| !s.is_empty()).map(str::to_string).collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn parses_a_list() {
        assert_eq!(super::parse(" a, b,,c "), vec!["a", "b", "c"]);
        assert!(super::parse("").is_empty());
    }
}
