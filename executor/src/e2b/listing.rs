//! Listing as E2B's control API defines it: `GET /v2/sandboxes` and
//! `GET /snapshots` filter, order newest first (or `order=asc`), and page
//! by `limit` and `nextToken`.
//!
//! A page token is a cursor, not an offset: the (time, id) of the last
//! entry of the page before, and the next page holds what sorts after it.
//! Entries made or removed between two pages therefore never make another
//! one repeat or go missing: a new sandbox sorts before the cursor (it is
//! newer), a removed one is simply not there. A sandbox resumed meanwhile
//! starts a new run with a new `startedAt`, and is listed by that one.

use std::cmp::Ordering;
use std::collections::BTreeMap;

use base64::Engine;
use time::format_description::well_known::Rfc3339;
use time::OffsetDateTime;

use super::control::{ApiError, Result, MAX_PAGE};
use super::Req;

/// Where a page starts: after the entry started (or made) at `ms` with `id`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cursor {
    pub ms: i64,
    pub id: String,
}

impl Cursor {
    fn encode(&self) -> String {
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(format!("{}:{}", self.ms, self.id))
    }

    fn decode(token: &str) -> Option<Cursor> {
        let raw = base64::engine::general_purpose::URL_SAFE_NO_PAD.decode(token).ok()?;
        let (ms, id) = std::str::from_utf8(&raw).ok()?.split_once(':')?;
        Some(Cursor { ms: ms.parse().ok()?, id: id.to_string() })
    }

    fn cmp(&self, ms: i64, id: &str) -> Ordering {
        (self.ms, self.id.as_str()).cmp(&(ms, id))
    }
}

/// A page request: its order, size and start.
#[derive(Debug)]
pub struct Paging {
    pub newest_first: bool,
    pub limit: usize,
    pub after: Option<Cursor>,
}

impl Paging {
    pub fn parse(req: &Req) -> Result<Paging> {
        let newest_first = match req.query("order").as_deref() {
            None | Some("desc") => true,
            Some("asc") => false,
            Some(o) => return Err(ApiError::bad(format!("order {o:?}: asc or desc"))),
        };
        let limit = match req.query("limit") {
            None => MAX_PAGE,
            Some(l) => l
                .parse::<usize>()
                .ok()
                .filter(|l| (1..=MAX_PAGE).contains(l))
                .ok_or_else(|| ApiError::bad(format!("limit {l:?} must be between 1 and {MAX_PAGE}")))?,
        };
        let after = match req.query("nextToken") {
            None => None,
            Some(t) if t.is_empty() => None,
            Some(t) => Some(
                Cursor::decode(&t)
                    .ok_or_else(|| ApiError::bad(format!("nextToken {t:?} is not one a listing gave")))?,
            ),
        };
        Ok(Paging { newest_first, limit, after })
    }

    /// One page of `items` (each keyed by its time and id), and the token
    /// of the next if there is more.
    pub fn page<T>(&self, mut items: Vec<T>, key: impl Fn(&T) -> (i64, &str)) -> (Vec<T>, Option<String>) {
        let order = |a: (i64, &str), b: (i64, &str)| if self.newest_first { b.cmp(&a) } else { a.cmp(&b) };
        items.sort_by(|a, b| order(key(a), key(b)));
        if let Some(c) = &self.after {
            items.retain(|t| {
                let (ms, id) = key(t);
                let after = c.cmp(ms, id);
                if self.newest_first {
                    after == Ordering::Greater
                } else {
                    after == Ordering::Less
                }
            });
        }
        if items.len() <= self.limit {
            return (items, None);
        }
        items.truncate(self.limit);
        let next = items.last().map(|t| {
            let (ms, id) = key(t);
            Cursor { ms, id: id.to_string() }.encode()
        });
        (items, next)
    }
}

/// The filters of `GET /v2/sandboxes`.
#[derive(Debug, Default)]
pub struct SandboxFilter {
    pub metadata: BTreeMap<String, String>,
    /// `running`, `paused`; empty: both.
    pub states: Vec<String>,
    /// A template id or name (we keep one name per template).
    pub template: Option<String>,
    /// Started at or after (unix ms).
    pub started_after: Option<i64>,
}

impl SandboxFilter {
    pub fn parse(req: &Req) -> Result<SandboxFilter> {
        let mut metadata = BTreeMap::new();
        if let Some(m) = req.query("metadata") {
            // The SDK quotes each key and value, then form-encodes the lot.
            for (k, v) in super::form_decode(&m) {
                metadata.insert(super::percent_decode(&k), super::percent_decode(&v));
            }
        }
        let states: Vec<String> = req
            .query("state")
            .map(|s| s.split(',').map(|s| s.trim().to_string()).filter(|s| !s.is_empty()).collect())
            .unwrap_or_default();
        if let Some(bad) = states.iter().find(|s| !matches!(s.as_str(), "running" | "paused")) {
            return Err(ApiError::bad(format!("state {bad:?}: running or paused")));
        }
        let started_after = req.query("startedAfter").map(|t| parse_time(&t, "startedAfter")).transpose()?;
        Ok(SandboxFilter { metadata, states, template: req.query("template"), started_after })
    }

    /// Whether a sandbox of `template`, started at `started_ms`, with
    /// `metadata`, passes the filters that need no look at where it runs.
    pub fn keeps(&self, template: &str, started_ms: i64, metadata: &BTreeMap<String, String>) -> bool {
        self.template.as_deref().is_none_or(|t| t == template)
            && self.started_after.is_none_or(|a| started_ms >= a)
            && self.metadata.iter().all(|(k, v)| metadata.get(k) == Some(v))
    }

    pub fn keeps_state(&self, state: &str) -> bool {
        self.states.is_empty() || self.states.iter().any(|s| s == state)
    }
}

/// An RFC 3339 time (any offset) as unix ms; a 400 naming `what` otherwise.
pub fn parse_time(s: &str, what: &str) -> Result<i64> {
    let t = OffsetDateTime::parse(s, &Rfc3339)
        .map_err(|e| ApiError::bad(format!("{what} {s:?} is not an RFC 3339 time: {e}")))?;
    i64::try_from(t.unix_timestamp_nanos() / 1_000_000)
        .map_err(|_| ApiError::bad(format!("{what} {s:?} is out of range")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn paging(newest_first: bool, limit: usize, after: Option<Cursor>) -> Paging {
        Paging { newest_first, limit, after }
    }

    fn ids(v: &[(i64, String)]) -> Vec<&str> {
        v.iter().map(|(_, id)| id.as_str()).collect()
    }

    #[test]
    fn pages_neither_repeat_nor_skip_while_entries_come_and_go() {
        let mut items: Vec<(i64, String)> = (0..5).map(|i| (i * 10, format!("s{i}"))).collect();
        let p = paging(true, 2, None);
        let (first, next) = p.page(items.clone(), |t| (t.0, t.1.as_str()));
        assert_eq!(ids(&first), ["s4", "s3"]);
        // One made (newer than all) and one of the first page removed.
        items.push((100, "s9".into()));
        items.retain(|t| t.1 != "s4");
        let after = Cursor::decode(&next.unwrap());
        let (second, next) = paging(true, 2, after).page(items.clone(), |t| (t.0, t.1.as_str()));
        assert_eq!(ids(&second), ["s2", "s1"]);
        let (third, next) = paging(true, 2, Cursor::decode(&next.unwrap())).page(items, |t| (t.0, t.1.as_str()));
        assert_eq!(ids(&third), ["s0"]);
        assert!(next.is_none());
    }

    #[test]
    fn ascending_order_and_equal_times_page_by_id() {
        let items: Vec<(i64, String)> = vec![(5, "b".into()), (5, "a".into()), (1, "z".into())];
        let (first, next) = paging(false, 2, None).page(items.clone(), |t| (t.0, t.1.as_str()));
        assert_eq!(ids(&first), ["z", "a"]);
        let (rest, _) = paging(false, 2, Cursor::decode(&next.unwrap())).page(items, |t| (t.0, t.1.as_str()));
        assert_eq!(ids(&rest), ["b"]);
    }

    #[test]
    fn times_parse_with_any_offset_and_format_in_utc() {
        assert_eq!(parse_time("1970-01-01T01:00:01.5+01:00", "t").unwrap(), 1500);
        assert_eq!(parse_time("2026-12-07T00:00:00Z", "t").unwrap(), 1_796_601_600_000);
        assert!(parse_time("yesterday", "t").is_err());
        assert!(Cursor::decode("not a token!").is_none());
    }
}
