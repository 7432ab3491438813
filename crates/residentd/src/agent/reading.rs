//! The live readings, a room of its own: the probes' (`probes.rs`) of
//! host- and device-bound pools and each run's measured bytes, fed into
//! the books; a pool's reading lost or back told once per change; the
//! fleet views told that the figures may have moved.

use std::sync::Arc;

use resident_config::Config;
use resident_core::PoolName;
use resident_supervisor::Supervisor;

use super::books::{Books, Readings};
use super::durability::Durability;
use super::parts::Parts;
use super::picture::Signals;
use super::probes::Probes;
use super::shared::Current;
use super::tell::Teller;
use crate::metrics::Metrics;

/// The reader.
#[derive(Debug)]
pub(super) struct Reader {
    config: Current,
    books: Arc<Books>,
    sup: Supervisor,
    probes: Arc<Probes>,
    durability: Arc<Durability>,
    signals: Arc<Signals>,
    metrics: Arc<Metrics>,
    teller: Arc<Teller>,
}

impl Reader {
    /// The room, on the parts (and the rooms) it uses.
    pub(super) fn new(p: &Parts, teller: Arc<Teller>) -> Self {
        Self {
            config: p.config.clone(),
            books: p.books.clone(),
            sup: p.sup.clone(),
            probes: p.probes.clone(),
            durability: p.durability.clone(),
            signals: p.signals.clone(),
            metrics: p.metrics.clone(),
            teller,
        }
    }

    /// Reads the live probes into the books: host memory for host-bound
    /// pools, device readings, and each instance's measured bytes. The
    /// probes and `/proc` are read first; the books' lock is taken once,
    /// for the numbers alone.
    pub(super) fn refresh(&self) {
        let _ = self.refresh_with(&self.config.get());
    }

    /// [`Reader::refresh_with`] from async code. Where a device probe is
    /// open (an NVML call, a reading file, and the /proc scan that
    /// per-process device use needs) it runs on a blocking thread, so a
    /// slow driver never holds one of the runtime's threads; a node of host
    /// pools only reads /proc/meminfo (one small read) in place.
    pub(super) async fn refresh_async(self: &Arc<Self>, config: &Arc<Config>) -> bool {
        if !self.probes.has_devices() {
            return self.refresh_with(config);
        }
        let (me, config) = (self.clone(), config.clone());
        tokio::task::spawn_blocking(move || me.refresh_with(&config))
            .await
            .unwrap_or(false)
    }

    /// [`Reader::refresh`] under the request's config snapshot. On a
    /// blocking thread where a device probe is open; on a node of host
    /// pools alone, in place: one read of /proc/meminfo. Whether there was
    /// anything to read (and the fleet views were told).
    #[allow(clippy::disallowed_methods)]
    pub(super) fn refresh_with(&self, config: &Config) -> bool {
        let mut readings = Readings {
            available: self.probes.devices(),
            measured: self
                .probes
                .device_use(|| {
                    let runs = self.sup.list().into_iter();
                    runs.filter_map(|s| Some((s.instance.to_string(), s.pid?)))
                        .collect()
                })
                .into_iter()
                .filter_map(|(id, pool, bytes)| Some((id, PoolName::new(pool).ok()?, bytes)))
                .collect(),
            host: Vec::new(),
            host_pools: config
                .pools
                .iter()
                .filter(|p| p.host)
                .map(|p| p.pool.name.clone())
                .collect(),
            learn: config.node.learn_footprints,
        };
        // Only host-bound pools count measured bytes; a node without one
        // skips the copy of every status (this runs every second).
        if !readings.host_pools.is_empty() {
            let host = self.probes.host();
            for pool in &readings.host_pools {
                readings.available.push((pool.to_string(), host));
            }
            readings.host = self
                .sup
                .list()
                .into_iter()
                .map(|s| (s.instance.to_string(), s.measured_bytes))
                .collect();
        }
        // A node whose pools all have static budgets reads nothing: then
        // nothing moved, and a Start or a Place does not wake every fleet
        // view (the tick still does, once a second).
        if readings.available.is_empty() && readings.measured.is_empty() {
            return false;
        }
        self.health(&readings.available);
        if self.books.set_readings(readings) {
            self.durability.change();
            self.signals.roster_changed();
        }
        self.signals.figures_may_have_moved();
        true
    }

    /// Tells when a pool's live reading fails (no reading: its configured
    /// budget stands in) and when it comes back: a log line, a POOL event
    /// and the metrics, once per change.
    fn health(&self, available: &[(String, Option<u64>)]) {
        for h in self.probes.health(available) {
            self.metrics.pool_live(&h.pool, h.live);
            if h.live {
                if h.known {
                    tracing::info!(pool = %h.pool, "live readings are back");
                    self.teller.publish_pool(&h.pool, "live readings are back");
                }
            } else {
                let message =
                    "no live reading: its configured budget stands in until readings come back";
                tracing::warn!(pool = %h.pool, "{message}");
                self.teller.publish_pool(&h.pool, message);
            }
        }
    }

    /// Opens the probe of every device-bound pool of the config in force.
    pub(super) fn open_device_probes(&self) {
        self.probes.open(&self.config.get());
    }
}
