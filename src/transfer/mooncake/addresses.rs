//! Memory as a transfer engine registers and addresses it: device addresses on a GPU, process
//! (host) addresses on the CPU twin, whose arena addresses no engine knows.

use std::sync::Arc;

use crate::backend::cpu::CpuBackend;
use crate::copy::BlockSpace;
use crate::error::{Error, Result};
use crate::pool::DevicePool;

/// How kvshard's addresses of one device translate into the addresses a transfer engine
/// registers and moves.
#[derive(Debug, Clone)]
pub enum EngineAddresses {
    /// A GPU: the engine moves device addresses as they are.
    Device,
    /// The CPU twin: its arena's addresses become the host addresses of its allocations
    /// ([`CpuBackend::host_address`]).
    Cpu(Arc<CpuBackend>),
}

impl EngineAddresses {
    /// The engine's address of `[addr, addr + len)` of this device's memory. On the CPU twin
    /// the range must lie in one live allocation.
    pub fn address(&self, addr: u64, len: u64) -> Result<u64> {
        match self {
            Self::Device => Ok(addr),
            Self::Cpu(b) => {
                let len = usize::try_from(len)
                    .map_err(|_| Error::InvalidArgument(format!("{len} bytes at {addr:#x}")))?;
                Ok(b.host_address(addr, len)? as u64)
            }
        }
    }
}

/// What [`pool_memory`] returns: the regions to register, `[(address, bytes)]`, and the base
/// of every stored layer of every component, `bases[c][l]`.
pub type PoolMemory = (Vec<(u64, u64)>, Vec<Vec<u64>>);

/// The regions of `pool` an engine registers once, `[(address, bytes)]` sorted with adjacent
/// layers merged, and the base of every stored layer of every component (`bases[c][l]`, in
/// `geometry.components()` order): what a decode side publishes to its prefill ranks.
pub fn pool_memory(pool: &DevicePool, addresses: &EngineAddresses) -> Result<PoolMemory> {
    let mut ranges = Vec::new();
    let mut bases = Vec::new();
    for c in pool.geometry().components() {
        let bytes = BlockSpace::pages(pool)
            .checked_mul(c.block_bytes as u64)
            .ok_or_else(|| Error::overflow(format!("bytes of a layer of {}", c.component)))?;
        let mut layers = Vec::new();
        for &base in pool.layer_bases(c.component)? {
            let at = addresses.address(base, bytes)?;
            layers.push(at);
            ranges.push((at, bytes));
        }
        bases.push(layers);
    }
    Ok((merged(ranges), bases))
}

/// `ranges` sorted, overlapping or adjacent ones merged (saturating at the top of the address
/// space rather than wrapping).
pub fn merged(mut ranges: Vec<(u64, u64)>) -> Vec<(u64, u64)> {
    ranges.sort_unstable();
    let mut out: Vec<(u64, u64)> = Vec::new();
    for (addr, len) in ranges {
        let end = addr.saturating_add(len);
        match out.last_mut() {
            Some((a, l)) if a.saturating_add(*l) >= addr => {
                *l = end.max(a.saturating_add(*l)) - *a;
            }
            _ => out.push((addr, len)),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_merge_when_they_touch_or_overlap() {
        assert_eq!(
            merged(vec![(100, 10), (0, 10), (10, 5), (12, 1), (200, 1)]),
            vec![(0, 15), (100, 10), (200, 1)]
        );
        assert_eq!(merged(vec![(u64::MAX - 1, 5), (u64::MAX - 3, 2)]).len(), 1);
        assert!(merged(Vec::new()).is_empty());
    }
}
