//! What every pool (device pool, chunk staging, host pool) shares about tensors: keep-alives of
//! the engine memory it wraps, the DLPack devices and element types a component's tensors may
//! have, the element type its rows are exported as, and views of its memory.

use std::sync::Arc;

use dlpark::ffi::{DLDataType, DLDevice};
use pyo3::prelude::*;

use kvshard::backend::{Buffer, MemoryKind};
use kvshard::geometry::{ComponentLayout, LatentLayout};

use crate::device::PyDevice;
use crate::errors::IntoPy;
use crate::tensor::{KeepInner, PyTensorView};

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

/// Engine memory a pool wraps: the tensors, and their adoptions into a CPU arena.
#[derive(Default)]
pub struct PoolKeep {
    pub objects: Vec<Py<PyAny>>,
    pub buffers: Vec<Buffer>,
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
