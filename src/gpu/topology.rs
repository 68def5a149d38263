//! Where the GPU sits, from NVML (loaded at run time; absent NVML is an answer, not an error):
//! PCIe link and NUMA node, and a way to run host allocations on the GPU's own CPUs so pinned
//! host pools are NUMA-local.

use nvml_wrapper::Nvml;

/// PCIe and NUMA facts of one GPU; `None` where NVML could not say.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Topology {
    /// Driver version NVML reports.
    pub driver: Option<String>,
    /// Current PCIe generation.
    pub pcie_gen: Option<u32>,
    /// Current PCIe link width (lanes).
    pub pcie_width: Option<u32>,
    /// Maximum PCIe generation of the link.
    pub pcie_max_gen: Option<u32>,
    /// Maximum PCIe link width.
    pub pcie_max_width: Option<u32>,
    /// NUMA node the GPU is attached to.
    pub numa_node: Option<u32>,
}

/// Asks NVML about the GPU at `pci_bus_id`; `Err` says why NVML could not be used at all.
pub fn topology(pci_bus_id: &str) -> Result<Topology, String> {
    let nvml = Nvml::init().map_err(|e| format!("NVML unavailable: {e}"))?;
    let device = nvml
        .device_by_pci_bus_id(pci_bus_id)
        .map_err(|e| format!("NVML has no device at {pci_bus_id}: {e}"))?;
    Ok(Topology {
        driver: nvml.sys_driver_version().ok(),
        pcie_gen: device.current_pcie_link_gen().ok(),
        pcie_width: device.current_pcie_link_width().ok(),
        pcie_max_gen: device.max_pcie_link_gen().ok(),
        pcie_max_width: device.max_pcie_link_width().ok(),
        numa_node: device.numa_node_id().ok(),
    })
}

/// Bytes of device memory NVML says are free on the GPU at `pci_bus_id` (`None` without NVML).
pub fn free_memory(pci_bus_id: &str) -> Option<u64> {
    let nvml = Nvml::init().ok()?;
    let device = nvml.device_by_pci_bus_id(pci_bus_id).ok()?;
    device.memory_info().ok().map(|m| m.free)
}

/// Runs `f` with the calling thread bound to the CPUs NVML says are closest to the GPU at
/// `pci_bus_id`, so memory `f` allocates and touches lands on the GPU's NUMA node (Linux first
/// touch). Without NVML, or where the binding fails, `f` runs unbound: placement is a
/// performance matter, never a correctness one.
pub fn on_gpu_numa_node<T>(pci_bus_id: &str, f: impl FnOnce() -> T) -> T {
    let Ok(nvml) = Nvml::init() else {
        return f();
    };
    let Ok(mut device) = nvml.device_by_pci_bus_id(pci_bus_id) else {
        return f();
    };
    if device.set_cpu_affinity().is_err() {
        return f();
    }
    let out = f();
    // A failure to unbind leaves the thread on the GPU's CPUs, which is harmless.
    let _ = device.clear_cpu_affinity();
    out
}
