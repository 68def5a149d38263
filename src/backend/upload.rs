//! int64s onto the device: their little-endian bytes, a set-up upload into a new buffer, and the
//! per-call uploads of `_sync` calls (a checked write's slots, a checked quantizer's rows)
//! without an allocation and a free per call: one device buffer per address space, lent to one
//! call at a time and grown when too small.
//!
//! Reuse is safe across streams: the lent buffer's usage records the launch that reads it, so
//! the next call's upload (an ordered write) waits for that launch on the device.

use std::collections::HashMap;
use std::sync::Mutex;

use super::{AddressSpace, Backend, Buffer, MemoryKind};
use crate::error::{Checked, Error, Result};
use crate::lock::lock;

static SPARE: Mutex<Option<HashMap<AddressSpace, Buffer>>> = Mutex::new(None);

fn spare() -> std::sync::MutexGuard<'static, Option<HashMap<AddressSpace, Buffer>>> {
    lock(&SPARE)
}

/// A device buffer holding uploaded int64s, lent until dropped.
#[derive(Debug)]
pub(crate) struct Upload(Buffer);

impl Upload {
    /// The buffer (at least as long as the values uploaded).
    pub(crate) fn buffer(&self) -> &Buffer {
        &self.0
    }
}

impl Drop for Upload {
    fn drop(&mut self) {
        let b = self.0.clone();
        let mut spare = spare();
        let map = spare.get_or_insert_with(HashMap::new);
        // Keep the larger of two buffers returned for one address space.
        if map.get(&b.space()).is_none_or(|old| old.len() < b.len()) {
            map.insert(b.space(), b);
        }
    }
}

/// Uploads `values` through `backend` into the spare buffer of its address space (or a new
/// one, when there is none or it is too small), waiting for the upload.
pub(crate) fn upload_reused_sync(backend: &dyn Backend, values: &[i64]) -> Result<Upload> {
    let bytes = values
        .len()
        .mul_or(8, || format!("bytes of {} int64s", values.len()))?
        .max(8);
    let reused = spare()
        .as_mut()
        .and_then(|m| m.remove(&backend.address_space()))
        .filter(|b| b.len() >= bytes);
    let buffer = match reused {
        Some(b) => b,
        None => backend.alloc(bytes.next_power_of_two(), MemoryKind::Device)?,
    };
    backend.write_sync(&buffer, 0, &i64s_to_bytes(values))?;
    Ok(Upload(buffer))
}

/// Reads little-endian i64s from bytes.
pub fn i64s_from_bytes(bytes: &[u8]) -> Vec<i64> {
    bytes
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
        .collect()
}

/// Little-endian bytes of i64s.
pub fn i64s_to_bytes(values: &[i64]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// Enqueues `values` as little-endian int64s at the start of `dst` on `backend`'s stream, without
/// waiting: ordered by `dst`'s usage record after the work queued on it on any stream (a launch
/// still reading the previous values, say), and `values` staged when this returns. How an
/// engine puts a chunk's slot indices, or a quantizer's rows, on the device for the calls that
/// only enqueue ([`OwnedRowWrite::run`](crate::pool::OwnedRowWrite::run),
/// [`quantize_latent`](crate::quantize::quantize_latent)): one buffer, rewritten every chunk.
/// A buffer of another address space, or too short, is refused and nothing is enqueued.
pub fn enqueue_i64s(backend: &dyn Backend, dst: &Buffer, values: &[i64]) -> Result<()> {
    let bytes = values
        .len()
        .mul_or(8, || format!("bytes of {} int64s", values.len()))?;
    backend.check(dst, "int64 destination")?;
    if dst.len() < bytes {
        return Err(Error::InvalidArgument(format!(
            "{} int64s into a buffer of {} bytes",
            values.len(),
            dst.len()
        )));
    }
    backend.enqueue_write(dst, 0, &i64s_to_bytes(values))
}

/// Uploads `values` into a new device buffer of `backend`, waiting for the copy (its one use
/// is set-up: per-call uploads go through a reused table, see `copy::TableStore`).
pub fn upload_i64s_sync(backend: &dyn Backend, values: &[i64]) -> Result<Buffer> {
    let bytes = crate::error::Checked::mul_or(values.len(), 8, || {
        format!("bytes of {} int64s", values.len())
    })?;
    let buf = backend.alloc(bytes, MemoryKind::Device)?;
    backend.write_sync(&buf, 0, &i64s_to_bytes(values))?;
    Ok(buf)
}
