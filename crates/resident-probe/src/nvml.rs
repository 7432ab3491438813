//! GPU memory through NVML (feature `nvml`). nvml-wrapper loads
//! libnvidia-ml at run time, so this builds everywhere and fails, with a
//! clear error, only where no NVIDIA driver is installed.

use parking_lot::Mutex;

use nvml_wrapper::Nvml;

use crate::MemoryProbe;

/// Free memory of one GPU.
pub struct NvmlProbe {
    nvml: Mutex<Nvml>,
    index: u32,
}

impl std::fmt::Debug for NvmlProbe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NvmlProbe {{ index: {} }}", self.index)
    }
}

impl NvmlProbe {
    /// A probe of GPU `index`; checks once that the device answers.
    pub fn new(index: u32) -> Result<Self, String> {
        let nvml = Nvml::init().map_err(|e| format!("GPU {index}: NVML is not available: {e}"))?;
        nvml.device_by_index(index)
            .map_err(|e| format!("GPU {index}: {e}"))?;
        Ok(Self {
            nvml: Mutex::new(nvml),
            index,
        })
    }

    /// GPU memory used by `pids` (the processes NVML lists as running
    /// compute or graphics work on this device).
    fn used(&self, pids: &[u32]) -> u64 {
        let nvml = self.nvml.lock();
        let Ok(device) = nvml.device_by_index(self.index) else {
            return 0;
        };
        let mut total = 0u64;
        for list in [
            device.running_compute_processes(),
            device.running_graphics_processes(),
        ] {
            for p in list.unwrap_or_default() {
                if pids.contains(&p.pid)
                    && let nvml_wrapper::enums::device::UsedGpuMemory::Used(bytes) =
                        p.used_gpu_memory
                {
                    total = total.saturating_add(bytes);
                }
            }
        }
        total
    }
}

impl MemoryProbe for NvmlProbe {
    fn used_by(&self, pids: &[u32]) -> Option<u64> {
        Some(self.used(pids))
    }

    fn available(&self) -> Option<u64> {
        let nvml = self.nvml.lock();
        let device = nvml.device_by_index(self.index).ok()?;
        device.memory_info().ok().map(|m| m.free)
    }
}
