//! Allocations of the CPU twin: zeroed memory or adopted bytes placed in an arena's window, held
//! by the buffers that share them and removed from the arena when the last one goes.

use std::sync::{Arc, Mutex, Weak};

use super::arena::{memory_name, zeroed, HostBytes};
use super::streams::Device;
use crate::backend::{AddressSpace, Buffer, MemoryKind};
use crate::error::{Error, Result};
use crate::lock::lock;

/// Frees its allocation from the arena when the last buffer sharing it is dropped.
pub(super) struct CpuAllocation {
    pub(super) device: Weak<Mutex<Device>>,
    pub(super) base: u64,
    pub(super) len: u64,
}

impl Drop for CpuAllocation {
    fn drop(&mut self) {
        if let Some(device) = self.device.upgrade() {
            // Runs nothing: the allocation's usage (`super::usage`) drops this only once the
            // work kvshard queued on it has run. Work queued on it without its usage being told
            // meets a missing allocation and fails, where a GPU would read freed memory.
            let mut d = lock(&device);
            if d.arena.allocs.remove(&self.base).is_some() {
                d.arena.used -= self.len;
            }
        }
    }
}

pub(super) fn alloc_in(
    device: &Arc<Mutex<Device>>,
    len: usize,
    kind: MemoryKind,
    arena: u64,
) -> Result<Buffer> {
    {
        let d = lock(device);
        if d.arena.used.saturating_add(len as u64) > d.arena.limit {
            return Err(Error::OutOfMemory {
                what: format!(
                    "a CPU backend allocation ({} bytes already held, the machine has {})",
                    d.arena.used, d.arena.limit
                ),
                bytes: len as u64,
                memory: memory_name(kind),
            });
        }
    }
    adopt_in(device, Box::new(zeroed(len, kind)?), kind, arena)
}

/// Places `bytes` in the arena's window and returns them as a buffer that removes (and drops)
/// them when its last share goes.
pub(super) fn adopt_in(
    device: &Arc<Mutex<Device>>,
    bytes: Box<dyn HostBytes>,
    kind: MemoryKind,
    arena: u64,
) -> Result<Buffer> {
    let len = bytes.bytes().len();
    let base = lock(device).arena.insert(len, bytes)?;
    let owner = Arc::new(CpuAllocation {
        device: Arc::downgrade(device),
        base,
        len: len as u64,
    });
    Ok(Buffer::owned(
        base,
        len,
        kind,
        AddressSpace::Cpu(arena),
        owner,
    ))
}
