//! The agent's metrics: pools, instances, counters of admissions,
//! evictions, refusals and restarts, and an RPC latency histogram, in the
//! OpenMetrics text format of the prometheus-client crate. Served by
//! `server.rs` (`metrics_listen`); this module knows nothing of the agent.

use std::time::Instant;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use resident_api::pb;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PoolLabels {
    pool: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct InstanceLabels {
    instance: String,
    workload: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct InstancePoolLabels {
    instance: String,
    workload: String,
    pool: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StateLabels {
    instance: String,
    workload: String,
    state: String,
    /// "true" for an instance entered by Adopt.
    adopted: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WorkloadLabels {
    workload: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EvictionLabels {
    /// The workload whose start evicted.
    evicting: String,
    /// The workload of the evicted instance.
    evicted: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RoleLabels {
    /// The role the refused call needed.
    role: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TransportLabels {
    /// "unix" or "tcp".
    transport: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LimitLabels {
    /// "total" or "peer".
    limit: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RpcLabels {
    rpc: String,
}

fn rpc_histogram() -> Histogram {
    // 50 µs to about 1.6 s.
    Histogram::new(exponential_buckets(0.00005, 2.0, 16))
}

/// Every metric of the agent.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    pool_budget: Family<PoolLabels, Gauge>,
    pool_effective: Family<PoolLabels, Gauge>,
    pool_used: Family<PoolLabels, Gauge>,
    declared: Family<InstanceLabels, Gauge>,
    measured: Family<InstanceLabels, Gauge>,
    reserved: Family<InstanceLabels, Gauge>,
    overrun: Family<InstancePoolLabels, Gauge>,
    state: Family<StateLabels, Gauge>,
    admissions: Family<WorkloadLabels, Counter>,
    evictions: Family<EvictionLabels, Counter>,
    restarts: Family<WorkloadLabels, Counter>,
    exposed: Family<WorkloadLabels, Counter>,
    denied: Family<RoleLabels, Counter>,
    pool_live: Family<PoolLabels, Gauge>,
    probe_failures: Family<PoolLabels, Counter>,
    refusals: Family<ReasonLabels, Counter>,
    connections: Family<TransportLabels, Gauge>,
    connections_refused: Family<LimitLabels, Counter>,
    rpc: Family<RpcLabels, Histogram, fn() -> Histogram>,
    sleeps: Family<WorkloadLabels, Counter>,
    wakes: Family<WorkloadLabels, Counter>,
    wake_seconds: Family<WorkloadLabels, Histogram, fn() -> Histogram>,
    journal_writable: Gauge,
    kv_states: Family<KvLabels, Counter>,
}

/// What happened to a saved conversation (`keep_kv`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KvLabels {
    event: &'static str,
}

/// The events of [`KvLabels`], in the order [`Metrics::kv`] takes them.
const KV_EVENTS: [&str; 4] = ["saved", "restored", "failed", "evicted"];

/// Wake times: 10 ms to about 80 s.
fn wake_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.01, 2.0, 14))
}

fn gauge_value(bytes: u64) -> i64 {
    i64::try_from(bytes).unwrap_or(i64::MAX)
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// The metrics, registered under the `residentd_` prefix.
    pub fn new() -> Self {
        let mut m = Self {
            registry: Registry::with_prefix("residentd"),
            pool_budget: Family::default(),
            pool_effective: Family::default(),
            pool_used: Family::default(),
            declared: Family::default(),
            measured: Family::default(),
            reserved: Family::default(),
            overrun: Family::default(),
            state: Family::default(),
            admissions: Family::default(),
            evictions: Family::default(),
            restarts: Family::default(),
            exposed: Family::default(),
            denied: Family::default(),
            pool_live: Family::default(),
            journal_writable: Gauge::default(),
            probe_failures: Family::default(),
            refusals: Family::default(),
            connections: Family::default(),
            connections_refused: Family::default(),
            rpc: Family::new_with_constructor(rpc_histogram),
            sleeps: Family::default(),
            wakes: Family::default(),
            wake_seconds: Family::new_with_constructor(wake_histogram),
            kv_states: Family::default(),
        };
        // The four events of saved conversations are known up front: each
        // is served from the start at zero, so a rate over them is defined
        // before the first save (and the family is there to be found).
        for event in KV_EVENTS {
            drop(m.kv_states.get_or_create(&KvLabels { event }));
        }
        let r = &mut m.registry;
        r.register(
            "pool_budget_bytes",
            "Configured budget of a pool",
            m.pool_budget.clone(),
        );
        r.register(
            "pool_effective_budget_bytes",
            "Budget tightened by the live ceiling",
            m.pool_effective.clone(),
        );
        r.register(
            "pool_used_bytes",
            "Bytes counted for residents (the larger of reserved and measured, per resident)",
            m.pool_used.clone(),
        );
        r.register(
            "instance_declared_bytes",
            "Bytes an instance declared (weights, KV cache, overhead)",
            m.declared.clone(),
        );
        r.register(
            "instance_reserved_bytes",
            "Bytes the books hold for an instance (its reservation, or what was measured where more)",
            m.reserved.clone(),
        );
        r.register(
            "overrun_bytes",
            "Bytes an instance was measured to hold beyond its reservation in a pool",
            m.overrun.clone(),
        );
        r.register(
            "instance_measured_bytes",
            "Resident bytes of an instance's process group",
            m.measured.clone(),
        );
        r.register(
            "instance_state",
            "1 for the instance's current state",
            m.state.clone(),
        );
        r.register("admissions", "Starts admitted", m.admissions.clone());
        r.register(
            "evictions",
            "Instances evicted, by the workload whose start evicted them and their own",
            m.evictions.clone(),
        );
        r.register("restarts", "Restarts after an exit", m.restarts.clone());
        r.register(
            "sleeps",
            "Instances put to sleep ([workload.sleep]): asked, idle, or to make room",
            m.sleeps.clone(),
        );
        r.register("wakes", "Sleeping instances woken", m.wakes.clone());
        r.register(
            "wake_seconds",
            "Time from a wake's admission to its server awake again",
            m.wake_seconds.clone(),
        );
        r.register(
            "exposed",
            "Instances found listening beyond loopback under expose = loopback (stopped; adopted ones reported)",
            m.exposed.clone(),
        );
        // Writable until a write says otherwise: the journal was opened
        // (created if need be) before the agent serves.
        m.journal_writable.set(1);
        r.register(
            "journal_writable",
            "1 while the journal is written, 0 while its last write failed (starts are refused until it can be written)",
            m.journal_writable.clone(),
        );
        r.register(
            "kv_states",
            "Saved conversations (keep_kv): slots saved before a stop, restored after a start, saves or restores that failed, states evicted from a disk pool",
            m.kv_states.clone(),
        );
        r.register(
            "pool_live",
            "1 while a probe-bound pool has live readings, 0 while its configured budget stands in",
            m.pool_live.clone(),
        );
        r.register(
            "probe_failures",
            "Times a pool's live reading failed and its configured budget took over",
            m.probe_failures.clone(),
        );
        r.register(
            "access_denied",
            "Calls refused PERMISSION_DENIED, by the role they needed",
            m.denied.clone(),
        );
        r.register(
            "refusals",
            "Starts refused, by first reason",
            m.refusals.clone(),
        );
        r.register(
            "connections_open",
            "Client connections open, by transport",
            m.connections.clone(),
        );
        r.register(
            "connections_refused",
            "Client connections closed at accept, by the limit they met",
            m.connections_refused.clone(),
        );
        r.register(
            "rpc_duration_seconds",
            "Time to answer an RPC",
            m.rpc.clone(),
        );
        m
    }

    /// Counts an instance stopped by the exposure guard.
    pub fn exposed(&self, workload: &str) {
        let labels = WorkloadLabels {
            workload: workload.to_string(),
        };
        self.exposed.get_or_create(&labels).inc();
    }

    /// Counts an admitted start.
    pub fn admitted(&self, workload: &str) {
        let labels = WorkloadLabels {
            workload: workload.to_string(),
        };
        self.admissions.get_or_create(&labels).inc();
    }

    /// Counts saved conversations (`keep_kv`): slots saved before a stop,
    /// restored after a start, saves or restores that failed, states
    /// evicted to keep a disk pool within its budget.
    pub fn kv(&self, saved: u64, restored: u64, failed: u64, evicted: u64) {
        for (event, n) in KV_EVENTS
            .into_iter()
            .zip([saved, restored, failed, evicted])
        {
            if n > 0 {
                self.kv_states.get_or_create(&KvLabels { event }).inc_by(n);
            }
        }
    }

    /// Counts an instance of `workload` put to sleep.
    pub fn slept(&self, workload: &str) {
        let labels = WorkloadLabels {
            workload: workload.to_string(),
        };
        self.sleeps.get_or_create(&labels).inc();
    }

    /// Counts an instance of `workload` woken, after `seconds`.
    pub fn woke(&self, workload: &str, seconds: f64) {
        let labels = WorkloadLabels {
            workload: workload.to_string(),
        };
        self.wakes.get_or_create(&labels).inc();
        self.wake_seconds.get_or_create(&labels).observe(seconds);
    }

    /// Counts one instance of `evicted` stopped for a start of `evicting`.
    pub fn evicted(&self, evicting: &str, evicted: &str) {
        let labels = EvictionLabels {
            evicting: evicting.to_string(),
            evicted: evicted.to_string(),
        };
        self.evictions.get_or_create(&labels).inc();
    }

    /// Counts a refused start.
    pub fn refused(&self, reason: &str) {
        self.refusals
            .get_or_create(&ReasonLabels {
                reason: reason.to_string(),
            })
            .inc();
    }

    /// Whether the journal's last write went through.
    pub fn journal_written(&self, ok: bool) {
        self.journal_writable.set(i64::from(ok));
    }

    /// Whether `pool`'s probe gives readings; a failure is counted.
    pub fn pool_live(&self, pool: &str, live: bool) {
        let labels = PoolLabels {
            pool: pool.to_string(),
        };
        self.pool_live.get_or_create(&labels).set(i64::from(live));
        if !live {
            self.probe_failures.get_or_create(&labels).inc();
        }
    }

    /// Counts a call refused for want of `role` (the role it needed).
    pub fn denied(&self, role: &str) {
        self.denied
            .get_or_create(&RoleLabels {
                role: role.to_string(),
            })
            .inc();
    }

    /// Counts a connection opened on `transport`.
    pub fn connection_opened(&self, transport: &str) {
        let labels = TransportLabels {
            transport: transport.to_string(),
        };
        self.connections.get_or_create(&labels).inc();
    }

    /// Counts a connection on `transport` closed.
    pub fn connection_closed(&self, transport: &str) {
        let labels = TransportLabels {
            transport: transport.to_string(),
        };
        self.connections.get_or_create(&labels).dec();
    }

    /// Counts a connection refused at accept for `limit`.
    pub fn connection_refused(&self, limit: &str) {
        let labels = LimitLabels {
            limit: limit.to_string(),
        };
        self.connections_refused.get_or_create(&labels).inc();
    }

    /// Counts a restart.
    pub fn restarted(&self, workload: &str) {
        self.restarts
            .get_or_create(&WorkloadLabels {
                workload: workload.to_string(),
            })
            .inc();
    }

    /// Starts timing an RPC; the time is recorded when the guard drops.
    pub fn time(&self, rpc: &'static str) -> RpcTimer<'_> {
        RpcTimer {
            metrics: self,
            rpc,
            started: Instant::now(),
        }
    }

    /// The text exposition, with the gauges set from `pools` and
    /// `instances` (the agent's, at the scrape).
    pub fn render(&self, pools: &[pb::PoolStatus], instances: &[pb::Instance]) -> String {
        for family in [&self.pool_budget, &self.pool_effective, &self.pool_used] {
            family.clear();
        }
        for p in pools {
            let l = PoolLabels {
                pool: p.name.clone(),
            };
            if let Some(b) = p.budget_bytes {
                self.pool_budget.get_or_create(&l).set(gauge_value(b));
            }
            if let Some(e) = p.effective_budget_bytes {
                self.pool_effective.get_or_create(&l).set(gauge_value(e));
            }
            self.pool_used
                .get_or_create(&l)
                .set(gauge_value(p.used_bytes));
        }
        self.declared.clear();
        self.measured.clear();
        self.reserved.clear();
        self.overrun.clear();
        self.state.clear();
        for i in instances {
            let l = InstanceLabels {
                instance: i.instance_id.clone(),
                workload: i.workload.clone(),
            };
            let declared: u64 = i
                .demand
                .iter()
                .map(|d| {
                    d.weights_bytes
                        .saturating_add(d.kv_budget_bytes)
                        .saturating_add(d.overhead_bytes)
                })
                .sum();
            self.declared.get_or_create(&l).set(gauge_value(declared));
            self.reserved
                .get_or_create(&l)
                .set(gauge_value(i.reserved_bytes));
            for d in i.demand.iter().filter(|d| d.overrun_bytes > 0) {
                let p = InstancePoolLabels {
                    instance: l.instance.clone(),
                    workload: l.workload.clone(),
                    pool: d.pool.clone(),
                };
                self.overrun
                    .get_or_create(&p)
                    .set(gauge_value(d.overrun_bytes));
            }
            self.measured
                .get_or_create(&l)
                .set(gauge_value(i.measured_bytes));
            let state = pb::State::try_from(i.state).map_or("UNKNOWN", |s| s.as_str_name());
            let s = StateLabels {
                instance: l.instance,
                workload: l.workload,
                state: state.to_string(),
                adopted: i.adopted.to_string(),
            };
            self.state.get_or_create(&s).set(1);
        }
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

/// Records an RPC's duration when dropped.
#[derive(Debug)]
pub struct RpcTimer<'a> {
    metrics: &'a Metrics,
    rpc: &'static str,
    started: Instant,
}

impl Drop for RpcTimer<'_> {
    fn drop(&mut self) {
        let labels = RpcLabels {
            rpc: self.rpc.to_string(),
        };
        self.metrics
            .rpc
            .get_or_create(&labels)
            .observe(self.started.elapsed().as_secs_f64());
    }
}
