//! Live memory readings that bound probe-bound pools. A reading is what
//! is available now; `None` means no trustworthy reading (the configured
//! budget then stands).
//!
//! Architecture invariant: a probe only reads; what a reading means for
//! admission is the core planner's business.

use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;

/// A source of "bytes available now".
pub trait MemoryProbe: Send + Sync + std::fmt::Debug {
    /// Reads the probe. `None`: no trustworthy reading.
    fn available(&self) -> Option<u64>;

    /// Bytes the processes `pids` hold on this probe's memory, where the
    /// probe can tell (a GPU's per-process accounting). `None`: it cannot.
    fn used_by(&self, _pids: &[u32]) -> Option<u64> {
        None
    }
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
        let mut system = self.system.lock();
        system.refresh_memory_specifics(sysinfo::MemoryRefreshKind::nothing().with_ram());
        // A zero total means the reading failed (no /proc/meminfo).
        (system.total_memory() > 0).then(|| system.available_memory())
    }
}

/// A reading kept in a file: the bytes available, as a decimal integer on
/// the first line, then optionally one `PID BYTES` line per process using
/// the device (what `nvidia-smi --query-compute-apps=pid,used_memory`
/// lists). Another tool (an exporter, a test) writes it; a missing, empty
/// or garbled first line is no reading.
#[derive(Debug)]
pub struct FileProbe {
    path: std::path::PathBuf,
}

impl FileProbe {
    /// A probe reading `path`.
    pub fn new(path: impl Into<std::path::PathBuf>) -> Self {
        Self { path: path.into() }
    }
}

impl MemoryProbe for FileProbe {
    fn available(&self) -> Option<u64> {
        let text = std::fs::read_to_string(&self.path).ok()?;
        text.lines().next()?.trim().parse().ok()
    }

    fn used_by(&self, pids: &[u32]) -> Option<u64> {
        let text = std::fs::read_to_string(&self.path).ok()?;
        let mut lines = text.lines();
        lines.next()?;
        let mut total = 0u64;
        for line in lines {
            let mut fields = line.split_whitespace();
            let (Some(pid), Some(bytes)) = (fields.next(), fields.next()) else {
                continue;
            };
            if let (Ok(pid), Ok(bytes)) = (pid.parse::<u32>(), bytes.parse::<u64>())
                && pids.contains(&pid)
            {
                total = total.saturating_add(bytes);
            }
        }
        Some(total)
    }
}

/// Whether this build reads GPUs through NVML (the `nvml` feature).
pub const NVML_BUILT: bool = cfg!(feature = "nvml");

/// What a config's `nvml:` pools get from this build, for people: a
/// warning per such pool when it was built without NVML (each keeps its
/// static budget: foreign GPU memory is never seen).
pub fn build_warnings(devices: impl IntoIterator<Item = (String, String)>) -> Vec<String> {
    if NVML_BUILT {
        return Vec::new();
    }
    devices
        .into_iter()
        .filter(|(_, device)| device.starts_with("nvml:"))
        .map(|(pool, device)| {
            format!(
                "pool '{pool}': device = \"{device}\", but this residentd was built without the nvml feature: the pool keeps its static budget and memory other processes hold on the GPU is not seen (build with `cargo build --release --features nvml`)"
            )
        })
        .collect()
}

#[cfg(feature = "nvml")]
mod nvml;
#[cfg(feature = "nvml")]
pub use nvml::NvmlProbe;

/// The probe for a pool's `device = "..."` setting: `file:/path` or
/// `nvml:N`. `Err` says why there is none (the pool then keeps its static
/// budget).
pub fn device_probe(device: &str) -> Result<Box<dyn MemoryProbe>, String> {
    if let Some(path) = device.strip_prefix("file:") {
        return Ok(Box::new(FileProbe::new(path)));
    }
    if let Some(index) = device.strip_prefix("nvml:") {
        let index: u32 = index
            .parse()
            .map_err(|_| format!("{device:?}: expected nvml:N"))?;
        #[cfg(feature = "nvml")]
        return NvmlProbe::new(index).map(|p| Box::new(p) as Box<dyn MemoryProbe>);
        #[cfg(not(feature = "nvml"))]
        return Err(format!(
            "GPU {index}: this residentd was built without the nvml feature; the pool keeps its static budget"
        ));
    }
    Err(format!("{device:?}: expected nvml:N or file:/path"))
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
    fn a_file_probe_reads_the_first_line_and_distrusts_garbage() {
        let path = std::env::temp_dir().join(format!("probe-{}", std::process::id()));
        let probe = device_probe(&format!("file:{}", path.display())).expect("a file probe");
        assert_eq!(probe.available(), None, "no file, no reading");
        std::fs::write(&path, "16000000000\n").expect("write");
        assert_eq!(probe.available(), Some(16_000_000_000));
        std::fs::write(&path, "lots").expect("write");
        assert_eq!(probe.available(), None);
        std::fs::write(&path, "100\n7 30\n8 5\n9 1\n").expect("write");
        assert_eq!(probe.used_by(&[7, 9]), Some(31), "per-process lines add up");
        let _ = std::fs::remove_file(path);
        assert!(device_probe("pci:0").is_err());
    }

    #[test]
    fn the_fake_reads_what_it_is_told() {
        let fake = FakeProbe::new(None);
        assert_eq!(fake.available(), None);
        fake.set(Some(42));
        assert_eq!(fake.available(), Some(42));
    }
}
