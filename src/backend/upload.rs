//! Per-call uploads of `_sync` calls (a checked write's slots, a checked quantizer's rows)
//! without an allocation and a free per call: one device buffer per address space, lent to one
//! call at a time and grown when too small.
//!
//! Reuse is safe across streams: the lent buffer's usage records the launch that reads it, so
//! the next call's upload (an ordered write) waits for that launch on the device.

use std::collections::HashMap;
use std::sync::Mutex;

use super::{i64s_to_bytes, AddressSpace, Backend, Buffer, MemoryKind};
use crate::error::{Checked, Result};
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
pub(crate) fn upload_i64s_sync(backend: &dyn Backend, values: &[i64]) -> Result<Upload> {
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
