//! The router's metrics, under the `residentd_router_` prefix, in the
//! OpenMetrics text format (`GET /metrics`). docs/router.md lists them.

use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

use parking_lot::Mutex;
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

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WhyLabels {
    why: &'static str,
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
    loads_abandoned: Family<ModelLabels, Counter>,
    waiting: Gauge,
    connections: Gauge,
    refused: Family<WhyLabels, Counter>,
    buffered: Gauge,
    console_streams: Gauge,
    /// The requests in flight per model again, readable (a Family is
    /// not): what the console shows.
    in_flight_now: Mutex<BTreeMap<String, i64>>,
    /// The starts waiting on holds per model, readable.
    waiting_now: Mutex<BTreeMap<String, i64>>,
    /// The last [`RECENT_KEPT`] requests answered, newest last.
    recent: Mutex<VecDeque<Served>>,
    /// Counts changes of the traffic, so the console can show each within
    /// moments.
    traffic_changed: tokio::sync::watch::Sender<u64>,
}

/// How many answered requests the console can show.
pub const RECENT_KEPT: usize = 50;

/// One request answered (its body sent, or its client gone), as the
/// console lists it.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Served {
    /// The workload it went to.
    pub model: String,
    /// Its path.
    pub path: String,
    /// The model server's status.
    pub status: u16,
    /// When it arrived, in ms since the Unix epoch.
    pub arrived_unix_ms: u64,
    /// From its arrival to the first piece of the answer's body: the time
    /// to the first token of a streamed answer (a start or wake on demand
    /// and any wait for memory included).
    pub first_token_ms: Option<f64>,
    /// From its arrival to the end of the answer's body.
    pub total_ms: f64,
    /// Tokens generated: a streamed answer's `data:` events (the last
    /// `[DONE]` left out), else the answer's `usage.completion_tokens`.
    pub tokens: Option<u64>,
    /// Tokens per second after the first: None for fewer than two.
    pub tokens_per_s: Option<f64>,
    /// Whether the client went away before the answer ended.
    pub cut_off: bool,
}

/// The traffic as the console shows it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Traffic {
    /// Requests in flight per model (every model that had one).
    pub in_flight: BTreeMap<String, i64>,
    /// Starts waiting on holds per model (every model that had one).
    pub waiting: BTreeMap<String, i64>,
    /// The last requests answered, newest first.
    pub recent: Vec<Served>,
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
            loads_abandoned: Family::default(),
            waiting: Gauge::default(),
            connections: Gauge::default(),
            refused: Family::default(),
            buffered: Gauge::default(),
            console_streams: Gauge::default(),
            in_flight_now: Mutex::default(),
            waiting_now: Mutex::default(),
            recent: Mutex::default(),
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
            "loads_abandoned",
            "Starts on demand stopped while loading because every request waiting for them went away",
            m.loads_abandoned.clone(),
        );
        r.register(
            "starts_waiting",
            "Starts waiting for memory that requests in flight hold",
            m.waiting.clone(),
        );
        r.register(
            "connections",
            "Open HTTP connections (at most --max-connections)",
            m.connections.clone(),
        );
        r.register(
            "refused",
            "Requests and connections refused before any handler: a host, an origin, a content type or an upstream path not allowed, or a bound reached (connections, streams, body_budget)",
            m.refused.clone(),
        );
        r.register(
            "buffered_bytes",
            "Bytes set aside for request bodies being read or waiting to be forwarded (at most --body-budget)",
            m.buffered.clone(),
        );
        r.register(
            "console_streams",
            "The console's open event and log streams (at most --max-streams)",
            m.console_streams.clone(),
        );
        m
    }

    /// A connection opened (+1) or closed (-1).
    pub fn connections(&self, by: i64) {
        self.connections.inc_by(by);
    }

    /// Counts a refusal before any handler.
    pub fn refused(&self, why: &'static str) {
        self.refused.get_or_create(&WhyLabels { why }).inc();
    }

    /// Bytes set aside for bodies (+) or given back (-).
    pub fn buffered(&self, by: i64) {
        self.buffered.inc_by(by);
    }

    /// A console stream opened (+1) or ended (-1).
    pub fn console_stream(&self, by: i64) {
        self.console_streams.inc_by(by);
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
        *self.in_flight_now.lock().entry(labels.model).or_default() += by;
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

    /// A start on demand of `model` stopped while it loaded: nobody waited
    /// for it any more.
    pub fn load_abandoned(&self, model: &str) {
        let labels = ModelLabels {
            model: model.to_string(),
        };
        self.loads_abandoned.get_or_create(&labels).inc();
    }

    /// A start of `model` began (+1) or stopped (-1) waiting on holds.
    pub fn waiting(&self, model: &str, by: i64) {
        self.waiting.inc_by(by);
        *self
            .waiting_now
            .lock()
            .entry(model.to_string())
            .or_default() += by;
        self.traffic_changed.send_modify(|n| *n += 1);
    }

    /// A request answered: kept for the console.
    pub fn served(&self, s: Served) {
        let mut recent = self.recent.lock();
        if recent.len() == RECENT_KEPT {
            recent.pop_front();
        }
        recent.push_back(s);
        drop(recent);
        self.traffic_changed.send_modify(|n| *n += 1);
    }

    /// The traffic now: requests in flight and starts waiting per model,
    /// the last requests answered.
    pub fn traffic(&self) -> Traffic {
        Traffic {
            in_flight: self.in_flight_now.lock().clone(),
            waiting: self.waiting_now.lock().clone(),
            recent: self.recent.lock().iter().rev().cloned().collect(),
        }
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
    fn the_last_requests_are_kept_newest_first() {
        let m = Metrics::new();
        for status in 0..(RECENT_KEPT as u16 + 3) {
            m.served(Served {
                model: "chat".into(),
                path: "/v1/completions".into(),
                status,
                arrived_unix_ms: 0,
                first_token_ms: None,
                total_ms: 1.0,
                tokens: None,
                tokens_per_s: None,
                cut_off: false,
            });
        }
        let recent = m.traffic().recent;
        assert_eq!(recent.len(), RECENT_KEPT);
        assert_eq!(recent[0].status, RECENT_KEPT as u16 + 2);
        assert_eq!(recent[RECENT_KEPT - 1].status, 3);
    }

    #[test]
    fn the_console_reads_what_the_gauges_say() {
        let m = Metrics::new();
        m.in_flight("chat", 1);
        m.in_flight("chat", 1);
        m.in_flight("embed", 1);
        m.in_flight("embed", -1);
        m.waiting("embed", 1);
        let t = m.traffic();
        let want = BTreeMap::from([("chat".to_string(), 2), ("embed".to_string(), 0)]);
        assert_eq!(t.in_flight, want);
        assert_eq!(t.waiting, BTreeMap::from([("embed".to_string(), 1)]));
        assert!(
            m.render()
                .contains("residentd_router_in_flight{model=\"chat\"} 2")
        );
    }
}
