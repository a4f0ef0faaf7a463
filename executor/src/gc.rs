//! Retention (DESIGN.md invariant 7): `strata gc` and the daemon's periodic
//! sweep retire stale lineages (neither captured nor restored within
//! `--stale-after`) and delete superseded, retired and failed snapshots
//! past `--retention`. A snapshot goes through the same removal as `strata
//! snapshot rm`, so one still used (by a live sandbox, a launch in flight, a
//! child snapshot, or as an active lineage's head) is kept; its layer and
//! blob go only when no image or remaining snapshot lists them.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::api::ApiError;
use crate::daemon::{lock, Daemon};
use crate::error::ErrorKind;

/// What one collection did.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct GcReport {
    /// Lineages retired as stale.
    pub retired: Vec<String>,
    /// Snapshots deleted.
    pub deleted: Vec<String>,
    /// Snapshots past retention kept because something uses them, with why.
    pub kept: Vec<(String, String)>,
}

/// `30s`, `15m`, `2h`, `7d` or plain seconds.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let (num, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len()));
    let n: u64 = num.parse().map_err(|_| format!("bad duration {s:?}: use e.g. 30s, 15m, 2h, 7d"))?;
    let mult = match unit {
        "" | "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86_400,
        _ => return Err(format!("bad duration unit in {s:?}: use s, m, h or d")),
    };
    n.checked_mul(mult).map(Duration::from_secs).ok_or_else(|| format!("duration {s:?} is too long"))
}

impl Daemon {
    /// Retire stale lineages, then delete what retention allows.
    pub fn gc(&self, retention: Duration, stale_after: Duration) -> Result<GcReport, ApiError> {
        let now = crate::db::now();
        let cutoff = |d: Duration| now.saturating_sub(i64::try_from(d.as_secs()).unwrap_or(i64::MAX));
        let mut report = GcReport::default();
        // A lineage with a live sandbox is in use, however old its last append.
        let busy: std::collections::HashSet<String> =
            lock(&self.pool).live.values().filter_map(|s| s.spec.work_context.clone()).collect();
        // (Each list is taken first: the database lock must not be held
        // across the loop, whose body locks it again.)
        let stale = lock(&self.db).stale_lineages(cutoff(stale_after))?;
        for wc in stale {
            if !busy.contains(&wc) && lock(&self.db).retire_work_context(&wc)? {
                tracing::info!("gc: retired stale lineage {wc}");
                report.retired.push(wc);
            }
        }
        // Children before parents; a parent freed by a deleted child is
        // tried again on the next pass.
        let mut kept = std::collections::BTreeMap::new();
        loop {
            let mut progress = false;
            let candidates = lock(&self.db).gc_candidates(cutoff(retention))?;
            for id in candidates {
                if report.deleted.contains(&id) {
                    continue;
                }
                match self.remove_snapshot(&id) {
                    Ok(()) => {
                        tracing::info!("gc: deleted snapshot {id}");
                        kept.remove(&id);
                        report.deleted.push(id);
                        progress = true;
                    }
                    Err(e) if matches!(e.kind, ErrorKind::Conflict | ErrorKind::NotFound) => {
                        kept.insert(id, e.message);
                    }
                    Err(e) => return Err(e),
                }
            }
            if !progress {
                break;
            }
        }
        report.kept = kept.into_iter().collect();
        Ok(report)
    }

    /// Collect every `interval` on a background thread (never if zero).
    pub fn start_gc(self: &std::sync::Arc<Self>, interval: Duration, retention: Duration, stale_after: Duration) {
        if interval.is_zero() {
            return;
        }
        let d = self.clone();
        let spawned = std::thread::Builder::new().name("gc".into()).spawn(move || loop {
            std::thread::sleep(interval);
            if let Err(e) = d.gc(retention, stale_after) {
                tracing::error!("gc: {}", e.message);
            }
        });
        if let Err(e) = spawned {
            tracing::error!("start gc thread: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("30").unwrap(), Duration::from_secs(30));
        assert_eq!(parse_duration("15m").unwrap(), Duration::from_secs(900));
        assert_eq!(parse_duration("7d").unwrap(), Duration::from_secs(7 * 86_400));
        assert_eq!(parse_duration("0s").unwrap(), Duration::ZERO);
        for bad in ["", "d", "7w", "-1s", "1.5h", "99999999999999999999d"] {
            assert!(parse_duration(bad).is_err(), "{bad}");
        }
    }
}
