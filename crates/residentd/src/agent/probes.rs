//! The probes, a room with walls (it imports nothing of the agent): host
//! memory, each device-bound pool's probe (`device = "nvml:N"` or
//! `"file:..."`), and whether each pool's last reading was live. Every
//! reading here may block (an NVML call, a file): callers on the runtime
//! run them on a blocking thread.

use std::collections::HashMap;
use std::sync::Arc;

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
}
