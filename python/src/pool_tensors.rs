//! What every pool (device pool, chunk staging, host pool) shares about tensors: keep-alives of
//! the engine memory it wraps, and the claims on it (one memory, one usage record), the DLPack
//! devices and element types a component's tensors may have, the element type its rows are
//! exported as, and views of its memory.

use std::sync::{Arc, Mutex};

use dlpark::ffi::{DLDataType, DLDevice, DLDeviceType};
use pyo3::prelude::*;

use kvshard::backend::{Buffer, MemoryKind};
use kvshard::geometry::{ComponentLayout, LatentLayout};

use crate::device::PyDevice;
use crate::errors::{invalid, IntoPy};
use crate::lock::lock;
use crate::tensor::{device_name, Imported, KeepInner, PyTensorView};

/// A Python object as an `Arc<dyn Send + Sync>` keep-alive.
pub struct PyKeep(#[allow(dead_code)] pub Py<PyAny>);

/// The DLPack devices a tensor of `device` may be on.
pub fn dl_devices(device: &PyDevice, host: bool) -> Vec<DLDevice> {
    match device.gpu() {
        Some(g) if !host => vec![DLDevice::cuda(g.info().ordinal as i32)],
        Some(_) => vec![
            DLDevice::CPU,
            DLDevice {
                device_type: dlpark::ffi::DLDeviceType::CUDAHOST,
                device_id: 0,
            },
        ],
        None => vec![
            DLDevice::CPU,
            DLDevice {
                device_type: dlpark::ffi::DLDeviceType::CUDAHOST,
                device_id: 0,
            },
        ],
    }
}

/// Element sizes a component's tensors may have, and their names.
pub fn item_sizes(c: &ComponentLayout, latent: LatentLayout) -> (&'static [usize], &'static str) {
    if c.component.is_indexer() || latent != LatentLayout::Bf16 {
        (&[1], "uint8/int8/float8")
    } else {
        (&[2, 1], "bfloat16 (or uint8 bytes)")
    }
}

/// The element type kvshard exports a component's rows as: bytes, or bf16 for bf16 rows unless
/// `raw` (NumPy has no bfloat16).
pub fn export_dtype(c: &ComponentLayout, latent: LatentLayout, raw: bool) -> (DLDataType, usize) {
    if raw || c.component.is_indexer() || latent != LatentLayout::Bf16 {
        (DLDataType::U8, c.row_bytes)
    } else {
        (
            DLDataType::scalar(dlpark::ffi::DLDataTypeCode::BFLOAT, 16),
            c.row_bytes / 2,
        )
    }
}

/// Engine memory a pool wraps: the tensors, their adoptions into a CPU arena, and the ranges
/// it claims ([`PoolKeep::claim`], then [`PoolKeep::commit`]). Handed to the pool itself
/// (`keep_alive`), so it lives as long as the pool and the work queued on it.
#[derive(Default)]
pub struct PoolKeep {
    pub objects: Vec<Py<PyAny>>,
    pub buffers: Vec<Buffer>,
    ranges: Vec<Range>,
    claim: Option<Claim>,
}

impl PoolKeep {
    /// Records the memory of `t` (`what` names it in errors) as claimed by the pool being made.
    pub fn claim(&mut self, t: &Imported, what: &str) {
        self.ranges.push(Range {
            host: matches!(
                t.device.device_type,
                DLDeviceType::CPU | DLDeviceType::CUDAHOST
            ),
            device: t.device,
            start: t.ptr,
            end: t.ptr.saturating_add(t.nbytes as u64),
            what: what.to_string(),
        });
    }

    /// Claims every recorded range, before the pool is made: refused, with nothing claimed,
    /// when two of them overlap (one tensor, or views of one buffer, as two layers) or one
    /// overlaps memory a live kvshard object wraps (or whose work is still queued).
    pub fn commit(&mut self) -> PyResult<()> {
        let ranges = std::mem::take(&mut self.ranges);
        self.claim = Some(Claim::take(ranges)?);
        Ok(())
    }
}

/// One claimed range of engine memory.
struct Range {
    /// Host memory (CPU and pinned tensors share the host's addresses), else `device`'s.
    host: bool,
    device: DLDevice,
    start: u64,
    end: u64,
    what: String,
}

impl Range {
    fn meets(&self, other: &Range) -> bool {
        self.host == other.host
            && (self.host || self.device == other.device)
            && self.start < other.end
            && other.start < self.end
    }

    fn describe(&self) -> String {
        format!(
            "{} ({:#x}..{:#x} on {})",
            self.what,
            self.start,
            self.end,
            if self.host {
                "the host".to_string()
            } else {
                device_name(self.device)
            }
        )
    }
}

/// Memory wrapped by live kvshard objects, by claim: a memory wrapped twice would get two usage
/// records, and kvshard could not order the work queued through one after the other's.
static CLAIMED: Mutex<Vec<(u64, Range)>> = Mutex::new(Vec::new());
static NEXT_CLAIM: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Ranges claimed by one pool, given back when it (and the work queued on it) is gone.
struct Claim(u64);

impl Claim {
    fn take(ranges: Vec<Range>) -> PyResult<Claim> {
        let mut claimed = lock(&CLAIMED);
        for (i, r) in ranges.iter().enumerate() {
            if let Some(other) = ranges[..i].iter().find(|o| o.meets(r)) {
                return Err(invalid(format!(
                    "{} overlaps {}: one memory wrapped twice would get two usage records; pass \
                     distinct memory for each buffer",
                    r.describe(),
                    other.describe()
                )));
            }
            if let Some((_, other)) = claimed.iter().find(|(_, o)| o.meets(r)) {
                return Err(invalid(format!(
                    "{} overlaps memory another kvshard pool wraps: {}. One memory wrapped twice \
                     would get two usage records, and kvshard could not order the work queued \
                     through one after the other's; wrap it once and share that pool (a pool \
                     dropped with work still queued holds its memory until the work has run)",
                    r.describe(),
                    other.describe()
                )));
            }
        }
        let id = NEXT_CLAIM.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        claimed.extend(ranges.into_iter().map(|r| (id, r)));
        Ok(Claim(id))
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        lock(&CLAIMED).retain(|(id, _)| *id != self.0);
    }
}

/// A view of `bytes` bytes at `addr` of `device`'s space (a CPU arena address is turned into
/// its host address), kept alive by `owner`.
pub fn view_of(
    d: &PyDevice,
    addr: u64,
    bytes: usize,
    host: bool,
    dtype: DLDataType,
    shape: Vec<i64>,
    owner: Py<PyAny>,
) -> PyResult<PyTensorView> {
    let (ptr, device) = match (d.cpu(), d.gpu()) {
        (Some(cpu), _) => {
            // SAFETY: only used to look the range up in the arena (no access through it).
            let b = unsafe { Buffer::from_raw(addr, bytes, MemoryKind::Device, d.space()) };
            (cpu.host_ptr(&b).py_err()? as u64, DLDevice::CPU)
        }
        (None, Some(g)) if !host => (addr, DLDevice::cuda(g.info().ordinal as i32)),
        // Host memory goes out as plain CPU memory (torch and NumPy import kDLCPU; torch
        // refuses kDLCUDAHost), addressed by its host address.
        (None, _) => (addr, DLDevice::CPU),
    };
    let keep = Arc::new(KeepInner {
        buffer: None,
        objects: vec![owner],
    });
    // SAFETY: `bytes` bytes at `ptr` belong to the object `owner` keeps alive (a pool, a
    // staging, a host pool), and `shape` spans exactly them (callers build it from the same
    // sizes).
    Ok(unsafe { PyTensorView::contiguous(ptr, device, dtype, shape, keep) })
}
