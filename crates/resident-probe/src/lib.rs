//! Live memory readings that bound probe-bound pools. A reading is what
//! is available now; `None` means no trustworthy reading (the configured
//! budget then stands).
//!
//! Architecture invariant: a probe only reads; what a reading means for
//! admission is the core planner's business.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

/// A source of "bytes available now".
pub trait MemoryProbe: Send + Sync + std::fmt::Debug {
    /// Reads the probe. `None`: no trustworthy reading.
    fn available(&self) -> Option<u64>;
}

/// Host memory: the kernel's MemAvailable, through sysinfo.
#[derive(Debug)]
pub struct HostMemory {
    system: Mutex<sysinfo::System>,
}

impl HostMemory {
    /// A probe of this machine's memory.
    pub fn new() -> Self {
        Self {
            system: Mutex::new(sysinfo::System::new()),
        }
    }
}

impl Default for HostMemory {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryProbe for HostMemory {
    fn available(&self) -> Option<u64> {
        let mut system = self.system.lock().unwrap_or_else(|e| e.into_inner());
        system.refresh_memory_specifics(sysinfo::MemoryRefreshKind::nothing().with_ram());
        // A zero total means the reading failed (no /proc/meminfo).
        (system.total_memory() > 0).then(|| system.available_memory())
    }
}

/// A probe whose reading the test sets. `u64::MAX` stands for "no reading".
#[derive(Debug)]
pub struct FakeProbe {
    value: AtomicU64,
}

impl FakeProbe {
    /// A fake reading `value`.
    pub fn new(value: Option<u64>) -> Self {
        Self {
            value: AtomicU64::new(value.unwrap_or(u64::MAX)),
        }
    }

    /// Changes the reading.
    pub fn set(&self, value: Option<u64>) {
        self.value
            .store(value.unwrap_or(u64::MAX), Ordering::Relaxed);
    }
}

impl MemoryProbe for FakeProbe {
    fn available(&self) -> Option<u64> {
        Some(self.value.load(Ordering::Relaxed)).filter(|v| *v != u64::MAX)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_memory_reads_something_plausible() {
        let available = HostMemory::new()
            .available()
            .expect("a Linux host has /proc/meminfo");
        assert!(available > 16 << 20 && available < 1 << 50, "{available}");
    }

    #[test]
    fn the_fake_reads_what_it_is_told() {
        let fake = FakeProbe::new(None);
        assert_eq!(fake.available(), None);
        fake.set(Some(42));
        assert_eq!(fake.available(), Some(42));
    }
}
