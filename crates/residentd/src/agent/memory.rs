//! The agent's live readings: the probes' readings (`probes.rs`) of host-
//! and device-bound pools fed into the ledger, their health told, and the
//! wait for evicted victims' memory to come back.

use std::sync::Arc;
use std::time::{Duration, Instant};

use resident_config::Config;
use resident_core::PoolName;

use super::Agent;
use super::books::Readings;

impl Agent {
    /// Reads the live probes into the books: host memory for host-bound
    /// pools, device readings, and each instance's measured bytes. The
    /// probes and `/proc` are read first; the books' lock is taken once,
    /// for the numbers alone.
    pub fn refresh_probes(&self) {
        self.refresh_probes_with(&self.config());
    }

    /// [`Agent::refresh_probes_with`] from async code. Where a device probe
    /// is open (an NVML call, a reading file, and the /proc scan that
    /// per-process device use needs) it runs on a blocking thread, so a
    /// slow driver never holds one of the runtime's threads; a node of host
    /// pools only reads /proc/meminfo (one small read) in place.
    pub(super) async fn refresh_probes_async(self: &Arc<Self>, config: &Arc<Config>) {
        if !self.probes.has_devices() {
            self.refresh_probes_with(config);
            return;
        }
        let (me, config) = (self.clone(), config.clone());
        let _ = tokio::task::spawn_blocking(move || me.refresh_probes_with(&config)).await;
    }

    /// [`Agent::refresh_probes`] under the request's config snapshot. On a
    /// blocking thread where a device probe is open; on a node of host
    /// pools alone, in place: one read of /proc/meminfo.
    #[allow(clippy::disallowed_methods)]
    pub(super) fn refresh_probes_with(&self, config: &Config) {
        let mut readings = Readings {
            available: self.probes.devices(),
            measured: self
                .device_use()
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
        self.probe_health(&readings.available);
        if self.books.set_readings(readings) {
            self.persist();
            self.roster_changed();
        }
        self.figures_may_have_moved();
    }

    /// Tells when a pool's live reading fails (no reading: its configured
    /// budget stands in) and when it comes back: a log line, a POOL event
    /// and the metrics, once per change.
    fn probe_health(&self, available: &[(String, Option<u64>)]) {
        for h in self.probes.health(available) {
            self.metrics.pool_live(&h.pool, h.live);
            if h.live {
                if h.known {
                    tracing::info!(pool = %h.pool, "live readings are back");
                    self.publish_pool(&h.pool, "live readings are back");
                }
            } else {
                let message =
                    "no live reading: its configured budget stands in until readings come back";
                tracing::warn!(pool = %h.pool, "{message}");
                self.publish_pool(&h.pool, message);
            }
        }
    }

    /// What each instance holds on each device pool whose probe accounts
    /// per process (NVML, or a file with `PID BYTES` lines): the sum over
    /// the instance's process group. One scan of /proc, only when needed
    /// (a device probe is open: on a blocking thread).
    #[allow(clippy::disallowed_methods)]
    fn device_use(&self) -> Vec<(String, String, u64)> {
        let probes = self.probes.per_process();
        if probes.is_empty() {
            return Vec::new();
        }
        let mut groups: std::collections::HashMap<i32, Vec<u32>> = std::collections::HashMap::new();
        for p in resident_supervisor::procfs::scan() {
            groups.entry(p.pgrp).or_default().push(p.pid as u32);
        }
        let mut out = Vec::new();
        for status in self.sup.list() {
            let Some(pgid) = status.pid else {
                continue;
            };
            let Some(pids) = groups.get(&(pgid as i32)) else {
                continue;
            };
            for (pool, probe) in &probes {
                if let Some(bytes) = probe.used_by(pids) {
                    out.push((status.instance.to_string(), pool.clone(), bytes));
                }
            }
        }
        out
    }

    /// Opens the probe of every device-bound pool of the config in force.
    pub(super) fn open_device_probes(&self) {
        self.probes.open(&self.config());
    }

    /// Waits, bounded by `memory_recovery`, until every live pool shows at
    /// least `want` bytes available: drivers and the kernel free a large
    /// process's memory after it is reaped, and a new model should not
    /// start into memory that is not back yet. No reading: no wait.
    pub(super) async fn await_memory_back(
        self: &Arc<Self>,
        config: &Config,
        wanted: &[(String, u64)],
    ) {
        let deadline = Instant::now() + config.node.memory_recovery;
        loop {
            // The readings (an NVML call, /proc/meminfo) on a blocking
            // thread.
            let (me, pools) = (self.clone(), wanted.to_vec());
            let readings = tokio::task::spawn_blocking(move || {
                pools
                    .iter()
                    .map(|(pool, _)| me.probes.available(pool))
                    .collect::<Vec<_>>()
            })
            .await
            .unwrap_or_default();
            let short: Vec<(&str, u64, Option<u64>)> = wanted
                .iter()
                .zip(readings)
                .map(|((pool, want), now)| (pool.as_str(), *want, now))
                .filter(|(_, want, now)| now.is_some_and(|a| a < *want))
                .collect();
            if short.is_empty() {
                return;
            }
            if Instant::now() >= deadline {
                tracing::warn!(?short, "evicted memory not back in time; starting anyway");
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}
