//! A CUDA [`Stream`]: one kvshard owns, or one borrowed from the engine
//! ([`Gpu::borrow_stream`](super::Gpu::borrow_stream)).

use std::sync::Arc;

use cudarc::driver::{sys, CudaEvent, CudaStream};

use super::sync_count;
use crate::error::{Error, Result};

/// A CUDA stream: owned by kvshard, or borrowed from the engine.
#[derive(Debug, Clone)]
pub struct Stream {
    pub(super) inner: Arc<CudaStream>,
}

impl Stream {
    /// The raw handle, to pass to other libraries.
    pub fn raw(&self) -> sys::CUstream {
        self.inner.cu_stream()
    }

    /// The cudarc stream.
    pub fn cuda(&self) -> &Arc<CudaStream> {
        &self.inner
    }

    /// Blocks until all work enqueued so far has finished (counted in
    /// `backend::sync_counts`).
    pub fn synchronize(&self) -> Result<()> {
        sync_count::count_host_sync();
        self.inner
            .synchronize()
            .map_err(Error::driver("cuStreamSynchronize"))
    }

    /// Records `event` at this point of the stream.
    pub fn record(&self, event: &CudaEvent) -> Result<()> {
        event
            .record(&self.inner)
            .map_err(Error::driver("cuEventRecord"))
    }

    /// Makes later work on this stream wait for `event`.
    pub fn wait(&self, event: &CudaEvent) -> Result<()> {
        self.inner
            .wait(event)
            .map_err(Error::driver("cuStreamWaitEvent"))
    }

    /// Makes later work on this stream wait until the u32 at device address `addr` is at least
    /// `value` (wrapping comparison), without involving the host.
    ///
    /// # Safety
    /// `addr` must be a 4-byte aligned device address that stays valid until the wait is over.
    pub unsafe fn wait_value_geq(&self, addr: u64, value: u32) -> Result<()> {
        // SAFETY: the caller guarantees the address; the stream is live.
        unsafe {
            sys::cuStreamWaitValue32_v2(
                self.raw(),
                addr,
                value,
                sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32,
            )
        }
        .result()
        .map_err(Error::driver("cuStreamWaitValue32"))
    }
}
