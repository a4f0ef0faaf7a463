//! The daemon's Prometheus metrics, served in the OpenMetrics text format
//! (which Prometheus reads) at `GET /metrics` on the API socket, kept with
//! the prometheus-client crate. Counters and histograms are updated where the
//! work is done (the API's and the E2B listener's routing, execs, captures);
//! the gauges (sandboxes by state, the store's use) are read when scraped.

use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::{Metric, Registry};

use super::{lock, Daemon};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Operation {
    /// The API's name of it (`create_sandbox`, `checkpoint`, ...).
    pub operation: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Outcome {
    pub operation: &'static str,
    pub status: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct E2bRoute {
    /// The route's pattern (`POST /sandboxes/{id}/pause`), not its path.
    pub route: &'static str,
    pub status: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct State {
    state: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Kind {
    kind: &'static str,
}

/// 0.5 ms to about 16 s, doubling.
fn latency() -> Histogram {
    Histogram::new(exponential_buckets(0.0005, 2.0, 16))
}

pub struct Telemetry {
    registry: Registry,
    requests: Family<Outcome, Counter>,
    seconds: Family<Operation, Histogram, fn() -> Histogram>,
    execs: Histogram,
    capture_bytes: Counter,
    e2b: Family<E2bRoute, Counter>,
    sandboxes: Family<State, Gauge>,
    store_bytes: Family<Kind, Gauge>,
    images: Gauge,
    snapshots: Gauge,
}

/// `metric`, registered in `r` under `name`.
fn reg<M: Metric + Clone>(r: &mut Registry, name: &str, help: &str, metric: M) -> M {
    r.register(name, help, metric.clone());
    metric
}

impl Default for Telemetry {
    fn default() -> Self {
        let mut r = Registry::with_prefix("strata");
        let by_operation =
            Family::<Operation, Histogram, fn() -> Histogram>::new_with_constructor(latency as fn() -> _);
        Telemetry {
            requests: reg(&mut r, "api_requests", "API requests answered, by operation and status", Family::default()),
            seconds: reg(
                &mut r,
                "api_request_seconds",
                "API request latency by operation (a buffered or attached exec: until it is started)",
                by_operation,
            ),
            execs: reg(&mut r, "exec_seconds", "Commands run in sandboxes, by how long they ran", latency()),
            capture_bytes: reg(
                &mut r,
                "capture_bytes",
                "Bytes of layer blobs written by checkpoints and suspends",
                Counter::default(),
            ),
            e2b: reg(&mut r, "e2b_requests", "E2B control API requests, by route and status", Family::default()),
            sandboxes: reg(&mut r, "sandboxes", "Sandboxes of this daemon, by state", Family::default()),
            store_bytes: reg(
                &mut r,
                "store_bytes",
                "Bytes the store holds: image layers, snapshot layers, snapshot blobs",
                Family::default(),
            ),
            images: reg(&mut r, "images", "Images in the store", Gauge::default()),
            snapshots: reg(&mut r, "snapshots", "Snapshots in the store", Gauge::default()),
            registry: r,
        }
    }
}

impl Telemetry {
    /// An API request answered.
    pub fn request(&self, operation: &'static str, status: u16, took: Duration) {
        self.requests.get_or_create(&Outcome { operation, status }).inc();
        self.seconds.get_or_create(&Operation { operation }).observe(took.as_secs_f64());
    }

    /// A command that ran for `took`.
    pub fn exec(&self, took: Duration) {
        self.execs.observe(took.as_secs_f64());
    }

    /// A capture that wrote `bytes` of blobs.
    pub fn captured(&self, bytes: u64) {
        self.capture_bytes.inc_by(bytes);
    }

    /// An E2B control request answered.
    pub fn e2b(&self, route: &'static str, status: u16) {
        self.e2b.get_or_create(&E2bRoute { route, status }).inc();
    }
}

impl Daemon {
    /// The metrics as Prometheus text, the gauges read now.
    pub fn prometheus(&self) -> String {
        let t = &self.telemetry;
        let states: Vec<String> = lock(&self.pool).live.values().map(|s| s.run_state().to_string()).collect();
        t.sandboxes.clear();
        for s in ["running", "paused"] {
            t.sandboxes.get_or_create(&State { state: s.into() }).set(0);
        }
        for s in states {
            t.sandboxes.get_or_create(&State { state: s }).inc();
        }
        match lock(&self.db).usage() {
            Ok(u) => {
                let g = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
                for (kind, n) in [
                    ("image_layers", u.image_layer_bytes),
                    ("snapshot_layers", u.snapshot_layer_bytes),
                    ("snapshot_blobs", u.snapshot_blob_bytes),
                ] {
                    t.store_bytes.get_or_create(&Kind { kind }).set(g(n));
                }
                t.images.set(g(u.images));
                t.snapshots.set(g(u.snapshots));
            }
            Err(e) => tracing::warn!("metrics: the store's use: {}", crate::error::chain(&e)),
        }
        let mut out = String::new();
        if let Err(e) = prometheus_client::encoding::text::encode(&mut out, &t.registry) {
            tracing::error!("metrics: encode: {e}");
        }
        out
    }
}
