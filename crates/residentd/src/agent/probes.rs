//! The probes, a room with walls (it imports nothing of the agent): host
//! memory, each device-bound pool's probe (`device = "nvml:N"` or
//! `"file:..."`), whether each pool's last reading was live, what each
//! run holds on a device, and the wait for evicted memory to come back. Every
//! reading here may block (an NVML call, a file): callers on the runtime
//! run them on a blocking thread.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};
use resident_config::Config;
use resident_probe::MemoryProbe;

/// The agent's probes.
#[derive(Debug)]
pub(super) struct Probes {
    host: Arc<dyn MemoryProbe>,
    /// Probes of device-bound pools, by pool name.
    devices: RwLock<Vec<(String, Arc<dyn MemoryProbe>)>>,
    /// Whether each probe-bound pool's last reading was live.
    live: Mutex<HashMap<String, bool>>,
}

/// A pool whose live reading failed or came back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Health {
    pub(super) pool: String,
    /// Live now.
    pub(super) live: bool,
    /// It had a reading before (a first reading that is live is no news).
    pub(super) known: bool,
}

impl Probes {
    /// Reading host memory from `host`; no device probe open yet.
    pub(super) fn new(host: Arc<dyn MemoryProbe>) -> Self {
        Self {
            host,
            devices: RwLock::new(Vec::new()),
            live: Mutex::new(HashMap::new()),
        }
    }

    /// Opens the probe of every device-bound pool of `config`. A pool
    /// whose probe cannot be opened keeps its static budget, with one
    /// warning.
    pub(super) fn open(&self, config: &Config) {
        let mut probes = Vec::new();
        for p in &config.pools {
            let Some(device) = &p.device else {
                continue;
            };
            match resident_probe::device_probe(device) {
                Ok(probe) => probes.push((p.pool.name.to_string(), Arc::from(probe))),
                Err(e) => {
                    tracing::warn!(pool = %p.pool.name, error = %e, "no live reading; static budget")
                }
            }
        }
        *self.devices.write() = probes;
    }

    /// Whether a device probe is open (its readings may block).
    pub(super) fn has_devices(&self) -> bool {
        !self.devices.read().is_empty()
    }

    /// Host memory available now. Blocking: a small read.
    #[allow(clippy::disallowed_methods)]
    pub(super) fn host(&self) -> Option<u64> {
        self.host.available()
    }

    /// Each device-bound pool's reading. Blocking.
    #[allow(clippy::disallowed_methods)]
    pub(super) fn devices(&self) -> Vec<(String, Option<u64>)> {
        self.devices
            .read()
            .iter()
            .map(|(pool, probe)| (pool.clone(), probe.available()))
            .collect()
    }

    /// The live reading of `pool`: its device probe's, else host memory.
    /// Blocking.
    #[allow(clippy::disallowed_methods)]
    pub(super) fn available(&self, pool: &str) -> Option<u64> {
        let device = self
            .devices
            .read()
            .iter()
            .find(|(name, _)| name == pool)
            .map(|(_, probe)| probe.clone());
        match device {
            Some(probe) => probe.available(),
            None => self.host.available(),
        }
    }

    /// The device probes that account per process (NVML, or a file with
    /// `PID BYTES` lines).
    pub(super) fn per_process(&self) -> Vec<(String, Arc<dyn MemoryProbe>)> {
        self.devices
            .read()
            .iter()
            .filter(|(_, probe)| probe.used_by(&[]).is_some())
            .cloned()
            .collect()
    }

    /// Notes which pools read live now; returns those whose state changed
    /// since their last reading.
    pub(super) fn health(&self, available: &[(String, Option<u64>)]) -> Vec<Health> {
        let mut live = self.live.lock();
        let mut changed = Vec::new();
        for (pool, reading) in available {
            let now = reading.is_some();
            let before = live.insert(pool.clone(), now);
            if before != Some(now) {
                changed.push(Health {
                    pool: pool.clone(),
                    live: now,
                    known: before.is_some(),
                });
            }
        }
        changed
    }

    /// What each run holds on each device pool whose probe accounts per
    /// process (NVML, or a file with `PID BYTES` lines): the sum over the
    /// run's process group. `runs` (each instance and its group's leader)
    /// is asked only when such a probe is open, and so is the one scan of
    /// /proc. Blocking.
    #[allow(clippy::disallowed_methods)]
    pub(super) fn device_use(
        &self,
        runs: impl FnOnce() -> Vec<(String, u32)>,
    ) -> Vec<(String, String, u64)> {
        let probes = self.per_process();
        if probes.is_empty() {
            return Vec::new();
        }
        let mut groups: HashMap<i32, Vec<u32>> = HashMap::new();
        for p in resident_supervisor::procfs::scan() {
            groups.entry(p.pgrp).or_default().push(p.pid as u32);
        }
        let mut out = Vec::new();
        for (instance, pgid) in runs() {
            let Some(pids) = i32::try_from(pgid).ok().and_then(|g| groups.get(&g)) else {
                continue;
            };
            for (pool, probe) in &probes {
                if let Some(bytes) = probe.used_by(pids) {
                    out.push((instance.clone(), pool.clone(), bytes));
                }
            }
        }
        out
    }

    /// Waits, at most `within`, until every live pool of `wanted` shows at
    /// least its bytes available: drivers and the kernel free a large
    /// process's memory after it is reaped, and a new model should not
    /// start into memory that is not back yet. No reading: no wait. The
    /// readings run on a blocking thread.
    pub(super) async fn await_back(self: &Arc<Self>, within: Duration, wanted: &[(String, u64)]) {
        let deadline = Instant::now() + within;
        loop {
            let (me, pools) = (self.clone(), wanted.to_vec());
            let readings = tokio::task::spawn_blocking(move || {
                pools
                    .iter()
                    .map(|(pool, _)| me.available(pool))
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
