//! The CPU twin's memory: an arena per backend, in an address window of its own, holding
//! zeroed allocations or memory adopted from elsewhere (another process's shared memory, an
//! engine's arrays), with unmapped gaps between them so an out-of-bounds access is an error.

use std::collections::BTreeMap;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use crate::abi;
use crate::backend::MemoryKind;
use crate::error::{Error, Result};

/// First address of the first arena; every arena owns a window of [`ARENA_SPAN`] addresses, and
/// allocations inside it are 256-byte aligned with unmapped gaps between them, so an
/// out-of-bounds access is an error here just as it would be a fault on the GPU.
pub(super) const BASE: u64 = 0x1000_0000_0000;
pub(super) const ARENA_SPAN: u64 = 1 << 46;
/// Windows fit below 2^63 (addresses stay positive as int64); arenas beyond this many reuse
/// windows, which is harmless because buffers are matched to arenas by id, not by address.
pub(super) const WINDOWS: u64 = ((1 << 63) - BASE) / ARENA_SPAN;
pub(super) const GAP: u64 = 64 << 10;

pub(super) static NEXT_ARENA: AtomicU64 = AtomicU64::new(0);

/// Bytes an allocation can hold: kvshard's own zeroed heap memory, or memory mapped from
/// elsewhere (shared memory another process exported).
pub(crate) trait HostBytes: Send {
    fn bytes(&self) -> &[u8];
    fn bytes_mut(&mut self) -> &mut [u8];
}

impl HostBytes for Box<[u8]> {
    fn bytes(&self) -> &[u8] {
        self
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        self
    }
}

/// Memory the caller owns, adopted into an arena ([`CpuBackend::adopt`]).
pub(super) struct Adopted {
    pub(super) ptr: *mut u8,
    pub(super) len: usize,
    pub(super) _keep: Arc<dyn Send + Sync>,
}

// SAFETY: the memory is the caller's, who promised (`CpuBackend::adopt`) it stays valid until
// `_keep` is dropped and is not touched concurrently with the arena's work; the arena only
// reaches it under its lock.
unsafe impl Send for Adopted {}

impl HostBytes for Adopted {
    fn bytes(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: `len` valid bytes at `ptr` while `_keep` lives (the adopt contract).
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        if self.len == 0 {
            return &mut [];
        }
        // SAFETY: as `bytes`, and writable; `&mut self` is the arena's only access path.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

/// `len` zeroed bytes, or [`Error::OutOfMemory`]: the allocation is asked of the allocator
/// fallibly and zeroed by it (calloc: fresh pages are not touched until used).
pub(super) fn zeroed(len: usize, kind: MemoryKind) -> Result<Box<[u8]>> {
    let oom = || Error::OutOfMemory {
        what: "a CPU backend allocation".into(),
        bytes: len as u64,
        memory: memory_name(kind),
    };
    if len == 0 {
        return Ok(Box::new([]));
    }
    let layout = std::alloc::Layout::array::<u8>(len).map_err(|_| oom())?;
    // SAFETY: the layout has a non-zero size.
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
    if ptr.is_null() {
        return Err(oom());
    }
    // SAFETY: `ptr` is a zeroed allocation of the global allocator with the layout of a
    // `[u8; len]`, owned by nothing else: exactly what a boxed slice of `len` bytes is.
    Ok(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(ptr, len)) })
}

pub(super) fn memory_name(kind: MemoryKind) -> &'static str {
    match kind {
        MemoryKind::Device => "device",
        MemoryKind::PinnedHost => "pinned host",
    }
}

/// Bytes of memory the machine has, as the OS reports it (`None` when it cannot be read).
pub(super) fn machine_memory() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

pub(super) struct Arena {
    pub(super) id: u64,
    pub(super) allocs: BTreeMap<u64, Box<dyn HostBytes>>,
    pub(super) next: u64,
    /// Bytes currently allocated, and the most the machine can hold.
    pub(super) used: u64,
    pub(super) limit: u64,
}

impl Arena {
    pub(super) fn locate(&self, addr: u64, len: usize) -> Result<(u64, usize)> {
        if let Some((&base, bytes)) = self.allocs.range(..=addr).next_back() {
            let offset = (addr - base) as usize;
            if offset
                .checked_add(len)
                .is_some_and(|end| end <= bytes.bytes().len())
            {
                return Ok((base, offset));
            }
        }
        Err(Error::InvalidArgument(format!(
            "CPU backend: [{addr:#x}, +{len}) is not inside one allocation of arena {}",
            self.id
        )))
    }

    pub(super) fn bytes(&self, addr: u64, len: usize) -> Result<&[u8]> {
        let (base, offset) = self.locate(addr, len)?;
        Ok(&self.allocs[&base].bytes()[offset..offset + len])
    }

    pub(super) fn bytes_mut(&mut self, addr: u64, len: usize) -> Result<&mut [u8]> {
        let (base, offset) = self.locate(addr, len)?;
        let alloc = self
            .allocs
            .get_mut(&base)
            .ok_or_else(|| Error::InvalidArgument(format!("allocation {base:#x} vanished")))?;
        Ok(&mut alloc.bytes_mut()[offset..offset + len])
    }

    pub(super) fn copy(&mut self, dst: u64, src: u64, len: usize) -> Result<()> {
        let data = self.bytes(src, len)?.to_vec();
        self.bytes_mut(dst, len)?.copy_from_slice(&data);
        Ok(())
    }

    pub(super) fn i64_at(&self, addr: u64) -> Result<i64> {
        let b = self.bytes(addr, 8)?;
        Ok(i64::from_le_bytes([
            b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7],
        ]))
    }

    pub(super) fn u64_at(&self, addr: u64) -> Result<u64> {
        Ok(self.i64_at(addr)? as u64)
    }

    pub(super) fn u32_at(&self, addr: u64) -> Result<u32> {
        let b = self.bytes(addr, 4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    pub(super) fn set_u64(&mut self, addr: u64, v: u64) -> Result<()> {
        self.bytes_mut(addr, 8)?.copy_from_slice(&v.to_le_bytes());
        Ok(())
    }

    pub(super) fn pair(&self, addr: u64, k: u64) -> Result<abi::kvs_layer_pair> {
        let at = addr + 24 * k;
        Ok(abi::kvs_layer_pair {
            src: self.u64_at(at)?,
            dst: self.u64_at(at + 8)?,
            component: self.u32_at(at + 16)?,
            signal: self.u32_at(at + 20)?,
        })
    }

    /// Takes `len` bytes in this arena's window, held by `bytes`.
    pub(super) fn insert(&mut self, len: usize, bytes: Box<dyn HostBytes>) -> Result<u64> {
        let base = self.next;
        let next = base
            .checked_add(len as u64)
            .and_then(|e| e.checked_add(GAP))
            .map(|e| e.next_multiple_of(256))
            .filter(|&e| e <= window_start(self.id) + ARENA_SPAN)
            .ok_or_else(|| Error::OutOfMemory {
                what: format!("CPU backend arena {} (its address window is full)", self.id),
                bytes: len as u64,
                memory: "host",
            })?;
        self.next = next;
        self.used += len as u64;
        self.allocs.insert(base, bytes);
        Ok(base)
    }
}

pub(super) fn window_start(arena: u64) -> u64 {
    BASE + (arena % WINDOWS) * ARENA_SPAN
}
