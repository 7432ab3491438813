//! The router's metrics, under the `residentd_router_` prefix, in the
//! OpenMetrics text format (`GET /metrics`). docs/router.md lists them.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    model: String,
    status: u16,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ModelLabels {
    model: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StartLabels {
    model: String,
    result: String,
}

fn latency() -> Histogram {
    // 100 µs to about 53 s.
    Histogram::new(exponential_buckets(0.0001, 2.0, 20))
}

/// Every metric of the router.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    requests: Family<RequestLabels, Counter>,
    first_byte: Family<ModelLabels, Histogram, fn() -> Histogram>,
    in_flight: Family<ModelLabels, Gauge>,
    starts: Family<StartLabels, Histogram, fn() -> Histogram>,
    queue_timeouts: Family<ModelLabels, Counter>,
    waiting: Gauge,
    /// The requests in flight per model again, readable (a Family is
    /// not): what the console shows.
    in_flight_now: Mutex<BTreeMap<String, i64>>,
    /// Counts changes of the traffic, so the console can show each within
    /// moments.
    traffic_changed: tokio::sync::watch::Sender<u64>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// The metrics, registered.
    pub fn new() -> Self {
        let mut m = Self {
            registry: Registry::with_prefix("residentd_router"),
            requests: Family::default(),
            first_byte: Family::new_with_constructor(latency),
            in_flight: Family::default(),
            starts: Family::new_with_constructor(latency),
            queue_timeouts: Family::default(),
            waiting: Gauge::default(),
            in_flight_now: Mutex::default(),
            traffic_changed: tokio::sync::watch::Sender::new(0),
        };
        let r = &mut m.registry;
        r.register(
            "requests",
            "Requests answered, by model and HTTP status",
            m.requests.clone(),
        );
        r.register(
            "first_byte_seconds",
            "From a request's arrival to its model's response headers (a start on demand included)",
            m.first_byte.clone(),
        );
        r.register(
            "in_flight",
            "Requests being answered, each holding its model's instance",
            m.in_flight.clone(),
        );
        r.register(
            "start_seconds",
            "Starts on demand until READY (or refused, or failed), by result",
            m.starts.clone(),
        );
        r.register(
            "queue_timeouts",
            "Requests answered 503 queue_timeout",
            m.queue_timeouts.clone(),
        );
        r.register(
            "starts_waiting",
            "Starts waiting for memory that requests in flight hold",
            m.waiting.clone(),
        );
        m
    }

    /// Counts an answered request.
    pub fn answered(&self, model: &str, status: u16) {
        let labels = RequestLabels {
            model: model.to_string(),
            status,
        };
        self.requests.get_or_create(&labels).inc();
    }

    /// Observes the time to the model's response headers.
    pub fn first_byte(&self, model: &str, took: Duration) {
        let labels = ModelLabels {
            model: model.to_string(),
        };
        self.first_byte
            .get_or_create(&labels)
            .observe(took.as_secs_f64());
    }

    /// A request began (+1) or ended (-1) holding `model`.
    pub fn in_flight(&self, model: &str, by: i64) {
        let labels = ModelLabels {
            model: model.to_string(),
        };
        self.in_flight.get_or_create(&labels).inc_by(by);
        let mut now = self
            .in_flight_now
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        *now.entry(labels.model).or_default() += by;
        drop(now);
        self.traffic_changed.send_modify(|n| *n += 1);
    }

    /// Observes a start on demand.
    pub fn started(&self, model: &str, result: &str, took: Duration) {
        let labels = StartLabels {
            model: model.to_string(),
            result: result.to_string(),
        };
        self.starts
            .get_or_create(&labels)
            .observe(took.as_secs_f64());
    }

    /// Counts a queue timeout.
    pub fn queue_timeout(&self, model: &str) {
        let labels = ModelLabels {
            model: model.to_string(),
        };
        self.queue_timeouts.get_or_create(&labels).inc();
    }

    /// A start began (+1) or stopped (-1) waiting on holds.
    pub fn waiting(&self, by: i64) {
        self.waiting.inc_by(by);
        self.traffic_changed.send_modify(|n| *n += 1);
    }

    /// The requests in flight per model (every model that had one), and
    /// the starts waiting on holds.
    pub fn traffic(&self) -> (BTreeMap<String, i64>, i64) {
        let now = self
            .in_flight_now
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        (now, self.waiting.get())
    }

    /// Wakes whenever the traffic changes.
    pub fn traffic_changes(&self) -> tokio::sync::watch::Receiver<u64> {
        self.traffic_changed.subscribe()
    }

    /// The text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        if prometheus_client::encoding::text::encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_console_reads_what_the_gauges_say() {
        let m = Metrics::new();
        m.in_flight("chat", 1);
        m.in_flight("chat", 1);
        m.in_flight("embed", 1);
        m.in_flight("embed", -1);
        m.waiting(1);
        let (in_flight, waiting) = m.traffic();
        let want = BTreeMap::from([("chat".to_string(), 2), ("embed".to_string(), 0)]);
        assert_eq!((in_flight, waiting), (want, 1));
        assert!(
            m.render()
                .contains("residentd_router_in_flight{model=\"chat\"} 2")
        );
    }
}
